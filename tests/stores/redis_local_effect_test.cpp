// Local effects (idem::local_effect) on a real redis-server: the effect runs before the claim
// and its writes go with the claim in ONE script call (claim_and_commit); counted by the
// store's round_trips(). Also: the stream ack riding in that call, the poison limit, two
// processes racing on the same ids, SIGKILL in the crash windows, and the wrapper on a store
// without the one-step path (the ordinary claim → effect → commit).

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "idem/idem.hpp"
#include "idem/store/memory.hpp"
#include "idem/store/redis.hpp"
#include "idem/testing/crash.hpp"
#include "idem/testing/redis_server.hpp"
#include "support/forked_child.hpp"
#include "support/redis_env.hpp"
#include "support/require_redis.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;
using namespace std::chrono_literals;

class RedisLocalEffectTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_REDIS();
        env_ = std::make_unique<idem_test::RedisEnv>();
        store().warm_up();
    }
    idem::RedisStore& store() { return *env_->store; }
    idem::testing::RedisClient& client() { return *env_->client; }
    long long counter(const std::string& key) { return client().integer({"GET", key}).value_or(0); }
    /// A store of its own on the shared server and its clock (another process, after a fork).
    std::unique_ptr<idem::RedisStore> fresh_store() {
        idem::RedisOptions options;
        options.lease = 5s;
        return std::make_unique<idem::RedisStore>(store().endpoint(), options);
    }

    std::unique_ptr<idem_test::RedisEnv> env_;
};

auto counting_handler(idem::RedisStore& store, int& runs, idem::PolicyOptions options = {}) {
    return idem::make_handler(store, idem::Policy{"views", options},
                              idem::local_effect([&runs](auto& tx, const std::string& page) {
                                  ++runs;
                                  tx.write("HINCRBY", "views", page, 1);
                              }));
}

TEST_F(RedisLocalEffectTest, ANewIdCostsOneRoundTripAndARedeliveryOneAndAppliesNothing) {
    static_assert(idem::has_claim_and_commit<idem::RedisStore::Transaction>::value);
    int runs = 0;
    auto handler = counting_handler(store(), runs);
    auto before = store().round_trips();
    auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("home"));
    EXPECT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
    EXPECT_EQ(store().round_trips() - before, 1u);  // claim, writes and completion in one
    EXPECT_EQ(client().integer({"HGET", "views", "home"}), 1);
    auto claim = store().find_claim("views", "m-1");
    ASSERT_TRUE(claim.has_value());
    EXPECT_EQ(claim->disposition, Disposition::processed);
    EXPECT_EQ(store().attempts("views", "m-1"), 1u);

    before = store().round_trips();
    auto again = handler.handle(Delivery{"m-1", 2u}, std::string("home"));
    EXPECT_EQ(again.disposition, Disposition::duplicate);
    EXPECT_EQ(store().round_trips() - before, 1u);
    EXPECT_EQ(runs, 2);  // it ran before the claim was checked; its write was dropped
    EXPECT_EQ(client().integer({"HGET", "views", "home"}), 1);
}

TEST_F(RedisLocalEffectTest, ALiveLeaseAppliesNothingAndAnswersInProgressWithItsTimeLeft) {
    auto holder = store().begin();
    holder.set_terms(idem::ClaimTerms{30s, idem::days(14)});
    ASSERT_EQ(holder.claim("views", "m-1").status, idem::ClaimStatus::claimed);
    env_->now += 10s;
    int runs = 0;
    auto handler = counting_handler(store(), runs);
    auto outcome = handler.handle(Delivery{"m-1", 2u}, std::string("home"));
    EXPECT_EQ(outcome.disposition, Disposition::in_progress);
    EXPECT_EQ(outcome.retry_after, std::optional<std::chrono::milliseconds>(20s));
    EXPECT_FALSE(client().integer({"HGET", "views", "home"}).has_value());
    // The holder gives up (its effect failed): the next delivery takes over, attempt 2.
    holder.rollback();
    EXPECT_EQ(handler.handle(Delivery{"m-1", 3u}, std::string("home")).disposition,
              Disposition::processed);
    EXPECT_EQ(store().attempts("views", "m-1"), 2u);
    EXPECT_EQ(client().integer({"HGET", "views", "home"}), 1);
}

TEST_F(RedisLocalEffectTest, RejectedKeepsTheClaimWithoutTheWritesAndAThrowIsACountedAttempt) {
    int calls = 0;
    auto handler = idem::make_handler(
        store(), idem::Policy{"views"},
        idem::local_effect([&](auto& tx, const std::string& page) -> idem::EffectResult {
            tx.write("HINCRBY", "views", page, 1);
            if (page == "stale") return idem::EffectResult::rejected("stale page");
            if (++calls == 1) throw std::runtime_error("bad input");
            return idem::EffectResult::applied();
        }));
    auto rejected = handler.handle(Delivery{"r-1", 1u}, std::string("stale"));
    EXPECT_EQ(rejected.disposition, Disposition::rejected);
    EXPECT_EQ(store().find_claim("views", "r-1")->disposition, Disposition::rejected);
    EXPECT_FALSE(client().integer({"HGET", "views", "stale"}).has_value());

    store().note_failure("warm-up", "w", "x", std::chrono::seconds(1));  // its script cached
    const auto before = store().round_trips();
    auto failed = handler.handle(Delivery{"t-1", 1u}, std::string("home"));
    EXPECT_EQ(failed.disposition, Disposition::failed);
    EXPECT_EQ(failed.cause, idem::FailureCause::effect_threw);
    // The attempt is counted in one call, then its failure noted in one more.
    EXPECT_EQ(store().round_trips() - before, 2u);
    EXPECT_FALSE(store().find_claim("views", "t-1").has_value());  // free again
    EXPECT_EQ(store().attempts("views", "t-1"), 1u);
    EXPECT_EQ(handler.handle(Delivery{"t-1", 2u}, std::string("home")).disposition,
              Disposition::processed);
    EXPECT_EQ(store().attempts("views", "t-1"), 2u);
    EXPECT_EQ(client().integer({"HGET", "views", "home"}), 1);
}

// A deferral and a malformed message need the claim before their answer (a finished id is a
// duplicate, not deferred; a malformed one is parked with its claim): the ordinary path takes
// them and replays the effect's answer. The effect runs once per delivery, never twice.
TEST_F(RedisLocalEffectTest, ADeferralOrAMalformedMessageRunsTheEffectOnce) {
    int runs = 0;
    bool defer = true;
    auto handler = idem::make_handler(
        store(), idem::Policy{"views"},
        idem::local_effect([&](auto& tx, const std::string& page) -> idem::EffectResult {
            ++runs;
            tx.write("HINCRBY", "views", page, 1);
            if (page == "garbled") throw idem::malformed_message("no page name");
            if (defer) return idem::EffectResult::deferred("catalogue not loaded", 2s);
            return idem::EffectResult::applied();
        }));
    auto deferred = handler.handle(Delivery{"d-1", 1u}, std::string("home"));
    EXPECT_EQ(deferred.disposition, Disposition::deferred) << deferred.reason;
    EXPECT_EQ(deferred.retry_after, std::optional<std::chrono::milliseconds>(2s));
    EXPECT_EQ(runs, 1);
    EXPECT_FALSE(store().find_claim("views", "d-1").has_value());  // nothing kept, not the claim
    EXPECT_FALSE(client().integer({"HGET", "views", "home"}).has_value());

    defer = false;
    EXPECT_EQ(handler.handle(Delivery{"d-1", 2u}, std::string("home")).disposition,
              Disposition::processed);
    EXPECT_EQ(runs, 2);
    defer = true;  // a finished id is a duplicate, whatever the effect answers now
    EXPECT_EQ(handler.handle(Delivery{"d-1", 3u}, std::string("home")).disposition,
              Disposition::duplicate);
    EXPECT_EQ(runs, 3);
    EXPECT_EQ(client().integer({"HGET", "views", "home"}), 1);

    auto malformed = handler.handle(Delivery{"g-1", 1u}, std::string("garbled"));
    EXPECT_EQ(malformed.disposition, Disposition::dead_lettered) << malformed.reason;
    EXPECT_NE(malformed.reason.find("no page name"), std::string::npos) << malformed.reason;
    EXPECT_EQ(runs, 4);
    EXPECT_EQ(store().find_claim("views", "g-1")->disposition, Disposition::dead_lettered);
    ASSERT_EQ(store().dead_letters().size(), 1u);
    EXPECT_EQ(store().dead_letters()[0].payload, "garbled");
    EXPECT_FALSE(client().integer({"HGET", "views", "garbled"}).has_value());
    EXPECT_EQ(handler.handle(Delivery{"g-1", 2u}, std::string("garbled")).disposition,
              Disposition::duplicate);
    EXPECT_EQ(runs, 5);
}

// Redis cannot undo a write: one failing after another was applied parks the claim (as the
// two-step commit does), so the redelivery is a duplicate and the applied write stays single.
TEST_F(RedisLocalEffectTest, AWriteFailingAfterOneWasAppliedParksTheClaim) {
    auto handler = idem::make_handler(store(), idem::Policy{"views"},
                                      idem::local_effect([](auto& tx, const std::string& page) {
                                          tx.write("HINCRBY", "views", page, 1);
                                          tx.write("HSET", "views");  // wrong arity: fails
                                      }));
    auto outcome = handler.handle(Delivery{"w-1", 1u}, std::string("home"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_EQ(outcome.cause, idem::FailureCause::commit_failed);
    EXPECT_EQ(store().find_claim("views", "w-1")->disposition, Disposition::dead_lettered);
    ASSERT_EQ(store().dead_letters().size(), 1u);
    EXPECT_NE(store().dead_letters()[0].reason.find("HSET"), std::string::npos);
    EXPECT_EQ(handler.handle(Delivery{"w-1", 2u}, std::string("home")).disposition,
              Disposition::duplicate);
    EXPECT_EQ(client().integer({"HGET", "views", "home"}), 1);
}

// The lease store's poison check counts effect starts: a delivery whose count reaches the
// limit takes the ordinary path, which parks a body whose attempts reach it before the effect.
TEST_F(RedisLocalEffectTest, AtThePoisonLimitTheEffectNeverRunsAndTheMessageIsParked) {
    idem::PolicyOptions options;
    options.max_deliveries = 3;
    int runs = 0;
    auto handler = counting_handler(store(), runs, options);
    auto two_failed_attempts = [&](const char* id) {
        for (int attempt = 0; attempt < 2; ++attempt) {
            auto tx = store().begin();
            ASSERT_EQ(tx.claim("views", id).status, idem::ClaimStatus::claimed);
        }  // released: the attempt stays counted
        ASSERT_EQ(store().attempts("views", id), 2u);
    };
    two_failed_attempts("p-1");
    auto parked = handler.handle(Delivery{"p-1", 3u}, std::string("home"));
    EXPECT_EQ(parked.disposition, Disposition::dead_lettered) << parked.reason;
    EXPECT_EQ(runs, 0);
    ASSERT_EQ(store().dead_letters().size(), 1u);
    // A broker whose count lags the attempts: the effect runs, the script refuses the takeover
    // that would reach the limit and applies nothing, and the ordinary path parks it.
    two_failed_attempts("p-2");
    auto at_limit = handler.handle(Delivery{"p-2", 2u}, std::string("home"));
    EXPECT_EQ(at_limit.disposition, Disposition::dead_lettered) << at_limit.reason;
    EXPECT_EQ(runs, 1);
    EXPECT_FALSE(client().integer({"HGET", "views", "home"}).has_value());
    EXPECT_EQ(store().dead_letters().size(), 2u);
    // A new id at that count is an attempt 1 on a lease store: processed, as without the mode.
    EXPECT_EQ(handler.handle(Delivery{"p-3", 3u}, std::string("home")).disposition,
              Disposition::processed);
}

TEST_F(RedisLocalEffectTest, TheStreamAckRidesInTheSameCallOnlyWhenItCommits) {
    client().exec({"XGROUP", "CREATE", "orders", "g", "0", "MKSTREAM"});
    std::vector<std::string> entries;
    for (int i = 0; i < 2; ++i) {
        entries.push_back(client().str({"XADD", "orders", "*", "page", "home"}).value());
    }
    client().exec({"XREADGROUP", "GROUP", "g", "c", "COUNT", "10", "STREAMS", "orders", ">"});
    int runs = 0;
    auto handler = counting_handler(store(), runs);
    idem::CommitHook hook{idem::redis::StreamAck{store().endpoint(), "orders", "g", entries[0]}};
    const auto before = store().round_trips();
    auto outcome = handler.handle(Delivery{entries[0], 1u}, std::string("home"), hook);
    EXPECT_EQ(outcome.disposition, Disposition::processed);
    EXPECT_TRUE(hook.acked_in_commit);
    EXPECT_EQ(store().round_trips() - before, 1u);
    // The second entry carries the first one's id (a duplicate): nothing acked in the script.
    idem::CommitHook dup{idem::redis::StreamAck{store().endpoint(), "orders", "g", entries[1]}};
    EXPECT_EQ(handler.handle(Delivery{entries[0], 1u}, std::string("home"), dup).disposition,
              Disposition::duplicate);
    EXPECT_FALSE(dup.acked_in_commit);
    EXPECT_EQ(client().integer({"XACK", "orders", "g", entries[0]}), 0);  // acked already
    EXPECT_EQ(client().integer({"XACK", "orders", "g", entries[1]}), 1);  // the caller's
}

TEST_F(RedisLocalEffectTest, TwoProcessesRacingOnTheSameIdsApplyEachIdsWritesOnce) {
    constexpr int ids = 200;
    auto run = [&](bool backwards) {
        return std::make_unique<idem_test::ForkedChild>([&, backwards](const auto& send) {
            auto own = fresh_store();
            auto handler = idem::make_handler(
                *own, idem::Policy{"race"}, idem::local_effect([](auto& tx, const std::string& id) {
                    tx.write("INCR", "applied:" + id);
                    tx.write("INCR", "applied:total");
                }));
            int processed = 0;
            for (int k = 0; k < ids; ++k) {
                const std::string id = "m-" + std::to_string(backwards ? ids - 1 - k : k);
                auto outcome = handler.handle(Delivery{id, 1u}, id);
                if (outcome.disposition == Disposition::processed) ++processed;
                if (!idem::should_ack(outcome)) send("not acked: " + outcome.reason);
            }
            send("processed " + std::to_string(processed));
        });
    };
    auto a = run(false);
    auto b = run(true);
    int processed = 0;
    for (auto* child : {a.get(), b.get()}) {
        auto line = child->line();
        ASSERT_TRUE(line.has_value());
        ASSERT_EQ(line->rfind("processed ", 0), 0u) << *line;
        processed += std::stoi(line->substr(10));
        EXPECT_EQ(child->wait(), std::optional<int>(0));
    }
    EXPECT_EQ(processed, ids);  // each id processed by exactly one of them
    EXPECT_EQ(counter("applied:total"), ids);
    for (int k = 0; k < ids; ++k)
        ASSERT_EQ(counter("applied:m-" + std::to_string(k)), 1) << k;
}

// Killed before the one call (in the effect) nothing was applied: the redelivery processes it.
// Killed after it, before the ack: the redelivery is a duplicate. Once, either way.
TEST_F(RedisLocalEffectTest, KilledBeforeTheCallOrAfterItBeforeTheAckAppliesOnce) {
    using idem::testing::Window;
    for (Window window : {Window::before_commit, Window::after_commit_before_ack}) {
        const std::string id = "crash-" + std::string(idem::testing::to_string(window));
        auto consume = [&](idem::RedisStore& on, std::uint32_t count) {
            auto handler =
                idem::make_handler(on, idem::Policy{"crash"},
                                   idem::local_effect([&](auto& tx, const std::string& key) {
                                       tx.write("INCR", key);
                                       idem::testing::crash_point(Window::before_commit);
                                   }));
            auto outcome = handler.handle(Delivery{id, count}, "applied:" + id);
            idem::testing::crash_point(Window::after_commit_before_ack);
            return outcome;
        };
        auto result = idem::testing::run_and_kill_at(window, [&] {
            auto own = fresh_store();
            (void)consume(*own, 1u);
        });
        ASSERT_TRUE(result.killed_at_window) << result.message;
        auto restarted = fresh_store();
        auto outcome = consume(*restarted, 2u);
        EXPECT_EQ(outcome.disposition,
                  window == Window::before_commit ? Disposition::processed : Disposition::duplicate)
            << outcome.reason;
        EXPECT_EQ(counter("applied:" + id), 1) << idem::testing::to_string(window);
    }
}

// Without the one-step path (here the memory store) the wrapper is the ordinary pipeline: the
// claim comes first, so a duplicate's effect does not even run.
TEST(LocalEffectOnOtherStores, TakesTheOrdinaryPathClaimThenEffectThenCommit) {
    static_assert(!idem::has_claim_and_commit<idem::MemoryStore::Transaction>::value);
    idem::MemoryStore store;
    int runs = 0;
    auto handler = idem::make_handler(store, idem::Policy{"views"},
                                      idem::local_effect([&](auto& tx, const std::string& page) {
                                          ++runs;
                                          tx.put("views", page, "1");
                                      }));
    EXPECT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("home")).disposition,
              Disposition::processed);
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("home")).disposition,
              Disposition::duplicate);
    EXPECT_EQ(runs, 1);
    EXPECT_EQ(store.count("views"), 1u);
}

}  // namespace

// The effect's exception text reaches the outcome through the policy's redaction hook, as on
// the two-step path: a card number in it is masked.
TEST_F(RedisLocalEffectTest, AnEffectsExceptionTextIsRedactedLikeOnTheTwoStepPath) {
    idem::PolicyOptions options;
    options.redact_payload = idem::mask_card_numbers;
    auto handler =
        idem::make_handler(store(), idem::Policy{"views", options},
                           idem::local_effect([](auto&, const std::string&) -> idem::EffectResult {
                               throw std::runtime_error("gateway declined card 4111111111111111");
                           }));
    const auto outcome = handler.handle(Delivery{"r-1", 1u}, std::string("home"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_EQ(outcome.cause, idem::FailureCause::effect_threw);
    EXPECT_EQ(outcome.reason.find("4111111111111111"), std::string::npos) << outcome.reason;
    EXPECT_NE(outcome.reason.find("************1111"), std::string::npos) << outcome.reason;
}
