#pragma once
/// @file
/// @brief The Redis store's dead letters brought back (contract/redrive.hpp): the listing with a
/// selection, the redrive and the purge by selection. A message's dead letters are a stream in
/// its claim's hash slot; a redrive appends a mark entry to that stream (`redriven <entry> at
/// <ms> count <n>`) rather than changing the letter (stream entries are immutable). Each entry is
/// redriven by one script on the claim's slot, so it is all or nothing on one server and on a
/// Cluster: the letter is found unmarked and the claim still dead_lettered, then the outbox
/// intent is written (the first write: should it fail, nothing is written), the claim deleted
/// (its attempt count goes with it: a fresh poison limit) and the mark appended. The intent's
/// version is announced to the outbox index first (store/redis/outbox.hpp). Link idem::redis.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/contract/records.hpp"
#include "idem/contract/redrive.hpp"
#include "idem/contract/time.hpp"
#include "idem/store/redis/admin.hpp"
#include "idem/store/redis/context.hpp"
#include "idem/store/redis/outbox.hpp"
#include "idem/store/redis/scripts.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// KEYS: the claim, its dead letters, its outbox intent. ARGV: the letter's entry id, now ('':
/// the server's), destination, the intent's version id, the message id, its scope (the intent
/// records whose it is). 1: redriven; 0: nothing
/// to do (the letter is gone or redriven before, or the claim records no dead letter now).
inline const std::string& redrive_source() {
    static const std::string source = lua({lua_now, lua_sibling}) + R"(
local letter, marks = nil, 0
for _, e in ipairs(redis.call('XRANGE', KEYS[2], '-', '+')) do
  local f = e[2]
  if f[1] == 'redriven' then
    marks = marks + 1
    if f[2] == ARGV[1] then return 0 end
  elseif e[1] == ARGV[1] then
    letter = f
  end
end
if not letter then return 0 end
local claim = redis.call('GET', KEYS[1])
if not claim or string.sub(claim, 1, 20) ~= 'done||dead_lettered|' then return 0 end
local payload = ''
for i = 1, #letter - 1, 2 do
  if letter[i] == 'payload' then payload = letter[i + 1] end
end
local now = now_text(ARGV[2])
redis.call('HSET', KEYS[3], 'id', ARGV[4], 'destination', ARGV[3], 'key', ARGV[5],
           'payload', payload, 'created_at', now, 'sent_at', '', 'attempts', '0',
           'last_error', '', 'next_attempt_at', '0', 'parked', '0', 'leased_until', '0',
           'scope', ARGV[6], 'message_id', ARGV[5])
redis.call('DEL', KEYS[1])
redis.call('DEL', sibling(KEYS[1], 'f'))  -- its noted failures too: a fresh history
redis.call('XADD', KEYS[2], '*', 'redriven', ARGV[1], 'at', now, 'count', marks + 1)
return 1
)";
    return source;
}

/// redrive_source() as a Script (made once).
inline const Script& redrive_script() {
    static const Script script{"redrive", redrive_source().c_str()};
    return script;
}

/// A letter's id: its microseconds, then its rank in its script (the letters of one commit
/// beyond the 1000th share the last id; the listing still orders them by rank).
inline std::int64_t letter_id(const StoredDeadLetter& stored) {
    constexpr std::int64_t ranks = 1000;
    const std::int64_t micros = parse_int(stored.order);
    if (micros > INT64_MAX / ranks - 1) return INT64_MAX;
    return micros * ranks + std::min<std::int64_t>(stored.seq, ranks - 1);
}

/// The letters of one dead-letter stream (its XRANGE reply), with their redrive marks applied.
inline std::vector<StoredDeadLetter> letters_of(const Reply& entries) {
    std::vector<StoredDeadLetter> letters;
    std::map<std::string, std::pair<std::int64_t, std::uint32_t>> marks;  // entry → at, count
    for (const Reply& entry : entries.elements) {
        const bool mark = entry.elements.size() >= 2 && !entry.elements[1].elements.empty() &&
                          entry.elements[1].elements[0].str == "redriven";
        if (!mark) {
            if (auto item = dead_letter_of(entry)) letters.push_back(std::move(*item));
            continue;
        }
        const auto& fields = entry.elements[1].elements;
        std::string of;
        std::int64_t at = 0;
        std::uint32_t count = 0;
        for (std::size_t i = 0; i + 1 < fields.size(); i += 2) {
            if (fields[i].str == "redriven") of = fields[i + 1].str;
            if (fields[i].str == "at") at = parse_int(fields[i + 1].str);
            if (fields[i].str == "count")
                count = static_cast<std::uint32_t>(parse_int(fields[i + 1].str));
        }
        marks[of] = {at, count};
    }
    for (StoredDeadLetter& stored : letters) {
        stored.letter.id = letter_id(stored);
        const auto found = marks.find(stored.entry);
        if (found == marks.end()) continue;
        stored.letter.redriven_at = from_unix_ms(found->second.first);
        stored.letter.redrive_count = found->second.second;
    }
    return letters;
}

/// The letters of the dead-letter streams @p keys, read in pipelines (per node on a Cluster).
inline std::vector<StoredDeadLetter> read_letters(StoreContext& store,
                                                  const std::vector<std::string>& keys) {
    constexpr std::size_t chunk = 512;
    std::vector<StoredDeadLetter> letters;
    for (std::size_t start = 0; start < keys.size(); start += chunk) {
        const std::size_t end = std::min(keys.size(), start + chunk);
        std::vector<Args> commands(end - start);
        for (std::size_t i = start; i < end; ++i)
            commands[i - start].add("XRANGE").add(keys[i]).add("-").add("+");
        const std::vector<Reply> replies = store.pipeline(
            commands, [&](std::size_t i) -> const std::string& { return keys[start + i]; });
        for (const Reply& reply : replies) {
            if (reply.is_error()) throw_reply_error(reply, "idem: Redis XRANGE: " + reply.str);
            for (StoredDeadLetter& stored : letters_of(reply))
                letters.push_back(std::move(stored));
        }
    }
    return letters;
}

/// The dead letters @p selection takes, oldest first, with where each is.
inline std::vector<StoredDeadLetter> select_letters(StoreContext& store,
                                                    const DeadLetterSelection& selection) {
    std::vector<std::string> keys;
    if (!selection.scope.empty() && !selection.message_ids.empty()) {
        std::set<std::string> unique;
        for (const std::string& id : selection.message_ids)
            unique.insert(store.keys.dead_letter(selection.scope, id));
        keys.assign(unique.begin(), unique.end());
    } else {
        keys = scan(store, store.keys.pattern('d', selection.scope));
    }
    std::vector<StoredDeadLetter> letters = read_letters(store, keys);
    letters.erase(std::remove_if(letters.begin(), letters.end(),
                                 [&](const StoredDeadLetter& stored) {
                                     return !selection.matches(stored.letter);
                                 }),
                  letters.end());
    std::sort(letters.begin(), letters.end(), written_before);
    if (selection.limit != 0 && letters.size() > selection.limit) letters.resize(selection.limit);
    return letters;
}

/// The letters of @p selection as the store hands them out.
inline std::vector<DeadLetter> dead_letters(StoreContext& store,
                                            const DeadLetterSelection& selection = {}) {
    std::vector<DeadLetter> letters;
    for (StoredDeadLetter& stored : select_letters(store, selection))
        letters.push_back(std::move(stored.letter));
    return letters;
}

/// The letter @p stored as it is now; nothing when it was purged.
inline std::optional<DeadLetter> reread_letter(StoreContext& store,
                                               const StoredDeadLetter& stored) {
    const std::string key = store.keys.dead_letter(stored.letter.scope, stored.letter.message_id);
    for (StoredDeadLetter& now : read_letters(store, {key})) {
        if (now.entry == stored.entry) return std::move(now.letter);
    }
    return std::nullopt;
}

/// KEYS: the message's failures hash. ARGV: now ('' for the server's clock), the failure's
/// text, how long to keep the hash (ms). The first failure's time is kept, the last replaced.
inline const Script& note_failure_script() {
    static const std::string source = lua({lua_now}) + R"(
local now = now_text(ARGV[1])
redis.call('HSETNX', KEYS[1], 'first', now)
redis.call('HSET', KEYS[1], 'last', now, 'failure', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
)";
    static const Script script{"note_failure", source.c_str()};
    return script;
}

/// RedisStore::note_failure(): see its documentation.
inline void note_failure(StoreContext& store, std::string_view scope, std::string_view id,
                         std::string_view failure, std::chrono::seconds keep_for) {
    const std::string key = store.keys.failures(scope, id);
    const auto keep_ms = std::chrono::duration_cast<std::chrono::milliseconds>(keep_for).count();
    Reply reply = store.router.on_key(key, [&](Connection& c) {
        return c.eval(note_failure_script(), {key},
                      {store.now_arg(), std::string(failure), std::to_string(keep_ms)});
    });
    store.check_script(reply, "note_failure");
}

/// RedisStore::noted_failure(): the failures hash read back (HMGET).
inline std::optional<NotedFailure> noted_failure(StoreContext& store, std::string_view scope,
                                                 std::string_view id) {
    const std::string key = store.keys.failures(scope, id);
    Args hmget;
    hmget.add("HMGET").add(key).add("failure").add("first").add("last");
    Reply reply = store.checked_on(
        key, [&](Connection& c) { return c.command(hmget); }, "HMGET");
    if (reply.elements.size() != 3 || reply.elements[2].is_nil()) return std::nullopt;
    const auto last = from_unix_ms(parse_int(reply.elements[2].str));
    const Reply& first = reply.elements[1];
    return NotedFailure{reply.elements[0].str,
                        first.is_nil() ? last : from_unix_ms(parse_int(first.str)), last};
}

/// One letter's redrive script; true when it redrove it.
inline bool redrive_step(StoreContext& store, Outbox& outbox, const StoredDeadLetter& stored,
                         const std::string& destination) {
    const DeadLetter& letter = stored.letter;
    const std::string intent = store.keys.outbox(letter.scope, letter.message_id);
    const std::int64_t version = outbox.announce(intent);
    const std::string claim = store.keys.claim(letter.scope, letter.message_id);
    const std::string letters = store.keys.dead_letter(letter.scope, letter.message_id);
    Reply reply = store.router.on_key(claim, [&](Connection& c) {
        return c.eval(redrive_script(), {claim, letters, intent},
                      {stored.entry, store.now_arg(), destination, std::to_string(version),
                       letter.message_id, letter.scope});
    });
    store.check_script(reply, "redrive");
    return reply.integer == 1;
}

/// RedisStore::redrive(): see its documentation.
inline RedriveReport redrive(StoreContext& store, Outbox& outbox,
                             const DeadLetterSelection& selection, const RedriveOptions& options) {
    options.validate("idem::RedisStore: redrive()");
    const std::vector<StoredDeadLetter> stored = select_letters(store, selection);
    std::vector<DeadLetter> letters;
    letters.reserve(stored.size());
    for (const StoredDeadLetter& s : stored)
        letters.push_back(s.letter);
    // run_redrive() hands step() an element of `letters` and then asks find_letter() about the
    // same one: `current` is its position, which also indexes `stored` (the entry id).
    std::size_t current = 0;
    return detail::run_redrive(
        letters, options,
        [&](const std::string& scope, const std::string& id) {
            return find_claim(store, scope, id);
        },
        [&](std::int64_t) { return reread_letter(store, stored[current]); },
        [&](const DeadLetter& letter) {
            current = static_cast<std::size_t>(&letter - letters.data());
            return redrive_step(store, outbox, stored[current],
                                redrive_destination(letter, options));
        });
}

/// RedisStore::purge_dead_letters(): each selected entry deleted on its own (XDEL).
inline std::vector<DeadLetter> purge_dead_letters(StoreContext& store,
                                                  const DeadLetterSelection& selection,
                                                  bool dry_run) {
    std::vector<DeadLetter> purged;
    for (StoredDeadLetter& stored : select_letters(store, selection)) {
        if (!dry_run) {
            const std::string key =
                store.keys.dead_letter(stored.letter.scope, stored.letter.message_id);
            Args del;
            del.add("XDEL").add(key).add(stored.entry);
            Reply reply = store.checked_on(
                key, [&](Connection& c) { return c.command(del); }, "XDEL");
            if (reply.integer != 1) continue;
        }
        purged.push_back(std::move(stored.letter));
    }
    return purged;
}

}  // namespace redis
IDEM_END_NAMESPACE
