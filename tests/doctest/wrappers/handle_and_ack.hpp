// Doc-test wrapper `handle_and_ack`: the block is one step of a consumer loop, run for a
// delivery and its redelivery on a MemoryStore handler; both are acked, the effect runs once.
#include <idem/idem.hpp>
#include <idem/store/memory.hpp>

#include <cstdint>
#include <string>
#include <vector>

struct Consumer {
    std::vector<std::string> acked;
    void ack(const std::string& message) { acked.push_back(message); }
};

inline void doctest_run() {
    idem::MemoryStore store;
    auto handler = idem::make_handler(
        store, idem::Policy{"capture"},
        [](auto& tx, const std::string& body) { tx.put("captures", body, "captured"); });
    Consumer consumer;
    const std::string id = "m-1", body = "order 8814", msg = id;
    for (std::uint32_t delivery_count = 1; delivery_count <= 2; ++delivery_count) {
        // @block
    }
    IDEM_DOCTEST_CHECK(consumer.acked.size() == 2);  // processed, then its duplicate
    IDEM_DOCTEST_CHECK(handler.counters().processed == 1);
    IDEM_DOCTEST_CHECK(handler.counters().duplicates == 1);
}
