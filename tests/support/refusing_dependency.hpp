#pragma once
// A dependency that refuses for a while (a gateway answering "in flight", a service restarting),
// for the redelivery-backoff tests of every broker adapter: an effect that records each delivery
// (its count and when it came) and throws until the refusal is over, and the checks that the
// message was not parked and that its deliveries were spaced by the default backoff.

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "idem/broker/redelivery_backoff.hpp"
#include "idem/delivery.hpp"
#include "idem/handler.hpp"
#include "idem/policy.hpp"

namespace idem_test {

class RefusingDependency {
  public:
    using Clock = std::chrono::steady_clock;

    explicit RefusingDependency(std::chrono::milliseconds refusing_for)
        : until_(Clock::now() + refusing_for) {}

    /// An IdempotentHandler on @p store (scope "capture", max_deliveries 4) whose effect calls
    /// this dependency; @p Body is the broker's message type.
    template <class Body, class Store>
    auto handler(Store& store) {
        idem::PolicyOptions policy;
        policy.max_deliveries = 4;
        return idem::make_handler(store, idem::Policy{"capture", policy},
                                  [this](auto&, const Body&, const idem::Delivery& d) { call(d); });
    }

    /// Records the delivery; throws while the dependency refuses.
    void call(const idem::Delivery& delivery) {
        counts_.push_back(delivery.delivery_count.value());
        at_.push_back(Clock::now());
        if (Clock::now() < until_) throw std::runtime_error("gateway: in flight");
    }

    /// Processed at its 2nd or 3rd delivery (0 s, >= 1.6 s, >= 4.8 s: the third is past a 3 s
    /// refusal), each delivery at least the default backoff (less its 20 % jitter) after the one
    /// before.
    void expect_spaced_by_the_default_backoff() const {
        ASSERT_GE(counts_.size(), 2u);
        ASSERT_LE(counts_.size(), 3u);
        for (std::size_t i = 1; i < at_.size(); ++i) {
            EXPECT_EQ(counts_[i], counts_[i - 1] + 1);
            const auto nominal = idem::RedeliveryBackoff{}.nominal_before(counts_[i]);
            EXPECT_GE(at_[i] - at_[i - 1], nominal * 8 / 10) << "delivery " << counts_[i];
        }
    }

    [[nodiscard]] std::size_t deliveries() const noexcept { return counts_.size(); }

  private:
    Clock::time_point until_;
    std::vector<std::uint32_t> counts_;
    std::vector<Clock::time_point> at_;
};

}  // namespace idem_test
