// expect: idem::outbox: this store's transaction has no add_outbox
// Writing an outbox intent through a transaction that cannot store one is refused by name.
#include <string>

#include "idem/idem.hpp"
#include "idem/store/memory.hpp"

struct TransactionWithoutOutbox {};

int main() {
#ifdef IDEM_COMPILE_FAIL
    TransactionWithoutOutbox tx;
#else
    idem::MemoryStore store;
    auto tx = store.begin();
#endif
    return idem::outbox(tx, "rail", "wire-1", "payload") ? 0 : 1;
}
