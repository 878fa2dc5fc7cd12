#pragma once
/// @file
/// @brief The Lua of the Redis store: claim, complete (the commit), claim-and-commit (a local
/// effect's one round trip), release, lock, unlock and the
/// purges, built from shared snippets, as idem::redis::Script values run by Connection::eval
/// (EVALSHA, loaded again after NOSCRIPT). The claim record they read and write: record.hpp.
/// Link idem::redis.

#include <initializer_list>
#include <string>

#include "idem/config.hpp"
#include "idem/redis/connection.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

// The helpers, one per snippet, so that each script includes only those it uses (every `local
// function` is made anew on every call).

/// The store's clock in milliseconds, as text: ARGV's now, or the server's TIME cut as text
/// (seconds, then the first 3 of 6 digits of microseconds) rather than computed as a number.
inline constexpr const char* lua_now = R"(
local function now_text(arg, t)
  if arg ~= '' then return arg end
  t = t or redis.call('TIME')
  return t[1] .. string.sub('00000' .. t[2], -6, -4)
end
)";

/// Lua: int(x), a number as integer text (no exponent, no fraction).
inline constexpr const char* lua_int = R"(
local function int(x) return string.format('%d', x) end
)";

/// `rest` is everything from attempts on, which a change of state keeps.
inline constexpr const char* lua_record = R"(
local function record(state, token, outcome, rest)
  return state .. '|' .. token .. '|' .. outcome .. '|' .. rest
end
)";

/// Every field of the header, and rest and tail (from `#fp` on); nothing when there is no record.
/// The times come back as numbers, `~<retention>` ones resolved against the record's expiry.
inline constexpr const char* lua_split = R"(
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

/// The rest of a record that starts with `prefix` ('leased|\<token\>||': leased to that token),
/// else nil. No pattern: cheaper than split().
inline constexpr const char* lua_held = R"(
local function held(v, prefix)
  if v and string.sub(v, 1, #prefix) == prefix then return string.sub(v, #prefix + 1) end
  return nil
end
)";

/// The fingerprint, scope and id in a record's rest.
inline constexpr const char* lua_fields = R"(
local function fields(rest)
  local nf, ns, ni, at = string.match(rest, '^%d+|~?%d+|~?%d*|%d*|(%d+)|(%d+)|(%d+)\n()')
  nf, ns, ni = tonumber(nf), tonumber(ns), tonumber(ni)
  return string.sub(rest, at, at + nf - 1), string.sub(rest, at + nf, at + nf + ns - 1),
         string.sub(rest, at + nf + ns, at + nf + ns + ni - 1)
end
)";

/// Frees a lease if the token of `prefix` still holds it; attempts and the expiry stay.
inline constexpr const char* lua_release = R"(
local function release(key, prefix)
  local rest = held(redis.call('GET', key), prefix)
  if not rest then return 0 end
  redis.call('SET', key, record('free', '', '', rest), 'KEEPTTL')
  return 1
end
)";

/// lua_release for a claim whose effect never started (a pipelined claim whose answer was lost):
/// it also takes back the attempt the claim counted.
inline constexpr const char* lua_release_unstarted = R"(
local function release(key, prefix)
  local rest = held(redis.call('GET', key), prefix)
  if not rest then return 0 end
  local attempts, tail = string.match(rest, '^(%d+)(.*)$')
  local left = math.max(0, tonumber(attempts) - 1)
  redis.call('SET', key, record('free', '', '', string.format('%d', left) .. tail), 'KEEPTTL')
  return 1
end
)";

/// Lua: sibling(key, kind), the key of another kind in the same hash slot (KeyLayout): @p key's
/// kind letter, the one before the hash tag, replaced by @p kind ('c' the claim, 'd' its dead
/// letters, 'f' its noted failures). Include it before the snippets that use it.
inline constexpr const char* lua_sibling = R"(
local function sibling(key, kind)
  local tag = string.find(key, '{', 1, true)
  return string.sub(key, 1, tag - 2) .. kind .. string.sub(key, tag)
end
)";

/// Adds a dead letter to a stream: assigns `add_letter` (declared by the caller; needs
/// lua_now and lua_sibling). The clock is read only here, once a letter. After created_at,
/// `order_us` and `seq` order the letters of all streams as written: the commit's time and the
/// letter's rank in its transaction (given by the client, the same across the slots of one commit),
/// else the server's microseconds and the rank in this script.
inline constexpr const char* lua_add_letter = R"(
local letter_seq = 0
add_letter = function(key, scope, id, count, reason, payload, created_at, order_us, seq,
                      origin, origin_position)
  local t = redis.call('TIME')
  if created_at == '' then created_at = now_text(ARGV[1], t) end
  letter_seq = letter_seq + 1
  -- The failures noted for the message (KeyLayout::failures()); lua_sibling comes first.
  local failed = redis.call('HMGET', sibling(key, 'f'), 'failure', 'first', 'last')
  redis.call('XADD', key, '*', 'scope', scope, 'id', id, 'delivery_count', count,
             'reason', reason, 'payload', payload, 'created_at', created_at,
             'order_us', order_us or (t[1] .. string.format('%06d', t[2])),
             'seq', seq or letter_seq, 'origin', origin or '',
             'origin_position', origin_position or '', 'failure', failed[1] or '',
             'first_failed_at', failed[2] or '', 'last_failed_at', failed[3] or '')
end
)";

/// A script's source: @p parts (snippets, then the body) back to back.
inline std::string lua(std::initializer_list<const char*> parts) {
    std::string out;
    for (const char* part : parts)
        out += part;
    return out;
}

/// KEYS: the claim records, one per id. ARGV: token, lease_ms, retention_ms, now, then per key
/// the fields of its new record (`"#fp|#scope|#id\n"` fp scope id). One script for a whole batch:
/// one call instead of one per id. Answers, per key, 1 for a new claim (attempt 1, the
/// fingerprint sent) or {status, detail, fingerprint, attempts}: an array of them, or for one
/// key its answer alone.
inline const std::string& claim_source() {
    static const std::string source = lua({lua_now, lua_int, lua_record, lua_split, lua_fields}) +
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

/// KEYS: the claims' records (n_claims), then the stream of each dead letter, then leases to free
/// (unclaimed). ARGV: now, token, n_claims, {outcome, reason} * n_claims, n_letters, {scope, id,
/// delivery_count, reason, payload, created_at, order_us, seq, origin, origin_position} *
/// n_letters, n_commands, {argc, args...} * n_commands. Every lease is checked before anything is
/// written: a lost lease writes nothing. Returns 'ok', or {why, detail...}. The clock is read only
/// for dead letters.
inline const std::string& complete_source() {
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
i = letters_at + 10 * n_letters
local n_commands = tonumber(ARGV[i]); i = i + 1
local add_letter
if n_letters > 0 then
)") + lua_now + lua_sibling + lua_add_letter +
                                      R"(
end
for k = 1, n_commands do
  local argc = tonumber(ARGV[i])
  local name = ARGV[i + 1]
  local result = redis.pcall(unpack(ARGV, i + 1, i + argc))
  i = i + 1 + argc
  if type(result) == 'table' and result.err then
    if k == 1 then return {'command_failed', '1', result.err} end
)" + lua_now + lua_fields + lua_sibling +
                                      lua_add_letter +
                                      R"(
    -- Redis cannot undo commands 1..k-1: park the claims so a redelivery does not apply them a
    -- second time, and leave a dead letter for a human.
    local why = 'Redis command ' .. k .. ' of the commit (' .. name .. ') failed after ' ..
                (k - 1) .. ' had been applied (Redis cannot roll back): ' .. result.err
    for c = 1, n_claims do
      redis.call('SET', KEYS[c], 'done||dead_lettered|' .. rest[c] .. why, 'KEEPTTL')
      local _, scope, id = fields(rest[c])
      add_letter(sibling(KEYS[c], 'd'), scope, id, string.match(rest[c], '^%d+'), why, '', '')
    end
    return {'partial', tostring(k), why}
  end
end
for d = 1, n_letters do
  local a = letters_at + 10 * (d - 1)
  add_letter(KEYS[n_claims + d], ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4],
             ARGV[a + 5], ARGV[a + 6], ARGV[a + 7], ARGV[a + 8], ARGV[a + 9])
end
for c = 1, n_claims do
  redis.call('SET', KEYS[c], 'done||' .. ARGV[2 + 2 * c] .. '|' .. rest[c] .. ARGV[3 + 2 * c],
             'KEEPTTL')
end
-- Leases given back without completion (batch messages that failed): freed if still ours.
if #KEYS > n_claims + n_letters then
)" + lua_record + lua_held + lua_release +
                                      R"(
  for k = n_claims + n_letters + 1, #KEYS do
    release(KEYS[k], mine)
  end
end
return 'ok'
)";
    return source;
}

/// The claim and the commit of a local effect (idem::local_effect: its only effect is the
/// transaction's queued writes, already computed with no claim held) in ONE script. KEYS: the
/// claim record, its dead letters. ARGV: now, retention_ms, lease_ms, max_attempts, outcome
/// (processed or rejected; '' for an effect that threw: count the attempt, apply nothing, leave
/// the id free), reason, the record's fields (`"#fp|#scope|#id\n"` fp scope id), the whole record
/// of a new id (made by the client, as the SET claim's), n_commands, {argc, args...} *
/// n_commands. A new id (or a released or expired claim) has the writes applied and the claim
/// recorded done with the outcome; anything else applies nothing. Answers 'ok' (a new id,
/// committed), or {status, detail, fingerprint, attempts}: duplicate (detail: the recorded
/// outcome), in_progress (the lease's time left), limit (a takeover would reach max_attempts:
/// nothing applied, take the ordinary path), committed (a takeover or a counted failure; detail:
/// the state taken over); or {command_failed | partial, k, why} as the commit.
inline const std::string& claim_commit_source() {
    // The common case (a new id) is one SET NX of the client's record and the writes, with no
    // `local function` made (each builds a closure per call) and no string built; the rest
    // makes its helpers.
    static const std::string source = std::string(R"(
local key, outcome = KEYS[1], ARGV[5]
local answer = 'ok'
if not redis.call('SET', key, ARGV[8], 'NX', 'PX', ARGV[2]) then
)") + lua_now + lua_int + lua_split + lua_fields +
                                      R"(
  local now = now_text(ARGV[1])
  local r = split(key, redis.call('GET', key))
  local fp = fields(r.rest)
  if r.state == 'done' then
    return {'duplicate', r.outcome ~= '' and r.outcome or 'processed', fp, r.attempts}
  end
  local left = r.state == 'leased' and r.leased_at + r.lease_ms - now or 0
  if left > 0 then return {'in_progress', int(left), fp, r.attempts} end
  -- Released, or the lease ran out: taken over, one more attempt (the count and the first
  -- claim's time stay; the fields are the taker's; the retention restarts).
  local attempts = int(r.attempts + 1)
  if tonumber(attempts) >= tonumber(ARGV[4]) then return {'limit', r.state, fp, attempts} end
  local rest = attempts .. '|' .. int(r.claimed_at) .. '|' .. now .. '|' .. ARGV[3] .. '|' ..
               ARGV[7]
  if outcome == '' then
    redis.call('SET', key, 'free|||' .. rest, 'PX', ARGV[2])
  else
    redis.call('SET', key, 'done||' .. outcome .. '|' .. rest .. ARGV[6], 'PX', ARGV[2])
  end
  answer = {'committed', r.state, '', attempts}
end
if outcome == '' then  -- a failed effect: the attempt is counted, nothing else
  if answer == 'ok' then return {'committed', 'new', '', '1'} end
  return answer
end
local i = 10
for k = 1, tonumber(ARGV[9]) do
  local argc = tonumber(ARGV[i])
  local result = redis.pcall(unpack(ARGV, i + 1, i + argc))
  if type(result) == 'table' and result.err then
    -- The record as written above, from attempts on (its header is 'done||<outcome>|').
    local rest = string.sub(redis.call('GET', key), 8 + #outcome)
    rest = string.sub(rest, 1, #rest - #ARGV[6])
    if k == 1 then  -- nothing applied: the attempt stays counted, the id free
      redis.call('SET', key, 'free|||' .. rest, 'KEEPTTL')
      return {'command_failed', '1', result.err}
    end
    local add_letter
)" + lua_now + lua_fields + lua_sibling +
                                      lua_add_letter +
                                      R"(
    -- Redis cannot undo writes 1..k-1: park the claim so a redelivery does not apply them again.
    local why = 'Redis command ' .. k .. ' of the commit (' .. ARGV[i + 1] .. ') failed after ' ..
                (k - 1) .. ' had been applied (Redis cannot roll back): ' .. result.err
    redis.call('SET', key, 'done||dead_lettered|' .. rest .. why, 'KEEPTTL')
    local _, scope, id = fields(rest)
    add_letter(KEYS[2], scope, id, string.match(rest, '^%d+'), why, '', '')
    return {'partial', tostring(k), why}
  end
  i = i + 1 + argc
end
return answer
)";
    return source;
}

/// Calls the release() defined before it on every key; answers how many leases it freed.
inline constexpr const char* lua_release_each = R"(
local mine = 'leased|' .. ARGV[1] .. '||'
local freed = 0
for c = 1, #KEYS do
  freed = freed + release(KEYS[c], mine)
end
return freed
)";

/// KEYS: claim records. ARGV: token. Frees only leases this token holds; attempts stay.
inline const std::string& release_source() {
    static const std::string source = lua({lua_record, lua_held, lua_release, lua_release_each});
    return source;
}

/// KEYS: claim records. ARGV: token. Frees only leases this token holds, each with one attempt
/// fewer (their effects never started).
inline const std::string& release_unstarted_source() {
    static const std::string source =
        lua({lua_record, lua_held, lua_release_unstarted, lua_release_each});
    return source;
}

/// KEYS[1] lock. ARGV: owner, expire_ms, now. 1: taken (or renewed by its owner), 0: held.
inline const std::string& lock_source() {
    static const std::string source = lua({lua_now, lua_int}) + R"(
local now = tonumber(now_text(ARGV[3]))
local r = redis.call('HMGET', KEYS[1], 'owner', 'expires_at')
if r[1] and r[1] ~= ARGV[1] and (tonumber(r[2]) or 0) > now then return 0 end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'expires_at', int(now + tonumber(ARGV[2])))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
)";
    return source;
}

/// KEYS[1] lock. ARGV: owner. 1: released, 0: not ours.
inline constexpr const char* unlock_source = R"(
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
)";

/// KEYS: claim records. ARGV: cutoff_ms, now. Deletes claims claimed before the cutoff (never a
/// live lease). Returns {claims deleted, released records deleted}.
inline const std::string& purge_claims_source() {
    static const std::string source = lua({lua_now, lua_split}) + R"(
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

/// KEYS: locks. ARGV: now. Deletes locks whose expiry is before now.
inline const std::string& purge_locks_source() {
    static const std::string source = lua({lua_now}) + R"(
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

/// claim_source() as a Script (made once).
inline const Script& claim_script() {
    static const Script script{"claim", claim_source().c_str()};
    return script;
}
/// complete_source() as a Script (made once).
inline const Script& complete_script() {
    static const Script script{"complete", complete_source().c_str()};
    return script;
}
/// claim_commit_source() as a Script (made once).
inline const Script& claim_commit_script() {
    static const Script script{"claim and commit", claim_commit_source().c_str()};
    return script;
}
/// release_source() as a Script (made once).
inline const Script& release_script() {
    static const Script script{"release", release_source().c_str()};
    return script;
}
/// release_unstarted_source() as a Script (made once).
inline const Script& release_unstarted_script() {
    static const Script script{"release unstarted", release_unstarted_source().c_str()};
    return script;
}
/// lock_source() as a Script (made once).
inline const Script& lock_script() {
    static const Script script{"lock", lock_source().c_str()};
    return script;
}
/// unlock_source as a Script (made once).
inline const Script& unlock_script() {
    static const Script script{"unlock", unlock_source};
    return script;
}
/// purge_claims_source() as a Script (made once).
inline const Script& purge_claims_script() {
    static const Script script{"purge claims", purge_claims_source().c_str()};
    return script;
}
/// purge_locks_source() as a Script (made once).
inline const Script& purge_locks_script() {
    static const Script script{"purge locks", purge_locks_source().c_str()};
    return script;
}

}  // namespace redis
IDEM_END_NAMESPACE
