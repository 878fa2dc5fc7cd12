#pragma once
/// @file
/// @brief The Redis store's outbox: the intents a redrive writes (store/redis/redrive.hpp), one
/// hash per message in its claim's hash slot (`<prefix>o{<scope>:<id>}`), leased, marked sent or
/// failed by idem::Relay. Each version of an intent has an id of its own (a counter), and a
/// sorted set, the index (`<prefix>outbox{idem-outbox}`), lists the versions waiting, scored by
/// when they are due. The index is written before the intent and cleaned by the lease, never
/// trusted: an entry whose intent is gone, sent, parked or of another version is dropped when a
/// lease meets it. So an intent is never waiting without an entry, on one server or a Cluster
/// (where the index and the intent are in different slots and no script writes both).
/// Link idem::redis.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/records.hpp"
#include "idem/contract/time.hpp"
#include "idem/error.hpp"
#include "idem/store/redis/admin.hpp"
#include "idem/store/redis/context.hpp"
#include "idem/store/redis/scripts.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// KEYS: the counter, the index. ARGV: the intent's key. A new version's id, listed as due now.
inline constexpr const char* outbox_announce_source = R"(
local id = redis.call('INCR', KEYS[1])
redis.call('ZADD', KEYS[2], 0, string.format('%019d', id) .. ' ' .. ARGV[1])
return id
)";

/// KEYS: an intent. ARGV: version id, now, lease_ms. {'stale'} (gone, sent, parked or another
/// version), {'leased', until} (another relay holds it), {'later', due}, or {'taken', until,
/// field, value, ...} (leased to the caller until `until`).
inline const std::string& outbox_lease_source() {
    static const std::string source = lua({lua_int}) + R"(
local now = tonumber(ARGV[2])
local r = redis.call('HMGET', KEYS[1], 'id', 'sent_at', 'parked', 'leased_until',
                     'next_attempt_at')
if r[1] ~= ARGV[1] or r[2] ~= '' or r[3] == '1' then return {'stale'} end
if tonumber(r[4]) > now then return {'leased', r[4]} end
if tonumber(r[5]) > now then return {'later', r[5]} end
local lease_until = int(now + tonumber(ARGV[3]))
redis.call('HSET', KEYS[1], 'leased_until', lease_until)
local answer = {'taken', lease_until}
for _, v in ipairs(redis.call('HGETALL', KEYS[1])) do answer[#answer + 1] = v end
return answer
)";
    return source;
}

/// KEYS: an intent. ARGV: version id, then field, value, ... to set (the lease ends); with a
/// fifth argument 'failed', attempts + 1. 1: done, 0: the intent is of another version now.
inline constexpr const char* outbox_mark_source = R"(
if redis.call('HGET', KEYS[1], 'id') ~= ARGV[1] then return 0 end
if ARGV[#ARGV] == 'failed' then
  redis.call('HINCRBY', KEYS[1], 'attempts', 1)
  redis.call('HSET', KEYS[1], unpack(ARGV, 2, #ARGV - 1))
else
  redis.call('HSET', KEYS[1], unpack(ARGV, 2))
end
redis.call('HSET', KEYS[1], 'leased_until', '0')
return 1
)";

/// KEYS: intents. ARGV: cutoff_ms. Deletes those sent before the cutoff; answers how many.
inline constexpr const char* outbox_purge_source = R"(
local cutoff = tonumber(ARGV[1])
local n = 0
for c = 1, #KEYS do
  local sent_at = tonumber(redis.call('HGET', KEYS[c], 'sent_at') or '')
  if sent_at and sent_at < cutoff then
    redis.call('DEL', KEYS[c])
    n = n + 1
  end
end
return n
)";

/// outbox_announce_source as a Script (made once).
inline const Script& outbox_announce_script() {
    static const Script script{"outbox announce", outbox_announce_source};
    return script;
}
/// outbox_lease_source() as a Script (made once).
inline const Script& outbox_lease_script() {
    static const Script script{"outbox lease", outbox_lease_source().c_str()};
    return script;
}
/// outbox_mark_source as a Script (made once).
inline const Script& outbox_mark_script() {
    static const Script script{"outbox mark", outbox_mark_source};
    return script;
}
/// outbox_purge_source as a Script (made once).
inline const Script& outbox_purge_script() {
    static const Script script{"outbox purge", outbox_purge_source};
    return script;
}

/// The intent of @p fields (HGETALL's field, value, ... from @p first on) as an OutboxRow.
inline OutboxRow outbox_row_of(const std::vector<Reply>& fields, std::size_t first = 0) {
    OutboxRow row;
    for (std::size_t i = first; i + 1 < fields.size(); i += 2) {
        const std::string& name = fields[i].str;
        const std::string& value = fields[i + 1].str;
        if (name == "id") row.id = parse_int(value);
        if (name == "destination") row.destination = value;
        if (name == "key") row.idempotency_key = value;
        if (name == "payload") row.payload = value;
        if (name == "created_at") row.created_at = from_unix_ms(parse_int(value));
        if (name == "sent_at" && !value.empty()) row.sent_at = from_unix_ms(parse_int(value));
        if (name == "attempts") row.attempts = static_cast<std::uint32_t>(parse_int(value));
        if (name == "last_error") row.last_error = value;
        if (name == "next_attempt_at") row.next_attempt_at = from_unix_ms(parse_int(value));
        if (name == "parked") row.parked = value == "1";
        if (name == "scope") row.scope = value;
        if (name == "message_id") row.message_id = value;
    }
    return row;
}

/// @brief The Redis store's outbox (see the file's comment): what the relay calls, and the
/// redrive's announce of a new version. Keeps, for mark_sent() and mark_failed(), the key of each
/// version this object leased.
class Outbox {
  public:
    /// The outbox of @p store.
    explicit Outbox(StoreContext& store)
        : store_(store),
          counter_(store.options.key_prefix + "outbox-seq{idem-outbox}"),
          index_(store.options.key_prefix + "outbox{idem-outbox}") {}

    /// A new version's id for the intent @p key, listed in the index as due now: done before
    /// the intent is written, so that no intent waits unlisted.
    std::int64_t announce(const std::string& key) {
        Reply reply = store_.checked_on(
            index_,
            [&](Connection& c) {
                return c.eval(outbox_announce_script(), {counter_, index_}, {key});
            },
            "outbox announce");
        return reply.integer;
    }

    /// Relay: up to @p limit due intents, leased until now + @p lease, lowest id first.
    std::vector<OutboxRow> lease(std::size_t limit, std::chrono::milliseconds lease) {
        std::vector<OutboxRow> rows;
        if (limit == 0) return rows;
        const std::int64_t now = store_.now_ms();
        // Each entry met is leased, moved to when it is due, or dropped: the next page is new.
        for (int page = 0; page < 8 && rows.size() < limit; ++page) {
            Reply due = store_.checked_on(
                index_,
                [&](Connection& c) {
                    return c.command({"ZRANGEBYSCORE", index_, "-inf", std::to_string(now), "LIMIT",
                                      "0", std::to_string(limit - rows.size())});
                },
                "outbox index");
            if (due.elements.empty()) break;
            for (const Reply& entry : due.elements)
                take(entry.str, now, lease, rows);
        }
        std::sort(rows.begin(), rows.end(),
                  [](const OutboxRow& a, const OutboxRow& b) { return a.id < b.id; });
        return rows;
    }

    /// Relay: the version @p id was sent. @throws usage_error when this object did not lease it.
    void mark_sent(std::int64_t id) {
        const std::int64_t now = store_.now_ms();
        mark(id, "mark_outbox_sent", {"sent_at", std::to_string(now)}, false, 0);
    }

    /// Relay: the version @p id failed (@p error); due again at @p retry_at, or parked.
    /// @throws usage_error when this object did not lease it.
    void mark_failed(std::int64_t id, std::string_view error,
                     std::chrono::system_clock::time_point retry_at, bool park) {
        const std::int64_t due = to_unix_ms(retry_at);
        mark(id, "mark_outbox_failed",
             {"last_error", std::string(error), "next_attempt_at", std::to_string(due), "parked",
              park ? "1" : "0", "failed"},
             !park, due);
    }

    /// Every intent (each message's current version), lowest id first.
    std::vector<OutboxRow> rows() {
        std::vector<OutboxRow> rows;
        for (const std::string& key : scan(store_, store_.keys.pattern('o'))) {
            Reply fields = store_.checked_on(
                key,
                [&](Connection& c) {
                    return c.command({"HGETALL", key});
                },
                "HGETALL");
            if (!fields.elements.empty()) rows.push_back(outbox_row_of(fields.elements));
        }
        std::sort(rows.begin(), rows.end(),
                  [](const OutboxRow& a, const OutboxRow& b) { return a.id < b.id; });
        return rows;
    }

    /// The intent of message (@p scope, @p id): a redrive's, the only kind a Redis store writes.
    std::vector<OutboxRow> rows_of(std::string_view scope, std::string_view id) {
        const std::string key = store_.keys.outbox(scope, id);
        Reply fields = store_.checked_on(
            key,
            [&](Connection& c) {
                return c.command({"HGETALL", key});
            },
            "HGETALL");
        if (fields.elements.empty()) return {};
        return {outbox_row_of(fields.elements)};
    }

    /// Deletes the intents sent before @p cutoff_ms into result.sent_intents, a SCAN page of
    /// about @p page keys at a time, paced by @p pacer.
    void purge_sent(std::int64_t cutoff_ms, std::size_t page, const detail::PurgePacer& pacer,
                    PurgeResult& result) {
        sweep(store_, store_.keys.pattern('o'), page, outbox_purge_script(),
              {std::to_string(cutoff_ms)}, pacer, result, [&](const Reply& reply) {
                  store_.check_script(reply, "outbox purge");
                  result.sent_intents += static_cast<std::size_t>(reply.integer);
              });
    }

  private:
    struct Leased {
        std::string key;
        std::string member;
    };

    static std::string member_of(std::int64_t id, const std::string& key) {
        return fmt::format("{:019d} {}", id, key);
    }

    /// The index entry @p member at @p now: leased into @p rows, or moved, or dropped.
    void take(const std::string& member, std::int64_t now, std::chrono::milliseconds lease,
              std::vector<OutboxRow>& rows) {
        const std::size_t space = member.find(' ');
        if (space == std::string::npos) {  // not ours to read: dropped
            index_command({"ZREM", index_, member});
            return;
        }
        const std::string id = member.substr(0, space);
        const std::string key = member.substr(space + 1);
        const std::string version = std::to_string(parse_int(id));
        Reply answer = store_.router.on_key(key, [&](Connection& c) {
            return c.eval(outbox_lease_script(), {key},
                          {version, std::to_string(now), std::to_string(lease.count())});
        });
        store_.check_script(answer, "outbox lease");
        const std::string& status =
            answer.elements.empty() ? std::string() : answer.elements[0].str;
        if (status == "taken") {
            OutboxRow row = outbox_row_of(answer.elements, 2);
            {
                std::lock_guard<std::mutex> lock(mutex_);
                leased_[row.id] = Leased{key, member};
            }
            index_command({"ZADD", index_, "XX", answer.elements[1].str, member});
            rows.push_back(std::move(row));
        } else if (status == "leased" || status == "later") {
            index_command({"ZADD", index_, "XX", answer.elements[1].str, member});
        } else {
            index_command({"ZREM", index_, member});
        }
    }

    void mark(std::int64_t id, const char* who, std::vector<std::string> fields, bool again,
              std::int64_t due) {
        Leased leased;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            const auto found = leased_.find(id);
            if (found == leased_.end()) {
                throw usage_error(fmt::format(
                    "idem::RedisStore: {}({}): this store leased no outbox intent with this id",
                    who, id));
            }
            leased = found->second;
            leased_.erase(found);
        }
        fields.insert(fields.begin(), std::to_string(id));
        Reply reply = store_.router.on_key(leased.key, [&](Connection& c) {
            return c.eval(outbox_mark_script(), {leased.key}, fields);
        });
        store_.check_script(reply, "outbox mark");
        // Another version now (redriven again meanwhile): its own entry lists it.
        if (again && reply.integer == 1) {
            index_command({"ZADD", index_, "XX", std::to_string(due), leased.member});
        } else {
            index_command({"ZREM", index_, leased.member});
        }
    }

    void index_command(const std::vector<std::string>& args) {
        store_.checked_on(
            index_, [&](Connection& c) { return c.command(args); }, "outbox index");
    }

    StoreContext& store_;
    std::string counter_;
    std::string index_;
    std::mutex mutex_;
    std::map<std::int64_t, Leased> leased_;
};

}  // namespace redis
IDEM_END_NAMESPACE
