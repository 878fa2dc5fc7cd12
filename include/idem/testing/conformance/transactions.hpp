#pragma once
/// @file
/// @brief The conformance tests of transactions: rollback and savepoints, purge, threads racing,
/// batches.
/// Part of idem/testing/conformance.hpp, which registers the suite; include that one.

#include "idem/testing/conformance/suite.hpp"

TYPED_TEST_P(IdemStoreConformance, TransactionRollsBackWhenDroppedAndSavepointsNest) {
    {
        auto tx = this->store().begin();
        EXPECT_EQ(tx.claim("s", "dropped").status, idem::ClaimStatus::claimed);
        TypeParam::write_effect(tx, "dropped");
    }  // destructor: rollback
    EXPECT_FALSE(this->store().find_claim("s", "dropped").has_value());
    EXPECT_EQ(this->env.effect_rows(), 0u);
    {
        auto tx = this->store().begin();
        EXPECT_EQ(tx.claim("s", "kept").status, idem::ClaimStatus::claimed);
        tx.savepoint();
        TypeParam::write_effect(tx, "undone");
        tx.rollback_to_savepoint();
        tx.savepoint();
        TypeParam::write_effect(tx, "kept");
        tx.release_savepoint();
        tx.record_outcome("s", "kept", idem::Disposition::processed, "");
        tx.commit();
    }
    EXPECT_TRUE(this->store().find_claim("s", "kept").has_value());
    EXPECT_TRUE(this->env.has_effect("kept"));
    EXPECT_FALSE(this->env.has_effect("undone"));
}

TYPED_TEST_P(IdemStoreConformance, ClaimInsideOneTransactionSeesItsOwnClaimAsDuplicate) {
    auto tx = this->store().begin();
    EXPECT_EQ(tx.claim("s", "id").status, idem::ClaimStatus::claimed);
    EXPECT_EQ(tx.claim("s", "id").status, idem::ClaimStatus::duplicate);
}

TYPED_TEST_P(IdemStoreConformance, PurgeRemovesOnlyClaimsOlderThanTheRetention) {
    auto handler = this->writer();
    idem::PolicyOptions park_at_once;  // the first attempt is already the limit, on any store
    park_at_once.max_deliveries = 1;
    auto poison = this->writer("conformance", park_at_once);
    ASSERT_EQ(handler.handle(idem::Delivery{"old", 1u}, std::string("a")).disposition,
              idem::Disposition::processed);
    ASSERT_EQ(poison.handle(idem::Delivery{"old-poison", 9u}, std::string("p")).disposition,
              idem::Disposition::dead_lettered);
    this->env.now += idem::days(10);
    ASSERT_EQ(handler.handle(idem::Delivery{"young", 1u}, std::string("b")).disposition,
              idem::Disposition::processed);
    this->env.now += idem::days(5);  // "old" is 15 days old, "young" 5 days

    const auto retention = handler.policy().retention();   // 14 days
    EXPECT_EQ(this->store().purge(retention).claims, 2u);  // "old" and "old-poison"
    EXPECT_FALSE(this->store().find_claim("conformance", "old").has_value());
    EXPECT_TRUE(this->store().find_claim("conformance", "young").has_value());
    EXPECT_EQ(this->store().dead_letters().size(), 1u);  // dead letters are for humans: kept
    EXPECT_EQ(this->store().purge(retention).claims, 0u);
    // Exactly at the boundary nothing goes: only strictly older claims are purged.
    this->env.now += idem::days(9);
    EXPECT_EQ(this->store().purge(retention).claims, 0u);
    this->env.now += std::chrono::milliseconds(1);
    constexpr auto granularity = TestFixture::purge_granularity;
    if constexpr (granularity.count() > 0) {
        // Purged a span at a time: "young" opened its span, which goes once all of it expired.
        EXPECT_EQ(this->store().purge(retention).claims, 0u);
        EXPECT_TRUE(this->store().find_claim("conformance", "young").has_value());
        this->env.now += granularity - std::chrono::milliseconds(2);
        EXPECT_EQ(this->store().purge(retention).claims, 0u);
        this->env.now += std::chrono::milliseconds(1);
    }
    EXPECT_EQ(this->store().purge(retention).claims, 1u);
}

TYPED_TEST_P(IdemStoreConformance, PurgeRemovesExpiredLocksButNotLiveOnes) {
    if constexpr (!TestFixture::has_overlap_lock) {
        GTEST_SKIP()
            << "the store has no overlap lock (Tx::try_lock, Store::hold_lock/release_lock)";
    } else {
        using std::chrono::milliseconds;
        auto& store = this->store();
        const auto t0 = this->env.now;
        ASSERT_TRUE(store.hold_lock("invoice-1", "batch", std::chrono::minutes(1)));
        const auto retention = idem::days(14);
        // At t0 + 1 min the lock's expires_at is now, not before it: kept.
        this->env.now = t0 + std::chrono::minutes(1);
        EXPECT_EQ(store.purge(retention).expired_locks, 0u);

        this->env.now = t0 + std::chrono::minutes(1) + milliseconds(1);
        ASSERT_TRUE(store.hold_lock("invoice-2", "live-job", idem::days(30)));
        auto expired = store.purge(retention);
        EXPECT_EQ(expired.claims, 0u);
        EXPECT_EQ(expired.expired_locks, 1u);  // "invoice-1", whatever the retention

        this->env.now = t0 + idem::days(15);
        EXPECT_EQ(store.purge(retention).expired_locks, 0u);
        // The live lock survived both purges: another owner is still refused.
        EXPECT_FALSE(store.hold_lock("invoice-2", "other-job", std::chrono::minutes(1)));
        EXPECT_TRUE(store.release_lock("invoice-2", "live-job"));
        // The purged lock's key is free.
        EXPECT_TRUE(store.hold_lock("invoice-1", "next-batch", std::chrono::minutes(1)));
    }
}

TYPED_TEST_P(IdemStoreConformance, ConcurrentThreadsApplyEachEffectOnce) {
    auto handler = this->writer();
    constexpr int kThreads = 4;
    constexpr int kIds = 100;
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&] {
            for (int i = 0; i < kIds; ++i) {
                auto id = "m-" + std::to_string(i);
                auto outcome = handler.handle(idem::Delivery{id, 1u}, id);
                // A lease store answers in_progress while another thread holds the lease; the
                // broker would redeliver, so the test does.
                for (std::uint32_t count = 2; outcome.disposition == idem::Disposition::in_progress;
                     ++count) {
                    std::this_thread::yield();
                    outcome = handler.handle(idem::Delivery{id, count}, id);
                }
                ASSERT_TRUE(outcome.disposition == idem::Disposition::processed ||
                            outcome.disposition == idem::Disposition::duplicate)
                    << outcome.reason;
            }
        });
    }
    for (auto& t : threads)
        t.join();
    EXPECT_EQ(this->env.effect_rows(), static_cast<std::size_t>(kIds));
    auto counters = handler.counters();
    EXPECT_EQ(counters.processed, static_cast<std::uint64_t>(kIds));
    EXPECT_EQ(counters.duplicates, static_cast<std::uint64_t>(kIds * (kThreads - 1)));
}

TYPED_TEST_P(IdemStoreConformance, BatchCommitsTogetherAndAFailingMessageRollsBackAlone) {
    auto seed = this->writer("batch");
    ASSERT_EQ(seed.handle(idem::Delivery{"m-done", 1u}, std::string("done")).disposition,
              idem::Disposition::processed);
    idem::PolicyOptions options;
    options.max_deliveries = 3;
    int runs = 0;
    auto handler =
        this->make(idem::Policy{"batch", options}, [&](auto& tx, const std::string& body) {
            ++runs;
            TypeParam::write_effect(tx, body);
            if (body == "throws") throw std::runtime_error("gateway 503");
            if (body == "defers") return idem::EffectResult::deferred("too early");
            if (body == "rejects") return idem::EffectResult::rejected("stale");
            if (body == "malformed") throw idem::malformed_message("no amount");
            return idem::EffectResult::applied();
        });
    const std::vector<idem::Delivery> deliveries = {
        idem::Delivery{"m-1", 1u},      idem::Delivery{"m-done", 2u},
        idem::Delivery{"m-throw", 1u},  idem::Delivery{"m-defer", 1u},
        idem::Delivery{"m-reject", 1u}, idem::Delivery{"", 1u},
        idem::Delivery{"m-bad", 1u},    idem::Delivery{"m-2", 1u},
        idem::Delivery{"m-1", 2u}};
    const std::vector<std::string> bodies = {"ok-1",  "done",      "throws", "defers", "rejects",
                                             "no-id", "malformed", "ok-2",   "ok-1"};
    auto outcomes = handler.handle_batch(deliveries, bodies);
    ASSERT_EQ(outcomes.size(), deliveries.size());
    const std::vector<idem::Disposition> expected = {
        idem::Disposition::processed,     idem::Disposition::duplicate,
        idem::Disposition::failed,        idem::Disposition::deferred,
        idem::Disposition::rejected,      idem::Disposition::dead_lettered,
        idem::Disposition::dead_lettered, idem::Disposition::processed,
        idem::Disposition::duplicate};
    for (std::size_t i = 0; i < expected.size(); ++i) {
        EXPECT_EQ(outcomes[i].disposition, expected[i]) << i << ": " << outcomes[i].reason;
    }
    EXPECT_EQ(runs, 6);  // m-done and the second m-1 are duplicates; "" never reaches the effect
    // Committed together: the two processed rows and the seed's; nothing of the others.
    EXPECT_EQ(this->env.effect_rows(), 3u);
    EXPECT_TRUE(this->env.has_effect("ok-1"));
    EXPECT_TRUE(this->env.has_effect("ok-2"));
    EXPECT_FALSE(this->store().find_claim("batch", "m-throw").has_value());
    EXPECT_FALSE(this->store().find_claim("batch", "m-defer").has_value());
    EXPECT_EQ(this->store().find_claim("batch", "m-reject")->disposition,
              idem::Disposition::rejected);
    EXPECT_EQ(this->store().find_claim("batch", "m-bad")->disposition,
              idem::Disposition::dead_lettered);
    EXPECT_EQ(this->store().dead_letters().size(), 2u);
    // The failed and deferred messages come back and run once.
    auto again = handler.handle_batch(std::vector<idem::Delivery>{{"m-throw", 2u}, {"m-defer", 2u}},
                                      std::vector<std::string>{"ok-3", "ok-4"});
    EXPECT_EQ(again[0].disposition, idem::Disposition::processed) << again[0].reason;
    EXPECT_EQ(again[1].disposition, idem::Disposition::processed) << again[1].reason;
    EXPECT_EQ(this->env.effect_rows(), 5u);
    EXPECT_EQ(handler.counters().processed, 4u);
}

// Batches larger than a store's claim chunk (SQLite: 64 rows per statement): an all-new batch,
// then one mixing new ids, ids committed before, ids repeated inside the batch and a failing
// message, with the repeats and the committed ids on both sides of the chunk boundaries.
TYPED_TEST_P(IdemStoreConformance, LargeBatchesClaimEachIdOnceAcrossChunks) {
    int runs = 0;
    auto handler = this->make(idem::Policy{"chunks"}, [&](auto& tx, const std::string& body) {
        ++runs;
        TypeParam::write_effect(tx, body);
        if (body == "b-throw") throw std::runtime_error("boom");
    });
    auto id = [](const char* prefix, int i) { return std::string(prefix) + std::to_string(i); };
    std::vector<idem::Delivery> first;
    std::vector<std::string> first_bodies;
    for (int i = 0; i < 130; ++i) {
        first.push_back(idem::Delivery{id("a-", i), 1u});
        first_bodies.push_back(id("a-", i));
    }
    for (const auto& outcome : handler.handle_batch(first, first_bodies)) {
        ASSERT_EQ(outcome.disposition, idem::Disposition::processed) << outcome.reason;
    }
    EXPECT_EQ(runs, 130);
    EXPECT_EQ(this->env.effect_rows(), 130u);

    std::vector<idem::Delivery> second;
    std::vector<std::string> bodies;
    std::vector<idem::Disposition> expected;
    for (int i = 0; i < 140; ++i) {
        if (i % 7 == 3 && i < 130) {  // committed by the first batch
            second.push_back(idem::Delivery{id("a-", i), 2u});
            bodies.push_back(id("a-", i));
            expected.push_back(idem::Disposition::duplicate);
        } else if (i % 11 == 5 && i >= 11) {  // a repeat of a new id earlier in this batch
            second.push_back(idem::Delivery{id("b-", i - 11), 2u});
            bodies.push_back(id("b-", i - 11));
            const bool earlier_is_new = (i - 11) % 7 != 3 && !((i - 11) % 11 == 5 && i - 11 >= 11);
            expected.push_back(earlier_is_new ? idem::Disposition::duplicate
                                              : idem::Disposition::processed);
        } else if (i == 70) {
            second.push_back(idem::Delivery{"b-throws", 1u});
            bodies.push_back("b-throw");
            expected.push_back(idem::Disposition::failed);
        } else {
            second.push_back(idem::Delivery{id("b-", i), 1u});
            bodies.push_back(id("b-", i));
            expected.push_back(idem::Disposition::processed);
        }
    }
    runs = 0;
    const auto outcomes = handler.handle_batch(second, bodies);
    ASSERT_EQ(outcomes.size(), second.size());
    std::size_t processed = 0;
    for (std::size_t i = 0; i < outcomes.size(); ++i) {
        EXPECT_EQ(outcomes[i].disposition, expected[i])
            << i << " " << second[i].message_id << ": " << outcomes[i].reason;
        if (expected[i] == idem::Disposition::processed) ++processed;
    }
    EXPECT_EQ(static_cast<std::size_t>(runs), processed + 1);  // + the one that threw
    EXPECT_EQ(this->env.effect_rows(), 130u + processed);
    EXPECT_FALSE(this->store().find_claim("chunks", "b-throws").has_value());
    for (std::size_t i = 0; i < second.size(); ++i) {
        if (expected[i] == idem::Disposition::failed) continue;
        const auto claim = this->store().find_claim("chunks", second[i].message_id);
        ASSERT_TRUE(claim.has_value()) << second[i].message_id;
        EXPECT_EQ(claim->disposition, idem::Disposition::processed) << second[i].message_id;
    }
}

TYPED_TEST_P(IdemStoreConformance, BatchWhoseCommitFailsAcksNothing) {
    if constexpr (!TestFixture::can_fail_commit) {
        GTEST_SKIP() << "the environment cannot make a commit fail (no make_commit_fail(tx))";
    } else {
        bool sabotage = true;
        auto handler = this->make(idem::Policy{"batch"}, [&](auto& tx, const std::string& body) {
            TypeParam::write_effect(tx, body);
            if (sabotage && body == "b") {
                this->env.make_commit_fail(tx);
            }
        });
        const std::vector<idem::Delivery> deliveries = {{"m-1", 1u}, {"m-2", 1u}, {"m-1", 1u}};
        const std::vector<std::string> bodies = {"a", "b", "a"};
        auto outcomes = handler.handle_batch(deliveries, bodies);
        for (const auto& outcome : outcomes) {
            EXPECT_EQ(outcome.disposition, idem::Disposition::failed) << outcome.reason;
            EXPECT_FALSE(idem::should_ack(outcome));
        }
        EXPECT_EQ(this->env.effect_rows(), 0u);
        EXPECT_FALSE(this->store().find_claim("batch", "m-1").has_value());
        sabotage = false;
        outcomes = handler.handle_batch(deliveries, bodies);
        EXPECT_EQ(outcomes[0].disposition, idem::Disposition::processed);
        EXPECT_EQ(outcomes[1].disposition, idem::Disposition::processed);
        EXPECT_EQ(outcomes[2].disposition, idem::Disposition::duplicate);
        EXPECT_EQ(this->env.effect_rows(), 2u);
    }
}

TYPED_TEST_P(IdemStoreConformance, EmptyBatchAndMismatchedSizes) {
    auto handler = this->writer();
    EXPECT_TRUE(
        handler.handle_batch(std::vector<idem::Delivery>{}, std::vector<std::string>{}).empty());
    EXPECT_THROW(
        handler.handle_batch(std::vector<idem::Delivery>{{"m", 1u}}, std::vector<std::string>{}),
        idem::usage_error);
}
