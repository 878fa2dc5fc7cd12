// Store-counted attempts (count_attempt(scope, id)), the poison limit of brokers without a
// delivery count (Kafka): one typed body over the stores that count (memory, SQLite, PostgreSQL,
// MySQL/MariaDB). Each count is committed on its own, before the claim's transaction: a
// transaction that rolls back, or a worker SIGKILLed between the count and the commit, leaves
// it; workers in several processes counting the same id at once each get their own number.
#include <gtest/gtest.h>

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "idem/idem.hpp"
#include "idem/testing/process.hpp"
#include "idem/testing/temp_dir.hpp"
#include "support/sql_store_envs.hpp"  // IDEM_HAS_<NAME>: which stores this build has
#if IDEM_HAS_POSTGRES
#include "support/postgres_env.hpp"
#include "support/require_postgres.hpp"
#endif
#if IDEM_HAS_MYSQL
#include "support/mysql_env.hpp"
#include "support/require_mariadb.hpp"
#endif

namespace {

using namespace std::chrono_literals;

template <class Env>
class AttemptCount : public idem_test::StoreEnvTest<Env> {};

TYPED_TEST_SUITE(AttemptCount, idem_test::MemoryAndSqlEnvs, idem_test::EnvNames);

template <class Env>
constexpr bool counts_v = idem::has_count_attempt<typename Env::Store>::value;
static_assert(counts_v<idem_test::MemoryEnv>, "MemoryStore counts attempts");
#if IDEM_HAS_SQLITE
static_assert(counts_v<idem_test::SqliteEnv>, "SqliteStore counts attempts");
#endif
static_assert(!idem::has_count_attempt<int>::value, "an int does not");

TYPED_TEST(AttemptCount, CountsPerScopeAndIdAndReadsTheCountBack) {
    auto& store = this->store();
    EXPECT_EQ(store.attempts("orders", "m-1"), 0u);
    EXPECT_EQ(store.count_attempt("orders", "m-1"), 1u);
    EXPECT_EQ(store.count_attempt("orders", "m-1"), 2u);
    EXPECT_EQ(store.count_attempt("orders", "m-1"), 3u);
    EXPECT_EQ(store.count_attempt("orders", "m-2"), 1u);
    EXPECT_EQ(store.count_attempt("refunds", "m-1"), 1u);  // another scope, its own count
    // Binary-safe ids (a NUL, a quote) are counted apart from their prefixes.
    const std::string odd("m-1\0'x", 6);
    EXPECT_EQ(store.count_attempt("orders", odd), 1u);
    EXPECT_EQ(store.attempts("orders", "m-1"), 3u);
    EXPECT_EQ(store.attempts("orders", "m-2"), 1u);
    EXPECT_EQ(store.attempts("orders", odd), 1u);
}

// A broker without a count (DeliveryCounter::store, delivery_count 1 every time): the handler
// counts each attempt in the store before its transaction, so an effect that fails every time is
// parked on the max_deliveries-th attempt, without running, its reason naming the store's count.
TYPED_TEST(AttemptCount, TheHandlerCountsInTheStoreWhenTheBrokerKeepsNoCount) {
    auto& store = this->store();
    idem::PolicyOptions options;
    options.max_deliveries = 3;
    int runs = 0;
    auto handler =
        idem::make_handler(store, idem::Policy{"orders", options}, [&](auto&, const std::string&) {
            ++runs;
            throw std::runtime_error("gateway away");
        });
    idem::Delivery delivery{"m-1", 1u};
    delivery.counted_by = idem::DeliveryCounter::store;
    EXPECT_EQ(handler.handle(delivery, std::string("body")).disposition, idem::Disposition::failed);
    EXPECT_EQ(handler.handle(delivery, std::string("body")).disposition, idem::Disposition::failed);
    const idem::Outcome parked = handler.handle(delivery, std::string("body"));
    EXPECT_EQ(parked.disposition, idem::Disposition::dead_lettered);
    EXPECT_NE(parked.reason.find("attempt 3 (counted in the store"), std::string::npos)
        << parked.reason;
    EXPECT_EQ(runs, 2);
    EXPECT_EQ(store.attempts("orders", "m-1"), 3u);
    // The broker's count (the default) is not replaced: no write, the delivery's own count.
    idem::Delivery counted_by_broker{"m-2", 1u};
    EXPECT_EQ(handler.handle(counted_by_broker, std::string("body")).disposition,
              idem::Disposition::failed);
    EXPECT_EQ(store.attempts("orders", "m-2"), 0u);
}

// handle_batch() counts each store-counted delivery before the batch's transaction.
TYPED_TEST(AttemptCount, HandleBatchCountsEachDeliveryInTheStore) {
    auto& store = this->store();
    idem::PolicyOptions options;
    options.max_deliveries = 2;
    auto handler = idem::make_handler(store, idem::Policy{"orders", options},
                                      [&](auto&, const std::string& body) {
                                          if (body == "bad") throw std::runtime_error("no");
                                      });
    std::vector<idem::Delivery> deliveries{{"a", 1u}, {"b", 1u}};
    for (auto& d : deliveries)
        d.counted_by = idem::DeliveryCounter::store;
    const std::vector<std::string> bodies{"good", "bad"};
    auto first = handler.handle_batch(deliveries, bodies);
    EXPECT_EQ(first[0].disposition, idem::Disposition::processed);
    EXPECT_EQ(first[1].disposition, idem::Disposition::failed);
    auto second = handler.handle_batch(deliveries, bodies);
    EXPECT_EQ(second[0].disposition, idem::Disposition::duplicate);
    EXPECT_EQ(second[1].disposition, idem::Disposition::dead_lettered);
    EXPECT_EQ(store.attempts("orders", "b"), 2u);
}

TYPED_TEST(AttemptCount, ARolledBackClaimLeavesTheCount) {
    auto& store = this->store();
    ASSERT_EQ(store.count_attempt("orders", "m-1"), 1u);
    {
        auto tx = store.begin();
        ASSERT_EQ(tx.claim("orders", "m-1").status, idem::ClaimStatus::claimed);
        // The effect fails: the transaction is dropped without a commit.
    }
    EXPECT_FALSE(store.find_claim("orders", "m-1").has_value());
    EXPECT_EQ(store.attempts("orders", "m-1"), 1u);
    EXPECT_EQ(store.count_attempt("orders", "m-1"), 2u);
}

TYPED_TEST(AttemptCount, IsRefusedInsideThisThreadsOpenTransaction) {
    auto& store = this->store();
    auto tx = store.begin();
    EXPECT_THROW(store.count_attempt("orders", "m-1"), idem::usage_error);
    tx.rollback();
    EXPECT_EQ(store.count_attempt("orders", "m-1"), 1u);
}

TYPED_TEST(AttemptCount, PurgeDeletesCountersOlderThanTheRetention) {
    auto& store = this->store();
    store.count_attempt("orders", "old");
    this->env.now += std::chrono::hours(24 * 15);
    store.count_attempt("orders", "recent");
    const auto purged = store.purge(std::chrono::hours(24 * 14));
    EXPECT_EQ(purged.attempt_counts, 1u);
    EXPECT_EQ(store.attempts("orders", "old"), 0u);
    EXPECT_EQ(store.attempts("orders", "recent"), 1u);
}

TYPED_TEST(AttemptCount, ThreadsCountingOneIdEachGetTheirOwnNumber) {
    auto& store = this->store();
    constexpr int per_thread = 40;
    std::vector<std::uint32_t> seen[2];
    std::thread threads[2];
    for (int t = 0; t < 2; ++t) {
        threads[t] = std::thread([&, t] {
            for (int i = 0; i < per_thread; ++i)
                seen[t].push_back(store.count_attempt("orders", "hot"));
        });
    }
    for (auto& thread : threads)
        thread.join();
    std::set<std::uint32_t> all(seen[0].begin(), seen[0].end());
    all.insert(seen[1].begin(), seen[1].end());
    EXPECT_EQ(all.size(), 2u * per_thread);
    EXPECT_EQ(*all.begin(), 1u);
    EXPECT_EQ(*all.rbegin(), 2u * per_thread);
    EXPECT_EQ(store.attempts("orders", "hot"), 2u * per_thread);
}

#if IDEM_HAS_SQLITE
TEST(AttemptCountSchema, AVersionOneSqliteDatabaseIsMigratedToCountAttempts) {
    idem::testing::TempDir dir;
    const std::string path = dir.file("v1.db");
    {
        idem::SqliteStore store{path};
        // Back to what version 1 wrote: no attempts table (nor version 3's offsets, nor version
        // 4's redrive columns, nor version 5's origin and failures).
        store.execute("DROP TABLE idem_attempts");
        store.execute("DROP TABLE idem_offsets");
        store.execute("DROP INDEX idem_dead_letters_message");
        for (const char* column : {"redrive_count", "redriven_at", "origin", "origin_position",
                                   "failure", "first_failed_at", "last_failed_at"}) {
            store.execute(std::string("ALTER TABLE idem_dead_letters DROP COLUMN ") + column);
        }
        for (const char* column : {"scope", "message_id"})  // nor version 6's intent's writer
            store.execute(std::string("ALTER TABLE idem_outbox DROP COLUMN ") + column);
        store.execute("UPDATE idem_schema SET version = 1");
    }
    idem::SqliteStore store{path};  // migrated through versions 2, 3 and 4
    EXPECT_EQ(store.query_int("SELECT version FROM idem_schema"),
              idem::SqliteStore::schema_version);
    EXPECT_EQ(store.query_int("SELECT count(*) FROM sqlite_master WHERE name = 'idem_offsets'"), 1);
    EXPECT_EQ(store.count_attempt("orders", "m-1"), 1u);
    EXPECT_EQ(store.count_attempt("orders", "m-1"), 2u);
}
#endif

#if IDEM_HAS_SQLITE || IDEM_HAS_POSTGRES || IDEM_HAS_MYSQL
// The same across processes: the SQL stores, used by fork()ed workers.
template <class Env>
class AttemptCountAcrossProcesses : public AttemptCount<Env> {
  protected:
    /// The store a fork()ed worker uses: the inherited one (SQLite and PostgreSQL reopen their
    /// connection in the child), or, for MySQL, whose driver cannot, one opened in the child.
    typename Env::Store& worker_store() {
#if IDEM_HAS_MYSQL
        if constexpr (std::is_same_v<typename Env::Store, idem::MysqlStore>) {
            worker_ =
                std::make_unique<idem::MysqlStore>(idem_test::mariadb_endpoint(this->env.database));
            return *worker_;
        }
#endif
        return this->store();
    }

  private:
    std::unique_ptr<typename Env::Store> worker_;
};

using SqlStores = ::testing::Types<
#if IDEM_HAS_SQLITE
    idem_test::SqliteEnv
#endif
#if IDEM_HAS_POSTGRES
#if IDEM_HAS_SQLITE
    ,
#endif
    idem_test::PostgresEnv
#endif
#if IDEM_HAS_MYSQL
#if IDEM_HAS_SQLITE || IDEM_HAS_POSTGRES
    ,
#endif
    idem_test::MysqlEnv
#endif
    >;

TYPED_TEST_SUITE(AttemptCountAcrossProcesses, SqlStores, idem_test::EnvNames);

TYPED_TEST(AttemptCountAcrossProcesses, AWorkerKilledBetweenTheCountAndTheCommitHasCounted) {
    {
        auto& store = this->store();
        // A worker counts, claims, writes the effect and dies before the commit (SIGKILL: no
        // destructor, no rollback of its own; the database ends the transaction).
        for (int crash = 1; crash <= 2; ++crash) {
            const auto killed = idem::testing::killed_while([&](auto die) {
                auto& worker = this->worker_store();
                const auto count = worker.count_attempt("orders", "poison");
                auto tx = worker.begin();
                if (tx.claim("orders", "poison").status != idem::ClaimStatus::claimed) {
                    die("not claimed");
                }
                TypeParam::write_effect(tx, std::string("poison"));
                die("counted " + std::to_string(count));
            });
            ASSERT_TRUE(WIFSIGNALED(killed.status)) << killed.report;
            EXPECT_EQ(killed.report, "counted " + std::to_string(crash) + "\n");
        }
        EXPECT_FALSE(store.find_claim("orders", "poison").has_value());
        EXPECT_EQ(this->env.effect_rows(), 0u);
        EXPECT_EQ(store.attempts("orders", "poison"), 2u);
        // The third worker sees the two dead ones: with a limit of 3 it parks the message.
        EXPECT_EQ(store.count_attempt("orders", "poison"), 3u);
    }
}

TYPED_TEST(AttemptCountAcrossProcesses, ProcessesRacingOnOneIdEachGetTheirOwnNumber) {
    {
        auto& store = this->store();
        store.count_attempt("orders", "warm-up");  // the schema and connection exist before fork
        constexpr int workers = 3;
        constexpr int per_worker = 25;
        std::vector<pid_t> pids;
        std::vector<int> reads;
        for (int w = 0; w < workers; ++w) {
            int fds[2];
            ASSERT_EQ(::pipe(fds), 0);
            const pid_t pid = ::fork();
            ASSERT_GE(pid, 0);
            if (pid == 0) {
                ::close(fds[0]);
                int code = 0;
                std::string out;
                try {
                    auto& worker = this->worker_store();
                    for (int i = 0; i < per_worker; ++i)
                        out += std::to_string(worker.count_attempt("orders", "race")) + "\n";
                } catch (const std::exception& e) {
                    out += std::string("error ") + e.what() + "\n";
                    code = 1;
                }
                (void)!::write(fds[1], out.data(), out.size());
                ::_exit(code);
            }
            ::close(fds[1]);
            pids.push_back(pid);
            reads.push_back(fds[0]);
        }
        std::multiset<std::uint32_t> numbers;
        for (int w = 0; w < workers; ++w) {
            std::string text;
            char buffer[512];
            for (ssize_t n; (n = ::read(reads[w], buffer, sizeof buffer)) > 0;)
                text.append(buffer, static_cast<std::size_t>(n));
            ::close(reads[w]);
            const auto status = idem::testing::wait_for(pids[w], 60s);
            ASSERT_TRUE(status.has_value());
            EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << text;
            std::istringstream lines(text);
            for (std::string line; std::getline(lines, line);) {
                ASSERT_EQ(line.find("error"), std::string::npos) << line;
                numbers.insert(static_cast<std::uint32_t>(std::stoul(line)));
            }
        }
        ASSERT_EQ(numbers.size(), static_cast<std::size_t>(workers * per_worker));
        // Every number from 1 to the total exactly once: no lost update, no number given twice.
        std::uint32_t expected = 1;
        for (const auto n : numbers)
            EXPECT_EQ(n, expected++);
        EXPECT_EQ(store.attempts("orders", "race"),
                  static_cast<std::uint32_t>(workers * per_worker));
    }
}

// ---- CountAhead: the next delivery's attempt counted in the commit before it ----

idem::Delivery store_counted(const std::string& id) {
    idem::Delivery delivery{id, 1u};
    delivery.counted_by = idem::DeliveryCounter::store;
    return delivery;
}

#if IDEM_HAS_SQLITE
static_assert(idem::has_tx_count_attempt<idem::SqliteStore::Transaction>::value,
              "a SQL transaction counts an attempt in its commit");
#endif
static_assert(!idem::has_tx_count_attempt<idem::MemoryStore::Transaction>::value,
              "the memory store counts apart (its count is never rolled back)");

// The handler counts the next delivery's attempt inside this one's transaction: after the
// first handle() the second's count is on record, and the second handle() takes it instead of
// counting again.
TYPED_TEST(AttemptCountAcrossProcesses, TheNextDeliveryIsCountedInTheCommitBeforeIt) {
    auto& store = this->store();
    auto handler = idem::make_handler(
        store, idem::Policy{"orders"},
        [&](auto& tx, const std::string& body) { TypeParam::write_effect(tx, body); });
    idem::CountAhead ahead;
    ahead.next(store_counted("b"));
    EXPECT_EQ(handler.handle(store_counted("a"), std::string("a"), ahead).disposition,
              idem::Disposition::processed);
    EXPECT_EQ(store.attempts("orders", "a"), 1u);
    EXPECT_EQ(store.attempts("orders", "b"), 1u) << "counted in a's commit";
    ahead.none();
    const idem::Outcome b = handler.handle(store_counted("b"), std::string("b"), ahead);
    EXPECT_EQ(b.disposition, idem::Disposition::processed);
    EXPECT_EQ(store.attempts("orders", "b"), 1u) << "not counted a second time";
    EXPECT_EQ(this->env.effect_rows(), 2u);
}

// No commit, no count ahead: a failed (rolled back) or duplicate message leaves the next one to
// count itself; a count made for another id is dropped, and that id counts itself when it comes.
TYPED_TEST(AttemptCountAcrossProcesses, WithoutACommitOrForAnotherIdTheNextCountsItself) {
    auto& store = this->store();
    auto handler =
        idem::make_handler(store, idem::Policy{"orders"}, [&](auto& tx, const std::string& body) {
            if (body == "fails") throw std::runtime_error("no");
            TypeParam::write_effect(tx, body);
        });
    idem::CountAhead ahead;
    ahead.next(store_counted("b"));
    EXPECT_EQ(handler.handle(store_counted("a"), std::string("fails"), ahead).disposition,
              idem::Disposition::failed);
    EXPECT_EQ(store.attempts("orders", "b"), 0u) << "rolled back with a's transaction";
    EXPECT_EQ(handler.handle(store_counted("b"), std::string("b"), ahead).disposition,
              idem::Disposition::processed);
    EXPECT_EQ(store.attempts("orders", "b"), 1u);

    ahead.next(store_counted("c"));  // b again: a duplicate commits nothing
    EXPECT_EQ(handler.handle(store_counted("b"), std::string("b"), ahead).disposition,
              idem::Disposition::duplicate);
    EXPECT_EQ(store.attempts("orders", "c"), 0u);

    ahead.next(store_counted("d"));  // d counted in e's commit, then c comes instead
    EXPECT_EQ(handler.handle(store_counted("e"), std::string("e"), ahead).disposition,
              idem::Disposition::processed);
    EXPECT_EQ(store.attempts("orders", "d"), 1u);
    ahead.none();
    EXPECT_EQ(handler.handle(store_counted("c"), std::string("c"), ahead).disposition,
              idem::Disposition::processed);
    EXPECT_EQ(store.attempts("orders", "c"), 1u);
    EXPECT_EQ(handler.handle(store_counted("d"), std::string("d"), ahead).disposition,
              idem::Disposition::processed);
    EXPECT_EQ(store.attempts("orders", "d"), 2u) << "d's first count was not its attempt's";
}

// The poison limit still ends a message that kills every worker when its attempts are counted
// ahead: each worker handles a message of its own and then the poison one, whose count committed
// with that message; the worker dies in the poison's effect, the count stays, and the third
// attempt parks it without running it.
TYPED_TEST(AttemptCountAcrossProcesses, AWorkerKilledInAnEffectCountedAheadHasCountedIt) {
    auto& store = this->store();
    store.count_attempt("orders", "warm-up");  // the schema and connection exist before fork
    idem::PolicyOptions options;
    options.max_deliveries = 3;
    for (int crash = 1; crash <= 2; ++crash) {
        const auto killed = idem::testing::killed_while([&](auto die) {
            auto& worker = this->worker_store();
            auto handler = idem::make_handler(worker, idem::Policy{"orders", options},
                                              [&](auto& tx, const std::string& body) {
                                                  if (body == "poison") die("killed");
                                                  TypeParam::write_effect(tx, body);
                                              });
            idem::CountAhead ahead;
            const std::string before = "before-" + std::to_string(crash);
            ahead.next(store_counted("poison"));
            if (handler.handle(store_counted(before), before, ahead).disposition !=
                idem::Disposition::processed) {
                die("the message before was not processed");
            }
            ahead.none();
            (void)handler.handle(store_counted("poison"), std::string("poison"), ahead);
            die("the poison message did not kill the worker");
        });
        ASSERT_TRUE(WIFSIGNALED(killed.status)) << killed.report;
        EXPECT_EQ(killed.report, "killed\n");
        EXPECT_EQ(store.attempts("orders", "poison"), static_cast<std::uint32_t>(crash));
    }
    EXPECT_EQ(store.attempts("orders", "poison"), 2u);
    int runs = 0;
    auto handler = idem::make_handler(store, idem::Policy{"orders", options},
                                      [&](auto& tx, const std::string& body) {
                                          ++runs;
                                          TypeParam::write_effect(tx, body);
                                      });
    const idem::Outcome parked = handler.handle(store_counted("poison"), std::string("poison"));
    EXPECT_EQ(parked.disposition, idem::Disposition::dead_lettered) << parked.reason;
    EXPECT_NE(parked.reason.find("attempt 3"), std::string::npos) << parked.reason;
    EXPECT_EQ(runs, 0);
    EXPECT_EQ(this->env.effect_rows(), 2u) << "before-1 and before-2";
}

#endif  // the SQL stores

}  // namespace
