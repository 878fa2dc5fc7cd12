// PostgresStore's overlap lock and outbox against a real PostgreSQL server, with several
// relays leasing at once.

#include "support/postgres_test_env.hpp"

namespace idem_test::postgres_store {
namespace {

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

// A destination TEXT cannot hold is refused before any entry is touched: nothing is redriven.
TEST_F(PostgresStoreTest, RedriveToADestinationTextCannotHoldChangesNothing) {
    auto s = store(clocked());
    auto handler = idem::make_handler(*s, idem::Policy{"s"}, writer());
    ASSERT_EQ(handler.handle(Delivery{"m-1", 5u}, std::string("a")).disposition,
              Disposition::dead_lettered);
    idem::RedriveOptions options;
    options.destination = std::string("orders\xff", 7);
    EXPECT_THROW(s->redrive({}, options), idem::usage_error);
    EXPECT_EQ(s->find_claim("s", "m-1")->disposition, Disposition::dead_lettered);
    EXPECT_FALSE(s->dead_letters()[0].redriven_at.has_value());
    EXPECT_EQ(count("SELECT count(*) FROM idem_outbox"), 0);
    options.destination = "orders";
    EXPECT_EQ(s->redrive({}, options).count(idem::RedriveStatus::redriven), 1u);
    EXPECT_EQ(count("SELECT count(*) FROM idem_outbox"), 1);
}

}  // namespace
}  // namespace idem_test::postgres_store
