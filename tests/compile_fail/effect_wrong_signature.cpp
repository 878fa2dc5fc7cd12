// expect: idem: the effect must be callable as effect\(Transaction&, const Body&\)
// An effect that does not take the transaction is refused with a message saying what fits.
#include <string>

#include "idem/idem.hpp"
#include "idem/store/memory.hpp"

int main() {
    idem::MemoryStore store;
#ifdef IDEM_COMPILE_FAIL
    auto effect = [](const std::string&) {};
#else
    auto effect = [](auto&, const std::string&) {};
#endif
    auto handler = idem::make_handler(store, idem::Policy{"x"}, effect);
    return handler.handle(idem::Delivery{"m", 1u}, std::string("b")).disposition ==
                   idem::Disposition::processed
               ? 0
               : 1;
}
