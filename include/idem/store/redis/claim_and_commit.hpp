#pragma once
/// @file
/// @brief The Redis store's claim-and-commit (idem/contract/store.hpp), for a local effect that
/// already ran with no claim held: ONE script that claims the id and, only if it is new (or
/// free, or its lease expired), applies the queued writes and the hooks' XACKs and records the
/// claim done. Link idem::redis.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/store.hpp"
#include "idem/error.hpp"
#include "idem/store/redis/commit.hpp"
#include "idem/store/redis/context.hpp"
#include "idem/store/redis/record.hpp"
#include "idem/store/redis/replication.hpp"
#include "idem/store/redis/scripts.hpp"
#include "idem/store/redis/transaction_state.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// What claim_and_commit_round_trip() sent and got back.
struct ClaimAndCommitSent {
    bool attempted = false;  ///< false: nothing was sent (the writes are in another slot)
    /// The script's answer (when attempted).
    Reply reply;
    std::optional<Reply> replicas;  ///< WAIT's, with replicas_to_ack
    /// The attached hooks whose acks went with the script: marked acked_in_commit once it
    /// committed.
    std::vector<CommitHook*> acked_hooks;
};

/// The claim-and-commit script for @p request with @p tx's queued writes and hooks, and the
/// replication mark and WAIT after it with replicas_to_ack, in one round trip. On a Redis Cluster
/// only when every write is in the claim's slot (else nothing is sent: fits_one_call()).
inline ClaimAndCommitSent claim_and_commit_round_trip(StoreContext& store, TransactionState& tx,
                                                      const ClaimAndCommit& request) {
    ClaimAndCommitSent sent;
    const std::string key = store.keys.claim(request.scope, request.message_id);
    if (!fits_one_call(store, tx, key)) return sent;
    sent.attempted = true;
    const std::string_view outcome =
        request.outcome ? to_string(*request.outcome) : std::string_view();
    // The hooks' acks, for the outcome this call records (none for a failed effect).
    Commands acks;
    if (request.outcome && !tx.hooks().empty()) {
        tx.hold(HeldClaim{std::string(request.scope), std::string(request.message_id), key,
                          std::string(request.fingerprint), outcome, std::string(request.reason)});
        sent.acked_hooks = hook_commands(tx, acks);
        tx.forget_claims();  // no lease is held: nothing to release
    }
    // A new id's record, whole: attempt 1, claimed now; done with the outcome, or free.
    const std::string fields =
        Record::fields(request.fingerprint, request.scope, request.message_id);
    const std::string now = store.now_arg();
    std::string new_record = Record::new_head(request.outcome ? "done" : "free", {}, outcome, now,
                                              tx.retention_ms(), tx.lease().count());
    new_record.append(fields);
    if (request.outcome) new_record.append(request.reason);
    Args call;
    call.reserve(256 + 2 * fields.size() + tx.commands().resp().size() + acks.args.resp().size());
    call.add(key).add(store.keys.dead_letter(request.scope, request.message_id));
    call.add(now)
        .add(tx.retention_ms())
        .add(tx.lease().count())
        .add(request.max_attempts)
        .add(outcome)
        .add(request.reason)
        .add(fields)
        .add(new_record)
        .add(tx.command_count() + acks.count)
        .append(tx.commands())
        .append(acks.args);
    // With replicas_to_ack, a mark then WAIT follow in the same round trip: they confirm a
    // commit and, when the script wrote nothing, the duplicate's record (confirm_duplicates()).
    const std::optional<Args> wait = wait_command(store.options);
    Args mark;
    if (wait) mark = replication_mark(store, request.scope, request.message_id);
    sent.reply = store.router.on_slot(store.slot_of(key), [&](Connection& c) {
        if (!wait) return c.eval(claim_commit_script(), 2, call);
        std::vector<Reply> replies = c.eval_then(claim_commit_script(), 2, call,
                                                 {ThenCommand{&mark, AfterNoscript::resend},
                                                  ThenCommand{&*wait, AfterNoscript::resend}});
        sent.replicas = std::move(replies.at(2));
        return std::move(replies.at(0));
    });
    return sent;
}

/// Reads what claim_and_commit_round_trip() got back (the transaction has ended by then).
/// @throws commit_failed when a queued write failed; commit_unconfirmed when the master's answer
/// (committed, or the duplicate's record) is not on enough replicas.
inline ClaimAndCommitResult read_claim_and_commit(StoreContext& store, ClaimAndCommitSent& sent) {
    ClaimAndCommitResult result;
    if (!sent.attempted) {
        result.status = ClaimAndCommitStatus::not_attempted;
        return result;
    }
    Reply& reply = sent.reply;
    // What the master answered counts only once its replicas have it (committed, duplicate).
    const bool replicated = !sent.replicas || confirmed(store.options, *sent.replicas);
    auto committed = [&] {
        if (!replicated) throw commit_unconfirmed(unconfirmed_text(store, *sent.replicas));
        result.status = ClaimAndCommitStatus::committed;
        for (CommitHook* hook : sent.acked_hooks)
            hook->acked_in_commit = true;
    };
    store.check_script(reply, "claim and commit");
    if (reply.type == Reply::Type::string && reply.str == "ok") {
        committed();
        result.claim.attempts = 1;
        return result;
    }
    const std::string status = reply.elements.empty() ? std::string() : reply.elements[0].str;
    if (status == "command_failed" || status == "partial") {
        const CommitVerdict verdict = read_commit_reply(
            reply,
            [](std::size_t) -> const HeldClaim& {
                throw store_error("idem: Redis claim-and-commit script: unexpected reply");
            },
            "nothing");
        if (verdict.kind == CommitVerdict::Kind::parked) throw commit_failed(verdict.problem);
        throw commit_failed(verdict.problem + "; the attempt is counted and the id stays free");
    }
    if (reply.elements.size() != 4) {
        throw store_error("idem: Redis claim-and-commit script: unexpected reply");
    }
    result.claim.fingerprint = std::move(reply.elements[2].str);
    result.claim.attempts = static_cast<std::uint32_t>(parse_int(reply.elements[3].str));
    if (status == "duplicate") {
        if (!replicated) {
            throw commit_unconfirmed(unconfirmed_duplicate_text(store, *sent.replicas));
        }
        result.status = ClaimAndCommitStatus::duplicate;
        result.claim.status = ClaimStatus::duplicate;
        result.claim.recorded = disposition_from(reply.elements[1].str);
    } else if (status == "in_progress") {
        result.status = ClaimAndCommitStatus::in_progress;
        result.claim.status = ClaimStatus::in_progress;
        result.claim.retry_after = std::chrono::milliseconds(parse_int(reply.elements[1].str));
    } else if (status == "limit") {
        result.status = ClaimAndCommitStatus::at_limit;
    } else if (status == "committed") {
        committed();
    } else {
        throw store_error("idem: Redis claim-and-commit script: unexpected reply " + status);
    }
    return result;
}

}  // namespace redis
IDEM_END_NAMESPACE
