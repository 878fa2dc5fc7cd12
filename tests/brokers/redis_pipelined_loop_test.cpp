// idem::PipelinedLoop on a real redis-server: message N's commit and N+1's claim in one round
// trip (counted by round_trips()), N settled only after its commit's reply, what a failed
// commit or a dropped connection does to N and to N+1's fresh lease, and the loop on a store
// without the capability.

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "idem/idem.hpp"
#include "idem/store/memory.hpp"
#include "idem/store/redis.hpp"
#include "idem/testing/redis_server.hpp"
#include "support/redis_env.hpp"
#include "support/refusing_proxy.hpp"
#include "support/require_redis.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;
using namespace std::chrono_literals;

class PipelinedLoopTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_REDIS();
        env_ = std::make_unique<idem_test::RedisEnv>();
        store().warm_up();
    }
    idem::RedisStore& store() { return *env_->store; }
    idem::testing::RedisClient& client() { return *env_->client; }
    long long applied(const std::string& id) {
        return client().integer({"HGET", "applied", id}).value_or(0);
    }
    std::unique_ptr<idem_test::RedisEnv> env_;
};

auto incrementing_handler(idem::RedisStore& store) {
    return idem::make_handler(store, idem::Policy{"orders"}, [](auto& tx, const std::string& id) {
        tx.write("HINCRBY", "applied", id, 1);
    });
}

template <class Settled>
std::vector<std::string> tags(const std::vector<Settled>& settled) {
    std::vector<std::string> out;
    for (const auto& s : settled)
        out.push_back(s.tag + ":" + std::string(idem::to_string(s.outcome.disposition)));
    return out;
}

TEST_F(PipelinedLoopTest, EachCommitGoesWithTheNextClaimAndSettlesOnlyAfterItsReply) {
    auto handler = incrementing_handler(store());
    idem::PipelinedLoop<decltype(handler)> loop(handler);
    static_assert(decltype(loop)::pipelines);
    const auto before = store().round_trips();
    EXPECT_TRUE(loop.handle(Delivery{"m-0", 1u}, std::string("m-0"), "m-0").empty());
    EXPECT_TRUE(loop.holding());
    EXPECT_EQ(applied("m-0"), 0);  // not committed yet: nothing to ack
    std::vector<std::string> settled;
    for (int i = 1; i < 10; ++i) {
        const std::string id = "m-" + std::to_string(i);
        auto done = loop.handle(Delivery{id, 1u}, id, id);
        ASSERT_EQ(done.size(), 1u);
        EXPECT_EQ(done[0].tag, "m-" + std::to_string(i - 1));
        EXPECT_EQ(done[0].outcome.disposition, Disposition::processed) << done[0].outcome.reason;
        EXPECT_EQ(applied(done[0].tag), 1);  // settled means committed
    }
    auto last = loop.flush();
    ASSERT_EQ(last.size(), 1u);
    EXPECT_EQ(last[0].tag, "m-9");
    EXPECT_FALSE(loop.holding());
    // One claim, nine commit + next claim, one commit: 11 round trips for 10 messages (20 with
    // handle()).
    EXPECT_EQ(store().round_trips() - before, 11u);
    EXPECT_EQ(handler.counters().processed, 10u);
}

TEST_F(PipelinedLoopTest, ADuplicateSettlesAtOnceAfterTheHeldMessage) {
    auto handler = incrementing_handler(store());
    ASSERT_EQ(handler.handle(Delivery{"old", 1u}, std::string("old")).disposition,
              Disposition::processed);
    idem::PipelinedLoop<decltype(handler)> loop(handler);
    EXPECT_TRUE(loop.handle(Delivery{"a", 1u}, std::string("a"), "a").empty());
    EXPECT_EQ(tags(loop.handle(Delivery{"old", 2u}, std::string("old"), "old")),
              (std::vector<std::string>{"a:processed", "old:duplicate"}));
    EXPECT_FALSE(loop.holding());
    EXPECT_EQ(applied("old"), 1);
}

// Decided: a refused commit fails its own message only; the next message's fresh lease is
// kept (another id, a valid claim) and its effect runs.
TEST_F(PipelinedLoopTest, AFailedCommitFailsItsMessageAndKeepsTheNextOnesFreshLease) {
    auto handler = incrementing_handler(store());
    idem::PipelinedLoop<decltype(handler)> loop(handler);
    EXPECT_TRUE(loop.handle(Delivery{"n", 1u}, std::string("n"), "n").empty());
    // The held lease is lost behind the loop's back (expired and released by another worker).
    auto record = env_->record(store().claim_key("orders", "n")).value();
    record.state = "free";
    record.token.clear();
    client().exec({"SET", store().claim_key("orders", "n"), record.encode(), "KEEPTTL"});

    auto settled = loop.handle(Delivery{"n+1", 1u}, std::string("n+1"), "n+1");
    ASSERT_EQ(settled.size(), 1u);
    EXPECT_EQ(settled[0].tag, "n");
    EXPECT_EQ(settled[0].outcome.disposition, Disposition::failed);
    EXPECT_EQ(settled[0].outcome.cause, idem::FailureCause::commit_failed);
    EXPECT_FALSE(idem::should_ack(settled[0].outcome));
    EXPECT_EQ(applied("n"), 0);
    EXPECT_TRUE(loop.holding());  // n+1 claimed with the failed commit, effect run, held
    EXPECT_EQ(store().find_claim("orders", "n+1")->disposition, Disposition::in_progress);
    EXPECT_EQ(tags(loop.flush()), std::vector<std::string>{"n+1:processed"});
    // The broker redelivers n: applied once.
    EXPECT_EQ(tags(loop.handle(Delivery{"n", 2u}, std::string("n"), "n")),
              std::vector<std::string>{});
    EXPECT_EQ(tags(loop.flush()), std::vector<std::string>{"n:processed"});
    EXPECT_EQ(applied("n"), 1);
    EXPECT_EQ(applied("n+1"), 1);
}

// The round trip itself fails (the server dropped the connection): both outcomes are unknown,
// both `failed`, nothing acked; the redeliveries apply each once.
TEST_F(PipelinedLoopTest, ADroppedConnectionFailsBothAndTheRedeliveriesApplyEachOnce) {
    auto handler = incrementing_handler(store());
    idem::PipelinedLoop<decltype(handler)> loop(handler);
    EXPECT_TRUE(loop.handle(Delivery{"x", 1u}, std::string("x"), "x").empty());
    client().exec({"CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"});
    auto settled = loop.handle(Delivery{"y", 1u}, std::string("y"), "y");
    EXPECT_EQ(tags(settled), (std::vector<std::string>{"x:failed", "y:failed"}));
    EXPECT_FALSE(loop.holding());
    for (const char* id : {"x", "y"}) {
        auto again = loop.handle(Delivery{id, 2u}, std::string(id), id);
        for (const auto& s : again)
            EXPECT_EQ(s.outcome.disposition, Disposition::processed) << s.outcome.reason;
    }
    EXPECT_EQ(tags(loop.flush()), std::vector<std::string>{"y:processed"});
    EXPECT_EQ(applied("x"), 1);
    EXPECT_EQ(applied("y"), 1);
}

// The connection drops after the server ran the commit and the next claim, before their
// replies: the next message's lease is released at once (a new connection), and the attempt
// its claim counted is taken back, since its effect never started. Its redelivery then counts
// one effect start, not two, and does not wait out a dead lease.
TEST_F(PipelinedLoopTest, ALostRoundTripReleasesTheNextLeaseAndTakesItsAttemptBack) {
    int claims = 0;  // the claim of "x" goes through; the one sent with x's commit is cut off
    auto proxy = idem_test::RefusingProxy::dropping(
        store().endpoint().host, store().endpoint().port,
        [&claims](const std::vector<std::string>& args) {
            return idem_test::is_set_nx_get(args) && ++claims == 2;
        });
    idem::RedisEndpoint through_proxy = store().endpoint();
    through_proxy.port = proxy->port();
    idem::RedisOptions options;
    options.lease = std::chrono::seconds(30);  // a lease left behind would block y for 30 s
    idem::RedisStore proxied{through_proxy, options};
    auto handler = incrementing_handler(proxied);
    idem::PipelinedLoop<decltype(handler)> loop(handler);
    EXPECT_TRUE(loop.handle(Delivery{"x", 1u}, std::string("x"), "x").empty());
    auto settled = loop.handle(Delivery{"y", 1u}, std::string("y"), "y");
    EXPECT_EQ(tags(settled), (std::vector<std::string>{"x:failed", "y:failed"}));
    EXPECT_EQ(proxy->refused(), 1);
    EXPECT_EQ(applied("x"), 1);  // the server ran x's commit: its redelivery is a duplicate
    EXPECT_EQ(applied("y"), 0);
    EXPECT_FALSE(proxied.find_claim("orders", "y").has_value());  // released, not leased
    EXPECT_EQ(proxied.attempts("orders", "y"), 0u);               // no effect started

    EXPECT_EQ(tags(loop.handle(Delivery{"y", 2u}, std::string("y"), "y")),
              std::vector<std::string>{});
    EXPECT_EQ(tags(loop.flush()), std::vector<std::string>{"y:processed"});
    EXPECT_EQ(proxied.attempts("orders", "y"), 1u);
    EXPECT_EQ(applied("y"), 1);
    EXPECT_EQ(handler.handle(Delivery{"x", 2u}, std::string("x")).disposition,
              Disposition::duplicate);
}

// The previous message's outcome reaches the observer once the next one's attempt has run: a
// worker that dies in the observer then holds no claim whose effect has not started.
TEST_F(PipelinedLoopTest, ThePreviousOutcomeIsReportedAfterTheNextAttemptRan) {
    struct Order final : idem::Observer {
        std::vector<std::string>* events;
        void on_outcome(std::string_view, const Delivery& d, const idem::Outcome& o) override {
            events->push_back("report " + d.message_id + " " +
                              std::string(idem::to_string(o.disposition)));
        }
    };
    std::vector<std::string> events;
    Order observer;
    observer.events = &events;
    auto handler = idem::make_handler(
        store(), idem::Policy{"orders"},
        [&events](auto& tx, const std::string& id) {
            events.push_back("effect " + id);
            tx.write("HINCRBY", "applied", id, 1);
        },
        &observer);
    idem::PipelinedLoop<decltype(handler)> loop(handler);
    EXPECT_TRUE(loop.handle(Delivery{"a", 1u}, std::string("a"), "a").empty());
    EXPECT_EQ(tags(loop.handle(Delivery{"b", 1u}, std::string("b"), "b")),
              std::vector<std::string>{"a:processed"});
    EXPECT_EQ(tags(loop.flush()), std::vector<std::string>{"b:processed"});
    EXPECT_EQ(events, (std::vector<std::string>{"effect a", "effect b", "report a processed",
                                                "report b processed"}));
}

// The next id is held by another worker, so its claim needs the claim script: a round trip
// after the commit's. When that one fails, the commit's outcome stands (processed, reported
// so); only the next message fails.
TEST_F(PipelinedLoopTest, AFailedContestedClaimAfterTheCommitFailsOnlyTheNextMessage) {
    auto held_elsewhere = store().begin();
    ASSERT_EQ(held_elsewhere.claim("orders", "busy").status, idem::ClaimStatus::claimed);
    bool cut = false;  // the claim script's EVALSHA for "busy" is cut off
    auto proxy = idem_test::RefusingProxy::dropping(
        store().endpoint().host, store().endpoint().port,
        [&cut](const std::vector<std::string>& args) {
            // EVALSHA <sha> <numkeys> <first key> ...: the claim script on busy's record.
            const bool claim_script = args.size() > 3 &&
                                      (args[0] == "EVALSHA" || args[0] == "EVAL") &&
                                      args[3].find("busy") != std::string::npos;
            if (!claim_script || cut) return false;
            cut = true;
            return true;
        });
    idem::RedisEndpoint through_proxy = store().endpoint();
    through_proxy.port = proxy->port();
    idem::RedisStore proxied{through_proxy};
    proxied.warm_up();
    idem::CountingObserver counting;
    auto handler = idem::make_handler(
        proxied, idem::Policy{"orders"},
        [](auto& tx, const std::string& id) { tx.write("HINCRBY", "applied", id, 1); }, &counting);
    idem::PipelinedLoop<decltype(handler)> loop(handler);
    EXPECT_TRUE(loop.handle(Delivery{"p", 1u}, std::string("p"), "p").empty());
    auto settled = loop.handle(Delivery{"busy", 1u}, std::string("busy"), "busy");
    EXPECT_EQ(tags(settled), (std::vector<std::string>{"p:processed", "busy:failed"}));
    EXPECT_EQ(proxy->refused(), 1);
    EXPECT_EQ(applied("p"), 1);
    EXPECT_EQ(counting.counters("orders").processed, 1u);
    EXPECT_EQ(counting.counters("orders").failed, 1u);
}

TEST_F(PipelinedLoopTest, TheStreamAckGoesWithTheCommitAndALoopDroppedHoldingReleasesIt) {
    client().exec({"XGROUP", "CREATE", "orders", "g", "0", "MKSTREAM"});
    const std::string entry = client().str({"XADD", "orders", "*", "id", "s-1"}).value();
    client().exec({"XREADGROUP", "GROUP", "g", "c", "STREAMS", "orders", ">"});
    auto handler = incrementing_handler(store());
    {
        idem::PipelinedLoop<decltype(handler)> loop(handler);
        idem::CommitHook hook{idem::redis::StreamAck{store().endpoint(), "orders", "g", entry}};
        EXPECT_TRUE(loop.handle(Delivery{"s-1", 1u}, std::string("s-1"), entry, hook).empty());
        auto settled = loop.flush();
        ASSERT_EQ(settled.size(), 1u);
        EXPECT_TRUE(settled[0].acked_in_commit);
        EXPECT_EQ(client().integer({"XACK", "orders", "g", entry}), 0);  // acked already
        EXPECT_TRUE(loop.handle(Delivery{"s-2", 1u}, std::string("s-2"), "s-2").empty());
    }  // dropped while holding s-2: rolled back, not committed
    EXPECT_FALSE(store().find_claim("orders", "s-2").has_value());
    EXPECT_EQ(applied("s-2"), 0);
}

// A local effect takes the handler's one-step path by default: each message is settled by the
// call that handled it (nothing held), in ONE round trip, and its claim record says it was
// claimed and committed by one script (no pipelined SET). LocalEffectPath::pipelined keeps the
// two-step path: held, then committed with the next claim.
TEST_F(PipelinedLoopTest, ALocalEffectTakesTheOneStepPathUnlessAskedToPipeline) {
    auto handler = idem::make_handler(store(), idem::Policy{"orders"},
                                      idem::local_effect([](auto& tx, const std::string& id) {
                                          tx.write("HINCRBY", "applied", id, 1);
                                      }));
    {
        auto loop = idem::pipelined_loop(handler);
        static_assert(decltype(loop)::one_step_effect);
        EXPECT_TRUE(loop.takes_one_step());
        client().exec({"XGROUP", "CREATE", "local", "g", "0", "MKSTREAM"});
        const std::string entry = client().str({"XADD", "local", "*", "id", "l-0"}).value();
        client().exec({"XREADGROUP", "GROUP", "g", "c", "STREAMS", "local", ">"});
        const auto before = store().round_trips();
        idem::CommitHook hook{idem::redis::StreamAck{store().endpoint(), "local", "g", entry}};
        auto first = loop.handle(Delivery{"l-0", 1u}, std::string("l-0"), "l-0", hook);
        ASSERT_EQ(tags(first), std::vector<std::string>{"l-0:processed"});
        EXPECT_TRUE(first[0].acked_in_commit);  // the XACK went with the one script
        EXPECT_FALSE(loop.holding());
        for (int i = 1; i < 10; ++i) {
            const std::string id = "l-" + std::to_string(i);
            EXPECT_EQ(tags(loop.handle(Delivery{id, 1u}, id, id)),
                      std::vector<std::string>{id + ":processed"});
            EXPECT_FALSE(loop.holding());
            EXPECT_EQ(applied(id), 1);  // settled by the call that handled it
        }
        EXPECT_TRUE(loop.flush().empty());
        EXPECT_EQ(store().round_trips() - before, 10u);                 // one script call a message
        EXPECT_EQ(client().integer({"XACK", "local", "g", entry}), 0);  // acked already
        EXPECT_EQ(tags(loop.handle(Delivery{"l-3", 2u}, std::string("l-3"), "l-3")),
                  std::vector<std::string>{"l-3:duplicate"});
        EXPECT_EQ(applied("l-3"), 1);
    }
    auto loop = idem::pipelined_loop(handler, idem::LocalEffectPath::pipelined);
    EXPECT_FALSE(loop.takes_one_step());
    const auto before = store().round_trips();
    EXPECT_TRUE(loop.handle(Delivery{"p-0", 1u}, std::string("p-0"), "p-0").empty());
    EXPECT_TRUE(loop.holding());  // the two-step path: held until the next claim
    EXPECT_EQ(applied("p-0"), 0);
    EXPECT_EQ(tags(loop.handle(Delivery{"p-1", 1u}, std::string("p-1"), "p-1")),
              std::vector<std::string>{"p-0:processed"});
    EXPECT_EQ(tags(loop.flush()), std::vector<std::string>{"p-1:processed"});
    EXPECT_EQ(store().round_trips() - before, 3u);  // claim, commit + claim, commit
    EXPECT_EQ(applied("p-0"), 1);
    EXPECT_EQ(applied("p-1"), 1);
}

// A broker without a count (DeliveryCounter::store): the loop hands such a delivery to the
// handler's own path, which counts its attempt (AttemptRunner::counted) and settles it at once,
// so an effect that fails every time is parked at the poison limit as with handle().
TEST_F(PipelinedLoopTest, AStoreCountedDeliveryTakesTheHandlersPathAndMeetsThePoisonLimit) {
    idem::PolicyOptions options;
    options.max_deliveries = 3;
    int runs = 0;
    auto handler = idem::make_handler(store(), idem::Policy{"orders", options},
                                      [&](auto& tx, const std::string& id) {
                                          ++runs;
                                          if (id == "bad") throw std::runtime_error("gateway away");
                                          tx.write("HINCRBY", "applied", id, 1);
                                      });
    idem::PipelinedLoop<decltype(handler)> loop(handler);
    EXPECT_TRUE(loop.handle(Delivery{"good", 1u}, std::string("good"), "good").empty());
    EXPECT_TRUE(loop.holding());  // a broker-counted delivery is pipelined
    Delivery bad{"bad", 1u};
    bad.counted_by = idem::DeliveryCounter::store;
    // The held commit goes first, then the store-counted delivery settles in the same call.
    EXPECT_EQ(tags(loop.handle(bad, std::string("bad"), "bad")),
              (std::vector<std::string>{"good:processed", "bad:failed"}));
    EXPECT_FALSE(loop.holding());
    EXPECT_EQ(tags(loop.handle(bad, std::string("bad"), "bad")),
              std::vector<std::string>{"bad:failed"});
    const auto parked = loop.handle(bad, std::string("bad"), "bad");
    ASSERT_EQ(tags(parked), std::vector<std::string>{"bad:dead_lettered"});
    EXPECT_NE(parked[0].outcome.reason.find("attempt 3"), std::string::npos)
        << parked[0].outcome.reason;
    EXPECT_EQ(runs, 3);  // good once, bad twice: the third attempt is parked without running
    EXPECT_EQ(applied("good"), 1);
    EXPECT_EQ(applied("bad"), 0);
}

TEST(PipelinedLoopOnOtherStores, SettlesEachMessageAtOnce) {
    idem::MemoryStore store;
    auto handler =
        idem::make_handler(store, idem::Policy{"orders"},
                           [](auto& tx, const std::string& id) { tx.put("applied", id, "1"); });
    auto loop = idem::pipelined_loop(handler);
    static_assert(!decltype(loop)::pipelines);
    EXPECT_EQ(tags(loop.handle(Delivery{"a", 1u}, std::string("a"), "a")),
              std::vector<std::string>{"a:processed"});
    EXPECT_EQ(tags(loop.handle(Delivery{"a", 2u}, std::string("a"), "a")),
              std::vector<std::string>{"a:duplicate"});
    EXPECT_TRUE(loop.flush().empty());
    EXPECT_EQ(store.count("applied"), 1u);
}

}  // namespace
