#pragma once
/// @file
/// @brief handle() of a local effect on a store that claims and commits in one step (Redis):
/// the effect runs first, with no claim held, and its writes go with the claim in ONE
/// claim_and_commit() call; the answers that need the ordinary path's steps fall back to it,
/// with the effect's answer when it has one (the effect is not run twice).

#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/records.hpp"
#include "idem/contract/store.hpp"
#include "idem/delivery.hpp"
#include "idem/effect.hpp"
#include "idem/error.hpp"
#include "idem/handler/attempt.hpp"
#include "idem/handler/strategy.hpp"
#include "idem/handler/timing.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE
namespace detail {

/// A local effect (local_effect(): only queued writes) on a store that claims and commits
/// in one step: handle() runs the effect first, with no claim held, and sends its writes with
/// the claim in one call (claim_and_commit_first).
template <class Store, class Effect>
inline constexpr bool runs_before_claim =
    chain_only_transaction_writes<Effect>() &&
    has_claim_and_commit<typename AttemptRunner<Store, Effect>::Transaction>::value;

/// What claim_and_commit_first() ended with: the message's outcome, or none (the ordinary path
/// takes the message) with, when the effect already ran and gave an answer that keeps none of
/// its writes (a deferral, a malformed message), that answer for the ordinary path to replay
/// (RanAheadStrategy): the effect runs at most once per attempt.
struct FirstStep {
    std::optional<Outcome> outcome;
    std::optional<EffectRanAhead> ran;
};

/// The effect, then ONE claim_and_commit() with its writes. No outcome (the ordinary path takes
/// the message, claim first) when the message needs its claim before the effect: a count at
/// the poison limit or 0 (the effect must not run), a message older than the gateway's keys;
/// or when the answer needs the ordinary path's steps: a deferral or a malformed message (their
/// answer replayed there, after the claim), a reused id (fingerprint differs) or a takeover at
/// the limit (both end before the effect there). A store that answers not_attempted (none of
/// idem's) has the effect run again on the ordinary path.
template <class Store, class Effect, class Body>
FirstStep claim_and_commit_first(AttemptRunner<Store, Effect>& p, const Delivery& delivery,
                                 const Body& body, CommitHook* hook, Measure* measure) {
    using Transaction = typename AttemptRunner<Store, Effect>::Transaction;
    const std::uint32_t count = delivery.delivery_count.value();
    if (count == 0 || count >= p.policy().max_deliveries() || p.older_than_gateway_keys(delivery)) {
        return {};
    }
    Transaction tx = p.begin(hook, hook != nullptr ? 1 : 0);
    const std::string fingerprint = p.fingerprint_of(body);
    ClaimAndCommit request;
    request.scope = p.policy().scope();
    request.message_id = delivery.message_id;
    request.fingerprint = fingerprint;
    request.max_attempts = p.policy().max_deliveries();
    std::string reason;
    std::optional<Outcome> threw;
    tx.savepoint();
    try {
        EffectResult result = EffectResult::applied();
        {
            const EffectTimer timer(measure);
            result = run_effect(p.effect(), tx, body, delivery);
        }
        switch (result.kind()) {
            case EffectResult::Kind::applied:
                tx.release_savepoint();
                request.outcome = Disposition::processed;
                break;
            case EffectResult::Kind::rejected:  // the claim without the effect's writes
                tx.rollback_to_savepoint();
                reason = result.reason();
                request.outcome = Disposition::rejected;
                request.reason = reason;
                break;
            case EffectResult::Kind::deferred:  // a duplicate is not deferred: claim first
                return {std::nullopt, EffectRanAhead{std::move(result), nullptr}};
        }
    } catch (const malformed_message&) {  // parked with its claim by the ordinary path
        return {std::nullopt, EffectRanAhead{EffectResult::applied(), std::current_exception()}};
    } catch (const store_error&) {
        throw;  // failed, as on the ordinary path
    } catch (const std::exception& e) {
        threw = failed_outcome(fmt::format("effect threw: {}", quoted(p.policy(), e)),
                               FailureCause::effect_threw);
    } catch (...) {
        threw = failed_outcome("effect threw a non-standard exception", FailureCause::effect_threw);
    }
    if (threw) tx.rollback_to_savepoint();  // the attempt is counted, nothing applied
    const auto sent = measure != nullptr ? std::chrono::steady_clock::now()
                                         : std::chrono::steady_clock::time_point{};
    const ClaimAndCommitResult answer = tx.claim_and_commit(request);
    if (measure != nullptr) measure->commit_in = since(sent);
    switch (answer.status) {
        case ClaimAndCommitStatus::committed:
            if (threw) return {std::move(threw), std::nullopt};
            return {Outcome{*request.outcome, std::move(reason)}, std::nullopt};
        case ClaimAndCommitStatus::duplicate:
            if (reused_id(answer.claim, fingerprint)) {
                return {};  // dead-lettered as a reused id by the ordinary path
            }
            return {duplicate_outcome(answer.claim), std::nullopt};
        case ClaimAndCommitStatus::in_progress:
            return {in_progress_outcome(answer.claim), std::nullopt};
        case ClaimAndCommitStatus::at_limit:
        case ClaimAndCommitStatus::not_attempted:
            return {};
    }
    return {};
}

}  // namespace detail
IDEM_END_NAMESPACE
