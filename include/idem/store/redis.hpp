#pragma once
/// @file
/// @brief RedisStore: claims held as leases in Redis, taken in one round trip (a Lua script) and
/// completed by compare-and-set on the lease's token. Redis-side writes of the effect (and the
/// stream XACK when the broker is the same Redis) commit atomically with the completion. Link
/// idem::redis. See docs/redis.md.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
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

// Claim record: a hash. state: leased | done | free (released: the lease is gone, the attempt
// count stays). Times are milliseconds since the epoch; ARGV "now" is empty to use the server's
// clock. Numbers are formatted with %.0f: Lua numbers are doubles.
inline constexpr const char* redis_now_lua = R"(
local function now_ms(arg)
  local n = tonumber(arg)
  if n then return n end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function num(x) return string.format('%.0f', x) end
)";

// KEYS[1] claim. ARGV: token, lease_ms, retention_ms, now, fingerprint, scope, id.
// Returns {status, detail, fingerprint, attempts}.
inline const std::string& redis_claim_source() {
    static const std::string source = std::string(redis_now_lua) + R"(
local now = now_ms(ARGV[4])
local r = redis.call('HMGET', KEYS[1], 'state', 'token', 'lease_until', 'attempts', 'outcome', 'fp')
local state = r[1]
if state == 'done' then
  return {'duplicate', r[5] or 'processed', r[6] or '', r[4] or '0'}
end
if state == 'leased' then
  if r[2] == ARGV[1] then return {'duplicate', 'in_progress', r[6] or '', r[4] or '0'} end
  local lease_until = tonumber(r[3]) or 0
  if lease_until > now then
    return {'in_progress', num(lease_until - now), r[6] or '', r[4] or '0'}
  end
end
local attempts = (tonumber(r[4]) or 0) + 1
local lease_until = num(now + tonumber(ARGV[2]))
if state then
  redis.call('HSET', KEYS[1], 'state', 'leased', 'token', ARGV[1], 'lease_until', lease_until,
             'attempts', num(attempts))
else
  redis.call('HSET', KEYS[1], 'state', 'leased', 'token', ARGV[1], 'lease_until', lease_until,
             'attempts', num(attempts), 'scope', ARGV[6], 'id', ARGV[7], 'claimed_at', num(now),
             'fp', ARGV[5])
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {'claimed', state or '', r[6] or ARGV[5], num(attempts)}
)";
    return source;
}

// KEYS: per claim its record and its dead-letter stream, then one stream per extra dead letter.
// ARGV: now, retention_ms, n_claims, {token, outcome, reason} * n_claims, n_letters,
// {scope, id, delivery_count, reason, payload, created_at} * n_letters, n_commands,
// {argc, args...} * n_commands, token; then KEYS ends with leases to free (unclaimed).
// Every lease is checked before anything is written: a lost lease writes nothing.
inline const std::string& redis_complete_source() {
    static const std::string source = std::string(redis_now_lua) + R"(
local now = now_ms(ARGV[1])
local i = 3
local n_claims = tonumber(ARGV[i]); i = i + 1
local claims = {}
for c = 1, n_claims do
  local r = redis.call('HMGET', KEYS[2 * c - 1], 'state', 'token')
  if r[1] ~= 'leased' or r[2] ~= ARGV[i] then
    return {'lease_lost', tostring(c), r[1] or 'gone'}
  end
  claims[c] = {ARGV[i + 1], ARGV[i + 2]}
  i = i + 3
end
local n_letters = tonumber(ARGV[i]); i = i + 1
local letters = {}
for d = 1, n_letters do
  letters[d] = {ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[i + 5]}
  i = i + 6
end
local function add_letter(key, scope, id, count, reason, payload, created_at)
  local t = redis.call('TIME')
  redis.call('XADD', key, '*', 'scope', scope, 'id', id, 'delivery_count', count,
             'reason', reason, 'payload', payload, 'created_at', created_at,
             'order_us', t[1] .. string.format('%06d', tonumber(t[2])))
end
local n_commands = tonumber(ARGV[i]); i = i + 1
for k = 1, n_commands do
  local argc = tonumber(ARGV[i]); i = i + 1
  local args = {}
  for a = 1, argc do args[a] = ARGV[i]; i = i + 1 end
  local result = redis.pcall(unpack(args))
  if type(result) == 'table' and result.err then
    if k == 1 then return {'command_failed', '1', result.err} end
    -- Redis cannot undo commands 1..k-1: park the claims so a redelivery does not apply them a
    -- second time, and leave a dead letter for a human.
    local why = 'Redis command ' .. k .. ' of the commit (' .. args[1] .. ') failed after ' ..
                (k - 1) .. ' had been applied (Redis cannot roll back): ' .. result.err
    for c = 1, n_claims do
      local rec = redis.call('HMGET', KEYS[2 * c - 1], 'scope', 'id', 'attempts')
      redis.call('HSET', KEYS[2 * c - 1], 'state', 'done', 'outcome', 'dead_lettered',
                 'reason', why, 'finished_at', num(now))
      redis.call('HDEL', KEYS[2 * c - 1], 'token', 'lease_until')
      add_letter(KEYS[2 * c], rec[1] or '', rec[2] or '', rec[3] or '0', why, '', num(now))
    end
    return {'partial', tostring(k), why}
  end
end
for d = 1, n_letters do
  local created = letters[d][6]
  if created == '' then created = num(now) end
  add_letter(KEYS[2 * n_claims + d], letters[d][1], letters[d][2], letters[d][3], letters[d][4],
             letters[d][5], created)
end
for c = 1, n_claims do
  local key = KEYS[2 * c - 1]
  redis.call('HSET', key, 'state', 'done', 'outcome', claims[c][1], 'reason', claims[c][2],
             'finished_at', num(now))
  redis.call('HDEL', key, 'token', 'lease_until')
  redis.call('PEXPIRE', key, ARGV[2])
end
-- Leases given back without completion (batch messages that failed): freed if still ours.
for k = 2 * n_claims + n_letters + 1, #KEYS do
  local r = redis.call('HMGET', KEYS[k], 'state', 'token')
  if r[1] == 'leased' and r[2] == ARGV[i] then
    redis.call('HSET', KEYS[k], 'state', 'free')
    redis.call('HDEL', KEYS[k], 'token', 'lease_until')
  end
end
return {'ok'}
)";
    return source;
}

// KEYS: claim records. ARGV: token. Frees only leases this token holds; attempts stay.
inline constexpr const char* redis_release_source = R"(
local freed = 0
for c = 1, #KEYS do
  local r = redis.call('HMGET', KEYS[c], 'state', 'token')
  if r[1] == 'leased' and r[2] == ARGV[1] then
    redis.call('HSET', KEYS[c], 'state', 'free')
    redis.call('HDEL', KEYS[c], 'token', 'lease_until')
    freed = freed + 1
  end
end
return freed
)";

// KEYS[1] lock. ARGV: owner, expire_ms, now. 1: taken (or renewed by its owner), 0: held.
inline const std::string& redis_lock_source() {
    static const std::string source = std::string(redis_now_lua) + R"(
local now = now_ms(ARGV[3])
local r = redis.call('HMGET', KEYS[1], 'owner', 'expires_at')
if r[1] and r[1] ~= ARGV[1] and (tonumber(r[2]) or 0) > now then return 0 end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'expires_at', num(now + tonumber(ARGV[2])))
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
    static const std::string source = std::string(redis_now_lua) + R"(
local now = now_ms(ARGV[2])
local cutoff = tonumber(ARGV[1])
local claims, released = 0, 0
for c = 1, #KEYS do
  local r = redis.call('HMGET', KEYS[c], 'claimed_at', 'state', 'lease_until')
  local claimed_at = tonumber(r[1])
  if claimed_at and claimed_at < cutoff and
     not (r[2] == 'leased' and (tonumber(r[3]) or 0) > now) then
    redis.call('DEL', KEYS[c])
    if r[2] == 'free' then released = released + 1 else claims = claims + 1 end
  end
end
return {claims, released}
)";
    return source;
}

// KEYS: locks. ARGV: now. Deletes locks whose expiry is before now.
inline const std::string& redis_purge_locks_source() {
    static const std::string source = std::string(redis_now_lua) + R"(
local now = now_ms(ARGV[1])
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
    static const RedisScript script{"release", redis_release_source};
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

inline std::int64_t to_ms(std::chrono::system_clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
}
inline std::chrono::system_clock::time_point from_ms(std::int64_t ms) {
    return std::chrono::system_clock::time_point{} +
           std::chrono::duration_cast<std::chrono::system_clock::duration>(
               std::chrono::milliseconds(ms));
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

/// 128 random bits as hex: the token that fences one transaction's leases.
inline std::string new_lease_token() {
    thread_local std::mt19937_64 generator{[] {
        std::random_device device;
        std::seed_seq seed{
            device(),
            device(),
            device(),
            device(),
            static_cast<unsigned>(std::hash<std::thread::id>{}(std::this_thread::get_id())),
            static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count())};
        return std::mt19937_64(seed);
    }()};
    return fmt::format("{:016x}{:016x}", generator(), generator());
}

}  // namespace detail

/// @brief Claims as leases in Redis (standalone, Sentinel, or Cluster with the notes of
/// docs/redis.md). Thread-safe: each call takes a connection from a small pool, so handlers on
/// several threads share one store.
///
/// - claim(): one round trip. Absent or released → leased to this transaction's token (the
///   attempt count goes up); finished → duplicate with the recorded outcome; leased and live →
///   in_progress; leased but expired → taken over with a new token.
/// - commit(): one round trip, a script that checks every lease is still ours, runs the queued
///   Redis writes (write(), the consumer's XACK), stores dead letters and marks the claims done
///   with the retention as expiry. A lease lost to another worker writes nothing and throws
///   commit_failed ("lease lost").
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
        if (options_.lease.count() <= 0) {
            throw usage_error("idem::RedisStore: the default lease must be positive");
        }
        if (options_.key_prefix.find_first_of("{}") != std::string::npos) {
            throw usage_error(
                "idem::RedisStore: the key prefix must not contain braces (they would change the "
                "keys' Cluster hash tags)");
        }
    }
    RedisStore(const RedisStore&) = delete;
    RedisStore& operator=(const RedisStore&) = delete;

    [[nodiscard]] const RedisEndpoint& endpoint() const noexcept { return endpoint_; }
    [[nodiscard]] const RedisOptions& options() const noexcept { return options_; }
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
        RedisReply reply = with_connection([&](RedisConnection& c) {
            return c.checked({"HGETALL", claim_key(scope, id)}, "HGETALL");
        });
        std::string state, outcome, reason, fingerprint, claimed_at;
        for (std::size_t i = 0; i + 1 < reply.elements.size(); i += 2) {
            const std::string& name = reply.elements[i].str;
            const std::string& value = reply.elements[i + 1].str;
            if (name == "state") state = value;
            if (name == "outcome") outcome = value;
            if (name == "reason") reason = value;
            if (name == "fp") fingerprint = value;
            if (name == "claimed_at") claimed_at = value;
        }
        if (state.empty() || state == "free") return std::nullopt;
        ClaimRecord record;
        record.scope = std::string(scope);
        record.message_id = std::string(id);
        record.disposition = Disposition::in_progress;
        if (state == "done") {
            record.disposition = disposition_from(outcome);
        }
        record.reason = std::move(reason);
        record.claimed_at = detail::from_ms(detail::parse_int(claimed_at));
        record.fingerprint = std::move(fingerprint);
        return record;
    }

    /// @brief How many times the effect started for this claim (0 when there is no record).
    std::uint32_t attempts(std::string_view scope, std::string_view id) {
        RedisReply reply = with_connection([&](RedisConnection& c) {
            return c.checked({"HGET", claim_key(scope, id), "attempts"}, "HGET");
        });
        return static_cast<std::uint32_t>(detail::parse_int(reply.str));
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
                        item.letter.created_at = detail::from_ms(detail::parse_int(value));
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

    /// @brief Runs @p fn with a pooled connection (reconnecting if it was dropped).
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
        return fn(*connection);
    }

    /// @brief Request/reply exchanges with Redis so far, over all pooled connections (a
    /// pipeline counts once): the cost tests and benchmarks check.
    [[nodiscard]] std::size_t round_trips() const noexcept {
        return round_trips_.load(std::memory_order_relaxed);
    }

    /// @brief Milliseconds since the epoch on the store's clock (the server's by default).
    std::int64_t now_ms() {
        return options_.clock ? detail::to_ms(options_.clock()) : server_now_ms();
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
        return options_.clock ? std::to_string(detail::to_ms(options_.clock())) : std::string();
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

    std::unique_ptr<RedisConnection> acquire() {
        {
            std::lock_guard<std::mutex> lock(pool_mutex_);
            if (!idle_.empty()) {
                auto connection = std::move(idle_.back());
                idle_.pop_back();
                return connection;
            }
        }
        return std::make_unique<RedisConnection>(endpoint_);
    }
    void give_back(std::unique_ptr<RedisConnection> connection) noexcept {
        if (!connection) return;
        try {
            std::lock_guard<std::mutex> lock(pool_mutex_);
            if (idle_.size() < max_idle_connections) idle_.push_back(std::move(connection));
        } catch (...) {  // a connection that cannot be pooled is closed
        }
    }

    static constexpr std::size_t max_idle_connections = 16;

    RedisEndpoint endpoint_;
    RedisOptions options_;
    std::mutex pool_mutex_;
    std::vector<std::unique_ptr<RedisConnection>> idle_;
    std::atomic<std::size_t> round_trips_{0};
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

    /// @brief One round trip. For a claim: ClaimResult::attempts is how many times the effect
    /// started (this time included), which the handler's poison check uses.
    ClaimResult claim(std::string_view scope, std::string_view id,
                      std::string_view fingerprint = {}) {
        active();
        if (auto own = own_claim(scope, id)) return *own;
        Claim held{std::string(scope),
                   std::string(id),
                   store_->claim_key(scope, id),
                   std::string(fingerprint),
                   {},
                   {}};
        RedisReply reply = store_->with_connection([&](RedisConnection& c) {
            return c.eval(detail::redis_claim_script(), {held.key}, claim_args(held));
        });
        return take(std::move(held), reply);
    }

    /// @brief Claims many ids of one scope in ONE round trip (pipelined scripts); results in
    /// order. An id repeated in @p ids is a duplicate of its first copy. @p fingerprints is
    /// empty or one per id. Used by IdempotentHandler::handle_batch.
    std::vector<ClaimResult> claim_many(std::string_view scope,
                                        const std::vector<std::string_view>& ids,
                                        const std::vector<std::string>& fingerprints = {}) {
        active();
        if (!fingerprints.empty() && fingerprints.size() != ids.size()) {
            throw usage_error("idem::RedisStore: claim_many() needs one fingerprint per id");
        }
        std::vector<Claim> held;
        std::vector<std::vector<std::string>> keys;
        std::vector<std::vector<std::string>> args;
        held.reserve(ids.size());
        for (std::size_t i = 0; i < ids.size(); ++i) {
            held.push_back(Claim{std::string(scope),
                                 std::string(ids[i]),
                                 store_->claim_key(scope, ids[i]),
                                 fingerprints.empty() ? std::string() : fingerprints[i],
                                 {},
                                 {}});
            keys.push_back({held.back().key});
            args.push_back(claim_args(held.back()));
        }
        std::vector<RedisReply> replies = store_->with_connection([&](RedisConnection& c) {
            return c.eval_many(detail::redis_claim_script(), keys, args);
        });
        std::vector<ClaimResult> results;
        results.reserve(ids.size());
        for (std::size_t i = 0; i < ids.size(); ++i) {
            // The script saw an earlier copy in this pipeline as our own lease: a duplicate.
            if (auto own = own_claim(scope, ids[i])) {
                results.push_back(*own);
                continue;
            }
            results.push_back(take(std::move(held[i]), replies[i]));
        }
        return results;
    }

    /// @brief Gives back a claim this transaction holds without completing it (a batch message
    /// that failed): its lease is freed by the commit, or by the rollback.
    void unclaim(std::string_view scope, std::string_view id) {
        active();
        for (auto it = claims_.begin(); it != claims_.end(); ++it) {
            if (it->scope == scope && it->id == id) {
                released_.push_back(it->key);
                claims_.erase(it);
                for (auto& mark : savepoints_)
                    mark.claims = std::min(mark.claims, claims_.size());
                return;
            }
        }
    }

    void record_outcome(std::string_view scope, std::string_view id, Disposition disposition,
                        std::string_view reason) {
        active();
        for (auto& held : claims_) {
            if (held.scope == scope && held.id == id) {
                held.outcome = std::string(to_string(disposition));
                held.reason = std::string(reason);
                return;
            }
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
        commands_.push_back(detail::redis_command(args...));
    }

    /// @brief Runs a read now, outside the transaction (it does not see this transaction's
    /// queued writes). An error reply throws store_error.
    template <class... Args>
    RedisReply read(const Args&... args) {
        active();
        auto command = detail::redis_command(args...);
        return store_->with_connection(
            [&](RedisConnection& c) { return c.checked(command, "read"); });
    }

    /// @brief Acks a stream entry in the commit (when stream and claims share a server).
    void ack_on_commit(std::string_view stream, std::string_view group, std::string_view entry) {
        write("XACK", stream, group, entry);
    }

    void savepoint() {
        active();
        savepoints_.push_back(Mark{commands_.size(), letters_.size(), claims_.size()});
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
        commands_.resize(mark.commands);
        letters_.resize(mark.letters);
        if (claims_.size() > mark.claims) {
            std::vector<std::string> keys;
            for (std::size_t i = mark.claims; i < claims_.size(); ++i)
                keys.push_back(claims_[i].key);
            claims_.resize(mark.claims);
            RedisReply reply = store_->with_connection([&](RedisConnection& c) {
                return c.eval(detail::redis_release_script(), keys, {token_});
            });
            store_->check_script(reply, "release");
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
    /// and marks the claims done (expiring after the retention).
    /// @throws commit_failed when a lease was lost (nothing written) or a write failed;
    /// store_unavailable / store_timeout when Redis could not be reached (outcome unknown: the
    /// lease then expires, or the commit did happen and a redelivery is a duplicate).
    void commit() {
        active();
        std::vector<std::string> keys;
        std::vector<std::string> args{store_->now_arg(), std::to_string(retention_ms()),
                                      std::to_string(claims_.size())};
        bool dead_lettered = !letters_.empty();
        std::string dead_letter_reason;
        for (const auto& held : claims_) {
            keys.push_back(held.key);
            keys.push_back(store_->dead_letter_key(held.scope, held.id));
            args.push_back(token_);
            args.push_back(held.outcome.empty() ? std::string("in_progress") : held.outcome);
            args.push_back(held.reason);
            if (held.outcome == to_string(Disposition::dead_lettered)) {
                dead_lettered = true;
                dead_letter_reason = held.reason;
            }
        }
        args.push_back(std::to_string(letters_.size()));
        for (const auto& letter : letters_) {
            keys.push_back(store_->dead_letter_key(letter.scope, letter.message_id));
            args.push_back(letter.scope);
            args.push_back(letter.message_id);
            args.push_back(std::to_string(letter.delivery_count));
            args.push_back(letter.reason);
            args.push_back(letter.payload);
            args.push_back(letter.created_at == std::chrono::system_clock::time_point{}
                               ? std::string()
                               : std::to_string(detail::to_ms(letter.created_at)));
            dead_letter_reason = letter.reason;
        }
        std::vector<std::vector<std::string>> commands = commands_;
        if (ack_ != nullptr) {
            if (dead_lettered && !ack_->dead_letter_stream.empty()) {
                const std::string scope =
                    claims_.empty() ? (letters_.empty() ? std::string() : letters_[0].scope)
                                    : claims_[0].scope;
                const std::string id =
                    claims_.empty() ? (letters_.empty() ? std::string() : letters_[0].message_id)
                                    : claims_[0].id;
                commands.push_back(detail::stream_dead_letter_command(
                    ack_->dead_letter_stream, ack_->entry_id, ack_->fields, dead_letter_reason,
                    scope, id, ack_->delivery_count));
            }
            commands.push_back({"XACK", ack_->stream, ack_->group, ack_->entry_id});
        }
        const std::vector<StreamAck*> batch_acked =
            acks_ != nullptr ? batch_ack_commands(commands) : std::vector<StreamAck*>{};
        args.push_back(std::to_string(commands.size()));
        for (const auto& command : commands) {
            args.push_back(std::to_string(command.size()));
            args.insert(args.end(), command.begin(), command.end());
        }
        args.push_back(token_);
        keys.insert(keys.end(), released_.begin(), released_.end());

        RedisReply reply = store_->with_connection([&](RedisConnection& c) {
            return c.eval(detail::redis_complete_script(), keys, args);
        });
        store_->check_script(reply, "commit");
        const std::string status = reply.elements.empty() ? std::string() : reply.elements[0].str;
        if (status == "ok") {
            if (ack_ != nullptr) ack_->acked = true;
            for (StreamAck* acked : batch_acked)
                acked->acked = true;
            claims_.clear();  // done: nothing left to release
            released_.clear();
            finish();
            return;
        }
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
                std::vector<std::string> keys = released_;
                for (const auto& held : claims_)
                    keys.push_back(held.key);
                store_->with_connection([&](RedisConnection& c) {
                    return c.eval(detail::redis_release_script(), keys, {token_});
                });
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
        std::string outcome;
        std::string reason;
    };
    struct Mark {
        std::size_t commands;
        std::size_t letters;
        std::size_t claims;
    };

    std::optional<ClaimResult> own_claim(std::string_view scope, std::string_view id) const {
        for (const auto& held : claims_) {
            if (held.scope == scope && held.id == id) {
                ClaimResult own;
                own.status = ClaimStatus::duplicate;
                own.recorded = Disposition::in_progress;
                own.fingerprint = held.fingerprint;
                return own;
            }
        }
        return std::nullopt;
    }

    std::vector<std::string> claim_args(const Claim& held) const {
        return {token_,
                std::to_string(lease_.count()),
                std::to_string(retention_ms()),
                store_->now_arg(),
                held.fingerprint,
                held.scope,
                held.id};
    }

    /// Reads the claim script's answer; a claimed id joins this transaction's leases.
    ClaimResult take(Claim held, const RedisReply& reply) {
        store_->check_script(reply, "claim");
        if (!reply.is_array() || reply.elements.size() != 4) {
            throw store_error("idem: Redis claim script: unexpected reply");
        }
        const std::string& status = reply.elements[0].str;
        ClaimResult result;
        result.fingerprint = reply.elements[2].str;
        result.attempts = static_cast<std::uint32_t>(detail::parse_int(reply.elements[3].str));
        if (status == "duplicate") {
            result.status = ClaimStatus::duplicate;
            result.recorded = disposition_from(reply.elements[1].str);
        } else if (status == "in_progress") {
            result.status = ClaimStatus::in_progress;
        } else {
            result.status = ClaimStatus::claimed;
            claims_.push_back(std::move(held));
        }
        return result;
    }

    explicit Transaction(RedisStore& store) : Transaction(store, store.take_pending_acks()) {}
    Transaction(RedisStore& store, Pending pending)
        : store_(&store),
          token_(detail::new_lease_token()),
          lease_(store.options_.lease),
          retention_(store.options_.retention),
          ack_(pending.ack),
          acks_(pending.acks) {}

    /// A batch's acks: appends, after the queued writes, the dead-letter stream entries and then
    /// the XACKs of the entries this commit completes, and returns those entries. For each
    /// (scope, message id): a claim with a final outcome is the id's first entry's (claims go to
    /// an id's first copy; later copies are its duplicates, acked by the caller); without a
    /// claim, dead letters pair with the entries in order when there is exactly one per entry
    /// (a malformed entry, an id reused with another payload). Anything else is left alone.
    std::vector<StreamAck*> batch_ack_commands(std::vector<std::vector<std::string>>& commands) {
        std::vector<StreamAck*> acked;
        std::vector<std::vector<std::string>> xacks;
        std::vector<bool> grouped(acks_->size(), false);
        for (std::size_t i = 0; i < acks_->size(); ++i) {
            if (grouped[i]) continue;
            const std::string& scope = (*acks_)[i].scope;
            const std::string& id = (*acks_)[i].message_id;
            std::vector<StreamAck*> copies;
            for (std::size_t j = i; j < acks_->size(); ++j) {
                if ((*acks_)[j].scope == scope && (*acks_)[j].message_id == id) {
                    grouped[j] = true;
                    copies.push_back(&(*acks_)[j]);
                }
            }
            std::vector<const DeadLetter*> letters;
            for (const auto& letter : letters_) {
                if (letter.scope == scope && letter.message_id == id) letters.push_back(&letter);
            }
            auto add = [&](StreamAck& ack, const std::string* dead_letter_reason) {
                if (dead_letter_reason != nullptr && !ack.dead_letter_stream.empty()) {
                    commands.push_back(detail::stream_dead_letter_command(
                        ack.dead_letter_stream, ack.entry_id, ack.fields, *dead_letter_reason,
                        ack.scope, ack.message_id, ack.delivery_count));
                }
                xacks.push_back({"XACK", ack.stream, ack.group, ack.entry_id});
                acked.push_back(&ack);
            };
            auto claim = std::find_if(claims_.begin(), claims_.end(), [&](const Claim& held) {
                return held.scope == scope && held.id == id;
            });
            if (claim != claims_.end()) {
                Disposition outcome = Disposition::in_progress;
                if (claim->outcome.empty() || !from_string(claim->outcome, outcome)) continue;
                if (outcome == Disposition::dead_lettered) {
                    add(*copies.front(), &claim->reason);
                } else if (outcome == Disposition::processed || outcome == Disposition::rejected) {
                    add(*copies.front(), nullptr);
                }
            } else if (!letters.empty() && letters.size() == copies.size()) {
                for (std::size_t k = 0; k < copies.size(); ++k)
                    add(*copies[k], &letters[k]->reason);
            }
        }
        // Dead-letter entries before any XACK: one that fails leaves every entry pending.
        commands.insert(commands.end(), std::make_move_iterator(xacks.begin()),
                        std::make_move_iterator(xacks.end()));
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
    std::vector<std::vector<std::string>> commands_;
    std::vector<Mark> savepoints_;
    std::vector<std::string> locks_;
    std::vector<std::string> released_;  ///< keys of unclaim()ed leases, freed at the end
    StreamAck* ack_ = nullptr;
    std::vector<StreamAck>* acks_ = nullptr;  ///< a batch's entries (AckWithNextCommit)
};

inline RedisStore::Transaction RedisStore::begin() {
    return Transaction(*this);
}

IDEM_END_NAMESPACE
