#pragma once
/// @file
/// @brief handle_batch(): many deliveries in ONE transaction, each through the attempt
/// runner (attempt.hpp): with BatchUnclaimStrategy after one claim_many() for the batch where
/// the store has it, else with BatchSavepointStrategy; one commit, each message committed
/// given its share of its time.

#include <chrono>
#include <cstddef>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/records.hpp"
#include "idem/contract/store.hpp"
#include "idem/delivery.hpp"
#include "idem/effect.hpp"
#include "idem/error.hpp"
#include "idem/handler/attempt.hpp"
#include "idem/handler/reporting.hpp"
#include "idem/handler/strategy.hpp"
#include "idem/handler/timing.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE
namespace detail {

/// One claim per delivery with a usable id, in one call; malformed ones get a placeholder
/// (they never reach the attempt).
template <class Store, class Effect, class Body>
std::vector<ClaimResult> claim_all(AttemptRunner<Store, Effect>& p,
                                   typename AttemptRunner<Store, Effect>::Transaction& tx,
                                   const Delivery* deliveries, const Body* bodies,
                                   std::size_t count) {
    std::vector<std::string_view> ids;
    std::vector<std::string> fingerprints;
    std::vector<std::size_t> index;
    for (std::size_t i = 0; i < count; ++i) {
        if (unclaimable_reason(deliveries[i])) continue;
        ids.push_back(deliveries[i].message_id);
        index.push_back(i);
        if constexpr (chain_has_fingerprint<Effect, Body>()) {
            fingerprints.push_back(p.fingerprint_of(bodies[i]));
        }
    }
    std::vector<ClaimResult> claimed = tx.claim_many(p.policy().scope(), ids, fingerprints);
    std::vector<ClaimResult> all(count);
    for (std::size_t k = 0; k < index.size(); ++k)
        all[index[k]] = std::move(claimed[k]);
    return all;
}

/// The commit of handle_batch()'s transaction: when any outcome stored something. Each
/// message it commits gets an equal share of its time.
template <class Transaction>
void commit_batch_if_stored(Transaction& tx, const std::vector<Outcome>& outcomes,
                            Measure* measures) {
    std::size_t writing = 0;
    for (const auto& outcome : outcomes)
        writing += writes_something(outcome.disposition) ? 1 : 0;
    if (writing == 0) return;
    timed_commit(
        tx,
        [&](std::chrono::nanoseconds took) noexcept {
            const auto share = took / static_cast<std::chrono::nanoseconds::rep>(writing);
            for (std::size_t i = 0; i < outcomes.size(); ++i) {
                if (writes_something(outcomes[i].disposition)) measures[i].commit_in = share;
            }
        },
        measures != nullptr);
}

/// Whether any of the deliveries has its attempts counted in the store (AttemptRunner::counted).
inline bool count_in_store(const Delivery* deliveries, std::size_t count) noexcept {
    for (std::size_t i = 0; i < count; ++i) {
        if (deliveries[i].counted_by == DeliveryCounter::store) return true;
    }
    return false;
}

/// handle_batch(): every message through the same attempt, in ONE transaction.
template <class Store, class Effect, class Body>
std::vector<Outcome> handle_many(AttemptRunner<Store, Effect>& p, const Delivery* deliveries,
                                 const Body* bodies, std::size_t count, CommitHook* hooks,
                                 Measure* measures) {
    using Transaction = typename AttemptRunner<Store, Effect>::Transaction;
    std::vector<Outcome> outcomes(count);
    if (count == 0) return outcomes;
    std::vector<Delivery> counted;  // the store's attempt counts, when the broker keeps none
    try {
        if (count_in_store(deliveries, count)) {
            counted.reserve(count);
            for (std::size_t i = 0; i < count; ++i) {
                std::optional<Delivery> storage;
                counted.push_back(p.counted(deliveries[i], storage));
            }
            deliveries = counted.data();
        }
        Transaction tx = p.begin(hooks, hooks != nullptr ? count : 0);
        // Stores that can claim many ids in one call (SQLite, PostgreSQL, Redis) do so up
        // front: one statement or round trip for the batch instead of one per message.
        std::vector<ClaimResult> claims;
        if constexpr (has_claim_many<Transaction>::value) {
            claims = claim_all(p, tx, deliveries, bodies, count);
        }
        for (std::size_t i = 0; i < count; ++i) {
            const Delivery& delivery = deliveries[i];
            if (auto reason = unclaimable_reason(delivery)) {
                tx.dead_letter(p.make_dead_letter(delivery, bodies[i], *reason));
                outcomes[i] = {Disposition::dead_lettered, std::move(*reason)};
            } else if constexpr (has_claim_many<Transaction>::value) {
                outcomes[i] = p.attempt(tx, delivery, bodies[i],
                                        BatchUnclaimStrategy<Transaction>{
                                            claims[i], p.policy().scope(), delivery.message_id},
                                        measures != nullptr ? &measures[i] : nullptr)
                                  .outcome;
            } else {
                outcomes[i] =
                    p.attempt(tx, delivery, bodies[i], BatchSavepointStrategy<Transaction>{},
                              measures != nullptr ? &measures[i] : nullptr)
                        .outcome;
            }
        }
        commit_batch_if_stored(tx, outcomes, measures);
        for (std::size_t i = 0; i < count; ++i)
            outcomes[i] = with_judged_count(std::move(outcomes[i]), deliveries[i]);
    } catch (const partial_commit& e) {
        // Some of the batch committed (a Redis Cluster's slot groups): those outcomes stand,
        // the others are failed as below.
        const Outcome failed = p.failure(e);
        for (std::size_t i = 0; i < count; ++i) {
            if (e.committed(p.policy().scope(), deliveries[i].message_id)) continue;
            Outcome& outcome = outcomes[i];
            if (outcome.disposition != Disposition::in_progress &&
                outcome.disposition != Disposition::deferred) {
                outcome = failed_outcome("batch: " + failed.reason, failed.cause);
            }
            if (hooks != nullptr) hooks[i].acked_in_commit = false;
        }
    } catch (const std::exception& e) {
        // Nothing of this batch committed, so nothing is acked. Duplicates too: one may be a
        // second copy of an id this very batch claimed.
        const Outcome failed = p.failure(e);
        for (auto& outcome : outcomes) {
            if (outcome.disposition != Disposition::in_progress &&
                outcome.disposition != Disposition::deferred) {
                outcome = failed_outcome("batch: " + failed.reason, failed.cause);
            }
        }
    }
    return outcomes;
}

/// The report of each message of a batch, each with its share of the batch's time (a parked
/// message's outcome first takes how its effect failed: AttemptRunner::recall_failure()).
template <class Store, class Effect, class Body>
void report_batch(AttemptRunner<Store, Effect>& p, const std::vector<Delivery>& deliveries,
                  const std::vector<Body>& bodies, std::vector<Outcome>& outcomes,
                  const Stopwatch& watch, const std::vector<Measure>& measures) noexcept {
    const auto share = watch.share(outcomes.size());
    const Measure none;
    for (std::size_t i = 0; i < outcomes.size(); ++i) {
        p.recall_failure(deliveries[i], outcomes[i]);
        p.report(deliveries[i], bodies[i], outcomes[i], share,
                 measures.empty() ? none : measures[i]);
    }
}

}  // namespace detail
IDEM_END_NAMESPACE
