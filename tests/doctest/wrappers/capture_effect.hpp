// Doc-test wrapper `capture_effect`: the block is an effect (a lambda expression), given to a
// handler on an SQLite store; a delivery and its redelivery make one charge and one row.
#include <idem/idem.hpp>
#include <idem/store/sqlite.hpp>

// @use capture_types

inline std::string idem_payload(const CapturePayment& m) {
    return m.to_json();
}

inline void doctest_run() {
    idem::SqliteStore store{":memory:"};
    store.execute("CREATE TABLE captures(order_id TEXT, gateway_reference TEXT)");
    Gateway gateway;
    auto effect =
        // @block
        ;
    auto capture = idem::make_handler(store, idem::Policy{"capture-payment"}, effect);
    const CapturePayment m{"8814", "tok", 1250};
    capture.handle(idem::Delivery{"m-1", 1u}, m);
    capture.handle(idem::Delivery{"m-1", 2u}, m);  // the redelivery: a duplicate
    IDEM_DOCTEST_CHECK(gateway.requests == 1);
    IDEM_DOCTEST_CHECK(store.query_int("SELECT COUNT(*) FROM captures") == 1);
}
