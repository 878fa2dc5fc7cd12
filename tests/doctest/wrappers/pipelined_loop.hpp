// Doc-test wrapper `pipelined_loop`: the block is the body of a function that has a handler on a
// RedisStore (`capture`) and the user's own reading, waiting and acking. Compiled only: it needs
// a server, and loops forever.
#include <idem/idem.hpp>
#include <idem/store/redis.hpp>

#include <string>
#include <vector>

struct Entry {
    idem::Delivery delivery;
    std::string body;
    std::string id;
};
inline std::vector<Entry> read_without_blocking() {
    return {};
}
inline void wait_for_entries() {}
template <class Settled>
void ack(const Settled& /*settled*/) {}

inline void doctest_run() {
    idem::RedisStore store{idem::RedisEndpoint{"127.0.0.1", 6379}};
    auto capture =
        idem::make_handler(store, idem::Policy{"capture"}, [](auto& tx, const std::string& order) {
            tx.write("HSET", "captures", order, "captured");
        });
    // @block
}
