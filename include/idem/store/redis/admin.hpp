#pragma once
/// @file
/// @brief The Redis store's inspection and maintenance, outside any transaction: the claim
/// record of an id, the dead letters, purge, overlap locks and the warm-up. Link idem::redis.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/store.hpp"
#include "idem/detail/purge_pacer.hpp"
#include "idem/error.hpp"
#include "idem/store/redis/context.hpp"
#include "idem/store/redis/record.hpp"
#include "idem/store/redis/scripts.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// The stored record of (scope, id), as it is (any state); nothing when there is none.
inline std::optional<Record> read_record(StoreContext& store, std::string_view scope,
                                         std::string_view id) {
    const std::string key = store.keys.claim(scope, id);
    Args get;
    get.add("GET").add(key);
    Reply reply = store.checked_on(
        key, [&](Connection& c) { return c.command(get); }, "GET");
    if (reply.is_nil()) return std::nullopt;
    auto record = Record::decode(reply.str);
    if (!record) {
        throw store_error(fmt::format("idem: unreadable claim record for {}/{} on {}", scope, id,
                                      store.endpoint().describe()));
    }
    if (record->times_before_expiry) {
        Args expiry;
        expiry.add("PEXPIRETIME").add(key);
        Reply at = store.checked_on(
            key, [&](Connection& c) { return c.command(expiry); }, "PEXPIRETIME");
        record->resolve(at.integer);
    }
    return record;
}

/// The claim record of (scope, id) as the store contract shows it; nothing when there is none
/// or it was released.
inline std::optional<ClaimRecord> find_claim(StoreContext& store, std::string_view scope,
                                             std::string_view id) {
    std::optional<Record> stored = read_record(store, scope, id);
    if (!stored || stored->state == "free") return std::nullopt;
    ClaimRecord record;
    record.scope = std::string(scope);
    record.message_id = std::string(id);
    record.disposition = Disposition::in_progress;
    if (stored->state == "done") record.disposition = disposition_from(stored->outcome);
    record.reason = std::move(stored->reason);
    record.claimed_at = from_unix_ms(stored->claimed_at);
    record.fingerprint = std::move(stored->fingerprint);
    return record;
}

/// One `SCAN cursor MATCH pattern COUNT count` on @p c: appends the keys it found to @p keys and
/// answers the next cursor ("0": the scan is over).
inline std::string scan_page(Connection& c, const std::string& cursor, const std::string& pattern,
                             const std::string& count, std::vector<std::string>& keys) {
    Reply reply = c.checked({"SCAN", cursor, "MATCH", pattern, "COUNT", count}, "SCAN");
    if (reply.elements.size() != 2) throw store_error("idem: Redis SCAN: unexpected reply");
    for (auto& key : reply.elements[1].elements)
        keys.push_back(std::move(key.str));
    return std::move(reply.elements[0].str);
}

/// Every key matching @p pattern, on every master, each once.
inline std::vector<std::string> scan(StoreContext& store, const std::string& pattern) {
    std::vector<std::string> keys;
    store.router.on_each_master([&](Connection& c) {
        std::string cursor = "0";
        do {
            cursor = scan_page(c, cursor, pattern, "1000", keys);
        } while (cursor != "0");
        return 0;
    });
    std::sort(keys.begin(), keys.end());  // SCAN may return a key twice
    keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
    return keys;
}

/// @p script over @p keys with @p args after them: 256 keys a call, the keys of a call in one
/// hash slot on a Cluster.
inline std::vector<Reply> run_in_batches(StoreContext& store, const Script& script,
                                         const std::vector<std::string>& keys,
                                         const std::vector<std::string>& args) {
    constexpr std::size_t batch = 256;
    std::vector<SlotCall> calls;
    for (const auto& [slot, positions] :
         store.by_slot(keys.size(), [&](std::size_t i) -> const std::string& { return keys[i]; })) {
        for (std::size_t start = 0; start < positions.size(); start += batch) {
            SlotCall call;
            call.slot = slot;
            const std::size_t end = std::min(positions.size(), start + batch);
            call.num_keys = end - start;
            for (std::size_t k = start; k < end; ++k)
                call.keys_then_args.add(keys[positions[k]]);
            for (const auto& arg : args)
                call.keys_then_args.add(arg);
            calls.push_back(std::move(call));
        }
    }
    if (calls.empty()) return {};
    return store.eval_calls(script, calls);
}

/// A dead letter as read back from its stream, with where it is and the order it was written in.
struct StoredDeadLetter {
    std::string order;      ///< order_us: the server's microseconds when it was written
    std::uint32_t seq = 0;  ///< seq: its rank among the letters of its script
    std::string entry;      ///< its stream entry id
    DeadLetter letter;      ///< the letter, as the store hands it out
};

/// The dead letter of an XRANGE entry of a dead-letter stream ([id, [name, value, ...]], the
/// fields the commit script writes); nothing when @p entry is not such an entry. Fields it does
/// not know are skipped.
inline std::optional<StoredDeadLetter> dead_letter_of(const Reply& entry) {
    if (entry.elements.size() < 2) return std::nullopt;
    StoredDeadLetter item;
    item.entry = entry.elements[0].str;
    const auto& fields = entry.elements[1].elements;
    for (std::size_t i = 0; i + 1 < fields.size(); i += 2) {
        const std::string& name = fields[i].str;
        const std::string& value = fields[i + 1].str;
        if (name == "scope") item.letter.scope = value;
        if (name == "id") item.letter.message_id = value;
        if (name == "delivery_count")
            item.letter.delivery_count = static_cast<std::uint32_t>(parse_int(value));
        if (name == "reason") item.letter.reason = value;
        if (name == "payload") item.letter.payload = value;
        if (name == "created_at") item.letter.created_at = from_unix_ms(parse_int(value));
        if (name == "order_us") item.order = value;
        if (name == "seq") item.seq = static_cast<std::uint32_t>(parse_int(value));
        if (name == "origin") item.letter.origin = value;
        if (name == "origin_position") item.letter.origin_position = value;
        if (name == "failure") item.letter.failure = value;
        if (name == "first_failed_at" && !value.empty())
            item.letter.first_failed_at = from_unix_ms(parse_int(value));
        if (name == "last_failed_at" && !value.empty())
            item.letter.last_failed_at = from_unix_ms(parse_int(value));
    }
    return item;
}

/// Oldest first: by created_at, then by order_us (a number: a shorter one is smaller), then by
/// the rank in its script.
inline bool written_before(const StoredDeadLetter& a, const StoredDeadLetter& b) {
    if (a.letter.created_at != b.letter.created_at)
        return a.letter.created_at < b.letter.created_at;
    if (a.order.size() != b.order.size()) return a.order.size() < b.order.size();
    if (a.order != b.order) return a.order < b.order;
    return a.seq < b.seq;
}

/// Runs @p script over every key matching @p pattern, page by page: a page is one SCAN (about
/// @p count keys looked at) on each master whose scan is not over, then the script over the keys
/// it found (run_in_batches), each reply handed to @p take, then the pacer's pause. Only a page's
/// keys are held, whatever the keyspace's size. Stops early (the result marked incomplete) when
/// the pacer says so; a key SCAN returns twice just meets the script twice.
template <class Take>
void sweep(StoreContext& store, const std::string& pattern, std::size_t count, const Script& script,
           const std::vector<std::string>& args, const detail::PurgePacer& pacer,
           PurgeResult& result, Take&& take) {
    struct Scan {
        std::string cursor = "0";
        bool over = false;
    };
    std::vector<Scan> scans;  // one per master, in on_each_master's order
    const std::string page = std::to_string(count);
    for (bool going = true; going;) {
        if (!pacer.may_go_on(result)) return;
        const auto started = detail::PurgePacer::clock::now();
        std::vector<std::string> keys;
        std::size_t at = 0;
        going = false;
        store.router.on_each_master([&](Connection& c) {
            if (at == scans.size()) scans.emplace_back();  // a master not seen before
            Scan& scan = scans[at++];
            if (scan.over) return 0;
            scan.cursor = scan_page(c, scan.cursor, pattern, page, keys);
            scan.over = scan.cursor == "0";
            going = going || !scan.over;
            return 0;
        });
        for (const Reply& reply : run_in_batches(store, script, keys, args))
            take(reply);
        pacer.after_batch(result, detail::PurgePacer::clock::now() - started);
    }
}

/// Deletes the claims claimed before @p cutoff_ms (never a live lease) and the locks expired by
/// the store's now, a SCAN page of about @p page keys at a time, paced by @p pacer.
inline void purge(StoreContext& store, std::int64_t cutoff_ms, std::size_t page,
                  const detail::PurgePacer& pacer, PurgeResult& result) {
    const std::string now = store.now_arg();
    sweep(store, store.keys.pattern('c'), page, purge_claims_script(),
          {std::to_string(cutoff_ms), now}, pacer, result, [&](const Reply& reply) {
              store.check_script(reply, "purge");
              if (reply.elements.size() == 2)
                  result.claims += static_cast<std::size_t>(reply.elements[0].integer);
          });
    sweep(store, store.keys.pattern('l'), page, purge_locks_script(), {now}, pacer, result,
          [&](const Reply& reply) {
              store.check_script(reply, "purge");
              result.expired_locks += static_cast<std::size_t>(reply.integer);
          });
}

/// Takes the lock @p key for @p owner; false when another owner holds it and it has not expired.
inline bool hold_lock(StoreContext& store, std::string_view key, std::string_view owner,
                      std::chrono::milliseconds expire_after) {
    const std::string lock = store.keys.lock(key);
    Reply reply = store.router.on_key(lock, [&](Connection& c) {
        return c.eval(lock_script(), {lock},
                      {std::string(owner), std::to_string(expire_after.count()), store.now_arg()});
    });
    store.check_script(reply, "lock");
    return reply.integer == 1;
}
/// Releases the lock @p key @p owner holds; false when it holds none.
inline bool release_lock(StoreContext& store, std::string_view key, std::string_view owner) {
    const std::string lock = store.keys.lock(key);
    Reply reply = store.router.on_key(
        lock, [&](Connection& c) { return c.eval(unlock_script(), {lock}, {std::string(owner)}); });
    store.check_script(reply, "unlock");
    return reply.integer == 1;
}

/// Opens @p connections pooled connections to each master and loads the per-message scripts.
inline void warm_up(StoreContext& store, std::size_t connections) {
    connections = std::max<std::size_t>(1, std::min(connections, store.options.max_connections));
    store.router.on_connections_of_each_master(connections, [](Connection& connection) {
        connection.preload(
            {&claim_script(), &complete_script(), &release_script(), &claim_commit_script()});
    });
}

}  // namespace redis
IDEM_END_NAMESPACE
