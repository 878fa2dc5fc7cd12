// Doc-test wrapper `payload_of`: the block defines idem_payload() for the user's message type
// at namespace scope, next to the type; doctest_run() checks what a dead letter then keeps.
#include <idem/idem.hpp>
#include <idem/store/memory.hpp>

// @use capture_types

// @block

inline void doctest_run() {
    const CapturePayment m{"8814", "tok", 1250};
    IDEM_DOCTEST_CHECK(idem_payload(m) == R"({"order_id":"8814","amount":1250})");
    idem::MemoryStore store;
    auto capture = idem::make_handler(store, idem::Policy{"capture-payment"},
                                      [](auto&, const CapturePayment&) {});
    // At the poison limit (5 deliveries): dead-lettered with the payload, found by ADL.
    IDEM_DOCTEST_CHECK(capture.handle(idem::Delivery{"m-1", 5u}, m).disposition ==
                       idem::Disposition::dead_lettered);
    IDEM_DOCTEST_CHECK(store.dead_letters().at(0).payload == idem_payload(m));
}
