// expect: idem: Store's transaction must provide claim
// A store whose transaction has no claim() is refused with a message naming the member.
#include <string>

#include "idem/idem.hpp"
#include "idem/store/memory.hpp"

struct StoreWithoutClaim {
    struct Transaction {
        void record_outcome(std::string_view, std::string_view, idem::Disposition,
                            std::string_view) {}
        void dead_letter(const idem::DeadLetter&) {}
        void savepoint() {}
        void rollback_to_savepoint() {}
        void release_savepoint() {}
        void commit() {}
    };
    Transaction begin() { return {}; }
};

int main() {
#ifdef IDEM_COMPILE_FAIL
    StoreWithoutClaim store;
#else
    idem::MemoryStore store;
#endif
    auto handler = idem::make_handler(store, idem::Policy{"x"}, [](auto&, const std::string&) {});
    return handler.handle(idem::Delivery{"m", 1u}, std::string("b")).disposition ==
                   idem::Disposition::processed
               ? 0
               : 1;
}
