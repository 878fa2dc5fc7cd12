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
/// for a millisecond-aligned t.
[[nodiscard]] inline std::chrono::system_clock::time_point from_unix_ms(std::int64_t ms) noexcept {
    return std::chrono::system_clock::time_point(
        std::chrono::duration_cast<std::chrono::system_clock::duration>(
            std::chrono::milliseconds(ms)));
}

IDEM_END_NAMESPACE
