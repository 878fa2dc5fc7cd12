// PostgresStore against a real PostgreSQL server (tests/support/postgres_server.hpp): schema and
// versioning, claims and the wait on a concurrent claim, lock_timeout, lost connections and
// server restarts, commit failures, hostile values, purge, the overlap lock, the outbox with
// several relays, and 8 threads delivering the same 1,000 ids.

#include <gtest/gtest.h>
#include <libpq-fe.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/store/postgres.hpp"
#include "support/postgres_server.hpp"
#include "support/require_postgres.hpp"

namespace {

using idem::ClaimStatus;
using idem::Delivery;
using idem::Disposition;
using idem::PostgresStore;
using idem_test::PgConnection;
using namespace std::chrono_literals;

using time_point = std::chrono::system_clock::time_point;

class PostgresStoreTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_POSTGRES();
        server_ = &idem_test::shared_postgres();
        database_ = server_->fresh_database();
        exec(
            "CREATE TABLE effects(message_id BYTEA NOT NULL);"
            "CREATE TABLE parents(id INTEGER PRIMARY KEY);"
            "CREATE TABLE children(parent_id INTEGER REFERENCES parents(id) "
            "  DEFERRABLE INITIALLY DEFERRED);");
    }
    void TearDown() override {
        if (server_ == nullptr) return;
        try {
            server_->exec("DROP DATABASE IF EXISTS " + database_ + " WITH (FORCE)", "postgres");
        } catch (...) {
        }
    }

    [[nodiscard]] std::string conninfo() const { return server_->conninfo(database_); }
    void exec(const std::string& sql) const { server_->exec(sql, database_); }
    [[nodiscard]] long long count(const std::string& sql) const {
        return std::stoll(server_->query_value(sql, database_).value_or("-1"));
    }
    [[nodiscard]] PGconn* connect() const { return server_->connect(database_); }
    /// After @p threads stores raced over @p ids ids: each processed once, by exactly one.
    void expect_each_effect_once(long long ids, long threads, const std::atomic<long>& processed,
                                 const std::atomic<long>& duplicates,
                                 const std::atomic<long>& retried, const char* run) const {
        EXPECT_EQ(processed.load(), ids);
        EXPECT_EQ(duplicates.load(), ids * (threads - 1));
        EXPECT_EQ(count("SELECT count(*) FROM effects"), ids);
        EXPECT_EQ(count("SELECT count(DISTINCT message_id) FROM effects"), ids);
        EXPECT_EQ(count("SELECT count(*) FROM idem_claims WHERE outcome = 'processed'"), ids);
        std::printf("%s: %ld processed, %ld duplicates, %ld retried\n", run, processed.load(),
                    duplicates.load(), retried.load());
    }

    /// Options on the test's clock.
    idem::PostgresOptions clocked() {
        idem::PostgresOptions options;
        options.clock = [this] { return time_point(std::chrono::milliseconds(now_ms_.load())); };
        return options;
    }
    std::unique_ptr<PostgresStore> store(idem::PostgresOptions options = {}) {
        return std::make_unique<PostgresStore>(conninfo(), std::move(options));
    }
    void advance(std::chrono::milliseconds by) { now_ms_ += by.count(); }
    [[nodiscard]] time_point now() const {
        return time_point(std::chrono::milliseconds(now_ms_.load()));
    }

    /// Ends @p pid's session from another connection and waits until it is gone.
    void terminate(int pid) const {
        exec("SELECT pg_terminate_backend(" + std::to_string(pid) + ", 10000)");
    }

    idem_test::PostgresServer* server_ = nullptr;
    std::string database_;
    std::atomic<long long> now_ms_{1'700'000'000'000LL};
};

auto writer() {
    return [](auto& tx, const std::string& body) {
        tx.execute("INSERT INTO effects(message_id) VALUES ($1)", idem::Blob{body});
    };
}

// ---- schema -------------------------------------------------------------------------------

TEST_F(PostgresStoreTest, CreatesItsVersionedSchemaOnceAndReusesIt) {
    {
        PostgresStore first(conninfo());
        EXPECT_EQ(first.schema(), "public");
    }
    EXPECT_EQ(count("SELECT version FROM idem_schema"), PostgresStore::schema_version);
    EXPECT_EQ(count("SELECT count(*) FROM pg_tables WHERE schemaname = 'public' AND tablename IN "
                    "('idem_claims', 'idem_dead_letters', 'idem_locks', 'idem_outbox', "
                    "'idem_schema')"),
              5);
    EXPECT_EQ(count("SELECT count(*) FROM pg_indexes WHERE indexname = 'idem_claims_claimed_at'"),
              1);
    PostgresStore second(conninfo());  // finds the finished schema
    EXPECT_EQ(count("SELECT count(*) FROM idem_schema"), 1);
}

TEST_F(PostgresStoreTest, RefusesASchemaWrittenByANewerIdem) {
    { PostgresStore created(conninfo()); }
    exec("UPDATE idem_schema SET version = " + std::to_string(PostgresStore::schema_version + 1));
    try {
        PostgresStore refused(conninfo());
        FAIL() << "a newer schema must be refused";
    } catch (const idem::store_error& e) {
        EXPECT_NE(std::string(e.what()).find("newer"), std::string::npos) << e.what();
    }
}

TEST_F(PostgresStoreTest, OwnSchemaWithAnAwkwardNameKeepsTablesApart) {
    idem::PostgresOptions options;
    options.schema = "idem \"quoted\"; DROP";
    auto separate = store(options);
    auto plain = store();
    auto a = idem::make_handler(*separate, idem::Policy{"s"}, writer());
    auto b = idem::make_handler(*plain, idem::Policy{"s"}, writer());
    EXPECT_EQ(a.handle(Delivery{"m-1", 1u}, std::string("a")).disposition, Disposition::processed);
    EXPECT_EQ(b.handle(Delivery{"m-1", 1u}, std::string("b")).disposition, Disposition::processed);
    EXPECT_EQ(count("SELECT count(*) FROM \"idem \"\"quoted\"\"; DROP\".idem_claims"), 1);
    EXPECT_EQ(count("SELECT count(*) FROM public.idem_claims"), 1);
}

TEST_F(PostgresStoreTest, ConcurrentFirstStartsDoNotRace) {
    constexpr int kStores = 8;
    std::vector<std::future<std::string>> starts;
    std::promise<void> go;
    std::shared_future<void> ready = go.get_future().share();
    for (int i = 0; i < kStores; ++i) {
        starts.push_back(std::async(std::launch::async, [&, ready] {
            ready.wait();
            try {
                PostgresStore store(conninfo());
                return std::string();
            } catch (const std::exception& e) {
                return std::string(e.what());
            }
        }));
    }
    go.set_value();
    for (auto& start : starts)
        EXPECT_EQ(start.get(), "");
    EXPECT_EQ(count("SELECT count(*) FROM idem_schema"), 1);
}

TEST_F(PostgresStoreTest, BadOptionsAndConnectionsAreRefusedWithAReason) {
    idem::PostgresOptions negative;
    negative.lock_timeout = -1ms;
    EXPECT_THROW(PostgresStore(conninfo(), negative), idem::usage_error);
    idem::PostgresOptions empty_schema;
    empty_schema.schema = "";
    EXPECT_THROW(PostgresStore(conninfo(), empty_schema), idem::usage_error);
    EXPECT_THROW(PostgresStore(static_cast<PGconn*>(nullptr)), idem::usage_error);
    try {
        PostgresStore unreachable(
            "host=127.0.0.1 port=1 user=idem password=s3cret "
            "connect_timeout=2");
        FAIL();
    } catch (const idem::store_unavailable& e) {
        EXPECT_NE(std::string(e.what()).find("cannot connect"), std::string::npos);
        EXPECT_EQ(std::string(e.what()).find("s3cret"), std::string::npos) << e.what();
    }
}

// ---- claims -------------------------------------------------------------------------------

TEST_F(PostgresStoreTest, ClaimThenDuplicateWithTheRecordedOutcomeAndFingerprint) {
    auto s = store(clocked());
    {
        auto tx = s->begin();
        EXPECT_EQ(tx.claim("capture", "m-1", "fp-1").status, ClaimStatus::claimed);
        tx.record_outcome("capture", "m-1", Disposition::processed, "");
        tx.commit();
    }
    auto tx = s->begin();
    auto again = tx.claim("capture", "m-1", "fp-other");
    EXPECT_EQ(again.status, ClaimStatus::duplicate);
    EXPECT_EQ(again.recorded, Disposition::processed);
    EXPECT_EQ(again.fingerprint, "fp-1");
    tx.rollback();
    auto found = s->find_claim("capture", "m-1");
    ASSERT_TRUE(found.has_value());
    EXPECT_EQ(found->claimed_at, now());
    EXPECT_EQ(found->fingerprint, "fp-1");
    EXPECT_FALSE(s->find_claim("capture", "m-2").has_value());
}

TEST_F(PostgresStoreTest, RoundTripsPerMessage) {
    auto s = store();
    auto handler = idem::make_handler(*s, idem::Policy{"rt"}, writer());
    ASSERT_EQ(handler.handle(Delivery{"warm-up", 1u}, std::string("w")).disposition,
              Disposition::processed);  // statements prepared
    {
        const auto before = s->round_trips();
        auto tx = s->begin();
        EXPECT_EQ(s->round_trips(), before);  // BEGIN is queued
        ASSERT_EQ(tx.claim("rt", "x").status, ClaimStatus::claimed);
        EXPECT_EQ(s->round_trips(), before + 1);  // BEGIN + claim
        tx.rollback();
    }
    auto before = s->round_trips();
    ASSERT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
              Disposition::processed);
    // claim (with BEGIN), the effect's INSERT, COMMIT.
    EXPECT_EQ(s->round_trips() - before, 3u);
    before = s->round_trips();
    ASSERT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("m-1")).disposition,
              Disposition::duplicate);
    // claim (nothing inserted), reading the stored outcome, ROLLBACK
    EXPECT_EQ(s->round_trips() - before, 3u);
}

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

TEST_F(PostgresStoreTest, ASecondConnectionWaitsForTheFirstAndThenSeesADuplicate) {
    auto first = store();
    auto second = store();
    auto tx = first->begin();
    ASSERT_EQ(tx.claim("capture", "m-1").status, ClaimStatus::claimed);
    tx.execute("INSERT INTO effects(message_id) VALUES ($1)", idem::Blob{"m-1"});

    const auto started = std::chrono::steady_clock::now();
    auto waiting = std::async(std::launch::async, [&] {
        auto other = second->begin();
        auto result = other.claim("capture", "m-1");
        return std::make_pair(result, std::chrono::steady_clock::now() - started);
    });
    EXPECT_EQ(waiting.wait_for(300ms), std::future_status::timeout);  // blocked on the index
    tx.record_outcome("capture", "m-1", Disposition::processed, "");
    tx.commit();
    const auto [result, waited] = waiting.get();
    EXPECT_EQ(result.status, ClaimStatus::duplicate);
    EXPECT_EQ(result.recorded, Disposition::processed);
    EXPECT_GE(waited, 300ms);
    EXPECT_EQ(count("SELECT count(*) FROM effects"), 1);
}

TEST_F(PostgresStoreTest, WhenTheFirstRollsBackTheWaitingOneClaims) {
    auto first = store();
    auto second = store();
    auto tx = first->begin();
    ASSERT_EQ(tx.claim("capture", "m-1").status, ClaimStatus::claimed);
    auto waiting = std::async(std::launch::async, [&] {
        auto other = second->begin();
        auto status = other.claim("capture", "m-1").status;
        other.record_outcome("capture", "m-1", Disposition::processed, "");
        other.commit();
        return status;
    });
    EXPECT_EQ(waiting.wait_for(200ms), std::future_status::timeout);
    tx.rollback();
    EXPECT_EQ(waiting.get(), ClaimStatus::claimed);
    EXPECT_EQ(first->find_claim("capture", "m-1")->disposition, Disposition::processed);
}

TEST_F(PostgresStoreTest, LockTimeoutGivesInProgressAndTheTransactionIsAborted) {
    auto holder = store();
    idem::PostgresOptions impatient;
    impatient.lock_timeout = 150ms;
    auto waiter = store(impatient);
    auto held = holder->begin();
    ASSERT_EQ(held.claim("capture", "m-1").status, ClaimStatus::claimed);
    {
        const auto started = std::chrono::steady_clock::now();
        auto tx = waiter->begin();
        EXPECT_EQ(tx.claim("capture", "m-1").status, ClaimStatus::in_progress);
        EXPECT_GE(std::chrono::steady_clock::now() - started, 150ms);
        EXPECT_THROW(tx.commit(), idem::commit_failed);  // PostgreSQL aborted it
    }
    auto handler = idem::make_handler(*waiter, idem::Policy{"capture"}, writer());
    auto outcome = handler.handle(Delivery{"m-1", 2u}, std::string("m-1"));
    EXPECT_EQ(outcome.disposition, Disposition::in_progress) << outcome.reason;
    EXPECT_FALSE(idem::should_ack(outcome));
    // The store is fine afterwards.
    EXPECT_EQ(handler.handle(Delivery{"m-2", 1u}, std::string("m-2")).disposition,
              Disposition::processed);
    held.rollback();
    EXPECT_EQ(handler.handle(Delivery{"m-1", 3u}, std::string("m-1")).disposition,
              Disposition::processed);
}

// ---- failures ------------------------------------------------------------------------------

TEST_F(PostgresStoreTest, AKilledSessionFailsTheDeliveryAndTheStoreReconnects) {
    auto s = store();
    {
        auto tx = s->begin();
        ASSERT_EQ(tx.claim("capture", "m-0").status, ClaimStatus::claimed);
        terminate(PQbackendPID(s->conn()));
        EXPECT_THROW(tx.execute("INSERT INTO effects(message_id) VALUES ($1)", idem::Blob{"x"}),
                     idem::store_unavailable);
    }
    bool kill = true;
    auto handler =
        idem::make_handler(*s, idem::Policy{"capture"}, [&](auto& tx, const std::string& body) {
            if (kill) terminate(PQbackendPID(tx.conn()));
            tx.execute("INSERT INTO effects(message_id) VALUES ($1)", idem::Blob{body});
        });
    auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("m-1"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_NE(outcome.reason.find("connection"), std::string::npos) << outcome.reason;
    kill = false;
    const int old_pid = PQbackendPID(s->conn());
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("m-1")).disposition,
              Disposition::processed);
    EXPECT_NE(PQbackendPID(s->conn()), old_pid);  // a new session
    EXPECT_EQ(count("SELECT count(*) FROM effects"), 1);
    EXPECT_EQ(count("SELECT count(*) FROM idem_claims"), 1);
}

TEST_F(PostgresStoreTest, AServerRestartFailsDeliveriesUntilItIsBack) {
    idem_test::PostgresServer own;  // this one we may stop
    own.exec("CREATE TABLE effects(message_id BYTEA NOT NULL)");
    PostgresStore s(own.conninfo() + " connect_timeout=5");
    auto handler = idem::make_handler(s, idem::Policy{"capture"}, writer());
    ASSERT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
              Disposition::processed);
    own.stop();
    auto down = handler.handle(Delivery{"m-2", 1u}, std::string("m-2"));
    EXPECT_EQ(down.disposition, Disposition::failed);
    auto still_down = handler.handle(Delivery{"m-2", 2u}, std::string("m-2"));
    EXPECT_EQ(still_down.disposition, Disposition::failed);
    EXPECT_NE(still_down.reason.find("reconnecting failed"), std::string::npos)
        << still_down.reason;
    own.start();
    EXPECT_EQ(handler.handle(Delivery{"m-2", 3u}, std::string("m-2")).disposition,
              Disposition::processed);
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("m-1")).disposition,
              Disposition::duplicate);
    own.kill9();  // a crash this time
    EXPECT_EQ(handler.handle(Delivery{"m-3", 1u}, std::string("m-3")).disposition,
              Disposition::failed);
    own.start();
    EXPECT_EQ(handler.handle(Delivery{"m-3", 2u}, std::string("m-3")).disposition,
              Disposition::processed);
    EXPECT_EQ(std::stoll(own.query_value("SELECT count(*) FROM effects").value_or("-1")), 3);
}

TEST_F(PostgresStoreTest, DeferredConstraintFailsTheCommitAndNothingIsStored) {
    auto s = store();
    {
        auto tx = s->begin();
        ASSERT_EQ(tx.claim("capture", "m-1").status, ClaimStatus::claimed);
        tx.execute("INSERT INTO children(parent_id) VALUES ($1)", 4242);
        tx.record_outcome("capture", "m-1", Disposition::processed, "");
        try {
            tx.commit();
            FAIL() << "the deferred foreign key must refuse the commit";
        } catch (const idem::commit_failed& e) {
            EXPECT_NE(std::string(e.what()).find("foreign key"), std::string::npos) << e.what();
        }
        EXPECT_FALSE(tx.active());
        EXPECT_THROW(tx.commit(), idem::usage_error);
    }
    EXPECT_FALSE(s->find_claim("capture", "m-1").has_value());
    EXPECT_EQ(count("SELECT count(*) FROM children"), 0);
}

TEST_F(PostgresStoreTest, ConnectionLostDuringCommitIsFailedAndTheRedeliveryDecides) {
    // A deferred constraint trigger that ends its own session while COMMIT runs.
    exec(
        "CREATE TABLE doomed(x INTEGER);"
        "CREATE FUNCTION die() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "  PERFORM pg_terminate_backend(pg_backend_pid()); PERFORM pg_sleep(1); RETURN NULL; "
        "END $$;"
        "CREATE CONSTRAINT TRIGGER die_at_commit AFTER INSERT ON doomed "
        "  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION die();");
    auto s = store();
    bool doom = true;
    auto handler =
        idem::make_handler(*s, idem::Policy{"capture"}, [&](auto& tx, const std::string& body) {
            tx.execute("INSERT INTO effects(message_id) VALUES ($1)", idem::Blob{body});
            if (doom) tx.execute("INSERT INTO doomed VALUES (1)");
        });
    auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("m-1"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_NE(outcome.reason.find("outcome is unknown"), std::string::npos) << outcome.reason;
    EXPECT_FALSE(idem::should_ack(outcome));
    doom = false;
    // Here the session died before the commit record: the redelivery does the work once.
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("m-1")).disposition,
              Disposition::processed);
    EXPECT_EQ(count("SELECT count(*) FROM effects"), 1);
}

TEST_F(PostgresStoreTest, AFailedEffectStatementIsReportedWithTheSqlAndRolledBack) {
    auto s = store();
    auto handler =
        idem::make_handler(*s, idem::Policy{"capture"}, [](auto& tx, const std::string&) {
            tx.execute("INSERT INTO no_such_table VALUES (?)", 1);
        });
    auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("x"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_NE(outcome.reason.find("no_such_table"), std::string::npos) << outcome.reason;
    EXPECT_NE(outcome.reason.find("$1"), std::string::npos) << outcome.reason;  // ? hint
    EXPECT_FALSE(s->find_claim("capture", "m-1").has_value());
}

TEST_F(PostgresStoreTest, MalformedAfterAFailedStatementStillDeadLettersThroughTheSavepoint) {
    auto s = store();
    auto handler =
        idem::make_handler(*s, idem::Policy{"capture"}, [](auto& tx, const std::string& body) {
            try {
                tx.execute("INSERT INTO children(parent_id) VALUES ('not a number')");
            } catch (const idem::store_error&) {
                throw idem::malformed_message("body " + body + " has no usable parent");
            }
        });
    auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("b"));
    EXPECT_EQ(outcome.disposition, Disposition::dead_lettered) << outcome.reason;
    ASSERT_EQ(s->dead_letters().size(), 1u);
    EXPECT_EQ(s->find_claim("capture", "m-1")->disposition, Disposition::dead_lettered);
}

TEST_F(PostgresStoreTest, MisuseIsAUsageError) {
    auto s = store();
    {
        auto tx = s->begin();
        EXPECT_THROW((void)s->begin(), idem::usage_error);  // same thread: would deadlock
        EXPECT_THROW((void)s->find_claim("a", "b"), idem::usage_error);
        EXPECT_THROW(tx.execute("SELECT $1::text", std::string("nul\0inside", 10)),
                     idem::usage_error);
        EXPECT_THROW(tx.execute("SELECT $1::int, $2::int", 1), idem::usage_error);
    }
    {
        auto tx = s->begin();
        (void)tx.claim("s", "id");
        EXPECT_THROW(tx.execute("COMMIT"), idem::usage_error);  // ended behind idem's back
        EXPECT_FALSE(tx.active());
    }
    // The effect's COMMIT went through behind idem's back: the claim row is stored with the
    // outcome it is inserted with ('processed'; idem's commit() would have corrected it).
    EXPECT_TRUE(s->find_claim("s", "id").has_value());
    // A borrowed connection inside the user's own transaction is refused.
    PgConnection conn{connect()};
    PQclear(PQexec(conn.get(), "BEGIN"));
    EXPECT_THROW(PostgresStore{conn.get()}, idem::usage_error);
    PQclear(PQexec(conn.get(), "ROLLBACK"));
}

// ---- values -----------------------------------------------------------------------------------

TEST_F(PostgresStoreTest, HostileValuesRoundTripExactly) {
    auto s = store();
    const std::string big(10 * 1024, '\'');
    const std::vector<std::string> values = {std::string("nul\0inside", 10),
                                             "quote'\"; DROP TABLE idem_claims; --",
                                             "\xff\xfe invalid utf-8 \xc3",
                                             big,
                                             std::string(),
                                             std::string("\0", 1)};
    {
        auto tx = s->begin();
        for (const auto& v : values) {
            const std::string id = v.substr(0, 300);
            ASSERT_EQ(tx.claim(v, id, v).status, ClaimStatus::claimed);
            tx.execute("INSERT INTO effects(message_id) VALUES ($1)", idem::Blob{v});
            EXPECT_EQ(tx.query_text("SELECT $1::bytea", idem::Blob{v}), v);
            idem::DeadLetter letter;
            letter.scope = v;
            letter.message_id = id;
            letter.delivery_count = 7;
            letter.reason = "why: " + v.substr(0, 40);
            letter.payload = v;
            tx.dead_letter(letter);
            tx.record_outcome(v, id, Disposition::rejected, v.substr(0, 100));
        }
        tx.commit();
    }
    const auto letters = s->dead_letters();
    ASSERT_EQ(letters.size(), values.size());
    for (std::size_t i = 0; i < values.size(); ++i) {
        const std::string& v = values[i];
        const std::string id = v.substr(0, 300);
        auto claim = s->find_claim(v, id);
        ASSERT_TRUE(claim.has_value()) << i;
        EXPECT_EQ(claim->scope, v);
        EXPECT_EQ(claim->message_id, id);
        EXPECT_EQ(claim->fingerprint, v);
        EXPECT_EQ(claim->disposition, Disposition::rejected);
        EXPECT_EQ(letters[i].payload, v);
        EXPECT_EQ(letters[i].scope, v);
        EXPECT_EQ(letters[i].delivery_count, 7u);
    }
    // Text columns keep valid UTF-8: invalid bytes and NULs become U+FFFD, the rest stays.
    EXPECT_EQ(s->find_claim(values[2], values[2])->reason,
              "\xEF\xBF\xBD\xEF\xBF\xBD invalid "
              "utf-8 \xEF\xBF\xBD");
    EXPECT_EQ(s->find_claim(values[0], values[0])->reason, "nul\xEF\xBF\xBDinside");
    EXPECT_EQ(s->find_claim(values[3], values[3].substr(0, 300))->reason, std::string(100, '\''));
    EXPECT_EQ(count("SELECT count(*) FROM effects"), static_cast<long long>(values.size()));
    // The same values as one batch's ids and fingerprints (binary bytea[] parameters).
    {
        auto tx = s->begin();
        std::vector<std::string> ids;
        for (const auto& v : values)
            ids.push_back(v.substr(0, 300));
        const auto claims =
            tx.claim_many("batch", std::vector<std::string_view>(ids.begin(), ids.end()), values);
        for (const auto& claim : claims)
            EXPECT_EQ(claim.status, ClaimStatus::claimed);
        tx.commit();
        for (std::size_t i = 0; i < values.size(); ++i) {
            auto claim = s->find_claim("batch", ids[i]);
            ASSERT_TRUE(claim.has_value()) << i;
            EXPECT_EQ(claim->message_id, ids[i]);
            EXPECT_EQ(claim->fingerprint, values[i]);
        }
    }
    // Text and numbers bind as text and take the SQL's types.
    EXPECT_EQ(s->query_text("SELECT $1::text || $2::int || $3::float8 || $4::bool",
                            std::string_view("a'b"), 42, 0.5, true),
              "a'b420.5true");
    EXPECT_EQ(s->query_int("SELECT $1::bigint", std::numeric_limits<std::int64_t>::min()),
              std::numeric_limits<std::int64_t>::min());
    EXPECT_EQ(s->query_int("SELECT NULL::int"), std::nullopt);
    EXPECT_EQ(s->query_text("SELECT $1::text", std::optional<std::string>{}), std::nullopt);
    EXPECT_EQ(s->query_int("SELECT $1::bool", false), 0);
    EXPECT_THROW((void)s->query_int("SELECT 'x'::text"), idem::usage_error);
}

TEST_F(PostgresStoreTest, PurgeDeletesClaimsOlderThanTheRetentionOnTheInjectedClock) {
    auto s = store(clocked());
    auto handler = idem::make_handler(*s, idem::Policy{"capture"}, writer());
    ASSERT_EQ(handler.handle(Delivery{"old", 1u}, std::string("old")).disposition,
              Disposition::processed);
    advance(std::chrono::hours(24 * 10));
    ASSERT_EQ(handler.handle(Delivery{"young", 1u}, std::string("young")).disposition,
              Disposition::processed);
    advance(std::chrono::hours(24 * 4));                          // old: 14 days, young: 4 days
    EXPECT_EQ(s->purge(std::chrono::hours(24 * 14)).claims, 0u);  // exactly 14 days: kept
    advance(1ms);
    EXPECT_EQ(s->purge(std::chrono::hours(24 * 14)).claims, 1u);
    EXPECT_FALSE(s->find_claim("capture", "old").has_value());
    EXPECT_TRUE(s->find_claim("capture", "young").has_value());
    EXPECT_THROW(s->purge(-std::chrono::hours(1)), idem::usage_error);
    // Many batches: claims, sent intents (an unsent and a parked one stay), expired locks (a
    // live one stays).
    exec(
        "INSERT INTO idem_claims(scope, message_id, claimed_at, outcome) SELECT 'bulk', "
        "int4send(g), 0, 'processed' FROM generate_series(1, 12000) g");
    exec(
        "INSERT INTO idem_outbox(destination, idempotency_key, payload, created_at, sent_at, "
        "next_attempt_at) SELECT 'rail', int4send(g), '', 0, 0, 0 FROM generate_series(1, 12000) "
        "g");
    exec(
        "INSERT INTO idem_outbox(destination, idempotency_key, payload, created_at, "
        "next_attempt_at, parked) VALUES ('rail', 'unsent', '', 0, 0, false), "
        "('rail', 'parked', '', 0, 0, true)");
    exec(
        "INSERT INTO idem_locks(lock_key, owner, expires_at) SELECT int4send(g), 'o', 0 "
        "FROM generate_series(1, 12000) g");
    ASSERT_TRUE(s->hold_lock("live", "o", std::chrono::hours(1)));
    const idem::PurgeResult purged = s->purge(std::chrono::hours(1));
    EXPECT_EQ(purged.claims, 12001u);  // and "young"
    EXPECT_EQ(purged.sent_intents, 12000u);
    EXPECT_EQ(purged.expired_locks, 12000u);
    EXPECT_EQ(s->query_int("SELECT count(*) FROM idem_outbox"), 2);
    EXPECT_EQ(s->query_int("SELECT count(*) FROM idem_locks"), 1);
}

// ---- overlap lock ------------------------------------------------------------------------

TEST_F(PostgresStoreTest, TryLockContendsAcrossStoresUntilTheTransactionEnds) {
    auto a = store(clocked());
    auto b = store(clocked());
    auto first = a->begin();
    EXPECT_TRUE(first.try_lock("invoice-42", 1min));
    {
        auto second = b->begin();
        EXPECT_FALSE(second.try_lock("invoice-42", 1min));
        EXPECT_TRUE(second.try_lock("invoice-43", 1min));
    }
    // While a transaction holds the key, hold_lock() is refused too.
    EXPECT_FALSE(b->hold_lock("invoice-42", "batch", 1min));
    first.rollback();  // the advisory lock ends with the transaction
    {
        auto second = b->begin();
        EXPECT_TRUE(second.try_lock("invoice-42", 1min));
        second.commit();
    }
    // A session that dies releases its lock.
    auto third = a->begin();
    ASSERT_TRUE(third.try_lock("invoice-7", 1min));
    terminate(PQbackendPID(a->conn()));
    auto fourth = b->begin();
    EXPECT_TRUE(fourth.try_lock("invoice-7", 1min));
}

TEST_F(PostgresStoreTest, HeldLocksExpireAndOnlyTheirOwnerReleasesThem) {
    auto a = store(clocked());
    auto b = store(clocked());
    ASSERT_TRUE(a->hold_lock("invoice-42", "batch-1", 10min));
    EXPECT_FALSE(b->hold_lock("invoice-42", "batch-2", 10min));
    EXPECT_TRUE(a->hold_lock("invoice-42", "batch-1", 20min));  // renewed by its owner
    {
        auto tx = b->begin();
        EXPECT_FALSE(tx.try_lock("invoice-42", 1min));
    }
    advance(20min);  // expires_at == now: expired
    {
        auto tx = b->begin();
        EXPECT_TRUE(tx.try_lock("invoice-42", 1min));
    }
    EXPECT_TRUE(b->hold_lock("invoice-42", "batch-2", 10min));  // takes the expired lock
    EXPECT_FALSE(a->release_lock("invoice-42", "batch-1"));
    EXPECT_TRUE(b->release_lock("invoice-42", "batch-2"));
    EXPECT_FALSE(b->release_lock("invoice-42", "batch-2"));
    EXPECT_TRUE(a->hold_lock(std::string("k\0ey", 4), std::string("o\0wner", 6), 1min));
    EXPECT_FALSE(a->hold_lock(std::string("k\0ey", 4), "other", 1min));
}

// ---- outbox ------------------------------------------------------------------------------

idem::OutboxIntent intent(const std::string& key, std::string payload = "p") {
    return idem::OutboxIntent{"payments-rail", key, std::move(payload)};
}

TEST_F(PostgresStoreTest, OutboxAddDedupesOnTheKeyAndRollsBackWithTheTransaction) {
    auto s = store(clocked());
    {
        auto tx = s->begin();
        EXPECT_TRUE(tx.add_outbox(intent("settle-1", std::string("\0bin\xff", 5))));
        EXPECT_FALSE(tx.add_outbox(intent("settle-1", "another payload")));
        tx.commit();
    }
    {
        auto tx = s->begin();
        EXPECT_FALSE(tx.add_outbox(intent("settle-1")));
        EXPECT_TRUE(tx.add_outbox(intent("settle-2")));
    }  // rolled back
    {
        auto tx = s->begin();
        EXPECT_THROW(tx.add_outbox(idem::OutboxIntent{std::string("a\0b", 3), "k", "p"}),
                     idem::usage_error);
    }
    const auto rows = s->outbox_rows();
    ASSERT_EQ(rows.size(), 1u);
    EXPECT_EQ(rows[0].idempotency_key, "settle-1");
    EXPECT_EQ(rows[0].payload, std::string("\0bin\xff", 5));
    EXPECT_EQ(rows[0].destination, "payments-rail");
    EXPECT_EQ(rows[0].created_at, now());
    EXPECT_EQ(rows[0].next_attempt_at, now());
    EXPECT_FALSE(rows[0].sent_at.has_value());
    EXPECT_EQ(rows[0].attempts, 0u);
    EXPECT_FALSE(rows[0].parked);
}

TEST_F(PostgresStoreTest, LeasesExpireFailuresBackOffAndParkedRowsStay) {
    auto s = store(clocked());
    {
        auto tx = s->begin();
        for (int i = 1; i <= 3; ++i)
            ASSERT_TRUE(tx.add_outbox(intent("k-" + std::to_string(i))));
        tx.commit();
    }
    auto leased = s->lease_outbox(2, 30s);
    ASSERT_EQ(leased.size(), 2u);
    EXPECT_LT(leased[0].id, leased[1].id);
    EXPECT_EQ(leased[0].idempotency_key, "k-1");
    auto rest = s->lease_outbox(10, 30s);
    ASSERT_EQ(rest.size(), 1u);
    EXPECT_EQ(rest[0].idempotency_key, "k-3");
    EXPECT_TRUE(s->lease_outbox(10, 30s).empty());  // all leased
    s->mark_outbox_sent(leased[0].id);
    s->mark_outbox_failed(leased[1].id, "rail said 503 \xff", now() + 1min, false);
    s->mark_outbox_failed(rest[0].id, "rejected for good", now(), true);
    EXPECT_THROW(s->mark_outbox_sent(987654), idem::usage_error);
    EXPECT_TRUE(s->lease_outbox(10, 30s).empty());  // k-2 waits for its retry, k-3 is parked
    advance(1min);
    auto retry = s->lease_outbox(10, 30s);
    ASSERT_EQ(retry.size(), 1u);
    EXPECT_EQ(retry[0].idempotency_key, "k-2");
    EXPECT_EQ(retry[0].attempts, 1u);
    EXPECT_EQ(retry[0].last_error, "rail said 503 \xEF\xBF\xBD");
    advance(30s);  // the relay died: its lease ran out
    ASSERT_EQ(s->lease_outbox(10, 30s).size(), 1u);
    const auto rows = s->outbox_rows();
    ASSERT_EQ(rows.size(), 3u);
    EXPECT_TRUE(rows[0].sent_at.has_value());
    EXPECT_TRUE(rows[2].parked);
    EXPECT_EQ(rows[2].attempts, 1u);
}

TEST_F(PostgresStoreTest, FourRelaysNeverLeaseTheSameRowAndSendEachOnce) {
    constexpr int kRows = 1000;
    constexpr int kRelays = 4;
    auto writer_store = store();
    {
        auto tx = writer_store->begin();
        for (int i = 0; i < kRows; ++i)
            ASSERT_TRUE(tx.add_outbox(intent("key-" + std::to_string(i))));
        tx.commit();
    }
    std::vector<std::atomic<int>> sends(kRows + 1);
    std::atomic<int> overlaps{0};
    std::vector<std::thread> relays;
    for (int r = 0; r < kRelays; ++r) {
        relays.emplace_back([&] {
            PostgresStore relay(conninfo());
            for (;;) {
                auto batch = relay.lease_outbox(7, 60s);
                if (batch.empty()) break;
                for (const auto& row : batch) {
                    const auto index = std::stoi(row.idempotency_key.substr(4));
                    if (sends[static_cast<std::size_t>(index)].fetch_add(1) != 0) ++overlaps;
                    relay.mark_outbox_sent(row.id);
                }
            }
        });
    }
    for (auto& relay : relays)
        relay.join();
    EXPECT_EQ(overlaps.load(), 0);
    for (int i = 0; i < kRows; ++i)
        EXPECT_EQ(sends[static_cast<std::size_t>(i)].load(), 1) << i;
    EXPECT_EQ(count("SELECT count(*) FROM idem_outbox WHERE sent_at IS NOT NULL"), kRows);
}

// ---- borrowed connection, options ----------------------------------------------------------

TEST_F(PostgresStoreTest, ABorrowedConnectionCarriesTheEffectAndIsLeftOpenAndClean) {
    PgConnection conn{connect()};
    {
        PostgresStore s(conn.get());
        auto handler =
            idem::make_handler(s, idem::Policy{"raw"}, [](auto& tx, const std::string& body) {
                // The effect's own libpq code on the same connection joins the transaction.
                PGconn* raw = tx.conn();
                const char* values[] = {body.c_str()};
                PGresult* r =
                    PQexecParams(raw, "INSERT INTO effects(message_id) VALUES ($1::bytea)", 1,
                                 nullptr, values, nullptr, nullptr, 0);
                const bool ok = PQresultStatus(r) == PGRES_COMMAND_OK;
                PQclear(r);
                if (!ok) throw std::runtime_error("insert failed");
            });
        EXPECT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
                  Disposition::processed);
        EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("m-1")).disposition,
                  Disposition::duplicate);
    }
    EXPECT_EQ(PQstatus(conn.get()), CONNECTION_OK);
    EXPECT_EQ(PQtransactionStatus(conn.get()), PQTRANS_IDLE);
    PGresult* r = PQexec(conn.get(), "SELECT count(*) FROM pg_prepared_statements");
    EXPECT_STREQ(PQgetvalue(r, 0, 0), "0");  // the store's statements are deallocated
    PQclear(r);
    EXPECT_EQ(count("SELECT count(*) FROM effects"), 1);
}

// ---- notices ------------------------------------------------------------------------------

/// An effect that makes the server send a NOTICE with @p text, then writes its row.
auto noisy_writer(std::string text) {
    return [text = std::move(text)](auto& tx, const std::string& body) {
        tx.execute("DO $$ BEGIN RAISE NOTICE '" + text + "'; END $$");
        tx.execute("INSERT INTO effects(message_id) VALUES ($1)", idem::Blob{body});
    };
}

bool has(const std::vector<std::string>& notices, const std::string& text) {
    return std::find(notices.begin(), notices.end(), text) != notices.end();
}

/// A connection with libpq's own notice handling (the fixture's connect() silences it).
PGconn* plain_connection(const std::string& conninfo) {
    PGconn* conn = PQconnectdb(conninfo.c_str());
    if (PQstatus(conn) != CONNECTION_OK) {
        PQfinish(conn);
        throw std::runtime_error("cannot connect");
    }
    return conn;
}

void raise_notice(PGconn* conn, const std::string& text) {
    PQclear(PQexec(conn, ("DO $$ BEGIN RAISE NOTICE '" + text + "'; END $$").c_str()));
}

TEST_F(PostgresStoreTest, NoticesReachOnNoticeAndNotStderr) {
    std::vector<std::string> notices;
    idem::PostgresOptions options;
    options.on_notice = [&](std::string_view text) { notices.emplace_back(text); };
    auto s = store(options);
    auto handler = idem::make_handler(*s, idem::Policy{"notices"}, noisy_writer("hello"));

    testing::internal::CaptureStderr();
    const auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("m-1"));
    s->execute("DO $$ BEGIN RAISE WARNING 'careful'; END $$");
    const std::string err = testing::internal::GetCapturedStderr();

    EXPECT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
    EXPECT_TRUE(has(notices, "NOTICE:  hello")) << ::testing::PrintToString(notices);
    EXPECT_TRUE(has(notices, "WARNING:  careful")) << ::testing::PrintToString(notices);
    EXPECT_EQ(err.find("hello"), std::string::npos) << err;
    EXPECT_EQ(err.find("careful"), std::string::npos) << err;

    // The receiver survives the reconnect after a lost session (PQreset keeps it).
    terminate(PQbackendPID(s->conn()));
    EXPECT_EQ(handler.handle(Delivery{"m-2", 1u}, std::string("m-2")).disposition,
              Disposition::failed);
    testing::internal::CaptureStderr();
    EXPECT_EQ(handler.handle(Delivery{"m-2", 2u}, std::string("m-2")).disposition,
              Disposition::processed);
    const std::string after = testing::internal::GetCapturedStderr();
    EXPECT_EQ(std::count(notices.begin(), notices.end(), "NOTICE:  hello"), 2);
    EXPECT_EQ(after.find("hello"), std::string::npos) << after;

    // A throwing sink does not escape through libpq: the statement still succeeds.
    idem::PostgresOptions throwing;
    throwing.on_notice = [](std::string_view) { throw std::runtime_error("sink failed"); };
    auto t = store(throwing);
    EXPECT_EQ(t->execute("DO $$ BEGIN RAISE NOTICE 'ignored'; END $$"), 0);
}

TEST_F(PostgresStoreTest, NoticesOfAnOwnedConnectionAreDroppedWithoutOnNotice) {
    auto s = store();
    auto handler = idem::make_handler(*s, idem::Policy{"notices"}, noisy_writer("dropped"));
    testing::internal::CaptureStderr();
    const auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("m-1"));
    raise_notice(s->conn(), "dropped too");
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
    EXPECT_EQ(err.find("dropped"), std::string::npos) << err;
}

TEST_F(PostgresStoreTest, ABorrowedConnectionWithOnNoticeRoutesItsNoticesUntilTheStoreIsGone) {
    PgConnection conn{plain_connection(conninfo())};
    std::vector<std::string> notices;
    {
        idem::PostgresOptions options;
        options.on_notice = [&](std::string_view text) { notices.emplace_back(text); };
        PostgresStore s(conn.get(), options);
        auto handler = idem::make_handler(s, idem::Policy{"notices"}, noisy_writer("routed"));
        testing::internal::CaptureStderr();
        EXPECT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
                  Disposition::processed);
        const std::string err = testing::internal::GetCapturedStderr();
        EXPECT_TRUE(has(notices, "NOTICE:  routed")) << ::testing::PrintToString(notices);
        EXPECT_EQ(err.find("routed"), std::string::npos) << err;
    }
    // The store is gone: libpq's own handling is back (it prints on stderr), the sink hears
    // nothing more.
    const auto heard = notices.size();
    testing::internal::CaptureStderr();
    raise_notice(conn.get(), "after the store");
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("NOTICE:  after the store"), std::string::npos) << err;
    EXPECT_EQ(notices.size(), heard);
}

TEST_F(PostgresStoreTest, ABorrowedConnectionKeepsTheConsumersOwnNoticeHandling) {
    struct Heard {
        std::vector<std::string> texts;
        static void processor(void* arg, const char* message) {
            static_cast<Heard*>(arg)->texts.emplace_back(message);
        }
        static void receiver(void* arg, const PGresult* result) {
            static_cast<Heard*>(arg)->texts.emplace_back(
                PQresultErrorField(result, PG_DIAG_MESSAGE_PRIMARY));
        }
    };
    std::vector<std::string> notices;
    idem::PostgresOptions options;
    options.on_notice = [&](std::string_view text) { notices.emplace_back(text); };

    // 1. The consumer's notice processor: still called while the store routes notices to
    // on_notice, and still installed (with its argument) afterwards.
    {
        PgConnection conn{plain_connection(conninfo())};
        Heard heard;
        PQsetNoticeProcessor(conn.get(), &Heard::processor, &heard);
        {
            PostgresStore s(conn.get(), options);
            auto handler = idem::make_handler(s, idem::Policy{"notices"}, noisy_writer("both"));
            EXPECT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
                      Disposition::processed);
        }
        EXPECT_TRUE(has(notices, "NOTICE:  both")) << ::testing::PrintToString(notices);
        EXPECT_TRUE(has(heard.texts, "NOTICE:  both\n")) << ::testing::PrintToString(heard.texts);
        EXPECT_EQ(PQsetNoticeProcessor(conn.get(), nullptr, nullptr), &Heard::processor);
        raise_notice(conn.get(), "later");
        EXPECT_TRUE(has(heard.texts, "NOTICE:  later\n")) << ::testing::PrintToString(heard.texts);
        EXPECT_FALSE(has(notices, "NOTICE:  later"));
    }
    // 2. The consumer's notice receiver: left alone, it gets the notices.
    {
        PgConnection conn{plain_connection(conninfo())};
        Heard heard;
        PQsetNoticeReceiver(conn.get(), &Heard::receiver, &heard);
        {
            PostgresStore s(conn.get(), options);
            EXPECT_EQ(PQsetNoticeReceiver(conn.get(), nullptr, nullptr), &Heard::receiver);
            auto handler = idem::make_handler(s, idem::Policy{"notices"}, noisy_writer("theirs"));
            EXPECT_EQ(handler.handle(Delivery{"m-2", 1u}, std::string("m-2")).disposition,
                      Disposition::processed);
        }
        EXPECT_TRUE(has(heard.texts, "theirs")) << ::testing::PrintToString(heard.texts);
        EXPECT_FALSE(has(notices, "NOTICE:  theirs"));
        EXPECT_EQ(PQsetNoticeReceiver(conn.get(), nullptr, nullptr), &Heard::receiver);
    }
    // 3. No on_notice: the borrowed connection's handling is not touched at all.
    {
        PgConnection conn{connect()};  // the fixture's silent processor
        const auto receiver = PQsetNoticeReceiver(conn.get(), nullptr, nullptr);
        const auto processor = PQsetNoticeProcessor(conn.get(), nullptr, nullptr);
        PostgresStore s(conn.get());
        EXPECT_EQ(PQsetNoticeReceiver(conn.get(), nullptr, nullptr), receiver);
        EXPECT_EQ(PQsetNoticeProcessor(conn.get(), nullptr, nullptr), processor);
    }
}

TEST_F(PostgresStoreTest, WorksWithoutPreparedStatements) {
    idem::PostgresOptions options;
    options.prepare_statements = false;
    auto s = store(options);
    auto handler = idem::make_handler(*s, idem::Policy{"plain"}, writer());
    EXPECT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
              Disposition::processed);
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("m-1")).disposition,
              Disposition::duplicate);
    const auto batch = handler.handle_batch(
        std::vector<Delivery>{{"m-1", 3u}, {"m-2", 1u}, {"m-2", 1u}, {std::string("m\0-3", 4), 1u}},
        std::vector<std::string>{"m-1", "m-2", "m-2", "m-3"});
    EXPECT_EQ(batch[0].disposition, Disposition::duplicate) << batch[0].reason;
    EXPECT_EQ(batch[1].disposition, Disposition::processed) << batch[1].reason;
    EXPECT_EQ(batch[2].disposition, Disposition::duplicate) << batch[2].reason;
    EXPECT_EQ(batch[3].disposition, Disposition::processed) << batch[3].reason;
    EXPECT_EQ(std::stoll(s->query_text("SELECT count(*) FROM pg_prepared_statements").value()), 0);
}

TEST_F(PostgresStoreTest, LostPreparedStatementsArePreparedAgain) {
    auto s = store();
    auto handler = idem::make_handler(*s, idem::Policy{"p"}, writer());
    ASSERT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
              Disposition::processed);
    const auto prepared = [&] {
        return s  // idem's own statements, not the cached ones of execute() / query_*()
            ->query_int("SELECT count(*) FROM pg_prepared_statements WHERE name !~ '_u[0-9]+$'")
            .value_or(-1);
    };
    const auto all = prepared();
    // The claim only: BEGIN, SAVEPOINT… are not prepared, and a processed outcome needs no
    // statement (the claim row is inserted as 'processed').
    ASSERT_EQ(all, 1);
    // Some lost (a targeted DEALLOCATE), then all lost (a pooler's DISCARD ALL): each costs
    // one failed delivery (not acked), and the next one runs with the statements prepared again.
    for (const char* lose : {"DEALLOCATE idem_*_0", "DEALLOCATE ALL"}) {
        std::string sql = lose;
        const auto star = sql.find('*');
        if (star != std::string::npos) {
            sql.replace(star, 1,
                        s->query_text("SELECT split_part(name, '_', 2) FROM pg_prepared_statements "
                                      "LIMIT 1")
                            .value());
        }
        s->execute(sql);
        const std::string id = std::string("after ") + lose;
        auto outcome = handler.handle(Delivery{id, 1u}, id);
        EXPECT_EQ(outcome.disposition, Disposition::failed) << outcome.reason;
        EXPECT_NE(outcome.reason.find("26000"), std::string::npos) << outcome.reason;
        EXPECT_EQ(handler.handle(Delivery{id, 2u}, id).disposition, Disposition::processed);
        EXPECT_EQ(prepared(), all);
    }
}

// ---- exactly once under threads ------------------------------------------------------------

TEST_F(PostgresStoreTest, EightStoresDeliveringTheSameThousandIdsApplyEachEffectOnce) {
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
            PostgresStore s(conninfo());
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

TEST_F(PostgresStoreTest, FourStoresDeliveringTheSameIdsInBatchesApplyEachEffectOnce) {
    // Overlapping batches wait on one another's claims; a lock_timeout shorter than a batch's
    // effects makes some of them give up (in_progress after claiming one by one), and those ids
    // are redelivered later.
    constexpr int kThreads = 4;
    constexpr int kIds = 400;
    constexpr std::size_t kBatch = 20;
    idem::PolicyOptions patient;
    patient.max_deliveries = 100000;
    idem::PostgresOptions impatient;
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
