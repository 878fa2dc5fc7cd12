#pragma once
/// @file
/// @brief What the claim partitions of PostgreSQL (postgres/partitions.hpp) and MySQL / MariaDB
/// (mysql/partitions.hpp) share: a partition's range, the UTC stamp in its name, spans aligned
/// to UTC, and the options' checks.

#include <chrono>
#include <cstdint>
#include <ctime>
#include <limits>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"

IDEM_BEGIN_NAMESPACE
namespace sql {

/// One partition of the claims: its name and the claimed_at range [from, to) it holds (from is
/// the lowest int64 for a partition without a lower bound: PostgreSQL's `MINVALUE`, MySQL's
/// first partition).
struct ClaimPartition {
    std::string name;  ///< the partition's name, unquoted
    std::int64_t from = std::numeric_limits<std::int64_t>::min();  ///< first claimed_at in it
    std::int64_t to = std::numeric_limits<std::int64_t>::max();    ///< first one past it
};

/// The UTC minute @p from_ms falls in, as a partition's name writes it: `20261205_0000`.
inline std::string claim_partition_stamp(std::int64_t from_ms) {
    const std::int64_t seconds =
        from_ms >= 0 ? from_ms / 1000 : -((-from_ms + 999) / 1000);  // floor
    const std::time_t t = static_cast<std::time_t>(seconds);
    std::tm utc{};
    ::gmtime_r(&t, &utc);
    return fmt::format("{:04}{:02}{:02}_{:02}{:02}", utc.tm_year + 1900, utc.tm_mon + 1,
                       utc.tm_mday, utc.tm_hour, utc.tm_min);
}

/// The start of the span of @p span_ms (> 0) that holds @p at: spans are aligned to the Unix
/// epoch, so a day's span starts at midnight UTC.
inline std::int64_t align_to_span(std::int64_t at, std::int64_t span_ms) noexcept {
    const std::int64_t q = at / span_ms;
    return (at % span_ms < 0 ? q - 1 : q) * span_ms;
}

/// The span asked for, in milliseconds, after checking @p span and @p ahead (the backend's
/// options claim_partition_span and claim_partitions_ahead). @throws usage_error.
inline std::int64_t checked_partition_span(std::string_view backend, std::chrono::minutes span,
                                           int ahead) {
    if (span.count() < 0)
        throw usage_error(
            fmt::format("idem {}: claim_partition_span must not be negative", backend));
    if (ahead < 1) {
        throw usage_error(
            fmt::format("idem {}: claim_partitions_ahead must be at least 1", backend));
    }
    return std::chrono::duration_cast<std::chrono::milliseconds>(span).count();
}

}  // namespace sql
IDEM_END_NAMESPACE
