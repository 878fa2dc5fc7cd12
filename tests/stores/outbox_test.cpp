// The transactional outbox and its relay: intents commit with the claim and the ledger row, the
// relay ships them in order with their key, retries with backoff and parks; a relay killed
// between send and mark (a real SIGKILL) resends with the same key and the receiver dedupes;
// child messages dispatched through the outbox keep their child id; two relays on one SQLite
// file share the work without sending an intent twice.

#include <gtest/gtest.h>

#include <sqlite3.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "idem/idem.hpp"
#include "idem/outbox.hpp"
#include "idem/store/memory.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/crash.hpp"
#include "support/sql_store_envs.hpp"  // IDEM_HAS_<NAME>: which stores this build has
#if IDEM_HAS_POSTGRES
#include "support/postgres_env.hpp"
#include "support/require_postgres.hpp"
#endif
#if IDEM_HAS_MYSQL
#include "support/mysql_env.hpp"
#include "support/require_mariadb.hpp"
#endif
#include "idem/testing/temp_dir.hpp"
#include "support/stored_offsets.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;
using idem::OutboxRow;
using namespace std::chrono_literals;

static_assert(idem::has_add_outbox<idem::MemoryStore::Transaction>::value);
static_assert(idem::has_add_outbox<idem::SqliteStore::Transaction>::value);
static_assert(!idem::has_add_outbox<int>::value);
static_assert(idem::check_relay_store<idem::MemoryStore>());
static_assert(idem::check_relay_store<idem::SqliteStore>());

/// A receiver that dedupes on the idempotency key: it applies a key once and counts every send.
class DedupingReceiver {
  public:
    void receive(const OutboxRow& row) {
        std::lock_guard<std::mutex> lock(mutex_);
        order_.push_back(row.idempotency_key);
        auto& entry = by_key_[row.idempotency_key];
        if (entry.deliveries++ == 0) entry.payload = row.payload;  // applied once
    }
    [[nodiscard]] std::vector<std::string> order() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return order_;
    }
    [[nodiscard]] int deliveries(const std::string& key) const {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = by_key_.find(key);
        return it == by_key_.end() ? 0 : it->second.deliveries;
    }
    [[nodiscard]] std::size_t applied() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return by_key_.size();
    }
    [[nodiscard]] std::map<std::string, int> counts() const {
        std::lock_guard<std::mutex> lock(mutex_);
        std::map<std::string, int> out;
        for (const auto& [key, entry] : by_key_)
            out[key] = entry.deliveries;
        return out;
    }

  private:
    struct Entry {
        int deliveries = 0;
        std::string payload;
    };
    mutable std::mutex mutex_;
    std::vector<std::string> order_;
    std::map<std::string, Entry> by_key_;
};

/// Forwards the relay's calls to a real store and fails the next ones on request, as a store
/// that becomes unreachable would.
template <class Inner>
class FlakyStore {
  public:
    explicit FlakyStore(Inner& inner) : inner_(inner) {}

    std::vector<OutboxRow> lease_outbox(std::size_t limit, std::chrono::milliseconds lease) {
        if (take(fail_lease)) throw idem::store_unavailable("flaky: lease_outbox lost the store");
        return inner_.lease_outbox(limit, lease);
    }
    void mark_outbox_sent(std::int64_t id) {
        if (take(fail_sent)) throw idem::store_unavailable("flaky: mark_outbox_sent lost it");
        inner_.mark_outbox_sent(id);
    }
    void mark_outbox_failed(std::int64_t id, std::string_view error,
                            std::chrono::system_clock::time_point retry_at, bool park) {
        if (take(fail_failed)) throw idem::store_unavailable("flaky: mark_outbox_failed lost it");
        inner_.mark_outbox_failed(id, error, retry_at, park);
    }

    std::atomic<int> fail_lease{0};
    std::atomic<int> fail_sent{0};
    std::atomic<int> fail_failed{0};

  private:
    static bool take(std::atomic<int>& left) {
        int n = left.load();
        while (n > 0) {
            if (left.compare_exchange_weak(n, n - 1)) return true;
        }
        return false;
    }
    Inner& inner_;
};

struct Payment {
    std::string payment_id;
    std::string account;
    long long amount_cents = 0;
};
// What a dead letter keeps of a settlement (found by ADL).
std::string idem_payload(const Payment& p) {
    return p.payment_id + ":" + p.account + ":" + std::to_string(p.amount_cents);
}

template <class Env>
class Outbox : public idem_test::StoreEnvTest<Env> {
  protected:
    using idem_test::StoreEnvTest<Env>::env;
    using idem_test::StoreEnvTest<Env>::store;

    /// Options on the environment's clock (the store's clock too).
    idem::RelayOptions options() {
        idem::RelayOptions o;
        o.clock = [this] { return env.now; };
        o.lease = 30s;
        return o;
    }

    /// Adds intents "k-1".."k-n" to "rail", committed.
    void add_intents(int n, const std::string& prefix = "k-") {
        auto tx = store().begin();
        for (int i = 1; i <= n; ++i) {
            ASSERT_TRUE(idem::outbox(tx, "rail", prefix + std::to_string(i),
                                     "payload-" + std::to_string(i)));
        }
        tx.commit();
    }

    const OutboxRow* row(const std::vector<OutboxRow>& rows, const std::string& key) {
        for (const auto& r : rows) {
            if (r.idempotency_key == key) return &r;
        }
        return nullptr;
    }

    /// The settlement consumer: ledger row (upsert on the payment id) + the wire's intent, keyed
    /// by the payment id, in the claim's transaction.
    auto settlement(bool throw_after_outbox = false) {
        return idem::make_handler(store(), idem::Policy{"settle-payment"},
                                  [throw_after_outbox](auto& tx, const Payment& p) {
                                      Env::write_effect(tx, "ledger:" + p.payment_id);
                                      idem::outbox(
                                          tx, "rail", idem::key("wire", p.payment_id),
                                          p.account + ":" + std::to_string(p.amount_cents));
                                      if (throw_after_outbox) {
                                          throw std::runtime_error("rail client crashed");
                                      }
                                  });
    }
};

TYPED_TEST_SUITE(Outbox, idem_test::MemoryAndSqlEnvs, idem_test::EnvNames);

// --- the intent commits with the claim and the ledger row ------------------------------------

TYPED_TEST(Outbox, ProcessedCommitsLedgerRowAndIntentTogether) {
    auto settle = this->settlement();
    auto outcome = settle.handle(Delivery{"msg-42", 1u}, Payment{"42", "acct-7", 12'500});
    ASSERT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
    EXPECT_EQ(this->env.effect_rows(), 1u);
    EXPECT_TRUE(this->env.has_effect("ledger:42"));
    const auto rows = this->store().outbox_rows();
    ASSERT_EQ(rows.size(), 1u);
    EXPECT_EQ(rows[0].destination, "rail");
    EXPECT_EQ(rows[0].idempotency_key, "wire-42");
    EXPECT_EQ(rows[0].payload, "acct-7:12500");
    EXPECT_EQ(rows[0].created_at, this->env.now);
    EXPECT_FALSE(rows[0].sent_at.has_value());
    EXPECT_EQ(rows[0].attempts, 0u);
    EXPECT_FALSE(rows[0].parked);
}

// Each intent records the message whose effect wrote it, in a batch too (each message's own),
// and an intent added outside any claim records none: a message's story lists its intents.
TYPED_TEST(Outbox, EachIntentSaysWhichMessageWroteIt) {
    auto settle = this->settlement();
    ASSERT_EQ(settle.handle(Delivery{"msg-1", 1u}, Payment{"1", "acct-7", 100}).disposition,
              Disposition::processed);
    const std::vector<Delivery> deliveries{{"msg-2", 1u}, {"msg-3", 1u}};
    const std::vector<Payment> payments{{"2", "acct-7", 200}, {"3", "acct-7", 300}};
    for (const auto& outcome : settle.handle_batch(deliveries, payments))
        ASSERT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
    this->add_intents(1, "loose-");

    for (const char* n : {"1", "2", "3"}) {
        const auto rows = this->store().outbox_rows("settle-payment", std::string("msg-") + n);
        ASSERT_EQ(rows.size(), 1u) << n;
        EXPECT_EQ(rows[0].idempotency_key, std::string("wire-") + n);
        EXPECT_EQ(rows[0].scope, "settle-payment");
        EXPECT_EQ(rows[0].message_id, std::string("msg-") + n);
    }
    EXPECT_TRUE(this->store().outbox_rows("other-scope", "msg-1").empty());
    const auto all = this->store().outbox_rows();  // row() points into it
    const OutboxRow* loose = this->row(all, "loose-1");
    ASSERT_NE(loose, nullptr);
    EXPECT_EQ(loose->scope, "");
    EXPECT_EQ(loose->message_id, "");
}

TYPED_TEST(Outbox, EffectThrowingAfterTheOutboxWriteLeavesNeither) {
    auto crashing = this->settlement(/*throw_after_outbox=*/true);
    auto outcome = crashing.handle(Delivery{"msg-42", 1u}, Payment{"42", "acct-7", 12'500});
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_FALSE(idem::should_ack(outcome));
    EXPECT_EQ(this->env.effect_rows(), 0u);
    EXPECT_TRUE(this->store().outbox_rows().empty());
    EXPECT_FALSE(this->store().find_claim("settle-payment", "msg-42").has_value());

    // The rolled-back intent left no key behind: the redelivery writes both.
    auto settle = this->settlement();
    EXPECT_EQ(settle.handle(Delivery{"msg-42", 2u}, Payment{"42", "acct-7", 12'500}).disposition,
              Disposition::processed);
    EXPECT_EQ(this->env.effect_rows(), 1u);
    EXPECT_EQ(this->store().outbox_rows().size(), 1u);
}

TYPED_TEST(Outbox, RedeliveredParentIsADuplicateAndAddsNoIntent) {
    auto settle = this->settlement();
    const Payment p{"42", "acct-7", 12'500};
    EXPECT_EQ(settle.handle(Delivery{"msg-42", 1u}, p).disposition, Disposition::processed);
    EXPECT_EQ(settle.handle(Delivery{"msg-42", 2u}, p).disposition, Disposition::duplicate);
    EXPECT_EQ(settle.handle(Delivery{"msg-42", 3u}, p).disposition, Disposition::duplicate);
    EXPECT_EQ(this->env.effect_rows(), 1u);
    EXPECT_EQ(this->store().outbox_rows().size(), 1u);
}

TYPED_TEST(Outbox, AReusedKeyIsDedupedAtTheSource) {
    // A producer retry publishes the same payment under a new message id: the claim cannot see
    // it, the outbox key can.
    bool added_first = false;
    bool added_retry = true;
    auto settle = idem::make_handler(
        this->store(), idem::Policy{"settle-payment"},
        [&](auto& tx, const Payment& p, const Delivery& d) {
            const bool added = idem::outbox(tx, "rail", idem::key("wire", p.payment_id), "wire");
            (d.message_id == "msg-42" ? added_first : added_retry) = added;
        });
    const Payment p{"42", "acct-7", 12'500};
    EXPECT_EQ(settle.handle(Delivery{"msg-42", 1u}, p).disposition, Disposition::processed);
    EXPECT_EQ(settle.handle(Delivery{"msg-42-retry", 1u}, p).disposition, Disposition::processed);
    EXPECT_TRUE(added_first);
    EXPECT_FALSE(added_retry);
    EXPECT_EQ(this->store().outbox_rows().size(), 1u);

    // Directly, and within one transaction.
    auto tx = this->store().begin();
    EXPECT_FALSE(idem::outbox(tx, "rail", "wire-42", "other"));
    EXPECT_TRUE(idem::outbox(tx, "rail", "wire-43", "x"));
    EXPECT_FALSE(idem::outbox(tx, "rail", "wire-43", "x"));
    tx.commit();
    const auto rows = this->store().outbox_rows();
    ASSERT_EQ(rows.size(), 2u);
    EXPECT_EQ(rows[0].payload, "wire");  // the first intent is kept, not overwritten
}

TYPED_TEST(Outbox, EmptyDestinationOrKeyIsAUsageError) {
    auto tx = this->store().begin();
    EXPECT_THROW(idem::outbox(tx, "", "k", "p"), idem::usage_error);
    EXPECT_THROW(idem::outbox(tx, "rail", "", "p"), idem::usage_error);
    EXPECT_TRUE(idem::outbox(tx, "rail", "k", ""));  // an empty payload is fine
    tx.commit();
}

// --- the relay ---------------------------------------------------------------------------------

TYPED_TEST(Outbox, RelayShipsInOrderWithTheKeyAndMarksSent) {
    this->add_intents(5);
    std::vector<OutboxRow> seen;
    idem::Relay relay(
        this->store(), [&](const OutboxRow& row) { seen.push_back(row); }, this->options());
    const auto result = relay.run_once();
    EXPECT_EQ(result.sent, 5u);
    EXPECT_EQ(result.failed + result.parked + result.lease_expired, 0u);
    ASSERT_EQ(seen.size(), 5u);
    for (std::size_t i = 0; i < seen.size(); ++i) {
        EXPECT_EQ(seen[i].idempotency_key, "k-" + std::to_string(i + 1));
        EXPECT_EQ(seen[i].destination, "rail");
        EXPECT_EQ(seen[i].payload, "payload-" + std::to_string(i + 1));
        if (i > 0) {
            EXPECT_LT(seen[i - 1].id, seen[i].id);
        }
    }
    for (const auto& row : this->store().outbox_rows()) {
        ASSERT_TRUE(row.sent_at.has_value()) << row.idempotency_key;
        EXPECT_EQ(*row.sent_at, this->env.now);
    }
    EXPECT_EQ(relay.run_once().total(), 0u);  // nothing left
    EXPECT_EQ(relay.counters().sent, 5u);
    EXPECT_EQ(seen.size(), 5u);
}

TYPED_TEST(Outbox, RelayShipsInBatches) {
    this->add_intents(7);
    auto options = this->options();
    options.batch = 3;
    DedupingReceiver receiver;
    auto relay = idem::make_relay(
        this->store(), [&](const OutboxRow& row) { receiver.receive(row); }, options);
    EXPECT_EQ(relay.run_once().sent, 3u);
    EXPECT_EQ(relay.run_once().sent, 3u);
    EXPECT_EQ(relay.run_once().sent, 1u);
    EXPECT_EQ(relay.run_once().sent, 0u);
    const std::vector<std::string> expected{"k-1", "k-2", "k-3", "k-4", "k-5", "k-6", "k-7"};
    EXPECT_EQ(receiver.order(), expected);
}

TYPED_TEST(Outbox, FailureIsRetriedAfterBackoffAndDoesNotBlockLaterIntents) {
    this->add_intents(3);
    int failures_left = 2;
    std::vector<std::string> sent;
    idem::Relay relay(
        this->store(),
        [&](const OutboxRow& row) {
            if (row.idempotency_key == "k-2" && failures_left > 0) {
                --failures_left;
                throw std::runtime_error("rail: 503 service unavailable");
            }
            sent.push_back(row.idempotency_key);
        },
        this->options());

    const auto t0 = this->env.now;
    auto result = relay.run_once();
    EXPECT_EQ(result.sent, 2u);
    EXPECT_EQ(result.failed, 1u);
    EXPECT_EQ(sent, (std::vector<std::string>{"k-1", "k-3"}));  // k-3 was not held up
    auto rows = this->store().outbox_rows();
    const OutboxRow* k2 = this->row(rows, "k-2");
    ASSERT_NE(k2, nullptr);
    EXPECT_FALSE(k2->sent_at.has_value());
    EXPECT_EQ(k2->attempts, 1u);
    EXPECT_EQ(k2->last_error, "rail: 503 service unavailable");
    EXPECT_EQ(k2->next_attempt_at, t0 + 1s);  // backoff_base
    EXPECT_FALSE(k2->parked);

    // Not due yet.
    EXPECT_EQ(relay.run_once().total(), 0u);
    this->env.now = t0 + 999ms;
    EXPECT_EQ(relay.run_once().total(), 0u);

    // Due: fails again, now twice the delay.
    this->env.now = t0 + 1s;
    result = relay.run_once();
    EXPECT_EQ(result.failed, 1u);
    rows = this->store().outbox_rows();
    k2 = this->row(rows, "k-2");
    EXPECT_EQ(k2->attempts, 2u);
    EXPECT_EQ(k2->next_attempt_at, t0 + 1s + 2s);

    this->env.now = t0 + 3s;
    result = relay.run_once();
    EXPECT_EQ(result.sent, 1u);
    EXPECT_EQ(sent, (std::vector<std::string>{"k-1", "k-3", "k-2"}));
    rows = this->store().outbox_rows();
    k2 = this->row(rows, "k-2");
    EXPECT_TRUE(k2->sent_at.has_value());
    EXPECT_EQ(k2->attempts, 2u);  // failed sends so far
    const auto counters = relay.counters();
    EXPECT_EQ(counters.sent, 3u);
    EXPECT_EQ(counters.failed, 2u);
    EXPECT_EQ(counters.parked, 0u);
}

TYPED_TEST(Outbox, ParkedAfterMaxAttemptsWithCappedBackoffAndNeverRetried) {
    this->add_intents(1);
    auto options = this->options();
    options.max_attempts = 5;
    options.backoff_base = 1s;
    options.backoff_max = 3s;
    int calls = 0;
    idem::Relay relay(
        this->store(),
        [&](const OutboxRow&) {
            ++calls;
            throw std::runtime_error("rail: account closed");
        },
        options);
    EXPECT_EQ(relay.backoff(1), 1s);
    EXPECT_EQ(relay.backoff(2), 2s);
    EXPECT_EQ(relay.backoff(3), 3s);  // 4s capped
    EXPECT_EQ(relay.backoff(4000000000u), 3s);

    const std::vector<std::chrono::milliseconds> delays{1s, 2s, 3s, 3s};
    for (std::size_t i = 0; i < delays.size(); ++i) {
        const auto result = relay.run_once();
        EXPECT_EQ(result.failed, 1u) << "attempt " << i + 1;
        const auto rows = this->store().outbox_rows();
        EXPECT_EQ(rows[0].attempts, i + 1);
        EXPECT_EQ(rows[0].next_attempt_at, this->env.now + delays[i]);
        EXPECT_FALSE(rows[0].parked);
        this->env.now += delays[i];
    }
    const auto result = relay.run_once();
    EXPECT_EQ(result.parked, 1u);
    EXPECT_EQ(result.failed, 0u);
    auto rows = this->store().outbox_rows();
    EXPECT_TRUE(rows[0].parked);
    EXPECT_EQ(rows[0].attempts, 5u);
    EXPECT_EQ(rows[0].last_error, "rail: account closed");
    EXPECT_FALSE(rows[0].sent_at.has_value());
    EXPECT_EQ(calls, 5);

    this->env.now += std::chrono::hours(24 * 30);
    EXPECT_EQ(relay.run_once().total(), 0u);
    EXPECT_EQ(calls, 5);  // parked intents are not retried
    EXPECT_EQ(relay.counters().parked, 1u);
    EXPECT_EQ(relay.counters().failed, 4u);
}

TYPED_TEST(Outbox, SendRefusedParksAtOnceAndLaterIntentsStillShip) {
    this->add_intents(3);
    auto options = this->options();
    options.max_attempts = 10;
    std::vector<std::string> calls;
    idem::Relay relay(
        this->store(),
        [&](const OutboxRow& row) {
            calls.push_back(row.idempotency_key);
            if (row.idempotency_key == "k-2") throw idem::send_refused("rail: message too large");
        },
        options);
    const auto result = relay.run_once();
    EXPECT_EQ(result.sent, 2u);
    EXPECT_EQ(result.parked, 1u);
    EXPECT_EQ(result.failed, 0u);
    const auto rows = this->store().outbox_rows();
    const OutboxRow* refused = this->row(rows, "k-2");
    ASSERT_NE(refused, nullptr);
    EXPECT_TRUE(refused->parked);
    EXPECT_EQ(refused->attempts, 1u);  // parked on its first failure, not after 10
    EXPECT_EQ(refused->last_error, "rail: message too large");
    EXPECT_FALSE(refused->sent_at.has_value());

    this->env.now += std::chrono::hours(24);
    EXPECT_EQ(relay.run_once().total(), 0u);  // never retried
    EXPECT_EQ(calls, (std::vector<std::string>{"k-1", "k-2", "k-3"}));
    EXPECT_EQ(relay.counters().parked, 1u);
    EXPECT_EQ(relay.counters().failed, 0u);
}

TYPED_TEST(Outbox, NonStandardExceptionIsRecorded) {
    this->add_intents(1);
    idem::Relay relay(
        this->store(), [](const OutboxRow&) { throw 42; }, this->options());
    EXPECT_EQ(relay.run_once().failed, 1u);
    EXPECT_EQ(this->store().outbox_rows()[0].last_error, "sender threw a non-standard exception");
}

TYPED_TEST(Outbox, StoreErrorWhileMarkingLosesNothingAndResendsWithTheSameKey) {
    this->add_intents(3);
    FlakyStore<typename TypeParam::Store> flaky(this->store());
    DedupingReceiver receiver;
    idem::Relay relay(
        flaky, [&](const OutboxRow& row) { receiver.receive(row); }, this->options());

    flaky.fail_sent = 1;  // k-1 reaches the rail, then the store is lost
    EXPECT_THROW(relay.run_once(), idem::store_unavailable);
    EXPECT_EQ(receiver.order(), std::vector<std::string>{"k-1"});  // the batch stopped there
    EXPECT_EQ(relay.counters().store_errors, 1u);
    for (const auto& row : this->store().outbox_rows())
        EXPECT_FALSE(row.sent_at.has_value());

    // Still leased: no relay sends them until the lease passes.
    EXPECT_EQ(relay.run_once().total(), 0u);
    this->env.now += 30s;
    const auto result = relay.run_once();
    EXPECT_EQ(result.sent, 3u);
    EXPECT_EQ(receiver.order(), (std::vector<std::string>{"k-1", "k-1", "k-2", "k-3"}));
    EXPECT_EQ(receiver.deliveries("k-1"), 2);  // resent with the same key...
    EXPECT_EQ(receiver.applied(), 3u);         // ...and applied once
    for (const auto& row : this->store().outbox_rows())
        EXPECT_TRUE(row.sent_at.has_value());

    // A failure that cannot be recorded is retried after the lease too.
    this->add_intents(1, "f-");
    int calls = 0;
    idem::Relay failing(
        flaky,
        [&](const OutboxRow&) {
            ++calls;
            throw std::runtime_error("rail down");
        },
        this->options());
    flaky.fail_failed = 1;
    EXPECT_THROW(failing.run_once(), idem::store_unavailable);
    EXPECT_EQ(this->row(this->store().outbox_rows(), "f-1")->attempts, 0u);
    this->env.now += 30s;
    EXPECT_EQ(failing.run_once().failed, 1u);
    EXPECT_EQ(calls, 2);
    EXPECT_EQ(this->row(this->store().outbox_rows(), "f-1")->attempts, 1u);

    // A failed lease sends nothing.
    flaky.fail_lease = 1;
    EXPECT_THROW(relay.run_once(), idem::store_unavailable);
}

TYPED_TEST(Outbox, RelayStopsItsBatchWhenTheLeaseRunsOut) {
    this->add_intents(3);
    auto options = this->options();
    options.lease = 10s;
    std::vector<std::string> sent;
    idem::Relay relay(
        this->store(),
        [&](const OutboxRow& row) {
            sent.push_back(row.idempotency_key);
            this->env.now += 10s;  // a very slow rail
        },
        options);
    const auto result = relay.run_once();
    EXPECT_EQ(result.sent, 1u);
    EXPECT_EQ(result.lease_expired, 2u);
    EXPECT_EQ(sent, std::vector<std::string>{"k-1"});
    EXPECT_EQ(relay.run_once().sent, 1u);  // k-2; the lease of k-3 has passed, so it is free
    EXPECT_EQ(relay.run_once().sent, 1u);
    EXPECT_EQ(sent, (std::vector<std::string>{"k-1", "k-2", "k-3"}));
}

TYPED_TEST(Outbox, RunLoopShipsUntilStoppedAndSurvivesStoreErrors) {
    FlakyStore<typename TypeParam::Store> flaky(this->store());
    flaky.fail_lease = 1;
    DedupingReceiver receiver;
    std::atomic<bool> stop{false};
    idem::Relay relay(
        flaky, [&](const OutboxRow& row) { receiver.receive(row); }, this->options());
    this->add_intents(10);
    idem::RelayResult total;
    std::thread runner([&] { total = relay.run(stop, 5ms); });
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (receiver.applied() < 10 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(2ms);
    stop = true;
    runner.join();
    EXPECT_EQ(receiver.applied(), 10u);
    EXPECT_EQ(total.sent, 10u);
    EXPECT_EQ(relay.counters().store_errors, 1u);
    EXPECT_NE(relay.last_store_error().find("lease_outbox"), std::string::npos);
}

TYPED_TEST(Outbox, PurgeRemovesSentIntentsOlderThanTheRetentionAndKeepsTheRest) {
    using std::chrono::milliseconds;
    auto& store = this->store();
    const auto t0 = this->env.now;
    auto handler = idem::make_handler(
        store, idem::Policy{"ledger"},
        [](auto& tx, const std::string& body) { TypeParam::write_effect(tx, body); });
    ASSERT_EQ(handler.handle(Delivery{"old", 1u}, std::string("a")).disposition,
              Disposition::processed);
    {
        auto tx = store.begin();
        ASSERT_TRUE(tx.add_outbox(idem::OutboxIntent{"rail", "wire-sent", "s"}));
        ASSERT_TRUE(tx.add_outbox(idem::OutboxIntent{"rail", "wire-unsent", "u"}));
        ASSERT_TRUE(tx.add_outbox(idem::OutboxIntent{"rail", "wire-parked", "p"}));
        tx.commit();
    }
    // At t0 the first intent is sent and the third parked; the second is never leased.
    const auto leased = store.lease_outbox(1, milliseconds(30'000));
    ASSERT_EQ(leased.size(), 1u);
    ASSERT_EQ(leased[0].idempotency_key, "wire-sent");
    store.mark_outbox_sent(leased[0].id);
    const auto rows = store.outbox_rows();
    ASSERT_EQ(rows.size(), 3u);
    ASSERT_EQ(rows[2].idempotency_key, "wire-parked");
    store.mark_outbox_failed(rows[2].id, "rail says no", t0, true);

    const auto retention = handler.policy().retention();  // 14 days
    this->env.now = t0 + std::chrono::minutes(1);
    auto early = store.purge(retention);
    EXPECT_EQ(early.claims, 0u);
    EXPECT_EQ(early.sent_intents, 0u);  // sent 1 min ago: far younger than the retention
    EXPECT_EQ(store.outbox_rows().size(), 3u);

    this->env.now = t0 + idem::days(15);
    auto later = store.purge(retention);
    EXPECT_EQ(later.claims, 1u);
    EXPECT_EQ(later.sent_intents, 1u);
    const auto kept = store.outbox_rows();
    ASSERT_EQ(kept.size(), 2u);
    EXPECT_EQ(kept[0].idempotency_key, "wire-unsent");
    EXPECT_FALSE(kept[0].sent_at.has_value());
    EXPECT_EQ(kept[1].idempotency_key, "wire-parked");
    EXPECT_TRUE(kept[1].parked);
    // The unsent intent is still leased to a relay.
    const auto due = store.lease_outbox(10, milliseconds(30'000));
    ASSERT_EQ(due.size(), 1u);
    EXPECT_EQ(due[0].idempotency_key, "wire-unsent");
    const auto again = store.purge(retention);
    EXPECT_EQ(again.claims + again.sent_intents + again.expired_locks, 0u);
}

// A paced purge (small batches, each its own statement in time order) deletes exactly what is
// past the retention — claims, sent intents, old attempt counters — batch by batch, rows that
// share a time in one batch, and keeps dead letters, unsent and parked intents, stored offsets
// and everything younger.
TYPED_TEST(Outbox, APacedPurgeDeletesExactlyTheExpiredRowsBatchByBatch) {
    using std::chrono::milliseconds;
    auto& store = this->store();
    const auto t0 = this->env.now;
    idem::PolicyOptions policy_options;
    policy_options.max_deliveries = 5;
    auto handler = idem::make_handler(
        store, idem::Policy{"ledger", policy_options},
        [](auto& tx, const std::string& body) { TypeParam::write_effect(tx, body); });
    for (int i = 0; i < 25; ++i) {  // three claims per millisecond
        this->env.now = t0 + milliseconds(i / 3);
        ASSERT_EQ(
            handler.handle(Delivery{"old-" + std::to_string(i), 1u}, std::string("o")).disposition,
            Disposition::processed);
    }
    ASSERT_EQ(handler.handle(Delivery{"poison", 9u}, std::string("p")).disposition,
              Disposition::dead_lettered);
    store.count_attempt("ledger", "counted-old");
    {
        auto tx = store.begin();
        ASSERT_TRUE(tx.add_outbox(idem::OutboxIntent{"rail", "wire-sent", "s"}));
        ASSERT_TRUE(tx.add_outbox(idem::OutboxIntent{"rail", "wire-unsent", "u"}));
        ASSERT_TRUE(tx.add_outbox(idem::OutboxIntent{"rail", "wire-parked", "p"}));
        tx.commit();
    }
    const auto leased = store.lease_outbox(1, milliseconds(30'000));
    ASSERT_EQ(leased.size(), 1u);
    store.mark_outbox_sent(leased[0].id);
    store.mark_outbox_failed(store.outbox_rows()[2].id, "rail says no", this->env.now, true);
    ASSERT_TRUE(idem_test::commit_offset(store, "g", "t", 0, 42));
    this->env.now = t0 + idem::days(10);
    for (int i = 0; i < 5; ++i) {
        ASSERT_EQ(
            handler.handle(Delivery{"new-" + std::to_string(i), 1u}, std::string("n")).disposition,
            Disposition::processed);
    }
    store.count_attempt("ledger", "counted-new");

    this->env.now = t0 + idem::days(15);
    idem::PurgeOptions options;
    options.batch_rows = 4;
    options.duty_cycle = 1.0;  // no pause: this test counts rows, not time
    std::vector<std::size_t> claims_after_batch;
    options.on_batch = [&](const idem::PurgeResult& so_far) {
        claims_after_batch.push_back(so_far.claims);
    };
    const auto result = store.purge(idem::days(14), options);
    EXPECT_TRUE(result.complete);
    EXPECT_EQ(result.claims, 26u) << "25 old claims and the parked one's";
    EXPECT_EQ(result.sent_intents, 1u);
    EXPECT_EQ(result.attempt_counts, 1u);
    EXPECT_EQ(result.batches, claims_after_batch.size());
    if (!std::is_same_v<TypeParam, idem_test::MemoryEnv>) {
        // Batches of 4 rows, widened to the last row's millisecond (3 share one): 4 to 6 rows.
        std::size_t before = 0;
        for (std::size_t i = 0; i < claims_after_batch.size() && claims_after_batch[i] < 26u; ++i) {
            EXPECT_GE(claims_after_batch[i] - before, 4u) << "batch " << i;
            EXPECT_LE(claims_after_batch[i] - before, 6u) << "batch " << i;
            before = claims_after_batch[i];
        }
        EXPECT_GE(result.batches, 5u);
    }
    for (int i = 0; i < 25; ++i)
        EXPECT_FALSE(store.find_claim("ledger", "old-" + std::to_string(i)).has_value()) << i;
    for (int i = 0; i < 5; ++i)
        EXPECT_TRUE(store.find_claim("ledger", "new-" + std::to_string(i)).has_value()) << i;
    EXPECT_EQ(store.dead_letters().size(), 1u) << "dead letters are never purged";
    const auto kept = store.outbox_rows();
    ASSERT_EQ(kept.size(), 2u);
    EXPECT_EQ(kept[0].idempotency_key, "wire-unsent");
    EXPECT_EQ(kept[1].idempotency_key, "wire-parked");
    EXPECT_TRUE(kept[1].parked);
    EXPECT_EQ(store.stored_offset("g", "t", 0), std::optional<std::int64_t>(42));
    EXPECT_EQ(store.count_attempt("ledger", "counted-new"), 2u);
    EXPECT_EQ(store.count_attempt("ledger", "counted-old"), 1u) << "its old count was purged";
    EXPECT_EQ(store.purge(idem::days(14), options).rows(), 0u);
}

// A purge asked to stop ends cleanly after its batch, says it is not complete, and the next run
// deletes the rest.
TYPED_TEST(Outbox, AStoppedPurgeLeavesTheRestForTheNextRun) {
    auto& store = this->store();
    const auto t0 = this->env.now;
    auto handler = idem::make_handler(
        store, idem::Policy{"ledger"},
        [](auto& tx, const std::string& body) { TypeParam::write_effect(tx, body); });
    for (int i = 0; i < 20; ++i) {
        this->env.now = t0 + std::chrono::milliseconds(i);
        ASSERT_EQ(
            handler.handle(Delivery{"m-" + std::to_string(i), 1u}, std::string("x")).disposition,
            Disposition::processed);
    }
    this->env.now = t0 + idem::days(15);
    idem::PurgeOptions options;
    options.batch_rows = 3;
    std::size_t batches = 0;
    options.on_batch = [&](const idem::PurgeResult&) { ++batches; };
    options.should_stop = [&] { return batches >= 2; };
    const auto first = store.purge(idem::days(14), options);
    if (std::is_same_v<TypeParam, idem_test::MemoryEnv>) {
        EXPECT_TRUE(first.complete);  // one step: nothing to stop between
        EXPECT_EQ(first.claims, 20u);
        return;
    }
    EXPECT_FALSE(first.complete);
    EXPECT_EQ(first.claims, 6u);
    EXPECT_EQ(first.batches, 2u);
    EXPECT_TRUE(store.find_claim("ledger", "m-6").has_value());
    options.should_stop = nullptr;
    const auto second = store.purge(idem::days(14), options);
    EXPECT_TRUE(second.complete);
    EXPECT_EQ(second.claims, 14u);
    EXPECT_FALSE(store.find_claim("ledger", "m-19").has_value());
}

// The Purger runs purge on its schedule, reports each run, and stops cleanly.
TYPED_TEST(Outbox, APurgerRunsOnItsScheduleAndStops) {
    auto& store = this->store();
    const auto t0 = this->env.now;
    auto handler = idem::make_handler(
        store, idem::Policy{"ledger"},
        [](auto& tx, const std::string& body) { TypeParam::write_effect(tx, body); });
    ASSERT_EQ(handler.handle(Delivery{"old", 1u}, std::string("x")).disposition,
              Disposition::processed);
    this->env.now = t0 + idem::days(15);
    std::mutex mutex;
    std::vector<idem::PurgeResult> runs;
    idem::PurgerOptions options;
    options.retention = idem::days(14);
    options.interval = std::chrono::milliseconds(20);
    options.on_run = [&](const idem::PurgeResult& r) {
        std::lock_guard<std::mutex> lock(mutex);
        runs.push_back(r);
    };
    {
        idem::Purger<typename TypeParam::Store> purger{store, options};
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        while (purger.runs() < 3 && std::chrono::steady_clock::now() < deadline)
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        purger.stop();
        EXPECT_GE(purger.runs(), 3u);
        EXPECT_EQ(purger.failures(), 0u);
        ASSERT_TRUE(purger.last().has_value());
    }
    std::lock_guard<std::mutex> lock(mutex);
    ASSERT_GE(runs.size(), 3u);
    EXPECT_EQ(runs[0].claims, 1u);
    EXPECT_EQ(runs[1].claims, 0u) << "the second run finds nothing left";
    EXPECT_FALSE(store.find_claim("ledger", "old").has_value());
    EXPECT_THROW((idem::Purger<typename TypeParam::Store>{store,
                                                          [] {
                                                              idem::PurgerOptions bad;
                                                              bad.purge.duty_cycle = 0;
                                                              return bad;
                                                          }()}),
                 idem::usage_error);
}

TYPED_TEST(Outbox, OptionsThatCannotWorkAreRefused) {
    auto sender = [](const OutboxRow&) {};
    auto with = [&](auto change) {
        auto options = this->options();
        change(options);
        return options;
    };
    using O = idem::RelayOptions;
    EXPECT_THROW(idem::Relay(this->store(), sender, with([](O& o) { o.batch = 0; })),
                 idem::usage_error);
    EXPECT_THROW(idem::Relay(this->store(), sender, with([](O& o) { o.lease = 0ms; })),
                 idem::usage_error);
    EXPECT_THROW(idem::Relay(this->store(), sender, with([](O& o) { o.max_attempts = 0; })),
                 idem::usage_error);
    EXPECT_THROW(idem::Relay(this->store(), sender, with([](O& o) { o.backoff_max = 10ms; })),
                 idem::usage_error);
}

// --- child messages through the outbox ---------------------------------------------------------

TYPED_TEST(Outbox, ParentDeliveredTwiceRelaysOneChildAndTheChildAppliesOnce) {
    // The parent handler (place-order) writes its row and dispatches a "notify" child through
    // the outbox under child_id(parent id, "notify").
    bool crash_after_outbox = true;
    auto parent = idem::make_handler(
        this->store(), idem::Policy{"place-order"},
        [&](auto& tx, const std::string& order, const Delivery& d) {
            TypeParam::write_effect(tx, "order:" + order);
            const std::string child = idem::child_id(d.message_id, "notify");
            idem::outbox(tx, "notifications", child, "notify customer of " + order);
            if (crash_after_outbox) throw std::runtime_error("worker crashed before its commit");
        });
    // First delivery: fails after the outbox write, so everything rolls back.
    EXPECT_EQ(parent.handle(Delivery{"order-msg-7", 1u}, std::string("7")).disposition,
              Disposition::failed);
    EXPECT_TRUE(this->store().outbox_rows().empty());
    crash_after_outbox = false;
    // Redelivery: processed. Then the ack is lost and it comes again: a duplicate claim.
    EXPECT_EQ(parent.handle(Delivery{"order-msg-7", 2u}, std::string("7")).disposition,
              Disposition::processed);
    EXPECT_EQ(parent.handle(Delivery{"order-msg-7", 3u}, std::string("7")).disposition,
              Disposition::duplicate);
    const std::string child_id = idem::child_id("order-msg-7", "notify");
    const auto rows = this->store().outbox_rows();
    ASSERT_EQ(rows.size(), 1u);
    EXPECT_EQ(rows[0].idempotency_key, child_id);

    // The child's consumer, with its own claim.
    int child_effects = 0;
    auto notify = idem::make_handler(this->store(), idem::Policy{"notify"},
                                     [&](auto& tx, const std::string& text, const Delivery& d) {
                                         ++child_effects;
                                         TypeParam::write_effect(tx, "notified:" + d.message_id);
                                         (void)text;
                                     });
    // The relay hands the child to its consumer (the "broker"), keyed by the child id; the first
    // mark is lost, so the relay resends the child.
    FlakyStore<typename TypeParam::Store> flaky(this->store());
    std::uint32_t child_deliveries = 0;
    std::vector<std::string> relayed;
    idem::Relay relay(
        flaky,
        [&](const OutboxRow& row) {
            relayed.push_back(row.idempotency_key);
            auto outcome =
                notify.handle(Delivery{row.idempotency_key, ++child_deliveries}, row.payload);
            if (!idem::should_ack(outcome)) throw std::runtime_error(outcome.reason);
        },
        this->options());
    flaky.fail_sent = 1;
    EXPECT_THROW(relay.run_once(), idem::store_error);
    this->env.now += 30s;
    EXPECT_EQ(relay.run_once().sent, 1u);

    EXPECT_EQ(relayed, (std::vector<std::string>{child_id, child_id}));  // one child, sent twice
    EXPECT_EQ(child_effects, 1);
    EXPECT_TRUE(this->env.has_effect("notified:" + child_id));
    EXPECT_EQ(this->env.effect_rows(), 2u);  // the order row and one notification
    const auto counters = notify.counters();
    EXPECT_EQ(counters.processed, 1u);
    EXPECT_EQ(counters.duplicates, 1u);
}

// --- SQLite across processes and threads -------------------------------------------------------

/// A receiver in its own SQLite file: one row per key (applied once), counting deliveries.
class ReceiverDb {
  public:
    explicit ReceiverDb(const std::string& path) {
        if (sqlite3_open(path.c_str(), &db_) != SQLITE_OK) throw std::runtime_error("open");
        sqlite3_busy_timeout(db_, 10000);
        idem_test::sqlite_exec(db_,
                               "CREATE TABLE IF NOT EXISTS received(key BLOB PRIMARY KEY, "
                               "payload BLOB, deliveries INTEGER NOT NULL)");
    }
    ReceiverDb(const ReceiverDb&) = delete;
    ReceiverDb& operator=(const ReceiverDb&) = delete;
    ~ReceiverDb() { sqlite3_close(db_); }

    /// Applies the intent once per key; a resend only bumps the delivery count.
    void receive(const OutboxRow& row) {
        sqlite3_stmt* stmt = nullptr;
        const char* sql =
            "INSERT INTO received(key, payload, deliveries) VALUES (?1, ?2, 1) "
            "ON CONFLICT(key) DO UPDATE SET deliveries = deliveries + 1";
        if (sqlite3_prepare_v2(db_, sql, -1, &stmt, nullptr) != SQLITE_OK) {
            throw std::runtime_error(sqlite3_errmsg(db_));
        }
        sqlite3_bind_blob(stmt, 1, row.idempotency_key.data(),
                          static_cast<int>(row.idempotency_key.size()), SQLITE_TRANSIENT);
        sqlite3_bind_blob(stmt, 2, row.payload.data(), static_cast<int>(row.payload.size()),
                          SQLITE_TRANSIENT);
        const int rc = sqlite3_step(stmt);
        sqlite3_finalize(stmt);
        if (rc != SQLITE_DONE) throw std::runtime_error(sqlite3_errmsg(db_));
    }
    long long applied() { return idem_test::sqlite_count(db_, "SELECT count(*) FROM received"); }
    long long deliveries(const std::string& key) {
        return idem_test::sqlite_count(db_, "SELECT deliveries FROM received WHERE key = ?", &key);
    }

  private:
    sqlite3* db_ = nullptr;
};

TEST(OutboxSqliteCrash, RelayKilledBetweenSendAndMarkResendsWithTheSameKey) {
    idem::testing::TempDir dir;
    const std::string path = dir.file("outbox.db");
    const std::string receiver_path = dir.file("receiver.db");
    {
        idem::SqliteStore store(path);
        auto tx = store.begin();
        for (const char* key : {"wire-pay-1", "wire-pay-2", "wire-pay-3"})
            ASSERT_TRUE(idem::outbox(tx, "rail", key, std::string("wire for ") + key));
        tx.commit();
        ReceiverDb create(receiver_path);
    }  // nothing of SQLite is open across fork()

    // The relay process is killed after the rail got its second intent (wire-pay-2) and before
    // it was marked sent.
    idem::testing::CrashOptions second_send;
    second_send.hit = 2;
    const auto crash = idem::testing::run_and_kill_at(
        "relay_after_send",
        [&] {
            idem::SqliteStore store(path);  // the relay process's own connection
            ReceiverDb receiver(receiver_path);
            idem::RelayOptions options;
            options.lease = 60s;
            idem::Relay relay(
                store,
                [&](const OutboxRow& row) {
                    receiver.receive(row);  // the rail has it
                    idem::testing::crash_point("relay_after_send");
                },
                options);
            relay.run_once();
        },
        second_send);
    ASSERT_TRUE(crash.killed_at_window) << crash.message;

    ReceiverDb receiver(receiver_path);
    auto sender = [&](const OutboxRow& row) { receiver.receive(row); };
    {
        // A new relay at once: wire-pay-2 and wire-pay-3 are still under the dead relay's lease.
        idem::SqliteStore store(path);
        const auto rows = store.outbox_rows();
        ASSERT_EQ(rows.size(), 3u);
        EXPECT_TRUE(rows[0].sent_at.has_value());
        EXPECT_FALSE(rows[1].sent_at.has_value());
        EXPECT_FALSE(rows[2].sent_at.has_value());
        idem::Relay relay(store, sender);
        EXPECT_EQ(relay.run_once().total(), 0u);
    }
    // After the lease: a store and relay whose clock is past it.
    const auto later = [] { return std::chrono::system_clock::now() + 61s; };
    idem::SqliteOptions store_options;
    store_options.clock = later;
    idem::SqliteStore store(path, store_options);
    idem::RelayOptions options;
    options.clock = later;
    idem::Relay relay(store, sender, options);
    const auto result = relay.run_once();
    EXPECT_EQ(result.sent, 2u);
    for (const auto& row : store.outbox_rows())
        EXPECT_TRUE(row.sent_at.has_value()) << row.idempotency_key;

    EXPECT_EQ(receiver.applied(), 3);                 // each wire applied once
    EXPECT_EQ(receiver.deliveries("wire-pay-1"), 1);  // marked before the kill
    EXPECT_EQ(receiver.deliveries("wire-pay-2"), 2);  // sent, killed, resent with the same key
    EXPECT_EQ(receiver.deliveries("wire-pay-3"), 1);  // never sent by the dead relay
}

/// Fills one database with 1,000 intents, then runs `relays` relays side by side, each in its own
/// thread with its own store connection (make_store()), until the receiver has them all: every
/// intent must be delivered exactly once.
template <class MakeStore>
void relays_share_the_work(MakeStore make_store, std::size_t relays) {
    constexpr int intents = 1000;
    {
        auto store = make_store();
        auto tx = store->begin();
        for (int i = 0; i < intents; ++i)
            ASSERT_TRUE(idem::outbox(tx, "rail", idem::key("wire", i), std::to_string(i)));
        tx.commit();
    }

    DedupingReceiver receiver;
    std::atomic<int> store_errors{0};
    std::vector<std::size_t> sent_by(relays, 0);
    auto relay_thread = [&](std::size_t index) {
        auto store = make_store();  // each relay its own connection
        idem::RelayOptions options;
        options.batch = 25;
        options.lease = 120s;
        idem::Relay relay(
            *store, [&](const OutboxRow& row) { receiver.receive(row); }, options);
        const auto deadline = std::chrono::steady_clock::now() + 120s;
        while (receiver.applied() < static_cast<std::size_t>(intents) &&
               std::chrono::steady_clock::now() < deadline) {
            try {
                const auto result = relay.run_once();
                sent_by[index] += result.sent;
                if (result.total() == 0) std::this_thread::sleep_for(1ms);
            } catch (const idem::store_error&) {
                ++store_errors;
            }
        }
    };
    std::vector<std::thread> threads;
    for (std::size_t i = 0; i < relays; ++i)
        threads.emplace_back(relay_thread, i);
    for (auto& thread : threads)
        thread.join();

    EXPECT_EQ(store_errors.load(), 0);
    EXPECT_EQ(receiver.applied(), static_cast<std::size_t>(intents));
    for (const auto& [key, deliveries] : receiver.counts())
        EXPECT_EQ(deliveries, 1) << key;
    EXPECT_EQ(receiver.order().size(), static_cast<std::size_t>(intents));
    std::size_t sent = 0;
    for (std::size_t n : sent_by)
        sent += n;
    EXPECT_EQ(sent, static_cast<std::size_t>(intents));
    for (const auto& row : make_store()->outbox_rows())
        EXPECT_TRUE(row.sent_at.has_value()) << row.idempotency_key;
}

TEST(OutboxConcurrency, TwoRelaysOnOneSqliteFileSendEachIntentOnce) {
    idem::testing::TempDir dir;
    const std::string path = dir.file("outbox.db");
    relays_share_the_work(
        [&] {
            idem::SqliteOptions options;
            options.busy_timeout = 30s;
            return std::make_unique<idem::SqliteStore>(path, options);
        },
        2);
}

#if IDEM_HAS_POSTGRES
TEST(OutboxConcurrency, ThreeRelaysOnPostgresShareTheWorkWithSkipLocked) {
    IDEM_REQUIRE_POSTGRES();
    auto& server = idem::testing::shared_postgres();
    const std::string database = server.fresh_database();
    relays_share_the_work(
        [&] { return std::make_unique<idem::PostgresStore>(server.conninfo(database)); }, 3);
}
#endif

#if IDEM_HAS_MYSQL
TEST(OutboxConcurrency, ThreeRelaysOnMysqlShareTheWorkWithSkipLocked) {
    IDEM_REQUIRE_MARIADB();
    const std::string database = idem_test::fresh_mariadb_database();
    relays_share_the_work(
        [&] { return std::make_unique<idem::MysqlStore>(idem_test::mariadb_endpoint(database)); },
        3);
}
#endif

}  // namespace
