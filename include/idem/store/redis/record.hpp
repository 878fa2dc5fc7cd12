#pragma once
/// @file
/// @brief idem::redis::Record: the C++ twin of the claim record the Lua scripts
/// (scripts.hpp) read and write, with its `~<retention>` times; and the lease token. Link
/// idem::redis.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/detail/random.hpp"
#include "idem/redis/reply.hpp"
#include "idem/redis/resp.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

// A claim record is ONE string value, so a script reads it with one GET and writes it, with its
// expiry, with one SET: with AOF on, every write a script makes is propagated and paid for, and
// a hash needed HSET + HDEL + PEXPIRE. Layout: a text header, a newline, then the binary-safe
// fields back to back, their lengths in the header:
//
//   state|token|outcome|attempts|claimed_at|leased_at|lease_ms|#fp|#scope|#id\n fp scope id reason
//
// state: leased, done or free (released: the lease is gone, the attempt count stays). token is
// hex and empty unless leased; outcome a Disposition name and, like the reason, empty unless
// done; the rest decimal. The lease runs from leased_at for lease_ms and means something only
// while the state is leased. Times are milliseconds since the epoch. The claim sets the
// record's expiry (the retention) and a takeover sets it again from now (claimed_at keeps the
// first claim's time); completion and release keep it. Record is the C++ twin.
//
// A new id is claimed without a script: one `SET key record NX PX retention GET` (Redis 7.0+),
// which cannot read the server's clock. Its claimed_at and leased_at say `~<retention>`
// instead: "the record's expiry minus this", which PEXPIRETIME answers exactly (the server set
// the expiry from its clock when the SET ran, and later changes keep it). Whoever reads the
// times (the claim script on a contested id, purge, find_claim) resolves them; a takeover writes
// them out as numbers.
//
// Why this layout: a change of state rewrites the first three fields and keeps the rest (from
// attempts on) as it is, so the scripts only cut and join strings. Lua in Redis pays 1,000 to
// 3,000 instructions for each C call (tonumber, string.match, ...) and ~2,500 for each number
// turned into text, against ~15,000 for a whole EVALSHA that does nothing and ~17,000 for the
// SET of a record: the claim of a new id and a commit format no number (a lease is stored as
// start and length, both already text), and the client sends each new record's fields ready-made.

/// The claim record as stored (layout: the comment above), the C++ twin of the Lua (scripts.hpp):
/// find_claim() and attempts() decode it; tests write one with encode().
struct Record {
    std::string state;    ///< leased, done or free
    std::string token;    ///< empty unless leased
    std::string outcome;  ///< empty unless done
    /// Attempts counted: one per claim or takeover, less those whose effect never started.
    std::uint32_t attempts = 0;
    /// The first claim's time, ms since the epoch.
    std::int64_t claimed_at = 0;
    std::int64_t leased_at = 0;  ///< the lease: from leased_at, lease_ms long (while leased)
    /// The lease's length.
    std::int64_t lease_ms = 0;
    /// Stored with the claim (a takeover stores its own).
    std::string fingerprint;
    /// The policy scope.
    std::string scope;
    /// The message id.
    std::string id;
    std::string reason;  ///< empty unless done
    /// claimed_at and leased_at are "the record's expiry minus this" (`~<ms>` in the record: a
    /// claim made by SET, which cannot read the clock) until resolve() is given the expiry.
    std::optional<std::int64_t> times_before_expiry;

    /// Turns `~<ms>` times into numbers, given the record's PEXPIRETIME.
    void resolve(std::int64_t expiry_ms) {
        if (!times_before_expiry) return;
        claimed_at = saturating_sub(expiry_ms, *times_before_expiry);
        leased_at = claimed_at;
        times_before_expiry.reset();
    }

    /// When the lease ends; 0 when the record is not leased.
    [[nodiscard]] std::int64_t lease_until() const {
        return state == "leased" ? saturating_add(leased_at, lease_ms) : 0;
    }

    /// @p a + @p b, held at the int64 limits: the times of a corrupt record (any decimal) must
    /// not overflow; the result is then meaningless, but defined.
    static std::int64_t saturating_add(std::int64_t a, std::int64_t b) noexcept {
        if (b > 0 && a > INT64_MAX - b) return INT64_MAX;
        if (b < 0 && a < INT64_MIN - b) return INT64_MIN;
        return a + b;
    }
    /// @p a - @p b, held at the int64 limits (as saturating_add()).
    static std::int64_t saturating_sub(std::int64_t a, std::int64_t b) noexcept {
        if (b < 0 && a > INT64_MAX + b) return INT64_MAX;
        if (b > 0 && a < INT64_MIN + b) return INT64_MIN;
        return a - b;
    }

    /// Nothing when @p value is not a claim record.
    static std::optional<Record> decode(std::string_view value) {
        constexpr std::size_t header_fields = 10;
        const std::size_t newline = value.find('\n');
        if (newline == std::string_view::npos) return std::nullopt;
        std::string_view header = value.substr(0, newline);
        std::string_view parts[header_fields];
        for (std::size_t i = 0; i < header_fields; ++i) {
            const std::size_t bar = header.find('|');
            const bool last = i + 1 == header_fields;
            if ((bar == std::string_view::npos) != last) return std::nullopt;
            parts[i] = last ? header : header.substr(0, bar);
            if (!last) header.remove_prefix(bar + 1);
        }
        Record r;
        r.state = std::string(parts[0]);
        r.token = std::string(parts[1]);
        r.outcome = std::string(parts[2]);
        r.attempts = static_cast<std::uint32_t>(parse_int(parts[3]));
        if (!parts[4].empty() && parts[4][0] == '~') {
            r.times_before_expiry = parse_int(parts[4].substr(1));
        } else {
            r.claimed_at = parse_int(parts[4]);
            r.leased_at = parse_int(parts[5]);
        }
        r.lease_ms = parse_int(parts[6]);
        const std::string_view fields = value.substr(newline + 1);
        // The three lengths, each within what is left of the value (a negative or oversized
        // length, e.g. a corrupt value, is not a record; their sum must not wrap).
        std::size_t lengths[3] = {};
        std::size_t left = fields.size();
        for (std::size_t k = 0; k < 3; ++k) {
            const std::int64_t n = parse_int(parts[7 + k]);
            if (n < 0 || static_cast<std::uint64_t>(n) > left) return std::nullopt;
            lengths[k] = static_cast<std::size_t>(n);
            left -= lengths[k];
        }
        const std::size_t nf = lengths[0], ns = lengths[1], ni = lengths[2];
        if (r.state.empty()) return std::nullopt;
        r.fingerprint = std::string(fields.substr(0, nf));
        r.scope = std::string(fields.substr(nf, ns));
        r.id = std::string(fields.substr(nf + ns, ni));
        r.reason = std::string(fields.substr(nf + ns + ni));
        return r;
    }

    /// The record as stored (the inverse of decode()).
    [[nodiscard]] std::string encode() const {
        return fmt::format("{}|{}|{}|{}|{}|{}|{}|", state, token, outcome, attempts, claimed_at,
                           leased_at, lease_ms) +
               fields(fingerprint, scope, id) + reason;
    }
    /// The start of a new record, up to its fields: `state|token|outcome|1|now|now|lease_ms|`
    /// (attempt 1, claimed and leased now). @p now empty: the server's now, which a plain SET
    /// cannot read, so the times say `~<retention_ms>`, "the expiry minus the retention".
    static std::string new_head(std::string_view state, std::string_view token,
                                std::string_view outcome, std::string_view now,
                                long long retention_ms, long long lease_ms) {
        std::string head;
        head.reserve(64 + token.size());
        head.append(state).append("|").append(token).append("|").append(outcome).append("|1|");
        for (int time = 0; time < 2; ++time) {
            if (now.empty()) {
                head += '~';
                append_decimal(head, retention_ms);
            } else {
                head.append(now);
            }
            head += '|';
        }
        append_decimal(head, lease_ms);
        head += '|';
        return head;
    }
    /// The end of a record: `#fp|#scope|#id\n` fp scope id. A claim sends it for each id, so
    /// the script only joins strings.
    static std::string fields(std::string_view fingerprint, std::string_view scope,
                              std::string_view id) {
        std::string out;
        out.reserve(24 + fingerprint.size() + scope.size() + id.size());
        append_decimal(out, static_cast<long long>(fingerprint.size()));
        out += '|';
        append_decimal(out, static_cast<long long>(scope.size()));
        out += '|';
        append_decimal(out, static_cast<long long>(id.size()));
        out += '\n';
        out.append(fingerprint).append(scope).append(id);
        return out;
    }
};

/// 128 random bits as hex: the token that fences one transaction's leases (and owns its overlap
/// locks). Kernel bytes, read ahead per thread and per process (detail::pooled_random_bytes): a
/// generator seeded in the process would hand every fork()ed child its parent's sequence, and two
/// workers with one token take each other's leases and locks as their own.
inline std::string new_lease_token() {
    return detail::os_random_hex(16);
}

}  // namespace redis
IDEM_END_NAMESPACE
