// PostgresStore's batch claims (claim_many) against a real PostgreSQL server, and stores on
// several threads delivering the same ids, one by one and in batches, applying each effect once.

#include "support/postgres_test_env.hpp"

namespace idem_test::postgres_store {
namespace {

// ---- batch claims (claim_many) -------------------------------------------------------------

TEST_F(PostgresStoreTest, ABatchOfAHundredFreshIdsClaimsInOneRoundTrip) {
    constexpr std::size_t kBatch = 100;
    auto s = store();
    std::vector<std::string> names;
    for (std::size_t i = 0; i < 3 * kBatch; ++i)
        names.push_back("m-" + std::to_string(i));
    const auto ids_of = [&](std::size_t from) {
        return std::vector<std::string_view>(names.begin() + static_cast<long>(from),
                                             names.begin() + static_cast<long>(from + kBatch));
    };
    { auto warm_up = s->begin(); }  // an owned session sets its lock_timeout once, here
    {
        const auto before = s->round_trips();
        auto tx = s->begin();
        const auto claims = tx.claim_many("rt", ids_of(0), {});
        EXPECT_EQ(s->round_trips() - before, 1u);  // BEGIN + SAVEPOINT + one INSERT
        ASSERT_EQ(claims.size(), kBatch);
        for (const auto& claim : claims)
            EXPECT_EQ(claim.status, ClaimStatus::claimed);
        tx.commit();  // committed without outcomes: stored as claimed
        EXPECT_EQ(s->round_trips() - before, 2u);
    }
    EXPECT_EQ(count("SELECT count(*) FROM idem_claims WHERE outcome = 'claimed'"),
              static_cast<long long>(kBatch));

    // Through the handler: the claims, one round trip per effect statement, the commit.
    auto handler = idem::make_handler(*s, idem::Policy{"rt"}, writer());
    const auto batch = [&](std::size_t from) {
        std::vector<Delivery> deliveries;
        std::vector<std::string> bodies;
        for (std::size_t i = from; i < from + kBatch; ++i) {
            deliveries.push_back(Delivery{names[i], 1u});
            bodies.push_back(names[i]);
        }
        const auto before = s->round_trips();
        const auto outcomes = handler.handle_batch(deliveries, bodies);
        return std::make_pair(outcomes, s->round_trips() - before);
    };
    auto [processed, fresh_trips] = batch(kBatch);
    for (const auto& outcome : processed)
        EXPECT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
    EXPECT_EQ(fresh_trips, 1 + kBatch + 1);
    EXPECT_EQ(count("SELECT count(*) FROM effects"), static_cast<long long>(kBatch));
    EXPECT_EQ(count("SELECT count(*) FROM idem_claims WHERE outcome = 'processed'"),
              static_cast<long long>(kBatch));
    // All duplicates: the INSERT, one SELECT of the stored outcomes, ROLLBACK.
    auto [duplicates, duplicate_trips] = batch(kBatch);
    for (const auto& outcome : duplicates)
        EXPECT_EQ(outcome.disposition, Disposition::duplicate) << outcome.reason;
    EXPECT_EQ(duplicate_trips, 3u);
    // An effect without SQL: the claims and the commit (the savepoints travel with them).
    auto quiet = idem::make_handler(*s, idem::Policy{"rt"}, [](auto&, const std::string&) {});
    std::vector<Delivery> deliveries;
    for (std::size_t i = 2 * kBatch; i < 3 * kBatch; ++i)
        deliveries.push_back(Delivery{names[i], 1u});
    const auto before = s->round_trips();
    const std::vector<std::string> bodies(kBatch, "body");
    for (const auto& outcome : quiet.handle_batch(deliveries, bodies))
        EXPECT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
    EXPECT_EQ(s->round_trips() - before, 2u);
}

TEST_F(PostgresStoreTest, ClaimManyAnswersAsClaimingOneByOneWould) {
    auto s = store(clocked());
    {
        auto tx = s->begin();
        ASSERT_EQ(tx.claim("batch", "done", "fp-done").status, ClaimStatus::claimed);
        tx.record_outcome("batch", "done", Disposition::processed, "");
        ASSERT_EQ(tx.claim("batch", "refused", "fp-refused").status, ClaimStatus::claimed);
        tx.record_outcome("batch", "refused", Disposition::rejected, "stale");
        ASSERT_EQ(tx.claim("batch", "bare").status, ClaimStatus::claimed);  // no outcome
        ASSERT_EQ(tx.claim("other-scope", "new-1").status, ClaimStatus::claimed);
        tx.commit();
    }
    auto tx = s->begin();
    ASSERT_EQ(tx.claim("batch", "mine", "fp-mine").status, ClaimStatus::claimed);
    const std::vector<std::string_view> ids = {"new-1",   "done", "new-1", "mine",
                                               "refused", "bare", "new-2", "done"};
    const std::vector<std::string> fingerprints = {"fp-1", "fp-x", "fp-1b", "fp-y",
                                                   "fp-z", "",     "fp-2",  "fp-w"};
    EXPECT_THROW((void)tx.claim_many("batch", ids, {"one"}), idem::usage_error);
    const auto before = s->round_trips();
    const auto claims = tx.claim_many("batch", ids, fingerprints);
    EXPECT_EQ(s->round_trips() - before, 2u);  // the INSERT, the stored outcomes
    ASSERT_EQ(claims.size(), ids.size());
    const auto expect = [&](std::size_t i, ClaimStatus status, Disposition recorded,
                            const std::string& fingerprint) {
        EXPECT_EQ(claims[i].status, status) << i;
        if (status == ClaimStatus::duplicate) {
            EXPECT_EQ(claims[i].recorded, recorded) << i;
            EXPECT_EQ(claims[i].fingerprint, fingerprint) << i;
        }
    };
    expect(0, ClaimStatus::claimed, {}, "");
    expect(1, ClaimStatus::duplicate, Disposition::processed, "fp-done");
    expect(2, ClaimStatus::duplicate, Disposition::in_progress, "fp-1");  // this batch's own
    expect(3, ClaimStatus::duplicate, Disposition::in_progress, "fp-mine");
    expect(4, ClaimStatus::duplicate, Disposition::rejected, "fp-refused");
    expect(5, ClaimStatus::duplicate, Disposition::in_progress, "");  // committed without outcome
    expect(6, ClaimStatus::claimed, {}, "");
    expect(7, ClaimStatus::duplicate, Disposition::processed, "fp-done");
    // Claimed again in the same transaction, one by one or in a batch: its own duplicates.
    EXPECT_EQ(tx.claim("batch", "new-2").recorded, Disposition::in_progress);
    const auto again = tx.claim_many("batch", {"new-1", "new-3"}, {});
    EXPECT_EQ(again[0].status, ClaimStatus::duplicate);
    EXPECT_EQ(again[1].status, ClaimStatus::claimed);
    // Given back: its row goes (queued); not ours: nothing happens.
    tx.unclaim("batch", "new-2");
    tx.unclaim("batch", "done");
    tx.record_outcome("batch", "new-1", Disposition::processed, "");
    tx.commit();
    EXPECT_FALSE(s->find_claim("batch", "new-2").has_value());
    EXPECT_EQ(s->find_claim("batch", "done")->disposition, Disposition::processed);
    EXPECT_EQ(s->find_claim("batch", "new-1")->disposition, Disposition::processed);
    EXPECT_EQ(s->find_claim("batch", "new-1")->fingerprint, "fp-1");
    EXPECT_EQ(s->find_claim("batch", "new-1")->claimed_at, now());
    EXPECT_EQ(s->find_claim("batch", "new-3")->disposition, Disposition::in_progress);
    EXPECT_EQ(s->find_claim("batch", "new-3")->fingerprint, "");
    EXPECT_EQ(s->find_claim("batch", "mine")->disposition, Disposition::in_progress);
    // done, refused, bare, mine, new-1, new-3 (new-2 was given back)
    EXPECT_EQ(count("SELECT count(*) FROM idem_claims WHERE scope = 'batch'"), 6);
}

TEST_F(PostgresStoreTest, ABatchWaitsForAConcurrentClaimAndSeesItsCommittedOutcome) {
    auto first = store();
    auto second = store();
    auto held = first->begin();
    ASSERT_EQ(held.claim("capture", "m-2", "fp").status, ClaimStatus::claimed);
    auto waiting = std::async(std::launch::async, [&] {
        auto tx = second->begin();
        auto claims = tx.claim_many("capture", {"m-1", "m-2", "m-3"}, {});
        tx.commit();
        return claims;
    });
    EXPECT_EQ(waiting.wait_for(300ms), std::future_status::timeout);  // blocked on m-2
    held.record_outcome("capture", "m-2", Disposition::rejected, "no");
    held.commit();
    const auto claims = waiting.get();
    EXPECT_EQ(claims[0].status, ClaimStatus::claimed);
    EXPECT_EQ(claims[1].status, ClaimStatus::duplicate);  // committed while the INSERT waited
    EXPECT_EQ(claims[1].recorded, Disposition::rejected);
    EXPECT_EQ(claims[1].fingerprint, "fp");
    EXPECT_EQ(claims[2].status, ClaimStatus::claimed);
    EXPECT_EQ(count("SELECT count(*) FROM idem_claims"), 3);
}

TEST_F(PostgresStoreTest, ABatchWithDuplicatesAFailureAndAHeldIdCommitsTheRest) {
    auto holder = store();
    idem::PostgresOptions impatient;
    impatient.lock_timeout = 200ms;
    auto s = store(impatient);
    auto handler =
        idem::make_handler(*s, idem::Policy{"capture"}, [](auto& tx, const std::string& body) {
            tx.execute("INSERT INTO effects(message_id) VALUES ($1)", idem::Blob{body});
            if (body == "throws") throw std::runtime_error("gateway 503");
            if (body == "bad-sql") tx.execute("INSERT INTO no_such_table VALUES (1)");
        });
    ASSERT_EQ(handler.handle(Delivery{"m-done", 1u}, std::string("done")).disposition,
              Disposition::processed);
    auto held = holder->begin();  // another worker holds m-held and stays open
    ASSERT_EQ(held.claim("capture", "m-held").status, ClaimStatus::claimed);

    const std::vector<Delivery> deliveries = {{"m-1", 1u},       {"m-done", 2u},  {"m-held", 1u},
                                              {"m-1", 1u},       {"m-throw", 1u}, {"m-2", 1u},
                                              {"m-bad-sql", 1u}, {"m-held", 2u}};
    const std::vector<std::string> bodies = {"ok-1",   "done", "held",    "ok-1",
                                             "throws", "ok-2", "bad-sql", "held"};
    const auto started = std::chrono::steady_clock::now();
    const auto outcomes = handler.handle_batch(deliveries, bodies);
    const auto waited = std::chrono::steady_clock::now() - started;
    const std::vector<Disposition> expected = {Disposition::processed,   Disposition::duplicate,
                                               Disposition::in_progress, Disposition::duplicate,
                                               Disposition::failed,      Disposition::processed,
                                               Disposition::failed,      Disposition::in_progress};
    ASSERT_EQ(outcomes.size(), expected.size());
    for (std::size_t i = 0; i < expected.size(); ++i)
        EXPECT_EQ(outcomes[i].disposition, expected[i]) << i << ": " << outcomes[i].reason;
    // The batch's INSERT waited once, then m-held alone once more; its second copy not again.
    EXPECT_GE(waited, 400ms);
    EXPECT_LT(waited, 5s);
    // Committed together: the two processed messages (and the earlier one); the failed ones
    // gave their claims back, the held one was never ours.
    EXPECT_EQ(count("SELECT count(*) FROM effects"), 3);
    EXPECT_EQ(s->find_claim("capture", "m-1")->disposition, Disposition::processed);
    EXPECT_EQ(s->find_claim("capture", "m-2")->disposition, Disposition::processed);
    EXPECT_FALSE(s->find_claim("capture", "m-throw").has_value());
    EXPECT_FALSE(s->find_claim("capture", "m-bad-sql").has_value());
    EXPECT_FALSE(s->find_claim("capture", "m-held").has_value());
    held.rollback();  // the other worker gave up: the redeliveries run once
    const auto again =
        handler.handle_batch(std::vector<Delivery>{{"m-held", 3u}, {"m-throw", 2u}, {"m-1", 2u}},
                             std::vector<std::string>{"held", "ok-3", "ok-1"});
    EXPECT_EQ(again[0].disposition, Disposition::processed) << again[0].reason;
    EXPECT_EQ(again[1].disposition, Disposition::processed) << again[1].reason;
    EXPECT_EQ(again[2].disposition, Disposition::duplicate) << again[2].reason;
    EXPECT_EQ(count("SELECT count(*) FROM effects"), 5);
}

// ---- exactly once under threads ------------------------------------------------------------

// Each run twice: on one claims table (its unique key) and on claims in partitions (each id's
// advisory lock; no unique key spans partitions).
class PostgresRaceTest : public PostgresStoreTest {
  protected:
    static idem::PostgresOptions partitioned(idem::PostgresOptions options = {}) {
        options.claim_partition_span = std::chrono::hours(24);
        return options;
    }
    void eight_stores_deliver_the_same_ids(const idem::PostgresOptions& options);
    void four_stores_deliver_the_same_ids_in_batches(idem::PostgresOptions options);
};

TEST_F(PostgresRaceTest, EightStoresDeliveringTheSameThousandIdsApplyEachEffectOnce) {
    eight_stores_deliver_the_same_ids({});
}
TEST_F(PostgresRaceTest, EightStoresOnPartitionedClaimsApplyEachEffectOnce) {
    eight_stores_deliver_the_same_ids(partitioned());
}
TEST_F(PostgresRaceTest, FourStoresDeliveringTheSameIdsInBatchesApplyEachEffectOnce) {
    four_stores_deliver_the_same_ids_in_batches({});
}
TEST_F(PostgresRaceTest, FourStoresOnPartitionedClaimsInBatchesApplyEachEffectOnce) {
    four_stores_deliver_the_same_ids_in_batches(partitioned());
}

void PostgresRaceTest::eight_stores_deliver_the_same_ids(const idem::PostgresOptions& options) {
    constexpr int kThreads = 8;
    constexpr int kIds = 1000;
    idem::PolicyOptions patient;
    patient.max_deliveries = 1000;  // a lock timeout is a retry, not a step towards poison
    std::atomic<long> processed{0}, duplicates{0}, retried{0};
    std::mutex mutex;
    std::condition_variable start;
    bool go = false;
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            PostgresStore s(conninfo(), options);
            auto handler = idem::make_handler(s, idem::Policy{"capture", patient}, writer());
            std::vector<int> order(kIds);
            for (int i = 0; i < kIds; ++i)
                order[static_cast<std::size_t>(i)] = i;
            std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(t)));
            {
                std::unique_lock<std::mutex> lock(mutex);
                start.wait(lock, [&] { return go; });
            }
            for (int i : order) {
                const std::string id = "msg-" + std::to_string(i);
                for (std::uint32_t delivery = 1;; ++delivery) {
                    auto outcome = handler.handle(Delivery{id, delivery}, id);
                    if (outcome.disposition == Disposition::processed) ++processed;
                    if (outcome.disposition == Disposition::duplicate) ++duplicates;
                    if (idem::should_ack(outcome)) break;
                    ++retried;
                }
            }
        });
    }
    {
        std::lock_guard<std::mutex> lock(mutex);
        go = true;
    }
    start.notify_all();
    for (auto& thread : threads)
        thread.join();
    expect_each_effect_once(kIds, kThreads, processed, duplicates, retried, "8 stores x 1,000 ids");
}

void PostgresRaceTest::four_stores_deliver_the_same_ids_in_batches(idem::PostgresOptions options) {
    // Overlapping batches wait on one another's claims; a lock_timeout shorter than a batch's
    // effects makes some of them give up (in_progress after claiming one by one), and those ids
    // are redelivered later.
    constexpr int kThreads = 4;
    constexpr int kIds = 400;
    constexpr std::size_t kBatch = 20;
    idem::PolicyOptions patient;
    patient.max_deliveries = 100000;
    idem::PostgresOptions impatient = std::move(options);
    impatient.lock_timeout = 20ms;
    std::atomic<long> processed{0}, duplicates{0}, retried{0};
    // Opened one after another: the first creates the idem schema, and a store opening while
    // another creates it would wait on that for no longer than this test's short lock_timeout.
    std::vector<std::unique_ptr<PostgresStore>> stores;
    for (int t = 0; t < kThreads; ++t)
        stores.push_back(store(impatient));
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            PostgresStore& s = *stores[static_cast<std::size_t>(t)];
            auto handler = idem::make_handler(
                s, idem::Policy{"capture", patient}, [](auto& tx, const std::string& body) {
                    std::this_thread::sleep_for(1ms);
                    tx.execute("INSERT INTO effects(message_id) VALUES ($1)", idem::Blob{body});
                });
            std::vector<std::string> todo;
            for (int i = 0; i < kIds; ++i)
                todo.push_back("msg-" + std::to_string(i));
            std::shuffle(todo.begin(), todo.end(), std::mt19937(static_cast<unsigned>(t)));
            std::uint32_t delivery = 0;
            while (!todo.empty()) {
                ++delivery;
                std::vector<std::string> left;
                for (std::size_t from = 0; from < todo.size(); from += kBatch) {
                    const std::size_t to = std::min(todo.size(), from + kBatch);
                    std::vector<Delivery> deliveries;
                    std::vector<std::string> bodies(todo.begin() + static_cast<long>(from),
                                                    todo.begin() + static_cast<long>(to));
                    for (const auto& id : bodies)
                        deliveries.push_back(Delivery{id, delivery});
                    const auto outcomes = handler.handle_batch(deliveries, bodies);
                    for (std::size_t k = 0; k < outcomes.size(); ++k) {
                        if (outcomes[k].disposition == Disposition::processed) ++processed;
                        if (outcomes[k].disposition == Disposition::duplicate) ++duplicates;
                        if (!idem::should_ack(outcomes[k])) {
                            ++retried;
                            left.push_back(bodies[k]);
                        }
                    }
                }
                todo = std::move(left);
            }
        });
    }
    for (auto& thread : threads)
        thread.join();
    expect_each_effect_once(kIds, kThreads, processed, duplicates, retried,
                            "4 stores x 400 ids in batches of 20");
}

}  // namespace
}  // namespace idem_test::postgres_store
