// idem::RedeliveryBackoff: the delay before each delivery, its jitter, the horizon, refusals.

#include <gtest/gtest.h>

#include <chrono>
#include <set>
#include <string>

#include "idem/broker/redelivery_backoff.hpp"
#include "idem/error.hpp"

namespace {

using namespace std::chrono_literals;
using idem::RedeliveryBackoff;
using ms = std::chrono::milliseconds;

TEST(RedeliveryBackoff, DefaultsDoubleFromTwoSecondsUpToFiveMinutes) {
    const RedeliveryBackoff b;
    EXPECT_EQ(b.nominal_before(0), 0ms);
    EXPECT_EQ(b.nominal_before(1), 0ms);  // the first delivery waits for nothing
    EXPECT_EQ(b.nominal_before(2), 2000ms);
    EXPECT_EQ(b.nominal_before(3), 4000ms);
    EXPECT_EQ(b.nominal_before(4), 8000ms);
    EXPECT_EQ(b.nominal_before(9), 256000ms);
    EXPECT_EQ(b.nominal_before(10), ms(std::chrono::minutes(5)));
    EXPECT_EQ(b.nominal_before(4000000000u), ms(std::chrono::minutes(5)));  // capped, no overflow
}

TEST(RedeliveryBackoff, TheHorizonIsTheSumOfTheDelaysUpToTheParkedDelivery) {
    const RedeliveryBackoff b;
    EXPECT_EQ(b.horizon(1), 0ms);
    EXPECT_EQ(b.horizon(5), 30000ms);    // 2 + 4 + 8 + 16 s: the default max_deliveries
    EXPECT_EQ(b.horizon(10), 810000ms);  // ... + 32 + 64 + 128 + 256 + 300 s
    // A broker that never redelivers sooner than its visibility timeout.
    EXPECT_EQ(b.horizon(3, 5s), 10000ms);  // max(5, 2) + max(5, 4)
    EXPECT_EQ(RedeliveryBackoff::none().horizon(5, 400ms), 1600ms);
}

TEST(RedeliveryBackoff, JitterTakesUpToItsShareOffAndIsAFunctionOfTheMessageAndCount) {
    const RedeliveryBackoff b;  // jitter 0.2
    std::set<long long> seen;
    for (int i = 0; i < 200; ++i) {
        const std::string id = "order-" + std::to_string(i);
        const ms d = b.before(3, id);
        EXPECT_LE(d, 4000ms) << id;
        EXPECT_GE(d, 3200ms) << id;
        EXPECT_EQ(d, b.before(3, id));  // every worker computes the same wait
        seen.insert(d.count());
    }
    EXPECT_GT(seen.size(), 100u);  // messages that failed together spread out
    RedeliveryBackoff exact;
    exact.jitter = 0.0;
    EXPECT_EQ(exact.before(3, "order-1"), 4000ms);
}

TEST(RedeliveryBackoff, NoneIsOff) {
    const RedeliveryBackoff none = RedeliveryBackoff::none();
    EXPECT_TRUE(none.off());
    EXPECT_FALSE(RedeliveryBackoff{}.off());
    EXPECT_EQ(none.before(7, "x"), 0ms);
    EXPECT_NO_THROW(none.validate("test"));
}

TEST(RedeliveryBackoff, ValuesThatCannotWorkAreRefusedWithTheReason) {
    auto refused = [](RedeliveryBackoff b, const std::string& why) {
        try {
            b.validate("idem::RedisStreamConsumer(\"orders\")");
            ADD_FAILURE() << "accepted: " << why;
        } catch (const idem::usage_error& e) {
            EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find("idem::RedisStreamConsumer(\"orders\")"),
                      std::string::npos);
        }
    };
    RedeliveryBackoff b;
    b.initial = -1ms;
    refused(b, "initial is negative");
    b = {};
    b.multiplier = 0.9;
    refused(b, "multiplier must be");
    b = {};
    b.jitter = 1.5;
    refused(b, "jitter must be within");
    b = {};
    b.max = 1s;
    refused(b, "max is shorter than initial");
    EXPECT_NO_THROW(RedeliveryBackoff{}.validate("x"));
}

}  // namespace
