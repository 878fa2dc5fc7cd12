#pragma once
/// @file
/// @brief handle(): one delivery in its own transaction, through the attempt runner
/// (attempt.hpp) with SingleStrategy; a malformed delivery is parked in a commit of its own,
/// and a rejected or malformed message on a store whose savepoints cost a statement is recorded
/// in a second transaction.

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
#include "idem/count_ahead.hpp"
#include "idem/delivery.hpp"
#include "idem/error.hpp"
#include "idem/handler/attempt.hpp"
#include "idem/handler/claim_and_commit.hpp"
#include "idem/handler/reporting.hpp"
#include "idem/handler/strategy.hpp"
#include "idem/handler/timing.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE
namespace detail {

/// A delivery with no usable id cannot be claimed; it is parked with its reason so nothing
/// is lost. If even that fails the outcome is failed (no ack) and the broker keeps it.
template <class Store, class Effect, class Body>
Outcome park_malformed_delivery(AttemptRunner<Store, Effect>& p, const Delivery& delivery,
                                const Body& body, std::string reason, CommitHook* hook,
                                Measure* measure) {
    using Transaction = typename AttemptRunner<Store, Effect>::Transaction;
    try {
        Transaction tx = p.begin(hook, hook != nullptr ? 1 : 0);
        tx.dead_letter(p.make_dead_letter(delivery, body, reason));
        Outcome parked{Disposition::dead_lettered, reason};
        p.commit_if_stored(tx, parked, measure);
        return with_judged_count(std::move(parked), delivery);
    } catch (const std::exception& e) {
        return failed_outcome(fmt::format("{}; and the dead letter could not be stored: {}", reason,
                                          quoted(p.policy(), e)),
                              failure_cause_of(e));
    }
}

/// The rare outcomes that keep the claim but none of the effect's writes (rejected, or parked
/// as malformed), on a store whose savepoints cost a statement each: the first transaction
/// rolled back, this one claims again and records the outcome the effect gave.
template <class Store, class Effect, class Body>
Outcome record_without_effect(AttemptRunner<Store, Effect>& p, const Delivery& delivery,
                              const Body& body, Outcome outcome, CommitHook* hook,
                              Measure* measure) {
    using Transaction = typename AttemptRunner<Store, Effect>::Transaction;
    Transaction tx = p.begin(hook, hook != nullptr ? 1 : 0);
    const ClaimResult claim =
        p.template claim_one<Body>(tx, delivery.message_id, p.fingerprint_of(body));
    // Another worker finished it, or holds it, meanwhile.
    if (claim.status == ClaimStatus::duplicate) return duplicate_outcome(claim);
    if (claim.status == ClaimStatus::in_progress) return in_progress_outcome(claim);
    p.record_or_park(tx, delivery, body, outcome.disposition, outcome.reason);
    p.commit_if_stored(tx, outcome, measure);
    return outcome;
}

/// handle(): validate, then one attempt in its own transaction (or, for a local effect on a
/// store that can, the effect and one claim_and_commit(); when that cannot settle the message,
/// the attempt replays the effect's answer rather than running it again). With @p ahead, the
/// delivery it names next has its attempt counted in this attempt's commit, and this one uses
/// the count the commit before made for it.
template <class Store, class Effect, class Body>
Outcome handle_one(AttemptRunner<Store, Effect>& p, const Delivery& as_delivered, const Body& body,
                   CommitHook* hook, Measure* measure, CountAhead* ahead = nullptr) {
    using Transaction = typename AttemptRunner<Store, Effect>::Transaction;
    std::optional<std::uint32_t> counted_before;
    std::string next_id;
    if (ahead != nullptr) {  // both are for this call alone
        counted_before = ahead->take_counted(as_delivered.message_id);
        next_id = ahead->take_next();
    }
    if (auto reason = unclaimable_reason(as_delivered)) {
        return park_malformed_delivery(p, as_delivered, body, std::move(*reason), hook, measure);
    }
    std::optional<Delivery> storage;
    try {
        const Delivery& delivery = p.counted(as_delivered, storage, counted_before);
        auto one_attempt = [&](auto strategy) {
            Attempt attempted;
            {
                Transaction tx = p.begin(hook, hook != nullptr ? 1 : 0);
                attempted = p.attempt(tx, delivery, body, strategy, measure);
                if (!attempted.needs_second_transaction) {
                    // The next attempt is counted only where this commit happens (else it
                    // counts itself): it must be on record before the next effect runs.
                    std::optional<std::uint32_t> next_count;
                    if (writes_something(attempted.outcome.disposition))
                        next_count = p.count_ahead(tx, next_id);
                    p.commit_if_stored(tx, attempted.outcome, measure);
                    // or tx rolls back: nothing stored
                    if (next_count) ahead->counted(std::move(next_id), *next_count);
                    return std::move(attempted.outcome);
                }
            }  // rolled back: the effect's writes are gone, the claim with them
            return record_without_effect(p, delivery, body, std::move(attempted.outcome), hook,
                                         measure);
        };
        if constexpr (runs_before_claim<Store, Effect>) {
            FirstStep first = claim_and_commit_first(p, delivery, body, hook, measure);
            if (first.outcome) return with_judged_count(std::move(*first.outcome), delivery);
            if (first.ran) {
                return with_judged_count(one_attempt(RanAheadStrategy<Transaction>{*first.ran}),
                                         delivery);
            }
        }
        return with_judged_count(one_attempt(SingleStrategy<Transaction>{}), delivery);
    } catch (const std::exception& e) {
        return p.failure(e);
    } catch (...) {
        return failed_outcome("non-standard exception", FailureCause::other);
    }
}

}  // namespace detail
IDEM_END_NAMESPACE
