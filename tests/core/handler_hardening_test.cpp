// Hardening of the handler's values (issue 11): why an outcome failed (FailureCause), the
// circuit breaker a consumer loop pauses with, a count of 0 given one outcome, checked delivery
// counts, a movable handler, a printable Disposition.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "idem/broker/circuit_breaker.hpp"
#include "idem/idem.hpp"
#include "idem/store/memory.hpp"

namespace {

using namespace std::chrono_literals;
using idem::Delivery;
using idem::DeliveryCount;
using idem::Disposition;
using idem::FailureCause;

// ---------------------------------------------------------------------------------------------
// FailureCause: every failed path says why, as a value

class Causes : public ::testing::Test {
  protected:
    idem::MemoryStore store;
    int runs = 0;
    bool throw_in_effect = false;
    auto handler() {
        return idem::make_handler(store, idem::Policy{"capture"},
                                  [this](auto& tx, const std::string& body) {
                                      ++runs;
                                      if (throw_in_effect) throw std::runtime_error("gateway 502");
                                      tx.put("captures", body, "done");
                                  });
    }
};

TEST_F(Causes, BeginFailureIsStoreUnavailable) {
    auto h = handler();
    store.inject(idem::Fault::begin);
    const auto outcome = h.handle(Delivery{"m-1", 1u}, std::string("o-1"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_EQ(outcome.cause, FailureCause::store_unavailable);
    EXPECT_TRUE(outcome.store_unreachable());
    EXPECT_TRUE(outcome.store_unreachable());
    EXPECT_EQ(runs, 0);
}

TEST_F(Causes, ClaimFailureIsStoreUnavailable) {
    auto h = handler();
    store.inject(idem::Fault::claim);
    const auto outcome = h.handle(Delivery{"m-1", 1u}, std::string("o-1"));
    EXPECT_EQ(outcome.cause, FailureCause::store_unavailable);
    EXPECT_TRUE(outcome.store_unreachable());
}

TEST_F(Causes, CommitFailureIsCommitFailedNotUnreachable) {
    auto h = handler();
    store.inject(idem::Fault::commit);
    const auto outcome = h.handle(Delivery{"m-1", 1u}, std::string("o-1"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_EQ(outcome.cause, FailureCause::commit_failed);
    EXPECT_FALSE(outcome.store_unreachable());
}

TEST_F(Causes, EffectThrowingIsEffectThrew) {
    auto h = handler();
    throw_in_effect = true;
    const auto outcome = h.handle(Delivery{"m-1", 1u}, std::string("o-1"));
    EXPECT_EQ(outcome.cause, FailureCause::effect_threw);
    EXPECT_FALSE(outcome.store_unreachable());
}

TEST_F(Causes, NonFailedOutcomesHaveNoCause) {
    auto h = handler();
    EXPECT_EQ(h.handle(Delivery{"m-1", 1u}, std::string("o-1")).cause, FailureCause::none);
    const auto duplicate = h.handle(Delivery{"m-1", 2u}, std::string("o-1"));
    EXPECT_EQ(duplicate.disposition, Disposition::duplicate);
    EXPECT_EQ(duplicate.cause, FailureCause::none);
    EXPECT_EQ(duplicate.recorded, std::optional<Disposition>(Disposition::processed));
    EXPECT_FALSE(duplicate.duplicate_of_dead_letter());
}

TEST_F(Causes, BatchFailuresCarryTheCause) {
    auto h = handler();
    store.inject(idem::Fault::begin);
    const auto outcomes = h.handle_batch(std::vector<Delivery>{{"m-1", 1u}, {"m-2", 1u}},
                                         std::vector<std::string>{"a", "b"});
    ASSERT_EQ(outcomes.size(), 2u);
    for (const auto& outcome : outcomes) {
        EXPECT_EQ(outcome.disposition, Disposition::failed);
        EXPECT_EQ(outcome.cause, FailureCause::store_unavailable) << outcome.reason;
    }
    store.inject(idem::Fault::commit);
    const auto after_commit = h.handle_batch(std::vector<Delivery>{{"m-1", 2u}, {"m-2", 2u}},
                                             std::vector<std::string>{"a", "b"});
    for (const auto& outcome : after_commit)
        EXPECT_EQ(outcome.cause, FailureCause::commit_failed) << outcome.reason;
}

TEST_F(Causes, MalformedDeliveryWithTheStoreDownCarriesTheStoresCause) {
    auto h = handler();
    store.inject(idem::Fault::begin);
    const auto outcome = h.handle(Delivery{"", 1u}, std::string("o"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_EQ(outcome.cause, FailureCause::store_unavailable);
}

TEST(FailureCauseOf, MapsTheStoreErrorClasses) {
    EXPECT_EQ(idem::failure_cause_of(idem::store_unavailable("x")),
              FailureCause::store_unavailable);
    EXPECT_EQ(idem::failure_cause_of(idem::store_timeout("x")), FailureCause::store_timeout);
    EXPECT_EQ(idem::failure_cause_of(idem::commit_failed("x")), FailureCause::commit_failed);
    EXPECT_EQ(idem::failure_cause_of(idem::store_error("x")), FailureCause::store_error);
    EXPECT_EQ(idem::failure_cause_of(std::runtime_error("x")), FailureCause::other);
    idem::Outcome timeout = idem::failed_outcome("busy", FailureCause::store_timeout);
    EXPECT_TRUE(timeout.store_unreachable());
}

// ---------------------------------------------------------------------------------------------
// The poison reason says which count it was and what is known of the effect

TEST(PoisonReason, NamesTheBrokersCountOnAStoreWithoutAttempts) {
    idem::MemoryStore store;
    idem::PolicyOptions options;
    options.max_deliveries = 5;
    int runs = 0;
    auto h = idem::make_handler(store, idem::Policy{"capture", options},
                                [&](auto&, const std::string&) { ++runs; });
    const auto outcome = h.handle(Delivery{"m-1", 7u}, std::string("o"));
    EXPECT_EQ(outcome.disposition, Disposition::dead_lettered);
    EXPECT_NE(outcome.reason.find("delivery count 7 (broker) reached max_deliveries 5"),
              std::string::npos)
        << outcome.reason;
    EXPECT_NE(outcome.reason.find("not run on this delivery; earlier deliveries may have run it"),
              std::string::npos)
        << outcome.reason;
    EXPECT_EQ(outcome.reason.find("without running the effect"), std::string::npos);
    EXPECT_EQ(outcome.reason.find("after it was enqueued"), std::string::npos);  // not known
    EXPECT_EQ(runs, 0);
}

TEST(PoisonReason, SaysHowLongAfterItWasEnqueuedTheLimitWasReached) {
    idem::MemoryStore store;
    idem::PolicyOptions options;
    options.max_deliveries = 3;
    auto h = idem::make_handler(store, idem::Policy{"capture", options},
                                [](auto&, const std::string&) {});
    Delivery delivery{"m-2", 3u};
    delivery.enqueued_at = std::chrono::system_clock::now() - std::chrono::seconds(90);
    const auto outcome = h.handle(delivery, std::string("o"));
    EXPECT_EQ(outcome.disposition, Disposition::dead_lettered);
    EXPECT_NE(outcome.reason.find("reached max_deliveries 3, 90."), std::string::npos)
        << outcome.reason;
    EXPECT_NE(outcome.reason.find(" s after it was enqueued;"), std::string::npos)
        << outcome.reason;
}

// ---------------------------------------------------------------------------------------------
// Count 0: one id, one outcome

TEST(ZeroCount, IsParkedWithItsClaimSoALaterDeliveryIsADuplicate) {
    idem::MemoryStore store;
    int runs = 0;
    auto h = idem::make_handler(store, idem::Policy{"capture"},
                                [&](auto&, const std::string&) { ++runs; });
    const auto zero = h.handle(Delivery{"m-1", 0u}, std::string("o"));
    EXPECT_EQ(zero.disposition, Disposition::dead_lettered);
    EXPECT_NE(zero.reason.find("delivery count 0"), std::string::npos) << zero.reason;
    const auto claim = store.find_claim("capture", "m-1");
    ASSERT_TRUE(claim.has_value());
    EXPECT_EQ(claim->disposition, Disposition::dead_lettered);

    const auto later = h.handle(Delivery{"m-1", 1u}, std::string("o"));
    EXPECT_EQ(later.disposition, Disposition::duplicate);
    EXPECT_EQ(later.recorded, std::optional<Disposition>(Disposition::dead_lettered));
    EXPECT_TRUE(later.duplicate_of_dead_letter());
    EXPECT_EQ(runs, 0);  // never a dead letter AND an effect
    EXPECT_EQ(store.dead_letters().size(), 1u);
}

TEST(ZeroCount, InABatchToo) {
    idem::MemoryStore store;
    int runs = 0;
    auto h = idem::make_handler(store, idem::Policy{"capture"},
                                [&](auto&, const std::string&) { ++runs; });
    const auto first = h.handle_batch(std::vector<Delivery>{{"m-1", 0u}, {"m-2", 1u}},
                                      std::vector<std::string>{"a", "b"});
    EXPECT_EQ(first[0].disposition, Disposition::dead_lettered);
    EXPECT_EQ(first[1].disposition, Disposition::processed);
    const auto again = h.handle(Delivery{"m-1", 2u}, std::string("a"));
    EXPECT_EQ(again.disposition, Disposition::duplicate);
    EXPECT_EQ(runs, 1);
}

TEST(ZeroCount, AZeroCountOfAProcessedIdIsADuplicate) {
    idem::MemoryStore store;
    auto h = idem::make_handler(store, idem::Policy{"capture"}, [](auto&, const std::string&) {});
    EXPECT_EQ(h.handle(Delivery{"m-1", 1u}, std::string("o")).disposition, Disposition::processed);
    EXPECT_EQ(h.handle(Delivery{"m-1", 0u}, std::string("o")).disposition, Disposition::duplicate);
    EXPECT_TRUE(store.dead_letters().empty());
}

// ---------------------------------------------------------------------------------------------
// DeliveryCount: no silent conversion

static_assert(std::is_convertible_v<std::uint32_t, DeliveryCount>);
static_assert(std::is_convertible_v<std::uint16_t, DeliveryCount>);
static_assert(std::is_convertible_v<unsigned, DeliveryCount>);
static_assert(!std::is_convertible_v<int, DeliveryCount>);
static_assert(!std::is_constructible_v<DeliveryCount, int>);
static_assert(!std::is_constructible_v<DeliveryCount, long long>);
static_assert(!std::is_constructible_v<DeliveryCount, std::uint64_t>);
static_assert(!std::is_constructible_v<DeliveryCount, double>);
static_assert(!std::is_constructible_v<DeliveryCount, bool>);
template <class T, class = void>
struct delivery_takes : std::false_type {};
template <class T>
struct delivery_takes<T, std::void_t<decltype(Delivery{std::string(), std::declval<T>()})>>
    : std::true_type {};
static_assert(delivery_takes<std::uint32_t>::value);  // Delivery{msg.id(), msg.delivery_count()}
static_assert(!delivery_takes<int>::value);
static_assert(!delivery_takes<std::int64_t>::value);
static_assert(!delivery_takes<std::uint64_t>::value);

TEST(DeliveryCountFrom, AcceptsTheRangeAndRefusesWhatWouldWrap) {
    EXPECT_EQ(DeliveryCount::from(3).value(), 3u);
    EXPECT_EQ(DeliveryCount::from(0LL).value(), 0u);
    EXPECT_EQ(DeliveryCount::from(std::int64_t{UINT32_MAX}).value(), UINT32_MAX);
    EXPECT_EQ(DeliveryCount::from(std::uint64_t{42}).value(), 42u);
    try {
        (void)DeliveryCount::from(-1);
        FAIL() << "-1 must be refused";
    } catch (const idem::usage_error& e) {
        EXPECT_NE(std::string(e.what()).find("DeliveryCount::from(-1)"), std::string::npos)
            << e.what();
        EXPECT_NE(std::string(e.what()).find("negative"), std::string::npos) << e.what();
    }
    try {
        (void)DeliveryCount::from(std::uint64_t{1} << 32 | 1u);
        FAIL() << "2^32 + 1 must be refused";
    } catch (const idem::usage_error& e) {
        EXPECT_NE(std::string(e.what()).find("4294967297"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("at most 4294967295"), std::string::npos) << e.what();
    }
    EXPECT_THROW((void)DeliveryCount::from(std::numeric_limits<long long>::min()),
                 idem::usage_error);
    EXPECT_THROW((void)DeliveryCount::from(std::numeric_limits<std::int64_t>::max()),
                 idem::usage_error);
    const long long from_a_driver = 2;
    Delivery delivery{"m-1", DeliveryCount::from(from_a_driver)};
    EXPECT_EQ(delivery.delivery_count.value(), 2u);
}

// ---------------------------------------------------------------------------------------------
// A handler is movable, its counters with it

TEST(MovableHandler, LivesInAVectorAndKeepsItsCounters) {
    idem::MemoryStore store;
    int runs = 0;
    auto effect = [&runs](auto& tx, const std::string& body) {
        ++runs;
        tx.put("captures", body, "done");
    };
    using Handler = idem::IdempotentHandler<idem::MemoryStore, decltype(effect)>;
    static_assert(std::is_nothrow_move_constructible_v<Handler> ||
                  std::is_move_constructible_v<Handler>);
    static_assert(!std::is_copy_constructible_v<Handler>);

    std::vector<Handler> handlers;
    handlers.emplace_back(store, idem::Policy{"capture"}, effect);
    EXPECT_EQ(handlers[0].handle(Delivery{"m-1", 1u}, std::string("o-1")).disposition,
              Disposition::processed);

    Handler second = idem::make_handler(store, idem::Policy{"refund"}, effect);
    EXPECT_EQ(second.handle(Delivery{"r-1", 1u}, std::string("r-1")).disposition,
              Disposition::processed);
    handlers.push_back(std::move(second));  // may reallocate: handlers[0] moves too
    for (int i = 0; i < 8; ++i)
        handlers.emplace_back(store, idem::Policy{fmt::format("scope-{}", i)}, effect);

    EXPECT_EQ(handlers[0].policy().scope(), "capture");
    EXPECT_EQ(handlers[0].counters().processed, 1u);
    EXPECT_EQ(handlers[1].policy().scope(), "refund");
    EXPECT_EQ(handlers[1].counters().processed, 1u);
    EXPECT_EQ(handlers[0].handle(Delivery{"m-1", 2u}, std::string("o-1")).disposition,
              Disposition::duplicate);
    EXPECT_EQ(handlers[0].counters().duplicates, 1u);
    EXPECT_EQ(handlers[0].counters().deliveries, 2u);
    EXPECT_EQ(handlers[1].handle(Delivery{"r-2", 1u}, std::string("r-2")).disposition,
              Disposition::processed);
    EXPECT_EQ(handlers[1].counters().processed, 2u);

    Handler assigned = idem::make_handler(store, idem::Policy{"other"}, effect);
    assigned = std::move(handlers[1]);
    EXPECT_EQ(assigned.policy().scope(), "refund");
    EXPECT_EQ(assigned.counters().processed, 2u);
    EXPECT_EQ(assigned.handle(Delivery{"r-2", 2u}, std::string("r-2")).disposition,
              Disposition::duplicate);
    EXPECT_EQ(runs, 3);
}

// ---------------------------------------------------------------------------------------------
// Disposition prints

TEST(DispositionPrints, WithGtestStreamsAndFmt) {
    EXPECT_EQ(::testing::PrintToString(Disposition::dead_lettered), "dead_lettered");
    std::ostringstream out;
    out << Disposition::in_progress << ' ' << FailureCause::store_timeout;
    EXPECT_EQ(out.str(), "in_progress store_timeout");
    EXPECT_EQ(fmt::format("{}", Disposition::processed), "processed");
    EXPECT_EQ(fmt::format("[{:>10}]", Disposition::failed), "[    failed]");
    EXPECT_EQ(fmt::format("{}", FailureCause::store_unavailable), "store_unavailable");
}

// ---------------------------------------------------------------------------------------------
// CircuitBreaker, with an injected sleep and random source

struct FakeTime {
    std::vector<std::chrono::milliseconds> sleeps;
    double random = 0.0;
};

TEST(CircuitBreaker, BackoffDoublesToTheBoundAndResetsAfterASuccessfulProbe) {
    FakeTime time;
    int failing_probes = 3;
    int probes = 0;
    idem::CircuitBreakerOptions options;
    options.initial_backoff = 100ms;
    options.max_backoff = 300ms;
    options.jitter = 0.0;
    idem::CircuitBreaker breaker{options,
                                 [&] {
                                     ++probes;
                                     if (failing_probes-- > 0)
                                         throw idem::store_unavailable("down");
                                 },
                                 [&](std::chrono::milliseconds d) { time.sleeps.push_back(d); },
                                 [&] { return time.random; }};
    EXPECT_FALSE(breaker.is_open());
    EXPECT_TRUE(breaker.trips_on(idem::failed_outcome("x", FailureCause::store_timeout)));
    EXPECT_FALSE(breaker.trips_on(idem::failed_outcome("x", FailureCause::effect_threw)));
    EXPECT_FALSE(breaker.trips_on(idem::Outcome{Disposition::processed, {}}));

    breaker.open();
    breaker.open();  // already open: counted once
    EXPECT_TRUE(breaker.is_open());
    EXPECT_TRUE(breaker.wait_until_closed([] { return false; }));
    EXPECT_FALSE(breaker.is_open());
    EXPECT_EQ(time.sleeps, (std::vector<std::chrono::milliseconds>{100ms, 200ms, 300ms, 300ms}));
    EXPECT_EQ(probes, 4);
    EXPECT_EQ(breaker.stats().opened, 1u);
    EXPECT_EQ(breaker.stats().probes, 4u);
    EXPECT_EQ(breaker.stats().failed_probes, 3u);
    EXPECT_EQ(breaker.backoff(), 100ms);  // reset after the successful probe

    // Opened again: starts from the initial backoff.
    time.sleeps.clear();
    breaker.open();
    EXPECT_TRUE(breaker.wait_until_closed([] { return false; }));
    EXPECT_EQ(time.sleeps, (std::vector<std::chrono::milliseconds>{100ms}));
    EXPECT_EQ(breaker.stats().opened, 2u);
}

TEST(CircuitBreaker, JitterStaysWithinItsFraction) {
    idem::CircuitBreakerOptions options;
    options.initial_backoff = 1000ms;
    options.max_backoff = 1000ms;
    options.jitter = 0.25;
    double r = 0.0;
    idem::CircuitBreaker breaker{options, [] {}, [](std::chrono::milliseconds) {},
                                 [&] { return r; }};
    breaker.open();
    r = 0.0;
    EXPECT_EQ(breaker.next_wait(), 1000ms);
    r = 0.5;
    EXPECT_EQ(breaker.next_wait(), 875ms);
    r = 0.999999;
    EXPECT_GE(breaker.next_wait(), 750ms);
    r = 7.0;  // a bad random source is clamped
    EXPECT_EQ(breaker.next_wait(), 750ms);

    // The default random source: every wait within [750, 1000] ms.
    idem::CircuitBreaker real{options, [] {}, [](std::chrono::milliseconds) {}};
    real.open();
    for (int i = 0; i < 200; ++i) {
        const auto wait = real.next_wait();
        EXPECT_GE(wait, 750ms);
        EXPECT_LE(wait, 1000ms);
    }
}

TEST(CircuitBreaker, StopEndsTheWaitAndBadOptionsAreRefused) {
    int probes = 0;
    idem::CircuitBreaker breaker{{},
                                 [&] {
                                     ++probes;
                                     throw idem::store_unavailable("down");
                                 },
                                 [](std::chrono::milliseconds) {}};
    breaker.open();
    int checks = 0;
    EXPECT_FALSE(breaker.wait_until_closed([&] { return ++checks > 5; }));
    EXPECT_TRUE(breaker.is_open());
    EXPECT_GE(probes, 2);

    idem::CircuitBreakerOptions bad;
    bad.initial_backoff = 0ms;
    EXPECT_THROW(idem::CircuitBreaker(bad, [] {}), idem::usage_error);
    bad = {};
    bad.max_backoff = 10ms;
    EXPECT_THROW(idem::CircuitBreaker(bad, [] {}), idem::usage_error);
    bad = {};
    bad.jitter = 1.5;
    EXPECT_THROW(idem::CircuitBreaker(bad, [] {}), idem::usage_error);
    EXPECT_THROW(idem::CircuitBreaker({}, idem::CircuitBreaker::Probe{}), idem::usage_error);
}

TEST(CircuitBreaker, WaitsOnTheStopFlagARelayRunsOn) {
    // The std::atomic<bool> Relay::run() takes stops the wait as a callable does.
    std::atomic<bool> stop{false};
    int probes = 0;
    idem::CircuitBreaker breaker{{},
                                 [&] {
                                     if (++probes == 3) stop = true;
                                     throw idem::store_unavailable("down");
                                 },
                                 [](std::chrono::milliseconds) {}};
    breaker.open();
    EXPECT_FALSE(breaker.wait_until_closed(stop));
    EXPECT_EQ(probes, 3);
    EXPECT_TRUE(breaker.is_open());

    idem::CircuitBreaker closing{{}, [] {}, [](std::chrono::milliseconds) {}};
    stop = false;
    closing.open();
    EXPECT_TRUE(closing.wait_until_closed(stop));
    EXPECT_FALSE(closing.is_open());
    const std::atomic<bool> stopped{true};
    closing.open();
    EXPECT_FALSE(closing.wait_until_closed(stopped));
}

TEST(CircuitBreaker, ProbesAnyStoreWithATransaction) {
    idem::MemoryStore store;
    store.inject(idem::Fault::begin);
    EXPECT_THROW(idem::probe_store(store), idem::store_unavailable);
    EXPECT_NO_THROW(idem::probe_store(store));
}

}  // namespace
