// expect: idem: the effect must return void or idem::EffectResult
// An effect returning something else (here a bool "success" flag) is refused: success is not
// a value the handler could act on; refusals are EffectResult, failures are exceptions.
#include <string>

#include "idem/idem.hpp"
#include "idem/store/memory.hpp"

int main() {
    idem::MemoryStore store;
#ifdef IDEM_COMPILE_FAIL
    auto effect = [](auto&, const std::string&) { return true; };
#else
    auto effect = [](auto&, const std::string&) { return idem::EffectResult::applied(); };
#endif
    auto handler = idem::make_handler(store, idem::Policy{"x"}, effect);
    return handler.handle(idem::Delivery{"m", 1u}, std::string("b")).disposition ==
                   idem::Disposition::processed
               ? 0
               : 1;
}
