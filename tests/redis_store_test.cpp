// RedisStore beyond the conformance suite: leases (live → in_progress, expired → taken over),
// fenced completion (a lost lease writes nothing and is not acked), the poison limit counting
// attempts that started rather than redeliveries, the fourth field note's refund race against a
// Stripe-like gateway, Redis-side writes committing with the claim (and what happens when one
// fails), keys that share a Cluster slot, hostile ids and payloads, and a redis-server killed
// and restarted in the middle of 1,000 messages. Every test runs against a real redis-server.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/store/redis.hpp"
#include "support/redis_env.hpp"
#include "support/redis_server.hpp"
#include "support/refusing_proxy.hpp"
#include "support/require_redis.hpp"

namespace {

using idem::ClaimStatus;
using idem::Delivery;
using idem::Disposition;
using namespace std::chrono_literals;

class RedisStoreTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_REDIS();
        env_ = std::make_unique<idem_test::RedisEnv>();
    }
    idem::RedisStore& store() { return *env_->store; }
    idem_test::RedisClient& client() { return *env_->client; }
    idem_test::time_point& now() { return env_->now; }
    /// A second store on the same server and clock: another worker process.
    std::unique_ptr<idem::RedisStore> other_worker() {
        idem::RedisOptions options;
        options.clock = [this] { return env_->now; };
        return std::make_unique<idem::RedisStore>(store().endpoint(), options);
    }

    std::unique_ptr<idem_test::RedisEnv> env_;
};

// ---- leases --------------------------------------------------------------------------------

TEST_F(RedisStoreTest, LiveLeaseIsInProgressAndAnExpiredOneIsTakenOverWithANewToken) {
    auto b = other_worker();
    auto a_tx = store().begin();
    a_tx.set_terms(idem::ClaimTerms{30s, idem::days(14)});
    auto first = a_tx.claim("refund", "m-1");
    ASSERT_EQ(first.status, ClaimStatus::claimed);
    EXPECT_EQ(first.attempts, 1u);

    {
        auto b_tx = b->begin();
        b_tx.set_terms(idem::ClaimTerms{30s, idem::days(14)});
        auto held = b_tx.claim("refund", "m-1");
        EXPECT_EQ(held.status, ClaimStatus::in_progress);
        EXPECT_EQ(held.attempts, 1u);  // finding a live lease is not an attempt
    }
    EXPECT_EQ(store().attempts("refund", "m-1"), 1u);
    auto record = store().find_claim("refund", "m-1");
    ASSERT_TRUE(record.has_value());
    EXPECT_EQ(record->disposition, Disposition::in_progress);

    now() += 30s;  // exactly at the expiry the lease is over
    auto b_tx = b->begin();
    b_tx.set_terms(idem::ClaimTerms{30s, idem::days(14)});
    auto taken = b_tx.claim("refund", "m-1");
    EXPECT_EQ(taken.status, ClaimStatus::claimed);
    EXPECT_EQ(taken.attempts, 2u);
    EXPECT_NE(b_tx.token(), a_tx.token());
    EXPECT_EQ(env_->record(store().claim_key("refund", "m-1")).value().token, b_tx.token());
}

TEST_F(RedisStoreTest, CompletionIsFencedALostLeaseWritesNothing) {
    auto b = other_worker();
    auto a_tx = store().begin();
    ASSERT_EQ(a_tx.claim("refund", "m-1").status, ClaimStatus::claimed);
    a_tx.write("INCR", "refunds:m-1");
    a_tx.record_outcome("refund", "m-1", Disposition::processed, "");

    now() += store().default_lease() + 1ms;  // A is slower than its lease
    auto b_tx = b->begin();
    ASSERT_EQ(b_tx.claim("refund", "m-1").status, ClaimStatus::claimed);

    try {
        a_tx.commit();
        FAIL() << "A's commit must fail: B holds the claim";
    } catch (const idem::commit_failed& e) {
        EXPECT_NE(std::string(e.what()).find("lease lost"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(client().str({"GET", "refunds:m-1"}).has_value());  // A's write is not there
    // B's lease is untouched by A's failure and B completes.
    b_tx.write("INCR", "refunds:m-1");
    b_tx.record_outcome("refund", "m-1", Disposition::processed, "");
    b_tx.commit();
    EXPECT_EQ(client().str({"GET", "refunds:m-1"}), "1");
    EXPECT_EQ(store().find_claim("refund", "m-1")->disposition, Disposition::processed);
}

TEST_F(RedisStoreTest, ALostLeaseIsAFailureForTheHandlerNeverAnAck) {
    auto b = other_worker();
    auto handler =
        idem::make_handler(store(), idem::Policy{"refund"}, [&](auto& tx, const std::string& body) {
            tx.write("SADD", "refunded", body);
            // While A works, its lease runs out and B takes over.
            now() += store().default_lease() + 1ms;
            auto b_tx = b->begin();
            ASSERT_EQ(b_tx.claim("refund", "m-1").status, ClaimStatus::claimed);
            b_tx.record_outcome("refund", "m-1", Disposition::processed, "");
            b_tx.commit();
        });
    auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("order-7"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_FALSE(idem::should_ack(outcome));
    EXPECT_NE(outcome.reason.find("lease lost"), std::string::npos) << outcome.reason;
    EXPECT_EQ(client().integer({"SCARD", "refunded"}), 0);
}

TEST_F(RedisStoreTest, RollbackFreesOnlyItsOwnLeaseAndKeepsTheAttemptCount) {
    auto b = other_worker();
    {
        auto a_tx = store().begin();
        ASSERT_EQ(a_tx.claim("s", "m-1").status, ClaimStatus::claimed);
        now() += store().default_lease() + 1ms;
        auto b_tx = b->begin();
        ASSERT_EQ(b_tx.claim("s", "m-1").status, ClaimStatus::claimed);
        a_tx.rollback();  // A's effect threw: it must not free B's lease
        EXPECT_EQ(store().find_claim("s", "m-1")->disposition, Disposition::in_progress);
        EXPECT_EQ(env_->record(store().claim_key("s", "m-1")).value().token, b_tx.token());
    }  // B's transaction ends without commit: its lease is freed
    EXPECT_FALSE(store().find_claim("s", "m-1").has_value());
    EXPECT_EQ(store().attempts("s", "m-1"), 2u);
    auto c_tx = store().begin();
    auto third = c_tx.claim("s", "m-1");
    EXPECT_EQ(third.status, ClaimStatus::claimed);
    EXPECT_EQ(third.attempts, 3u);
}

// ---- the poison limit on a lease store -------------------------------------------------------

TEST_F(RedisStoreTest, SlowButAliveHolderIsNotDeadLetteredByRedeliveries) {
    // The broker redelivers while A still works (its count climbs past max_deliveries); each
    // redelivery finds A's live lease: in_progress, not acked, and not an attempt.
    idem::PolicyOptions options;
    options.max_deliveries = 3;
    int runs = 0;
    std::vector<Disposition> meanwhile;
    auto b = other_worker();
    auto b_handler = idem::make_handler(
        *b, idem::Policy{"capture", options},
        [&](auto& tx, const std::string& body) { tx.write("SADD", "captured", body); });
    auto a_handler = idem::make_handler(
        store(), idem::Policy{"capture", options}, [&](auto& tx, const std::string& body) {
            ++runs;
            for (std::uint32_t count = 2; count <= 7; ++count) {
                meanwhile.push_back(b_handler.handle(Delivery{"m-1", count}, body).disposition);
            }
            tx.write("SADD", "captured", body);
        });
    auto outcome = a_handler.handle(Delivery{"m-1", 1u}, std::string("order-1"));
    EXPECT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
    EXPECT_EQ(meanwhile, std::vector<Disposition>(6, Disposition::in_progress));
    EXPECT_EQ(runs, 1);
    EXPECT_TRUE(store().dead_letters().empty());
    EXPECT_EQ(store().attempts("capture", "m-1"), 1u);
    // The next redelivery, count 8, is a duplicate: acked, never parked.
    EXPECT_EQ(b_handler.handle(Delivery{"m-1", 8u}, std::string("order-1")).disposition,
              Disposition::duplicate);
    EXPECT_EQ(client().integer({"SCARD", "captured"}), 1);
}

TEST_F(RedisStoreTest, ACrashedHolderCountsOneAttemptNotItsRedeliveries) {
    idem::PolicyOptions options;
    options.max_deliveries = 3;
    auto handler = idem::make_handler(
        store(), idem::Policy{"capture", options},
        [&](auto& tx, const std::string& body) { tx.write("SADD", "captured", body); });
    {
        // A worker claimed and died (its transaction never ends; the lease just expires).
        auto crashed = other_worker();
        auto tx = crashed->begin();
        ASSERT_EQ(tx.claim("capture", "m-1").status, ClaimStatus::claimed);
        for (std::uint32_t count = 2; count <= 5; ++count) {
            EXPECT_EQ(handler.handle(Delivery{"m-1", count}, std::string("o")).disposition,
                      Disposition::in_progress);
        }
        now() += store().default_lease();
        auto outcome = handler.handle(Delivery{"m-1", 6u}, std::string("o"));
        EXPECT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
        tx.rollback();  // what the dead worker can no longer do changes nothing now
    }
    EXPECT_EQ(store().attempts("capture", "m-1"), 2u);
    EXPECT_TRUE(store().dead_letters().empty());
}

TEST_F(RedisStoreTest, PolicyRefusesALeaseLongerThanTheVisibilityTimeout) {
    idem::PolicyOptions options;
    options.visibility_timeout = 30s;
    options.lease = 45s;
    EXPECT_THROW(idem::Policy("capture", options), idem::usage_error);
    try {
        idem::Policy("capture", options);
    } catch (const idem::usage_error& e) {
        EXPECT_NE(std::string(e.what()).find("visibility timeout"), std::string::npos);
    }
    options.lease = 30s;  // equal is fine
    EXPECT_NO_THROW(idem::Policy("capture", options));

    // No lease in the policy: the store's default (30 s) is checked against a 10 s timeout.
    idem::PolicyOptions short_timeout;
    short_timeout.visibility_timeout = 10s;
    auto effect = [](auto&, const std::string&) {};
    EXPECT_THROW(idem::make_handler(store(), idem::Policy{"capture", short_timeout}, effect),
                 idem::usage_error);
    short_timeout.lease = 9s;
    auto handler = idem::make_handler(store(), idem::Policy{"capture", short_timeout}, effect);
    EXPECT_EQ(handler.effective_lease(), 9s);
}

TEST_F(RedisStoreTest, TheHandlersLeaseIsTheOneStored) {
    idem::PolicyOptions options;
    options.lease = 5s;
    auto handler = idem::make_handler(
        store(), idem::Policy{"capture", options}, [&](auto& tx, const std::string&) {
            auto stored = env_->record(store().claim_key("capture", "m-1"));
            ASSERT_TRUE(stored.has_value());
            EXPECT_EQ(stored->lease_until(), idem::detail::to_unix_ms(now() + 5s));
            tx.write("SET", "ran", "1");
        });
    ASSERT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("x")).disposition,
              Disposition::processed);
    // The finished record expires after the policy's retention.
    auto ttl = client().integer({"PTTL", store().claim_key("capture", "m-1")});
    ASSERT_TRUE(ttl.has_value());
    EXPECT_GT(*ttl, std::chrono::duration_cast<std::chrono::milliseconds>(idem::days(13)).count());
}

// ---- the fourth field note's race ------------------------------------------------------------

/// A Stripe-like refund API: a new key makes one refund and returns its reference; the same key
/// returns the first result; a request whose key is still in flight is refused.
class RefundProcessor {
  public:
    struct InFlight : std::runtime_error {
        using std::runtime_error::runtime_error;
    };

    std::string refund(const std::string& key, std::chrono::milliseconds takes) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            ++requests_;
            if (auto done = results_.find(key); done != results_.end()) return done->second;
            if (!in_flight_.insert(key).second) {
                throw InFlight("409: a request with idempotency key " + key + " is in flight");
            }
        }
        std::this_thread::sleep_for(takes);
        std::lock_guard<std::mutex> lock(mutex_);
        in_flight_.erase(key);
        std::string reference = "re_" + std::to_string(results_.size() + 1);
        results_.emplace(key, reference);
        return reference;
    }
    std::size_t refunds() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return results_.size();
    }
    std::size_t requests() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return requests_;
    }

  private:
    mutable std::mutex mutex_;
    std::set<std::string> in_flight_;
    std::map<std::string, std::string> results_;
    std::size_t requests_ = 0;
};

TEST_F(RedisStoreTest, SlowInstanceRacingASecondOneRefundsExactlyOnce) {
    // Real time here: the server's clock, a 300 ms lease equal to the visibility timeout.
    idem::RedisOptions options;
    options.lease = 300ms;
    idem::RedisStore a_store(store().endpoint(), options);
    idem::RedisStore b_store(store().endpoint(), options);
    idem::PolicyOptions policy;
    policy.visibility_timeout = 300ms;
    RefundProcessor processor;

    auto refund_effect = [&processor](std::chrono::milliseconds takes) {
        return [&processor, takes](auto& tx, const std::string& order) {
            std::string reference = processor.refund(idem::key("refund", "shop-1", order), takes);
            tx.write("HSET", "refunds", order, reference);
        };
    };
    auto a = idem::make_handler(a_store, idem::Policy{"refund-once", policy}, refund_effect(900ms));
    auto b = idem::make_handler(b_store, idem::Policy{"refund-once", policy}, refund_effect(0ms));

    std::mutex m;
    std::condition_variable cv;
    bool a_started = false;
    idem::Outcome a_outcome;
    std::thread instance_a([&] {
        {
            std::lock_guard<std::mutex> lock(m);
            a_started = true;
        }
        cv.notify_all();
        a_outcome = a.handle(Delivery{"m-1", 1u}, std::string("order-9"));
    });
    {
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] { return a_started; });
    }
    // The visibility timeout passes: the broker gives the message to B, whose claim finds A's
    // lease expired and takes it over. The processor refuses B: A's request is in flight.
    idem::Outcome b_outcome;
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    do {
        std::this_thread::sleep_for(350ms);
        b_outcome = b.handle(Delivery{"m-1", 2u}, std::string("order-9"));
    } while (b_outcome.disposition == Disposition::in_progress &&
             std::chrono::steady_clock::now() < deadline);
    EXPECT_EQ(b_outcome.disposition, Disposition::failed) << b_outcome.reason;
    EXPECT_NE(b_outcome.reason.find("in flight"), std::string::npos) << b_outcome.reason;
    EXPECT_FALSE(idem::should_ack(b_outcome));
    instance_a.join();
    // A's refund went through at the processor, but its completion is fenced off.
    EXPECT_EQ(a_outcome.disposition, Disposition::failed) << a_outcome.reason;
    EXPECT_NE(a_outcome.reason.find("lease lost"), std::string::npos) << a_outcome.reason;
    EXPECT_FALSE(idem::should_ack(a_outcome));
    EXPECT_FALSE(client().integer({"HLEN", "refunds"}).value_or(0) > 0);

    // The next redelivery gets the first result back from the processor and records it.
    auto c = b.handle(Delivery{"m-1", 3u}, std::string("order-9"));
    EXPECT_EQ(c.disposition, Disposition::processed) << c.reason;
    EXPECT_EQ(b.handle(Delivery{"m-1", 4u}, std::string("order-9")).disposition,
              Disposition::duplicate);
    EXPECT_EQ(processor.refunds(), 1u);
    EXPECT_EQ(processor.requests(), 3u);
    EXPECT_EQ(client().str({"HGET", "refunds", "order-9"}), "re_1");
}

// ---- Redis-side writes commit with the claim --------------------------------------------------

TEST_F(RedisStoreTest, WritesOfADeferredOrThrowingEffectAreNeverApplied) {
    bool fail = true;
    auto handler =
        idem::make_handler(store(), idem::Policy{"ledger"}, [&](auto& tx, const std::string& body) {
            tx.write("HINCRBY", "balance", body, 100);
            if (fail) throw std::runtime_error("downstream 503");
        });
    EXPECT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("acct-1")).disposition,
              Disposition::failed);
    EXPECT_FALSE(client().str({"HGET", "balance", "acct-1"}).has_value());
    fail = false;
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("acct-1")).disposition,
              Disposition::processed);
    EXPECT_EQ(handler.handle(Delivery{"m-1", 3u}, std::string("acct-1")).disposition,
              Disposition::duplicate);
    EXPECT_EQ(client().str({"HGET", "balance", "acct-1"}), "100");
}

TEST_F(RedisStoreTest, AWriteFailingFirstInTheCommitAppliesNothingAndReleasesTheClaim) {
    client().exec({"SET", "not-a-hash", "text"});
    bool sabotage = true;
    auto handler =
        idem::make_handler(store(), idem::Policy{"ledger"}, [&](auto& tx, const std::string&) {
            tx.write("HSET", sabotage ? "not-a-hash" : "a-hash", "f", "v");
            tx.write("INCR", "counter");
        });
    auto failed = handler.handle(Delivery{"m-1", 1u}, std::string("x"));
    EXPECT_EQ(failed.disposition, Disposition::failed);
    EXPECT_NE(failed.reason.find("WRONGTYPE"), std::string::npos) << failed.reason;
    EXPECT_FALSE(client().str({"GET", "counter"}).has_value());
    EXPECT_FALSE(store().find_claim("ledger", "m-1").has_value());
    sabotage = false;
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("x")).disposition,
              Disposition::processed);
    EXPECT_EQ(client().str({"GET", "counter"}), "1");
}

TEST_F(RedisStoreTest, AWriteFailingAfterOthersWereAppliedParksTheClaimSoTheyAreNotRepeated) {
    // Redis cannot roll back the INCR that ran before the failing command: the claim is parked
    // (a dead letter says why), and a redelivery is a duplicate instead of a second INCR.
    client().exec({"SET", "not-a-hash", "text"});
    auto handler =
        idem::make_handler(store(), idem::Policy{"ledger"}, [&](auto& tx, const std::string&) {
            tx.write("INCR", "counter");
            tx.write("HSET", "not-a-hash", "f", "v");
        });
    auto failed = handler.handle(Delivery{"m-1", 1u}, std::string("x"));
    EXPECT_EQ(failed.disposition, Disposition::failed);
    EXPECT_NE(failed.reason.find("cannot roll back"), std::string::npos) << failed.reason;
    EXPECT_EQ(client().str({"GET", "counter"}), "1");
    auto record = store().find_claim("ledger", "m-1");
    ASSERT_TRUE(record.has_value());
    EXPECT_EQ(record->disposition, Disposition::dead_lettered);
    auto letters = store().dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_EQ(letters[0].message_id, "m-1");
    EXPECT_NE(letters[0].reason.find("WRONGTYPE"), std::string::npos) << letters[0].reason;
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("x")).disposition,
              Disposition::duplicate);
    EXPECT_EQ(client().str({"GET", "counter"}), "1");
}

TEST_F(RedisStoreTest, AckOnCommitIsPartOfTheTransaction) {
    client().exec({"XGROUP", "CREATE", "orders", "workers", "$", "MKSTREAM"});
    auto entry = client().str({"XADD", "orders", "*", "order", "1"});
    ASSERT_TRUE(entry.has_value());
    auto run = [&](std::vector<std::string> command) {
        return store().with_connection(
            [&](idem::RedisConnection& c) { return c.checked(command, command[0]); });
    };
    run({"XREADGROUP", "GROUP", "workers", "w1", "COUNT", "1", "STREAMS", "orders", ">"});
    auto pending = [&] { return run({"XPENDING", "orders", "workers"}).elements.at(0).integer; };
    ASSERT_EQ(pending(), 1);
    {
        auto tx = store().begin();
        ASSERT_EQ(tx.claim("s", "m-1").status, ClaimStatus::claimed);
        tx.ack_on_commit("orders", "workers", *entry);
    }  // rolled back: not acked
    EXPECT_EQ(pending(), 1);
    auto tx = store().begin();
    ASSERT_EQ(tx.claim("s", "m-1").status, ClaimStatus::claimed);
    tx.ack_on_commit("orders", "workers", *entry);
    tx.record_outcome("s", "m-1", Disposition::processed, "");
    tx.commit();
    EXPECT_EQ(pending(), 0);
}

// ---- round trips ------------------------------------------------------------------------------

TEST_F(RedisStoreTest, OneMessageCostsTwoRoundTripsAndABatchOfAHundredCostsTwo) {
    auto handler = idem::make_handler(
        store(), idem::Policy{"capture"},
        [](auto& tx, const std::string& order) { tx.write("HSET", "captures", order, "ch"); });
    // Warm up: connect and load the scripts once.
    ASSERT_EQ(handler.handle(Delivery{"warm", 1u}, std::string("w")).disposition,
              Disposition::processed);
    auto before = store().round_trips();
    ASSERT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("o-1")).disposition,
              Disposition::processed);
    EXPECT_EQ(store().round_trips() - before, 2u);  // claim, commit

    std::vector<Delivery> deliveries;
    std::vector<std::string> bodies;
    for (int i = 0; i < 100; ++i) {
        deliveries.push_back(Delivery{"b-" + std::to_string(i), 1u});
        bodies.push_back("o-" + std::to_string(i));
    }
    before = store().round_trips();
    auto outcomes = handler.handle_batch(deliveries, bodies);
    EXPECT_EQ(store().round_trips() - before, 2u);  // 100 claims pipelined, one commit
    for (const auto& outcome : outcomes)
        EXPECT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
    EXPECT_EQ(client().integer({"HLEN", "captures"}), 101);
    // Redelivered as a batch: 100 duplicates, one round trip, no commit.
    before = store().round_trips();
    outcomes = handler.handle_batch(deliveries, bodies);
    EXPECT_EQ(store().round_trips() - before, 1u);
    for (const auto& outcome : outcomes)
        EXPECT_EQ(outcome.disposition, Disposition::duplicate);
}

TEST_F(RedisStoreTest, AFailedMessageOfAPipelinedBatchGivesItsLeaseBack) {
    auto handler = idem::make_handler(store(), idem::Policy{"capture"},
                                      [](auto& tx, const std::string& order) {
                                          tx.write("SADD", "captured", order);
                                          if (order == "bad") throw std::runtime_error("503");
                                      });
    auto outcomes =
        handler.handle_batch(std::vector<Delivery>{{"m-1", 1u}, {"m-2", 1u}, {"m-3", 1u}},
                             std::vector<std::string>{"a", "bad", "c"});
    EXPECT_EQ(outcomes[0].disposition, Disposition::processed);
    EXPECT_EQ(outcomes[1].disposition, Disposition::failed);
    EXPECT_EQ(outcomes[2].disposition, Disposition::processed);
    EXPECT_FALSE(store().find_claim("capture", "m-2").has_value());  // freed, not left leased
    EXPECT_EQ(store().attempts("capture", "m-2"), 1u);
    EXPECT_EQ(client().integer({"SCARD", "captured"}), 2);
    EXPECT_EQ(handler.handle(Delivery{"m-2", 2u}, std::string("b")).disposition,
              Disposition::processed);
}

// ---- keys, hostile ids and payloads ----------------------------------------------------------

/// Redis Cluster's key slot: CRC16/XMODEM of the hash tag (or the whole key), mod 16384.
unsigned key_slot(const std::string& key) {
    std::string hashed = key;
    auto open = key.find('{');
    if (open != std::string::npos) {
        auto close = key.find('}', open + 1);
        if (close != std::string::npos && close != open + 1)
            hashed = key.substr(open + 1, close - open - 1);
    }
    unsigned crc = 0;
    for (unsigned char c : hashed) {
        crc ^= static_cast<unsigned>(c) << 8;
        for (int i = 0; i < 8; ++i)
            crc = (crc & 0x8000) ? ((crc << 1) ^ 0x1021) : (crc << 1);
        crc &= 0xFFFF;
    }
    return crc % 16384;
}

// ---- claims by SET on the server's clock ------------------------------------------------------
// A new id is claimed with one `SET … NX PX … GET`, which cannot read the server's clock: its
// times are stored as "the expiry minus the retention" and resolved by whoever reads them.

class RedisServerClockTest : public RedisStoreTest {
  protected:
    /// A store on the server's clock (no RedisOptions::clock), as in production.
    std::unique_ptr<idem::RedisStore> worker(bool claim_with_set = true) {
        idem::RedisOptions options;
        options.claim_with_set = claim_with_set;
        return std::make_unique<idem::RedisStore>(store().endpoint(), options);
    }
    std::int64_t server_ms() {
        auto t = client().array({"TIME"});
        return std::stoll(*t.at(0)) * 1000 + std::stoll(*t.at(1)) / 1000;
    }
    std::string claim_key(const std::string& scope, const std::string& id) {
        return store().options().key_prefix + "c{" + scope + ":" + id + "}";
    }
};

TEST_F(RedisServerClockTest, ANewIdIsOneSetAndItsTimesAreTheServersWhenRead) {
    auto a = worker();
    EXPECT_TRUE(a->claims_with_set());
    const std::int64_t before = server_ms();
    auto tx = a->begin();
    tx.set_terms(idem::ClaimTerms{30s, idem::days(14)});
    const auto trips = a->round_trips();
    auto claim = tx.claim("pay", "m-1", "fp-1");
    ASSERT_EQ(claim.status, ClaimStatus::claimed);
    EXPECT_EQ(claim.attempts, 1u);
    EXPECT_LE(a->round_trips() - trips, 2u);  // the SET (and the connection's first connect)
    const std::int64_t after = server_ms();

    // Stored as SET wrote it: no number the client could only have guessed.
    auto raw = client().str({"GET", claim_key("pay", "m-1")});
    ASSERT_TRUE(raw.has_value());
    const std::string retention_ms = std::to_string(idem::days(14) / 1ms);
    EXPECT_EQ(
        raw->rfind(
            "leased|" + tx.token() + "||1|~" + retention_ms + "|~" + retention_ms + "|30000|", 0),
        0u)
        << *raw;
    auto found = a->find_claim("pay", "m-1");
    ASSERT_TRUE(found.has_value());
    const std::int64_t claimed_at = idem::detail::to_unix_ms(found->claimed_at);
    EXPECT_GE(claimed_at, before - 1);
    EXPECT_LE(claimed_at, after + 1);
    EXPECT_EQ(found->fingerprint, "fp-1");
    EXPECT_EQ(found->disposition, Disposition::in_progress);

    tx.record_outcome("pay", "m-1", Disposition::processed, "");
    tx.commit();
    auto done = a->find_claim("pay", "m-1");
    ASSERT_TRUE(done.has_value());
    EXPECT_EQ(done->disposition, Disposition::processed);
    EXPECT_EQ(idem::detail::to_unix_ms(done->claimed_at), claimed_at);  // the expiry was kept

    // A duplicate is answered from what the SET returned: one round trip, no script.
    auto again = a->begin();
    const auto dup_trips = a->round_trips();
    auto dup = again.claim("pay", "m-1", "fp-1");
    EXPECT_EQ(dup.status, ClaimStatus::duplicate);
    EXPECT_EQ(dup.recorded, Disposition::processed);
    EXPECT_EQ(dup.fingerprint, "fp-1");
    EXPECT_EQ(dup.attempts, 1u);
    EXPECT_EQ(a->round_trips() - dup_trips, 1u);
}

TEST_F(RedisServerClockTest, ALeaseTakenBySetIsLiveUntilItsServerTimeExpiryThenTakenOver) {
    auto a = worker();
    auto b = worker();
    auto a_tx = a->begin();
    a_tx.set_terms(idem::ClaimTerms{400ms, idem::days(1)});
    ASSERT_EQ(a_tx.claim("refund", "m-1").status, ClaimStatus::claimed);
    const std::int64_t claimed_at =
        idem::detail::to_unix_ms(a->find_claim("refund", "m-1")->claimed_at);
    {
        auto b_tx = b->begin();
        b_tx.set_terms(idem::ClaimTerms{400ms, idem::days(1)});
        auto held = b_tx.claim("refund", "m-1");  // the script resolves the lease's start
        EXPECT_EQ(held.status, ClaimStatus::in_progress);
        EXPECT_EQ(held.attempts, 1u);
    }
    std::this_thread::sleep_for(500ms);
    auto b_tx = b->begin();
    b_tx.set_terms(idem::ClaimTerms{400ms, idem::days(1)});
    auto taken = b_tx.claim("refund", "m-1");
    EXPECT_EQ(taken.status, ClaimStatus::claimed);
    EXPECT_EQ(taken.attempts, 2u);
    // The takeover writes the times as numbers; the claim's own time is the first claim's.
    auto raw = client().str({"GET", claim_key("refund", "m-1")});
    ASSERT_TRUE(raw.has_value());
    EXPECT_EQ(raw->find('~'), std::string::npos) << *raw;
    EXPECT_EQ(idem::detail::to_unix_ms(b->find_claim("refund", "m-1")->claimed_at), claimed_at);
    // A's completion is fenced off.
    a_tx.record_outcome("refund", "m-1", Disposition::processed, "");
    EXPECT_THROW(a_tx.commit(), idem::commit_failed);
    b_tx.record_outcome("refund", "m-1", Disposition::processed, "");
    b_tx.commit();
    EXPECT_EQ(b->find_claim("refund", "m-1")->disposition, Disposition::processed);
}

TEST_F(RedisServerClockTest, ReleasedSetClaimsCountAttemptsAndPurgeReadsTheirAge) {
    auto a = worker();
    {
        auto tx = a->begin();
        ASSERT_EQ(tx.claim("jobs", "m-1").status, ClaimStatus::claimed);
    }  // rolled back: released, the attempt stays
    {
        auto tx = a->begin();
        auto again = tx.claim("jobs", "m-1");
        EXPECT_EQ(again.status, ClaimStatus::claimed);
        EXPECT_EQ(again.attempts, 2u);
        tx.record_outcome("jobs", "m-1", Disposition::processed, "");
        tx.commit();
    }
    {
        auto tx = a->begin();
        ASSERT_EQ(tx.claim("jobs", "m-2").status, ClaimStatus::claimed);
        tx.record_outcome("jobs", "m-2", Disposition::processed, "");
        tx.commit();
    }
    // Both are younger than an hour; older than 0 ms both go (purge resolves `~` times).
    EXPECT_EQ(a->purge(1h).claims, 0u);
    std::this_thread::sleep_for(5ms);
    EXPECT_EQ(a->purge(1ms).claims, 2u);
    EXPECT_FALSE(a->find_claim("jobs", "m-1").has_value());
}

TEST_F(RedisServerClockTest, WithoutSetClaimsEveryClaimIsTheScriptAndTheAnswersAreTheSame) {
    auto scripted = worker(false);
    auto by_set = worker(true);
    EXPECT_FALSE(scripted->claims_with_set());
    for (auto* s : {scripted.get(), by_set.get()}) {
        const std::string scope = s == scripted.get() ? "scripted" : "set";
        auto handler =
            idem::make_handler(*s, idem::Policy{scope}, [](auto&, const std::string&) {});
        std::vector<Delivery> deliveries = {{"m-1", 1u}, {"m-2", 1u}, {"m-1", 1u}};
        std::vector<std::string> bodies = {"a", "b", "a"};
        auto first = handler.handle_batch(deliveries, bodies);
        EXPECT_EQ(first[0].disposition, Disposition::processed) << scope;
        EXPECT_EQ(first[1].disposition, Disposition::processed) << scope;
        EXPECT_EQ(first[2].disposition, Disposition::duplicate) << scope;
        auto second = handler.handle_batch(deliveries, bodies);
        for (const auto& outcome : second)
            EXPECT_EQ(outcome.disposition, Disposition::duplicate) << scope;
        auto raw = client().str({"GET", claim_key(scope, "m-1")});
        ASSERT_TRUE(raw.has_value());
        // The script reads TIME and writes numbers; SET writes `~<retention>`.
        EXPECT_EQ(raw->find('~') == std::string::npos, s == scripted.get()) << *raw;
    }
}

TEST_F(RedisServerClockTest, AServerThatRefusesSetGetTurnsTheStoreToTheClaimScriptForGood) {
    // Redis before 7.0 answers SET … NX … GET with a syntax error (and writes nothing); a proxy
    // in front of the real server answers so.
    idem_test::RefusingProxy proxy(store().endpoint().host, store().endpoint().port,
                                   idem_test::is_set_nx_get, "ERR syntax error");
    idem::RedisEndpoint through_proxy = store().endpoint();
    through_proxy.port = proxy.port();
    idem::RedisStore old_server{through_proxy};
    ASSERT_TRUE(old_server.claims_with_set());
    int runs = 0;
    auto handler = idem::make_handler(old_server, idem::Policy{"old"},
                                      [&runs](auto&, const std::string&) { ++runs; });
    EXPECT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("a")).disposition,
              Disposition::processed);
    EXPECT_EQ(proxy.refused(), 1);
    EXPECT_FALSE(old_server.claims_with_set());
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("a")).disposition,
              Disposition::duplicate);
    auto batch = handler.handle_batch(std::vector<Delivery>{{"m-2", 1u}, {"m-1", 3u}, {"m-3", 1u}},
                                      std::vector<std::string>{"b", "a", "c"});
    EXPECT_EQ(batch[0].disposition, Disposition::processed);
    EXPECT_EQ(batch[1].disposition, Disposition::duplicate);
    EXPECT_EQ(batch[2].disposition, Disposition::processed);
    EXPECT_EQ(proxy.refused(), 1);  // never asked again
    EXPECT_EQ(runs, 3);
    auto raw = client().str({"GET", claim_key("old", "m-2")});
    ASSERT_TRUE(raw.has_value());
    EXPECT_EQ(raw->find('~'), std::string::npos) << *raw;  // written by the script
}

TEST_F(RedisStoreTest, OneClaimsKeysShareAClusterSlotWhateverTheIdHolds) {
    ASSERT_EQ(key_slot("123456789"), 0x31C3u % 16384);  // the CRC16 check value
    const std::vector<std::string> ids = {"plain", "a}b", "{x}", "}",
                                          "{",     "%7D", "a:b", std::string("nul\0id", 6)};
    for (const auto& id : ids) {
        EXPECT_EQ(key_slot(store().claim_key("capture", id)),
                  key_slot(store().dead_letter_key("capture", id)))
            << id;
    }
    // Escaping keeps different (scope, id) pairs apart.
    EXPECT_NE(store().claim_key("a:b", "c"), store().claim_key("a", "b:c"));
    EXPECT_NE(store().claim_key("s", "a}b"), store().claim_key("s", "a%7Db"));
    EXPECT_NE(store().claim_key("s", "}"), store().claim_key("s", "%7D"));
}

TEST_F(RedisStoreTest, HostileIdsAndPayloadsRoundTripIntact) {
    const std::vector<std::string> ids = {"with space",
                                          "quote\"s and 'single'",
                                          "{braces}",
                                          "}{",
                                          std::string("n\0l", 3),
                                          "%25%7D",
                                          "a:b:c",
                                          "\xff\xfe binary",
                                          "*?[glob]\\",
                                          "emoji \xf0\x9f\x92\xb3"};
    const std::string payload = std::string("payload\0with nul", 16) + "\r\n\"{}\xff";
    idem::PolicyOptions park_at_once;
    park_at_once.max_deliveries = 1;
    auto writer = idem::make_handler(
        store(), idem::Policy{"scope:with{odd}chars"},
        [](auto& tx, const std::string& body) { tx.write("SADD", "seen", body); });
    auto parker = idem::make_handler(store(), idem::Policy{"park", park_at_once},
                                     [](auto&, const std::string&) {});
    for (const auto& id : ids) {
        EXPECT_EQ(writer.handle(Delivery{id, 1u}, id + payload).disposition, Disposition::processed)
            << id;
        EXPECT_EQ(writer.handle(Delivery{id, 2u}, id + payload).disposition, Disposition::duplicate)
            << id;
        auto record = store().find_claim("scope:with{odd}chars", id);
        ASSERT_TRUE(record.has_value()) << id;
        EXPECT_EQ(record->message_id, id);
        EXPECT_EQ(parker.handle(Delivery{id, 1u}, id + payload).disposition,
                  Disposition::dead_lettered);
        EXPECT_EQ(client().integer({"SISMEMBER", "seen", id + payload}), 1) << id;
    }
    EXPECT_EQ(client().integer({"SCARD", "seen"}), static_cast<long long>(ids.size()));
    auto letters = store().dead_letters();
    ASSERT_EQ(letters.size(), ids.size());
    std::set<std::string> got_ids;
    for (const auto& letter : letters) {
        got_ids.insert(letter.message_id);
        EXPECT_EQ(letter.payload, letter.message_id + payload);
        EXPECT_EQ(letter.scope, "park");
    }
    EXPECT_EQ(got_ids, std::set<std::string>(ids.begin(), ids.end()));
}

// ---- connection loss ---------------------------------------------------------------------------

/// Its own server: these tests kill it.
class RedisRestartTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_REDIS();
        server_ = std::make_unique<idem_test::RedisServer>();
    }
    std::unique_ptr<idem_test::RedisServer> server_;
};

TEST_F(RedisRestartTest, AnUnreachableServerIsAFailureAndTheStoreReconnects) {
    idem::RedisEndpoint endpoint = idem_test::redis_endpoint(*server_);
    endpoint.connect_timeout = 500ms;
    endpoint.command_timeout = 1s;
    idem::RedisStore store(endpoint);
    auto handler = idem::make_handler(
        store, idem::Policy{"s"}, [](auto& tx, const std::string& b) { tx.write("SADD", "x", b); });
    ASSERT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("1")).disposition,
              Disposition::processed);
    server_->kill9();
    auto down = handler.handle(Delivery{"m-2", 1u}, std::string("2"));
    EXPECT_EQ(down.disposition, Disposition::failed);
    EXPECT_FALSE(idem::should_ack(down));
    EXPECT_NE(down.reason.find("store error"), std::string::npos) << down.reason;
    server_->start();
    EXPECT_EQ(handler.handle(Delivery{"m-2", 2u}, std::string("2")).disposition,
              Disposition::processed);
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("1")).disposition,
              Disposition::duplicate);  // the AOF kept the first claim
}

TEST_F(RedisRestartTest, KilledAndRestartedMidRunOfAThousandLosesNothingAndAppliesNothingTwice) {
    constexpr int kMessages = 1000;
    idem::RedisEndpoint endpoint = idem_test::redis_endpoint(*server_);
    endpoint.connect_timeout = 500ms;
    endpoint.command_timeout = 2s;
    idem::RedisOptions options;
    options.lease = 500ms;  // leases orphaned by the kill expire quickly
    idem::RedisStore store(endpoint, options);
    auto handler =
        idem::make_handler(store, idem::Policy{"capture"}, [](auto& tx, const std::string& order) {
            tx.write("HINCRBY", "applied", order, 1);
            tx.write("SADD", "orders", order);
        });

    // The broker: unacked messages come back (with a higher count) until they are acked.
    std::vector<std::uint32_t> deliveries(kMessages, 0);
    std::vector<int> pending;
    for (int i = 0; i < kMessages; ++i)
        pending.push_back(i);
    std::atomic<int> handled{0};
    std::atomic<bool> killed{false};
    std::thread chaos([&] {
        // In the middle of the run, at a moment the handlers do not choose.
        while (handled.load() < kMessages / 2)
            std::this_thread::yield();
        server_->kill9();
        killed = true;
        std::this_thread::sleep_for(300ms);
        server_->start();
    });
    int failed = 0;
    const auto deadline = std::chrono::steady_clock::now() + 120s;
    while (!pending.empty() && std::chrono::steady_clock::now() < deadline) {
        std::vector<int> next;
        for (int i : pending) {
            const std::string id = "order-" + std::to_string(i);
            auto outcome = handler.handle(Delivery{id, ++deliveries[i]}, id);
            ++handled;
            if (idem::should_ack(outcome)) {
                EXPECT_TRUE(outcome.disposition == Disposition::processed ||
                            outcome.disposition == Disposition::duplicate)
                    << id << ": " << outcome.reason;
            } else {
                ++failed;
                next.push_back(i);
            }
        }
        pending = std::move(next);
        if (!pending.empty()) std::this_thread::sleep_for(50ms);
    }
    chaos.join();
    ASSERT_TRUE(killed);
    EXPECT_TRUE(pending.empty()) << pending.size() << " messages never acked";
    EXPECT_GT(failed, 0) << "the kill happened after the run: it proved nothing";

    idem_test::RedisClient check(server_->host(), server_->port());
    EXPECT_EQ(check.integer({"SCARD", "orders"}), kMessages);
    EXPECT_EQ(check.integer({"HLEN", "applied"}), kMessages);
    for (int i = 0; i < kMessages; ++i) {
        const std::string id = "order-" + std::to_string(i);
        EXPECT_EQ(check.str({"HGET", "applied", id}), "1") << id << " applied more than once";
    }
    EXPECT_TRUE(store.dead_letters().empty());
}

}  // namespace

// ---- retention after a takeover -----------------------------------------------------------------

TEST_F(RedisServerClockTest, ATakeoverRestartsTheRetentionAndKeepsTheFirstClaimedAt) {
    auto a = worker();
    const idem::ClaimTerms terms{30s, idem::days(14)};
    {
        auto tx = a->begin();
        tx.set_terms(terms);
        ASSERT_EQ(tx.claim("pay", "m-1", "fp-1").status, ClaimStatus::claimed);
    }  // rolled back: released, the record (and its expiry) stays
    const auto first = a->find_claim("pay", "m-1");
    ASSERT_FALSE(first.has_value());  // released
    // The record has aged: ten days of its retention are gone.
    const std::string key = claim_key("pay", "m-1");
    const std::int64_t four_days_ms = idem::days(4) / 1ms;
    client().exec({"PEXPIRE", key, std::to_string(four_days_ms)});
    const std::string before = *client().str({"GET", key});

    auto tx = a->begin();
    tx.set_terms(terms);
    ASSERT_EQ(tx.claim("pay", "m-1", "fp-2").status, ClaimStatus::claimed);  // the takeover
    tx.commit();
    // The retention counts again from the takeover (the latest delivery), not from claimed_at.
    const std::int64_t left = *client().integer({"PTTL", key});
    EXPECT_GT(left, idem::days(14) / 1ms - 60'000) << "the takeover kept the old expiry";
    const std::int64_t expires_at = *client().integer({"PEXPIRETIME", key});
    EXPECT_NEAR(static_cast<double>(expires_at),
                static_cast<double>(server_ms() + idem::days(14) / 1ms), 60'000.0);
    // claimed_at stays the first claim's (as resolved before the takeover), attempts go on.
    auto record = idem::detail::RedisClaimRecord::decode(*client().str({"GET", key}));
    ASSERT_TRUE(record.has_value());
    auto old_record = idem::detail::RedisClaimRecord::decode(before);
    ASSERT_TRUE(old_record.has_value());
    EXPECT_EQ(old_record->state, "free");
    EXPECT_EQ(record->attempts, 2u);
    EXPECT_EQ(record->fingerprint, "fp-2");
    EXPECT_FALSE(record->times_before_expiry.has_value());  // the takeover writes numbers
    const auto claim = a->find_claim("pay", "m-1");
    ASSERT_TRUE(claim.has_value());
    // The record says its first claim was ten days ago (its expiry minus the retention, as the SET
    // claim stores it): the takeover keeps that, it does not restart claimed_at.
    const std::int64_t ten_days_ago = server_ms() - idem::days(10) / 1ms;
    EXPECT_NEAR(static_cast<double>(idem::detail::to_unix_ms(claim->claimed_at)),
                static_cast<double>(ten_days_ago), 60'000.0);
    EXPECT_EQ(record->claimed_at, idem::detail::to_unix_ms(claim->claimed_at));
}

// ---- persistence --------------------------------------------------------------------------------

TEST(RedisPersistenceTest, AServerWithoutAofIsRefusedUnlessTheRiskIsAccepted) {
    IDEM_REQUIRE_REDIS();
    idem_test::RedisServer volatile_server{idem_test::RedisServer::no_aof};
    const idem::RedisEndpoint endpoint = idem_test::redis_endpoint(volatile_server);

    // A server that answers: the store does not even construct.
    try {
        idem::RedisStore refusing(endpoint);
        ADD_FAILURE() << "a store on a server without AOF started";
    } catch (const idem::usage_error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("accept_no_persistence"), std::string::npos) << what;
        EXPECT_NE(what.find("append-only"), std::string::npos) << what;
    }
    // A server that was down when the store was made: every message fails (nothing claimed,
    // nothing acked) and says why.
    volatile_server.stop();
    idem::RedisEndpoint quick = endpoint;
    quick.connect_timeout = 500ms;
    idem::RedisStore refusing(quick);
    EXPECT_FALSE(refusing.persistence().has_value());
    volatile_server.start();
    auto handler = idem::make_handler(
        refusing, idem::Policy{"p"}, [](auto& tx, const std::string& b) { tx.write("SET", b, 1); });
    for (int attempt = 1; attempt <= 2; ++attempt) {
        auto outcome =
            handler.handle(Delivery{"m-1", static_cast<std::uint32_t>(attempt)}, std::string("k"));
        EXPECT_EQ(outcome.disposition, Disposition::failed);
        EXPECT_FALSE(idem::should_ack(outcome));
        EXPECT_NE(outcome.reason.find("accept_no_persistence"), std::string::npos)
            << outcome.reason;
    }
    EXPECT_THROW((void)refusing.begin().claim("p", "m-1"), idem::usage_error);
    ASSERT_TRUE(refusing.persistence().has_value());
    EXPECT_FALSE(refusing.persistence()->aof_enabled);
    idem_test::RedisClient raw = volatile_server.client();
    EXPECT_EQ(*raw.integer({"DBSIZE"}), 0);  // nothing was claimed or written

    idem::RedisOptions accept;
    accept.accept_no_persistence = true;
    idem::RedisStore accepting(endpoint, accept);
    auto ok = idem::make_handler(accepting, idem::Policy{"p"},
                                 [](auto& tx, const std::string& b) { tx.write("SET", b, 1); });
    EXPECT_EQ(ok.handle(Delivery{"m-1", 1u}, std::string("k")).disposition, Disposition::processed);
    EXPECT_FALSE(accepting.persistence().has_value());  // not checked at all
}

TEST_F(RedisStoreTest, AnAofServerIsAcceptedAndAServerHidingConfigToo) {
    auto claim_once = [](idem::RedisStore& s, const std::string& id) {
        auto tx = s.begin();
        auto claim = tx.claim("p", id);
        tx.commit();
        return claim.status;
    };
    idem::RedisStore plain(store().endpoint());
    EXPECT_EQ(claim_once(plain, "a"), ClaimStatus::claimed);
    ASSERT_TRUE(plain.persistence().has_value());
    EXPECT_TRUE(plain.persistence()->aof_enabled);
    EXPECT_EQ(plain.persistence()->appendfsync, "always");

    // A user that may not run CONFIG (as with rename-command CONFIG ""): INFO is enough.
    client().exec(
        {"ACL", "SETUSER", "idem-noconfig", "reset", "on", ">pw", "~*", "&*", "+@all", "-config"});
    idem::RedisEndpoint limited = store().endpoint();
    limited.username = "idem-noconfig";
    limited.password = "pw";
    idem::RedisStore no_config(limited);
    EXPECT_EQ(claim_once(no_config, "b"), ClaimStatus::claimed);
    ASSERT_TRUE(no_config.persistence().has_value());
    EXPECT_TRUE(no_config.persistence()->aof_enabled);
    EXPECT_EQ(no_config.persistence()->appendfsync, "");

    // A user that may not run INFO either: the store cannot tell, so it refuses and says why.
    client().exec({"ACL", "SETUSER", "idem-noinfo", "reset", "on", ">pw", "~*", "&*", "+@all",
                   "-config", "-info"});
    limited.username = "idem-noinfo";
    try {
        idem::RedisStore no_info(limited);
        ADD_FAILURE() << "a store that could not read INFO started";
    } catch (const idem::usage_error& e) {
        EXPECT_NE(std::string(e.what()).find("accept_no_persistence"), std::string::npos)
            << e.what();
    }
    client().exec({"ACL", "DELUSER", "idem-noconfig", "idem-noinfo"});
}

// ---- the connection pool
// --------------------------------------------------------------------------

TEST_F(RedisStoreTest, WithAllConnectionsInUseACallWaitsThenTimesOut) {
    idem::RedisOptions options;
    options.max_connections = 1;
    options.pool_wait_timeout = 300ms;
    idem::RedisStore capped(store().endpoint(), options);
    std::mutex m;
    std::condition_variable cv;
    bool holding = false;
    bool let_go = false;
    std::thread holder([&] {
        capped.with_connection([&](idem::RedisConnection& c) {
            c.checked({"PING"}, "PING");
            std::unique_lock<std::mutex> lock(m);
            holding = true;
            cv.notify_all();
            cv.wait_for(lock, 60s, [&] { return let_go; });
            return 0;
        });
    });
    {
        std::unique_lock<std::mutex> lock(m);
        ASSERT_TRUE(cv.wait_for(lock, 30s, [&] { return holding; }));
    }
    auto tx = capped.begin();
    const auto started = std::chrono::steady_clock::now();
    EXPECT_THROW((void)tx.claim("p", "m-1"), idem::store_timeout);
    EXPECT_GE(std::chrono::steady_clock::now() - started, 250ms);
    {
        std::lock_guard<std::mutex> lock(m);
        let_go = true;
    }
    cv.notify_all();
    holder.join();
    // Given back: the next call gets it.
    EXPECT_EQ(tx.claim("p", "m-1").status, ClaimStatus::claimed);
    // And a waiter is woken by the give-back, not by its timeout.
    idem::RedisOptions patient = options;
    patient.pool_wait_timeout = 60s;
    idem::RedisStore one(store().endpoint(), patient);
    std::atomic<bool> held{false};
    std::thread second([&] {
        one.with_connection([&](idem::RedisConnection& c) {
            held = true;
            std::this_thread::sleep_for(300ms);
            return c.checked({"PING"}, "PING");
        });
    });
    while (!held)
        std::this_thread::yield();
    const auto waited_from = std::chrono::steady_clock::now();
    auto reply =
        one.with_connection([](idem::RedisConnection& c) { return c.checked({"PING"}, "PING"); });
    EXPECT_EQ(reply.str, "PONG");
    EXPECT_LT(std::chrono::steady_clock::now() - waited_from, 30s);
    second.join();
}

TEST_F(RedisStoreTest, AnIdleConnectionKilledByTheServerIsReplacedBeforeReuse) {
    auto client_id = [](idem::RedisStore& s) {
        return s.with_connection([](idem::RedisConnection& c) {
            return c.checked({"CLIENT", "ID"}, "CLIENT ID").integer;
        });
    };
    auto run = [](idem::RedisStore& s, const std::string& id) {
        auto handler = idem::make_handler(
            s, idem::Policy{"ping"},
            [](auto& tx, const std::string& b) { tx.write("SADD", "pinged", b); });
        return handler.handle(Delivery{id, 1u}, id).disposition;
    };

    idem::RedisOptions pinging;
    pinging.ping_idle_after = 0ms;  // every reuse
    idem::RedisStore checked(store().endpoint(), pinging);
    ASSERT_EQ(run(checked, "m-1"), Disposition::processed);
    const long long first = client_id(checked);
    client().exec({"CLIENT", "KILL", "ID", std::to_string(first)});
    EXPECT_EQ(run(checked, "m-2"), Disposition::processed);  // the ping found it dead
    EXPECT_NE(client_id(checked), first);

    // Without the ping (idle for less than ping_idle_after), the dead connection fails the call.
    idem::RedisOptions lazy;
    lazy.ping_idle_after = std::chrono::hours(1);
    idem::RedisStore unchecked(store().endpoint(), lazy);
    ASSERT_EQ(run(unchecked, "m-3"), Disposition::processed);
    client().exec({"CLIENT", "KILL", "ID", std::to_string(client_id(unchecked))});
    EXPECT_EQ(run(unchecked, "m-4"), Disposition::failed);
    EXPECT_EQ(run(unchecked, "m-4"), Disposition::processed);  // reconnected after the failure
}
