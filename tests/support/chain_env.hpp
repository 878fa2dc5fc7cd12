#pragma once
// The two ends of one hop of a chain, shared by the senders' tests (sender_*_test.cpp): an
// upstream SqliteStore whose outbox holds intents and its Relay options for tests; a downstream
// Ledger, an IdempotentHandler on its own SqliteStore that records each effect with the message
// id it claimed (no unique index: a duplicate that got through would be a second row); and the
// scenarios every sender must pass, written once over a broker's Hop (its sender, its consumer
// polled once).

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "idem/idem.hpp"
#include "idem/outbox.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/temp_dir.hpp"
#include "polling.hpp"

namespace idem_test::chain {

using namespace std::chrono_literals;

inline constexpr auto chain_deadline = 20s;  // generous: a loaded 2-core CI machine

/// The upstream service's store: its outbox is what the relay ships.
class Upstream {
  public:
    Upstream() : store_(dir_.file("upstream.db")) {}

    idem::SqliteStore& store() noexcept { return store_; }

    /// Adds one committed intent.
    void add(const std::string& destination, const std::string& key, const std::string& payload) {
        auto tx = store_.begin();
        ASSERT_TRUE(idem::outbox(tx, destination, key, payload));
        tx.commit();
    }

    /// The intent with @p key, as the store has it now.
    std::optional<idem::OutboxRow> row(const std::string& key) {
        for (auto& r : store_.outbox_rows()) {
            if (r.idempotency_key == key) return r;
        }
        return std::nullopt;
    }

    /// Relay options for tests: a short backoff, so a retry comes within the test.
    static idem::RelayOptions relay_options() {
        idem::RelayOptions options;
        options.backoff_base = 50ms;
        options.backoff_max = 200ms;
        options.max_attempts = 1000;
        return options;
    }

  private:
    idem::testing::TempDir dir_;
    idem::SqliteStore store_;
};

/// The downstream service: claims each delivery's message id and records (message_id, payload).
template <class Body>
class Ledger {
  public:
    using PayloadOf = std::function<std::string(const Body&)>;

    struct Effect {
        PayloadOf payload_of;
        template <class Tx>
        void operator()(Tx& tx, const Body& body, const idem::Delivery& delivery) const {
            tx.execute("INSERT INTO effects(message_id, payload) VALUES (?, ?)",
                       delivery.message_id, payload_of(body));
        }
    };
    using Handler = idem::IdempotentHandler<idem::SqliteStore, Effect>;

    explicit Ledger(PayloadOf payload_of, std::string scope = "downstream")
        : store_(prepared(dir_.file("downstream.db"))),
          handler_(store_, idem::Policy{std::move(scope)}, Effect{std::move(payload_of)}) {}

    Handler& handler() noexcept { return handler_; }
    idem::SqliteStore& store() noexcept { return store_; }

    /// How many effects were applied for @p message_id (1: exactly once).
    std::int64_t effects(const std::string& message_id) {
        return store_.query_int("SELECT count(*) FROM effects WHERE message_id = ?", message_id)
            .value_or(0);
    }
    std::int64_t total() { return store_.query_int("SELECT count(*) FROM effects").value_or(0); }
    std::string payload(const std::string& message_id) {
        return store_.query_text("SELECT payload FROM effects WHERE message_id = ?", message_id)
            .value_or("");
    }

  private:
    static std::string prepared(std::string path) {
        idem::SqliteStore(path).execute(
            "CREATE TABLE IF NOT EXISTS effects(message_id TEXT NOT NULL, payload TEXT)");
        return path;
    }

    idem::testing::TempDir dir_;
    idem::SqliteStore store_;
    Handler handler_;
};

/// A broker's side of the scenarios: its sender and one poll of its idem consumer.
struct Hop {
    std::function<void(const idem::OutboxRow&)> send;
    std::function<void()> poll;
};

/// A Hop whose poll outlives a broker away (its errors are dropped: the next poll retries).
template <class Send, class Poll>
Hop hop_of(Send send, Poll poll) {
    return Hop{std::move(send), [poll = std::move(poll)]() mutable {
                   try {
                       poll();
                   } catch (const idem::error&) {
                   }
               }};
}

/// Relays every due intent once; returns what it did.
template <class Sender>
idem::RelayResult relay_all(idem::SqliteStore& store, Sender& sender) {
    idem::Relay relay(
        store, [&](const idem::OutboxRow& row) { sender(row); }, Upstream::relay_options());
    return relay.run_once();
}

/// An intent (@p key to @p destination, @p payload) the broker refuses for good: the relay's
/// first failure parks it, with a last error containing @p reason.
template <class Sender>
void expect_parked_at_once(Upstream& up, Sender& sender, const std::string& destination,
                           const std::string& key, const std::string& payload,
                           const std::string& reason) {
    up.add(destination, key, payload);
    const auto result = relay_all(up.store(), sender);
    EXPECT_EQ(result.parked, 1u);
    const auto row = up.row(key);
    ASSERT_TRUE(row.has_value());
    EXPECT_TRUE(row->parked);
    EXPECT_EQ(row->attempts, 1u);
    EXPECT_FALSE(row->sent_at.has_value());
    EXPECT_NE(row->last_error.find(reason), std::string::npos) << row->last_error;
}

/// An intent the broker cannot take yet: a failure scheduled for a retry, not parked, with a
/// last error containing @p reason.
template <class Sender>
void expect_retried_later(Upstream& up, Sender& sender, const std::string& destination,
                          const std::string& key, const std::string& reason) {
    up.add(destination, key, "?");
    const auto result = relay_all(up.store(), sender);
    EXPECT_EQ(result.failed, 1u);
    const auto row = up.row(key);
    ASSERT_TRUE(row.has_value());
    EXPECT_FALSE(row->parked);
    EXPECT_FALSE(row->sent_at.has_value());
    EXPECT_NE(row->last_error.find(reason), std::string::npos) << row->last_error;
}

/// Polls @p hop until @p done or the deadline.
template <class Pred>
bool poll_until(const Hop& hop, Pred done, std::chrono::milliseconds limit = chain_deadline) {
    return idem_test::poll_within(limit, hop.poll, done);
}

/// Intents shipped by a Relay over a real store arrive once each, the key as the message id
/// and the payload intact; the rows are marked sent.
template <class Body>
void relay_ships_keys_as_message_ids(Upstream& up, Ledger<Body>& ledger, const Hop& hop,
                                     const std::string& destination) {
    const std::vector<std::string> keys{idem::key("wire", 1), idem::key("wire", 2),
                                        idem::key("wire", "a-b")};
    for (const auto& key : keys)
        up.add(destination, key, "payload of " + key);
    const auto result = relay_all(up.store(), hop.send);
    EXPECT_EQ(result.sent, keys.size());
    ASSERT_TRUE(poll_until(hop, [&] { return ledger.total() == 3; })) << ledger.total();
    for (const auto& key : keys) {
        EXPECT_EQ(ledger.effects(key), 1) << key;
        EXPECT_EQ(ledger.payload(key), "payload of " + key);
        EXPECT_TRUE(up.row(key)->sent_at.has_value()) << key;
    }
}

/// A relay that crashed between the send and the mark sends again with the same key: the
/// downstream claim drops the copy (one effect, one duplicate). @p between runs between the
/// two sends (NATS: outlive the stream's duplicate window, so the copy reaches the consumer).
template <class Body>
void resend_is_a_duplicate(
    Upstream& up, Ledger<Body>& ledger, const Hop& hop, const std::string& destination,
    const std::function<void()>& between = [] {}) {
    up.add(destination, "wire-7", "seven");
    const idem::OutboxRow row = *up.row("wire-7");
    hop.send(row);  // the send whose mark was lost
    between();
    EXPECT_EQ(relay_all(up.store(), hop.send).sent, 1u);  // the relay's resend
    ASSERT_TRUE(poll_until(
        hop, [&] { return ledger.handler().counters().duplicates >= 1 && ledger.total() >= 1; }))
        << "duplicates " << ledger.handler().counters().duplicates;
    hop.poll();  // nothing more may arrive
    EXPECT_EQ(ledger.effects("wire-7"), 1);
    EXPECT_EQ(ledger.total(), 1);
    EXPECT_EQ(ledger.handler().counters().processed, 1u);
}

/// The broker down: the relay's row stays unsent and is retried after its backoff; once the
/// broker is back, a retry delivers it, once. @p down and @p up_again stop and start it.
template <class Body>
void outage_is_retried_then_delivered(Upstream& up, Ledger<Body>& ledger, const Hop& hop,
                                      const std::string& destination,
                                      const std::function<void()>& down,
                                      const std::function<void()>& up_again) {
    up.add(destination, "wire-9", "nine");
    idem::Relay relay(
        up.store(), [&](const idem::OutboxRow& row) { hop.send(row); }, Upstream::relay_options());
    down();
    const auto failed = relay.run_once();
    EXPECT_EQ(failed.failed, 1u);
    EXPECT_EQ(failed.sent, 0u);
    const auto row = up.row("wire-9");
    ASSERT_TRUE(row.has_value());
    EXPECT_FALSE(row->sent_at.has_value());
    EXPECT_FALSE(row->parked);
    EXPECT_EQ(row->attempts, 1u);
    EXPECT_FALSE(row->last_error.empty());
    up_again();
    ASSERT_TRUE(idem_test::wait_within(chain_deadline, [&] {
        relay.run_once();
        return up.row("wire-9")->sent_at.has_value();
    })) << up.row("wire-9")->last_error;
    ASSERT_TRUE(poll_until(hop, [&] { return ledger.total() >= 1; }));
    EXPECT_EQ(ledger.effects("wire-9"), 1);
}

/// The consumer of an upstream service emits @p n follow-ups keyed child_id(parent, i) in its
/// claim's transaction; the parent is delivered twice (a redelivery) and the relay ships every
/// child twice (a crash before each mark; @p between runs between the rounds): downstream
/// applies each child once.
template <class Body>
void fan_out_children_apply_once(
    Upstream& up, Ledger<Body>& ledger, const Hop& hop, const std::string& destination, int n,
    const std::function<void()>& between = [] {}) {
    auto parent =
        idem::make_handler(up.store(), idem::Policy{"split-order"},
                           [&](auto& tx, const std::string& order, const idem::Delivery& d) {
                               for (int i = 0; i < n; ++i)
                                   idem::outbox(tx, destination, idem::child_id(d.message_id, i),
                                                order + " part " + std::to_string(i));
                           });
    const idem::Delivery first{"order-42", idem::DeliveryCount{1u}};
    const idem::Delivery again{"order-42", idem::DeliveryCount{2u}};
    EXPECT_EQ(parent.handle(first, std::string("order 42")).disposition,
              idem::Disposition::processed);
    EXPECT_EQ(parent.handle(again, std::string("order 42")).disposition,
              idem::Disposition::duplicate);
    const auto rows = up.store().outbox_rows();
    ASSERT_EQ(rows.size(), static_cast<std::size_t>(n));
    for (const auto& row : rows)
        hop.send(row);  // sent, then the relay died before marking
    between();
    EXPECT_EQ(relay_all(up.store(), hop.send).sent, static_cast<std::size_t>(n));
    ASSERT_TRUE(poll_until(hop, [&] {
        return ledger.total() == n &&
               ledger.handler().counters().duplicates >= static_cast<std::uint64_t>(n);
    })) << ledger.total();
    for (int i = 0; i < n; ++i) {
        const std::string child = idem::child_id("order-42", i);
        EXPECT_EQ(ledger.effects(child), 1) << child;
        EXPECT_EQ(ledger.payload(child), "order 42 part " + std::to_string(i));
    }
}

}  // namespace idem_test::chain
