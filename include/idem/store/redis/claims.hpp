#pragma once
/// @file
/// @brief The Redis store's claims: a new id by one `SET … NX PX … GET` (pipelined for a
/// batch), a contested one (leased by another worker, or released) by the claim script, which
/// answers in_progress or takes it over; and the release of a transaction's leases. Link
/// idem::redis.

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
#include "idem/error.hpp"
#include "idem/store/redis/context.hpp"
#include "idem/store/redis/record.hpp"
#include "idem/store/redis/replication.hpp"
#include "idem/store/redis/scripts.hpp"
#include "idem/store/redis/transaction_state.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// The `SET … NX PX … GET` of each of @p held: a new record, leased to @p tx. The record
/// (Record::new_head() + Record::fields()) is written straight into the command, in parts.
inline std::vector<Args> set_claims(const StoreContext& store, const TransactionState& tx,
                                    const std::vector<HeldClaim>& held) {
    const std::string now = store.now_arg();
    const Decimal retention(tx.retention_ms());
    const Decimal lease(tx.lease().count());
    // `~<retention>`: the server's now, which a plain SET cannot read (Record::new_head()).
    const std::string_view tilde = now.empty() ? std::string_view("~") : std::string_view();
    const std::string_view time = now.empty() ? retention.view() : std::string_view(now);
    std::vector<Args> sets(held.size());
    for (std::size_t i = 0; i < held.size(); ++i) {
        const HeldClaim& h = held[i];
        const Decimal fp_size(h.fingerprint.size());
        const Decimal scope_size(h.scope.size());
        const Decimal id_size(h.id.size());
        sets[i].reserve(96 + h.key.size() + 2 * (h.fingerprint.size() + h.id.size()) +
                        h.scope.size() + tx.token().size());
        sets[i].add("SET").add(h.key).add_parts({"leased|", tx.token(),
                                                 "||1|",    tilde,
                                                 time,      "|",
                                                 tilde,     time,
                                                 "|",       lease.view(),
                                                 "|",       fp_size.view(),
                                                 "|",       scope_size.view(),
                                                 "|",       id_size.view(),
                                                 "\n",      h.fingerprint,
                                                 h.scope,   h.id});
        sets[i].add("NX").add("PX").add(retention.view()).add("GET");
    }
    return sets;
}

/// Reads the replies of set_claims(@p held) into @p results, lists in @p contested the ids
/// the claim script must decide, and moves the new claims into @p tx. False (nothing decided,
/// nothing written) when the server does not know `SET … NX … GET`, which then stays off for
/// this store. An id @p tx held before (its first @p held_before claims) is its own duplicate.
inline bool read_set_claims(StoreContext& store, TransactionState& tx, std::vector<HeldClaim>& held,
                            std::vector<Reply>& replies, std::vector<ClaimResult>& results,
                            std::size_t held_before, std::vector<std::size_t>& contested) {
    if (!replies.empty() && replies[0].is_error() &&
        replies[0].str.rfind("ERR syntax error", 0) == 0) {
        store.claim_with_set.store(false, std::memory_order_relaxed);
        return false;
    }
    const Reply* error = nullptr;  // thrown once the claims that went in are ours
    for (std::size_t i = 0; i < held.size(); ++i) {
        Reply& reply = replies[i];
        if (reply.is_error()) {
            if (error == nullptr) error = &reply;
            continue;
        }
        std::optional<ClaimResult> own;
        if (held_before > 0) own = tx.own_claim(held[i].scope, held[i].id);
        if (own) {
            results[i] = *own;
            continue;
        }
        if (reply.is_nil()) {  // a new claim: attempt 1
            results[i].status = ClaimStatus::claimed;
            results[i].fingerprint = held[i].fingerprint;
            results[i].attempts = 1;
            tx.hold(std::move(held[i]));
            continue;
        }
        auto record = Record::decode(reply.str);
        if (!record) {
            if (error == nullptr) error = &reply;
            continue;
        }
        const bool mine = record->state == "leased" && record->token == tx.token();
        if (record->state == "done" || mine) {  // finished, or a second copy of ours
            results[i].status = ClaimStatus::duplicate;
            results[i].recorded =
                mine ? Disposition::in_progress : disposition_from(record->outcome);
            results[i].fingerprint = std::move(record->fingerprint);
            results[i].attempts = record->attempts;
            continue;
        }
        contested.push_back(i);
    }
    if (error != nullptr) {
        const std::string message =
            fmt::format("idem: Redis claim (SET … NX GET): {}",
                        error->is_error() ? error->str : "unreadable claim record");
        if (error->is_error()) throw_reply_error(*error, message);
        throw store_error(message);
    }
    return true;
}

/// The claim script for the @p contested of @p held: one call per hash slot (one in all on one
/// server), pipelined per node; one answer per id.
inline std::vector<Reply> claim_by_script(StoreContext& store, const TransactionState& tx,
                                          const std::vector<HeldClaim>& held,
                                          const std::vector<std::size_t>& contested) {
    const auto groups = store.by_slot(contested.size(), [&](std::size_t k) -> const std::string& {
        return held[contested[k]].key;
    });
    std::vector<SlotCall> calls;
    calls.reserve(groups.size());
    const std::string now = store.now_arg();
    for (const auto& [slot, positions] : groups) {
        SlotCall call;
        call.slot = slot;
        call.num_keys = positions.size();
        call.keys_then_args.reserve(128 * positions.size() + 128);
        for (std::size_t k : positions)
            call.keys_then_args.add(held[contested[k]].key);
        call.keys_then_args.add(tx.token()).add(tx.lease().count()).add(tx.retention_ms()).add(now);
        for (std::size_t k : positions) {
            const HeldClaim& c = held[contested[k]];
            call.keys_then_args.add(Record::fields(c.fingerprint, c.scope, c.id));
        }
        calls.push_back(std::move(call));
    }
    std::vector<Reply> replies = store.eval_calls(claim_script(), calls);
    std::vector<Reply> answers(contested.size());
    std::size_t g = 0;
    for (const auto& [slot, positions] : groups) {
        Reply& reply = replies[g++];
        store.check_script(reply, "claim");
        if (positions.size() == 1) {  // one id: the script answers it alone
            answers[positions.front()] = std::move(reply);
            continue;
        }
        if (reply.elements.size() != positions.size()) {
            throw store_error("idem: Redis claim script: unexpected reply");
        }
        for (std::size_t k = 0; k < positions.size(); ++k)
            answers[positions[k]] = std::move(reply.elements[k]);
    }
    return answers;
}

/// Reads one id's claim-script answer: 1 for a new claim, else {status, detail, fingerprint,
/// attempts}. A claimed id joins @p tx's leases.
inline ClaimResult take(TransactionState& tx, HeldClaim held, Reply& answer) {
    ClaimResult result;
    if (answer.type == Reply::Type::integer) {  // a new claim: attempt 1
        result.status = ClaimStatus::claimed;
        result.fingerprint = held.fingerprint;
        result.attempts = 1;
        tx.hold(std::move(held));
        return result;
    }
    if (!answer.is_array() || answer.elements.size() != 4) {
        throw store_error("idem: Redis claim script: unexpected reply");
    }
    const std::string& status = answer.elements[0].str;
    result.fingerprint = std::move(answer.elements[2].str);
    result.attempts = static_cast<std::uint32_t>(parse_int(answer.elements[3].str));
    if (status == "duplicate") {
        result.status = ClaimStatus::duplicate;
        result.recorded = disposition_from(answer.elements[1].str);
    } else if (status == "in_progress") {
        result.status = ClaimStatus::in_progress;
        // The script's detail is what is left of the holder's lease, in milliseconds.
        result.retry_after = std::chrono::milliseconds(parse_int(answer.elements[1].str));
    } else {
        result.status = ClaimStatus::claimed;
        tx.hold(std::move(held));
    }
    return result;
}

/// Claims @p count ids of @p scope for @p tx in one round trip: a pipelined `SET … NX PX … GET`
/// per id, which claims a new id outright and otherwise returns its record without writing. A
/// finished id is then a duplicate, a second copy of an id of this call is this transaction's
/// own; only the rest (leased by another worker, or released) go through the claim script, in
/// one more round trip. Without SET claims (option off, or a server before 7.0) every id goes
/// through the script. @p fingerprints is null or one per id.
inline std::vector<ClaimResult> claim_all(StoreContext& store, TransactionState& tx,
                                          std::string_view scope, const std::string_view* ids,
                                          std::size_t count, const std::string_view* fingerprints) {
    std::vector<HeldClaim> held;
    held.reserve(count);
    for (std::size_t i = 0; i < count; ++i) {
        held.push_back(
            HeldClaim{std::string(scope),
                      std::string(ids[i]),
                      store.keys.claim(scope, ids[i]),
                      fingerprints != nullptr ? std::string(fingerprints[i]) : std::string(),
                      {},
                      {}});
    }
    const std::size_t held_before = tx.claims().size();
    std::vector<ClaimResult> results(count);
    std::vector<std::size_t> contested;  // for the script
    bool decided = false;
    if (store.claim_with_set.load(std::memory_order_relaxed)) {
        std::vector<Reply> replies =
            store.pipeline(set_claims(store, tx, held),
                           [&](std::size_t i) -> const std::string& { return held[i].key; });
        decided = read_set_claims(store, tx, held, replies, results, held_before, contested);
    }
    if (!decided) {  // the server refused SET … GET (nothing was written), or it is off
        contested.clear();
        for (std::size_t i = 0; i < count; ++i)
            contested.push_back(i);
    }
    if (!contested.empty()) {
        std::vector<Reply> answers = claim_by_script(store, tx, held, contested);
        // An id this transaction held before the call is its own duplicate; a second copy of an
        // id in this call the script already answers so (the first copy made the lease ours).
        for (std::size_t k = 0; k < contested.size(); ++k) {
            const std::size_t i = contested[k];
            std::optional<ClaimResult> own;
            if (held_before > 0) own = tx.own_claim(held[i].scope, held[i].id);
            results[i] = own ? *own : take(tx, std::move(held[i]), answers[k]);
        }
    }
    confirm_duplicates(store, held, results);
    return results;
}

/// Frees the leases of @p keys that @p token still holds: one script (one per hash slot on a
/// cluster, pipelined per node). @p script: release_script(), or release_unstarted_script() to
/// take back the attempts too (effects that never started).
inline std::vector<Reply> release(StoreContext& store, const std::string& token,
                                  const std::vector<std::string>& keys,
                                  const Script& script = release_script()) {
    std::vector<SlotCall> calls;
    for (const auto& [slot, positions] :
         store.by_slot(keys.size(), [&](std::size_t i) -> const std::string& { return keys[i]; })) {
        SlotCall call;
        call.slot = slot;
        call.num_keys = positions.size();
        for (std::size_t i : positions)
            call.keys_then_args.add(keys[i]);
        call.keys_then_args.add(token);
        calls.push_back(std::move(call));
    }
    if (calls.empty()) return {};
    return store.eval_calls(script, calls);
}

}  // namespace redis
IDEM_END_NAMESPACE
