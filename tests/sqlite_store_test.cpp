// Store-level tests of idem::SqliteStore on real database files, one fresh temp dir per test.

#include "idem/store/sqlite.hpp"

#include <gtest/gtest.h>
#include <sqlite3.h>
#include <stdlib.h>  // mkdtemp

#include <algorithm>
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
using idem::OutboxIntent;
using idem::OutboxRow;
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
        EXPECT_EQ(
            store.query_int("SELECT count(*) FROM sqlite_master WHERE name IN "
                            "('idem_schema', 'idem_claims', 'idem_dead_letters', "
                            "'idem_claims_claimed_at', 'idem_locks', 'idem_outbox', "
                            "'idem_outbox_due', 'idem_outbox_sent', 'idem_locks_expires_at')"),
            9);
        EXPECT_EQ(store.query_int("SELECT count(*) FROM pragma_table_info('idem_claims') "
                                  "WHERE name = 'fingerprint'"),
                  1);
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

// --- fingerprints -----------------------------------------------------------------------------

TEST_F(SqliteStoreTest, FingerprintIsStoredWithTheClaimAndReturnedWithADuplicate) {
    SqliteStore store{file()};
    const std::string binary("\0\xff\x80'fp\0", 7);
    {
        auto tx = store.begin();
        ASSERT_EQ(tx.claim("s", "m-1", "3f2a").status, ClaimStatus::claimed);
        ASSERT_EQ(tx.claim("s", "m-2", binary).status, ClaimStatus::claimed);
        ASSERT_EQ(tx.claim("s", "m-3").status, ClaimStatus::claimed);  // no fingerprint
        // Claimed earlier in this same transaction: the duplicate already carries it.
        EXPECT_EQ(tx.claim("s", "m-1", "other").fingerprint, "3f2a");
        for (const char* id : {"m-1", "m-2", "m-3"})
            tx.record_outcome("s", id, Disposition::processed, {});
        tx.commit();
    }
    auto tx = store.begin();
    const auto first = tx.claim("s", "m-1", "different");
    EXPECT_EQ(first.status, ClaimStatus::duplicate);
    EXPECT_EQ(first.fingerprint, "3f2a");
    const auto second = tx.claim("s", "m-2");
    EXPECT_EQ(second.status, ClaimStatus::duplicate);
    EXPECT_EQ(second.fingerprint, binary);
    const auto third = tx.claim("s", "m-3", "late");
    EXPECT_EQ(third.status, ClaimStatus::duplicate);
    EXPECT_EQ(third.fingerprint, "");
    // A fingerprint of a rolled-back claim is gone with it.
    EXPECT_EQ(tx.claim("s", "m-4", "gone").status, ClaimStatus::claimed);
    tx.rollback();

    ASSERT_TRUE(store.find_claim("s", "m-1").has_value());
    EXPECT_EQ(store.find_claim("s", "m-1")->fingerprint, "3f2a");
    EXPECT_EQ(store.find_claim("s", "m-2")->fingerprint, binary);
    EXPECT_EQ(store.find_claim("s", "m-3")->fingerprint, "");
    EXPECT_FALSE(store.find_claim("s", "m-4").has_value());
    EXPECT_EQ(store.query_text("SELECT typeof(fingerprint) FROM idem_claims WHERE message_id = ?",
                               idem::Blob{"m-3"}),
              "blob");
    EXPECT_EQ(store.query_text("SELECT fingerprint FROM idem_claims WHERE message_id = ?",
                               idem::Blob{"m-2"}),
              binary);
}

// --- overlap locks ----------------------------------------------------------------------------

TEST_F(SqliteStoreTest, TryLockIsRefusedWhileAnotherOwnerHoldsAnUnexpiredLock) {
    SqliteStore store{file(), manual_clock()};
    {
        auto tx = store.begin();
        EXPECT_TRUE(tx.try_lock("invoice:42", 3min));  // nothing held
        EXPECT_TRUE(tx.try_lock("invoice:42", 3min));  // the transaction is the lock: re-entrant
        tx.commit();
    }
    EXPECT_EQ(store.query_int("SELECT count(*) FROM idem_locks"), 0);  // leaves no row behind

    ASSERT_TRUE(store.hold_lock("invoice:42", "nightly-batch", 1min));
    {
        auto tx = store.begin();
        EXPECT_FALSE(tx.try_lock("invoice:42", 3min));
        EXPECT_TRUE(tx.try_lock("invoice:43", 3min));  // another entity is free
    }
    {
        // Another connection on the file (another process) sees the same lock.
        SqliteStore other{file(), manual_clock()};
        auto tx = other.begin();
        EXPECT_FALSE(tx.try_lock("invoice:42", 3min));
    }
    now_ += 59s;
    EXPECT_FALSE(store.begin().try_lock("invoice:42", 3min));
    now_ += 1s;  // expires_at reached: the holder is presumed dead
    EXPECT_TRUE(store.begin().try_lock("invoice:42", 3min));

    ASSERT_TRUE(store.hold_lock("invoice:42", "nightly-batch", 1h));
    EXPECT_FALSE(store.begin().try_lock("invoice:42", 3min));
    EXPECT_FALSE(store.release_lock("invoice:42", "someone-else"));
    EXPECT_FALSE(store.begin().try_lock("invoice:42", 3min));
    EXPECT_TRUE(store.release_lock("invoice:42", "nightly-batch"));
    EXPECT_TRUE(store.begin().try_lock("invoice:42", 3min));
    {
        // hold_lock / release_lock run their own transaction: not inside this thread's one.
        auto tx = store.begin();
        EXPECT_THROW((void)store.hold_lock("x", "o", 1s), idem::usage_error);
        EXPECT_THROW((void)store.release_lock("x", "o"), idem::usage_error);
    }
}

TEST_F(SqliteStoreTest, HoldLockByTwoOwners) {
    SqliteStore store{file(), manual_clock()};
    SqliteStore other{file(), manual_clock()};
    EXPECT_TRUE(store.hold_lock("job", "a", 1min));
    EXPECT_FALSE(other.hold_lock("job", "b", 1min));
    EXPECT_FALSE(store.hold_lock("job", "b", 1min));
    EXPECT_EQ(store.query_text("SELECT owner FROM idem_locks"), "a");

    now_ += 50s;
    EXPECT_TRUE(store.hold_lock("job", "a", 1min));  // renewed by its owner
    EXPECT_EQ(
        store.query_int("SELECT expires_at FROM idem_locks"),
        std::chrono::duration_cast<std::chrono::milliseconds>((now_ + 1min).time_since_epoch())
            .count());
    now_ += 50s;
    EXPECT_FALSE(other.hold_lock("job", "b", 1min));  // the renewal still runs
    now_ += 10s;
    EXPECT_TRUE(other.hold_lock("job", "b", 1min));  // expired: a new owner takes it over
    EXPECT_FALSE(store.hold_lock("job", "a", 1min));
    EXPECT_FALSE(store.release_lock("job", "a"));  // no longer a's
    EXPECT_EQ(store.query_text("SELECT owner FROM idem_locks"), "b");
    EXPECT_TRUE(other.release_lock("job", "b"));
    EXPECT_FALSE(other.release_lock("job", "b"));
    EXPECT_EQ(store.query_int("SELECT count(*) FROM idem_locks"), 0);
    EXPECT_TRUE(store.hold_lock("job", "a", 1min));  // free again
}

// --- outbox -----------------------------------------------------------------------------------

OutboxIntent intent(const std::string& key, const std::string& payload = "{}",
                    const std::string& destination = "rail") {
    return OutboxIntent{destination, key, payload};
}

/// Adds intents with these keys in one committed transaction.
void add_committed(SqliteStore& store, const std::vector<std::string>& keys) {
    auto tx = store.begin();
    for (const auto& key : keys)
        ASSERT_TRUE(tx.add_outbox(intent(key, "payload-" + key)));
    tx.commit();
}

std::vector<std::int64_t> ids_of(const std::vector<OutboxRow>& rows) {
    std::vector<std::int64_t> ids;
    for (const auto& row : rows)
        ids.push_back(row.id);
    return ids;
}

TEST_F(SqliteStoreTest, OutboxAddStoresTheIntentAndDedupesOnTheKey) {
    SqliteStore store{file(), manual_clock()};
    {
        auto tx = store.begin();
        EXPECT_TRUE(tx.add_outbox(intent("k-1", "{\"amount\":5}", "payments")));
        EXPECT_FALSE(tx.add_outbox(intent("k-1", "another payload")));  // same transaction
        EXPECT_TRUE(tx.add_outbox(intent("k-2")));
        tx.commit();
    }
    EXPECT_FALSE(store.begin().add_outbox(intent("k-2")));  // a later one

    const auto rows = store.outbox_rows();
    ASSERT_EQ(rows.size(), 2u);
    EXPECT_LT(rows[0].id, rows[1].id);
    EXPECT_EQ(rows[0].destination, "payments");
    EXPECT_EQ(rows[0].idempotency_key, "k-1");
    EXPECT_EQ(rows[0].payload, "{\"amount\":5}");  // the first one is kept
    EXPECT_EQ(rows[0].created_at, t0);
    EXPECT_EQ(rows[0].next_attempt_at, t0);
    EXPECT_FALSE(rows[0].sent_at.has_value());
    EXPECT_EQ(rows[0].attempts, 0u);
    EXPECT_EQ(rows[0].last_error, "");
    EXPECT_FALSE(rows[0].parked);
    EXPECT_EQ(rows[1].idempotency_key, "k-2");
}

TEST_F(SqliteStoreTest, OutboxAddIsRolledBackWithTheTransaction) {
    SqliteStore store{file()};
    store.execute("CREATE TABLE ledger(id INTEGER)");
    {
        auto tx = store.begin();
        ASSERT_EQ(tx.claim("s", "m-1").status, ClaimStatus::claimed);
        tx.execute("INSERT INTO ledger VALUES (?)", 1);
        EXPECT_TRUE(tx.add_outbox(intent("k-1")));
    }  // dropped: rolled back
    EXPECT_TRUE(store.outbox_rows().empty());
    EXPECT_EQ(store.query_int("SELECT count(*) FROM ledger"), 0);
    {
        auto tx = store.begin();
        tx.savepoint();
        EXPECT_TRUE(tx.add_outbox(intent("k-1")));
        tx.rollback_to_savepoint();
        EXPECT_TRUE(tx.add_outbox(intent("k-2")));
        tx.commit();
    }
    const auto rows = store.outbox_rows();
    ASSERT_EQ(rows.size(), 1u);
    EXPECT_EQ(rows[0].idempotency_key, "k-2");
    // The rolled-back key was never stored: it can be added now.
    {
        auto tx = store.begin();
        EXPECT_TRUE(tx.add_outbox(intent("k-1")));
        tx.commit();
    }
    EXPECT_EQ(store.outbox_rows().size(), 2u);
}

TEST_F(SqliteStoreTest, LeaseHandsOutDueRowsInIdOrderUpToTheLimit) {
    SqliteStore store{file(), manual_clock()};
    SqliteStore other{file(), manual_clock()};  // a second relay on the same file
    add_committed(store, {"a", "b", "c", "d", "e"});
    const auto all = ids_of(store.outbox_rows());
    ASSERT_EQ(all.size(), 5u);

    EXPECT_TRUE(store.lease_outbox(0, 30s).empty());
    const auto first = store.lease_outbox(3, 30s);
    EXPECT_EQ(ids_of(first), (std::vector<std::int64_t>{all[0], all[1], all[2]}));
    EXPECT_EQ(first[0].idempotency_key, "a");
    EXPECT_EQ(first[0].payload, "payload-a");
    EXPECT_EQ(first[2].idempotency_key, "c");
    EXPECT_EQ(store.query_int("SELECT lease_until FROM idem_outbox WHERE id = ?", all[0]),
              std::chrono::duration_cast<std::chrono::milliseconds>((t0 + 30s).time_since_epoch())
                  .count());

    // Leased rows are not handed out again while the lease lives, by any store on the file.
    EXPECT_EQ(ids_of(other.lease_outbox(10, 30s)), (std::vector<std::int64_t>{all[3], all[4]}));
    EXPECT_TRUE(store.lease_outbox(10, 30s).empty());
    now_ += 29s;
    EXPECT_TRUE(other.lease_outbox(10, 30s).empty());
    now_ += 1s;  // the first lease passed (the relay died): the rows come back, in order
    EXPECT_EQ(ids_of(other.lease_outbox(2, 30s)), (std::vector<std::int64_t>{all[0], all[1]}));
    EXPECT_EQ(ids_of(store.lease_outbox(static_cast<std::size_t>(-1), 30s)),
              (std::vector<std::int64_t>{all[2], all[3], all[4]}));
    // A row added later is due at once.
    add_committed(store, {"f"});
    const auto late = store.lease_outbox(10, 30s);
    ASSERT_EQ(late.size(), 1u);
    EXPECT_EQ(late[0].idempotency_key, "f");
    EXPECT_EQ(late[0].created_at, now_);
}

TEST_F(SqliteStoreTest, MarkSentFailedAndParked) {
    SqliteStore store{file(), manual_clock()};
    add_committed(store, {"sent", "retried", "parked"});
    const auto leased = store.lease_outbox(10, 30s);
    ASSERT_EQ(leased.size(), 3u);
    const auto sent = leased[0].id;
    const auto retried = leased[1].id;
    const auto parked = leased[2].id;

    now_ += 1s;
    store.mark_outbox_sent(sent);
    store.mark_outbox_failed(retried, "503 from the rail", now_ + 10s, false);
    store.mark_outbox_failed(parked, "400 bad account", now_, true);
    EXPECT_EQ(store.query_int("SELECT count(*) FROM idem_outbox WHERE lease_until IS NOT NULL"), 0);

    auto rows = store.outbox_rows();
    ASSERT_EQ(rows.size(), 3u);
    ASSERT_TRUE(rows[0].sent_at.has_value());
    EXPECT_EQ(*rows[0].sent_at, t0 + 1s);
    EXPECT_EQ(rows[0].attempts, 0u);
    EXPECT_FALSE(rows[1].sent_at.has_value());
    EXPECT_EQ(rows[1].attempts, 1u);
    EXPECT_EQ(rows[1].last_error, "503 from the rail");
    EXPECT_EQ(rows[1].next_attempt_at, t0 + 11s);
    EXPECT_FALSE(rows[1].parked);
    EXPECT_TRUE(rows[2].parked);
    EXPECT_EQ(rows[2].attempts, 1u);
    EXPECT_EQ(rows[2].last_error, "400 bad account");

    // Marking ended the lease, but nothing is due: the retry waits for retry_at, sent and
    // parked rows never come back.
    EXPECT_TRUE(store.lease_outbox(10, 30s).empty());
    now_ += 9s;
    EXPECT_TRUE(store.lease_outbox(10, 30s).empty());
    now_ += 1s;
    auto again = store.lease_outbox(10, 30s);
    ASSERT_EQ(again.size(), 1u);
    EXPECT_EQ(again[0].id, retried);
    EXPECT_EQ(again[0].attempts, 1u);
    EXPECT_EQ(again[0].last_error, "503 from the rail");

    store.mark_outbox_failed(retried, "timeout", now_, false);  // due again at once
    again = store.lease_outbox(10, 30s);
    ASSERT_EQ(again.size(), 1u);
    EXPECT_EQ(again[0].attempts, 2u);
    EXPECT_EQ(again[0].last_error, "timeout");
    store.mark_outbox_sent(retried);
    now_ += 24h;
    EXPECT_TRUE(store.lease_outbox(10, 30s).empty());

    EXPECT_THROW(store.mark_outbox_sent(999), idem::usage_error);
    EXPECT_THROW(store.mark_outbox_failed(999, "e", now_, false), idem::usage_error);
    {
        auto tx = store.begin();  // marks run in their own transaction, never inside one
        EXPECT_THROW(store.mark_outbox_sent(sent), idem::usage_error);
        EXPECT_THROW((void)store.lease_outbox(1, 1s), idem::usage_error);
    }
}

TEST_F(SqliteStoreTest, TwoStoresLeasingConcurrentlyShipEveryRowExactlyOnce) {
    constexpr int rows = 1000;
    SqliteStore first{file()};
    SqliteStore second{file()};
    {
        auto tx = first.begin();
        for (int i = 0; i < rows; ++i)
            ASSERT_TRUE(tx.add_outbox(intent("key-" + std::to_string(i))));
        tx.commit();
    }
    const auto base = first.outbox_rows().front().id;
    std::vector<std::atomic<int>> leased(rows);
    std::vector<std::atomic<int>> sent(rows);
    std::atomic<bool> go{false};
    auto relay = [&](SqliteStore& store, std::size_t batch) {
        while (!go.load())
            std::this_thread::yield();
        try {
            for (;;) {
                const auto got = store.lease_outbox(batch, 1h);
                if (got.empty()) return;
                for (const auto& row : got) {
                    const auto index = static_cast<std::size_t>(row.id - base);
                    ASSERT_LT(index, static_cast<std::size_t>(rows));
                    EXPECT_EQ(row.idempotency_key, "key-" + std::to_string(index));
                    ++leased[index];
                    store.mark_outbox_sent(row.id);
                    ++sent[index];
                }
            }
        } catch (const std::exception& e) {
            ADD_FAILURE() << e.what();
        }
    };
    std::thread a(relay, std::ref(first), std::size_t{7});
    std::thread b(relay, std::ref(second), std::size_t{5});
    go = true;
    a.join();
    b.join();
    for (std::size_t i = 0; i < static_cast<std::size_t>(rows); ++i) {
        EXPECT_EQ(leased[i].load(), 1) << i;
        EXPECT_EQ(sent[i].load(), 1) << i;
    }
    const auto stored = second.outbox_rows();
    ASSERT_EQ(stored.size(), static_cast<std::size_t>(rows));
    EXPECT_TRUE(std::all_of(stored.begin(), stored.end(),
                            [](const OutboxRow& row) { return row.sent_at.has_value(); }));
    EXPECT_TRUE(first.lease_outbox(10, 1h).empty());
}

TEST_F(SqliteStoreTest, HostileBytesInOutboxAndLocksRoundTrip) {
    SqliteStore store{file(), manual_clock()};
    std::string big(64 * 1024, '\0');
    for (std::size_t i = 0; i < big.size(); ++i)
        big[i] = static_cast<char>(i * 131 + 3);
    const std::vector<std::string> keys = {
        "'); DROP TABLE idem_outbox;--",
        std::string("key\0tail", 8),
        std::string("key", 3),  // a prefix of the previous key: a different key
        std::string(1, '\0'),
        "\xff\xfe\xc3\x28 not utf-8 \x80",
        "?1 :name @x $y %",
        "",
    };
    const std::string destination("dest\0'\xff", 7);
    {
        auto tx = store.begin();
        for (const auto& key : keys)
            ASSERT_TRUE(tx.add_outbox(OutboxIntent{destination, key, big + key})) << key.size();
        for (const auto& key : keys)
            EXPECT_FALSE(tx.add_outbox(OutboxIntent{destination, key, ""})) << key.size();
        tx.commit();
    }
    const std::string error("error \0 with \xff bytes", 21);
    const auto leased = store.lease_outbox(keys.size(), 1min);
    ASSERT_EQ(leased.size(), keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
        EXPECT_EQ(leased[i].destination, destination);
        EXPECT_EQ(leased[i].idempotency_key, keys[i]);
        EXPECT_EQ(leased[i].payload, big + keys[i]);
        store.mark_outbox_failed(leased[i].id, error, now_, false);
    }
    const auto rows = store.outbox_rows();
    ASSERT_EQ(rows.size(), keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
        EXPECT_EQ(rows[i].idempotency_key, keys[i]);
        EXPECT_EQ(rows[i].payload, big + keys[i]);
        EXPECT_EQ(rows[i].last_error, error);
    }
    EXPECT_EQ(store.query_int("SELECT count(*) FROM idem_outbox WHERE typeof(payload) = 'blob' "
                              "AND typeof(idempotency_key) = 'blob'"),
              static_cast<std::int64_t>(keys.size()));

    const std::string owner("owner\0'x", 8);
    for (const auto& key : keys)
        ASSERT_TRUE(store.hold_lock(key, owner, 1min)) << key.size();
    EXPECT_EQ(store.query_int("SELECT count(*) FROM idem_locks"),
              static_cast<std::int64_t>(keys.size()));
    {
        auto tx = store.begin();
        for (const auto& key : keys)
            EXPECT_FALSE(tx.try_lock(key, 1min)) << key.size();
        // Held keys are exact byte strings: neither prefixes nor extensions are held.
        EXPECT_TRUE(tx.try_lock(std::string("key\0", 4), 1min));
        EXPECT_TRUE(tx.try_lock("ke", 1min));
    }
    EXPECT_FALSE(store.hold_lock(keys[1], "owner", 1min));  // a prefix of the owner
    EXPECT_FALSE(store.release_lock(keys[1], "owner"));     // is another owner
    EXPECT_TRUE(store.hold_lock(keys[1], owner, 1min));     // renewed by the real one
    for (const auto& key : keys)
        EXPECT_TRUE(store.release_lock(key, owner)) << key.size();
    EXPECT_EQ(store.query_int("SELECT count(*) FROM idem_locks"), 0);
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
    EXPECT_EQ(store.purge(24h * 14).claims, 1u);
    EXPECT_FALSE(store.find_claim("s", "old").has_value());
    ASSERT_TRUE(store.find_claim("s", "recent").has_value());
    EXPECT_EQ(store.find_claim("s", "recent")->claimed_at, t0 + 24h * 10);
    ASSERT_EQ(store.dead_letters().size(), 1u);
    EXPECT_EQ(store.dead_letters()[0].created_at, t0);
    EXPECT_EQ(store.purge(24h * 14).claims, 0u);
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
    // 12,000 sent intents, one unsent and one parked; 12,000 expired locks and a live one.
    const std::int64_t at_t0 =
        std::chrono::duration_cast<std::chrono::milliseconds>(t0.time_since_epoch()).count();
    store.execute(
        "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < 12000) "
        "INSERT INTO idem_outbox(destination, idempotency_key, payload, created_at, sent_at, "
        "next_attempt_at) SELECT 'rail', CAST('k' || n AS BLOB), x'', ?1, ?1, ?1 FROM g",
        at_t0);
    store.execute(
        "INSERT INTO idem_outbox(destination, idempotency_key, payload, created_at, "
        "next_attempt_at, parked) VALUES ('rail', CAST('unsent' AS BLOB), x'', ?1, ?1, 0), "
        "('rail', CAST('parked' AS BLOB), x'', ?1, ?1, 1)",
        at_t0);
    store.execute(
        "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < 12000) "
        "INSERT INTO idem_locks(lock_key, owner, expires_at) "
        "SELECT CAST('lock' || n AS BLOB), CAST('o' AS BLOB), ?1 FROM g",
        at_t0);
    ASSERT_TRUE(store.hold_lock("live", "o", 48h));
    now_ = t0 + 24h;
    const idem::PurgeResult purged = store.purge(1h);
    EXPECT_EQ(purged.claims, 12'000u);
    EXPECT_EQ(purged.sent_intents, 12'000u);
    EXPECT_EQ(purged.expired_locks, 12'000u);
    EXPECT_EQ(store.query_int("SELECT count(*) FROM idem_claims"), 0);
    EXPECT_EQ(store.query_int("SELECT count(*) FROM idem_outbox"), 2);
    EXPECT_EQ(store.query_int("SELECT count(*) FROM idem_locks"), 1);
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
