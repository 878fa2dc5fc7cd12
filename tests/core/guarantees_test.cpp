// The field notes' guarantees, end to end on the embedded SQLite store with a fake gateway that
// honours idempotency keys. Numbers refer to the list in issue 2.

#include <gtest/gtest.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "idem/idem.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/temp_dir.hpp"
#include "support/fake_gateway.hpp"
#include "support/store_envs.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;
using idem_test::sqlite_count;
using idem_test::sqlite_exec;

struct CapturePayment {
    std::string order_id;
    long amount = 0;
};
// What a dead letter keeps of a capture (found by ADL).
std::string idem_payload(const CapturePayment& m) {
    return m.order_id + ":" + std::to_string(m.amount);
}

class Guarantees : public ::testing::Test {
  protected:
    idem::testing::TempDir dir;
    idem::SqliteStore store{dir.file("shop.db")};
    idem_test::FakeGateway gateway;

    void SetUp() override {
        sqlite_exec(
            store.db(),
            "CREATE TABLE captures(order_id TEXT NOT NULL, gateway_reference TEXT NOT NULL);"
            "CREATE TABLE payments(id INTEGER PRIMARY KEY, state TEXT NOT NULL);"
            "CREATE TABLE ledger(payment_id INTEGER NOT NULL, entry TEXT NOT NULL);");
    }
    long long captures() { return sqlite_count(store.db(), "SELECT count(*) FROM captures"); }
};

// 1. The same capture delivered three times: one capture row, one gateway charge.
TEST_F(Guarantees, SameCaptureDeliveredThreeTimesCapturesOnce) {
    auto capture = idem::make_handler(
        store, idem::Policy{"capture-payment"}, [&](auto& tx, const CapturePayment& m) {
            auto charge = gateway.capture(idem::key("capture", m.order_id), m.amount);
            tx.execute("INSERT INTO captures(order_id, gateway_reference) VALUES (?, ?)",
                       m.order_id, charge.reference);
        });
    const CapturePayment message{"8814", 1250};
    EXPECT_EQ(capture.handle(Delivery{"msg-1", 1u}, message).disposition, Disposition::processed);
    EXPECT_EQ(capture.handle(Delivery{"msg-1", 2u}, message).disposition, Disposition::duplicate);
    EXPECT_EQ(capture.handle(Delivery{"msg-1", 3u}, message).disposition, Disposition::duplicate);
    EXPECT_EQ(captures(), 1);
    EXPECT_EQ(gateway.charges(), 1u);
    EXPECT_EQ(gateway.requests(), 1u);  // the claim stopped the handler from running again
}

// The second layer: a crash after the gateway call and before the local write is closed by the
// gateway key derived from the order id (never from the attempt).
TEST_F(Guarantees, CrashBetweenChargeAndSaveIsClosedByTheGatewayKey) {
    int attempt = 0;
    auto capture = idem::make_handler(
        store, idem::Policy{"capture-payment"}, [&](auto& tx, const CapturePayment& m) {
            auto charge = gateway.capture(idem::key("capture", m.order_id), m.amount);
            if (++attempt == 1) throw std::runtime_error("worker died after the charge");
            tx.execute("INSERT INTO captures(order_id, gateway_reference) VALUES (?, ?)",
                       m.order_id, charge.reference);
        });
    const CapturePayment message{"8814", 1250};
    EXPECT_EQ(capture.handle(Delivery{"msg-1", 1u}, message).disposition, Disposition::failed);
    EXPECT_EQ(captures(), 0);
    EXPECT_EQ(capture.handle(Delivery{"msg-1", 2u}, message).disposition, Disposition::processed);
    EXPECT_EQ(captures(), 1);
    EXPECT_EQ(gateway.requests(), 2u);
    EXPECT_EQ(gateway.charges(), 1u);  // the gateway recognised the key
}

enum class PaymentState { authorised, captured, refunded, voided };
enum class PaymentEvent { capture, refund, void_payment };

std::string to_string(PaymentState s) {
    switch (s) {
        case PaymentState::authorised:
            return "authorised";
        case PaymentState::captured:
            return "captured";
        case PaymentState::refunded:
            return "refunded";
        case PaymentState::voided:
            return "voided";
    }
    return "?";
}
std::string to_string(PaymentEvent e) {
    switch (e) {
        case PaymentEvent::capture:
            return "capture";
        case PaymentEvent::refund:
            return "refund";
        case PaymentEvent::void_payment:
            return "void";
    }
    return "?";
}
std::optional<PaymentState> parse_state(const std::string& text) {
    for (auto s : {PaymentState::authorised, PaymentState::captured, PaymentState::refunded,
                   PaymentState::voided}) {
        if (to_string(s) == text) return s;
    }
    return std::nullopt;
}

struct PaymentMessage {
    long payment_id = 0;
    PaymentEvent event = PaymentEvent::capture;
};
std::string idem_payload(const PaymentMessage& m) {
    return std::to_string(m.payment_id) + ":" + std::to_string(static_cast<int>(m.event));
}

constexpr idem::StateMachine payment_flow{
    idem::Transition{PaymentState::authorised, PaymentEvent::capture, PaymentState::captured},
    idem::Transition{PaymentState::captured, PaymentEvent::refund, PaymentState::refunded},
    idem::Transition{PaymentState::authorised, PaymentEvent::void_payment, PaymentState::voided},
};

/// The payment-event effect: reads the state inside the claim's transaction, applies only what
/// the table allows, and writes the next state and a ledger row.
auto payment_effect() {
    return idem::guarded(
               payment_flow,
               [](auto& tx, const PaymentMessage& m) -> std::optional<PaymentState> {
                   auto text =
                       tx.query_text("SELECT state FROM payments WHERE id = ?", m.payment_id);
                   if (!text) return std::nullopt;
                   return parse_state(*text);
               },
               [](auto& tx, const PaymentMessage& m, PaymentState next) {
                   tx.execute("UPDATE payments SET state = ? WHERE id = ?", to_string(next),
                              m.payment_id);
                   tx.execute("INSERT INTO ledger(payment_id, entry) VALUES (?, ?)", m.payment_id,
                              to_string(m.event));
               })
        .named("payment");
}

// 2. Out of order: a captured payment receives refund, then a stale capture. It stays refunded;
// the stale event is rejected and acked, and the reason is reported.
TEST_F(Guarantees, RefundedPaymentNeverBecomesCaptured) {
    sqlite_exec(store.db(), "INSERT INTO payments(id, state) VALUES (42, 'authorised');");
    struct LastReason : idem::Observer {
        std::string reason;
        void on_outcome(std::string_view, const Delivery&, const idem::Outcome& o) override {
            reason = o.reason;
        }
    } log;
    auto payments =
        idem::make_handler(store, idem::Policy{"payment-events"}, payment_effect(), &log);
    auto state = [&] { return store.query_text("SELECT state FROM payments WHERE id = 42"); };

    EXPECT_EQ(payments.handle(Delivery{"evt-1", 1u}, PaymentMessage{42, PaymentEvent::capture})
                  .disposition,
              Disposition::processed);
    EXPECT_EQ(payments.handle(Delivery{"evt-2", 1u}, PaymentMessage{42, PaymentEvent::refund})
                  .disposition,
              Disposition::processed);
    EXPECT_EQ(state(), std::optional<std::string>("refunded"));

    auto stale = payments.handle(Delivery{"evt-3", 1u}, PaymentMessage{42, PaymentEvent::capture});
    EXPECT_EQ(stale.disposition, Disposition::rejected);
    EXPECT_TRUE(idem::should_ack(stale));
    EXPECT_NE(stale.reason.find("stale"), std::string::npos) << stale.reason;
    EXPECT_NE(stale.reason.find("payment is refunded"), std::string::npos) << stale.reason;
    EXPECT_EQ(log.reason, stale.reason);  // reported to the observer
    EXPECT_EQ(state(), std::optional<std::string>("refunded"));
    EXPECT_EQ(sqlite_count(store.db(), "SELECT count(*) FROM ledger"), 2);
    auto claim = store.find_claim("payment-events", "evt-3");
    ASSERT_TRUE(claim.has_value());
    EXPECT_EQ(claim->disposition, Disposition::rejected);
    EXPECT_EQ(claim->reason, stale.reason);
}

TEST_F(Guarantees, EarlyEventIsDeferredUntilItsPredecessorArrives) {
    sqlite_exec(store.db(), "INSERT INTO payments(id, state) VALUES (43, 'authorised');");
    auto payments = idem::make_handler(store, idem::Policy{"payment-events"}, payment_effect());
    auto refund = payments.handle(Delivery{"evt-r", 1u}, PaymentMessage{43, PaymentEvent::refund});
    EXPECT_EQ(refund.disposition, Disposition::deferred);
    EXPECT_FALSE(idem::should_ack(refund));
    EXPECT_FALSE(store.find_claim("payment-events", "evt-r").has_value());
    EXPECT_EQ(payments.handle(Delivery{"evt-c", 1u}, PaymentMessage{43, PaymentEvent::capture})
                  .disposition,
              Disposition::processed);
    EXPECT_EQ(payments.handle(Delivery{"evt-r", 2u}, PaymentMessage{43, PaymentEvent::refund})
                  .disposition,
              Disposition::processed);
    // An event for a payment that never arrives ends in dead letters at the limit: nothing lost.
    auto orphan = payments.handle(Delivery{"evt-o", 5u}, PaymentMessage{99, PaymentEvent::refund});
    EXPECT_EQ(orphan.disposition, Disposition::dead_lettered);
    ASSERT_EQ(store.dead_letters().size(), 1u);
    EXPECT_EQ(store.dead_letters()[0].payload,
              "99:" + std::to_string(static_cast<int>(PaymentEvent::refund)));
}

// 4. Poison: count 5 is dead-lettered with its reason, the effect never runs, it is acked; a
// processed message arriving with count 7 is a duplicate, not a dead letter.
TEST_F(Guarantees, PoisonMessageIsParkedAndProcessedMessageIsNot) {
    auto capture = idem::make_handler(
        store, idem::Policy{"capture-payment"}, [&](auto& tx, const CapturePayment& m) {
            auto charge = gateway.capture(idem::key("capture", m.order_id), m.amount);
            tx.execute("INSERT INTO captures(order_id, gateway_reference) VALUES (?, ?)",
                       m.order_id, charge.reference);
        });
    auto poison = capture.handle(Delivery{"msg-poison", 5u}, CapturePayment{"1", 100});
    EXPECT_EQ(poison.disposition, Disposition::dead_lettered);
    EXPECT_TRUE(idem::should_ack(poison));
    EXPECT_NE(poison.reason.find("max_deliveries 5"), std::string::npos) << poison.reason;
    EXPECT_EQ(gateway.requests(), 0u);  // the effect never ran
    ASSERT_EQ(store.dead_letters().size(), 1u);
    EXPECT_EQ(store.dead_letters()[0].reason, poison.reason);
    EXPECT_EQ(store.dead_letters()[0].payload, "1:100");  // the message, to replay by hand

    EXPECT_EQ(capture.handle(Delivery{"msg-ok", 1u}, CapturePayment{"2", 100}).disposition,
              Disposition::processed);
    auto late = capture.handle(Delivery{"msg-ok", 7u}, CapturePayment{"2", 100});
    EXPECT_EQ(late.disposition, Disposition::duplicate);
    EXPECT_EQ(store.dead_letters().size(), 1u);
    EXPECT_EQ(captures(), 1);
}

// 6. Malformed deliveries and hostile ids: a clear outcome, nothing lost, no SQL error.
TEST_F(Guarantees, HostileInputGetsAClearOutcomeAndNothingIsLost) {
    auto capture = idem::make_handler(store, idem::Policy{"capture-payment"},
                                      [&](auto& tx, const std::string& body) {
                                          tx.execute("INSERT INTO captures VALUES (?, 'r')", body);
                                      });
    std::string ten_kb(10 * 1024, 'k');
    ten_kb[100] = '\0';
    ten_kb[200] = '\'';
    std::string payload = std::string("payload\0with nul", 16) + ten_kb;
    auto too_long = capture.handle(Delivery{ten_kb, 1u}, payload);
    EXPECT_EQ(too_long.disposition, Disposition::dead_lettered);
    EXPECT_NE(too_long.reason.find("10240 bytes"), std::string::npos) << too_long.reason;
    auto empty = capture.handle(Delivery{"", 3u}, std::string("{}"));
    EXPECT_EQ(empty.disposition, Disposition::dead_lettered);
    auto zero = capture.handle(Delivery{"m-zero", 0u}, std::string("{}"));
    EXPECT_EQ(zero.disposition, Disposition::dead_lettered);

    const std::string injection = "1'); DELETE FROM captures; --";
    const std::string with_nul("a\0b", 3);
    EXPECT_EQ(capture.handle(Delivery{injection, 1u}, injection).disposition,
              Disposition::processed);
    EXPECT_EQ(capture.handle(Delivery{with_nul, 1u}, with_nul).disposition, Disposition::processed);
    EXPECT_EQ(capture.handle(Delivery{"a", 1u}, std::string("a")).disposition,
              Disposition::processed);
    EXPECT_EQ(capture.handle(Delivery{injection, 2u}, injection).disposition,
              Disposition::duplicate);
    EXPECT_EQ(captures(), 3);

    auto letters = store.dead_letters();
    ASSERT_EQ(letters.size(), 3u);
    EXPECT_EQ(letters[0].message_id, ten_kb);  // the whole id, NULs and quotes intact
    EXPECT_EQ(letters[0].payload, payload);
    EXPECT_EQ(letters[1].delivery_count, 3u);
    EXPECT_EQ(letters[2].message_id, "m-zero");
}

}  // namespace
