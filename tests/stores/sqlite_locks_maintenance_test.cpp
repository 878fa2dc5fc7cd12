// SqliteStore on real database files: values, overlap locks, a busy database, purge, a
// borrowed connection and several stores or threads on one file.

#include <thread>

#include "support/sqlite_test_env.hpp"

namespace idem_test::sqlite_store {
namespace {

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

// A writer waiting for the lock takes it once it is free, well before its busy timeout.
TEST_F(SqliteStoreTest, AWaitingWriterTakesTheLockOnceItIsFree) {
    SqliteOptions options;
    options.busy_timeout = 10s;
    SqliteStore store{file(), options};
    RawDb other{file()};
    other.exec("BEGIN IMMEDIATE");
    std::thread release([&] {
        std::this_thread::sleep_for(50ms);
        other.exec("ROLLBACK");
    });
    const auto started = std::chrono::steady_clock::now();
    claim_and_commit(store, "s", "m-1");
    const auto waited = std::chrono::steady_clock::now() - started;
    release.join();
    EXPECT_GE(waited, 40ms) << "it did not wait for the lock";
    EXPECT_LT(waited, 5s) << "it waited on after the lock was free";
    EXPECT_TRUE(store.find_claim("s", "m-1").has_value());
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
}  // namespace idem_test::sqlite_store
