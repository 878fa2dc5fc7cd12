// MysqlStore with its claims in partitions (MysqlOptions::claim_partition_span) against a real
// MariaDB server: a claim found in whichever partition holds it, one claim per id across
// partitions while stores race (both isolation levels, single claims and batches), the claim's
// read after an earlier read of its transaction, partitions kept ahead of the clock, a table
// converted with its claims, an insert written for one table refused, and purge() dropping
// exactly the partitions that have expired.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <future>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/store/mysql.hpp"
#include "idem/testing/mariadb_server.hpp"
#include "support/mysql_env.hpp"
#include "support/require_mariadb.hpp"

namespace {

using idem::ClaimStatus;
using idem::Delivery;
using idem::Disposition;
using idem::MysqlStore;
using time_point = std::chrono::system_clock::time_point;
using namespace std::chrono_literals;

constexpr auto kDay = std::chrono::hours(24);

class MysqlPartitionsTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_MARIADB();
        database_ = idem_test::fresh_mariadb_database();
        exec("CREATE TABLE effects(message_id BLOB NOT NULL) ENGINE=InnoDB");
        // Midnight UTC: the first partition starts at the clock.
        now_ms_ = 1'700'000'000'000LL - 1'700'000'000'000LL % 86'400'000LL;
    }
    void TearDown() override {
        if (database_.empty()) return;
        try {
            idem::testing::shared_mariadb().client("").exec("DROP DATABASE IF EXISTS " + database_);
        } catch (...) {
        }
    }

    void exec(const std::string& sql) const {
        idem::testing::shared_mariadb().client(database_).exec(sql);
    }
    [[nodiscard]] long long count(const std::string& sql) const {
        return std::stoll(
            idem::testing::shared_mariadb().client(database_).value(sql).value_or("-1"));
    }
    /// Options on the test's clock, claims in one table.
    idem::MysqlOptions clocked() {
        idem::MysqlOptions options;
        options.clock = [this] { return time_point(std::chrono::milliseconds(now_ms_.load())); };
        return options;
    }
    /// A day per partition, on the test's clock.
    idem::MysqlOptions daily() {
        idem::MysqlOptions options = clocked();
        options.claim_partition_span = kDay;
        return options;
    }
    std::unique_ptr<MysqlStore> store(const idem::MysqlOptions& options) const {
        return std::make_unique<MysqlStore>(idem_test::mariadb_endpoint(database_), options);
    }
    void advance(std::chrono::milliseconds by) { now_ms_ += by.count(); }

    /// The effect: one row per message, in the claim's transaction.
    static auto writer() {
        return [](auto& tx, const std::string& body) {
            tx.execute("INSERT INTO effects(message_id) VALUES (?)", idem::Blob{body});
        };
    }
    [[nodiscard]] long long partitions() const {
        return count(
            "SELECT COUNT(*) FROM information_schema.PARTITIONS WHERE TABLE_SCHEMA = DATABASE() "
            "AND TABLE_NAME = 'idem_claims' AND PARTITION_NAME IS NOT NULL");
    }
    /// The partition holding @p id's claim.
    [[nodiscard]] std::string partition_of(const std::string& id) const {
        auto client = idem::testing::shared_mariadb().client(database_);
        const std::string names =
            client
                .value(
                    "SELECT GROUP_CONCAT(PARTITION_NAME) FROM information_schema.PARTITIONS "
                    "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'idem_claims'")
                .value_or("");
        std::size_t from = 0;
        while (from <= names.size()) {
            const std::size_t comma = std::min(names.find(',', from), names.size());
            const std::string name = names.substr(from, comma - from);
            if (!name.empty() && client.value("SELECT COUNT(*) FROM idem_claims PARTITION (" +
                                              name + ") WHERE message_id = '" + id + "'")
                                         .value_or("0") != "0")
                return name;
            from = comma + 1;
        }
        return "";
    }

    void stores_deliver_the_same_ids(const idem::MysqlOptions& options);
    void stores_deliver_the_same_ids_in_batches(const idem::MysqlOptions& options);
    void expect_each_effect_once(long long ids, long stores, long processed, long duplicates,
                                 long retried, const char* run) const {
        EXPECT_EQ(processed, ids);
        EXPECT_EQ(duplicates, ids * (stores - 1));
        EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), ids);
        EXPECT_EQ(count("SELECT COUNT(DISTINCT message_id) FROM effects"), ids);
        EXPECT_EQ(count("SELECT COUNT(*) FROM idem_claims"), ids);
        std::printf("%s: %ld processed, %ld duplicates, %ld retried\n", run, processed, duplicates,
                    retried);
    }

    std::string database_;
    std::atomic<long long> now_ms_{0};
};

TEST_F(MysqlPartitionsTest, AClaimIsFoundInWhicheverPartitionHoldsIt) {
    auto s = store(daily());
    EXPECT_EQ(partitions(), 4);  // today and three ahead
    EXPECT_EQ(count("SELECT COUNT(*) FROM idem_claim_locks"), 65536);
    auto handler = idem::make_handler(*s, idem::Policy{"s"}, writer());
    ASSERT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
              Disposition::processed);
    advance(kDay * 2 + 5h);
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("m-1")).disposition,
              Disposition::duplicate);
    ASSERT_EQ(handler.handle(Delivery{"m-2", 1u}, std::string("m-2")).disposition,
              Disposition::processed);
    EXPECT_EQ(partition_of("m-1"), "p20231114_0000");
    EXPECT_EQ(partition_of("m-2"), "p20231116_0000");
    EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), 2);
    const auto claim = s->find_claim("s", "m-1");
    ASSERT_TRUE(claim.has_value());
    EXPECT_EQ(claim->disposition, Disposition::processed);
    EXPECT_EQ(claim->claimed_at, time_point(std::chrono::milliseconds(1'699'920'000'000LL)));
}

TEST_F(MysqlPartitionsTest, ABatchClaimsAcrossPartitionsEachIdOnce) {
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
    EXPECT_EQ(count("SELECT COUNT(*) FROM idem_claims"), 4);
    EXPECT_EQ(count("SELECT COUNT(DISTINCT message_id) FROM idem_claims"), 4);
}

TEST_F(MysqlPartitionsTest, ASecondClaimOfAnIdWaitsForTheFirstAndSeesIt) {
    for (const auto isolation :
         {idem::MysqlIsolation::repeatable_read, idem::MysqlIsolation::read_committed}) {
        idem::MysqlOptions options = daily();
        options.isolation = isolation;
        options.lock_wait_timeout = 1s;
        const std::string id = isolation == idem::MysqlIsolation::read_committed ? "rc" : "rr";
        auto first = store(options);
        auto second = store(options);
        auto holder = first->begin();
        ASSERT_EQ(holder.claim("s", id).status, ClaimStatus::claimed);
        {
            // Held past the other's lock wait timeout: in progress, nothing written.
            auto waiter = second->begin();
            EXPECT_EQ(waiter.claim("s", id).status, ClaimStatus::in_progress);
        }
        // Committed while the other waits: the other's claim sees it.
        idem::MysqlOptions patient = options;
        patient.lock_wait_timeout = 10s;
        auto waited = std::async(std::launch::async, [&] {
            auto third = store(patient);
            auto tx = third->begin();
            return tx.claim("s", id).status;
        });
        std::this_thread::sleep_for(300ms);
        holder.record_outcome("s", id, Disposition::processed, "");
        holder.commit();
        EXPECT_EQ(waited.get(), ClaimStatus::duplicate);
        auto after = second->begin();
        EXPECT_EQ(after.claim("s", id).status, ClaimStatus::duplicate);
    }
    EXPECT_EQ(count("SELECT COUNT(*) FROM idem_claims"), 2);
}

TEST_F(MysqlPartitionsTest, AClaimAfterAReadInItsTransactionStillSeesTheLatestCommit) {
    // REPEATABLE READ: the transaction's first read fixes its snapshot; a claim that comes after
    // it must not miss a claim committed since (it reads with a lock instead).
    idem::MysqlOptions options = daily();
    options.isolation = idem::MysqlIsolation::repeatable_read;
    auto reader = store(options);
    auto other = store(options);
    auto tx = reader->begin();
    EXPECT_EQ(tx.query_int("SELECT COUNT(*) FROM effects").value_or(-1), 0);  // the snapshot
    {
        auto meanwhile = other->begin();
        ASSERT_EQ(meanwhile.claim("s", "late").status, ClaimStatus::claimed);
        meanwhile.record_outcome("s", "late", Disposition::processed, "");
        meanwhile.commit();
    }
    EXPECT_EQ(tx.claim("s", "late").status, ClaimStatus::duplicate);
    const auto batch = tx.claim_many("s", {"late", "new"}, {});
    EXPECT_EQ(batch[0].status, ClaimStatus::duplicate);
    EXPECT_EQ(batch[1].status, ClaimStatus::claimed);
    tx.commit();
    EXPECT_EQ(count("SELECT COUNT(*) FROM idem_claims"), 2);
}

void MysqlPartitionsTest::stores_deliver_the_same_ids(const idem::MysqlOptions& options) {
    constexpr int kStores = 6;
    constexpr int kIds = 600;
    idem::PolicyOptions patient;
    patient.max_deliveries = 1000;  // a lock wait timeout is a retry, not a step to poison
    std::atomic<long> processed{0}, duplicates{0}, retried{0};
    std::vector<std::unique_ptr<MysqlStore>> stores;
    for (int t = 0; t < kStores; ++t)
        stores.push_back(store(options));
    std::mutex mutex;
    std::condition_variable start;
    bool go = false;
    std::vector<std::thread> threads;
    for (int t = 0; t < kStores; ++t) {
        threads.emplace_back([&, t] {
            auto handler = idem::make_handler(*stores[static_cast<std::size_t>(t)],
                                              idem::Policy{"capture", patient}, writer());
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
    expect_each_effect_once(kIds, kStores, processed, duplicates, retried,
                            "6 stores x 600 ids on partitioned claims");
}

TEST_F(MysqlPartitionsTest, SixStoresDeliveringTheSameIdsApplyEachEffectOnce) {
    stores_deliver_the_same_ids(daily());
}

TEST_F(MysqlPartitionsTest, SixStoresUnderReadCommittedApplyEachEffectOnce) {
    idem::MysqlOptions options = daily();
    options.isolation = idem::MysqlIsolation::read_committed;
    stores_deliver_the_same_ids(options);
}

void MysqlPartitionsTest::stores_deliver_the_same_ids_in_batches(
    const idem::MysqlOptions& options) {
    constexpr int kStores = 4;
    constexpr int kIds = 300;
    constexpr std::size_t kBatch = 20;
    idem::PolicyOptions patient;
    patient.max_deliveries = 100000;
    std::atomic<long> processed{0}, duplicates{0}, retried{0};
    std::vector<std::unique_ptr<MysqlStore>> stores;
    for (int t = 0; t < kStores; ++t)
        stores.push_back(store(options));
    std::vector<std::thread> threads;
    for (int t = 0; t < kStores; ++t) {
        threads.emplace_back([&, t] {
            auto handler = idem::make_handler(*stores[static_cast<std::size_t>(t)],
                                              idem::Policy{"capture", patient}, writer());
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
    expect_each_effect_once(kIds, kStores, processed, duplicates, retried,
                            "4 stores x 300 ids in batches of 20 on partitioned claims");
}

TEST_F(MysqlPartitionsTest, FourStoresDeliveringTheSameIdsInBatchesApplyEachEffectOnce) {
    stores_deliver_the_same_ids_in_batches(daily());
}

TEST_F(MysqlPartitionsTest, FourStoresInBatchesUnderReadCommittedApplyEachEffectOnce) {
    idem::MysqlOptions options = daily();
    options.isolation = idem::MysqlIsolation::read_committed;
    stores_deliver_the_same_ids_in_batches(options);
}

TEST_F(MysqlPartitionsTest, PartitionsAreKeptAheadOfTheClock) {
    idem::MysqlOptions options = daily();
    options.claim_partitions_ahead = 1;
    auto s = store(options);
    EXPECT_EQ(partitions(), 2);
    auto handler = idem::make_handler(*s, idem::Policy{"s"}, writer());
    // Ten days on, the store adds the partitions before its transaction needs one.
    advance(kDay * 10);
    ASSERT_EQ(handler.handle(Delivery{"late", 1u}, std::string("late")).disposition,
              Disposition::processed);
    EXPECT_EQ(partition_of("late"), "p20231124_0000");
    // Days 0 and 1, one partition for the days no claim came (2 to 9), then 10 and 11.
    EXPECT_EQ(partitions(), 5);
    EXPECT_EQ(count("SELECT COUNT(*) FROM information_schema.PARTITIONS WHERE TABLE_SCHEMA = "
                    "DATABASE() AND PARTITION_NAME = 'p20231116_0000' AND "
                    "PARTITION_DESCRIPTION = '1700784000000'"),
              1);
    EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), 1);
}

TEST_F(MysqlPartitionsTest, AStoreWithoutASpanUsesThePartitionsThatAreThere) {
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
    EXPECT_EQ(partition_of("m-2"), "p20231122_0000");
    EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), 2);
    // The claim of an idem that knows no partitions (an upsert on the unique key they lack) is
    // refused, in strict mode and without: a failure, never a second claim.
    const std::string upsert =
        "INSERT INTO idem_claims(scope, message_id, claimed_at, outcome, reason, fingerprint) "
        "VALUES ('s', 'm-1', 1700640000000, 'processed', '', '') "
        "ON DUPLICATE KEY UPDATE claimed_at = claimed_at";
    EXPECT_ANY_THROW(exec(upsert));
    EXPECT_ANY_THROW(exec("SET SESSION sql_mode = ''; " + upsert));
    EXPECT_EQ(count("SELECT COUNT(*) FROM idem_claims"), 2);
}

TEST_F(MysqlPartitionsTest, AOneTableClaimsTableIsConvertedWithItsClaims) {
    {
        auto plain = store(clocked());
        auto handler = idem::make_handler(*plain, idem::Policy{"s"}, writer());
        for (int i = 0; i < 5; ++i) {
            const std::string id = "old-" + std::to_string(i);
            ASSERT_EQ(handler.handle(Delivery{id, 1u}, id).disposition, Disposition::processed);
        }
    }
    EXPECT_EQ(partitions(), 0);
    advance(2h);
    auto s = store(daily());
    // The old claims are the partition of everything before tomorrow; today's claims go there.
    EXPECT_EQ(count("SELECT COUNT(*) FROM idem_claims PARTITION (p_before_20231115_0000)"), 5);
    EXPECT_EQ(partitions(), 4);  // that one, tomorrow and two more: three ahead of today
    auto handler = idem::make_handler(*s, idem::Policy{"s"}, writer());
    EXPECT_EQ(handler.handle(Delivery{"old-3", 2u}, std::string("old-3")).disposition,
              Disposition::duplicate);
    ASSERT_EQ(handler.handle(Delivery{"new", 1u}, std::string("new")).disposition,
              Disposition::processed);
    EXPECT_EQ(partition_of("new"), "p_before_20231115_0000");
    // Its claims go together, once the newest of them has expired.
    advance(kDay * 2);
    auto kept = s->purge(kDay * 2);
    EXPECT_EQ(kept.claims, 0u);
    EXPECT_EQ(kept.partitions_dropped, 0u);
    advance(kDay);
    auto dropped = s->purge(kDay * 2);
    EXPECT_EQ(dropped.claims, 6u);
    EXPECT_EQ(dropped.partitions_dropped, 1u);
    EXPECT_FALSE(s->find_claim("s", "old-3").has_value());
    EXPECT_EQ(handler.handle(Delivery{"old-3", 3u}, std::string("old-3")).disposition,
              Disposition::processed);
}

TEST_F(MysqlPartitionsTest, AStoreRunningWhileTheTableIsConvertedFailsOneClaimThenUsesThem) {
    auto plain = store(clocked());
    auto before = idem::make_handler(*plain, idem::Policy{"s"}, writer());
    ASSERT_EQ(before.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
              Disposition::processed);
    auto converting = store(daily());  // converts the table under the running store
    EXPECT_EQ(partitions(), 4);
    // Its claim does not write the key the partitioned table checks: failed, not acked.
    EXPECT_EQ(before.handle(Delivery{"m-2", 1u}, std::string("m-2")).disposition,
              Disposition::failed);
    // The next transaction learns the partitions.
    EXPECT_EQ(before.handle(Delivery{"m-2", 2u}, std::string("m-2")).disposition,
              Disposition::processed);
    EXPECT_EQ(before.handle(Delivery{"m-1", 2u}, std::string("m-1")).disposition,
              Disposition::duplicate);
    EXPECT_EQ(count("SELECT COUNT(*) FROM effects"), 2);
}

TEST_F(MysqlPartitionsTest, PurgeDropsExactlyTheExpiredPartitionsAndKeepsTheRest) {
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
    ASSERT_GE(progress.size(), 3u);
    EXPECT_EQ(std::vector<std::size_t>(progress.begin(), progress.begin() + 3),
              (std::vector<std::size_t>{10, 20, 30}));
    EXPECT_FALSE(s->find_claim("s", "d2-9").has_value());
    EXPECT_TRUE(s->find_claim("s", "d3-0").has_value());
    EXPECT_EQ(count("SELECT COUNT(*) FROM idem_claims"), 20);
    EXPECT_EQ(s->dead_letters().size(), 1u);  // dead letters are kept
    const auto again = s->purge(kDay * 2);
    EXPECT_EQ(again.claims, 0u);
    EXPECT_EQ(again.partitions_dropped, 0u);
    // A purged id is new again, and claimed in today's partition.
    EXPECT_EQ(handler.handle(Delivery{"d1-1", 2u}, std::string("d1-1")).disposition,
              Disposition::processed);
    EXPECT_EQ(partition_of("d1-1"), "p20231119_0000");
}

TEST_F(MysqlPartitionsTest, ADropWaitsAtMostASecondForATransactionUsingTheClaims) {
    auto s = store(daily());
    auto other = store(daily());
    auto handler = idem::make_handler(*s, idem::Policy{"s"}, writer());
    ASSERT_EQ(handler.handle(Delivery{"d0", 1u}, std::string("d0")).disposition,
              Disposition::processed);
    advance(kDay * 2);
    // A transaction that used the claims holds their metadata lock until it ends.
    auto open = other->begin();
    ASSERT_EQ(open.claim("s", "open").status, ClaimStatus::claimed);
    const auto started = std::chrono::steady_clock::now();
    EXPECT_THROW(s->purge(kDay), idem::store_timeout);
    const auto waited = std::chrono::steady_clock::now() - started;
    EXPECT_LT(waited, 5s);
    open.commit();
    const auto purged = s->purge(kDay);
    EXPECT_EQ(purged.partitions_dropped, 1u);
    EXPECT_EQ(purged.claims, 1u);
    EXPECT_TRUE(s->find_claim("s", "open").has_value());
}

TEST_F(MysqlPartitionsTest, BadPartitionOptionsAreRefused) {
    idem::MysqlOptions negative = daily();
    negative.claim_partition_span = std::chrono::minutes(-1);
    EXPECT_THROW(store(negative), idem::usage_error);
    idem::MysqlOptions none_ahead = daily();
    none_ahead.claim_partitions_ahead = 0;
    EXPECT_THROW(store(none_ahead), idem::usage_error);
}

}  // namespace
