#pragma once
/// @file
/// @brief The time a store keeps: idem::Clock, the time source a store stamps claims, dead
/// letters and locks with (replaceable, so a test can move time), and the conversions to and from
/// Unix milliseconds, the one unit every idem store writes times in.

#include <chrono>
#include <cstdint>
#include <functional>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The time source a store stamps claims with; replaceable in tests of retention.
using Clock = std::function<std::chrono::system_clock::time_point()>;

/// @brief Milliseconds since the Unix epoch (sub-millisecond parts are truncated).
[[nodiscard]] inline std::int64_t to_unix_ms(std::chrono::system_clock::time_point tp) noexcept {
    return std::chrono::duration_cast<std::chrono::milliseconds>(tp.time_since_epoch()).count();
}

/// @brief The instant @p ms milliseconds after the Unix epoch: from_unix_ms(to_unix_ms(t)) is t
/// for a millisecond-aligned t. A value beyond what the clock holds (about ±292 years around
/// 1970 with nanosecond ticks; a corrupt or hostile stored time) is clamped to the clock's
/// earliest or latest time point, never wrapped.
[[nodiscard]] inline std::chrono::system_clock::time_point from_unix_ms(std::int64_t ms) noexcept {
    using duration = std::chrono::system_clock::duration;
    constexpr std::int64_t max_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(duration::max()).count();
    constexpr std::int64_t min_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(duration::min()).count();
    if (ms >= max_ms) return std::chrono::system_clock::time_point::max();
    if (ms <= min_ms) return std::chrono::system_clock::time_point::min();
    return std::chrono::system_clock::time_point(
        std::chrono::duration_cast<duration>(std::chrono::milliseconds(ms)));
}

IDEM_END_NAMESPACE
