// The SQL stores' ping() and a PostgreSQL outage under a redelivering stream. ping() is what
// idem::probe_store() runs (the circuit breaker's probe before a consumer reads again): on
// PostgreSQL one round trip, so a server that died while the connection sat idle fails the probe
// instead of passing it with nothing sent; on SQLite BEGIN IMMEDIATE + ROLLBACK. The outage: the
// PostgreSQL server SIGKILLed for ~2 s while a real Redis stream with a 20 ms visibility timeout
// keeps redelivering; once it is back no healthy message is dead-lettered and each is processed
// once.

#include <gtest/gtest.h>
#include <sqlite3.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/broker/circuit_breaker.hpp"
#include "idem/broker/redis_streams.hpp"
#include "idem/idem.hpp"
#include "idem/redis/connection.hpp"
#include "idem/store/postgres.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/postgres_server.hpp"
#include "idem/testing/redis_server.hpp"
#include "idem/testing/temp_dir.hpp"
#include "support/polling.hpp"
#include "support/require_postgres.hpp"
#include "support/require_redis.hpp"

namespace {

using namespace std::chrono_literals;
using idem::Delivery;
using idem::Disposition;
using idem::StreamEntry;

template <class Pred>
bool wait_for(Pred done, std::chrono::milliseconds limit = 60s) {
    return idem_test::wait_within(limit, done);
}

// ---------------------------------------------------------------------------------------------
// ping()

TEST(PostgresPingTest, ProbeFailsWhileTheServerIsKilledAndPassesAfterTheRestart) {
    IDEM_REQUIRE_POSTGRES();
    idem::testing::PostgresServer own;  // this one we kill
    idem::PostgresStore store(own.conninfo() + " connect_timeout=5");
    ASSERT_FALSE(store.find_claim("capture", "m-1").has_value());  // the session is up
    EXPECT_NO_THROW(idem::probe_store(store));

    own.kill9();  // the idle connection does not know yet
    EXPECT_THROW(idem::probe_store(store), idem::store_unavailable)
        << "the probe passed against a dead server";
    EXPECT_THROW(idem::probe_store(store), idem::store_unavailable);
    own.start();
    EXPECT_NO_THROW(idem::probe_store(store));
    const int session = PQbackendPID(store.conn());

    // Killed and back while the connection sat idle: the probe finds the socket dead,
    // reconnects once and answers from the new session.
    own.kill9();
    own.start();
    EXPECT_NO_THROW(idem::probe_store(store));
    EXPECT_NE(PQbackendPID(store.conn()), session);
    EXPECT_FALSE(store.find_claim("capture", "m-1").has_value());
}

TEST(SqlitePingTest, PingTimesOutWhileAnotherConnectionHoldsTheWriteLock) {
    idem::testing::TempDir dir;
    const std::string path = dir.file("idem.db");
    idem::SqliteOptions options;
    options.busy_timeout = 50ms;
    idem::SqliteStore store{path, options};
    EXPECT_NO_THROW(store.ping());

    sqlite3* other = nullptr;
    ASSERT_EQ(sqlite3_open(path.c_str(), &other), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(other, "BEGIN EXCLUSIVE", nullptr, nullptr, nullptr), SQLITE_OK);
    EXPECT_THROW(store.ping(), idem::store_timeout);
    EXPECT_THROW(idem::probe_store(store), idem::store_timeout);
    ASSERT_EQ(sqlite3_exec(other, "ROLLBACK", nullptr, nullptr, nullptr), SQLITE_OK);
    sqlite3_close(other);
    EXPECT_NO_THROW(store.ping());
    // ping() leaves no transaction behind.
    auto tx = store.begin();
    tx.commit();
}

// ---------------------------------------------------------------------------------------------
// The outage

class PostgresStoreOutageTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_REDIS();
        IDEM_REQUIRE_POSTGRES();
        redis_ = &idem::testing::shared_redis();
        redis_->flushall();
    }

    idem::RedisEndpoint endpoint() const {
        idem::RedisEndpoint endpoint;
        endpoint.host = redis_->host();
        endpoint.port = redis_->port();
        return endpoint;
    }
    long long stream_length(const std::string& stream) {
        idem::redis::Connection connection{endpoint()};
        return connection.checked({"XLEN", stream}, "XLEN").integer;
    }
    long long pending(const std::string& stream) {
        idem::redis::Connection connection{endpoint()};
        return connection.checked({"XPENDING", stream, "workers"}, "XPENDING")
            .elements.at(0)
            .integer;
    }

    idem::testing::RedisServer* redis_ = nullptr;
};

TEST_F(PostgresStoreOutageTest, DoesNotDeadLetterHealthyMessages) {
    idem::testing::PostgresServer pg;  // this one we kill
    pg.exec("CREATE TABLE captures(order_id TEXT PRIMARY KEY)");
    idem::PostgresStore store(pg.conninfo() + " connect_timeout=2");
    idem::PolicyOptions policy;
    policy.max_deliveries = 5;
    std::mutex mutex;
    std::uint32_t highest_count = 0;
    auto handler = idem::make_handler(
        store, idem::Policy{"capture", policy},
        [&](auto& tx, const StreamEntry& e, const Delivery& d) {
            tx.execute("INSERT INTO captures VALUES ($1)", std::string(*e.field("order")));
            {
                std::lock_guard<std::mutex> lock(mutex);
                highest_count = std::max(highest_count, d.delivery_count.value());
            }
            std::this_thread::sleep_for(20ms);  // messages are in flight when the server dies
        });
    idem::RedisStreamConsumerOptions options;
    options.stream = "orders";
    options.group = "workers";
    options.consumer = "c1";
    options.visibility_timeout = 20ms;  // the broker redelivers fast
    options.poll_wait = 20ms;
    options.circuit_breaker.initial_backoff = 20ms;
    options.circuit_breaker.max_backoff = 100ms;
    constexpr int messages = 40;
    {
        idem::redis::Connection connection{endpoint()};
        for (int i = 0; i < messages; ++i) {
            connection.checked({"XADD", "orders", "*", "order", std::to_string(i)}, "XADD");
        }
    }
    idem::RedisStreamConsumer consumer{endpoint(), options, handler};
    std::thread worker([&] { consumer.run(); });
    const bool started = wait_for([&] { return consumer.stats().acked >= 3; });
    if (started) {
        pg.kill9();  // the server dies with messages in flight, for ~2 s
        std::this_thread::sleep_for(2s);
    }
    const auto during = consumer.stats();
    if (started) pg.start();

    const bool done = wait_for([&] { return consumer.stats().acked >= messages; }, 90s);
    consumer.request_stop();
    worker.join();
    ASSERT_TRUE(started) << "no message was processed before the outage";
    ASSERT_TRUE(done) << "acked " << consumer.stats().acked << ", dead-lettered "
                      << consumer.stats().dead_lettered;

    EXPECT_EQ(consumer.stats().dead_lettered, 0u);
    EXPECT_EQ(stream_length("orders.dead-letters"), 0);
    EXPECT_TRUE(store.dead_letters().empty());
    EXPECT_EQ(pending("orders"), 0);
    EXPECT_EQ(store.query_int("SELECT count(*) FROM captures"), messages);  // each once
    EXPECT_EQ(store.query_int("SELECT count(*) FROM idem_claims WHERE outcome = 'processed'"),
              messages);
    EXPECT_GE(during.circuit_opened, 1u);
    EXPECT_GE(during.store_probes, 2u) << "the consumer kept reading while the server was down";
    std::lock_guard<std::mutex> guard(mutex);
    EXPECT_LT(highest_count, policy.max_deliveries);
}

}  // namespace
