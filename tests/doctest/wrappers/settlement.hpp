// Doc-test wrapper `settlement`: the block at namespace scope, after the user's Payment type
// (its idem_payload is defined after the block, as the block declares it). doctest_run() settles
// a payment, its redelivery and a producer's republish of it under another message id: one
// ledger row and one intent, keyed by the payment id.
#include <cstdint>
#include <string>

struct Payment {
    std::string id;
    std::string account;
    std::int64_t amount_cents = 0;
    std::string wire_json() const { return "{\"payment\":\"" + id + "\"}"; }
};

// @block

std::string idem_payload(const Payment& p) {
    return p.wire_json();
}

inline void doctest_run() {
    idem::SqliteStore store{":memory:"};
    store.execute(
        "CREATE TABLE ledger(payment_id TEXT, account TEXT, amount_cents INTEGER, "
        "UNIQUE(payment_id, account))");
    auto settle = make_settle(store);
    const Payment p{"p-7", "acc-1", 125000};
    settle.handle(idem::Delivery{"m-1", 1u}, p);
    settle.handle(idem::Delivery{"m-1", 2u}, p);  // redelivered: a duplicate
    settle.handle(idem::Delivery{"m-9", 1u}, p);  // republished under a new id: the key dedupes
    IDEM_DOCTEST_CHECK(store.query_int("SELECT COUNT(*) FROM ledger") == 1);
    const auto intents = store.outbox_rows();
    IDEM_DOCTEST_CHECK(intents.size() == 1);
    IDEM_DOCTEST_CHECK(intents.at(0).idempotency_key == idem::key("wire", "p-7"));
    IDEM_DOCTEST_CHECK(intents.at(0).destination == "rail");
}
