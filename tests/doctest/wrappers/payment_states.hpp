// Doc-test wrapper `payment_states`: the block at namespace scope, after a store it names
// (SQLite, in memory, with a payments table holding one authorised payment). doctest_run()
// delivers a refund before its capture, the capture, the refund, and a late second capture.
#include <idem/idem.hpp>
#include <idem/store/sqlite.hpp>

#include <optional>
#include <string>

inline idem::SqliteStore store{":memory:"};

// @block

inline void doctest_run() {
    store.execute("CREATE TABLE payments(id TEXT PRIMARY KEY, state INTEGER)");
    store.execute("INSERT INTO payments(id, state) VALUES ('p-1', 0)");  // authorised
    auto deliver = [](const char* id, PaymentEvent event) {
        return payments.handle(idem::Delivery{id, 1u}, PaymentMessage{"p-1", event});
    };
    using idem::Disposition;
    IDEM_DOCTEST_CHECK(deliver("m-1", PaymentEvent::refund).disposition == Disposition::deferred);
    IDEM_DOCTEST_CHECK(deliver("m-2", PaymentEvent::capture).disposition == Disposition::processed);
    IDEM_DOCTEST_CHECK(deliver("m-3", PaymentEvent::refund).disposition == Disposition::processed);
    const idem::Outcome late = deliver("m-4", PaymentEvent::capture);
    IDEM_DOCTEST_CHECK(late.disposition == Disposition::rejected);
    IDEM_DOCTEST_CHECK(late.reason.find("stale event") != std::string::npos);
    IDEM_DOCTEST_CHECK(store.query_int("SELECT state FROM payments WHERE id = 'p-1'") ==
                       static_cast<int>(PaymentState::refunded));
}
