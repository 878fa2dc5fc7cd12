// Doc-test wrapper `sentinel`: the block is the body of a function that has a stream consumer's
// options and an effect on stream entries. Compiled only: it needs Sentinels.
#include <idem/broker/redis_streams.hpp>
#include <idem/idem.hpp>
#include <idem/store/redis.hpp>

inline void doctest_run() {
    idem::RedisStreamConsumerOptions consumer_options;
    consumer_options.stream = "orders";
    consumer_options.group = "capture";
    consumer_options.consumer = "worker-1";
    auto capture_effect = [](auto& tx, const idem::StreamEntry& entry) {
        tx.write("HSET", "captures", entry.id, "captured");
    };
    // @block
}
