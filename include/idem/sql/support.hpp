#pragma once
/// @file
/// @brief The SQL store core's small parts (sql/store.hpp uses them, drivers may too): count
/// columns clamped, the row readers, claim_each() (a correct claim_many() for a driver without
/// a multi-row form), and the traits of a driver's optional members (fork hooks, ping()).

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/contract/records.hpp"
#include "idem/contract/time.hpp"
#include "idem/sql/own_claims.hpp"

IDEM_BEGIN_NAMESPACE
namespace sql {

/// A count column (delivery_count, attempts) as the struct's 32-bit field, clamped.
inline std::uint32_t to_count(std::int64_t value) noexcept {
    if (value < 0) return 0;
    if (value > std::numeric_limits<std::uint32_t>::max()) {
        return std::numeric_limits<std::uint32_t>::max();
    }
    return static_cast<std::uint32_t>(value);
}

/// For statements whose rows are not read.
struct no_rows {
    /// Ignores the row.
    template <class Row>
    void operator()(const Row&) const noexcept {}
};

/// Reads the outbox columns (sql::outbox_columns) of one row.
template <class Row>
OutboxRow read_outbox_row(const Row& row) {
    OutboxRow out;
    out.id = row.int64(0);
    out.destination = row.bytes(1);
    out.idempotency_key = row.bytes(2);
    out.payload = row.bytes(3);
    out.created_at = from_unix_ms(row.int64(4));
    if (!row.is_null(5)) out.sent_at = from_unix_ms(row.int64(5));
    out.attempts = to_count(row.int64(6));
    out.last_error = row.bytes(7);
    out.next_attempt_at = from_unix_ms(row.int64(8));
    out.parked = row.boolean(9);
    if (!row.is_null(10)) out.scope = row.bytes(10);  // NULL: a MySQL row of version 5
    if (!row.is_null(11)) out.message_id = row.bytes(11);
    return out;
}

/// A correct claim_many() for a driver without a multi-row form: claim() per id.
template <class Driver>
std::vector<ClaimResult> claim_each(Driver& driver, OwnClaims& own, std::string_view scope,
                                    const std::vector<std::string_view>& ids,
                                    const std::vector<std::string>& fingerprints,
                                    std::int64_t now_ms) {
    std::vector<ClaimResult> results(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
        const std::string_view fingerprint =
            fingerprints.empty() ? std::string_view() : std::string_view(fingerprints[i]);
        if (const auto* mine = own.find(scope, ids[i])) {
            results[i] = OwnClaims::duplicate_of(*mine);
        } else {
            results[i] = driver.claim(own, scope, ids[i], fingerprint, now_ms);
        }
    }
    return results;
}

/// Whether a driver has the fork hooks of sql/driver.hpp (owns_connection(),
/// reopen_after_fork(), forget_inherited()) and ping(). A driver without them still compiles:
/// its store refuses any use in a fork()ed child, and ping() falls back to begin + rollback.
template <class, class = void>
struct has_fork_hooks : std::false_type {};
template <class D>
struct has_fork_hooks<D, std::void_t<decltype(std::declval<const D&>().owns_connection()),
                                     decltype(std::declval<D&>().reopen_after_fork()),
                                     decltype(std::declval<D&>().forget_inherited())>>
    : std::true_type {};
/// Whether a driver keeps its claims in partitions (PostgreSQL: postgres/partitions.hpp).
template <class, class = void>
struct has_claim_partitions : std::false_type {};
template <class D>
struct has_claim_partitions<
    D, std::void_t<decltype(std::declval<D&>().keep_claim_partitions_ahead(std::int64_t()))>>
    : std::true_type {};
template <class, class = void>
struct has_driver_ping : std::false_type {};
template <class D>
struct has_driver_ping<D, std::void_t<decltype(std::declval<D&>().ping(std::string_view()))>>
    : std::true_type {};

}  // namespace sql
IDEM_END_NAMESPACE
