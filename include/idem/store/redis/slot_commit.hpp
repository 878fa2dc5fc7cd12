#pragma once
/// @file
/// @brief A RedisStore commit on a Redis Cluster: the complete script once per hash slot of the
/// transaction's claims (each with its dead letters, freed leases and the writes whose key is in
/// that slot), pipelined per node, then the writes outside their claims' slots; truthful about
/// what committed (partial_commit). Link idem::redis.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/store/redis/commit.hpp"
#include "idem/store/redis/context.hpp"
#include "idem/store/redis/replication.hpp"
#include "idem/store/redis/scripts.hpp"
#include "idem/store/redis/transaction_state.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// One hash slot's share of a cluster commit: one complete-script call.
struct SlotGroup {
    std::vector<std::size_t> claims;   ///< into the transaction's claims
    std::vector<std::size_t> letters;  ///< into its dead letters
    /// Keys of leases to free, in the transaction.
    std::vector<const std::string*> released;
    /// The queued writes that go with these claims.
    Commands commands;
};

/// The complete script's call for @p group.
inline SlotCall slot_call(const StoreContext& store, const TransactionState& tx, std::uint16_t slot,
                          const SlotGroup& group) {
    SlotCall call;
    call.slot = slot;
    call.num_keys = encode_commit(
        call.keys_then_args, store, tx.token(), group.claims.size(),
        [&](std::size_t k) -> const HeldClaim& { return tx.claims()[group.claims[k]]; },
        tx.letters(), group.letters.size(), [&](std::size_t k) { return group.letters[k]; },
        group.released.size(),
        [&](std::size_t k) -> const std::string& { return *group.released[k]; });
    call.keys_then_args.add(group.commands.count).append(group.commands.args);
    return call;
}

/// Why one slot group's commit reply is not "ok" (empty when it is); @p parked: the script
/// parked its claims.
inline std::string slot_problem(const TransactionState& tx, const Reply& reply,
                                const std::string& unreachable, const SlotGroup& group,
                                bool* parked) {
    *parked = false;
    if (!unreachable.empty()) return "Redis unreachable, outcome unknown: " + unreachable;
    if (reply.is_error()) return "the commit script failed: " + reply.str;
    CommitVerdict verdict = read_commit_reply(
        reply,
        [&](std::size_t i) -> const HeldClaim& {
            // The script names the claim by its key's number; another is not a reply of ours.
            if (i >= group.claims.size()) {
                throw store_error("idem: Redis commit script: unexpected reply");
            }
            return tx.claims().at(group.claims[i]);
        },
        "nothing of its hash slot");
    *parked = verdict.kind == CommitVerdict::Kind::parked;
    return std::move(verdict.problem);
}

/// The writes queued on a cluster, each placed: with its claim's slot group (or beside the
/// claims, for a write of no message), or in @p later (outside its claim's slot).
struct LaterWrite {
    /// The hash slot of its key.
    std::uint16_t slot;
    const std::string* owner;  ///< the claim key of its message; null: none
    std::string_view resp;     ///< {argc, args...} as encoded in the transaction's commands
    /// How many encoded arguments `resp` holds (each argc included).
    std::size_t count;
};

/// commit() on a Redis Cluster. Null when everything committed; else the error to throw once
/// @p tx freed what is still its own (what committed or was parked is removed from its claims).
inline std::exception_ptr commit_per_slot(StoreContext& store, TransactionState& tx) {
    // In the order the transaction first touched each slot: one node's scripts run in that
    // order (dead letters of a batch keep their order on each node).
    std::vector<std::pair<std::uint16_t, SlotGroup>> groups;
    std::unordered_map<std::uint16_t, std::size_t> group_at;
    auto group = [&](std::uint16_t slot) -> SlotGroup& {
        auto [it, added] = group_at.try_emplace(slot, groups.size());
        if (added) groups.emplace_back(slot, SlotGroup{});
        return groups[it->second].second;
    };
    for (std::size_t i = 0; i < tx.claims().size(); ++i)
        group(hash_slot(tx.claims()[i].key)).claims.push_back(i);
    for (std::size_t d = 0; d < tx.letters().size(); ++d) {
        const DeadLetter& letter = tx.letters()[d];
        group(hash_slot(store.keys.dead_letter(letter.scope, letter.message_id)))
            .letters.push_back(d);
    }
    for (const std::string& key : tx.released())
        group(hash_slot(key)).released.push_back(&key);
    std::vector<LaterWrite> later;
    std::size_t start = 0;
    const std::string_view encoded = tx.commands().resp();
    std::size_t start_count = 0;
    for (const TransactionState::WritePlace& place : tx.write_places()) {
        const std::string_view resp = encoded.substr(start, place.end.bytes - start);
        const std::size_t count = place.end.count - start_count;
        start = place.end.bytes;
        start_count = place.end.count;
        const bool with_owner = !place.owner.empty() && hash_slot(place.owner) == place.slot;
        const bool beside_claims = place.owner.empty() && group_at.count(place.slot) != 0;
        if (with_owner || beside_claims) {
            group(place.slot).commands.add_encoded(resp, count);
        } else {
            later.push_back(
                LaterWrite{place.slot, place.owner.empty() ? nullptr : &place.owner, resp, count});
        }
    }

    std::vector<SlotCall> calls;
    for (const auto& [slot, slot_group] : groups)
        calls.push_back(slot_call(store, tx, slot, slot_group));
    std::vector<std::string> unreachable;
    // With replicas_to_ack, each node's pipeline ends with WAIT: a group its replicas did not
    // confirm is applied on its master but unconfirmed, and not reported as committed.
    const std::optional<Args> wait = wait_command(store.options);
    std::vector<Reply> waited;
    const Args* wait_args = wait ? &*wait : nullptr;
    std::vector<Reply> replies =
        calls.empty()
            ? std::vector<Reply>{}
            : store.router.eval_each(complete_script(), calls, &unreachable, wait_args, &waited);
    bool only_unconfirmed = true;

    std::vector<bool> done(tx.claims().size(), false);  ///< committed (or parked by the script)
    std::vector<partial_commit::Id> committed;
    std::string first_problem;
    bool only_unreachable = true;
    for (std::size_t g = 0; g < groups.size(); ++g) {
        const SlotGroup& called = groups[g].second;
        bool parked = false;
        std::string problem = slot_problem(tx, replies[g], unreachable[g], called, &parked);
        if (problem.empty() || parked) {
            for (std::size_t i : called.claims)
                done[i] = true;
        }
        const bool unconfirmed = problem.empty() && wait && !confirmed(store.options, waited[g]);
        if (unconfirmed) problem = unconfirmed_text(store, waited[g]);
        only_unconfirmed = only_unconfirmed && unconfirmed;
        if (problem.empty()) {
            for (std::size_t i : called.claims)
                committed.emplace_back(tx.claims()[i].scope, tx.claims()[i].id);
            for (std::size_t d : called.letters)
                committed.emplace_back(tx.letters()[d].scope, tx.letters()[d].message_id);
            continue;
        }
        if (first_problem.empty()) first_problem = problem;
        // Unreachable, or answered that it cannot serve now (LOADING, MASTERDOWN: nothing ran).
        only_unreachable =
            only_unreachable && (!unreachable[g].empty() || is_unavailable_error(replies[g]));
    }

    // The writes outside their claims' slots, for the messages whose claim committed.
    auto owner_committed = [&](const std::string* owner) {
        if (owner == nullptr) return first_problem.empty();
        for (std::size_t i = 0; i < tx.claims().size(); ++i) {
            if (tx.claims()[i].key == *owner) return bool(done[i]);
        }
        return false;
    };
    std::map<std::uint16_t, SlotGroup> after;
    std::map<std::uint16_t, std::vector<const std::string*>> owners_of;
    for (const LaterWrite& write : later) {
        if (!owner_committed(write.owner)) continue;
        after[write.slot].commands.add_encoded(write.resp, write.count);
        owners_of[write.slot].push_back(write.owner);
    }
    if (!after.empty()) {
        std::vector<SlotCall> later_calls;
        std::vector<std::uint16_t> later_slots;
        for (const auto& [slot, slot_group] : after) {
            later_calls.push_back(slot_call(store, tx, slot, slot_group));
            later_slots.push_back(slot);
        }
        std::vector<std::string> later_unreachable;
        std::vector<Reply> later_waited;
        std::vector<Reply> later_replies = store.router.eval_each(
            complete_script(), later_calls, &later_unreachable, wait_args, &later_waited);
        for (std::size_t g = 0; g < later_calls.size(); ++g) {
            bool parked = false;
            std::string problem = slot_problem(tx, later_replies[g], later_unreachable[g],
                                               after[later_slots[g]], &parked);
            if (problem.empty() && wait && !confirmed(store.options, later_waited[g])) {
                problem = unconfirmed_text(store, later_waited[g]);
            }
            if (problem.empty()) continue;
            only_unconfirmed = false;
            // The claims are done but these writes of their effect are not: say so.
            const std::string text = fmt::format(
                "the claim committed but its writes outside the claim's hash slot did not "
                "({}); they are not retried",
                problem);
            if (first_problem.empty()) first_problem = text;
            only_unreachable = false;
            for (const std::string* owner : owners_of[later_slots[g]]) {
                for (std::size_t i = 0; i < tx.claims().size(); ++i) {
                    if (owner == nullptr || tx.claims()[i].key != *owner) continue;
                    committed.erase(
                        std::remove(committed.begin(), committed.end(),
                                    partial_commit::Id{tx.claims()[i].scope, tx.claims()[i].id}),
                        committed.end());
                }
            }
        }
    }

    // What committed or was parked is not ours to release any more; the rest is freed.
    tx.forget_done(done, first_problem.empty());
    if (first_problem.empty()) return nullptr;
    if (!committed.empty()) {
        return std::make_exception_ptr(partial_commit(
            fmt::format("only part of the transaction committed on the Redis Cluster "
                        "({} of its messages): {}",
                        committed.size(), first_problem),
            std::move(committed)));
    }
    if (only_unreachable) {
        return std::make_exception_ptr(store_unavailable("idem: Redis commit: " + first_problem));
    }
    if (wait && only_unconfirmed) return std::make_exception_ptr(commit_unconfirmed(first_problem));
    return std::make_exception_ptr(commit_failed(first_problem));
}

}  // namespace redis
IDEM_END_NAMESPACE
