// PostgresStore with its claims in partitions (PostgresOptions::claim_partition_span) against a
// real PostgreSQL server: a claim found in whichever partition holds it, one claim per id across
// partitions while transactions race, partitions kept ahead of the clock, an unpartitioned table
// converted with its claims, and purge() dropping exactly the partitions that have expired.

#include "support/postgres_test_env.hpp"

namespace idem_test::postgres_store {
namespace {

constexpr auto kDay = std::chrono::hours(24);

class PostgresPartitionsTest : public PostgresStoreTest {
  protected:
    void SetUp() override {
        PostgresStoreTest::SetUp();
        // Midnight UTC: the first partition starts at the clock.
        now_ms_ = 1'700'000'000'000LL - 1'700'000'000'000LL % 86'400'000LL;
    }
    /// A day per partition, on the test's clock.
    idem::PostgresOptions daily() {
        idem::PostgresOptions options = clocked();
        options.claim_partition_span = kDay;
        return options;
    }
    [[nodiscard]] long long partitions() const {
        return count(
            "SELECT count(*) FROM pg_inherits WHERE inhparent = 'public.idem_claims'::regclass");
    }
    [[nodiscard]] std::string claims_kind() const {
        return server_
            ->query_value(
                "SELECT relkind::text FROM pg_class WHERE oid = "
                "'public.idem_claims'::regclass",
                database_)
            .value_or("");
    }
    /// The partition holding (scope, id)'s claim.
    [[nodiscard]] std::string partition_of(const std::string& id) const {
        return server_
            ->query_value("SELECT tableoid::regclass::text FROM idem_claims WHERE message_id = '" +
                              id + "'::bytea",
                          database_)
            .value_or("");
    }
};

TEST_F(PostgresPartitionsTest, AClaimIsFoundInWhicheverPartitionHoldsIt) {
    auto s = store(daily());
    EXPECT_EQ(claims_kind(), "p");
    EXPECT_EQ(partitions(), 4);  // today and three ahead
    auto handler = idem::make_handler(*s, idem::Policy{"s"}, writer());
    ASSERT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
              Disposition::processed);
    advance(kDay * 2 + 5h);
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("m-1")).disposition,
              Disposition::duplicate);
    ASSERT_EQ(handler.handle(Delivery{"m-2", 1u}, std::string("m-2")).disposition,
              Disposition::processed);
    EXPECT_EQ(partition_of("m-1"), "idem_claims_p20231114_0000");
    EXPECT_EQ(partition_of("m-2"), "idem_claims_p20231116_0000");
    EXPECT_EQ(count("SELECT count(*) FROM effects"), 2);
    // The outcome recorded in the older partition is the one a duplicate reads.
    const auto claim = s->find_claim("s", "m-1");
    ASSERT_TRUE(claim.has_value());
    EXPECT_EQ(claim->disposition, Disposition::processed);
    EXPECT_EQ(claim->claimed_at, time_point(std::chrono::milliseconds(1'699'920'000'000LL)));
}

TEST_F(PostgresPartitionsTest, ABatchClaimsAcrossPartitionsEachIdOnce) {
    auto s = store(daily());
    {
        auto tx = s->begin();
        const auto first = tx.claim_many("b", {"a", "b"}, {});
        ASSERT_EQ(first[0].status, ClaimStatus::claimed);
        ASSERT_EQ(first[1].status, ClaimStatus::claimed);
        tx.commit();
    }
    advance(kDay);
    auto tx = s->begin();
    const auto claims = tx.claim_many("b", {"c", "a", "c", "d", "b"}, {});
    EXPECT_EQ(claims[0].status, ClaimStatus::claimed);
    EXPECT_EQ(claims[1].status, ClaimStatus::duplicate);  // yesterday's partition
    EXPECT_EQ(claims[2].status, ClaimStatus::duplicate);  // this batch's
    EXPECT_EQ(claims[3].status, ClaimStatus::claimed);
    EXPECT_EQ(claims[4].status, ClaimStatus::duplicate);
    tx.commit();
    EXPECT_EQ(count("SELECT count(*) FROM idem_claims"), 4);
    EXPECT_EQ(count("SELECT count(DISTINCT message_id) FROM idem_claims"), 4);
}

TEST_F(PostgresPartitionsTest, ASecondClaimOfAnIdWaitsForTheFirstAndSeesIt) {
    auto first = store(daily());
    idem::PostgresOptions impatient = daily();
    impatient.lock_timeout = 200ms;
    auto second = store(impatient);
    {
        auto holder = first->begin();
        ASSERT_EQ(holder.claim("s", "x").status, ClaimStatus::claimed);
        // Held past the other's lock_timeout: in progress, nothing written.
        {
            auto waiter = second->begin();
            EXPECT_EQ(waiter.claim("s", "x").status, ClaimStatus::in_progress);
        }
        // Committed while the other waits: the other's claim sees it.
        auto waited = std::async(std::launch::async, [&] {
            idem::PostgresOptions patient = daily();
            auto third = store(patient);
            auto tx = third->begin();
            return tx.claim("s", "x").status;
        });
        std::this_thread::sleep_for(100ms);
        holder.record_outcome("s", "x", Disposition::processed, "");
        holder.commit();
        EXPECT_EQ(waited.get(), ClaimStatus::duplicate);
    }
    auto after = second->begin();
    EXPECT_EQ(after.claim("s", "x").status, ClaimStatus::duplicate);
    EXPECT_EQ(count("SELECT count(*) FROM idem_claims"), 1);
}

TEST_F(PostgresPartitionsTest, PartitionsAreKeptAheadOfTheClock) {
    idem::PostgresOptions options = daily();
    options.claim_partitions_ahead = 1;
    auto s = store(options);
    EXPECT_EQ(partitions(), 2);
    auto handler = idem::make_handler(*s, idem::Policy{"s"}, writer());
    // Ten days on, the store adds the partitions before its transaction needs one.
    advance(kDay * 10);
    ASSERT_EQ(handler.handle(Delivery{"late", 1u}, std::string("late")).disposition,
              Disposition::processed);
    EXPECT_EQ(partition_of("late"), "idem_claims_p20231124_0000");
    EXPECT_EQ(count("SELECT count(*) FROM pg_class WHERE relname IN "
                    "('idem_claims_p20231124_0000', 'idem_claims_p20231125_0000')"),
              2);
    EXPECT_EQ(count("SELECT count(*) FROM effects"), 1);
}

TEST_F(PostgresPartitionsTest, APartitionAnalyzedWhileEmptyIsAnalyzedOnceItHoldsClaims) {
    auto s = store(daily());
    auto handler = idem::make_handler(*s, idem::Policy{"s"}, writer());
    // The whole table analyzed: the partitions made ahead have statistics of no rows, and
    // PostgreSQL would plan the lookups in them as sequential scans.
    exec("ANALYZE idem_claims");
    const std::string tomorrow =
        "SELECT reltuples::bigint FROM pg_class WHERE relname = 'idem_claims_p20231115_0000'";
    EXPECT_EQ(count(tomorrow), 0);
    advance(kDay + 1h);
    ASSERT_EQ(handler.handle(Delivery{"a", 1u}, std::string("a")).disposition,
              Disposition::processed);
    EXPECT_EQ(count(tomorrow), 0);  // it was empty when the store looked
    advance(2s);
    ASSERT_EQ(handler.handle(Delivery{"b", 1u}, std::string("b")).disposition,
              Disposition::processed);
    EXPECT_EQ(count(tomorrow), 1);  // analyzed with its first claim in it
    EXPECT_EQ(handler.handle(Delivery{"a", 2u}, std::string("a")).disposition,
              Disposition::duplicate);
}

TEST_F(PostgresPartitionsTest, AStoreWithoutASpanUsesThePartitionsThatAreThere) {
    auto partitioned = store(daily());
    auto plain = store(clocked());  // no span of its own
    auto a = idem::make_handler(*partitioned, idem::Policy{"s"}, writer());
    auto b = idem::make_handler(*plain, idem::Policy{"s"}, writer());
    ASSERT_EQ(b.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
              Disposition::processed);
    EXPECT_EQ(a.handle(Delivery{"m-1", 2u}, std::string("m-1")).disposition,
              Disposition::duplicate);
    advance(kDay * 8);  // past the partitions the first store made
    EXPECT_EQ(b.handle(Delivery{"m-1", 3u}, std::string("m-1")).disposition,
              Disposition::duplicate);
    ASSERT_EQ(b.handle(Delivery{"m-2", 1u}, std::string("m-2")).disposition,
              Disposition::processed);
    EXPECT_EQ(partition_of("m-2"), "idem_claims_p20231122_0000");
    EXPECT_EQ(count("SELECT count(*) FROM effects"), 2);
    // The claim of an idem that knows no partitions fails (no unique index to conflict on): a
    // failure, never a second claim.
    EXPECT_ANY_THROW(
        exec("INSERT INTO idem_claims(scope, message_id, claimed_at, outcome, reason, "
             "fingerprint) VALUES ('s', 'm-1', 1700640000000, 'processed', '', '') "
             "ON CONFLICT (scope, message_id) DO NOTHING"));
    EXPECT_EQ(count("SELECT count(*) FROM idem_claims"), 2);
}

TEST_F(PostgresPartitionsTest, AnUnpartitionedTableIsConvertedWithItsClaims) {
    {
        auto plain = store(clocked());
        auto handler = idem::make_handler(*plain, idem::Policy{"s"}, writer());
        for (int i = 0; i < 5; ++i) {
            const std::string id = "old-" + std::to_string(i);
            ASSERT_EQ(handler.handle(Delivery{id, 1u}, id).disposition, Disposition::processed);
        }
    }
    EXPECT_EQ(claims_kind(), "r");
    advance(2h);
    auto s = store(daily());
    EXPECT_EQ(claims_kind(), "p");
    // The old table is the partition of everything before tomorrow; today's claims go there.
    EXPECT_EQ(count("SELECT count(*) FROM idem_claims_p_before_20231115_0000"), 5);
    auto handler = idem::make_handler(*s, idem::Policy{"s"}, writer());
    EXPECT_EQ(handler.handle(Delivery{"old-3", 2u}, std::string("old-3")).disposition,
              Disposition::duplicate);
    ASSERT_EQ(handler.handle(Delivery{"new", 1u}, std::string("new")).disposition,
              Disposition::processed);
    EXPECT_EQ(partition_of("new"), "idem_claims_p_before_20231115_0000");
    // Its claims go together, once the newest of them has expired.
    advance(kDay * 2);
    auto kept = s->purge(kDay * 2);
    EXPECT_EQ(kept.claims, 0u);
    EXPECT_EQ(kept.partitions_dropped, 0u);
    advance(kDay);
    auto dropped = s->purge(kDay * 2);
    EXPECT_EQ(dropped.claims, 6u);
    EXPECT_EQ(dropped.partitions_dropped, 1u);
    EXPECT_EQ(count("SELECT count(*) FROM pg_class WHERE relname LIKE 'idem_claims_p_before%'"), 0);
    EXPECT_FALSE(s->find_claim("s", "old-3").has_value());
    // An unpartitioned store opened on it now uses the partitions.
    auto plain = store(clocked());
    auto again = idem::make_handler(*plain, idem::Policy{"s"}, writer());
    EXPECT_EQ(again.handle(Delivery{"fresh", 1u}, std::string("fresh")).disposition,
              Disposition::processed);
    EXPECT_EQ(again.handle(Delivery{"fresh", 2u}, std::string("fresh")).disposition,
              Disposition::duplicate);
}

TEST_F(PostgresPartitionsTest, AStoreRunningWhileTheTableIsConvertedFailsOneClaimThenUsesThem) {
    auto plain = store(clocked());
    auto before = idem::make_handler(*plain, idem::Policy{"s"}, writer());
    ASSERT_EQ(before.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
              Disposition::processed);
    auto converting = store(daily());  // converts the table under the running store
    EXPECT_EQ(claims_kind(), "p");
    // Its claim finds no unique index: failed, not acked, nothing written.
    EXPECT_EQ(before.handle(Delivery{"m-2", 1u}, std::string("m-2")).disposition,
              Disposition::failed);
    // The next transaction learns the partitions.
    EXPECT_EQ(before.handle(Delivery{"m-2", 2u}, std::string("m-2")).disposition,
              Disposition::processed);
    EXPECT_EQ(before.handle(Delivery{"m-1", 2u}, std::string("m-1")).disposition,
              Disposition::duplicate);
    EXPECT_EQ(count("SELECT count(*) FROM effects"), 2);
}

TEST_F(PostgresPartitionsTest, PurgeDropsExactlyTheExpiredPartitionsAndKeepsTheRest) {
    auto s = store(daily());
    auto handler = idem::make_handler(*s, idem::Policy{"s"}, writer());
    idem::PolicyOptions park_at_once;
    park_at_once.max_deliveries = 1;
    auto poison = idem::make_handler(*s, idem::Policy{"s", park_at_once}, writer());
    // Ten claims a day for five days, the first day's last one parked.
    for (int day = 0; day < 5; ++day) {
        for (int i = 0; i < 10; ++i) {
            const std::string id = "d" + std::to_string(day) + "-" + std::to_string(i);
            auto& h = (day == 0 && i == 9) ? poison : handler;
            const auto outcome = h.handle(Delivery{id, day == 0 && i == 9 ? 5u : 1u}, id);
            ASSERT_TRUE(idem::should_ack(outcome)) << outcome.reason;
        }
        advance(kDay);
    }
    // Now the start of day 5: with two days kept, days 0-2 have expired whole.
    advance(1h);
    std::vector<std::size_t> progress;
    idem::PurgeOptions options;
    options.on_batch = [&](const idem::PurgeResult& r) { progress.push_back(r.claims); };
    const auto purged = s->purge(kDay * 2, options);
    EXPECT_EQ(purged.partitions_dropped, 3u);
    EXPECT_EQ(purged.claims, 30u);
    EXPECT_TRUE(purged.complete);
    // A batch per partition (then the other tables' batches).
    ASSERT_GE(progress.size(), 3u);
    EXPECT_EQ(std::vector<std::size_t>(progress.begin(), progress.begin() + 3),
              (std::vector<std::size_t>{10, 20, 30}));
    EXPECT_FALSE(s->find_claim("s", "d2-9").has_value());
    EXPECT_TRUE(s->find_claim("s", "d3-0").has_value());
    EXPECT_EQ(count("SELECT count(*) FROM idem_claims"), 20);
    EXPECT_EQ(s->dead_letters().size(), 1u);  // dead letters are kept
    const auto again = s->purge(kDay * 2);
    EXPECT_EQ(again.claims, 0u);
    EXPECT_EQ(again.partitions_dropped, 0u);
    // A purged id is new again, and claimed in today's partition.
    EXPECT_EQ(handler.handle(Delivery{"d1-1", 2u}, std::string("d1-1")).disposition,
              Disposition::processed);
    EXPECT_EQ(partition_of("d1-1"), "idem_claims_p20231119_0000");
}

TEST_F(PostgresPartitionsTest, AStoppedPurgeLeavesThePartitionsForTheNextRun) {
    auto s = store(daily());
    auto handler = idem::make_handler(*s, idem::Policy{"s"}, writer());
    for (int day = 0; day < 4; ++day) {
        const std::string id = "d" + std::to_string(day);
        ASSERT_EQ(handler.handle(Delivery{id, 1u}, id).disposition, Disposition::processed);
        advance(kDay);
    }
    idem::PurgeOptions once;
    int batches = 0;
    once.should_stop = [&] { return batches >= 1; };
    once.on_batch = [&](const idem::PurgeResult&) { ++batches; };
    const auto first = s->purge(kDay, once);
    EXPECT_FALSE(first.complete);
    EXPECT_EQ(first.partitions_dropped, 1u);
    const auto rest = s->purge(kDay);
    EXPECT_TRUE(rest.complete);
    EXPECT_EQ(rest.partitions_dropped, 2u);
    EXPECT_TRUE(s->find_claim("s", "d3").has_value());
}

TEST_F(PostgresPartitionsTest, BadPartitionOptionsAreRefused) {
    idem::PostgresOptions negative = daily();
    negative.claim_partition_span = std::chrono::minutes(-1);
    EXPECT_THROW(store(negative), idem::usage_error);
    idem::PostgresOptions none_ahead = daily();
    none_ahead.claim_partitions_ahead = 0;
    EXPECT_THROW(store(none_ahead), idem::usage_error);
}

}  // namespace
}  // namespace idem_test::postgres_store
