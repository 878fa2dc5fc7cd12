#pragma once
/// @file
/// @brief RedisStore: claims held as leases in Redis, taken in one round trip (a plain
/// `SET … NX GET` for a new id, a Lua script for a contested one) and completed by
/// compare-and-set on the lease's token. Redis-side writes of the effect (and the
/// stream XACK when the broker is the same Redis) commit atomically with the completion. Link
/// idem::redis. See docs/redis.md.

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/detail/random.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"
#include "idem/policy.hpp"
#include "idem/store.hpp"
#include "idem/store/redis_connection.hpp"

IDEM_BEGIN_NAMESPACE

struct RedisOptions {
    /// Lease of a claim when the handler's policy sets none. Keep it equal to the broker's
    /// visibility timeout or just under (docs/redis.md).
    std::chrono::milliseconds lease{30'000};
    /// How long a finished claim is kept when the transaction is used without a handler (the
    /// handler passes its policy's retention).
    std::chrono::seconds retention = days(14);
    /// Prefix of every key the store writes.
    std::string key_prefix = "idem:";
    /// Time source for leases and claimed_at. Empty (the default): the Redis server's clock, read
    /// inside the scripts, so workers with skewed clocks still agree on when a lease expires.
    Clock clock;
    /// Claim a new id with one plain `SET … NX PX … GET` (Redis 7.0 and later) rather than a
    /// script; contested ids still go through the claim script. A server that refuses the
    /// command (before 7.0) switches the store to the script for good on the first claim.
    bool claim_with_set = true;
    /// A Redis without the append-only file loses every claim written since its last snapshot
    /// when it restarts, and a redelivery then runs those effects again. So the constructor (or,
    /// when the server is down then, the first call) reads `INFO persistence` and throws
    /// usage_error unless `aof_enabled` is 1. Set this to run without AOF anyway (a cache, a test,
    /// a server whose data survives otherwise), accepting that a restart re-runs effects; the
    /// check is then skipped.
    bool accept_no_persistence = false;
    /// Connections the store opens at most (in use and idle together). A call that needs one
    /// when all are in use waits up to pool_wait_timeout, then throws store_timeout.
    std::size_t max_connections = 64;
    std::chrono::milliseconds pool_wait_timeout{5'000};
    /// A pooled connection idle this long is PINGed before it is reused; a dead one (the server
    /// restarted, CLIENT KILL, a proxy dropped it) is replaced, so the call does not fail on it.
    /// Zero: ping before every reuse.
    std::chrono::milliseconds ping_idle_after{10'000};
};

/// @brief What the store found out about the server's persistence (RedisStore::persistence()).
struct RedisPersistence {
    bool aof_enabled = false;
    /// `CONFIG GET appendfsync` (always, everysec, no); empty when CONFIG is disabled or renamed.
    std::string appendfsync{};
};

/// @brief A consumer reading a stream on the same Redis asks the next transaction begun on its
/// thread to ack the entry in the commit itself (see RedisStore::AckWithNextCommit), so for
/// Redis-only effects the ack is part of the transaction.
struct StreamAck {
    std::string stream;
    std::string group;
    std::string entry_id;
    /// Where a dead letter of this entry also goes, with the entry's fields; empty: nowhere.
    std::string dead_letter_stream{};
    std::vector<std::pair<std::string, std::string>> fields{};
    std::uint32_t delivery_count = 0;
    bool acked = false;  ///< set when a commit included the XACK
    /// The claim this entry is delivered as: the handler's policy scope and the message id (the
    /// entry id, or the id field's value). A batch commit matches its claims and dead letters to
    /// the entries by these; a single ack does not need them.
    std::string scope{};
    std::string message_id{};
};

namespace detail {

/// The dead-letter stream entry of a stream message: why, where from, then its own fields.
inline std::vector<std::string> stream_dead_letter_command(
    const std::string& dead_letter_stream, const std::string& entry_id,
    const std::vector<std::pair<std::string, std::string>>& fields, std::string_view reason,
    std::string_view scope, std::string_view message_id, std::uint32_t delivery_count) {
    std::vector<std::string> command{"XADD",
                                     dead_letter_stream,
                                     "*",
                                     "idem-reason",
                                     std::string(reason),
                                     "idem-scope",
                                     std::string(scope),
                                     "idem-message-id",
                                     std::string(message_id),
                                     "idem-delivery-count",
                                     std::to_string(delivery_count),
                                     "idem-entry-id",
                                     entry_id};
    for (const auto& [name, value] : fields) {
        command.push_back(name);
        command.push_back(value);
    }
    return command;
}

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
// first claim's time); completion and release keep it. RedisClaimRecord is the C++ twin.
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

// The helpers, one per snippet, so that each script includes only those it uses (every `local
// function` is made anew on every call).

// The store's clock in milliseconds, as text: ARGV's now, or the server's TIME cut as text
// (seconds, then the first 3 of 6 digits of microseconds) rather than computed as a number.
inline constexpr const char* redis_lua_now = R"(
local function now_text(arg, t)
  if arg ~= '' then return arg end
  t = t or redis.call('TIME')
  return t[1] .. string.sub('00000' .. t[2], -6, -4)
end
)";

inline constexpr const char* redis_lua_int = R"(
local function int(x) return string.format('%d', x) end
)";

// `rest` is everything from attempts on, which a change of state keeps.
inline constexpr const char* redis_lua_record = R"(
local function record(state, token, outcome, rest)
  return state .. '|' .. token .. '|' .. outcome .. '|' .. rest
end
)";

// Every field of the header, and rest and tail (from #fp on); nothing when there is no record.
// The times come back as numbers, `~<retention>` ones resolved against the record's expiry.
inline constexpr const char* redis_lua_split = R"(
local function split(key, v)
  if not v then return nil end
  local r = {}
  r.state, r.token, r.outcome, r.rest, r.attempts, r.claimed_at, r.leased_at, r.lease_ms,
    r.tail = string.match(v, '^(%l+)|(%x*)|([%l_]*)|((%d+)|(~?%d+)|(~?%d*)|(%d*)|(.*))$')
  if not r.state then error('idem: unreadable claim record at ' .. key) end
  local expiry
  for _, f in ipairs({'claimed_at', 'leased_at'}) do
    if string.sub(r[f], 1, 1) == '~' then
      expiry = expiry or redis.call('PEXPIRETIME', key)
      r[f] = expiry - tonumber(string.sub(r[f], 2))
    else
      r[f] = tonumber(r[f]) or 0
    end
  end
  return r
end
)";

// The rest of a record that starts with `prefix` ('leased|<token>||': leased to that token),
// else nil. No pattern: cheaper than split().
inline constexpr const char* redis_lua_held = R"(
local function held(v, prefix)
  if v and string.sub(v, 1, #prefix) == prefix then return string.sub(v, #prefix + 1) end
  return nil
end
)";

// The fingerprint, scope and id in a record's rest.
inline constexpr const char* redis_lua_fields = R"(
local function fields(rest)
  local nf, ns, ni, at = string.match(rest, '^%d+|~?%d+|~?%d*|%d*|(%d+)|(%d+)|(%d+)\n()')
  nf, ns, ni = tonumber(nf), tonumber(ns), tonumber(ni)
  return string.sub(rest, at, at + nf - 1), string.sub(rest, at + nf, at + nf + ns - 1),
         string.sub(rest, at + nf + ns, at + nf + ns + ni - 1)
end
)";

// Frees a lease if the token of `prefix` still holds it; attempts and the expiry stay.
inline constexpr const char* redis_lua_release = R"(
local function release(key, prefix)
  local rest = held(redis.call('GET', key), prefix)
  if not rest then return 0 end
  redis.call('SET', key, record('free', '', '', rest), 'KEEPTTL')
  return 1
end
)";

// Adds a dead letter to a stream: assigns `add_letter` (declared by the caller; needs
// redis_lua_now). The clock is read only here, once.
inline constexpr const char* redis_lua_add_letter = R"(
add_letter = function(key, scope, id, count, reason, payload, created_at)
  local t = redis.call('TIME')
  if created_at == '' then created_at = now_text(ARGV[1], t) end
  redis.call('XADD', key, '*', 'scope', scope, 'id', id, 'delivery_count', count,
             'reason', reason, 'payload', payload, 'created_at', created_at,
             'order_us', t[1] .. string.format('%06d', t[2]))
end
)";

inline std::string lua(std::initializer_list<const char*> parts) {
    std::string out;
    for (const char* part : parts)
        out += part;
    return out;
}

// KEYS: the claim records, one per id. ARGV: token, lease_ms, retention_ms, now, then per key
// the fields of its new record ("#fp|#scope|#id\n" fp scope id). One script for a whole batch:
// one call instead of one per id. Answers, per key, 1 for a new claim (attempt 1, the
// fingerprint sent) or {status, detail, fingerprint, attempts}: an array of them, or for one
// key its answer alone.
inline const std::string& redis_claim_source() {
    static const std::string source =
        lua({redis_lua_now, redis_lua_int, redis_lua_record, redis_lua_split, redis_lua_fields}) +
        R"(
local now = now_text(ARGV[4])
local token, lease_ms, retention = ARGV[1], ARGV[2], ARGV[3]
-- A new record up to its fields: attempt 1, claimed and leased now.
local new = record('leased', token, '', '1|' .. now .. '|' .. now .. '|' .. lease_ms .. '|')
local out = {}
for c = 1, #KEYS do
  local key = KEYS[c]
  -- A new id, the common case: one SET NX, which also sets the record's expiry.
  if redis.call('SET', key, new .. ARGV[4 + c], 'NX', 'PX', retention) then
    out[c] = 1
  else
    local r = split(key, redis.call('GET', key))
    local fp = fields(r.rest)
    local left = r.state == 'leased' and r.leased_at + r.lease_ms - now or 0  -- of the lease
    if r.state == 'done' then
      out[c] = {'duplicate', r.outcome ~= '' and r.outcome or 'processed', fp, r.attempts}
    elseif r.state == 'leased' and r.token == token then
      out[c] = {'duplicate', 'in_progress', fp, r.attempts}
    elseif left > 0 then
      out[c] = {'in_progress', int(left), fp, r.attempts}
    else  -- released, or the lease ran out: taken over, one more attempt
      local attempts = int(r.attempts + 1)
      -- The count of attempts and the first claim's time stay; the lease, the token and the
      -- fields (fingerprint, scope, id) are the new claimer's, and the retention restarts.
      redis.call('SET', key, record('leased', token, '', attempts .. '|' .. int(r.claimed_at) ..
                 '|' .. now .. '|' .. lease_ms .. '|' .. ARGV[4 + c]), 'PX', retention)
      out[c] = {'claimed', r.state, fp, attempts}
    end
  end
end
if #KEYS == 1 then return out[1] end  -- a table reply costs more than the rest of the claim
return out
)";
    return source;
}

// KEYS: the claims' records (n_claims), then the stream of each dead letter, then leases to free
// (unclaimed). ARGV: now, token, n_claims, {outcome, reason} * n_claims, n_letters, {scope, id,
// delivery_count, reason, payload, created_at} * n_letters, n_commands, {argc, args...} *
// n_commands. Every lease is checked before anything is written: a lost lease writes nothing.
// Returns 'ok', or {why, detail...}. The clock is read only for dead letters.
inline const std::string& redis_complete_source() {
    // The common commit (leases held, the effect's writes, no dead letter) runs no `local
    // function` statement: each one builds a closure on every call. The helpers are made only
    // on the paths that need them.
    static const std::string source = std::string(R"(
local mine = 'leased|' .. ARGV[2] .. '||'  -- how a record leased to this transaction starts
local n_claims = tonumber(ARGV[3])
local rest = {}
for c = 1, n_claims do
  local v = redis.call('GET', KEYS[c])
  if v and string.sub(v, 1, #mine) == mine then
    rest[c] = string.sub(v, #mine + 1)
  else
    return {'lease_lost', tostring(c), v and string.match(v, '^%l+') or 'gone'}
  end
end
local i = 4 + 2 * n_claims
local n_letters = tonumber(ARGV[i])
local letters_at = i + 1
i = letters_at + 6 * n_letters
local n_commands = tonumber(ARGV[i]); i = i + 1
local add_letter
if n_letters > 0 then
)") + redis_lua_now + redis_lua_add_letter +
                                      R"(
end
for k = 1, n_commands do
  local argc = tonumber(ARGV[i])
  local name = ARGV[i + 1]
  local result = redis.pcall(unpack(ARGV, i + 1, i + argc))
  i = i + 1 + argc
  if type(result) == 'table' and result.err then
    if k == 1 then return {'command_failed', '1', result.err} end
)" + redis_lua_now + redis_lua_fields +
                                      redis_lua_add_letter +
                                      R"(
    -- Redis cannot undo commands 1..k-1: park the claims so a redelivery does not apply them a
    -- second time, and leave a dead letter for a human.
    local why = 'Redis command ' .. k .. ' of the commit (' .. name .. ') failed after ' ..
                (k - 1) .. ' had been applied (Redis cannot roll back): ' .. result.err
    for c = 1, n_claims do
      redis.call('SET', KEYS[c], 'done||dead_lettered|' .. rest[c] .. why, 'KEEPTTL')
      -- The claim's dead letters: its key with 'd' for 'c' before the hash tag (same slot).
      local tag = string.find(KEYS[c], '{', 1, true)
      local letters = string.sub(KEYS[c], 1, tag - 2) .. 'd' .. string.sub(KEYS[c], tag)
      local _, scope, id = fields(rest[c])
      add_letter(letters, scope, id, string.match(rest[c], '^%d+'), why, '', '')
    end
    return {'partial', tostring(k), why}
  end
end
for d = 1, n_letters do
  local a = letters_at + 6 * (d - 1)
  add_letter(KEYS[n_claims + d], ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4],
             ARGV[a + 5])
end
for c = 1, n_claims do
  redis.call('SET', KEYS[c], 'done||' .. ARGV[2 + 2 * c] .. '|' .. rest[c] .. ARGV[3 + 2 * c],
             'KEEPTTL')
end
-- Leases given back without completion (batch messages that failed): freed if still ours.
if #KEYS > n_claims + n_letters then
)" + redis_lua_record + redis_lua_held +
                                      redis_lua_release + R"(
  for k = n_claims + n_letters + 1, #KEYS do
    release(KEYS[k], mine)
  end
end
return 'ok'
)";
    return source;
}

// KEYS: claim records. ARGV: token. Frees only leases this token holds; attempts stay.
inline const std::string& redis_release_source() {
    static const std::string source =
        lua({redis_lua_record, redis_lua_held, redis_lua_release}) + R"(
local mine = 'leased|' .. ARGV[1] .. '||'
local freed = 0
for c = 1, #KEYS do
  freed = freed + release(KEYS[c], mine)
end
return freed
)";
    return source;
}

// KEYS[1] lock. ARGV: owner, expire_ms, now. 1: taken (or renewed by its owner), 0: held.
inline const std::string& redis_lock_source() {
    static const std::string source = lua({redis_lua_now, redis_lua_int}) + R"(
local now = tonumber(now_text(ARGV[3]))
local r = redis.call('HMGET', KEYS[1], 'owner', 'expires_at')
if r[1] and r[1] ~= ARGV[1] and (tonumber(r[2]) or 0) > now then return 0 end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'expires_at', int(now + tonumber(ARGV[2])))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
)";
    return source;
}

// KEYS[1] lock. ARGV: owner. 1: released, 0: not ours.
inline constexpr const char* redis_unlock_source = R"(
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
)";

// KEYS: claim records. ARGV: cutoff_ms, now. Deletes claims claimed before the cutoff (never a
// live lease). Returns {claims deleted, released records deleted}.
inline const std::string& redis_purge_claims_source() {
    static const std::string source = lua({redis_lua_now, redis_lua_split}) + R"(
local now = tonumber(now_text(ARGV[2]))
local cutoff = tonumber(ARGV[1])
local claims, released = 0, 0
for c = 1, #KEYS do
  local r = split(KEYS[c], redis.call('GET', KEYS[c]))
  if r and r.claimed_at < cutoff and
     not (r.state == 'leased' and r.leased_at + r.lease_ms > now) then
    redis.call('DEL', KEYS[c])
    if r.state == 'free' then released = released + 1 else claims = claims + 1 end
  end
end
return {claims, released}
)";
    return source;
}

// KEYS: locks. ARGV: now. Deletes locks whose expiry is before now.
inline const std::string& redis_purge_locks_source() {
    static const std::string source = lua({redis_lua_now}) + R"(
local now = tonumber(now_text(ARGV[1]))
local n = 0
for c = 1, #KEYS do
  local expires_at = tonumber(redis.call('HGET', KEYS[c], 'expires_at'))
  if expires_at and expires_at < now then
    redis.call('DEL', KEYS[c])
    n = n + 1
  end
end
return n
)";
    return source;
}

inline const RedisScript& redis_claim_script() {
    static const RedisScript script{"claim", redis_claim_source().c_str()};
    return script;
}
inline const RedisScript& redis_complete_script() {
    static const RedisScript script{"complete", redis_complete_source().c_str()};
    return script;
}
inline const RedisScript& redis_release_script() {
    static const RedisScript script{"release", redis_release_source().c_str()};
    return script;
}
inline const RedisScript& redis_lock_script() {
    static const RedisScript script{"lock", redis_lock_source().c_str()};
    return script;
}
inline const RedisScript& redis_unlock_script() {
    static const RedisScript script{"unlock", redis_unlock_source};
    return script;
}
inline const RedisScript& redis_purge_claims_script() {
    static const RedisScript script{"purge claims", redis_purge_claims_source().c_str()};
    return script;
}
inline const RedisScript& redis_purge_locks_script() {
    static const RedisScript script{"purge locks", redis_purge_locks_source().c_str()};
    return script;
}

/// A key part inside a hash tag: braces would end the tag early (and split one claim's keys
/// across Cluster slots), and ':' in a scope would let (a:b, c) and (a, b:c) collide.
inline void append_key_part(std::string& out, std::string_view part, bool escape_colon) {
    for (char c : part) {
        switch (c) {
            case '%':
                out += "%25";
                break;
            case '{':
                out += "%7B";
                break;
            case '}':
                out += "%7D";
                break;
            case ':':
                if (escape_colon) {
                    out += "%3A";
                } else {
                    out += c;
                }
                break;
            default:
                out += c;
        }
    }
}

/// A literal text inside a SCAN MATCH pattern.
inline std::string glob_escape(std::string_view text) {
    std::string out;
    for (char c : text) {
        if (c == '*' || c == '?' || c == '[' || c == ']' || c == '\\') out += '\\';
        out += c;
    }
    return out;
}

inline std::int64_t parse_int(std::string_view text) {
    std::int64_t value = 0;
    bool negative = false;
    std::size_t i = 0;
    if (!text.empty() && text[0] == '-') {
        negative = true;
        i = 1;
    }
    for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i)
        value = value * 10 + (text[i] - '0');
    return negative ? -value : value;
}

/// The claim record as stored (layout: the comment above redis_lua_now), the C++ twin of the Lua:
/// find_claim() and attempts() decode it; tests write one with encode().
struct RedisClaimRecord {
    std::string state;    ///< leased, done or free
    std::string token;    ///< empty unless leased
    std::string outcome;  ///< empty unless done
    std::uint32_t attempts = 0;
    std::int64_t claimed_at = 0;
    std::int64_t leased_at = 0;  ///< the lease: from leased_at, lease_ms long (while leased)
    std::int64_t lease_ms = 0;
    std::string fingerprint;
    std::string scope;
    std::string id;
    std::string reason;  ///< empty unless done
    /// claimed_at and leased_at are "the record's expiry minus this" (`~<ms>` in the record: a
    /// claim made by SET, which cannot read the clock) until resolve() is given the expiry.
    std::optional<std::int64_t> times_before_expiry;

    /// Turns `~<ms>` times into numbers, given the record's PEXPIRETIME.
    void resolve(std::int64_t expiry_ms) {
        if (!times_before_expiry) return;
        claimed_at = expiry_ms - *times_before_expiry;
        leased_at = claimed_at;
        times_before_expiry.reset();
    }

    /// When the lease ends; 0 when the record is not leased.
    [[nodiscard]] std::int64_t lease_until() const {
        return state == "leased" ? leased_at + lease_ms : 0;
    }

    /// Nothing when @p value is not a claim record.
    static std::optional<RedisClaimRecord> decode(std::string_view value) {
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
        RedisClaimRecord r;
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
        const auto nf = static_cast<std::size_t>(parse_int(parts[7]));
        const auto ns = static_cast<std::size_t>(parse_int(parts[8]));
        const auto ni = static_cast<std::size_t>(parse_int(parts[9]));
        const std::string_view fields = value.substr(newline + 1);
        if (r.state.empty() || fields.size() < nf + ns + ni) return std::nullopt;
        r.fingerprint = std::string(fields.substr(0, nf));
        r.scope = std::string(fields.substr(nf, ns));
        r.id = std::string(fields.substr(nf + ns, ni));
        r.reason = std::string(fields.substr(nf + ns + ni));
        return r;
    }

    [[nodiscard]] std::string encode() const {
        return fmt::format("{}|{}|{}|{}|{}|{}|{}|", state, token, outcome, attempts, claimed_at,
                           leased_at, lease_ms) +
               fields(fingerprint, scope, id) + reason;
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
/// locks). Drawn from the kernel every time: a generator seeded in the process would hand every
/// fork()ed child its parent's sequence, and two workers with one token take each other's leases
/// and locks as their own.
inline std::string new_lease_token() {
    return os_random_hex(16);
}

}  // namespace detail

/// @brief Claims as leases in ONE Redis server (no Sentinel discovery, no Cluster redirects
/// yet: docs/redis.md). Thread-safe: each call takes a connection from a small pool, so handlers
/// on several threads share one store.
///
/// - claim(): one round trip, `SET … NX PX … GET`: absent → leased to this transaction's token
///   (attempt 1); finished → duplicate with the recorded outcome. A record leased by another
///   worker or released goes on to the claim script (one more round trip): leased and live →
///   in_progress; expired or released → taken over with a new token (and the taker's
///   fingerprint), the attempt count goes up, claimed_at stays. The record expires the retention
///   after its latest claim. claim_many(): the same for a batch's ids, the SETs
///   pipelined in one round trip.
/// - commit(): one round trip, a script that checks every lease is still ours, runs the queued
///   Redis writes (write(), the consumer's XACK), stores dead letters and marks the claims done.
///   A lease lost to another worker writes nothing and throws commit_failed ("lease lost").
/// - rollback (destructor, or an effect that threw): frees only this transaction's leases, so a
///   redelivery runs the work; the attempt count stays for the poison check.
///
/// @code
/// idem::RedisStore store{idem::RedisEndpoint{"127.0.0.1", 6379}};
/// auto handler = idem::make_handler(store, policy, [](auto& tx, const Order& o) {
///     tx.write("HINCRBY", "balance:" + o.account, o.amount);   // applied at commit
/// });
/// @endcode
class RedisStore {
  public:
    class Transaction;

    explicit RedisStore(RedisEndpoint endpoint, RedisOptions options = {})
        : endpoint_(std::move(endpoint)), options_(std::move(options)) {
        claim_with_set_.store(options_.claim_with_set, std::memory_order_relaxed);
        if (options_.lease.count() <= 0) {
            throw usage_error("idem::RedisStore: the default lease must be positive");
        }
        if (options_.max_connections == 0) {
            throw usage_error("idem::RedisStore: max_connections must be at least 1");
        }
        if (options_.key_prefix.find_first_of("{}") != std::string::npos) {
            throw usage_error(
                "idem::RedisStore: the key prefix must not contain braces (they would change the "
                "keys' Cluster hash tags)");
        }
        // The persistence check, now if the server answers (a store on a server without AOF
        // does not start), else on first use.
        if (!options_.accept_no_persistence) {
            try {
                with_connection([](RedisConnection&) { return 0; });
            } catch (const store_error&) {  // unreachable for now: checked on first use
            }
        }
    }
    RedisStore(const RedisStore&) = delete;
    RedisStore& operator=(const RedisStore&) = delete;

    [[nodiscard]] const RedisEndpoint& endpoint() const noexcept { return endpoint_; }
    [[nodiscard]] const RedisOptions& options() const noexcept { return options_; }
    /// Whether new ids are claimed with `SET … NX … GET` (RedisOptions::claim_with_set, until a
    /// server before 7.0 refuses it) rather than the claim script.
    [[nodiscard]] bool claims_with_set() const noexcept {
        return claim_with_set_.load(std::memory_order_relaxed);
    }
    /// The lease used when the handler's policy sets none.
    [[nodiscard]] std::chrono::milliseconds default_lease() const noexcept {
        return options_.lease;
    }

    /// @brief Starts a transaction. No round trip: Redis is contacted by claim() and commit().
    [[nodiscard]] Transaction begin();

    /// @brief While alive, the next transaction this thread begins on this store acks @p ack's
    /// stream entry in its commit (and, if that commit writes a dead letter, adds the entry to
    /// the dead-letter stream). Used by StreamConsumer when stream and store share a server.
    class AckWithNextCommit {
      public:
        AckWithNextCommit(RedisStore& store, StreamAck& ack) noexcept {
            pending() = Pending{&store, &ack, nullptr};
        }
        /// @brief A batch (IdempotentHandler::handle_batch): the commit acks each entry of
        /// @p acks whose message it completes — matched by StreamAck::scope and message_id to a
        /// claim it marks processed, rejected or dead_lettered (an id's first entry: later
        /// entries of the same id are its duplicates), or else to a dead letter it stores (one
        /// per entry, in order) — and adds the dead-lettered ones to their dead-letter stream.
        /// Entries it does not complete (failed, deferred, in_progress, duplicate) are left to
        /// the caller; `acked` is set on exactly those the commit acked.
        AckWithNextCommit(RedisStore& store, std::vector<StreamAck>& acks) noexcept {
            pending() = Pending{&store, nullptr, &acks};
        }
        ~AckWithNextCommit() { pending() = Pending{}; }
        AckWithNextCommit(const AckWithNextCommit&) = delete;
        AckWithNextCommit& operator=(const AckWithNextCommit&) = delete;
    };

    /// @brief The claim record, or nothing when there is none or it was released.
    std::optional<ClaimRecord> find_claim(std::string_view scope, std::string_view id) {
        std::optional<detail::RedisClaimRecord> stored = read_record(scope, id);
        if (!stored || stored->state == "free") return std::nullopt;
        ClaimRecord record;
        record.scope = std::string(scope);
        record.message_id = std::string(id);
        record.disposition = Disposition::in_progress;
        if (stored->state == "done") record.disposition = disposition_from(stored->outcome);
        record.reason = std::move(stored->reason);
        record.claimed_at = detail::from_unix_ms(stored->claimed_at);
        record.fingerprint = std::move(stored->fingerprint);
        return record;
    }

    /// @brief How many times the effect started for this claim (0 when there is no record).
    std::uint32_t attempts(std::string_view scope, std::string_view id) {
        std::optional<detail::RedisClaimRecord> stored = read_record(scope, id);
        return stored ? stored->attempts : 0;
    }

    /// @brief Every dead letter, oldest first. Kept until a human deletes them: purge() and the
    /// claims' expiry never touch them.
    std::vector<DeadLetter> dead_letters() {
        struct Ordered {
            std::string order;
            DeadLetter letter;
        };
        std::vector<Ordered> found;
        for (const std::string& key : scan(prefix_glob() + "d{*")) {
            RedisReply entries = with_connection([&](RedisConnection& c) {
                return c.checked({"XRANGE", key, "-", "+"}, "XRANGE");
            });
            for (const RedisReply& entry : entries.elements) {
                if (entry.elements.size() < 2) continue;
                Ordered item;
                const auto& fields = entry.elements[1].elements;
                for (std::size_t i = 0; i + 1 < fields.size(); i += 2) {
                    const std::string& name = fields[i].str;
                    const std::string& value = fields[i + 1].str;
                    if (name == "scope") item.letter.scope = value;
                    if (name == "id") item.letter.message_id = value;
                    if (name == "delivery_count")
                        item.letter.delivery_count =
                            static_cast<std::uint32_t>(detail::parse_int(value));
                    if (name == "reason") item.letter.reason = value;
                    if (name == "payload") item.letter.payload = value;
                    if (name == "created_at")
                        item.letter.created_at = detail::from_unix_ms(detail::parse_int(value));
                    if (name == "order_us") item.order = value;
                }
                found.push_back(std::move(item));
            }
        }
        std::sort(found.begin(), found.end(), [](const Ordered& a, const Ordered& b) {
            if (a.letter.created_at != b.letter.created_at)
                return a.letter.created_at < b.letter.created_at;
            if (a.order.size() != b.order.size()) return a.order.size() < b.order.size();
            return a.order < b.order;
        });
        std::vector<DeadLetter> letters;
        letters.reserve(found.size());
        for (auto& item : found)
            letters.push_back(std::move(item.letter));
        return letters;
    }

    /// @brief Deletes claims claimed before clock() - @p older_than (never a live lease) and
    /// expired locks. Redis also expires claims by itself (each record's TTL is the retention);
    /// this is for a clock the server does not share (tests) and for reporting. Dead letters are
    /// kept.
    PurgeResult purge(std::chrono::system_clock::duration older_than) {
        PurgeResult result;
        const std::string now = now_arg();
        const std::int64_t cutoff_ms =
            (now.empty() ? server_now_ms() : detail::parse_int(now)) -
            std::chrono::duration_cast<std::chrono::milliseconds>(older_than).count();
        for (const auto& batch : batches(scan(prefix_glob() + "c{*"))) {
            RedisReply reply = with_connection([&](RedisConnection& c) {
                return c.eval(detail::redis_purge_claims_script(), batch,
                              {std::to_string(cutoff_ms), now});
            });
            check_script(reply, "purge");
            if (reply.elements.size() == 2) {
                result.claims += static_cast<std::size_t>(reply.elements[0].integer);
            }
        }
        for (const auto& batch : batches(scan(prefix_glob() + "l{*"))) {
            RedisReply reply = with_connection([&](RedisConnection& c) {
                return c.eval(detail::redis_purge_locks_script(), batch, {now});
            });
            check_script(reply, "purge");
            result.expired_locks += static_cast<std::size_t>(reply.integer);
        }
        return result;
    }

    /// @brief Takes a lock outside any transaction (a long job, another system); false when
    /// another owner holds it and it has not expired.
    bool hold_lock(std::string_view key, std::string_view owner,
                   std::chrono::milliseconds expire_after) {
        RedisReply reply = with_connection([&](RedisConnection& c) {
            return c.eval(detail::redis_lock_script(), {lock_key(key)},
                          {std::string(owner), std::to_string(expire_after.count()), now_arg()});
        });
        check_script(reply, "lock");
        return reply.integer == 1;
    }
    /// @brief Releases a lock @p owner holds; false when it holds none.
    bool release_lock(std::string_view key, std::string_view owner) {
        RedisReply reply = with_connection([&](RedisConnection& c) {
            return c.eval(detail::redis_unlock_script(), {lock_key(key)}, {std::string(owner)});
        });
        check_script(reply, "unlock");
        return reply.integer == 1;
    }

    /// @brief The record of (scope, id). The hash tag holds both, so one claim's keys (record,
    /// dead letters) share a Cluster slot whatever bytes the id has.
    [[nodiscard]] std::string claim_key(std::string_view scope, std::string_view id) const {
        return tagged_key('c', scope, id);
    }
    [[nodiscard]] std::string dead_letter_key(std::string_view scope, std::string_view id) const {
        return tagged_key('d', scope, id);
    }
    [[nodiscard]] std::string lock_key(std::string_view key) const {
        std::string out = options_.key_prefix + "l{";
        detail::append_key_part(out, key, false);
        out += '}';
        return out;
    }

    /// @brief Runs @p fn with a pooled connection (reconnecting if it was dropped). Waits up to
    /// RedisOptions::pool_wait_timeout when max_connections are in use.
    /// @throws store_timeout when no connection became free in time; usage_error when the server
    /// has no AOF (RedisOptions::accept_no_persistence).
    template <class Fn>
    auto with_connection(Fn&& fn) -> decltype(fn(std::declval<RedisConnection&>())) {
        std::unique_ptr<RedisConnection> connection = acquire();
        struct Return {
            RedisStore* store;
            std::unique_ptr<RedisConnection>& connection;
            std::size_t before;
            ~Return() {
                store->round_trips_.fetch_add(connection->round_trips() - before,
                                              std::memory_order_relaxed);
                store->give_back(std::move(connection));
            }
        } give_back{this, connection, connection->round_trips()};
        if (!options_.accept_no_persistence &&
            !persistence_checked_.load(std::memory_order_acquire)) {
            check_persistence(*connection);
            give_back.before = connection->round_trips();  // the check is not the caller's cost
        }
        return fn(*connection);
    }

    /// @brief What the persistence check found; nothing before the first call that reached the
    /// server, or with RedisOptions::accept_no_persistence (which skips the check).
    [[nodiscard]] std::optional<RedisPersistence> persistence() const {
        std::lock_guard<std::mutex> lock(pool_mutex_);
        return persistence_;
    }

    /// @brief Request/reply exchanges with Redis so far, over all pooled connections (a
    /// pipeline counts once): the cost tests and benchmarks check.
    [[nodiscard]] std::size_t round_trips() const noexcept {
        return round_trips_.load(std::memory_order_relaxed);
    }

    /// @brief Milliseconds since the epoch on the store's clock (the server's by default).
    std::int64_t now_ms() {
        return options_.clock ? detail::to_unix_ms(options_.clock()) : server_now_ms();
    }

  private:
    friend class Transaction;

    struct Pending {
        RedisStore* store = nullptr;
        StreamAck* ack = nullptr;
        std::vector<StreamAck>* acks = nullptr;
    };
    static Pending& pending() noexcept {
        thread_local Pending value;
        return value;
    }

    Pending take_pending_acks() noexcept {
        Pending& p = pending();
        if (p.store != this) return Pending{};
        Pending taken = p;
        p.ack = nullptr;  // one transaction takes them
        p.acks = nullptr;
        return taken;
    }

    static Disposition disposition_from(const std::string& text) {
        Disposition d = Disposition::processed;
        return from_string(text, d) ? d : Disposition::processed;
    }

    /// The stored record of (scope, id), as it is (any state); nothing when there is none.
    std::optional<detail::RedisClaimRecord> read_record(std::string_view scope,
                                                        std::string_view id) {
        RedisArgs get;
        get.add("GET").add(claim_key(scope, id));
        RedisReply reply =
            with_connection([&](RedisConnection& c) { return c.checked(get, "GET"); });
        if (reply.is_nil()) return std::nullopt;
        auto record = detail::RedisClaimRecord::decode(reply.str);
        if (!record) {
            throw store_error(fmt::format("idem: unreadable claim record for {}/{} on {}", scope,
                                          id, endpoint_.describe()));
        }
        if (record->times_before_expiry) {
            RedisArgs expiry;
            expiry.add("PEXPIRETIME").add(claim_key(scope, id));
            RedisReply at = with_connection(
                [&](RedisConnection& c) { return c.checked(expiry, "PEXPIRETIME"); });
            record->resolve(at.integer);
        }
        return record;
    }

    [[nodiscard]] std::string tagged_key(char kind, std::string_view scope,
                                         std::string_view id) const {
        std::string out;
        out.reserve(options_.key_prefix.size() + scope.size() + id.size() + 5);
        out += options_.key_prefix;
        out += kind;
        out += '{';
        detail::append_key_part(out, scope, true);
        out += ':';
        detail::append_key_part(out, id, false);
        out += '}';
        return out;
    }

    [[nodiscard]] std::string prefix_glob() const {
        return detail::glob_escape(options_.key_prefix);
    }

    /// Empty when the server's clock is used (the scripts read TIME themselves).
    [[nodiscard]] std::string now_arg() const {
        return options_.clock ? std::to_string(detail::to_unix_ms(options_.clock()))
                              : std::string();
    }

    std::int64_t server_now_ms() {
        RedisReply reply =
            with_connection([](RedisConnection& c) { return c.checked({"TIME"}, "TIME"); });
        if (reply.elements.size() != 2) throw store_error("idem: Redis TIME gave no time");
        return detail::parse_int(reply.elements[0].str) * 1000 +
               detail::parse_int(reply.elements[1].str) / 1000;
    }

    std::vector<std::string> scan(const std::string& pattern) {
        std::vector<std::string> keys;
        std::string cursor = "0";
        do {
            RedisReply reply = with_connection([&](RedisConnection& c) {
                return c.checked({"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"}, "SCAN");
            });
            if (reply.elements.size() != 2) throw store_error("idem: Redis SCAN: unexpected reply");
            cursor = reply.elements[0].str;
            for (auto& key : reply.elements[1].elements)
                keys.push_back(std::move(key.str));
        } while (cursor != "0");
        std::sort(keys.begin(), keys.end());  // SCAN may return a key twice
        keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
        return keys;
    }

    static std::vector<std::vector<std::string>> batches(std::vector<std::string> keys) {
        std::vector<std::vector<std::string>> out;
        constexpr std::size_t size = 256;
        for (std::size_t i = 0; i < keys.size(); i += size) {
            out.emplace_back(
                std::make_move_iterator(keys.begin() + static_cast<std::ptrdiff_t>(i)),
                std::make_move_iterator(
                    keys.begin() + static_cast<std::ptrdiff_t>(std::min(keys.size(), i + size))));
        }
        return out;
    }

    void check_script(const RedisReply& reply, const char* what) const {
        if (reply.is_error()) {
            throw store_error(fmt::format("idem: Redis {} script failed on {}: {}", what,
                                          endpoint_.describe(), reply.str));
        }
    }

    /// Reads `INFO persistence` (and `CONFIG GET appendfsync` when CONFIG answers) once per
    /// store; refuses a server without AOF.
    void check_persistence(RedisConnection& connection) {
        RedisPersistence found;
        const RedisReply info = connection.command({"INFO", "persistence"});
        if (info.is_error() || info.type != RedisReply::Type::string) {
            throw usage_error(fmt::format(
                "idem::RedisStore: cannot tell whether Redis at {} persists claims (INFO "
                "persistence: {}); enable AOF (appendonly yes) and allow INFO, or set "
                "RedisOptions::accept_no_persistence to run without it and accept that a "
                "restart re-runs effects",
                endpoint_.describe(), info.is_error() ? info.str : "no answer"));
        }
        found.aof_enabled = info.str.find("aof_enabled:1") != std::string::npos;
        const RedisReply config = connection.command({"CONFIG", "GET", "appendfsync"});
        if (config.is_array() && config.elements.size() == 2) {
            found.appendfsync = config.elements[1].str;
        }
        {
            std::lock_guard<std::mutex> lock(pool_mutex_);
            persistence_ = found;
        }
        if (!found.aof_enabled) {
            throw usage_error(fmt::format(
                "idem::RedisStore: Redis at {} has no append-only file (aof_enabled:0): a restart "
                "would lose the claims written since the last snapshot and redeliveries would run "
                "those effects again. Enable AOF (appendonly yes, appendfsync always or everysec), "
                "or set RedisOptions::accept_no_persistence to accept the risk",
                endpoint_.describe()));
        }
        persistence_checked_.store(true, std::memory_order_release);
    }

    /// A pooled connection, or a new one while fewer than max_connections are open; else waits.
    std::unique_ptr<RedisConnection> acquire() {
        std::unique_ptr<RedisConnection> connection;
        bool ping = false;
        {
            std::unique_lock<std::mutex> lock(pool_mutex_);
            forget_inherited_pool();
            const auto deadline = std::chrono::steady_clock::now() + options_.pool_wait_timeout;
            while (idle_.empty() && in_use_ >= options_.max_connections) {
                if (pool_free_.wait_until(lock, deadline) == std::cv_status::timeout &&
                    idle_.empty() && in_use_ >= options_.max_connections) {
                    throw store_timeout(fmt::format(
                        "idem::RedisStore: all {} connections to {} stayed in use for {} ms "
                        "(RedisOptions::max_connections, pool_wait_timeout)",
                        options_.max_connections, endpoint_.describe(),
                        options_.pool_wait_timeout.count()));
                }
                forget_inherited_pool();
            }
            ++in_use_;
            if (!idle_.empty()) {
                Idle& last = idle_.back();
                ping = std::chrono::steady_clock::now() - last.since >= options_.ping_idle_after;
                connection = std::move(last.connection);
                idle_.pop_back();
            }
        }
        if (connection) {
            if (ping && connection->connected()) check_alive(*connection);
            return connection;
        }
        try {
            return std::make_unique<RedisConnection>(endpoint_);
        } catch (...) {
            give_back(nullptr);
            throw;
        }
    }

    /// PING: a connection the server or the network closed while it was idle is dropped here
    /// (the next command reconnects) rather than failing the caller's command.
    static void check_alive(RedisConnection& connection) noexcept {
        try {
            const RedisReply pong = connection.command({"PING"});
            if (pong.is_error()) connection.disconnect();
        } catch (...) {  // command() dropped the connection already
            connection.disconnect();
        }
    }

    /// After fork(), the pool (its idle connections, its count of those in use) is the parent's:
    /// the child starts an empty pool. Called with pool_mutex_ held.
    void forget_inherited_pool() noexcept {
        const pid_t pid = ::getpid();
        if (pid == pool_pid_) return;
        pool_pid_ = pid;
        idle_.clear();  // each closes only this process's copy of its socket
        in_use_ = 0;
    }

    void give_back(std::unique_ptr<RedisConnection> connection) noexcept {
        {
            std::lock_guard<std::mutex> lock(pool_mutex_);
            if (in_use_ > 0) --in_use_;
            if (connection && idle_.size() < max_idle_connections) {
                try {
                    idle_.push_back(Idle{std::move(connection), std::chrono::steady_clock::now()});
                } catch (...) {  // a connection that cannot be pooled is closed
                }
            }
        }
        pool_free_.notify_one();
    }

    static constexpr std::size_t max_idle_connections = 16;

    struct Idle {
        std::unique_ptr<RedisConnection> connection;
        std::chrono::steady_clock::time_point since;
    };

    RedisEndpoint endpoint_;
    RedisOptions options_;
    mutable std::mutex pool_mutex_;
    std::condition_variable pool_free_;
    std::vector<Idle> idle_;
    std::size_t in_use_ = 0;
    pid_t pool_pid_ = ::getpid();
    std::atomic<bool> persistence_checked_{false};
    std::optional<RedisPersistence> persistence_;
    std::atomic<std::size_t> round_trips_{0};
    std::atomic<bool> claim_with_set_{true};
};

/// @brief One handler run's claims and queued writes; frees its leases in its destructor unless
/// committed. Never throws from the destructor.
class RedisStore::Transaction {
  public:
    Transaction(Transaction&& other) noexcept
        : store_(std::exchange(other.store_, nullptr)),
          token_(std::move(other.token_)),
          lease_(other.lease_),
          retention_(other.retention_),
          claims_(std::move(other.claims_)),
          letters_(std::move(other.letters_)),
          commands_(std::move(other.commands_)),
          command_count_(other.command_count_),
          savepoints_(std::move(other.savepoints_)),
          locks_(std::move(other.locks_)),
          released_(std::move(other.released_)),
          ack_(std::exchange(other.ack_, nullptr)),
          acks_(std::exchange(other.acks_, nullptr)) {}
    Transaction& operator=(Transaction&&) = delete;
    Transaction(const Transaction&) = delete;
    Transaction& operator=(const Transaction&) = delete;
    ~Transaction() { rollback(); }

    /// @brief The handler passes its policy's lease and retention before claiming.
    void set_terms(const ClaimTerms& terms) {
        active();
        lease_ = terms.lease.value_or(store_->options_.lease);
        if (terms.retention.count() > 0) retention_ = terms.retention;
    }

    /// @brief One round trip (two for an id another worker holds or released). For a claim:
    /// ClaimResult::attempts is how many times the effect started (this time included), which
    /// the handler's poison check uses.
    ClaimResult claim(std::string_view scope, std::string_view id,
                      std::string_view fingerprint = {}) {
        active();
        if (auto own = own_claim(scope, id)) return *own;
        std::vector<ClaimResult> results =
            claim_all(scope, &id, 1, fingerprint.empty() ? nullptr : &fingerprint);
        return results.front();
    }

    /// @brief Claims many ids of one scope in ONE round trip (pipelined SETs; one more for the
    /// ids other workers hold or released, together); results in order. An id repeated in @p ids is
    /// a duplicate of its first copy. @p fingerprints is empty or one per id. Used by
    /// IdempotentHandler::handle_batch. The keys of different ids are in different Cluster
    /// slots: on a Cluster, handle one message per transaction (docs/redis.md).
    std::vector<ClaimResult> claim_many(std::string_view scope,
                                        const std::vector<std::string_view>& ids,
                                        const std::vector<std::string>& fingerprints = {}) {
        active();
        if (!fingerprints.empty() && fingerprints.size() != ids.size()) {
            throw usage_error("idem::RedisStore: claim_many() needs one fingerprint per id");
        }
        if (ids.empty()) return {};
        std::vector<std::string_view> fps(fingerprints.begin(), fingerprints.end());
        return claim_all(scope, ids.data(), ids.size(), fps.empty() ? nullptr : fps.data());
    }

    /// @brief Gives back a claim this transaction holds without completing it (a batch message
    /// that failed): its lease is freed by the commit, or by the rollback.
    void unclaim(std::string_view scope, std::string_view id) {
        active();
        const std::size_t index = find_held(scope, id);
        if (index == claims_.size()) return;
        released_.push_back(claims_[index].key);
        claims_.erase(claims_.begin() + static_cast<std::ptrdiff_t>(index));
        for (auto& mark : savepoints_)
            mark.claims = std::min(mark.claims, claims_.size());
    }

    void record_outcome(std::string_view scope, std::string_view id, Disposition disposition,
                        std::string_view reason) {
        active();
        const std::size_t index = find_held(scope, id);
        if (index < claims_.size()) {
            claims_[index].outcome = to_string(disposition);
            claims_[index].reason = std::string(reason);
            return;
        }
        throw usage_error(
            "idem::RedisStore: record_outcome() for a claim this transaction does not hold");
    }

    void dead_letter(const DeadLetter& letter) {
        active();
        letters_.push_back(letter);
    }

    /// @brief Queues a Redis write (binary-safe arguments: text, idem::Blob, integers) that runs
    /// at commit, atomically with the completion, and only if every lease is still ours.
    /// Redis cannot undo a command that fails inside the commit: keep these to commands that
    /// cannot fail on keys of the right type (SET, HSET, HINCRBY, SADD, XADD, ...).
    template <class... Args>
    void write(const Args&... args) {
        active();
        static_assert(sizeof...(Args) > 0, "idem: write() needs a command");
        // Encoded now, as the commit script reads it: argc, then the arguments.
        commands_.add(sizeof...(Args));
        (commands_.add(args), ...);
        ++command_count_;
    }

    /// @brief Runs a read now, outside the transaction (it does not see this transaction's
    /// queued writes). An error reply throws store_error.
    template <class... Args>
    RedisReply read(const Args&... args) {
        active();
        RedisArgs command;
        (command.add(args), ...);
        return store_->with_connection(
            [&](RedisConnection& c) { return c.checked(command, "read"); });
    }

    /// @brief Acks a stream entry in the commit (when stream and claims share a server).
    void ack_on_commit(std::string_view stream, std::string_view group, std::string_view entry) {
        write("XACK", stream, group, entry);
    }

    void savepoint() {
        active();
        savepoints_.push_back(
            Mark{commands_.mark(), command_count_, letters_.size(), claims_.size()});
    }
    /// @brief Drops the writes and dead letters queued since the latest savepoint, and frees the
    /// leases claimed since then (one round trip, only if there are any): a batch message that
    /// failed leaves nothing, not even its claim.
    void rollback_to_savepoint() {
        active();
        if (savepoints_.empty())
            throw usage_error("idem::RedisStore: no savepoint to roll back to");
        const Mark mark = savepoints_.back();
        savepoints_.pop_back();
        commands_.truncate(mark.commands);
        command_count_ = mark.command_count;
        letters_.resize(mark.letters);
        if (claims_.size() > mark.claims) {
            RedisArgs keys;
            for (std::size_t i = mark.claims; i < claims_.size(); ++i)
                keys.add(claims_[i].key);
            claims_.resize(mark.claims);
            store_->check_script(release(keys), "release");
        }
    }
    void release_savepoint() {
        active();
        if (savepoints_.empty()) throw usage_error("idem::RedisStore: no savepoint to release");
        savepoints_.pop_back();
    }

    /// @brief Overlap lock held until the transaction ends; false when another holder has it.
    bool try_lock(std::string_view key, std::chrono::milliseconds expire_after) {
        active();
        if (!store_->hold_lock(key, token_, expire_after)) return false;
        locks_.emplace_back(key);
        return true;
    }

    /// @brief One round trip: checks the leases, applies the queued writes, stores dead letters
    /// and marks the claims done (each keeps the expiry its claim set: the retention).
    /// @throws commit_failed when a lease was lost (nothing written) or a write failed;
    /// store_unavailable / store_timeout when Redis could not be reached (outcome unknown: the
    /// lease then expires, or the commit did happen and a redelivery is a duplicate).
    void commit() {
        active();
        // The script's KEYS, then its ARGV (layout at redis_complete_source()), encoded once.
        RedisArgs call;
        call.reserve(256 + 96 * claims_.size() + commands_.resp().size());
        for (const auto& held : claims_)
            call.add(held.key);
        for (const auto& letter : letters_)
            call.add(store_->dead_letter_key(letter.scope, letter.message_id));
        for (const auto& key : released_)
            call.add(key);
        const std::size_t num_keys = call.count();

        call.add(store_->now_arg()).add(token_).add(claims_.size());
        bool dead_lettered = !letters_.empty();
        const std::string* dead_letter_reason = nullptr;
        for (const auto& held : claims_) {
            call.add(held.outcome.empty() ? std::string_view("in_progress") : held.outcome)
                .add(held.reason);
            if (held.outcome == to_string(Disposition::dead_lettered)) {
                dead_lettered = true;
                dead_letter_reason = &held.reason;
            }
        }
        call.add(letters_.size());
        for (const auto& letter : letters_) {
            call.add(letter.scope)
                .add(letter.message_id)
                .add(letter.delivery_count)
                .add(letter.reason)
                .add(letter.payload);
            if (letter.created_at == std::chrono::system_clock::time_point{}) {
                call.add(std::string_view());
            } else {
                call.add(detail::to_unix_ms(letter.created_at));
            }
            dead_letter_reason = &letter.reason;
        }
        // The consumer's acks (and dead-letter stream entries) run after the effect's writes.
        Commands acks;
        if (ack_ != nullptr) {
            if (dead_lettered && !ack_->dead_letter_stream.empty()) {
                const std::string none;
                const std::string& scope = claims_.empty()
                                               ? (letters_.empty() ? none : letters_[0].scope)
                                               : claims_[0].scope;
                const std::string& id = claims_.empty()
                                            ? (letters_.empty() ? none : letters_[0].message_id)
                                            : claims_[0].id;
                acks.add(detail::stream_dead_letter_command(
                    ack_->dead_letter_stream, ack_->entry_id, ack_->fields,
                    dead_letter_reason != nullptr ? *dead_letter_reason : none, scope, id,
                    ack_->delivery_count));
            }
            acks.add({"XACK", ack_->stream, ack_->group, ack_->entry_id});
        }
        const std::vector<StreamAck*> batch_acked =
            acks_ != nullptr ? batch_ack_commands(acks) : std::vector<StreamAck*>{};
        call.add(command_count_ + acks.count).append(commands_).append(acks.args);

        RedisReply reply = store_->with_connection([&](RedisConnection& c) {
            return c.eval(detail::redis_complete_script(), num_keys, call);
        });
        store_->check_script(reply, "commit");
        if (reply.type == RedisReply::Type::string && reply.str == "ok") {
            if (ack_ != nullptr) ack_->acked = true;
            for (StreamAck* acked : batch_acked)
                acked->acked = true;
            claims_.clear();  // done: nothing left to release
            released_.clear();
            finish();
            return;
        }
        const std::string status = reply.elements.empty() ? std::string() : reply.elements[0].str;
        if (status == "lease_lost") {
            const std::size_t index =
                static_cast<std::size_t>(detail::parse_int(reply.elements.at(1).str)) - 1;
            const auto& held = claims_.at(index);
            std::string message = fmt::format(
                "lease lost: the claim on {}/{} expired and another worker took it over ({}); "
                "nothing was written",
                held.scope, held.id,
                reply.elements.at(2).str == "leased" ? "it holds it now"
                                                     : reply.elements.at(2).str);
            rollback();
            throw commit_failed(message);
        }
        if (status == "partial") {
            claims_.clear();  // parked by the script: not ours to release any more
            std::string message = reply.elements.at(2).str;
            rollback();
            throw commit_failed(message +
                                "; the claim is parked as a dead letter so a "
                                "redelivery does not apply them twice");
        }
        std::string detail = reply.elements.size() > 2 ? reply.elements[2].str : "unknown reply";
        rollback();
        throw commit_failed(fmt::format(
            "a Redis write of the commit failed before anything was applied: {}", detail));
    }

    /// @brief Frees this transaction's leases and locks. A no-op after commit. Never throws:
    /// if Redis is unreachable the leases simply expire.
    void rollback() noexcept {
        if (store_ == nullptr) return;
        try {
            if (!claims_.empty() || !released_.empty()) {
                RedisArgs keys;
                for (const auto& key : released_)
                    keys.add(key);
                for (const auto& held : claims_)
                    keys.add(held.key);
                (void)release(keys);
            }
        } catch (...) {  // unreachable: the lease expires on its own
        }
        finish();
    }

    /// @brief The token fencing this transaction's leases (for logs and tests).
    [[nodiscard]] const std::string& token() const noexcept { return token_; }
    [[nodiscard]] RedisStore& store() noexcept { return *store_; }

  private:
    friend class RedisStore;

    struct Claim {
        std::string scope;
        std::string id;
        std::string key;
        std::string fingerprint;
        std::string_view outcome;  ///< a Disposition's name (static text); empty: none yet
        std::string reason;
    };
    struct Mark {
        RedisArgs::Mark commands;
        std::size_t command_count;
        std::size_t letters;
        std::size_t claims;
    };
    /// Commands for the commit script, each as {argc, args...}.
    struct Commands {
        RedisArgs args;
        std::size_t count = 0;
        void add(const std::vector<std::string>& command) {
            args.add(command.size());
            for (const auto& arg : command)
                args.add(arg);
            ++count;
        }
        void add(std::initializer_list<std::string_view> command) {
            args.add(command.size());
            for (std::string_view arg : command)
                args.add(arg);
            ++count;
        }
    };

    /// The index of the claim held on (scope, id), or claims_.size(). Starts after the last one
    /// found: a batch records its outcomes in claim order, so each search is one step, not a
    /// scan (which made a batch of N cost N * N / 2 comparisons).
    std::size_t find_held(std::string_view scope, std::string_view id) const {
        const std::size_t n = claims_.size();
        for (std::size_t k = 0; k < n; ++k) {
            const std::size_t i = (last_found_ + 1 + k) % n;
            if (claims_[i].id == id && claims_[i].scope == scope) {
                last_found_ = i;
                return i;
            }
        }
        return n;
    }

    /// A claim this transaction already holds is a duplicate, still in progress.
    std::optional<ClaimResult> own_claim(std::string_view scope, std::string_view id) const {
        const std::size_t index = find_held(scope, id);
        if (index == claims_.size()) return std::nullopt;
        ClaimResult own;
        own.status = ClaimStatus::duplicate;
        own.recorded = Disposition::in_progress;
        own.fingerprint = claims_[index].fingerprint;
        return own;
    }

    /// Claims @p count ids in one round trip: a pipelined `SET … NX PX … GET` per id, which
    /// claims a new id outright and otherwise returns its record without writing. A finished id
    /// is then a duplicate, a second copy of an id of this call is this transaction's own; only
    /// the rest (leased by another worker, or released) go through the claim script, in one more
    /// round trip. Without SET claims (option off, or a server before 7.0) every id goes through
    /// the script. @p fingerprints is null or one per id.
    std::vector<ClaimResult> claim_all(std::string_view scope, const std::string_view* ids,
                                       std::size_t count, const std::string_view* fingerprints) {
        std::vector<Claim> held;
        held.reserve(count);
        for (std::size_t i = 0; i < count; ++i) {
            held.push_back(
                Claim{std::string(scope),
                      std::string(ids[i]),
                      store_->claim_key(scope, ids[i]),
                      fingerprints != nullptr ? std::string(fingerprints[i]) : std::string(),
                      {},
                      {}});
        }
        const std::size_t held_before = claims_.size();
        std::vector<ClaimResult> results(count);
        std::vector<std::size_t> contested;  // for the script
        if (store_->claim_with_set_.load(std::memory_order_relaxed)) {
            if (!claim_with_set(held, results, held_before, contested)) {
                contested.clear();  // the server refused SET … GET: nothing was written
                for (std::size_t i = 0; i < count; ++i)
                    contested.push_back(i);
            }
        } else {
            for (std::size_t i = 0; i < count; ++i)
                contested.push_back(i);
        }
        if (contested.empty()) return results;

        RedisArgs call;
        call.reserve(128 * contested.size() + 128);
        for (std::size_t i : contested)
            call.add(held[i].key);
        call.add(token_).add(lease_.count()).add(retention_ms()).add(store_->now_arg());
        for (std::size_t i : contested)
            call.add(
                detail::RedisClaimRecord::fields(held[i].fingerprint, held[i].scope, held[i].id));
        RedisReply reply = store_->with_connection([&](RedisConnection& c) {
            return c.eval(detail::redis_claim_script(), contested.size(), call);
        });
        store_->check_script(reply, "claim");
        std::vector<RedisReply> one;  // one id: the script answers it alone
        if (contested.size() == 1) one.push_back(std::move(reply));
        std::vector<RedisReply>& answers = contested.size() == 1 ? one : reply.elements;
        if (answers.size() != contested.size()) {
            throw store_error("idem: Redis claim script: unexpected reply");
        }
        // An id this transaction held before the call is its own duplicate; a second copy of an
        // id in this call the script already answers so (the first copy made the lease ours).
        for (std::size_t k = 0; k < contested.size(); ++k) {
            const std::size_t i = contested[k];
            std::optional<ClaimResult> own;
            if (held_before > 0) own = own_claim(held[i].scope, held[i].id);
            results[i] = own ? *own : take(std::move(held[i]), answers[k]);
        }
        return results;
    }

    /// The SET round trip of claim_all(). Decides what it can into @p results and lists the
    /// rest in @p contested; false (nothing decided, nothing written) when the server does not
    /// know `SET … NX … GET`, which then stays off for this store.
    bool claim_with_set(std::vector<Claim>& held, std::vector<ClaimResult>& results,
                        std::size_t held_before, std::vector<std::size_t>& contested) {
        // A new record: attempt 1, claimed and leased now — the server's now, which a plain SET
        // cannot read, so the times say "the expiry minus the retention" (see redis_lua_now).
        const std::string now = store_->now_arg();
        const std::string retention = std::to_string(retention_ms());
        std::string head = "leased|" + token_ + "||1|";
        if (now.empty()) {
            head += '~' + retention + "|~" + retention;
        } else {
            head += now + '|' + now;
        }
        head += '|' + std::to_string(lease_.count()) + '|';
        std::vector<RedisArgs> sets(held.size());
        for (std::size_t i = 0; i < held.size(); ++i) {
            sets[i]
                .add("SET")
                .add(held[i].key)
                .add(head + detail::RedisClaimRecord::fields(held[i].fingerprint, held[i].scope,
                                                             held[i].id))
                .add("NX")
                .add("PX")
                .add(retention)
                .add("GET");
        }
        std::vector<RedisReply> replies =
            store_->with_connection([&](RedisConnection& c) { return c.pipeline(sets); });
        if (!replies.empty() && replies[0].is_error() &&
            replies[0].str.rfind("ERR syntax error", 0) == 0) {
            store_->claim_with_set_.store(false, std::memory_order_relaxed);
            return false;
        }
        const RedisReply* error = nullptr;  // thrown once the claims that went in are ours
        for (std::size_t i = 0; i < held.size(); ++i) {
            RedisReply& reply = replies[i];
            if (reply.is_error()) {
                if (error == nullptr) error = &reply;
                continue;
            }
            std::optional<ClaimResult> own;
            if (held_before > 0) own = own_claim(held[i].scope, held[i].id);
            if (own) {
                results[i] = *own;
                continue;
            }
            if (reply.is_nil()) {  // a new claim: attempt 1
                results[i].status = ClaimStatus::claimed;
                results[i].fingerprint = held[i].fingerprint;
                results[i].attempts = 1;
                claims_.push_back(std::move(held[i]));
                continue;
            }
            auto record = detail::RedisClaimRecord::decode(reply.str);
            if (!record) {
                if (error == nullptr) error = &reply;
                continue;
            }
            const bool mine = record->state == "leased" && record->token == token_;
            if (record->state == "done" || mine) {  // finished, or a second copy of ours
                results[i].status = ClaimStatus::duplicate;
                // A done record without an outcome name reads as processed, as in the script.
                results[i].recorded =
                    mine ? Disposition::in_progress : disposition_from(record->outcome);
                results[i].fingerprint = std::move(record->fingerprint);
                results[i].attempts = record->attempts;
                continue;
            }
            contested.push_back(i);
        }
        if (error != nullptr) {
            throw store_error(
                fmt::format("idem: Redis claim (SET … NX GET): {}",
                            error->is_error() ? error->str : "unreadable claim record"));
        }
        return true;
    }

    /// Reads one id's answer: 1 for a new claim, else {status, detail, fingerprint, attempts}.
    /// A claimed id joins this transaction's leases.
    ClaimResult take(Claim held, RedisReply& answer) {
        ClaimResult result;
        if (answer.type == RedisReply::Type::integer) {  // a new claim: attempt 1
            result.status = ClaimStatus::claimed;
            result.fingerprint = held.fingerprint;
            result.attempts = 1;
            claims_.push_back(std::move(held));
            return result;
        }
        if (!answer.is_array() || answer.elements.size() != 4) {
            throw store_error("idem: Redis claim script: unexpected reply");
        }
        const std::string& status = answer.elements[0].str;
        result.fingerprint = std::move(answer.elements[2].str);
        result.attempts = static_cast<std::uint32_t>(detail::parse_int(answer.elements[3].str));
        if (status == "duplicate") {
            result.status = ClaimStatus::duplicate;
            result.recorded = disposition_from(answer.elements[1].str);
        } else if (status == "in_progress") {
            result.status = ClaimStatus::in_progress;
        } else {
            result.status = ClaimStatus::claimed;
            claims_.push_back(std::move(held));
        }
        return result;
    }

    /// Frees the leases of @p keys that this transaction's token still holds.
    RedisReply release(const RedisArgs& keys) {
        RedisArgs call = keys;
        call.add(token_);
        return store_->with_connection([&](RedisConnection& c) {
            return c.eval(detail::redis_release_script(), keys.count(), call);
        });
    }

    explicit Transaction(RedisStore& store) : Transaction(store, store.take_pending_acks()) {}
    Transaction(RedisStore& store, Pending pending)
        : store_(&store),
          token_(detail::new_lease_token()),
          lease_(store.options_.lease),
          retention_(store.options_.retention),
          ack_(pending.ack),
          acks_(pending.acks) {}

    /// A batch's acks: adds to @p out the dead-letter stream entries and then the XACKs of the
    /// entries this commit completes, and returns those entries. For each (scope, message id): a
    /// claim with a final outcome is the id's first entry's (claims go to an id's first copy;
    /// later copies are its duplicates, acked by the caller); without a claim, dead letters pair
    /// with the entries in order when there is exactly one per entry (a malformed entry, an id
    /// reused with another payload). Anything else is left alone.
    std::vector<StreamAck*> batch_ack_commands(Commands& out) {
        // Entries and dead letters grouped by (scope, message id), in one pass each.
        auto group_key = [](std::string_view scope, std::string_view id) {
            std::string key = std::to_string(scope.size());
            key += ':';
            key.append(scope).append(id);
            return key;
        };
        std::vector<std::string> order;
        std::unordered_map<std::string, std::vector<StreamAck*>> copies_of;
        for (auto& ack : *acks_) {
            auto [it, added] = copies_of.try_emplace(group_key(ack.scope, ack.message_id));
            if (added) order.push_back(it->first);
            it->second.push_back(&ack);
        }
        std::unordered_map<std::string, std::vector<const DeadLetter*>> letters_of;
        for (const auto& letter : letters_)
            letters_of[group_key(letter.scope, letter.message_id)].push_back(&letter);

        std::vector<StreamAck*> acked;
        Commands xacks;
        auto add = [&](StreamAck& ack, const std::string* dead_letter_reason) {
            if (dead_letter_reason != nullptr && !ack.dead_letter_stream.empty()) {
                out.add(detail::stream_dead_letter_command(
                    ack.dead_letter_stream, ack.entry_id, ack.fields, *dead_letter_reason,
                    ack.scope, ack.message_id, ack.delivery_count));
            }
            xacks.add({"XACK", ack.stream, ack.group, ack.entry_id});
            acked.push_back(&ack);
        };
        for (const std::string& key : order) {
            const std::vector<StreamAck*>& copies = copies_of[key];
            StreamAck& first = *copies.front();
            const std::size_t held = find_held(first.scope, first.message_id);
            if (held < claims_.size()) {
                const Claim& claim = claims_[held];
                Disposition outcome = Disposition::in_progress;
                if (claim.outcome.empty() || !from_string(claim.outcome, outcome)) continue;
                if (outcome == Disposition::dead_lettered) {
                    add(first, &claim.reason);
                } else if (outcome == Disposition::processed || outcome == Disposition::rejected) {
                    add(first, nullptr);
                }
                continue;
            }
            auto letters = letters_of.find(key);
            if (letters != letters_of.end() && letters->second.size() == copies.size()) {
                for (std::size_t k = 0; k < copies.size(); ++k)
                    add(*copies[k], &letters->second[k]->reason);
            }
        }
        // Dead-letter entries before any XACK: one that fails leaves every entry pending.
        out.args.append(xacks.args);
        out.count += xacks.count;
        return acked;
    }

    void active() const {
        if (store_ == nullptr)
            throw usage_error(
                "idem::RedisStore: the transaction is already committed or rolled "
                "back");
    }
    [[nodiscard]] long long retention_ms() const {
        return std::chrono::duration_cast<std::chrono::milliseconds>(retention_).count();
    }

    /// Releases overlap locks (best effort: they expire anyway) and ends the transaction.
    void finish() noexcept {
        RedisStore* store = std::exchange(store_, nullptr);
        if (store == nullptr) return;
        for (const auto& key : locks_) {
            try {
                store->release_lock(key, token_);
            } catch (...) {  // expires by itself
            }
        }
        claims_.clear();
        released_.clear();
        locks_.clear();
    }

    RedisStore* store_;
    std::string token_;
    std::chrono::milliseconds lease_;
    std::chrono::seconds retention_;
    std::vector<Claim> claims_;
    std::vector<DeadLetter> letters_;
    RedisArgs commands_;  ///< the queued writes, encoded for the commit script
    std::size_t command_count_ = 0;
    std::vector<Mark> savepoints_;
    std::vector<std::string> locks_;
    std::vector<std::string> released_;  ///< keys of unclaim()ed leases, freed at the end
    StreamAck* ack_ = nullptr;
    std::vector<StreamAck>* acks_ = nullptr;  ///< a batch's entries (AckWithNextCommit)
    mutable std::size_t last_found_ = 0;      ///< find_held()'s hint
};

inline RedisStore::Transaction RedisStore::begin() {
    return Transaction(*this);
}

IDEM_END_NAMESPACE
