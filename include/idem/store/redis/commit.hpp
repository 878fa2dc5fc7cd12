#pragma once
/// @file
/// @brief The Redis store's commit: the complete script's call encoded once (for one server, a
/// hash slot's share of a Cluster commit, and the writes after it), the attached stream acks,
/// the round trip with its `WAIT` and a pipelined next claim, and what the replies mean.
/// Link idem::redis.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/store.hpp"
#include "idem/error.hpp"
#include "idem/redis/stream_ack.hpp"
#include "idem/store/redis/context.hpp"
#include "idem/store/redis/replication.hpp"
#include "idem/store/redis/scripts.hpp"
#include "idem/store/redis/transaction_state.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// Writes the complete script's KEYS then the head of its ARGV (layout at complete_source()):
/// the claims claim_at(0 .. claims - 1) with their outcomes, the dead letters
/// all_letters[letter_index(0 .. letters - 1)] (the transaction's, by position) and the freed
/// leases released_at(...). The caller appends the command count and the commands. Returns the
/// number of keys.
template <class ClaimAt, class LetterIndex, class ReleasedAt>
std::size_t encode_commit(Args& a, const StoreContext& store, std::string_view token,
                          std::size_t claims, ClaimAt&& claim_at,
                          const std::vector<DeadLetter>& all_letters, std::size_t letters,
                          LetterIndex&& letter_index, std::size_t released,
                          ReleasedAt&& released_at) {
    for (std::size_t k = 0; k < claims; ++k)
        a.add(claim_at(k).key);
    for (std::size_t k = 0; k < letters; ++k) {
        const DeadLetter& letter = all_letters[letter_index(k)];
        a.add(store.keys.dead_letter(letter.scope, letter.message_id));
    }
    for (std::size_t k = 0; k < released; ++k)
        a.add(released_at(k));
    const std::size_t num_keys = a.count();
    a.add(store.now_arg()).add(token).add(claims);
    for (std::size_t k = 0; k < claims; ++k) {
        const HeldClaim& held = claim_at(k);
        a.add(held.outcome.empty() ? std::string_view("in_progress") : held.outcome)
            .add(held.reason);
    }
    a.add(letters);
    // The order of the letters of one commit, whatever slot (and script) each goes to: the
    // commit's time, then the letter's rank in the transaction.
    const std::string stamp =
        letters == 0 ? std::string()
                     : std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(
                                          std::chrono::system_clock::now().time_since_epoch())
                                          .count());
    for (std::size_t k = 0; k < letters; ++k) {
        const std::size_t rank = letter_index(k);
        const DeadLetter& letter = all_letters[rank];
        a.add(letter.scope)
            .add(letter.message_id)
            .add(letter.delivery_count)
            .add(letter.reason)
            .add(letter.payload);
        if (letter.created_at == std::chrono::system_clock::time_point{}) {
            a.add(std::string_view());
        } else {
            a.add(to_unix_ms(letter.created_at));
        }
        a.add(stamp).add(rank + 1).add(letter.origin).add(letter.origin_position);
    }
    return num_keys;
}

/// The attached hooks' acks: adds to @p out the dead-letter stream entries and then the XACKs of
/// the entries this commit completes, and returns their hooks. Hooks are matched to the
/// transaction's work by CommitHook::scope and message_id (set by the handler). For each
/// (scope, message id): a claim with a final outcome (processed, rejected, dead_lettered) is the
/// id's first hook's (claims go to an id's first copy; later copies in a batch are its
/// duplicates, acked by the caller); without a claim, dead letters pair with the hooks in order
/// when there is exactly one per hook (a malformed delivery, an id reused with another payload).
/// Anything else (failed, deferred, in_progress, duplicate, a request this store does not know)
/// is left to the caller.
inline std::vector<CommitHook*> hook_commands(const TransactionState& tx, Commands& out);

/// The XADD of @p hook's stream entry's dead-letter copy, parked for @p reason. The count and
/// the noted failures are those of @p tx's dead letter of the message (the count the handler
/// judged), else the broker's count: a stream's copy says what the store's entry says.
inline std::vector<std::string> stream_copy(const TransactionState& tx, const CommitHook& hook,
                                            const StreamAck& ack, const std::string& reason) {
    const DeadLetter* parked = nullptr;
    for (const DeadLetter& letter : tx.letters()) {
        if (letter.scope == hook.scope && letter.message_id == hook.message_id) {
            parked = &letter;
            break;
        }
    }
    return stream_dead_letter_command(
        ack.dead_letter_destination(), ack.stream, ack.entry_id, ack.fields, reason, hook.scope,
        hook.message_id, parked != nullptr ? parked->delivery_count : ack.delivery_count,
        parked != nullptr ? parked->noted() : std::nullopt);
}

/// hook_commands() for ONE attached hook (a single message's commit, the RedisStreamConsumer's
/// every pipelined commit): the same rule without grouping anything.
inline std::vector<CommitHook*> one_hook_command(const TransactionState& tx, CommitHook& hook,
                                                 Commands& out) {
    const StreamAck* ack = hook.request_as<StreamAck>();
    if (ack == nullptr) return {};  // not a stream ack (any more)
    const std::string* dead_letter_reason = nullptr;
    if (const HeldClaim* held = tx.held(hook.scope, hook.message_id)) {
        const HeldClaim& claim = *held;
        Disposition outcome = Disposition::in_progress;
        if (claim.outcome.empty() || !from_string(claim.outcome, outcome)) return {};
        if (!should_ack(outcome)) return {};
        if (outcome == Disposition::dead_lettered) dead_letter_reason = &claim.reason;
    } else {  // no claim: exactly one dead letter of this (scope, id) pairs with the hook
        const DeadLetter* found = nullptr;
        for (const DeadLetter& letter : tx.letters()) {
            if (letter.scope != hook.scope || letter.message_id != hook.message_id) continue;
            if (found != nullptr) return {};
            found = &letter;
        }
        if (found == nullptr) return {};
        dead_letter_reason = &found->reason;
    }
    if (dead_letter_reason != nullptr) {  // never XACKed without its copy
        out.add(stream_copy(tx, hook, *ack, *dead_letter_reason));
    }
    out.add({"XACK", ack->stream, ack->group, ack->entry_id});
    return {&hook};
}

inline std::vector<CommitHook*> hook_commands(const TransactionState& tx, Commands& out) {
    if (tx.hooks().size() == 1) return one_hook_command(tx, *tx.hooks().front(), out);
    // Entries and dead letters grouped by (scope, message id), in one pass each.
    auto group_key = [](std::string_view scope, std::string_view id) {
        std::string key = std::to_string(scope.size());
        key += ':';
        key.append(scope).append(id);
        return key;
    };
    std::vector<std::string> order;
    std::unordered_map<std::string, std::vector<CommitHook*>> copies_of;
    for (CommitHook* hook : tx.hooks()) {
        if (hook->request_as<StreamAck>() == nullptr) continue;  // not a stream ack (any more)
        auto [it, added] = copies_of.try_emplace(group_key(hook->scope, hook->message_id));
        if (added) order.push_back(it->first);
        it->second.push_back(hook);
    }
    std::unordered_map<std::string, std::vector<const DeadLetter*>> letters_of;
    for (const auto& letter : tx.letters())
        letters_of[group_key(letter.scope, letter.message_id)].push_back(&letter);

    std::vector<CommitHook*> acked;
    Commands xacks;
    auto add = [&](CommitHook& hook, const std::string* dead_letter_reason) {
        const StreamAck& ack = *hook.request_as<StreamAck>();
        if (dead_letter_reason != nullptr) {  // never XACKed without its copy
            out.add(stream_copy(tx, hook, ack, *dead_letter_reason));
        }
        xacks.add({"XACK", ack.stream, ack.group, ack.entry_id});
        acked.push_back(&hook);
    };
    for (const std::string& key : order) {
        const std::vector<CommitHook*>& copies = copies_of[key];
        CommitHook& first = *copies.front();
        if (const HeldClaim* held = tx.held(first.scope, first.message_id)) {
            const HeldClaim& claim = *held;
            Disposition outcome = Disposition::in_progress;
            if (claim.outcome.empty() || !from_string(claim.outcome, outcome)) continue;
            // The consumer's own rule (should_ack), so a commit acks exactly what it would.
            if (should_ack(outcome)) {
                add(first, outcome == Disposition::dead_lettered ? &claim.reason : nullptr);
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

/// Whether everything @p tx's commit touches, and @p key, can go in ONE script call on one node:
/// always on one server; on a Cluster only when every key of the commit (claims, dead letters,
/// freed leases, queued writes) is in @p key's slot and no hook is attached (a stream is in
/// another slot).
[[nodiscard]] inline bool fits_one_call(StoreContext& store, const TransactionState& tx,
                                        std::string_view key) {
    if (!store.cluster()) return true;
    const std::uint16_t slot = hash_slot(key);
    if (!tx.hooks().empty() || !tx.writes_in(slot)) return false;
    for (const HeldClaim& held : tx.claims()) {
        if (hash_slot(held.key) != slot) return false;
    }
    for (const DeadLetter& letter : tx.letters()) {
        if (hash_slot(store.keys.dead_letter(letter.scope, letter.message_id)) != slot) {
            return false;
        }
    }
    for (const std::string& key : tx.released()) {
        if (hash_slot(key) != slot) return false;
    }
    return true;
}

/// The whole transaction's commit script call, encoded once, and the attached hooks it acks.
struct PreparedCommit {
    /// The script's keys, then its arguments.
    Args call;
    /// How many of `call` are keys.
    std::size_t num_keys = 0;
    /// The attached hooks whose acks are in `call`.
    std::vector<CommitHook*> acked_hooks;
};
/// The complete script's call for all of @p tx (one server): its claims, dead letters, leases to
/// free, queued writes, then the attached hooks' acks.
inline PreparedCommit prepare_commit(const StoreContext& store, const TransactionState& tx) {
    PreparedCommit prepared;
    Args& call = prepared.call;
    call.reserve(256 + 96 * tx.claims().size() + tx.commands().resp().size());
    prepared.num_keys = encode_commit(
        call, store, tx.token(), tx.claims().size(),
        [&](std::size_t k) -> const HeldClaim& { return tx.claims()[k]; }, tx.letters(),
        tx.letters().size(), [](std::size_t k) { return k; }, tx.released().size(),
        [&](std::size_t k) -> const std::string& { return tx.released()[k]; });
    // The attached stream acks (and dead-letter stream entries) run after the effect's writes.
    Commands acks;
    if (!tx.hooks().empty()) prepared.acked_hooks = hook_commands(tx, acks);
    call.add(tx.command_count() + acks.count).append(tx.commands()).append(acks.args);
    return prepared;
}

/// The replies of commit_round_trip().
struct CommitReplies {
    Reply commit;                    ///< the commit script's
    std::optional<Reply> replicas;   ///< WAIT's, with replicas_to_ack
    std::vector<Reply> next_claims;  ///< one per command of @p next_claims
};
/// The commit script of @p prepared, then `WAIT` when the store asks replicas to confirm
/// commits, then @p next_claims (commit_with_next_claim()'s `SET … NX GET`), in ONE round trip
/// on @p connection. After a NOSCRIPT the re-run script is followed by WAIT again (it confirms
/// only the writes before it: AfterNoscript::resend), not by the claims (they already ran:
/// AfterNoscript::keep_reply).
inline CommitReplies commit_round_trip(Connection& connection, const RedisOptions& options,
                                       const PreparedCommit& prepared,
                                       const std::vector<Args>& next_claims = {}) {
    CommitReplies out;
    const std::optional<Args> wait = wait_command(options);
    if (!wait && next_claims.empty()) {
        out.commit = connection.eval(complete_script(), prepared.num_keys, prepared.call);
        return out;
    }
    std::vector<ThenCommand> then;
    then.reserve(1 + next_claims.size());
    if (wait) then.push_back(ThenCommand{&*wait, AfterNoscript::resend});
    for (const Args& claim : next_claims)
        then.push_back(ThenCommand{&claim, AfterNoscript::keep_reply});
    std::vector<Reply> replies =
        connection.eval_then(complete_script(), prepared.num_keys, prepared.call, then);
    auto next = std::make_move_iterator(replies.begin());
    out.commit = *next++;
    if (wait) out.replicas = *next++;
    out.next_claims.assign(next, std::make_move_iterator(replies.end()));
    return out;
}

/// What a commit script's reply says (the complete script's, or the claim-and-commit script's).
struct CommitVerdict {
    /// @brief committed; lease_lost (another worker took a claim over: nothing written); parked (a
    /// write failed after others were applied: the claims parked as dead letters); write_failed
    /// (the first write failed: nothing applied).
    enum class Kind { committed, lease_lost, parked, write_failed };
    /// What the script did.
    Kind kind = Kind::committed;
    std::string problem;  ///< why not committed; empty when it was
};
/// Reads @p reply, an error reply excepted. @p claim_at(i) is the claim of the script's i-th
/// key; @p unwritten says what a lost lease left unwritten ("nothing", "nothing of its hash slot").
template <class ClaimAt>
CommitVerdict read_commit_reply(const Reply& reply, ClaimAt&& claim_at,
                                std::string_view unwritten) {
    CommitVerdict verdict;
    if (reply.type == Reply::Type::string && reply.str == "ok") return verdict;
    const std::string status = reply.elements.empty() ? std::string() : reply.elements[0].str;
    const bool detailed = reply.elements.size() > 2;
    if (status == "lease_lost" && detailed) {
        const HeldClaim& held =
            claim_at(static_cast<std::size_t>(parse_int(reply.elements[1].str)) - 1);
        verdict.kind = CommitVerdict::Kind::lease_lost;
        verdict.problem = fmt::format(
            "lease lost: the claim on {}/{} expired and another worker took it over ({}); {} was "
            "written",
            held.scope, held.id,
            reply.elements[2].str == "leased" ? "it holds it now" : reply.elements[2].str,
            unwritten);
        return verdict;
    }
    if (status == "partial" && detailed) {
        verdict.kind = CommitVerdict::Kind::parked;
        verdict.problem = reply.elements[2].str +
                          "; the claim is parked as a dead letter so a redelivery does not apply "
                          "them twice";
        return verdict;
    }
    verdict.kind = CommitVerdict::Kind::write_failed;
    verdict.problem =
        fmt::format("a Redis write of the commit failed before anything was applied: {}",
                    detailed ? reply.elements[2].str : "unknown reply");
    return verdict;
}

/// Concludes a one-server commit from its replies: null when it committed (the claims are done and
/// its hooks acked: nothing is left to release), else the error to throw once the transaction
/// freed what is still its own (a parked claim is not: the script parked it).
inline std::exception_ptr conclude_commit(StoreContext& store, TransactionState& tx,
                                          const CommitReplies& replies,
                                          const std::vector<CommitHook*>& acked_hooks) {
    store.check_script(replies.commit, "commit");
    const CommitVerdict verdict = read_commit_reply(
        replies.commit,
        [&](std::size_t i) -> const HeldClaim& {
            // The script names the claim by its key's number; another is not a reply of ours.
            if (i >= tx.claims().size())
                throw store_error("idem: Redis commit script: unexpected reply");
            return tx.claims()[i];
        },
        "nothing");
    if (verdict.kind == CommitVerdict::Kind::committed) {
        // Committed on the master: not ours to release any more, whatever WAIT says.
        tx.forget_committed();
        if (replies.replicas && !confirmed(store.options, *replies.replicas)) {
            return std::make_exception_ptr(
                commit_unconfirmed(unconfirmed_text(store, *replies.replicas)));
        }
        for (CommitHook* hook : acked_hooks)
            hook->acked_in_commit = true;
        return nullptr;
    }
    if (verdict.kind == CommitVerdict::Kind::parked) tx.forget_claims();
    return std::make_exception_ptr(commit_failed(verdict.problem));
}

/// commit() on one server: the whole transaction in one script call, one round trip. Null when it
/// committed, else the error to throw (conclude_commit()).
inline std::exception_ptr commit_one_server(StoreContext& store, TransactionState& tx) {
    const PreparedCommit prepared = prepare_commit(store, tx);
    const CommitReplies replies = store.router.on_any(
        [&](Connection& c) { return commit_round_trip(c, store.options, prepared); });
    return conclude_commit(store, tx, replies, prepared.acked_hooks);
}

}  // namespace redis
IDEM_END_NAMESPACE
