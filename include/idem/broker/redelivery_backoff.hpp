#pragma once
/// @file
/// @brief RedeliveryBackoff: how long a broker consumer lets a message that was not settled wait
/// before its next delivery, growing with the delivery count, so that the poison limit
/// (PolicyOptions::max_deliveries) spans a time the user chooses instead of max_deliveries ×
/// the visibility timeout. Generic: it knows no broker (each adapter applies it its own way).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string_view>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The delay before delivery n of a message (n ≥ 2): `initial × multiplier^(n−2)`, capped
/// at `max`, less up to `jitter` of it.
///
/// A failure that needs a moment to clear (a dependency refusing for a few seconds, a key "in
/// flight" at a gateway) is then retried a few times over seconds, then less and less often,
/// and a message is parked only after about horizon(max_deliveries) of failing. The defaults
/// (2 s doubling to 5 min) park a message after about 30 s of failing with the default 5
/// deliveries, and after about 13.5 min with 10.
///
/// The jitter is a function of the message id and the count (the same message waits the same
/// time whichever worker looks at it; different messages that failed together spread out).
///
/// @code
/// idem::RedisStreamConsumerOptions options;          // the same field on every adapter
/// options.redelivery_backoff.initial = std::chrono::seconds(5);
/// options.redelivery_backoff.horizon(10);       // 1215 s: ≈ 20 min of failing, then parked
/// @endcode
struct RedeliveryBackoff {
    /// The delay before the second delivery. 0: no backoff (each broker's own redelivery:
    /// the visibility timeout, AckWait, or a RabbitMQ nack with requeue).
    std::chrono::milliseconds initial{2000};
    /// Each further delivery waits this many times longer than the one before (≥ 1).
    double multiplier = 2.0;
    /// No delay is longer than this.
    std::chrono::milliseconds max{std::chrono::minutes(5)};
    /// Each delay is drawn from [delay × (1 − jitter), delay], 0 … 1.
    double jitter = 0.2;

    /// @brief No backoff: every delay is 0 (each broker redelivers on its own clock).
    [[nodiscard]] static RedeliveryBackoff none() noexcept {
        RedeliveryBackoff b;
        b.initial = std::chrono::milliseconds(0);
        return b;
    }

    /// @brief True when delays are 0 (initial 0, as none() sets it).
    [[nodiscard]] bool off() const noexcept { return initial.count() <= 0; }

    /// @brief The delay before delivery @p delivery without jitter: 0 for the first.
    [[nodiscard]] std::chrono::milliseconds nominal_before(std::uint32_t delivery) const noexcept {
        if (delivery <= 1 || off()) return std::chrono::milliseconds(0);
        const double steps = static_cast<double>(delivery - 2);
        const double ms = static_cast<double>(initial.count()) * std::pow(multiplier, steps);
        const double capped = std::min(ms, static_cast<double>(max.count()));
        return std::chrono::milliseconds(static_cast<std::int64_t>(capped));
    }

    /// @brief The delay before delivery @p delivery of the message @p message_id, jitter
    /// included (a pure function of both).
    [[nodiscard]] std::chrono::milliseconds before(std::uint32_t delivery,
                                                   std::string_view message_id) const noexcept {
        const std::chrono::milliseconds nominal = nominal_before(delivery);
        if (nominal.count() == 0 || jitter <= 0.0) return nominal;
        const double cut = std::clamp(jitter, 0.0, 1.0) * unit_of(message_id, delivery);
        return std::chrono::milliseconds(
            static_cast<std::int64_t>(static_cast<double>(nominal.count()) * (1.0 - cut)));
    }

    /// @brief About how long a message fails before it is parked: the delays before deliveries
    /// 2 … @p max_deliveries (the last is the one the poison limit parks), each at least
    /// @p floor (a broker that never redelivers sooner, e.g. a stream's visibility timeout for
    /// an entry nobody settled).
    [[nodiscard]] std::chrono::milliseconds horizon(
        std::uint32_t max_deliveries,
        std::chrono::milliseconds floor = std::chrono::milliseconds(0)) const noexcept {
        std::chrono::milliseconds total{0};
        for (std::uint32_t n = 2; n <= max_deliveries; ++n)
            total += std::max(floor, nominal_before(n));
        return total;
    }

    /// @brief Refuses values that cannot work; @p who names the consumer.
    /// @throws usage_error saying which value and why.
    void validate(std::string_view who) const {
        auto refuse = [&](std::string_view why) {
            throw usage_error(fmt::format("{}: redelivery_backoff: {}", who, why));
        };
        if (initial.count() < 0) refuse("initial is negative (0 turns the backoff off)");
        if (!(multiplier >= 1.0) || !std::isfinite(multiplier)) {
            refuse("multiplier must be a finite number >= 1 (each delay at least the one before)");
        }
        if (!(jitter >= 0.0 && jitter <= 1.0)) refuse("jitter must be within 0 ... 1");
        if (!off() && max < initial) refuse("max is shorter than initial");
    }

  private:
    /// A number in [0, 1) from the id and the count (FNV-1a, then the top 53 bits).
    static double unit_of(std::string_view id, std::uint32_t delivery) noexcept {
        std::uint64_t h = 14695981039346656037ull;
        auto mix = [&h](unsigned char c) {
            h ^= c;
            h *= 1099511628211ull;
        };
        for (char c : id)
            mix(static_cast<unsigned char>(c));
        for (int shift = 0; shift < 32; shift += 8)
            mix(static_cast<unsigned char>((delivery >> shift) & 0xFF));
        h ^= h >> 33;  // FNV's low bits mix poorly: fold the high ones in
        h *= 0xff51afd7ed558ccdull;
        h ^= h >> 33;
        return static_cast<double>(h >> 11) / static_cast<double>(1ull << 53);
    }
};

IDEM_END_NAMESPACE
