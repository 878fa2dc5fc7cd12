// Doc-test wrapper `follow_up`: the block is the body of a function that has a store (SQLite, in
// memory, with an orders table) and the user's message bus; Order has its idem_payload.
// doctest_run() places an order twice (a redelivery) and relays: one child message, its id
// derived from the parent's.
#include <idem/idem.hpp>
#include <idem/outbox.hpp>
#include <idem/store/sqlite.hpp>

#include <cstdint>
#include <string>
#include <vector>

struct Order {
    std::string id;
    std::int64_t total = 0;
    std::string notice() const { return "order " + id + " placed"; }
};
inline std::string idem_payload(const Order& o) {
    return o.id;
}

struct Bus {
    std::vector<std::string> message_ids;
    void publish(const std::string& /*destination*/, const std::string& message_id,
                 const std::string& /*payload*/) {
        message_ids.push_back(message_id);
    }
};

inline void doctest_run() {
    idem::SqliteStore store{":memory:"};
    store.execute("CREATE TABLE orders(id TEXT PRIMARY KEY, total INTEGER)");
    Bus bus;
    // @block
    place_order.handle(idem::Delivery{"m-1", 1u}, Order{"93", 1250});
    place_order.handle(idem::Delivery{"m-1", 2u}, Order{"93", 1250});  // redelivered
    relay.run_once();
    IDEM_DOCTEST_CHECK(bus.message_ids ==
                       std::vector<std::string>{idem::child_id("m-1", "notify")});
}
