// expect: initial_state_without_transition
// A constexpr StateMachine whose declared initial state has no transition from it (no event
// could create an entity) must not compile: the check reaches a non-constexpr function, and the
// compiler's error names it.
#include "idem/state_machine.hpp"

enum class State { none, authorised, captured };
enum class Event { authorise, capture };

int main() {
#ifdef IDEM_COMPILE_FAIL
    constexpr idem::StateMachine flow{
        idem::Initial{State::none},
        idem::Transition{State::authorised, Event::capture, State::captured}};
#else
    constexpr idem::StateMachine flow{
        idem::Initial{State::none},
        idem::Transition{State::none, Event::authorise, State::authorised},
        idem::Transition{State::authorised, Event::capture, State::captured}};
#endif
    return flow.size() == 2 ? 0 : 1;
}
