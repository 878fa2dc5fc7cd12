// expect: (conflicting declaration|redefinition)
// needs: redis
// A broker never includes a store header (docs/architecture.md, "Which part may include which"):
// idem/broker/redis_streams.hpp brings in no store, so idem::RedisStore (or any other store) is
// not declared after including it, and this file may declare those names as something else. Had
// the header included idem/store/redis.hpp (as it did before the commit hook), the alias below
// would conflict with the class. The failing variant includes the store to prove the check bites.
#include "idem/broker/redis_streams.hpp"
#ifdef IDEM_COMPILE_FAIL
#include "idem/store/redis.hpp"
#endif

IDEM_BEGIN_NAMESPACE
using RedisStore = int;
using SqliteStore = int;
using PostgresStore = int;
using MemoryStore = int;
IDEM_END_NAMESPACE

int main() {
    idem::RedisStore not_a_store = 0;
    idem::RedisStreamConsumerOptions options;  // the broker's own names are there
    options.stream = "orders";
    return not_a_store + static_cast<int>(options.stream.size()) - 6;
}
