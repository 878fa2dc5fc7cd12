// RedisStore's connections against a real redis-server: round trips, connection loss and
// a server killed mid-run, persistence (AOF) checks and the connection pool.

#include <optional>

#include "support/redis_store_test_env.hpp"

namespace idem_test::redis_store {
namespace {

// ---- round trips ------------------------------------------------------------------------------

TEST_F(RedisStoreTest, OneMessageCostsTwoRoundTripsAndABatchOfAHundredCostsTwo) {
    auto handler = idem::make_handler(
        store(), idem::Policy{"capture"},
        [](auto& tx, const std::string& order) { tx.write("HSET", "captures", order, "ch"); });
    // Warm up: connect and load the scripts once.
    ASSERT_EQ(handler.handle(Delivery{"warm", 1u}, std::string("w")).disposition,
              Disposition::processed);
    auto before = store().round_trips();
    ASSERT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("o-1")).disposition,
              Disposition::processed);
    EXPECT_EQ(store().round_trips() - before, 2u);  // claim, commit

    std::vector<Delivery> deliveries;
    std::vector<std::string> bodies;
    for (int i = 0; i < 100; ++i) {
        deliveries.push_back(Delivery{"b-" + std::to_string(i), 1u});
        bodies.push_back("o-" + std::to_string(i));
    }
    before = store().round_trips();
    auto outcomes = handler.handle_batch(deliveries, bodies);
    EXPECT_EQ(store().round_trips() - before, 2u);  // 100 claims pipelined, one commit
    for (const auto& outcome : outcomes)
        EXPECT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
    EXPECT_EQ(client().integer({"HLEN", "captures"}), 101);
    // Redelivered as a batch: 100 duplicates, one round trip, no commit.
    before = store().round_trips();
    outcomes = handler.handle_batch(deliveries, bodies);
    EXPECT_EQ(store().round_trips() - before, 1u);
    for (const auto& outcome : outcomes)
        EXPECT_EQ(outcome.disposition, Disposition::duplicate);
}

// warm_up() connects and loads the scripts ahead, so the first message costs what every later
// one does (claim, commit) instead of paying the commit script's SCRIPT LOAD.
TEST_F(RedisStoreTest, AfterWarmUpTheFirstMessageCostsOnlyItsTwoRoundTrips) {
    auto first_message_round_trips = [](idem::RedisStore& fresh, const char* id) {
        auto handler = idem::make_handler(
            fresh, idem::Policy{"capture"},
            [](auto& tx, const std::string& order) { tx.write("HSET", "captures", order, "ch"); });
        const auto before = fresh.round_trips();
        EXPECT_EQ(handler.handle(Delivery{id, 1u}, std::string(id)).disposition,
                  Disposition::processed);
        return fresh.round_trips() - before;
    };
    auto cold = other_worker();
    EXPECT_GT(first_message_round_trips(*cold, "m-cold"), 2u);  // + SCRIPT LOAD

    auto warm = other_worker();
    const auto before = warm->round_trips();
    warm->warm_up(2);
    EXPECT_GT(warm->round_trips(), before);  // the loads are counted, as warm_up's own
    EXPECT_EQ(first_message_round_trips(*warm, "m-warm"), 2u);  // claim, commit
    // A contested id goes through the claim script, loaded too: one more round trip, no load.
    auto holder = warm->begin();
    ASSERT_EQ(holder.claim("capture", "m-held").status, ClaimStatus::claimed);
    auto second = warm->begin();
    const auto contested = warm->round_trips();
    EXPECT_EQ(second.claim("capture", "m-held").status, ClaimStatus::in_progress);
    EXPECT_EQ(warm->round_trips() - contested, 2u);  // SET … NX GET, then the script
}

TEST_F(RedisStoreTest, AFailedMessageOfAPipelinedBatchGivesItsLeaseBack) {
    auto handler = idem::make_handler(store(), idem::Policy{"capture"},
                                      [](auto& tx, const std::string& order) {
                                          tx.write("SADD", "captured", order);
                                          if (order == "bad") throw std::runtime_error("503");
                                      });
    auto outcomes =
        handler.handle_batch(std::vector<Delivery>{{"m-1", 1u}, {"m-2", 1u}, {"m-3", 1u}},
                             std::vector<std::string>{"a", "bad", "c"});
    EXPECT_EQ(outcomes[0].disposition, Disposition::processed);
    EXPECT_EQ(outcomes[1].disposition, Disposition::failed);
    EXPECT_EQ(outcomes[2].disposition, Disposition::processed);
    EXPECT_FALSE(store().find_claim("capture", "m-2").has_value());  // freed, not left leased
    EXPECT_EQ(store().attempts("capture", "m-2"), 1u);
    EXPECT_EQ(client().integer({"SCARD", "captured"}), 2);
    EXPECT_EQ(handler.handle(Delivery{"m-2", 2u}, std::string("b")).disposition,
              Disposition::processed);
}

// ---- connection loss ---------------------------------------------------------------------------

/// Its own server: these tests kill it.
class RedisRestartTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_REDIS();
        server_ = std::make_unique<idem::testing::RedisServer>();
    }
    std::unique_ptr<idem::testing::RedisServer> server_;
};

TEST_F(RedisRestartTest, AnUnreachableServerIsAFailureAndTheStoreReconnects) {
    idem::RedisEndpoint endpoint = idem_test::redis_endpoint(*server_);
    endpoint.connect_timeout = 500ms;
    endpoint.command_timeout = 1s;
    idem::RedisStore store(endpoint);
    auto handler = idem::make_handler(
        store, idem::Policy{"s"}, [](auto& tx, const std::string& b) { tx.write("SADD", "x", b); });
    ASSERT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("1")).disposition,
              Disposition::processed);
    server_->kill9();
    auto down = handler.handle(Delivery{"m-2", 1u}, std::string("2"));
    EXPECT_EQ(down.disposition, Disposition::failed);
    EXPECT_FALSE(idem::should_ack(down));
    EXPECT_NE(down.reason.find("store error"), std::string::npos) << down.reason;
    server_->start();
    EXPECT_EQ(handler.handle(Delivery{"m-2", 2u}, std::string("2")).disposition,
              Disposition::processed);
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("1")).disposition,
              Disposition::duplicate);  // the AOF kept the first claim
}

TEST_F(RedisRestartTest, KilledAndRestartedMidRunOfAThousandLosesNothingAndAppliesNothingTwice) {
    constexpr int kMessages = 1000;
    idem::RedisEndpoint endpoint = idem_test::redis_endpoint(*server_);
    endpoint.connect_timeout = 500ms;
    endpoint.command_timeout = 2s;
    idem::RedisOptions options;
    options.lease = 500ms;  // leases orphaned by the kill expire quickly
    idem::RedisStore store(endpoint, options);
    auto handler =
        idem::make_handler(store, idem::Policy{"capture"}, [](auto& tx, const std::string& order) {
            tx.write("HINCRBY", "applied", order, 1);
            tx.write("SADD", "orders", order);
        });

    // The broker: unacked messages come back (with a higher count) until they are acked.
    std::vector<std::uint32_t> deliveries(kMessages, 0);
    std::vector<int> pending;
    for (int i = 0; i < kMessages; ++i)
        pending.push_back(i);
    std::atomic<int> handled{0};
    std::atomic<bool> killed{false};
    std::thread chaos([&] {
        // In the middle of the run, at a moment the handlers do not choose.
        while (handled.load() < kMessages / 2)
            std::this_thread::yield();
        server_->kill9();
        killed = true;
        std::this_thread::sleep_for(300ms);
        server_->start();
    });
    int failed = 0;
    const auto deadline = std::chrono::steady_clock::now() + 120s;
    while (!pending.empty() && std::chrono::steady_clock::now() < deadline) {
        std::vector<int> next;
        for (int i : pending) {
            const std::string id = "order-" + std::to_string(i);
            auto outcome = handler.handle(Delivery{id, ++deliveries[i]}, id);
            ++handled;
            if (idem::should_ack(outcome)) {
                EXPECT_TRUE(outcome.disposition == Disposition::processed ||
                            outcome.disposition == Disposition::duplicate)
                    << id << ": " << outcome.reason;
            } else {
                ++failed;
                next.push_back(i);
            }
        }
        pending = std::move(next);
        if (!pending.empty()) std::this_thread::sleep_for(50ms);
    }
    chaos.join();
    ASSERT_TRUE(killed);
    EXPECT_TRUE(pending.empty()) << pending.size() << " messages never acked";
    EXPECT_GT(failed, 0) << "the kill happened after the run: it proved nothing";

    idem::testing::RedisClient check(server_->host(), server_->port());
    EXPECT_EQ(check.integer({"SCARD", "orders"}), kMessages);
    EXPECT_EQ(check.integer({"HLEN", "applied"}), kMessages);
    for (int i = 0; i < kMessages; ++i) {
        const std::string id = "order-" + std::to_string(i);
        EXPECT_EQ(check.str({"HGET", "applied", id}), "1") << id << " applied more than once";
    }
    EXPECT_TRUE(store.dead_letters().empty());
}

// ---- persistence --------------------------------------------------------------------------------

TEST(RedisPersistenceTest, AServerWithoutAofIsRefusedUnlessTheRiskIsAccepted) {
    IDEM_REQUIRE_REDIS();
    idem::testing::RedisServer volatile_server{idem::testing::RedisServer::no_aof};
    const idem::RedisEndpoint endpoint = idem_test::redis_endpoint(volatile_server);

    // A server that answers: the store does not even construct.
    try {
        idem::RedisStore refusing(endpoint);
        ADD_FAILURE() << "a store on a server without AOF started";
    } catch (const idem::usage_error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("accept_no_persistence"), std::string::npos) << what;
        EXPECT_NE(what.find("append-only"), std::string::npos) << what;
    }
    // A server that was down when the store was made: every message fails (nothing claimed,
    // nothing acked) and says why.
    volatile_server.stop();
    idem::RedisEndpoint quick = endpoint;
    quick.connect_timeout = 500ms;
    idem::RedisStore refusing(quick);
    EXPECT_FALSE(refusing.persistence().has_value());
    volatile_server.start();
    auto handler = idem::make_handler(
        refusing, idem::Policy{"p"}, [](auto& tx, const std::string& b) { tx.write("SET", b, 1); });
    for (int attempt = 1; attempt <= 2; ++attempt) {
        auto outcome =
            handler.handle(Delivery{"m-1", static_cast<std::uint32_t>(attempt)}, std::string("k"));
        EXPECT_EQ(outcome.disposition, Disposition::failed);
        EXPECT_FALSE(idem::should_ack(outcome));
        EXPECT_NE(outcome.reason.find("accept_no_persistence"), std::string::npos)
            << outcome.reason;
    }
    EXPECT_THROW((void)refusing.begin().claim("p", "m-1"), idem::usage_error);
    ASSERT_TRUE(refusing.persistence().has_value());
    EXPECT_FALSE(refusing.persistence()->aof_enabled);
    idem::testing::RedisClient raw = volatile_server.client();
    EXPECT_EQ(*raw.integer({"DBSIZE"}), 0);  // nothing was claimed or written

    idem::RedisOptions accept;
    accept.accept_no_persistence = true;
    idem::RedisStore accepting(endpoint, accept);
    auto ok = idem::make_handler(accepting, idem::Policy{"p"},
                                 [](auto& tx, const std::string& b) { tx.write("SET", b, 1); });
    EXPECT_EQ(ok.handle(Delivery{"m-1", 1u}, std::string("k")).disposition, Disposition::processed);
    EXPECT_FALSE(accepting.persistence().has_value());  // not checked at all
}

// A restarted server replays its AOF before it answers, and says aof_enabled:0 while it does
// (loading:1): a store made then (a worker restarted with its Redis) must not take that for a
// server without AOF. It starts, checks once the load is done, and claims.
TEST(RedisPersistenceTest, AServerStillLoadingItsAofIsCheckedOnceItIsDone) {
    IDEM_REQUIRE_REDIS();
    // key-load-delay (µs per key loaded) makes the replay last long enough to be seen.
    idem::testing::RedisServer server{idem::testing::RedisServer::Setup{
        idem::testing::RedisServer::aof_always, {"--key-load-delay", "200"}, {}}};
    server.client().exec({"EVAL", "for i = 1, 5000 do redis.call('SET', 'k' .. i, i) end", "0"});
    server.kill9();
    std::thread restart([&] { server.start(); });  // returns once the replay is over
    idem::testing::RedisClient probe{server.host(), server.port(), 500ms};
    bool seen_loading = false;
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (!seen_loading && std::chrono::steady_clock::now() < deadline) {
        try {
            const std::string info = probe.str({"INFO", "persistence"}).value_or("");
            seen_loading = info.find("loading:1") != std::string::npos &&
                           info.find("aof_enabled:0") != std::string::npos;
        } catch (const std::exception&) {  // not listening yet
            probe.disconnect();
        }
        if (!seen_loading) std::this_thread::sleep_for(2ms);
    }
    std::optional<idem::RedisStore> store;
    if (seen_loading) {
        EXPECT_NO_THROW(store.emplace(idem_test::redis_endpoint(server)));
    }
    restart.join();
    ASSERT_TRUE(seen_loading) << "the replay was not seen; " << server.log_tail();
    ASSERT_TRUE(store.has_value());
    auto tx = store->begin();
    EXPECT_EQ(tx.claim("p", "after-load").status, ClaimStatus::claimed);
    tx.commit();
    ASSERT_TRUE(store->persistence().has_value());
    EXPECT_TRUE(store->persistence()->aof_enabled);
}

TEST_F(RedisStoreTest, AnAofServerIsAcceptedAndAServerHidingConfigToo) {
    auto claim_once = [](idem::RedisStore& s, const std::string& id) {
        auto tx = s.begin();
        auto claim = tx.claim("p", id);
        tx.commit();
        return claim.status;
    };
    idem::RedisStore plain(store().endpoint());
    EXPECT_EQ(claim_once(plain, "a"), ClaimStatus::claimed);
    ASSERT_TRUE(plain.persistence().has_value());
    EXPECT_TRUE(plain.persistence()->aof_enabled);
    EXPECT_EQ(plain.persistence()->appendfsync, "always");

    // A user that may not run CONFIG (as with rename-command CONFIG ""): INFO is enough.
    client().exec(
        {"ACL", "SETUSER", "idem-noconfig", "reset", "on", ">pw", "~*", "&*", "+@all", "-config"});
    idem::RedisEndpoint limited = store().endpoint();
    limited.username = "idem-noconfig";
    limited.password = "pw";
    idem::RedisStore no_config(limited);
    EXPECT_EQ(claim_once(no_config, "b"), ClaimStatus::claimed);
    ASSERT_TRUE(no_config.persistence().has_value());
    EXPECT_TRUE(no_config.persistence()->aof_enabled);
    EXPECT_EQ(no_config.persistence()->appendfsync, "");

    // A user that may not run INFO either: the store cannot tell, so it refuses and says why.
    client().exec({"ACL", "SETUSER", "idem-noinfo", "reset", "on", ">pw", "~*", "&*", "+@all",
                   "-config", "-info"});
    limited.username = "idem-noinfo";
    try {
        idem::RedisStore no_info(limited);
        ADD_FAILURE() << "a store that could not read INFO started";
    } catch (const idem::usage_error& e) {
        EXPECT_NE(std::string(e.what()).find("accept_no_persistence"), std::string::npos)
            << e.what();
    }
    client().exec({"ACL", "DELUSER", "idem-noconfig", "idem-noinfo"});
}

// ---- the connection pool
// --------------------------------------------------------------------------

TEST_F(RedisStoreTest, WithAllConnectionsInUseACallWaitsThenTimesOut) {
    idem::RedisOptions options;
    options.max_connections = 1;
    options.pool_wait_timeout = 300ms;
    idem::RedisStore capped(store().endpoint(), options);
    std::mutex m;
    std::condition_variable cv;
    bool holding = false;
    bool let_go = false;
    std::thread holder([&] {
        capped.with_connection([&](idem::redis::Connection& c) {
            c.checked({"PING"}, "PING");
            std::unique_lock<std::mutex> lock(m);
            holding = true;
            cv.notify_all();
            cv.wait_for(lock, 60s, [&] { return let_go; });
            return 0;
        });
    });
    {
        std::unique_lock<std::mutex> lock(m);
        ASSERT_TRUE(cv.wait_for(lock, 30s, [&] { return holding; }));
    }
    auto tx = capped.begin();
    const auto started = std::chrono::steady_clock::now();
    EXPECT_THROW((void)tx.claim("p", "m-1"), idem::store_timeout);
    EXPECT_GE(std::chrono::steady_clock::now() - started, 250ms);
    {
        std::lock_guard<std::mutex> lock(m);
        let_go = true;
    }
    cv.notify_all();
    holder.join();
    // Given back: the next call gets it.
    EXPECT_EQ(tx.claim("p", "m-1").status, ClaimStatus::claimed);
    // And a waiter is woken by the give-back, not by its timeout.
    idem::RedisOptions patient = options;
    patient.pool_wait_timeout = 60s;
    idem::RedisStore one(store().endpoint(), patient);
    std::atomic<bool> held{false};
    std::thread second([&] {
        one.with_connection([&](idem::redis::Connection& c) {
            held = true;
            std::this_thread::sleep_for(300ms);
            return c.checked({"PING"}, "PING");
        });
    });
    while (!held)
        std::this_thread::yield();
    const auto waited_from = std::chrono::steady_clock::now();
    auto reply =
        one.with_connection([](idem::redis::Connection& c) { return c.checked({"PING"}, "PING"); });
    EXPECT_EQ(reply.str, "PONG");
    EXPECT_LT(std::chrono::steady_clock::now() - waited_from, 30s);
    second.join();
}

TEST_F(RedisStoreTest, AnIdleConnectionKilledByTheServerIsReplacedBeforeReuse) {
    auto client_id = [](idem::RedisStore& s) {
        return s.with_connection([](idem::redis::Connection& c) {
            return c.checked({"CLIENT", "ID"}, "CLIENT ID").integer;
        });
    };
    auto run = [](idem::RedisStore& s, const std::string& id) {
        auto handler = idem::make_handler(
            s, idem::Policy{"ping"},
            [](auto& tx, const std::string& b) { tx.write("SADD", "pinged", b); });
        return handler.handle(Delivery{id, 1u}, id).disposition;
    };

    idem::RedisOptions pinging;
    pinging.ping_idle_after = 0ms;  // every reuse
    idem::RedisStore checked(store().endpoint(), pinging);
    ASSERT_EQ(run(checked, "m-1"), Disposition::processed);
    const long long first = client_id(checked);
    client().exec({"CLIENT", "KILL", "ID", std::to_string(first)});
    EXPECT_EQ(run(checked, "m-2"), Disposition::processed);  // the ping found it dead
    EXPECT_NE(client_id(checked), first);

    // Without the ping (idle for less than ping_idle_after), the dead connection fails the call.
    idem::RedisOptions lazy;
    lazy.ping_idle_after = std::chrono::hours(1);
    idem::RedisStore unchecked(store().endpoint(), lazy);
    ASSERT_EQ(run(unchecked, "m-3"), Disposition::processed);
    client().exec({"CLIENT", "KILL", "ID", std::to_string(client_id(unchecked))});
    EXPECT_EQ(run(unchecked, "m-4"), Disposition::failed);
    EXPECT_EQ(run(unchecked, "m-4"), Disposition::processed);  // reconnected after the failure
}

}  // namespace
}  // namespace idem_test::redis_store
