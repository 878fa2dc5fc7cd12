#pragma once
/// @file
/// @brief IdempotentHandler: wraps a user's effect so each message has its effect exactly once.

#include <chrono>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/delivery.hpp"
#include "idem/error.hpp"
#include "idem/observer.hpp"
#include "idem/outcome.hpp"
#include "idem/payload.hpp"
#include "idem/policy.hpp"
#include "idem/store.hpp"

IDEM_BEGIN_NAMESPACE

namespace detail {

template <class Effect, class Tx, class Body>
inline constexpr bool effect_takes_delivery_v =
    std::is_invocable_v<Effect&, Tx&, const Body&, const Delivery&>;

template <class Effect, class Tx, class Body>
inline constexpr bool effect_fits_v =
    effect_takes_delivery_v<Effect, Tx, Body> || std::is_invocable_v<Effect&, Tx&, const Body&>;

template <class Effect, class Tx, class Body>
auto invoke_effect(Effect& effect, Tx& tx, const Body& body, const Delivery& delivery) {
    if constexpr (effect_takes_delivery_v<Effect, Tx, Body>) {
        return effect(tx, body, delivery);
    } else {
        return effect(tx, body);
    }
}

template <class Effect, class Tx, class Body>
using effect_result_t =
    decltype(invoke_effect(std::declval<Effect&>(), std::declval<Tx&>(),
                           std::declval<const Body&>(), std::declval<const Delivery&>()));

/// Runs an effect and turns a void return into EffectResult::applied().
template <class Effect, class Tx, class Body>
EffectResult run_effect(Effect& effect, Tx& tx, const Body& body, const Delivery& delivery) {
    if constexpr (std::is_void_v<effect_result_t<Effect, Tx, Body>>) {
        invoke_effect(effect, tx, body, delivery);
        return EffectResult::applied();
    } else {
        return invoke_effect(effect, tx, body, delivery);
    }
}

// Effect wrappers (with_fingerprint, reconcile_expired, without_overlapping) expose inner();
// the handler looks through the chain for the capabilities it needs.
template <class E, class = void>
struct has_inner : std::false_type {};
template <class E>
struct has_inner<E, std::void_t<decltype(std::declval<E&>().inner())>> : std::true_type {};

template <class E, class Body, class = void>
struct has_fingerprint : std::false_type {};
template <class E, class Body>
struct has_fingerprint<
    E, Body, std::void_t<decltype(std::declval<E&>().fingerprint(std::declval<const Body&>()))>>
    : std::true_type {};

template <class E, class Body>
constexpr bool chain_has_fingerprint() {
    if constexpr (has_fingerprint<E, Body>::value) {
        return true;
    } else if constexpr (has_inner<E>::value) {
        return chain_has_fingerprint<std::remove_reference_t<decltype(std::declval<E&>().inner())>,
                                     Body>();
    } else {
        return false;
    }
}

/// The fingerprint of the body's stable part, from the first wrapper in the chain that has one.
template <class E, class Body>
std::string chain_fingerprint(E& effect, const Body& body) {
    if constexpr (has_fingerprint<E, Body>::value) {
        return effect.fingerprint(body);
    } else {
        return chain_fingerprint(effect.inner(), body);
    }
}

template <class E, class Tx, class Body, class = void>
struct has_reconcile : std::false_type {};
template <class E, class Tx, class Body>
struct has_reconcile<
    E, Tx, Body,
    std::void_t<decltype(std::declval<E&>().reconcile(
        std::declval<Tx&>(), std::declval<const Body&>(), std::declval<const Delivery&>()))>>
    : std::true_type {};

/// The reconcile callback's answer for a message too old for its gateway key, if the chain has
/// one.
template <class E, class Tx, class Body>
std::optional<EffectResult> chain_reconcile(E& effect, Tx& tx, const Body& body,
                                            const Delivery& delivery) {
    if constexpr (has_reconcile<E, Tx, Body>::value) {
        return EffectResult(effect.reconcile(tx, body, delivery));
    } else if constexpr (has_inner<E>::value) {
        return chain_reconcile(effect.inner(), tx, body, delivery);
    } else {
        return std::nullopt;
    }
}

template <class Effect, class Tx, class Body>
constexpr bool check_effect() {
    constexpr bool fits = effect_fits_v<Effect, Tx, Body>;
    static_assert(fits,
                  "idem: the effect must be callable as effect(Transaction&, const Body&) or "
                  "effect(Transaction&, const Body&, const idem::Delivery&), where Transaction "
                  "is the store's transaction type and Body the type passed to handle()");
    if constexpr (fits) {
        using R = effect_result_t<Effect, Tx, Body>;
        static_assert(std::is_void_v<R> || std::is_convertible_v<R, EffectResult>,
                      "idem: the effect must return void or idem::EffectResult");
    }
    return true;
}

}  // namespace detail

/// @brief Wraps a user's effect with a claim stored in the same transaction as the work, the
/// delivery-count poison check and outcome recording. See docs/contract.md for the table.
///
/// @code
/// auto capture = idem::make_handler(store, idem::Policy{"capture-payment"},
///     [&](auto& tx, const CapturePayment& m) { ... tx.execute("INSERT ...", ...); });
/// auto outcome = capture.handle(idem::Delivery{msg.id(), msg.delivery_count()}, message);
/// if (idem::should_ack(outcome)) consumer.ack(msg);
/// @endcode
///
/// handle() never throws for an ordinary failure: infrastructure errors and exceptions from the
/// effect become Disposition::failed (nothing acked, nothing stored), with Outcome::cause saying
/// why. It may be called from several threads when the store and the effect are thread-safe.
///
/// A handler is movable (e.g. into a std::vector; its counters move with it) but not copyable.
/// It must not be moved while another thread uses it, nor after a StreamConsumer was built on it
/// (the consumer keeps a reference).
template <class Store, class Effect>
class IdempotentHandler {
    static_assert(detail::check_store<Store>(), "idem: Store does not fit (see above)");

  public:
    using Transaction = std::remove_reference_t<detail::transaction_t<Store>>;

    IdempotentHandler(Store& store, Policy policy, Effect effect, Observer* observer = nullptr)
        : store_(&store),
          policy_(std::move(policy)),
          effect_(std::in_place, std::move(effect)),
          observer_(observer) {
        if constexpr (detail::has_default_lease<Store>::value) {
            policy_.check_lease_fits(effective_lease());
        }
    }

    IdempotentHandler(const IdempotentHandler&) = delete;
    IdempotentHandler& operator=(const IdempotentHandler&) = delete;
    /// @brief Moves the handler, its counters' values included. Not while another thread uses
    /// either handler.
    IdempotentHandler(IdempotentHandler&& other) noexcept(
        std::is_nothrow_move_constructible_v<Effect>&& std::is_nothrow_move_constructible_v<Policy>)
        : store_(other.store_),
          policy_(std::move(other.policy_)),
          effect_(std::move(other.effect_)),
          observer_(other.observer_),
          clock_(std::move(other.clock_)),
          counters_(std::move(other.counters_)) {}
    /// @brief Move assignment; the effect is rebuilt from the other's (closures cannot be
    /// assigned). Not while another thread uses either handler.
    IdempotentHandler& operator=(IdempotentHandler&& other) {
        if (this != &other) {
            store_ = other.store_;
            policy_ = std::move(other.policy_);
            effect_.reset();
            if (other.effect_) effect_.emplace(std::move(*other.effect_));
            observer_ = other.observer_;
            clock_ = std::move(other.clock_);
            counters_ = std::move(other.counters_);
        }
        return *this;
    }
    ~IdempotentHandler() = default;

    /// @brief Handles one delivery; the returned Outcome says whether to ack (should_ack()).
    template <class Body>
    Outcome handle(const Delivery& delivery, const Body& body) {
        static_assert(detail::check_effect<Effect, Transaction, Body>(),
                      "idem: effect does not fit (see above)");
        Outcome outcome = decide(delivery, body);
        report(delivery, outcome);
        return outcome;
    }

    /// @brief handle() for a broker that can ack inside the store's commit: @p hook
    /// (idem/contract/commit_hook.hpp) is offered to the transaction; a store that can do it
    /// (a RedisStore on the stream's database) acks in its commit and sets
    /// hook.acked_in_commit, any other ignores it. Ack yourself only when acked_in_commit is
    /// false and should_ack(outcome).
    template <class Body>
    Outcome handle(const Delivery& delivery, const Body& body, CommitHook& hook) {
        static_assert(detail::check_effect<Effect, Transaction, Body>(),
                      "idem: effect does not fit (see above)");
        bind_hook(hook, delivery);
        Outcome outcome = decide(delivery, body, &hook);
        report(delivery, outcome);
        return outcome;
    }

    /// @brief Handles many deliveries in ONE store transaction: each message in its own
    /// savepoint, so one that fails or defers rolls back alone while the others commit together.
    /// Returns one Outcome per delivery, in order; ack (should_ack) only after this returns —
    /// the batch is committed by then. If the commit fails, every outcome that needed it is
    /// `failed`.
    template <class Body>
    std::vector<Outcome> handle_batch(const std::vector<Delivery>& deliveries,
                                      const std::vector<Body>& bodies) {
        static_assert(detail::check_effect<Effect, Transaction, Body>(),
                      "idem: effect does not fit (see above)");
        if (deliveries.size() != bodies.size()) {
            throw usage_error(
                fmt::format("idem::IdempotentHandler::handle_batch: {} deliveries but {} bodies",
                            deliveries.size(), bodies.size()));
        }
        std::vector<Outcome> outcomes =
            decide_batch(deliveries.data(), bodies.data(), deliveries.size());
        for (std::size_t i = 0; i < outcomes.size(); ++i)
            report(deliveries[i], outcomes[i]);
        return outcomes;
    }

    /// @brief handle_batch() with one commit hook per delivery (@p hooks[i] for
    /// @p deliveries[i]): the batch's commit acks each message it completes whose hook its
    /// store can do, setting that hook's acked_in_commit; the others are the caller's to ack.
    template <class Body>
    std::vector<Outcome> handle_batch(const std::vector<Delivery>& deliveries,
                                      const std::vector<Body>& bodies,
                                      std::vector<CommitHook>& hooks) {
        static_assert(detail::check_effect<Effect, Transaction, Body>(),
                      "idem: effect does not fit (see above)");
        if (deliveries.size() != bodies.size() || deliveries.size() != hooks.size()) {
            throw usage_error(fmt::format(
                "idem::IdempotentHandler::handle_batch: {} deliveries, {} bodies, {} hooks",
                deliveries.size(), bodies.size(), hooks.size()));
        }
        for (std::size_t i = 0; i < hooks.size(); ++i)
            bind_hook(hooks[i], deliveries[i]);
        std::vector<Outcome> outcomes =
            decide_batch(deliveries.data(), bodies.data(), deliveries.size(), hooks.data());
        for (std::size_t i = 0; i < outcomes.size(); ++i)
            report(deliveries[i], outcomes[i]);
        return outcomes;
    }

    [[nodiscard]] const Policy& policy() const noexcept { return policy_; }
    [[nodiscard]] Counters counters() const noexcept { return counters_.snapshot(); }
    [[nodiscard]] Store& store() noexcept { return *store_; }

    /// @brief The lease this handler's claims are held for, on a lease store (Redis): the
    /// policy's, or the store's default.
    template <class S = Store, class = std::enable_if_t<detail::has_default_lease<S>::value>>
    [[nodiscard]] std::chrono::milliseconds effective_lease() const {
        return policy_.lease().value_or(store_->default_lease());
    }

    /// @brief Replaces the clock used to age messages against Policy::gateway_key_lifetime
    /// (tests); empty means the system clock.
    void set_clock(Clock clock) { clock_ = std::move(clock); }

  private:
    /// Stamps @p hook with the claim it belongs to, for the store to match it to its work.
    void bind_hook(CommitHook& hook, const Delivery& delivery) const {
        hook.scope = policy_.scope();
        hook.message_id = delivery.message_id;
        hook.acked_in_commit = false;
    }

    void report(const Delivery& delivery, const Outcome& outcome) noexcept {
        counters_.count(delivery, outcome.disposition);
        if (observer_ != nullptr) {
            try {
                observer_->on_outcome(policy_.scope(), delivery, outcome);
            } catch (...) {  // observing must never change an outcome
            }
        }
    }

    template <class Body>
    Outcome decide(const Delivery& delivery, const Body& body, CommitHook* hook = nullptr) {
        if (auto reason = unclaimable_reason(delivery)) {
            return park_malformed_delivery(delivery, body, std::move(*reason), hook);
        }
        try {
            bool again_without_effect = false;
            Outcome outcome;
            {
                Transaction tx = begin_transaction(hook, hook != nullptr ? 1 : 0);
                outcome =
                    process(tx, delivery, body, /*in_batch=*/false, nullptr, &again_without_effect);
                if (!again_without_effect) {
                    if (writes_something(outcome.disposition)) tx.commit();
                    return outcome;  // otherwise tx rolls back: nothing stored
                }
            }  // rolled back: the effect's writes are gone, the claim with them
            return record_without_effect(delivery, body, std::move(outcome), hook);
        } catch (const std::exception& e) {
            return failure(e);
        } catch (...) {
            return failed_outcome("non-standard exception", FailureCause::other);
        }
    }

    /// The rare outcomes that keep the claim but none of the effect's writes (rejected, or parked
    /// as malformed), on a store whose savepoints cost a statement each: the first transaction
    /// rolled back, this one claims again and records the outcome the effect gave.
    template <class Body>
    Outcome record_without_effect(const Delivery& delivery, const Body& body, Outcome outcome,
                                  CommitHook* hook = nullptr) {
        Transaction tx = begin_transaction(hook, hook != nullptr ? 1 : 0);
        const ClaimResult claim = claim_one<Body>(tx, delivery.message_id, fingerprint_of(body));
        // Another worker finished it, or holds it, meanwhile.
        if (claim.status == ClaimStatus::duplicate) return duplicate_outcome(claim);
        if (claim.status == ClaimStatus::in_progress) return in_progress_outcome();
        if (outcome.disposition == Disposition::dead_lettered) {
            park(tx, delivery, body, outcome.reason);
        } else {
            tx.record_outcome(policy_.scope(), delivery.message_id, outcome.disposition,
                              outcome.reason);
        }
        tx.commit();
        return outcome;
    }

    template <class Body>
    std::vector<Outcome> decide_batch(const Delivery* deliveries, const Body* bodies,
                                      std::size_t count, CommitHook* hooks = nullptr) {
        std::vector<Outcome> outcomes(count);
        if (count == 0) return outcomes;
        try {
            Transaction tx = begin_transaction(hooks, hooks != nullptr ? count : 0);
            // Stores that can claim many ids in one call (SQLite, PostgreSQL, Redis) do so up
            // front: one statement or round trip for the batch instead of one per message.
            std::vector<ClaimResult> claims;
            if constexpr (detail::has_claim_many<Transaction>::value) {
                claims = claim_all(tx, deliveries, bodies, count);
            }
            for (std::size_t i = 0; i < count; ++i) {
                if (auto reason = unclaimable_reason(deliveries[i])) {
                    tx.dead_letter(make_dead_letter(deliveries[i], bodies[i], *reason));
                    outcomes[i] = {Disposition::dead_lettered, std::move(*reason)};
                } else {
                    outcomes[i] = process(tx, deliveries[i], bodies[i], /*in_batch=*/true,
                                          claims.empty() ? nullptr : &claims[i]);
                }
            }
            bool any_write = false;
            for (const auto& outcome : outcomes)
                any_write = any_write || writes_something(outcome.disposition);
            if (any_write) tx.commit();
        } catch (const std::exception& e) {
            // Nothing of this batch committed, so nothing is acked. Duplicates too: one may be a
            // second copy of an id this very batch claimed.
            const Outcome failed = failure(e);
            for (auto& outcome : outcomes) {
                if (outcome.disposition != Disposition::in_progress &&
                    outcome.disposition != Disposition::deferred) {
                    outcome = failed_outcome("batch: " + failed.reason, failed.cause);
                }
            }
        }
        return outcomes;
    }

    /// One claim per delivery with a usable id, in one call; malformed ones get a placeholder
    /// (they never reach process()).
    template <class Body>
    std::vector<ClaimResult> claim_all(Transaction& tx, const Delivery* deliveries,
                                       const Body* bodies, std::size_t count) {
        std::vector<std::string_view> ids;
        std::vector<std::string> fingerprints;
        std::vector<std::size_t> index;
        for (std::size_t i = 0; i < count; ++i) {
            if (unclaimable_reason(deliveries[i])) continue;
            ids.push_back(deliveries[i].message_id);
            index.push_back(i);
            if constexpr (detail::chain_has_fingerprint<Effect, Body>()) {
                fingerprints.push_back(fingerprint_of(bodies[i]));
            }
        }
        std::vector<ClaimResult> claimed = tx.claim_many(policy_.scope(), ids, fingerprints);
        std::vector<ClaimResult> all(count);
        for (std::size_t k = 0; k < index.size(); ++k)
            all[index[k]] = std::move(claimed[k]);
        return all;
    }

    /// The fingerprint of the body's stable part, or empty when no wrapper computes one.
    template <class Body>
    std::string fingerprint_of(const Body& body) {
        if constexpr (detail::chain_has_fingerprint<Effect, Body>()) {
            return detail::chain_fingerprint(*effect_, body);
        } else {
            return {};
        }
    }

    /// Claims @p id in this handler's scope, passing the fingerprint only when the chain has one
    /// (a store may offer claim(scope, id) alone).
    template <class Body>
    ClaimResult claim_one(Transaction& tx, const std::string& id, const std::string& fingerprint) {
        if constexpr (detail::chain_has_fingerprint<Effect, Body>()) {
            return tx.claim(policy_.scope(), id, fingerprint);
        } else {
            return tx.claim(policy_.scope(), id);
        }
    }

    static Outcome duplicate_outcome(const ClaimResult& claim) {
        Outcome outcome{Disposition::duplicate, fmt::format("already {} by an earlier delivery",
                                                            to_string(claim.recorded))};
        outcome.recorded = claim.recorded;
        return outcome;
    }
    static Outcome in_progress_outcome() {
        return {Disposition::in_progress, "another worker holds the claim"};
    }

    /// Begins a transaction and offers it the broker's commit hooks (ignored by a store
    /// without the capability).
    Transaction begin_transaction(CommitHook* hooks = nullptr, std::size_t hook_count = 0) {
        Transaction tx = store_->begin();
        if constexpr (detail::has_set_terms<Transaction>::value) {
            tx.set_terms(ClaimTerms{policy_.lease(), policy_.retention()});
        }
        for (std::size_t i = 0; i < hook_count; ++i)
            attach_commit_hook(tx, hooks[i]);
        return tx;
    }

    /// Outcomes stored by the commit: the claim with its outcome (and a dead letter).
    static bool writes_something(Disposition d) noexcept {
        return d == Disposition::processed || d == Disposition::rejected ||
               d == Disposition::dead_lettered;
    }

    static Outcome failure(const std::exception& error) {
        const FailureCause cause = failure_cause_of(error);
        if (cause == FailureCause::commit_failed) {
            return failed_outcome(fmt::format("commit failed: {}", error.what()), cause);
        }
        if (cause != FailureCause::other) {
            return failed_outcome(fmt::format("store error: {}", error.what()), cause);
        }
        return failed_outcome(fmt::format("error: {}", error.what()), cause);
    }

    /// One message inside @p tx: claim, duplicate and poison checks, the effect, its outcome
    /// recorded (not committed). In a batch the message sits in its own savepoint, so a message
    /// that fails or defers leaves nothing (not even its claim) while the others commit; alone,
    /// the caller's commit or rollback does that.
    template <class Body>
    Outcome process(Transaction& tx, const Delivery& delivery, const Body& body, bool in_batch,
                    const ClaimResult* claimed_before = nullptr,
                    bool* again_without_effect = nullptr) {
        const std::string& scope = policy_.scope();
        const std::string& id = delivery.message_id;
        // In a batch the message needs a savepoint of its own around its claim, unless the
        // claim was made up front (claim_many): then a failure gives it back with unclaim().
        const bool own_savepoint = in_batch && claimed_before == nullptr;
        if (own_savepoint) tx.savepoint();
        auto keep_message = [&] {
            if (own_savepoint) tx.release_savepoint();
        };
        auto drop_message = [&] {
            if (own_savepoint) tx.rollback_to_savepoint();
            if constexpr (detail::has_claim_many<Transaction>::value) {
                if (claimed_before != nullptr && claimed_before->status == ClaimStatus::claimed) {
                    tx.unclaim(scope, id);
                }
            }
        };

        const std::string fingerprint = fingerprint_of(body);
        const ClaimResult claim =
            claimed_before != nullptr ? *claimed_before : claim_one<Body>(tx, id, fingerprint);
        if (claim.status == ClaimStatus::duplicate) {
            if (!fingerprint.empty() && !claim.fingerprint.empty() &&
                claim.fingerprint != fingerprint) {
                // Not a redelivery: the producer reused an id for another message. Acking it as
                // a duplicate would silently drop that message.
                std::string reason =
                    "id reused with a different payload (fingerprint differs from the first "
                    "delivery's)";
                tx.dead_letter(make_dead_letter(delivery, body, reason));
                keep_message();
                return {Disposition::dead_lettered, std::move(reason)};
            }
            keep_message();
            return duplicate_outcome(claim);
        }
        if (claim.status == ClaimStatus::in_progress) {
            drop_message();
            return in_progress_outcome();
        }
        // A usable id with count 0 (a broker field not mapped): parked WITH its claim, so a later
        // delivery of the same id is a duplicate of this dead letter rather than a second
        // outcome (an effect) for one message.
        if (delivery.delivery_count.value() == 0) {
            std::string reason(zero_count_reason);
            park(tx, delivery, body, reason);
            keep_message();
            return {Disposition::dead_lettered, std::move(reason)};
        }
        // Duplicate detection came first: a processed message whose acks kept failing is a
        // duplicate, never a dead letter.
        // A lease store counts the times the effect started; otherwise the broker's count is
        // all there is (it also grows with deliveries that never reached the effect).
        const std::uint32_t attempts = claim.attempts.value_or(delivery.delivery_count.value());
        if (attempts >= policy_.max_deliveries()) {
            std::string reason = fmt::format(
                "poison: {} {} {} reached max_deliveries {}; the effect was not run on this "
                "delivery; earlier deliveries may have run it",
                claim.attempts ? "attempt" : "delivery count", attempts,
                claim.attempts ? "(effect starts)" : "(broker)", policy_.max_deliveries());
            park(tx, delivery, body, reason);
            keep_message();
            return {Disposition::dead_lettered, std::move(reason)};
        }

        // The effect's savepoint lets a rejected or malformed message keep its claim but drop
        // the effect's writes. Alone, on a store where a savepoint costs statements (SQLite,
        // PostgreSQL), the common path goes without one: those rare outcomes roll the whole
        // transaction back and record themselves in a second one (record_without_effect).
        const bool effect_savepoint = in_batch || detail::cheap_savepoints<Transaction>::value ||
                                      again_without_effect == nullptr;
        auto undo_effect = [&] {
            if (effect_savepoint) tx.rollback_to_savepoint();
        };
        // Rejected or parked without the effect's writes: here, or in a second transaction.
        auto settle_without_effect = [&](Disposition disposition, std::string reason) -> Outcome {
            if (!effect_savepoint) {
                *again_without_effect = true;
                return {disposition, std::move(reason)};
            }
            tx.rollback_to_savepoint();
            if (disposition == Disposition::dead_lettered) {
                park(tx, delivery, body, reason);
            } else {
                tx.record_outcome(scope, id, disposition, reason);
            }
            keep_message();
            return {disposition, std::move(reason)};
        };

        if (effect_savepoint) tx.savepoint();
        EffectResult result = EffectResult::applied();
        try {
            if (auto too_old = older_than_gateway_keys(delivery)) {
                auto reconciled = detail::chain_reconcile(*effect_, tx, body, delivery);
                if (!reconciled) {
                    // Nothing ran since the claim: park in this transaction.
                    undo_effect();
                    park(tx, delivery, body, *too_old);
                    keep_message();
                    return {Disposition::dead_lettered, std::move(*too_old)};
                }
                result = std::move(*reconciled);
            } else {
                result = detail::run_effect(*effect_, tx, body, delivery);
            }
        } catch (const malformed_message& e) {
            return settle_without_effect(Disposition::dead_lettered,
                                         fmt::format("malformed message: {}", e.what()));
        } catch (const redaction_failed&) {
            throw;  // the too-old message's dead letter: failed as a whole, like the other parks
        } catch (const store_error& e) {
            if (!in_batch) throw;
            // The message's own savepoints also recover a transaction a failed statement
            // aborted (PostgreSQL); if even that fails, the whole batch fails.
            tx.rollback_to_savepoint();
            drop_message();
            return failed_outcome(fmt::format("store error: {}", e.what()), failure_cause_of(e));
        } catch (const std::exception& e) {
            if (in_batch) {
                tx.rollback_to_savepoint();
                drop_message();
            }
            return failed_outcome(fmt::format("effect threw: {}", e.what()),
                                  FailureCause::effect_threw);
        } catch (...) {
            if (in_batch) {
                tx.rollback_to_savepoint();
                drop_message();
            }
            return failed_outcome("effect threw a non-standard exception",
                                  FailureCause::effect_threw);
        }

        switch (result.kind()) {
            case EffectResult::Kind::applied:
                if (effect_savepoint) tx.release_savepoint();
                tx.record_outcome(scope, id, Disposition::processed, {});
                keep_message();
                return {Disposition::processed, {}};
            case EffectResult::Kind::rejected:
                // The refusal is final: keep the claim (so redeliveries are duplicates) but none
                // of the effect's writes.
                return settle_without_effect(Disposition::rejected, result.reason());
            case EffectResult::Kind::deferred:  // nothing stored, not even the claim
                undo_effect();
                drop_message();
                return {Disposition::deferred, result.reason(), result.retry_after()};
        }
        return failed_outcome("unknown effect result", FailureCause::other);
    }

    /// Why the message must not reach a gateway whose keys have expired, if it must not.
    std::optional<std::string> older_than_gateway_keys(const Delivery& delivery) const {
        const auto lifetime = policy_.gateway_key_lifetime();
        if (!lifetime || !delivery.enqueued_at) return std::nullopt;
        const auto now = clock_ ? clock_() : std::chrono::system_clock::now();
        const auto age = now - *delivery.enqueued_at;
        if (age <= *lifetime) return std::nullopt;
        using std::chrono::duration_cast;
        using minutes = std::chrono::minutes;
        return fmt::format(
            "message enqueued {} min ago, older than the gateway's idempotency-key lifetime ({} "
            "min): the key no longer protects a retry, so it is not sent blindly; reconcile it "
            "with the gateway by hand",
            duration_cast<minutes>(age).count(), duration_cast<minutes>(*lifetime).count());
    }

    /// Claim row (dead_lettered) and dead-letter entry, committed with the transaction; the
    /// effect never runs.
    template <class Body>
    void park(Transaction& tx, const Delivery& delivery, const Body& body,
              const std::string& reason) {
        tx.record_outcome(policy_.scope(), delivery.message_id, Disposition::dead_lettered, reason);
        tx.dead_letter(make_dead_letter(delivery, body, reason));
    }

    /// A delivery with no usable id cannot be claimed; it is parked with its reason so nothing
    /// is lost. If even that fails the outcome is failed (no ack) and the broker keeps it.
    template <class Body>
    Outcome park_malformed_delivery(const Delivery& delivery, const Body& body, std::string reason,
                                    CommitHook* hook = nullptr) {
        try {
            Transaction tx = begin_transaction(hook, hook != nullptr ? 1 : 0);
            tx.dead_letter(make_dead_letter(delivery, body, reason));
            tx.commit();
            return {Disposition::dead_lettered, std::move(reason)};
        } catch (const std::exception& e) {
            return failed_outcome(
                fmt::format("{}; and the dead letter could not be stored: {}", reason, e.what()),
                failure_cause_of(e));
        }
    }

    /// The payload is the body's bytes through the policy's redaction hook, or empty under
    /// keep_no_payload (payload.hpp); a hook that throws throws redaction_failed here, which
    /// makes the outcome failed: nothing stored, nothing acked.
    template <class Body>
    DeadLetter make_dead_letter(const Delivery& delivery, const Body& body,
                                const std::string& reason) const {
        DeadLetter letter;
        letter.scope = policy_.scope();
        letter.message_id = delivery.message_id;
        letter.delivery_count = delivery.delivery_count.value();
        letter.reason = reason;
        letter.payload = detail::dead_letter_payload<Effect>(policy_, body);
        return letter;
    }

    Store* store_;
    Policy policy_;
    std::optional<Effect> effect_;  ///< optional only so that move assignment can rebuild it
    Observer* observer_;
    Clock clock_;
    detail::AtomicCounters counters_;
};

/// @brief Builds an IdempotentHandler, deducing the store and effect types.
template <class Store, class Effect>
IdempotentHandler<Store, std::decay_t<Effect>> make_handler(Store& store, Policy policy,
                                                            Effect&& effect,
                                                            Observer* observer = nullptr) {
    return IdempotentHandler<Store, std::decay_t<Effect>>(store, std::move(policy),
                                                          std::forward<Effect>(effect), observer);
}

IDEM_END_NAMESPACE
