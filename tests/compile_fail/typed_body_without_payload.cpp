// expect: would keep nothing: define std::string idem_payload.*idem::keep_no_payload\(effect\)
// A typed body without idem_payload() would leave its dead letters empty: refused, naming the
// two ways out (define idem_payload, or wrap the effect in idem::keep_no_payload).
#include "idem/idem.hpp"
#include "idem/store/memory.hpp"

namespace app {
struct Tick {
    int n;
};
}  // namespace app

int main() {
    idem::MemoryStore store;
    auto effect = [](auto&, const app::Tick&) {};
#ifdef IDEM_COMPILE_FAIL
    auto handler = idem::make_handler(store, idem::Policy{"tick"}, effect);
#else
    auto handler = idem::make_handler(store, idem::Policy{"tick"}, idem::keep_no_payload(effect));
#endif
    return handler.handle(idem::Delivery{"m", 1u}, app::Tick{1}).disposition ==
                   idem::Disposition::processed
               ? 0
               : 1;
}
