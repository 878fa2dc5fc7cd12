// SqliteStore on real database files: the schema and its version, claims and transactions,
// and fingerprints.

#include "support/sqlite_test_env.hpp"
#include "support/stored_offsets.hpp"

namespace idem_test::sqlite_store {
namespace {

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
    // The owned connection waits in idem's own busy handler (short sleeps up to busy_timeout,
    // BusyDatabaseGivesStoreTimeout), so SQLite's pragma reads 0; a borrowed connection, which
    // outlives the store, gets SQLite's own handler with the same timeout.
    EXPECT_EQ(plain.query_int("PRAGMA busy_timeout"), 0);
    EXPECT_EQ(plain.query_int("PRAGMA mmap_size"), 0) << "no map unless asked";
    options.mmap_size = std::int64_t{1} << 30;
    SqliteStore mapped{file("mapped.db"), options};
    EXPECT_EQ(mapped.query_int("PRAGMA mmap_size"), std::int64_t{1} << 30);
    claim_and_commit(mapped, "s", "m-1");
    EXPECT_TRUE(mapped.find_claim("s", "m-1").has_value());
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(file("borrowed.db").c_str(), &db), SQLITE_OK);
    {
        SqliteStore borrowed{db, options};
        EXPECT_EQ(borrowed.query_int("PRAGMA busy_timeout"), 1234);
    }
    sqlite3_close(db);
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

TEST_F(SqliteStoreTest, VersionTwoDatabaseIsMigratedToStoredOffsets) {
    {
        SqliteStore store{file()};
        claim_and_commit(store, "s", "m-1");
    }
    {
        RawDb raw{file()};  // what idem schema version 2 left: no idem_offsets
        raw.exec("DROP TABLE idem_offsets");
        // nor version 4's redrive columns, nor version 5's origin and failures
        raw.exec("DROP INDEX idem_dead_letters_message");
        for (const char* column : {"redrive_count", "redriven_at", "origin", "origin_position",
                                   "failure", "first_failed_at", "last_failed_at"}) {
            raw.exec(std::string("ALTER TABLE idem_dead_letters DROP COLUMN ") + column);
        }
        for (const char* column : {"last_failure", "first_failed_at", "last_failed_at"})
            raw.exec(std::string("ALTER TABLE idem_attempts DROP COLUMN ") + column);
        for (const char* column : {"scope", "message_id"})  // nor version 6's intent's writer
            raw.exec(std::string("ALTER TABLE idem_outbox DROP COLUMN ") + column);
        raw.exec("UPDATE idem_schema SET version = 2");
    }
    SqliteStore migrated{file()};
    EXPECT_EQ(migrated.query_int("SELECT version FROM idem_schema"), SqliteStore::schema_version);
    EXPECT_EQ(migrated.query_int("SELECT count(*) FROM pragma_table_info('idem_offsets')"), 5);
    EXPECT_TRUE(migrated.find_claim("s", "m-1").has_value());  // kept
    EXPECT_FALSE(migrated.stored_offset("g", "t", 0).has_value());
    EXPECT_TRUE(commit_offset(migrated, "g", "t", 0, 12));
    EXPECT_EQ(migrated.stored_offset("g", "t", 0), std::optional<std::int64_t>(12));
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

// ---- fuzz regressions (tests/fuzz/corpus/stored_outcome) ---------------------------------------
// A stored time is outside bytes: one the clock cannot hold (a corrupt row) is held at the
// clock's limit, never wrapped (fuzz.stored_outcome found from_unix_ms(INT64_MIN) overflowing).

TEST(StoredTimesFuzzRegression, AMillisecondCountPastTheClockIsHeldAtItsLimit) {
    using clock = std::chrono::system_clock;
    EXPECT_EQ(idem::from_unix_ms(INT64_MIN), clock::time_point::min());
    EXPECT_EQ(idem::from_unix_ms(INT64_MAX), clock::time_point::max());
    EXPECT_EQ(idem::to_unix_ms(idem::from_unix_ms(1700000000123)), 1700000000123);
    EXPECT_EQ(idem::to_unix_ms(idem::from_unix_ms(-1)), -1);
    EXPECT_LT(idem::from_unix_ms(-9223372036854), idem::from_unix_ms(9223372036854));
}

TEST(StoredTimesFuzzRegression, OnlyTheOutcomesIdemWritesAreRead) {
    EXPECT_EQ(idem::sql::stored_disposition("claimed", "t"), idem::Disposition::in_progress);
    EXPECT_EQ(idem::sql::stored_disposition("dead_lettered", "t"),
              idem::Disposition::dead_lettered);
    EXPECT_THROW((void)idem::sql::stored_disposition("PROCESSED", "t"), idem::store_error);
    EXPECT_THROW((void)idem::sql::stored_disposition(std::string("processed\0", 10), "t"),
                 idem::store_error);
}
}  // namespace
}  // namespace idem_test::sqlite_store
