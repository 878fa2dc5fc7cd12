// Store-level tests of idem::SqliteStore on real database files, one fresh temp dir per test.

#include "idem/store/sqlite.hpp"

#include <gtest/gtest.h>
#include <sqlite3.h>
#include <stdlib.h>  // mkdtemp

#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace {

using namespace std::chrono_literals;
using idem::ClaimStatus;
using idem::Disposition;
using idem::SqliteOptions;
using idem::SqliteStore;
using time_point = std::chrono::system_clock::time_point;

static_assert(idem::detail::is_store_v<SqliteStore>);
static_assert(!std::is_copy_constructible_v<SqliteStore::Transaction>);
static_assert(std::is_nothrow_move_constructible_v<SqliteStore::Transaction>);
#if IDEM_HAS_CONCEPTS
static_assert(idem::IdempotencyStore<SqliteStore>);
#endif

// A millisecond-aligned instant: the store keeps unix milliseconds.
const time_point t0 = time_point(std::chrono::milliseconds(1'700'000'000'123));

/// A plain connection of the test's own, for looking at the file behind the store's back.
class RawDb {
  public:
    explicit RawDb(const std::string& path) {
        if (sqlite3_open(path.c_str(), &db_) != SQLITE_OK) {
            ADD_FAILURE() << "cannot open " << path << ": " << sqlite3_errmsg(db_);
        }
    }
    RawDb(const RawDb&) = delete;
    RawDb& operator=(const RawDb&) = delete;
    ~RawDb() {
        if (db_ != nullptr) {
            EXPECT_EQ(sqlite3_close(db_), SQLITE_OK) << sqlite3_errmsg(db_);
        }
    }
    sqlite3* get() const { return db_; }
    void exec(const std::string& sql) {
        char* message = nullptr;
        const int rc = sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &message);
        EXPECT_EQ(rc, SQLITE_OK) << sql << ": " << (message ? message : "");
        sqlite3_free(message);
    }
    long long count(const std::string& sql) {
        sqlite3_stmt* stmt = nullptr;
        EXPECT_EQ(sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt, nullptr), SQLITE_OK)
            << sqlite3_errmsg(db_);
        long long value = -1;
        if (sqlite3_step(stmt) == SQLITE_ROW) value = sqlite3_column_int64(stmt, 0);
        sqlite3_finalize(stmt);
        return value;
    }

  private:
    sqlite3* db_ = nullptr;
};

class SqliteStoreTest : public ::testing::Test {
  protected:
    void SetUp() override {
        std::string pattern = "/tmp/idem-sqlite-XXXXXX";
        ASSERT_NE(mkdtemp(pattern.data()), nullptr);
        dir_ = pattern;
    }
    void TearDown() override {
        std::error_code ignored;
        std::filesystem::remove_all(dir_, ignored);
    }
    std::string file(const std::string& name = "idem.db") const { return dir_ + "/" + name; }

    /// Options whose clock the test moves by hand.
    SqliteOptions manual_clock() {
        SqliteOptions options;
        options.clock = [this] { return now_; };
        return options;
    }

    std::string dir_;
    time_point now_ = t0;
};

void claim_and_commit(SqliteStore& store, std::string_view scope, std::string_view id,
                      Disposition outcome = Disposition::processed, std::string_view reason = {}) {
    auto tx = store.begin();
    ASSERT_EQ(tx.claim(scope, id).status, ClaimStatus::claimed);
    tx.record_outcome(scope, id, outcome, reason);
    tx.commit();
}

// --- schema -----------------------------------------------------------------------------------

TEST_F(SqliteStoreTest, CreatesVersionedSchemaAndReopens) {
    {
        SqliteStore store{file()};
        EXPECT_EQ(store.query_int("SELECT count(*) FROM sqlite_master WHERE name IN "
                                  "('idem_schema', 'idem_claims', 'idem_dead_letters', "
                                  "'idem_claims_claimed_at')"),
                  4);
        EXPECT_EQ(store.query_int("SELECT version FROM idem_schema"), SqliteStore::schema_version);
        EXPECT_EQ(store.query_int("PRAGMA user_version"), 0);  // the application's, untouched
        claim_and_commit(store, "s", "m-1");
    }
    SqliteStore reopened{file()};
    EXPECT_EQ(reopened.query_int("SELECT count(*) FROM idem_schema"), 1);
    auto found = reopened.find_claim("s", "m-1");
    ASSERT_TRUE(found.has_value());
    EXPECT_EQ(found->disposition, Disposition::processed);
    EXPECT_EQ(reopened.begin().claim("s", "m-1").status, ClaimStatus::duplicate);
}

TEST_F(SqliteStoreTest, WalIsOnByDefaultAndOptionsApply) {
    SqliteStore store{file()};
    EXPECT_EQ(store.query_text("PRAGMA journal_mode"), "wal");

    SqliteOptions options;
    options.wal = false;
    options.synchronous = idem::Synchronous::normal;
    options.busy_timeout = 1234ms;
    SqliteStore plain{file("plain.db"), options};
    EXPECT_EQ(plain.query_text("PRAGMA journal_mode"), "delete");
    EXPECT_EQ(plain.query_int("PRAGMA synchronous"), 1);  // NORMAL
    EXPECT_EQ(plain.query_int("PRAGMA busy_timeout"), 1234);
}

TEST_F(SqliteStoreTest, NewerSchemaVersionIsRefusedWithAClearMessage) {
    { SqliteStore store{file()}; }
    {
        RawDb raw{file()};
        raw.exec("UPDATE idem_schema SET version = 99");
    }
    try {
        SqliteStore store{file()};
        FAIL() << "a database from a newer idem was accepted";
    } catch (const idem::store_error& e) {
        const std::string message = e.what();
        EXPECT_NE(message.find("schema version 99"), std::string::npos) << message;
        EXPECT_NE(message.find("newer"), std::string::npos) << message;
        EXPECT_NE(message.find("Upgrade idem"), std::string::npos) << message;
    }
    RawDb raw{file()};
    EXPECT_EQ(raw.count("SELECT version FROM idem_schema"), 99);  // left as it was
}

TEST_F(SqliteStoreTest, ProcessesOpeningAFreshFileAtOnceCreateTheSchemaOnce) {
    std::atomic<bool> go{false};
    std::atomic<int> opened{0};
    std::vector<std::thread> threads;
    for (int i = 0; i < 4; ++i) {
        threads.emplace_back([&] {
            while (!go.load())
                std::this_thread::yield();
            try {
                SqliteStore store{file()};
                ++opened;
            } catch (const std::exception& e) {
                ADD_FAILURE() << e.what();
            }
        });
    }
    go = true;
    for (auto& t : threads)
        t.join();
    EXPECT_EQ(opened.load(), 4);
    RawDb raw{file()};
    EXPECT_EQ(raw.count("SELECT count(*) FROM idem_schema"), 1);
}

// --- claims and transactions ------------------------------------------------------------------

TEST_F(SqliteStoreTest, ClaimThenDuplicateReportsTheRecordedOutcome) {
    SqliteStore store{file(), manual_clock()};
    claim_and_commit(store, "capture", "m-1", Disposition::processed);
    claim_and_commit(store, "capture", "m-2", Disposition::rejected, "payment is refunded");

    auto tx = store.begin();
    auto first = tx.claim("capture", "m-1");
    EXPECT_EQ(first.status, ClaimStatus::duplicate);
    EXPECT_EQ(first.recorded, Disposition::processed);
    auto second = tx.claim("capture", "m-2");
    EXPECT_EQ(second.status, ClaimStatus::duplicate);
    EXPECT_EQ(second.recorded, Disposition::rejected);
    // The claim is per scope: another handler may claim the same message id.
    EXPECT_EQ(tx.claim("refund", "m-1").status, ClaimStatus::claimed);
    // Claimed again inside the same transaction: a duplicate of a run not finished yet.
    auto again = tx.claim("refund", "m-1");
    EXPECT_EQ(again.status, ClaimStatus::duplicate);
    EXPECT_EQ(again.recorded, Disposition::in_progress);
    tx.rollback();

    auto record = store.find_claim("capture", "m-2");
    ASSERT_TRUE(record.has_value());
    EXPECT_EQ(record->disposition, Disposition::rejected);
    EXPECT_EQ(record->reason, "payment is refunded");
    EXPECT_EQ(record->claimed_at, t0);
    EXPECT_FALSE(store.find_claim("refund", "m-1").has_value());
}

TEST_F(SqliteStoreTest, RollbackRemovesTheClaimAndTheUsersRow) {
    SqliteStore store{file()};
    store.execute("CREATE TABLE captures(order_id INTEGER, ref TEXT)");
    {
        auto tx = store.begin();
        ASSERT_EQ(tx.claim("s", "m-1").status, ClaimStatus::claimed);
        EXPECT_EQ(tx.execute("INSERT INTO captures VALUES (?, ?)", 8814, "ch_1"), 1);
        EXPECT_EQ(tx.query_int("SELECT count(*) FROM captures"), 1);  // visible inside
    }                                                                 // destructor rolls back
    EXPECT_FALSE(store.find_claim("s", "m-1").has_value());
    EXPECT_EQ(store.query_int("SELECT count(*) FROM captures"), 0);

    {
        auto tx = store.begin();
        ASSERT_EQ(tx.claim("s", "m-1").status, ClaimStatus::claimed);
        tx.execute("INSERT INTO captures VALUES (?, ?)", 8814, "ch_1");
        tx.rollback();
        EXPECT_FALSE(tx.active());
        tx.rollback();  // a second rollback is harmless
    }
    EXPECT_FALSE(store.find_claim("s", "m-1").has_value());
    EXPECT_EQ(store.query_int("SELECT count(*) FROM captures"), 0);
}

TEST_F(SqliteStoreTest, SavepointRollbackUndoesTheEffectButKeepsTheClaim) {
    SqliteStore store{file()};
    store.execute("CREATE TABLE captures(order_id INTEGER)");
    auto tx = store.begin();
    ASSERT_EQ(tx.claim("s", "m-1").status, ClaimStatus::claimed);
    tx.savepoint();
    tx.execute("INSERT INTO captures VALUES (?)", 1);
    tx.rollback_to_savepoint();
    tx.savepoint();  // the savepoint was released: a new one starts cleanly
    tx.execute("INSERT INTO captures VALUES (?)", 2);
    tx.release_savepoint();
    tx.record_outcome("s", "m-1", Disposition::rejected, "stale");
    tx.commit();

    auto record = store.find_claim("s", "m-1");
    ASSERT_TRUE(record.has_value());
    EXPECT_EQ(record->disposition, Disposition::rejected);
    EXPECT_EQ(store.query_int("SELECT count(*) FROM captures WHERE order_id = 1"), 0);
    EXPECT_EQ(store.query_int("SELECT count(*) FROM captures WHERE order_id = 2"), 1);
}

TEST_F(SqliteStoreTest, MisuseOfAFinishedTransactionIsAUsageError) {
    SqliteStore store{file()};
    auto tx = store.begin();
    ASSERT_EQ(tx.claim("s", "m-1").status, ClaimStatus::claimed);
    tx.commit();
    EXPECT_THROW(tx.commit(), idem::usage_error);
    EXPECT_THROW(tx.claim("s", "m-2"), idem::usage_error);
    EXPECT_THROW(tx.rollback(), idem::usage_error);
    EXPECT_THROW(tx.execute("SELECT 1"), idem::usage_error);

    auto other = store.begin();
    EXPECT_THROW(other.rollback_to_savepoint(), idem::usage_error);
    EXPECT_THROW(other.release_savepoint(), idem::usage_error);
    auto moved = std::move(other);
    EXPECT_THROW(other.claim("s", "m-3"), idem::usage_error);  // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(moved.claim("s", "m-3").status, ClaimStatus::claimed);
    moved.commit();
    EXPECT_TRUE(store.find_claim("s", "m-3").has_value());
}

TEST_F(SqliteStoreTest, SameThreadReentryIsAUsageErrorNotADeadlock) {
    SqliteStore store{file()};
    auto tx = store.begin();
    EXPECT_THROW((void)store.begin(), idem::usage_error);
    EXPECT_THROW((void)store.find_claim("s", "m"), idem::usage_error);
    EXPECT_THROW((void)store.purge(1h), idem::usage_error);
    tx.commit();
    EXPECT_NO_THROW((void)store.find_claim("s", "m"));
}

TEST_F(SqliteStoreTest, EndingTheTransactionFromTheEffectIsReported) {
    SqliteStore store{file()};
    auto tx = store.begin();
    ASSERT_EQ(tx.claim("s", "m-1").status, ClaimStatus::claimed);
    tx.execute("ROLLBACK");
    EXPECT_THROW(tx.record_outcome("s", "m-1", Disposition::processed, {}), idem::usage_error);
    EXPECT_FALSE(tx.active());
    EXPECT_FALSE(store.find_claim("s", "m-1").has_value());
    claim_and_commit(store, "s", "m-1");  // the store is usable again
}

TEST_F(SqliteStoreTest, RefusedCommitIsCommitFailedAndLeavesNothing) {
    SqliteStore store{file()};
    store.execute("PRAGMA foreign_keys=ON");
    store.execute("CREATE TABLE parents(id INTEGER PRIMARY KEY)");
    store.execute(
        "CREATE TABLE children(parent_id INTEGER REFERENCES parents(id) DEFERRABLE INITIALLY "
        "DEFERRED)");
    {
        auto tx = store.begin();
        ASSERT_EQ(tx.claim("s", "m-1").status, ClaimStatus::claimed);
        tx.execute("INSERT INTO children(parent_id) VALUES (?)", 424242);  // checked at COMMIT
        tx.record_outcome("s", "m-1", Disposition::processed, {});
        try {
            tx.commit();
            FAIL() << "commit succeeded despite a deferred foreign-key violation";
        } catch (const idem::commit_failed& e) {
            EXPECT_NE(std::string(e.what()).find("FOREIGN KEY constraint failed"),
                      std::string::npos)
                << e.what();
        }
        EXPECT_FALSE(tx.active());
        EXPECT_THROW(tx.commit(), idem::usage_error);
    }
    EXPECT_FALSE(store.find_claim("s", "m-1").has_value());
    EXPECT_EQ(store.query_int("SELECT count(*) FROM children"), 0);
    EXPECT_EQ(sqlite3_get_autocommit(store.db()), 1);
    claim_and_commit(store, "s", "m-1");  // the redelivery claims it anew
}

TEST_F(SqliteStoreTest, SqlitesAutomaticRollbackIsNeverMistakenForAnOpenTransaction) {
    // SQLITE_FULL rolls the whole transaction back. An effect that swallows the error must not
    // lead idem to write the outcome (or commit) in autocommit mode.
    SqliteStore store{file()};
    store.execute("CREATE TABLE big(b BLOB)");
    const auto pages = store.query_int("PRAGMA page_count");
    ASSERT_TRUE(pages.has_value());
    store.execute("PRAGMA max_page_count = " + std::to_string(*pages + 3));
    {
        auto tx = store.begin();
        ASSERT_EQ(tx.claim("s", "m-1").status, ClaimStatus::claimed);
        EXPECT_THROW(tx.execute("INSERT INTO big VALUES (zeroblob(?))", 1'000'000),
                     idem::store_error);
        try {
            tx.commit();
            FAIL() << "commit succeeded after SQLite rolled the transaction back";
        } catch (const idem::commit_failed& e) {
            EXPECT_NE(std::string(e.what()).find("disk is full"), std::string::npos) << e.what();
        }
    }
    {
        auto tx = store.begin();
        ASSERT_EQ(tx.claim("s", "m-2").status, ClaimStatus::claimed);
        EXPECT_THROW(tx.execute("INSERT INTO big VALUES (zeroblob(?))", 1'000'000),
                     idem::store_error);
        EXPECT_THROW(tx.record_outcome("s", "m-2", Disposition::processed, {}),
                     idem::store_unavailable);
    }
    EXPECT_FALSE(store.find_claim("s", "m-1").has_value());
    EXPECT_FALSE(store.find_claim("s", "m-2").has_value());
    store.execute("PRAGMA max_page_count = 1000000");
    claim_and_commit(store, "s", "m-1");
}

// --- values -----------------------------------------------------------------------------------

TEST_F(SqliteStoreTest, HostileValuesRoundTripExactly) {
    SqliteStore store{file(), manual_clock()};
    std::string big(10 * 1024, '\0');
    for (std::size_t i = 0; i < big.size(); ++i)
        big[i] = static_cast<char>(i * 31 + 7);
    const std::vector<std::string> ids = {
        "'); DROP TABLE idem_claims;--",
        std::string("before\0after", 12),
        std::string("before", 6),  // a prefix of the previous id: must stay distinct
        std::string(1, '\0'),
        big,
        "\xff\xfe\xc3\x28 not utf-8 \x80",
        "\"double\" `back` [bracket] ?1 :name @x $y %",
        "",
    };
    const std::string scope("scope'\0--", 9);
    const std::string reason("reason with \0 and \xff", 20);

    for (const auto& id : ids)
        claim_and_commit(store, scope, id, Disposition::rejected, reason);
    for (const auto& id : ids) {
        auto record = store.find_claim(scope, id);
        ASSERT_TRUE(record.has_value()) << id.size();
        EXPECT_EQ(record->scope, scope);
        EXPECT_EQ(record->message_id, id);
        EXPECT_EQ(record->reason, reason);
        auto tx = store.begin();
        EXPECT_EQ(tx.claim(scope, id).status, ClaimStatus::duplicate);
    }
    EXPECT_EQ(store.query_int("SELECT count(*) FROM idem_claims"),
              static_cast<std::int64_t>(ids.size()));

    {
        auto tx = store.begin();
        for (const auto& id : ids) {
            idem::DeadLetter letter;
            letter.scope = scope;
            letter.message_id = id;
            letter.delivery_count = 5;
            letter.reason = reason;
            letter.payload = big + id;
            tx.dead_letter(letter);
        }
        tx.commit();
    }
    const auto letters = store.dead_letters();
    ASSERT_EQ(letters.size(), ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
        EXPECT_EQ(letters[i].scope, scope);
        EXPECT_EQ(letters[i].message_id, ids[i]);
        EXPECT_EQ(letters[i].delivery_count, 5u);
        EXPECT_EQ(letters[i].reason, reason);
        EXPECT_EQ(letters[i].payload, big + ids[i]);
        EXPECT_EQ(letters[i].created_at, t0);
    }
}

TEST_F(SqliteStoreTest, ExecuteBindsEveryKindOfValue) {
    SqliteStore store{file()};
    store.execute("CREATE TABLE t(i INTEGER, r REAL, s TEXT, b BLOB, n)");
    const std::string text("a\0b", 3);
    const std::optional<long> some = 7;
    const std::optional<long> none;
    auto tx = store.begin();
    EXPECT_EQ(tx.execute("INSERT INTO t VALUES (?, ?, ?, ?, ?)", 42, 2.5, text, idem::Blob{text},
                         nullptr),
              1);
    tx.execute("INSERT INTO t VALUES (?, ?, ?, ?, ?)", some, 0.0f, std::string_view("sv"),
               idem::Blob{""}, std::nullopt);
    tx.execute("INSERT INTO t VALUES (?, ?, ?, ?, ?)", none, -1LL, "literal",
               static_cast<const char*>(nullptr), true);
    EXPECT_EQ(tx.query_int("SELECT count(*) FROM t WHERE n IS NULL"), 2);
    EXPECT_EQ(tx.query_text("SELECT s FROM t WHERE i = ?", 42), text);
    EXPECT_EQ(tx.query_text("SELECT typeof(s) || typeof(b) FROM t WHERE i = ?", 42), "textblob");
    EXPECT_EQ(tx.query_text("SELECT b FROM t WHERE b = ?", idem::Blob{text}), text);
    EXPECT_EQ(tx.query_text("SELECT typeof(b) FROM t WHERE i = 7"), "blob");  // empty, not NULL
    EXPECT_EQ(tx.query_int("SELECT i FROM t WHERE s = 'literal'"), std::nullopt);  // NULL
    EXPECT_EQ(tx.query_int("SELECT n FROM t WHERE s = 'literal'"), 1);
    EXPECT_EQ(tx.query_int("SELECT i FROM t WHERE s = ?", "no such row"), std::nullopt);
    EXPECT_EQ(tx.execute("UPDATE t SET n = ? WHERE i IS NOT NULL", 3.5), 2);
    tx.commit();
}

TEST_F(SqliteStoreTest, ExecuteReportsBadSqlClearly) {
    SqliteStore store{file()};
    auto tx = store.begin();
    try {
        tx.execute("INSERT INTO no_such_table VALUES (?)", 1);
        FAIL() << "no error";
    } catch (const idem::store_error& e) {
        const std::string message = e.what();
        EXPECT_NE(message.find("no such table: no_such_table"), std::string::npos) << message;
        EXPECT_NE(message.find("SQL: INSERT INTO no_such_table"), std::string::npos) << message;
    }
    EXPECT_THROW(tx.execute("SELECT ?, ?", 1), idem::usage_error);      // parameter count
    EXPECT_THROW(tx.execute("SELECT 1; SELECT 2"), idem::usage_error);  // one statement only
    EXPECT_NO_THROW(tx.execute("SELECT 1; -- a trailing comment"));
    EXPECT_THROW(tx.execute("   "), idem::usage_error);
    // A failed statement does not end the transaction.
    EXPECT_EQ(tx.claim("s", "m-1").status, ClaimStatus::claimed);
    tx.commit();
    EXPECT_TRUE(store.find_claim("s", "m-1").has_value());
}

// --- concurrency and maintenance --------------------------------------------------------------

TEST_F(SqliteStoreTest, BusyDatabaseGivesStoreTimeout) {
    SqliteOptions options;
    options.busy_timeout = 100ms;
    SqliteStore store{file(), options};
    RawDb other{file()};
    other.exec("BEGIN IMMEDIATE");

    const auto started = std::chrono::steady_clock::now();
    try {
        (void)store.begin();
        FAIL() << "begin() succeeded while another connection held the write lock";
    } catch (const idem::store_timeout& e) {
        EXPECT_NE(std::string(e.what()).find("busy_timeout"), std::string::npos) << e.what();
    }
    const auto waited = std::chrono::steady_clock::now() - started;
    EXPECT_GE(waited, 90ms);
    EXPECT_LT(waited, 5s);

    other.exec("ROLLBACK");
    claim_and_commit(store, "s", "m-1");  // nothing left locked on our side
}

TEST_F(SqliteStoreTest, PurgeDeletesOnlyClaimsOlderThanTheRetention) {
    SqliteStore store{file(), manual_clock()};
    claim_and_commit(store, "s", "old");
    {
        auto tx = store.begin();
        idem::DeadLetter letter;
        letter.scope = "s";
        letter.message_id = "poison";
        letter.reason = "poison";
        tx.dead_letter(letter);
        tx.commit();
    }
    now_ = t0 + 24h * 10;
    claim_and_commit(store, "s", "recent");

    now_ = t0 + 24h * 15;
    EXPECT_EQ(store.purge(24h * 14), 1u);
    EXPECT_FALSE(store.find_claim("s", "old").has_value());
    ASSERT_TRUE(store.find_claim("s", "recent").has_value());
    EXPECT_EQ(store.find_claim("s", "recent")->claimed_at, t0 + 24h * 10);
    ASSERT_EQ(store.dead_letters().size(), 1u);
    EXPECT_EQ(store.dead_letters()[0].created_at, t0);
    EXPECT_EQ(store.purge(24h * 14), 0u);
    EXPECT_THROW((void)store.purge(-1h), idem::usage_error);
}

TEST_F(SqliteStoreTest, PurgeWorksInBatches) {
    SqliteStore store{file(), manual_clock()};
    {
        auto tx = store.begin();
        for (int i = 0; i < 12'000; ++i)
            tx.claim("s", std::to_string(i));
        tx.commit();
    }
    now_ = t0 + 24h;
    EXPECT_EQ(store.purge(1h), 12'000u);
    EXPECT_EQ(store.query_int("SELECT count(*) FROM idem_claims"), 0);
}

TEST_F(SqliteStoreTest, BorrowedConnectionIsUsedAndNotClosed) {
    RawDb user{file()};
    user.exec("CREATE TABLE orders(id INTEGER)");
    {
        SqliteStore store{user.get()};
        EXPECT_EQ(store.db(), user.get());
        auto tx = store.begin();
        ASSERT_EQ(tx.claim("s", "m-1").status, ClaimStatus::claimed);
        tx.execute("INSERT INTO orders VALUES (?)", 1);
        tx.record_outcome("s", "m-1", Disposition::processed, {});
        tx.commit();

        user.exec("BEGIN");
        try {
            (void)store.begin();
            FAIL() << "begin() inside the user's transaction was accepted";
        } catch (const idem::usage_error& e) {
            EXPECT_NE(std::string(e.what()).find("already inside a transaction"), std::string::npos)
                << e.what();
        }
        user.exec("ROLLBACK");
        claim_and_commit(store, "s", "m-2");
    }
    // Still open and usable; ~RawDb checks that sqlite3_close succeeds (no statement leaked).
    EXPECT_EQ(user.count("SELECT count(*) FROM idem_claims"), 2);
    EXPECT_EQ(user.count("SELECT count(*) FROM orders"), 1);

    user.exec("BEGIN");
    EXPECT_THROW(SqliteStore{user.get()}, idem::usage_error);
    user.exec("ROLLBACK");
    EXPECT_THROW(SqliteStore{static_cast<sqlite3*>(nullptr)}, idem::usage_error);
}

TEST_F(SqliteStoreTest, TwoStoresOnOneFileClaimEachIdOnce) {
    constexpr int ids = 200;
    SqliteStore first{file()};
    SqliteStore second{file()};
    std::vector<std::atomic<int>> claims(ids);
    auto worker = [&](SqliteStore& store) {
        for (int i = 0; i < ids; ++i) {
            const std::string id = "m-" + std::to_string(i);
            try {
                auto tx = store.begin();
                if (tx.claim("s", id).status == ClaimStatus::claimed) {
                    tx.record_outcome("s", id, Disposition::processed, {});
                    tx.commit();
                    ++claims[static_cast<std::size_t>(i)];
                }
            } catch (const std::exception& e) {
                ADD_FAILURE() << e.what();
            }
        }
    };
    std::thread a(worker, std::ref(first));
    std::thread b(worker, std::ref(second));
    a.join();
    b.join();
    for (int i = 0; i < ids; ++i)
        EXPECT_EQ(claims[static_cast<std::size_t>(i)].load(), 1) << i;
    EXPECT_EQ(first.query_int("SELECT count(*) FROM idem_claims"), ids);
}

TEST_F(SqliteStoreTest, OneStoreSharedByThreadsSerializes) {
    constexpr int ids = 100;
    SqliteStore store{file()};
    std::vector<std::atomic<int>> claims(ids);
    std::vector<std::thread> threads;
    for (int t = 0; t < 3; ++t) {
        threads.emplace_back([&] {
            for (int i = 0; i < ids; ++i) {
                const std::string id = std::to_string(i);
                auto tx = store.begin();
                if (tx.claim("s", id).status == ClaimStatus::claimed) {
                    tx.execute("SELECT ?", idem::Blob{id});
                    tx.record_outcome("s", id, Disposition::processed, {});
                    tx.commit();
                    ++claims[static_cast<std::size_t>(i)];
                }
            }
        });
    }
    for (auto& t : threads)
        t.join();
    for (int i = 0; i < ids; ++i)
        EXPECT_EQ(claims[static_cast<std::size_t>(i)].load(), 1) << i;
}

}  // namespace
