// expect: duplicate_transition_with_different_targets
// A constexpr StateMachine whose table sends one (from, on) pair to two different states must
// not compile: the check reaches a non-constexpr function, and the compiler's error names it.
#include "idem/state_machine.hpp"

enum class State { authorised, captured, voided };
enum class Event { capture };

int main() {
#ifdef IDEM_COMPILE_FAIL
    constexpr idem::StateMachine flow{
        idem::Transition{State::authorised, Event::capture, State::captured},
        idem::Transition{State::authorised, Event::capture, State::voided}};
#else
    constexpr idem::StateMachine flow{
        idem::Transition{State::authorised, Event::capture, State::captured},
        idem::Transition{State::captured, Event::capture, State::captured}};
#endif
    return flow.size() == 2 ? 0 : 1;
}
