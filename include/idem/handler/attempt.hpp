#pragma once
/// @file
/// @brief The attempt runner (detail::AttemptRunner): the steps of one delivery's attempt inside a
/// transaction (begin, key, claim, fingerprint, poison check, effect, record the outcome, commit,
/// report), written once for every way a message is handled: alone and in a batch (handler.hpp,
/// with handler/single.hpp, handler/batch.hpp, handler/claim_and_commit.hpp) and one step ahead of
/// its commit (broker/pipeline.hpp's PipelinedLoop). How a message is kept apart from the others in
/// its transaction is its strategy's (handler/strategy.hpp); calling the effect is effect.hpp's.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/records.hpp"
#include "idem/contract/store.hpp"
#include "idem/delivery.hpp"
#include "idem/effect.hpp"
#include "idem/error.hpp"
#include "idem/handler/reporting.hpp"
#include "idem/handler/strategy.hpp"
#include "idem/handler/timing.hpp"
#include "idem/observer.hpp"
#include "idem/outcome.hpp"
#include "idem/payload.hpp"
#include "idem/policy.hpp"

IDEM_BEGIN_NAMESPACE
namespace detail {

/// Outcomes stored by the commit: the claim with its outcome (and a dead letter).
[[nodiscard]] inline bool writes_something(Disposition d) noexcept {
    return d == Disposition::processed || d == Disposition::rejected ||
           d == Disposition::dead_lettered;
}

/// Acked: an earlier delivery finished the message.
[[nodiscard]] inline Outcome duplicate_outcome(const ClaimResult& claim) {
    Outcome outcome{Disposition::duplicate,
                    fmt::format("already {} by an earlier delivery", to_string(claim.recorded))};
    outcome.recorded = claim.recorded;
    return outcome;
}
/// Whether a duplicate's claim was taken for another payload: both fingerprints known and
/// different. Not a redelivery then: the producer reused an id for another message, and acking
/// it as a duplicate would silently drop that message. The one test of both paths (the
/// attempt's claim check and claim_and_commit_first()).
[[nodiscard]] inline bool reused_id(const ClaimResult& claim, std::string_view fingerprint) {
    return !fingerprint.empty() && !claim.fingerprint.empty() && claim.fingerprint != fingerprint;
}
/// @p outcome with, when it is dead-lettered and says no count yet, the count of @p delivery
/// (counted: the one the handler judged).
[[nodiscard]] inline Outcome with_judged_count(Outcome outcome, const Delivery& delivery) {
    if (outcome.disposition == Disposition::dead_lettered && !outcome.delivery_count)
        outcome.delivery_count = delivery.delivery_count.value();
    return outcome;
}
/// Not acked; retry_after is what is left of the holder's lease when the store knows it,
/// so a consumer can nack (or hide the message) for that long instead of at once.
[[nodiscard]] inline Outcome in_progress_outcome(const ClaimResult& claim) {
    Outcome outcome{Disposition::in_progress, "another worker holds the claim"};
    outcome.retry_after = claim.retry_after;
    return outcome;
}

/// What one attempt ended with. A rejected or malformed message under
/// Undo::second_transaction comes back with needs_second_transaction: its transaction must
/// roll back, and the outcome is recorded in another (handler/single.hpp).
struct Attempt {
    Attempt() = default;
    Attempt(Outcome settled, bool second = false)  // NOLINT(google-explicit-constructor)
        : outcome(std::move(settled)), needs_second_transaction(second) {}
    Outcome outcome;
    bool needs_second_transaction = false;
};

/// @brief A handler's store, policy, effect, clock, counters and observer, and the steps of one
/// attempt over them. IdempotentHandler owns one; its orchestrations and the PipelinedLoop run
/// their messages through it.
template <class Store, class Effect>
class AttemptRunner {
  public:
    using Transaction = std::remove_reference_t<transaction_t<Store>>;

    AttemptRunner(Store& store, Policy policy, Effect effect, Observer* observer)
        : store_(&store),
          policy_(std::move(policy)),
          effect_(std::in_place, std::move(effect)),
          reporter_(observer) {
        if constexpr (has_default_lease<Store>::value) {
            policy_.check_lease_fits(effective_lease());
        }
    }

    AttemptRunner(const AttemptRunner&) = delete;
    AttemptRunner& operator=(const AttemptRunner&) = delete;
    AttemptRunner(AttemptRunner&& other) noexcept(
        std::is_nothrow_move_constructible_v<Effect>&& std::is_nothrow_move_constructible_v<Policy>)
        : store_(other.store_),
          policy_(std::move(other.policy_)),
          effect_(std::move(other.effect_)),
          reporter_(std::move(other.reporter_)),
          clock_(std::move(other.clock_)) {}
    /// The effect is rebuilt from the other's (closures cannot be assigned).
    AttemptRunner& operator=(AttemptRunner&& other) {
        if (this != &other) {
            store_ = other.store_;
            policy_ = std::move(other.policy_);
            effect_.reset();
            if (other.effect_) effect_.emplace(std::move(*other.effect_));
            reporter_ = std::move(other.reporter_);
            clock_ = std::move(other.clock_);
        }
        return *this;
    }
    ~AttemptRunner() = default;

    [[nodiscard]] const Policy& policy() const noexcept { return policy_; }
    [[nodiscard]] Store& store() noexcept { return *store_; }
    [[nodiscard]] Effect& effect() noexcept { return *effect_; }
    [[nodiscard]] Counters counters() const noexcept { return reporter_.counters(); }
    /// Whether an observer is set: only then is anything timed (Stopwatch, Measure).
    [[nodiscard]] bool observed() const noexcept { return reporter_.observed(); }

    /// The lease the claims are held for, on a lease store: the policy's, or the store's default.
    template <class S = Store, class = std::enable_if_t<has_default_lease<S>::value>>
    [[nodiscard]] std::chrono::milliseconds effective_lease() const {
        return policy_.lease().value_or(store_->default_lease());
    }

    void set_clock(Clock clock) { clock_ = std::move(clock); }

    // ---- the steps ----

    /// @brief @p delivery with the count its poison check uses: as it came, unless the broker
    /// keeps no count (DeliveryCounter::store). Then this counts the attempt in the store, in a
    /// write of its own committed before the attempt's transaction begins (so a worker that
    /// dies in the effect has counted it), and returns the delivery in @p storage with that
    /// count. A lease store counts the claims it hands out (ClaimResult::attempts) and needs no
    /// extra write. @p counted_before: the count the commit before this one made for it
    /// (CountAhead), used instead of a write. @throws what count_attempt() throws (the
    /// attempt then fails: no ack).
    const Delivery& counted(const Delivery& delivery, std::optional<Delivery>& storage,
                            std::optional<std::uint32_t> counted_before = std::nullopt) {
        if (delivery.counted_by != DeliveryCounter::store) return delivery;
        if constexpr (has_count_attempt<Store>::value) {
            if (unclaimable_reason(delivery)) return delivery;  // parked without a claim
            storage.emplace(delivery);
            storage->delivery_count =
                counted_before ? *counted_before
                               : store_->count_attempt(policy_.scope(), delivery.message_id);
            return *storage;
        } else if constexpr (has_default_lease<Store>::value) {
            return delivery;  // the claim's own attempt count (check_poison)
        } else {
            throw usage_error(
                "idem: the broker keeps no delivery count (DeliveryCounter::store) but this store "
                "counts no attempts (it has neither count_attempt() nor leases), so the poison "
                "limit could never be reached");
        }
    }

    /// The attempt of @p next_id (the delivery a CountAhead says comes next) counted in @p tx,
    /// so that it commits with this message; none where the store counts no attempts apart
    /// (a lease store) or its transaction cannot (has_tx_count_attempt).
    std::optional<std::uint32_t> count_ahead([[maybe_unused]] Transaction& tx,
                                             [[maybe_unused]] const std::string& next_id) {
        if constexpr (has_count_attempt<Store>::value && has_tx_count_attempt<Transaction>::value) {
            if (!next_id.empty()) return tx.count_attempt(policy_.scope(), next_id);
        }
        return std::nullopt;
    }

    /// Stamps @p hook with the claim it belongs to, for the store to match it to its work.
    void bind_hook(CommitHook& hook, const Delivery& delivery) const {
        hook.scope = policy_.scope();
        hook.message_id = delivery.message_id;
        hook.acked_in_commit = false;
    }

    /// Begins a transaction, sets the policy's claim terms and offers it the broker's commit
    /// hooks (ignored by a store without the capability).
    Transaction begin(CommitHook* hooks = nullptr, std::size_t hook_count = 0) {
        Transaction tx = store_->begin();
        if constexpr (has_set_terms<Transaction>::value) {
            tx.set_terms(ClaimTerms{policy_.lease(), policy_.retention()});
        }
        for (std::size_t i = 0; i < hook_count; ++i)
            attach_commit_hook(tx, hooks[i]);
        return tx;
    }

    /// The fingerprint of the body's stable part, or empty when no wrapper computes one.
    template <class Body>
    std::string fingerprint_of(const Body& body) {
        if constexpr (chain_has_fingerprint<Effect, Body>()) {
            return chain_fingerprint(*effect_, body);
        } else {
            return {};
        }
    }

    /// Claims @p id in this handler's scope, passing the fingerprint only when the chain has one
    /// (a store may offer claim(scope, id) alone).
    template <class Body>
    ClaimResult claim_one(Transaction& tx, const std::string& id, const std::string& fingerprint) {
        if constexpr (chain_has_fingerprint<Effect, Body>()) {
            return tx.claim(policy_.scope(), id, fingerprint);
        } else {
            return tx.claim(policy_.scope(), id);
        }
    }

    /// claim → fingerprint → poison → effect → settle; the outcome is recorded, not committed.
    /// The strategy says how the message is kept apart from the others in the transaction
    /// (isolate / keep / drop) and how it keeps its claim without the effect's writes (undo).
    template <class Strategy, class Body>
    Attempt attempt(Transaction& tx, const Delivery& delivery, const Body& body, Strategy strategy,
                    Measure* measure) {
        static_assert(!Strategy::contains_failures || effect_savepoint_v<Strategy>,
                      "a strategy that contains a failure undoes the effect by its savepoint");
        strategy.isolate(tx);
        const std::string fingerprint = fingerprint_of(body);
        const ClaimResult claim =
            strategy.claim([&] { return claim_one<Body>(tx, delivery.message_id, fingerprint); });
        if (auto stop = check_claim(tx, delivery, body, claim, fingerprint, strategy)) {
            return std::move(*stop);
        }
        if (auto parked = check_poison(tx, delivery, body, claim, strategy)) {
            return std::move(*parked);
        }
        return effect_step(tx, delivery, body, strategy, measure);
    }

    /// The commit of one message's transaction: only when the outcome stored something (else
    /// the transaction rolls back as it ends).
    static void commit_if_stored(Transaction& tx, const Outcome& outcome, Measure* measure) {
        if (writes_something(outcome.disposition)) {
            timed_commit(
                tx,
                [measure](std::chrono::nanoseconds took) noexcept {
                    if (measure != nullptr) measure->commit_in = took;
                },
                measure != nullptr);
        }
    }

    /// Counts the outcome, records an effect's failure and tells the observer, if one is set.
    /// Called once the attempt's transaction is over. Never throws.
    template <class Body>
    void report(const Delivery& delivery, const Body& body, const Outcome& outcome,
                std::chrono::nanoseconds handled_in, const Measure& measure) noexcept {
        note_failure(delivery, outcome);
        reporter_.report(policy_.scope(), *effect_, delivery, body, outcome, handled_in, measure);
    }
    /// Counts the outcome and records an effect's failure (no observer to tell).
    void count(const Delivery& delivery, const Outcome& outcome) noexcept {
        note_failure(delivery, outcome);
        reporter_.count(delivery, outcome.disposition);
    }

    /// An effect's failure, recorded for the message's dead letter where the store keeps a
    /// record of them (Store::note_failure()): its text, when the first and the last were. A
    /// store that cannot take it now leaves a later dead letter without it; never throws.
    void note_failure(const Delivery& delivery, const Outcome& outcome) noexcept {
        if constexpr (has_note_failure<Store>::value) {
            if (outcome.disposition != Disposition::failed ||
                outcome.cause != FailureCause::effect_threw || unclaimable_reason(delivery)) {
                return;
            }
            try {
                store_->note_failure(policy_.scope(), delivery.message_id, outcome.reason,
                                     policy_.retention());
            } catch (...) {  // the failure stands; only its record is missing
            }
        }
    }

    /// How a parked message's effect failed before (Store::noted_failure()), for the broker's
    /// dead-letter copy: read once the attempt's transaction is over, for a dead-lettered outcome
    /// or a duplicate of one, past the first attempt only (a failure is noted after an attempt,
    /// so a message parked at its first has none). A store that cannot answer now leaves the
    /// copy without it.
    void recall_failure(const Delivery& delivery, Outcome& outcome) noexcept {
        if constexpr (has_noted_failure<Store>::value) {
            if (outcome.disposition != Disposition::dead_lettered &&
                !outcome.duplicate_of_dead_letter()) {
                return;
            }
            const std::uint32_t count =
                std::max(outcome.delivery_count.value_or(0), delivery.delivery_count.value());
            if (outcome.noted_failure || count <= 1 || unclaimable_reason(delivery)) return;
            try {
                outcome.noted_failure = store_->noted_failure(policy_.scope(), delivery.message_id);
            } catch (...) {  // the letter stands; only its history is missing
            }
        }
    }

    /// The failed outcome of an infrastructure error, its text through the redaction hook.
    [[nodiscard]] Outcome failure(const std::exception& error) const {
        return failure_outcome(policy_, error);
    }

    // ---- what the orchestrations share ----

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

    /// The claim's outcome recorded, or the message parked when it is dead-lettered.
    template <class Body>
    void record_or_park(Transaction& tx, const Delivery& delivery, const Body& body,
                        Disposition disposition, const std::string& reason) {
        if (disposition == Disposition::dead_lettered) {
            park(tx, delivery, body, reason);
        } else {
            tx.record_outcome(policy_.scope(), delivery.message_id, disposition, reason);
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
        letter.payload = dead_letter_payload<Effect>(policy_, body);
        letter.origin = delivery.origin;
        letter.origin_position = delivery.origin_position;
        return letter;
    }

  private:
    /// A duplicate is acked, or dead-lettered when its fingerprint says the id was reused for
    /// another payload; in_progress leaves nothing. A new claim goes on.
    template <class Strategy, class Body>
    std::optional<Outcome> check_claim(Transaction& tx, const Delivery& delivery, const Body& body,
                                       const ClaimResult& claim, const std::string& fingerprint,
                                       Strategy& strategy) {
        if (claim.status == ClaimStatus::duplicate) {
            if (reused_id(claim, fingerprint)) {
                std::string reason =
                    "id reused with a different payload (fingerprint differs from the first "
                    "delivery's)";
                tx.dead_letter(make_dead_letter(delivery, body, reason));
                strategy.keep(tx);
                return Outcome{Disposition::dead_lettered, std::move(reason)};
            }
            strategy.keep(tx);
            return duplicate_outcome(claim);
        }
        if (claim.status == ClaimStatus::in_progress) {
            strategy.drop(tx);
            return in_progress_outcome(claim);
        }
        return std::nullopt;
    }

    /// Parks a new claim, with the claim, before its effect: count 0, or the poison limit.
    template <class Strategy, class Body>
    std::optional<Outcome> check_poison(Transaction& tx, const Delivery& delivery, const Body& body,
                                        const ClaimResult& claim, Strategy& strategy) {
        std::string reason;
        std::uint32_t judged = 0;
        if (delivery.delivery_count.value() == 0) {
            // A usable id with count 0 (a broker field not mapped): parked WITH its claim, so a
            // later delivery of the same id is a duplicate of this dead letter rather than a
            // second outcome (an effect) for one message.
            reason = zero_count_reason;
        } else {
            // Duplicate detection came first: a processed message whose acks kept failing is a
            // duplicate, never a dead letter.
            // A lease store counts the claims taken to run the effect; otherwise the broker's count
            // is all there is (it also grows with deliveries that never reached the effect).
            const std::uint32_t attempts = claim.attempts.value_or(delivery.delivery_count.value());
            if (attempts < policy_.max_deliveries()) return std::nullopt;
            judged = attempts;
            // The span says whether the limit covered a real stretch of failing (the broker's
            // redelivery backoff) or a burst of redeliveries.
            std::string span;
            if (delivery.enqueued_at) {
                const auto age = std::chrono::duration_cast<std::chrono::milliseconds>(
                    std::chrono::system_clock::now() - *delivery.enqueued_at);
                span = fmt::format(", {:.1f} s after it was enqueued",
                                   static_cast<double>(age.count()) / 1000.0);
            }
            const bool store_counted = delivery.counted_by == DeliveryCounter::store;
            reason = fmt::format(
                "poison: {} {} {} reached max_deliveries {}{}; the effect was not run on this "
                "delivery; earlier deliveries may have run it",
                claim.attempts || store_counted ? "attempt" : "delivery count", attempts,
                claim.attempts  ? "(claims taken to run the effect, the store's count)"
                : store_counted ? "(counted in the store before each attempt)"
                                : "(broker)",
                policy_.max_deliveries(), span);
        }
        // The dead letter carries the count judged (a lease store's own attempt count).
        Delivery as_judged = delivery;
        as_judged.delivery_count = judged;
        park(tx, as_judged, body, reason);
        strategy.keep(tx);
        Outcome parked{Disposition::dead_lettered, std::move(reason)};
        parked.delivery_count = judged;
        return parked;
    }

    /// The effect (or the reconcile callback, for a message older than the gateway's keys; or
    /// the answer of an effect that ran ahead of its claim, replayed), in the effect's savepoint
    /// when the strategy undoes by one. What it throws ends here: a
    /// contained failure undoes the message alone, otherwise the transaction fails.
    template <class Strategy, class Body>
    Attempt effect_step(Transaction& tx, const Delivery& delivery, const Body& body,
                        Strategy& strategy, Measure* measure) {
        if constexpr (effect_savepoint_v<Strategy>) tx.savepoint();
        EffectResult result = EffectResult::applied();
        try {
            if constexpr (Strategy::ran_ahead) {
                result = strategy.ran.replay();  // it ran before the claim: not again
            } else if (auto too_old = older_than_gateway_keys(delivery)) {
                std::optional<EffectResult> reconciled;
                {
                    const EffectTimer timer(measure);
                    reconciled = chain_reconcile(*effect_, tx, body, delivery);
                }
                if (!reconciled) {
                    if (measure != nullptr) *measure = Measure{};  // nothing ran
                    return park_too_old(tx, delivery, body, strategy, *too_old);
                }
                result = std::move(*reconciled);
            } else {
                const EffectTimer timer(measure);
                result = run_effect(*effect_, tx, body, delivery);
            }
        } catch (const malformed_message& e) {
            // Its text may quote the payload, and it is stored with the dead letter.
            return settle_without_effect(
                tx, delivery, body, strategy, Disposition::dead_lettered,
                fmt::format("malformed message: {}", quoted(policy_, e.what())));
        } catch (const redaction_failed&) {
            throw;  // the too-old message's dead letter: failed as a whole, like the other parks
        } catch (const store_error& e) {
            if constexpr (!Strategy::contains_failures) {
                throw;
            } else {
                // The message's own savepoints also recover a transaction a failed statement
                // aborted (PostgreSQL); if even that fails, the whole batch fails.
                return abandon(
                    tx, strategy,
                    failed_outcome(fmt::format("store error: {}", quoted(policy_, e.what())),
                                   failure_cause_of(e)));
            }
        } catch (const std::exception& e) {
            return abandon(
                tx, strategy,
                failed_outcome(fmt::format("effect threw: {}", quoted(policy_, e.what())),
                               FailureCause::effect_threw));
        } catch (...) {
            return abandon(tx, strategy,
                           failed_outcome("effect threw a non-standard exception",
                                          FailureCause::effect_threw));
        }
        return settle(tx, delivery, body, strategy, result);
    }

    /// The effect's answer recorded on the claim (processed), without its writes (rejected), or
    /// nothing at all (deferred).
    template <class Strategy, class Body>
    Attempt settle(Transaction& tx, const Delivery& delivery, const Body& body, Strategy& strategy,
                   const EffectResult& result) {
        switch (result.kind()) {
            case EffectResult::Kind::applied:
                if constexpr (effect_savepoint_v<Strategy>) tx.release_savepoint();
                tx.record_outcome(policy_.scope(), delivery.message_id, Disposition::processed, {});
                strategy.keep(tx);
                return Outcome{Disposition::processed, {}};
            case EffectResult::Kind::rejected:
                // The refusal is final: keep the claim (so redeliveries are duplicates) but none
                // of the effect's writes.
                return settle_without_effect(tx, delivery, body, strategy, Disposition::rejected,
                                             result.reason());
            case EffectResult::Kind::deferred:  // nothing stored, not even the claim
                if constexpr (effect_savepoint_v<Strategy>) tx.rollback_to_savepoint();
                strategy.drop(tx);
                return Outcome{Disposition::deferred, result.reason(), result.retry_after()};
        }
        return failed_outcome("unknown effect result", FailureCause::other);
    }

    /// Rejected or parked as malformed, keeping the claim but not the effect's writes: by the
    /// effect's savepoint, here, or in a second transaction (record_without_effect).
    template <class Strategy, class Body>
    Attempt settle_without_effect([[maybe_unused]] Transaction& tx,
                                  [[maybe_unused]] const Delivery& delivery,
                                  [[maybe_unused]] const Body& body,
                                  [[maybe_unused]] Strategy& strategy, Disposition disposition,
                                  std::string reason) {
        if constexpr (Strategy::undo == Undo::second_transaction) {
            return Attempt(Outcome{disposition, std::move(reason)},
                           /*second=*/true);
        } else {
            tx.rollback_to_savepoint();
            record_or_park(tx, delivery, body, disposition, reason);
            strategy.keep(tx);
            return Outcome{disposition, std::move(reason)};
        }
    }

    /// A message too old for the gateway's keys, with no reconcile callback: nothing ran since
    /// the claim, so it is parked in this transaction.
    template <class Strategy, class Body>
    Attempt park_too_old(Transaction& tx, const Delivery& delivery, const Body& body,
                         Strategy& strategy, std::string reason) {
        if constexpr (effect_savepoint_v<Strategy>) tx.rollback_to_savepoint();
        park(tx, delivery, body, reason);
        strategy.keep(tx);
        return Outcome{Disposition::dead_lettered, std::move(reason)};
    }

    /// A failure in the effect step: contained (a batch), the message's savepoints undo it
    /// alone; otherwise the whole transaction rolls back as it ends.
    template <class Strategy>
    static Attempt abandon([[maybe_unused]] Transaction& tx, [[maybe_unused]] Strategy& strategy,
                           Outcome failed) {
        if constexpr (Strategy::contains_failures) {
            tx.rollback_to_savepoint();
            strategy.drop(tx);
        }
        return failed;
    }

    Store* store_;
    Policy policy_;
    std::optional<Effect> effect_;  ///< optional only so that move assignment can rebuild it
    Reporter reporter_;
    Clock clock_;
};

}  // namespace detail
IDEM_END_NAMESPACE
