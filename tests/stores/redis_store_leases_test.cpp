// RedisStore's leases against a real redis-server: live and expired leases, fenced
// completion, the poison limit counting attempts rather than redeliveries, the fourth field
// note's refund race, and Redis-side writes committing with the claim.

#include "support/redis_store_test_env.hpp"

namespace idem_test::redis_store {
namespace {

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

// in_progress carries what is left of the holder's lease (the claim script computes it), so a
// consumer can nack with that delay; the handler's outcome passes it on.
TEST_F(RedisStoreTest, InProgressCarriesTheLeasesRemainingTimeAsRetryAfter) {
    auto b = other_worker();
    auto a_tx = store().begin();
    a_tx.set_terms(idem::ClaimTerms{30s, idem::days(14)});
    ASSERT_EQ(a_tx.claim("refund", "m-1").status, ClaimStatus::claimed);
    now() += 12s;
    {
        auto b_tx = b->begin();
        b_tx.set_terms(idem::ClaimTerms{30s, idem::days(14)});
        auto held = b_tx.claim("refund", "m-1");
        ASSERT_EQ(held.status, ClaimStatus::in_progress);
        EXPECT_EQ(held.retry_after, std::optional<std::chrono::milliseconds>(18s));
    }
    idem::PolicyOptions options;
    options.lease = 30s;
    auto handler = idem::make_handler(
        *b, idem::Policy{"refund", options},
        [](auto& tx, const std::string& body) { tx.write("SADD", "refunded", body); });
    now() += 5s;
    auto outcome = handler.handle(Delivery{"m-1", 2u}, std::string("r"));
    EXPECT_EQ(outcome.disposition, Disposition::in_progress);
    EXPECT_EQ(outcome.retry_after, std::optional<std::chrono::milliseconds>(13s));
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
            EXPECT_EQ(stored->lease_until(), idem::to_unix_ms(now() + 5s));
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

TEST_F(RedisStoreTest, AnXackWriteIsPartOfTheTransaction) {
    client().exec({"XGROUP", "CREATE", "orders", "workers", "$", "MKSTREAM"});
    auto entry = client().str({"XADD", "orders", "*", "order", "1"});
    ASSERT_TRUE(entry.has_value());
    auto run = [&](std::vector<std::string> command) {
        return store().with_connection(
            [&](idem::redis::Connection& c) { return c.checked(command, command[0]); });
    };
    run({"XREADGROUP", "GROUP", "workers", "w1", "COUNT", "1", "STREAMS", "orders", ">"});
    auto pending = [&] { return run({"XPENDING", "orders", "workers"}).elements.at(0).integer; };
    ASSERT_EQ(pending(), 1);
    {
        auto tx = store().begin();
        ASSERT_EQ(tx.claim("s", "m-1").status, ClaimStatus::claimed);
        tx.write("XACK", "orders", "workers", *entry);
    }  // rolled back: not acked
    EXPECT_EQ(pending(), 1);
    auto tx = store().begin();
    ASSERT_EQ(tx.claim("s", "m-1").status, ClaimStatus::claimed);
    tx.write("XACK", "orders", "workers", *entry);
    tx.record_outcome("s", "m-1", Disposition::processed, "");
    tx.commit();
    EXPECT_EQ(pending(), 0);
}

}  // namespace
}  // namespace idem_test::redis_store
