// Doc-test wrapper `metrics_handlers`: the block builds handlers with a PrometheusObserver; the
// function has a store (MemoryStore), two effects, a broker consumer's options (a
// RedisStreamConsumer's), a circuit breaker and the numbers the user's loop reads. doctest_run()
// then checks the gauges set.
#include <idem/broker/circuit_breaker.hpp>
#include <idem/broker/redis_streams.hpp>
#include <idem/idem.hpp>
#include <idem/observers/prometheus.hpp>
#include <idem/store/memory.hpp>

#include <cstdint>
#include <string>

inline void doctest_run() {
    idem::MemoryStore store;
    auto capture_effect = [](auto& tx, const std::string& order) {
        tx.put("captures", order, "1");
    };
    auto refund_effect = [](auto& tx, const std::string& order) { tx.put("refunds", order, "1"); };
    idem::RedisStreamConsumerOptions consumer_options;
    idem::CircuitBreaker breaker{{}, [] {}};
    std::uint64_t pending = 3;
    std::uint64_t dead_letter_depth = 0;
    // @block
    capture.handle(idem::Delivery{"m-1", 1u}, std::string("8814"));
    refund.handle(idem::Delivery{"m-2", 1u}, std::string("8814"));
    const std::string text = metrics.render();
    IDEM_DOCTEST_CHECK(
        text.find(R"(idem_deliveries_total{scope="capture",disposition="processed"} 1)") !=
        std::string::npos);
    IDEM_DOCTEST_CHECK(text.find(R"(idem_circuit_open{consumer="capture-worker"} 0)") !=
                       std::string::npos);
    IDEM_DOCTEST_CHECK(text.find(R"(idem_pending{consumer="capture-worker"} 3)") !=
                       std::string::npos);
    IDEM_DOCTEST_CHECK(text.find(R"(idem_dead_letter_depth{stream="payments"} 0)") !=
                       std::string::npos);
}
