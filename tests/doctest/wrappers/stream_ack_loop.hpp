// Doc-test wrapper `stream_ack_loop`: the block is a step of the user's own loop over a Redis
// stream, with a handler on a RedisStore (as `handler` and `capture`), the endpoint (as
// `endpoint` and `redis`), the entry read, its delivery and the loop's own xack(). Compiled
// only: it needs a server.
#include <idem/broker/redis_streams.hpp>
#include <idem/store/redis.hpp>

#include <string>

inline void xack(const std::string& /*entry_id*/) {}

inline void doctest_run() {
    const idem::RedisEndpoint endpoint{"127.0.0.1", 6379};
    const idem::RedisEndpoint& redis = endpoint;
    idem::RedisStore store{endpoint};
    auto handler = idem::make_handler(store, idem::Policy{"capture"},
                                      [](auto& tx, const idem::StreamEntry& entry) {
                                          tx.write("HSET", "captures", entry.id, "captured");
                                      });
    auto& capture = handler;
    const idem::StreamEntry entry{"orders", "1700000000000-0", {{"order_id", "8814"}}};
    const idem::Delivery delivery{entry.id, 1u};
    // @block
}
