// SqliteStore's outbox on real database files: adds, leases, sent/failed/parked rows, two
// stores leasing at once and hostile bytes.

#include "support/sqlite_test_env.hpp"

namespace idem_test::sqlite_store {
namespace {

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

}  // namespace
}  // namespace idem_test::sqlite_store
