// RedisOptions::replicas_to_ack against a real master and replica (redis-server --replicaof), both
// started once for this binary: WAIT rides in the commit's round trip, a commit the replica
// confirmed is on the replica, and a commit the replica could not confirm (SIGSTOPped) is failed
// with its true meaning (commit_unconfirmed: applied on the master, maybe lost on failover) and is
// never acked by the RedisStreamConsumer; the PipelinedLoop's commit, WAIT, next claim round trip.

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "idem/broker/redis_streams.hpp"
#include "idem/idem.hpp"
#include "idem/store/redis.hpp"
#include "idem/testing/redis_server.hpp"
#include "support/redis_env.hpp"
#include "support/require_redis.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;
using idem::FailureCause;
using namespace std::chrono_literals;

/// The master and its replica, once per test binary.
struct Pair {
    idem::testing::RedisServer master;
    idem::testing::RedisServer replica;

    Pair()
        // No 5 s wait for more replicas before the first (diskless) sync.
        : master(idem::testing::RedisServer::Setup{
              idem::testing::RedisServer::aof_always, {"--repl-diskless-sync-delay", "0"}, {}}),
          replica(idem::testing::RedisServer::Setup{
              idem::testing::RedisServer::aof_always,
              {"--replicaof", "127.0.0.1", std::to_string(master.port())},
              {}}) {
        // Ready when a write reaches the replica: WAIT answers 1.
        auto client = master.client();
        const auto deadline = std::chrono::steady_clock::now() + 20s;
        for (;;) {
            client.exec({"INCR", "ready"});
            if (client.integer({"WAIT", "1", "100"}) == 1) return;
            if (std::chrono::steady_clock::now() >= deadline) {
                throw std::runtime_error("the replica did not come online: " + replica.log_tail());
            }
            std::this_thread::sleep_for(20ms);
        }
    }
};

Pair& pair() {
    static Pair servers;
    return servers;
}

class RedisReplicasTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_REDIS();
        pair().master.flushall();
        // WAIT 1 answers 1 once the FLUSHALL (and whatever the last test wrote) is on the replica.
        ASSERT_EQ(pair().master.client().integer({"WAIT", "1", "5000"}), 1)
            << "the replica did not confirm the FLUSHALL within 5 s; " << replication_state();
    }

    /// Both servers' replication as they report it, for a failure message.
    static std::string replication_state() {
        std::string out;
        for (const idem::testing::RedisServer* server : {&pair().master, &pair().replica}) {
            out += (server == &pair().master ? "master :" : "replica :") +
                   std::to_string(server->port()) + ": ";
            try {
                const std::string info = server->client().str({"INFO", "replication"}).value_or("");
                for (const char* field :
                     {"role", "master_link_status", "master_sync_in_progress", "connected_slaves",
                      "master_repl_offset", "slave_repl_offset"}) {
                    const std::string value = idem::testing::detail::info_field(info, field);
                    if (!value.empty()) out += std::string(field) + ":" + value + " ";
                }
            } catch (const std::exception& e) {
                out += e.what();
            }
            out += "; ";
        }
        return out;
    }

    /// Waits (up to 10 s) until the resumed replica has all the master had when called: a
    /// replica back from SIGSTOP works through what it missed before a WAIT can count it, and
    /// a short replicas_timeout must not race that. Empty when it has; the state otherwise.
    static std::string await_replica_caught_up() {
        const long long offset =
            idem::testing::replication_offset(pair().master, "master_repl_offset");
        const auto deadline = std::chrono::steady_clock::now() + 10s;
        while (idem::testing::replication_offset(pair().replica, "slave_repl_offset") < offset) {
            if (std::chrono::steady_clock::now() >= deadline) {
                return "the resumed replica did not reach the master's offset " +
                       std::to_string(offset) + " within 10 s; " + replication_state();
            }
            std::this_thread::sleep_for(5ms);
        }
        return "";
    }

    // replicas_timeout generous by default: a loaded machine delays the replica's ack.
    static std::unique_ptr<idem::RedisStore> store(
        int replicas_to_ack, std::chrono::milliseconds replicas_timeout = 2s) {
        idem::RedisOptions options;
        options.replicas_to_ack = replicas_to_ack;
        options.replicas_timeout = replicas_timeout;
        return std::make_unique<idem::RedisStore>(idem_test::redis_endpoint(pair().master),
                                                  options);
    }
    static auto handler(idem::RedisStore& store) {
        return idem::make_handler(
            store, idem::Policy{"orders"},
            [](auto& tx, const std::string& body) { tx.write("INCR", "effects:" + body); });
    }
    /// A claim record as the replica has it (nothing when it has none).
    static std::optional<std::string> on_replica(idem::RedisStore& store, const std::string& id) {
        return pair().replica.client().str({"GET", store.claim_key("orders", id)});
    }

    /// Resumes a SIGSTOPped replica even when an assertion fails.
    struct Paused {
        Paused() { pair().replica.pause(); }
        ~Paused() {
            try {
                pair().replica.resume();
            } catch (...) {
            }
        }
    };
};

TEST_F(RedisReplicasTest, WaitRidesInTheCommitsRoundTripAndTheReplicaHasTheCommit) {
    auto plain = store(0);
    auto confirmed = store(1);
    auto plain_handler = handler(*plain);
    auto confirmed_handler = handler(*confirmed);
    // Warm-up: the persistence check and the scripts load once per connection.
    ASSERT_EQ(plain_handler.handle(Delivery{"warm-a", 1u}, std::string("w")).disposition,
              Disposition::processed);
    const auto warm = confirmed_handler.handle(Delivery{"warm-b", 1u}, std::string("w"));
    ASSERT_EQ(warm.disposition, Disposition::processed) << warm.reason;

    const std::size_t plain_before = plain->round_trips();
    ASSERT_EQ(plain_handler.handle(Delivery{"a", 1u}, std::string("a")).disposition,
              Disposition::processed);
    const std::size_t plain_trips = plain->round_trips() - plain_before;

    const std::size_t confirmed_before = confirmed->round_trips();
    const auto outcome = confirmed_handler.handle(Delivery{"b", 1u}, std::string("b"));
    ASSERT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
    EXPECT_EQ(confirmed->round_trips() - confirmed_before, plain_trips)
        << "WAIT must be pipelined with the commit, not a round trip of its own";
    EXPECT_EQ(plain_trips, 2u);  // the claim, the commit

    // WAIT answered 1: the replica has the finished claim the moment the handler returns.
    const auto record = on_replica(*confirmed, "b");
    ASSERT_TRUE(record.has_value()) << "a confirmed commit is not on the replica";
    EXPECT_EQ(record->rfind("done|", 0), 0u) << *record;
}

TEST_F(RedisReplicasTest, ACommitTheReplicaDidNotConfirmIsFailedUnconfirmedAndADuplicateLater) {
    auto confirmed = store(1);
    auto h = handler(*confirmed);
    ASSERT_EQ(h.handle(Delivery{"warm", 1u}, std::string("w")).disposition, Disposition::processed);
    idem::Outcome outcome;
    {
        Paused replica_stopped;
        outcome = h.handle(Delivery{"x", 1u}, std::string("x"));
    }
    ASSERT_EQ(await_replica_caught_up(), "");
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_EQ(outcome.cause, FailureCause::commit_unconfirmed) << outcome.reason;
    EXPECT_FALSE(idem::should_ack(outcome));
    EXPECT_FALSE(outcome.store_unreachable()) << "the master answered; only its replica lags";
    EXPECT_NE(outcome.reason.find("0 of 1 replicas"), std::string::npos) << outcome.reason;
    EXPECT_NE(outcome.reason.find("must not be acked"), std::string::npos) << outcome.reason;

    // It was applied on the master (the outcome was unknown, not "nothing stored"): with the
    // master still there, the redelivery is a duplicate and the effect ran once.
    auto claim = confirmed->find_claim("orders", "x");
    ASSERT_TRUE(claim.has_value());
    EXPECT_EQ(claim->disposition, Disposition::processed);
    const auto again = h.handle(Delivery{"x", 2u}, std::string("x"));
    EXPECT_EQ(again.disposition, Disposition::duplicate) << again.reason;
    EXPECT_EQ(pair().master.client().integer({"GET", "effects:x"}), 1);
}

// A redelivery of a commit that was not confirmed finds its record on the master. Acking that
// duplicate on the master's word would lose the message if the master died before its replica
// caught up, so the duplicate waits for the replica too (a write of its own, then WAIT): failed
// while the replica is stopped, a duplicate once it has the record. The same for a local effect
// (claim and commit in one script, the mark and WAIT in its round trip).
TEST_F(RedisReplicasTest, ADuplicateIsAckedOnlyOnceTheReplicaHasTheRecordItRestsOn) {
    auto confirmed = store(1, 200ms);  // short: each unconfirmed answer waits for all of it
    auto h = handler(*confirmed);
    auto local = idem::make_handler(*confirmed, idem::Policy{"orders"},
                                    idem::local_effect([](auto& tx, const std::string& body) {
                                        tx.write("INCR", "effects:" + body);
                                    }));
    ASSERT_EQ(h.handle(Delivery{"warm", 1u}, std::string("w")).disposition, Disposition::processed);
    idem::Outcome first, redelivered, local_first, local_redelivered;
    {
        Paused replica_stopped;
        first = h.handle(Delivery{"x", 1u}, std::string("x"));
        redelivered = h.handle(Delivery{"x", 2u}, std::string("x"));
        local_first = local.handle(Delivery{"y", 1u}, std::string("y"));
        local_redelivered = local.handle(Delivery{"y", 2u}, std::string("y"));
    }
    ASSERT_EQ(await_replica_caught_up(), "");  // the duplicates' WAIT below has only 200 ms
    for (const idem::Outcome* o : {&first, &redelivered, &local_first, &local_redelivered}) {
        EXPECT_EQ(o->disposition, Disposition::failed) << o->reason;
        EXPECT_EQ(o->cause, FailureCause::commit_unconfirmed) << o->reason;
        EXPECT_FALSE(idem::should_ack(*o));
    }
    EXPECT_NE(redelivered.reason.find("the record a duplicate rests on"), std::string::npos)
        << redelivered.reason;
    EXPECT_NE(local_redelivered.reason.find("the record a duplicate rests on"), std::string::npos)
        << local_redelivered.reason;

    const auto again = h.handle(Delivery{"x", 3u}, std::string("x"));
    EXPECT_EQ(again.disposition, Disposition::duplicate) << again.reason;
    const auto local_again = local.handle(Delivery{"y", 3u}, std::string("y"));
    EXPECT_EQ(local_again.disposition, Disposition::duplicate) << local_again.reason;
    auto master = pair().master.client();
    EXPECT_EQ(master.integer({"GET", "effects:x"}), 1);
    EXPECT_EQ(master.integer({"GET", "effects:y"}), 1);
    EXPECT_TRUE(on_replica(*confirmed, "x").has_value());
    EXPECT_TRUE(on_replica(*confirmed, "y").has_value());

    // A duplicate's check is a round trip of its own, only with replicas_to_ack.
    const std::size_t before = confirmed->round_trips();
    ASSERT_EQ(h.handle(Delivery{"x", 4u}, std::string("x")).disposition, Disposition::duplicate);
    EXPECT_EQ(confirmed->round_trips() - before, 2u);  // the claim, then the mark and WAIT
    auto plain = store(0);
    auto plain_handler = handler(*plain);
    ASSERT_EQ(plain_handler.handle(Delivery{"x", 5u}, std::string("x")).disposition,
              Disposition::duplicate);
    const std::size_t plain_before = plain->round_trips();
    ASSERT_EQ(plain_handler.handle(Delivery{"x", 6u}, std::string("x")).disposition,
              Disposition::duplicate);
    EXPECT_EQ(plain->round_trips() - plain_before, 1u);
}

// replicas_to_ack with the PipelinedLoop: one round trip carries N's commit, WAIT, then N+1's
// claim. A commit the replica confirmed is on it when N settles; one it could not confirm fails
// N alone (commit_unconfirmed, no ack) and N+1's fresh lease stands. After the master lost its
// script cache (NOSCRIPT) the re-run commit is followed by WAIT again, not by the claim.
TEST_F(RedisReplicasTest, ThePipelinedLoopSendsTheCommitThenWaitThenTheNextClaim) {
    auto confirmed = store(1);
    confirmed->warm_up();
    auto h = handler(*confirmed);
    idem::PipelinedLoop<decltype(h)> loop(h);
    EXPECT_TRUE(loop.handle(Delivery{"p-1", 1u}, std::string("p-1"), "p-1").empty());
    const std::size_t before = confirmed->round_trips();
    auto settled = loop.handle(Delivery{"p-2", 1u}, std::string("p-2"), "p-2");
    EXPECT_EQ(confirmed->round_trips() - before, 1u) << "commit, WAIT and the claim together";
    ASSERT_EQ(settled.size(), 1u);
    EXPECT_EQ(settled[0].tag, "p-1");
    EXPECT_EQ(settled[0].outcome.disposition, Disposition::processed) << settled[0].outcome.reason;
    auto record = on_replica(*confirmed, "p-1");
    ASSERT_TRUE(record.has_value()) << "a confirmed commit is not on the replica";
    EXPECT_EQ(record->rfind("done|", 0), 0u) << *record;

    pair().master.client().exec({"SCRIPT", "FLUSH"});
    settled = loop.handle(Delivery{"p-3", 1u}, std::string("p-3"), "p-3");
    ASSERT_EQ(settled.size(), 1u);
    EXPECT_EQ(settled[0].tag, "p-2");
    EXPECT_EQ(settled[0].outcome.disposition, Disposition::processed) << settled[0].outcome.reason;
    record = on_replica(*confirmed, "p-2");
    ASSERT_TRUE(record.has_value()) << "WAIT was not sent again behind the re-run commit";
    EXPECT_EQ(record->rfind("done|", 0), 0u) << *record;
    EXPECT_TRUE(loop.holding());
    EXPECT_EQ(confirmed->find_claim("orders", "p-3")->disposition, Disposition::in_progress)
        << "the claim ran once, before the re-run commit, and is ours";

    {
        Paused replica_stopped;
        settled = loop.handle(Delivery{"p-4", 1u}, std::string("p-4"), "p-4");
    }
    ASSERT_EQ(settled.size(), 1u);
    EXPECT_EQ(settled[0].tag, "p-3");
    EXPECT_EQ(settled[0].outcome.disposition, Disposition::failed);
    EXPECT_EQ(settled[0].outcome.cause, FailureCause::commit_unconfirmed)
        << settled[0].outcome.reason;
    EXPECT_FALSE(idem::should_ack(settled[0].outcome));
    EXPECT_TRUE(loop.holding()) << "p-4's claim stands beside p-3's unconfirmed commit";
    EXPECT_EQ(confirmed->find_claim("orders", "p-4")->disposition, Disposition::in_progress);
    settled = loop.flush();
    ASSERT_EQ(settled.size(), 1u);
    EXPECT_EQ(settled[0].tag, "p-4");
    // The replica is back; whether it caught up within the timeout is not this test's point,
    // only that the outcome says which it was.
    EXPECT_TRUE(settled[0].outcome.disposition == Disposition::processed ||
                settled[0].outcome.cause == FailureCause::commit_unconfirmed)
        << settled[0].outcome.reason;
    // p-3 was applied on the master: its redelivery is a duplicate (once the replica has its
    // record), its effect ran once.
    ASSERT_EQ(await_replica_caught_up(), "");
    EXPECT_EQ(h.handle(Delivery{"p-3", 2u}, std::string("p-3")).disposition,
              Disposition::duplicate);
    for (const char* id : {"p-1", "p-2", "p-3", "p-4"})
        EXPECT_EQ(pair().master.client().integer({"GET", std::string("effects:") + id}), 1) << id;
}

TEST_F(RedisReplicasTest, TheStreamConsumerNeverAcksAnUnconfirmedCommit) {
    // The stream on a server of its own (the process's shared one): the consumer acks after the
    // commit, so an ack of an unconfirmed commit would outlive a failover that loses the commit.
    auto& broker = idem::testing::shared_redis();
    broker.flushall();
    auto confirmed = store(1);
    auto h = handler(*confirmed);
    ASSERT_EQ(h.handle(Delivery{"warm", 1u}, std::string("w")).disposition, Disposition::processed);
    auto client = broker.client();
    const auto entry = client.str({"XADD", "orders", "*", "body", "y"});
    ASSERT_TRUE(entry.has_value());

    idem::RedisStreamConsumerOptions options;
    options.stream = "orders";
    options.group = "g";
    options.consumer = "c1";
    options.poll_wait = 50ms;
    options.circuit_breaker.initial_backoff = 10ms;
    idem::RedisStreamConsumer consumer{idem_test::redis_endpoint(broker), options,
                                       [&](const Delivery& delivery, const idem::StreamEntry& e) {
                                           return h.handle(
                                               delivery, std::string(e.field("body").value_or("")));
                                       }};
    {
        Paused replica_stopped;
        EXPECT_EQ(consumer.poll_once(), 1u);
    }
    const auto stats = consumer.stats();
    EXPECT_EQ(stats.acked, 0u);
    EXPECT_EQ(stats.not_acked, 1u);
    // Still pending in the group: it comes back after the visibility timeout.
    idem::redis::Connection reader{idem_test::redis_endpoint(broker)};
    const auto pending = reader.checked({"XPENDING", "orders", "g"}, "XPENDING");
    ASSERT_FALSE(pending.elements.empty());
    EXPECT_EQ(pending.elements[0].integer, 1);
}

TEST_F(RedisReplicasTest, ATimeoutThatWouldOutlastTheCommandTimeoutIsRefused) {
    idem::RedisOptions options;
    options.replicas_to_ack = 1;
    options.replicas_timeout = 0ms;
    EXPECT_THROW(idem::RedisStore(idem_test::redis_endpoint(pair().master), options),
                 idem::usage_error);
    options.replicas_timeout = 5s;  // the endpoint's command_timeout
    EXPECT_THROW(idem::RedisStore(idem_test::redis_endpoint(pair().master), options),
                 idem::usage_error);
    options.replicas_to_ack = -1;
    EXPECT_THROW(idem::RedisStore(idem_test::redis_endpoint(pair().master), options),
                 idem::usage_error);
}

}  // namespace
