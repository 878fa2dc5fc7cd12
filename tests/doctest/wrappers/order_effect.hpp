// Doc-test wrapper `order_effect`: the block is an effect (a lambda expression) on an order that
// dispatches follow-up work; given to a handler on a MemoryStore, a parent delivered twice and
// another parent leave one child intent each, keyed by the child id.
#include <idem/idem.hpp>
#include <idem/store/memory.hpp>

#include <string>

struct Order {
    std::string id;
    std::string notice() const { return "your order " + id + " is placed"; }
};
inline std::string idem_payload(const Order& o) {
    return o.id;
}

inline void doctest_run() {
    idem::MemoryStore store;
    auto effect =
        // @block
        ;
    auto place_order = idem::make_handler(store, idem::Policy{"place-order"}, effect);
    place_order.handle(idem::Delivery{"m-1", 1u}, Order{"93"});
    place_order.handle(idem::Delivery{"m-1", 2u}, Order{"93"});  // redelivered: a duplicate
    place_order.handle(idem::Delivery{"m-2", 1u}, Order{"94"});
    const auto rows = store.outbox_rows();
    IDEM_DOCTEST_CHECK(rows.size() == 2);
    IDEM_DOCTEST_CHECK(rows.at(0).idempotency_key == idem::child_id("m-1", "notify"));
    IDEM_DOCTEST_CHECK(rows.at(1).idempotency_key == idem::child_id("m-2", "notify"));
    IDEM_DOCTEST_CHECK(rows.at(0).destination == "notify-customer");
}
