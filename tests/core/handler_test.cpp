// Handler behaviour that does not depend on the store: policy validation, the effect's forms,
// observer and counters, fault injection on the memory store (the failure paths users test).

#include <gtest/gtest.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/store/memory.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;

TEST(Policy, DefaultsAreTheFieldNotesNumbers) {
    idem::Policy policy{"capture-payment"};
    EXPECT_EQ(policy.scope(), "capture-payment");
    EXPECT_EQ(policy.max_deliveries(), 5u);
    EXPECT_EQ(policy.retention(), idem::days(14));
    EXPECT_EQ(policy.redelivery_window(), idem::days(7));
}

TEST(Policy, RetentionNotLongerThanTheWindowIsRefusedWithAReason) {
    idem::PolicyOptions options;
    options.retention = idem::days(7);
    options.redelivery_window = idem::days(7);
    try {
        idem::Policy policy{"capture", options};
        FAIL() << "a 7-day retention against a 7-day window must be refused";
    } catch (const idem::usage_error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("retention"), std::string::npos) << what;
        EXPECT_NE(what.find("redelivery window"), std::string::npos) << what;
        EXPECT_NE(what.find("run the effect again"), std::string::npos) << what;
    }
    options.retention = idem::days(8);
    EXPECT_NO_THROW(idem::Policy("capture", options));
}

TEST(Policy, EmptyScopeAndZeroDeliveriesAreRefused) {
    EXPECT_THROW(idem::Policy(""), idem::usage_error);
    EXPECT_THROW(idem::Policy(std::string(129, 's')), idem::usage_error);
    idem::PolicyOptions options;
    options.max_deliveries = 0;
    EXPECT_THROW(idem::Policy("x", options), idem::usage_error);
    options.max_deliveries = 1;
    options.redelivery_window = std::chrono::seconds(0);
    EXPECT_THROW(idem::Policy("x", options), idem::usage_error);
}

TEST(Policy, GatewayKeyLifetimeMustBePositive) {
    idem::PolicyOptions options;
    options.gateway_key_lifetime = std::chrono::seconds(0);
    EXPECT_THROW(idem::Policy("x", options), idem::usage_error);
    options.gateway_key_lifetime = std::chrono::hours(24);
    EXPECT_EQ(idem::Policy("x", options).gateway_key_lifetime(),
              std::optional<std::chrono::seconds>(std::chrono::hours(24)));
    EXPECT_FALSE(idem::Policy("x").gateway_key_lifetime().has_value());
}

TEST(Disposition, OnlyDurableOutcomesAck) {
    EXPECT_TRUE(idem::should_ack(Disposition::processed));
    EXPECT_TRUE(idem::should_ack(Disposition::duplicate));
    EXPECT_TRUE(idem::should_ack(Disposition::dead_lettered));
    EXPECT_TRUE(idem::should_ack(Disposition::rejected));
    EXPECT_FALSE(idem::should_ack(Disposition::deferred));
    EXPECT_FALSE(idem::should_ack(Disposition::in_progress));
    EXPECT_FALSE(idem::should_ack(Disposition::failed));
    for (auto d : {Disposition::processed, Disposition::duplicate, Disposition::dead_lettered,
                   Disposition::rejected, Disposition::deferred, Disposition::in_progress,
                   Disposition::failed}) {
        Disposition parsed{};
        ASSERT_TRUE(idem::from_string(idem::to_string(d), parsed));
        EXPECT_EQ(parsed, d);
    }
    Disposition unused{};
    EXPECT_FALSE(idem::from_string("acked", unused));
}

class MemoryHandler : public ::testing::Test {
  protected:
    idem::MemoryStore store;
    int runs = 0;
    auto counting_handler(idem::Observer* observer = nullptr) {
        return idem::make_handler(
            store, idem::Policy{"capture"},
            [this](auto& tx, const std::string& body) {
                ++runs;
                tx.put("captures", body, "done");
            },
            observer);
    }
};

TEST_F(MemoryHandler, BeginFailureIsFailedNotAcked) {
    auto handler = counting_handler();
    store.inject(idem::Fault::begin);
    auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("o-1"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_FALSE(idem::should_ack(outcome));
    EXPECT_NE(outcome.reason.find("injected"), std::string::npos) << outcome.reason;
    EXPECT_EQ(runs, 0);
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("o-1")).disposition,
              Disposition::processed);
}

TEST_F(MemoryHandler, ClaimFailureIsFailedAndNothingIsStored) {
    auto handler = counting_handler();
    store.inject(idem::Fault::claim);
    EXPECT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("o-1")).disposition,
              Disposition::failed);
    EXPECT_EQ(store.claim_count(), 0u);
    EXPECT_EQ(runs, 0);
}

TEST_F(MemoryHandler, CommitFailureRollsBackTheEffectsWrites) {
    auto handler = counting_handler();
    store.inject(idem::Fault::commit);
    auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("o-1"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_EQ(runs, 1);                      // the effect ran ...
    EXPECT_EQ(store.count("captures"), 0u);  // ... and its write is gone with the claim
    EXPECT_EQ(store.claim_count(), 0u);
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("o-1")).disposition,
              Disposition::processed);
    EXPECT_EQ(store.count("captures"), 1u);
}

TEST_F(MemoryHandler, FaultsCountDown) {
    auto handler = counting_handler();
    store.inject(idem::Fault::commit, 2);
    EXPECT_EQ(handler.handle(Delivery{"m", 1u}, std::string("o")).disposition, Disposition::failed);
    EXPECT_EQ(handler.handle(Delivery{"m", 2u}, std::string("o")).disposition, Disposition::failed);
    EXPECT_EQ(handler.handle(Delivery{"m", 3u}, std::string("o")).disposition,
              Disposition::processed);
}

TEST_F(MemoryHandler, MalformedDeliveryWithStoreDownIsFailedSoNothingIsLost) {
    auto handler = counting_handler();
    store.inject(idem::Fault::begin);
    auto outcome = handler.handle(Delivery{"", 1u}, std::string("body"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);  // not acked: the broker keeps it
    EXPECT_NE(outcome.reason.find("empty message id"), std::string::npos);
    EXPECT_TRUE(store.dead_letters().empty());
}

struct RecordingObserver : idem::Observer {
    std::vector<std::pair<std::string, idem::Outcome>> seen;
    void on_outcome(std::string_view scope, const Delivery&, const idem::Outcome& o) override {
        seen.emplace_back(std::string(scope), o);
    }
};

TEST_F(MemoryHandler, ObserverSeesEveryOutcomeWithItsReason) {
    RecordingObserver observer;
    auto handler = counting_handler(&observer);
    (void)handler.handle(Delivery{"m-1", 1u}, std::string("o"));
    (void)handler.handle(Delivery{"m-1", 2u}, std::string("o"));
    (void)handler.handle(Delivery{"m-2", 5u}, std::string("o"));
    ASSERT_EQ(observer.seen.size(), 3u);
    EXPECT_EQ(observer.seen[0].first, "capture");
    EXPECT_EQ(observer.seen[0].second.disposition, Disposition::processed);
    EXPECT_EQ(observer.seen[1].second.disposition, Disposition::duplicate);
    EXPECT_EQ(observer.seen[2].second.disposition, Disposition::dead_lettered);
    EXPECT_FALSE(observer.seen[2].second.reason.empty());
}

struct ThrowingObserver : idem::Observer {
    void on_outcome(std::string_view, const Delivery&, const idem::Outcome&) override {
        throw std::runtime_error("metrics backend down");
    }
};

TEST_F(MemoryHandler, ThrowingObserverDoesNotChangeTheOutcome) {
    ThrowingObserver observer;
    auto handler = counting_handler(&observer);
    EXPECT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("o")).disposition,
              Disposition::processed);
}

struct TimingObserver : idem::Observer {
    std::vector<std::chrono::nanoseconds> timed;
    int untimed = 0;
    void on_outcome(std::string_view, const Delivery&, const idem::Outcome&) override { ++untimed; }
    void on_timed_outcome(std::string_view, const Delivery&, const idem::Outcome&,
                          std::chrono::nanoseconds handled_in) override {
        timed.push_back(handled_in);
    }
};

TEST_F(MemoryHandler, ObserverIsToldHowLongHandleTook) {
    TimingObserver observer;
    auto handler = idem::make_handler(
        store, idem::Policy{"capture"},
        [](auto&, const std::string&) {
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        },
        &observer);
    (void)handler.handle(Delivery{"m-1", 1u}, std::string("o"));
    (void)handler.handle_batch(std::vector<Delivery>{{"m-2", 1u}, {"m-3", 1u}},
                               std::vector<std::string>{"o", "o"});
    ASSERT_EQ(observer.timed.size(), 3u);
    EXPECT_EQ(observer.untimed, 0);
    EXPECT_GE(observer.timed[0], std::chrono::milliseconds(5));
    EXPECT_LT(observer.timed[0], std::chrono::seconds(10));
    // A batch's messages share its time: each gets its share, at least one effect's sleep.
    EXPECT_GE(observer.timed[1], std::chrono::milliseconds(5));
    EXPECT_EQ(observer.timed[1], observer.timed[2]);
}

TEST_F(MemoryHandler, AnObserverWithoutTimingStillSeesEveryOutcome) {
    RecordingObserver observer;  // overrides on_outcome() only: the default forwards to it
    auto handler = counting_handler(&observer);
    (void)handler.handle(Delivery{"m-1", 1u}, std::string("o"));
    (void)handler.handle_batch(std::vector<Delivery>{{"m-2", 1u}}, std::vector<std::string>{"o"});
    EXPECT_EQ(observer.seen.size(), 2u);
}

TEST_F(MemoryHandler, CountersPerScope) {
    idem::CountingObserver metrics;
    auto capture = counting_handler(&metrics);
    auto refund = idem::make_handler(
        store, idem::Policy{"refund"},
        [](auto&, const std::string&) { return idem::EffectResult::deferred("not captured"); },
        &metrics);
    (void)capture.handle(Delivery{"a", 1u}, std::string("o"));
    (void)capture.handle(Delivery{"a", 2u}, std::string("o"));
    (void)capture.handle(Delivery{"b", 3u}, std::string("o"));
    (void)capture.handle(Delivery{"c", 9u}, std::string("o"));
    store.inject(idem::Fault::begin);
    (void)capture.handle(Delivery{"d", 1u}, std::string("o"));
    (void)refund.handle(Delivery{"a", 1u}, std::string("o"));

    const idem::Counters c = capture.counters();
    EXPECT_EQ(c.deliveries, 5u);
    EXPECT_EQ(c.redeliveries, 3u);
    EXPECT_EQ(c.processed, 2u);
    EXPECT_EQ(c.duplicates, 1u);
    EXPECT_EQ(c.dead_lettered, 1u);
    EXPECT_EQ(c.failed, 1u);
    EXPECT_EQ(c.deferred, 0u);
    const idem::Counters seen = metrics.counters("capture");
    EXPECT_EQ(seen.deliveries, c.deliveries);
    EXPECT_EQ(seen.processed, c.processed);
    EXPECT_EQ(seen.failed, c.failed);
    EXPECT_EQ(metrics.counters("refund").deferred, 1u);
    EXPECT_EQ(metrics.counters("refund").deliveries, 1u);
    EXPECT_EQ(metrics.all().size(), 2u);
    EXPECT_EQ(metrics.counters("never").deliveries, 0u);
}

TEST_F(MemoryHandler, DeferredCarriesTheEffectsRetryDelay) {
    auto handler = idem::make_handler(store, idem::Policy{"x"}, [](auto&, const std::string&) {
        return idem::EffectResult::deferred("waiting for the capture", std::chrono::seconds(30));
    });
    auto outcome = handler.handle(Delivery{"m", 1u}, std::string("o"));
    EXPECT_EQ(outcome.disposition, Disposition::deferred);
    EXPECT_EQ(outcome.retry_after,
              std::optional<std::chrono::milliseconds>(std::chrono::seconds(30)));
    EXPECT_EQ(outcome.reason, "waiting for the capture");
}

TEST_F(MemoryHandler, EffectMayTakeTheDelivery) {
    std::string seen_id;
    std::uint32_t seen_count = 0;
    auto handler = idem::make_handler(store, idem::Policy{"x"},
                                      [&](auto&, const std::string&, const Delivery& d) {
                                          seen_id = d.message_id;
                                          seen_count = d.delivery_count.value();
                                      });
    (void)handler.handle(Delivery{"m-9", 3u}, std::string("o"));
    EXPECT_EQ(seen_id, "m-9");
    EXPECT_EQ(seen_count, 3u);
}

struct CapturePayment {
    long order_id;
    long amount;
};
// A typed message tells dead letters how to keep its bytes.
std::string idem_payload(const CapturePayment& m) {
    return "{\"order_id\":" + std::to_string(m.order_id) +
           ",\"amount\":" + std::to_string(m.amount) + "}";
}

TEST_F(MemoryHandler, TypedMessagesKeepTheirPayloadInDeadLetters) {
    auto handler =
        idem::make_handler(store, idem::Policy{"capture"}, [](auto&, const CapturePayment&) {});
    auto outcome = handler.handle(Delivery{"m-1", 5u}, CapturePayment{8814, 1250});
    EXPECT_EQ(outcome.disposition, Disposition::dead_lettered);
    ASSERT_EQ(store.dead_letters().size(), 1u);
    EXPECT_EQ(store.dead_letters()[0].payload, "{\"order_id\":8814,\"amount\":1250}");
}

TEST_F(MemoryHandler, NonStandardExceptionIsFailed) {
    auto handler =
        idem::make_handler(store, idem::Policy{"x"}, [](auto&, const std::string&) { throw 42; });
    auto outcome = handler.handle(Delivery{"m", 1u}, std::string("o"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_EQ(store.claim_count(), 0u);
}

TEST_F(MemoryHandler, NestedHandleOnTheSameStoreIsAFailureNotADeadlock) {
    auto inner = counting_handler();
    auto outer =
        idem::make_handler(store, idem::Policy{"outer"}, [&](auto&, const std::string& body) {
            auto o = inner.handle(Delivery{"inner", 1u}, body);
            if (o.disposition == Disposition::failed) {
                throw std::runtime_error(o.reason);
            }
        });
    auto outcome = outer.handle(Delivery{"m", 1u}, std::string("o"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_NE(outcome.reason.find("nested"), std::string::npos) << outcome.reason;
}

TEST(MemoryStore, TransactionIsUsableOnlyOnce) {
    idem::MemoryStore store;
    auto tx = store.begin();
    tx.commit();
    EXPECT_THROW(tx.commit(), idem::usage_error);
    EXPECT_THROW((void)tx.claim("s", "id"), idem::usage_error);
}

TEST(MemoryStore, MovedTransactionKeepsTheLockAndTheWork) {
    idem::MemoryStore store;
    {
        auto tx = store.begin();
        (void)tx.claim("s", "id");
        auto moved = std::move(tx);
        moved.put("c", "k", "v");
        moved.commit();
    }
    EXPECT_TRUE(store.find_claim("s", "id").has_value());
    EXPECT_EQ(store.get("c", "k"), std::optional<std::string>("v"));
    // The store is free again.
    auto tx = store.begin();
    EXPECT_TRUE(tx.erase("c", "k"));
    EXPECT_FALSE(tx.get("c", "k").has_value());
}

}  // namespace
