// Doc-test wrapper `stored_offsets`: the block handles one Kafka-like record with a StoredOffset
// commit hook on a MemoryStore; doctest_run() then checks the stored position, and that a
// redelivery (a duplicate) leaves it where it is.
#include <idem/idem.hpp>
#include <idem/store/memory.hpp>

#include <cstdint>
#include <string>

struct DoctestRecord {
    std::string key() const { return "order-7"; }
    std::int64_t offset() const { return 41; }
    std::string payload() const { return "7"; }
};

inline void doctest_run() {
    idem::MemoryStore store;
    auto handler = idem::make_handler(
        store, idem::Policy{"capture"},
        [](auto& tx, const std::string& body) { tx.put("captures", body, "captured"); });
    for (int delivery = 0; delivery < 2; ++delivery) {
        const DoctestRecord record;
        // @block
    }
    IDEM_DOCTEST_CHECK(store.stored_offset("payments", "orders", 3) == std::int64_t{42});
    IDEM_DOCTEST_CHECK(store.count("captures") == 1);
}
