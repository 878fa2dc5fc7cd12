#pragma once
/// @file
/// @brief IdempotentHandler: wraps a user's effect so each message has its effect exactly once.
///
/// handle() and handle_batch() run one attempt pipeline per message (claim → fingerprint →
/// poison → effect → settle, after the delivery was validated); alone and in a batch differ only
/// in their strategy (detail::SingleStrategy, detail::BatchSavepointStrategy,
/// detail::BatchUnclaimStrategy), chosen at compile time. Calling the effect is effect.hpp's.

#include <chrono>
#include <cstddef>
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
#include "idem/contract/store.hpp"
#include "idem/delivery.hpp"
#include "idem/effect.hpp"
#include "idem/error.hpp"
#include "idem/observer.hpp"
#include "idem/outcome.hpp"
#include "idem/payload.hpp"
#include "idem/policy.hpp"

IDEM_BEGIN_NAMESPACE

namespace detail {

/// How a message keeps its claim but none of the effect's writes (rejected, or malformed).
enum class Undo {
    effect_savepoint,    ///< the effect ran in a savepoint: roll back to it, record, go on
    second_transaction,  ///< roll the whole transaction back; claim and record in a new one
};

/// @brief handle(): one message in its own transaction, so nothing to isolate: a failure or a
/// deferral rolls the transaction back, and a store error fails the attempt. The effect gets a
/// savepoint only where savepoints are cheap (memory, Redis); on SQL stores the common path goes
/// without one and the rare rejected or malformed outcome is recorded in a second transaction.
template <class Tx>
struct SingleStrategy {
    static constexpr Undo undo =
        cheap_savepoints<Tx>::value ? Undo::effect_savepoint : Undo::second_transaction;
    static constexpr bool contains_failures = false;  ///< a failure ends the transaction
    void isolate(Tx& /*tx*/) noexcept {}
    void keep(Tx& /*tx*/) noexcept {}
    void drop(Tx& /*tx*/) noexcept {}
    template <class ClaimNow>
    ClaimResult claim(ClaimNow&& claim_now) {
        return claim_now();
    }
};

/// @brief handle_batch() on a store that claims one id per call: each message in a savepoint of
/// its own, around its claim, so one that fails or defers leaves nothing (not even its claim)
/// while the others commit together.
template <class Tx>
struct BatchSavepointStrategy {
    static constexpr Undo undo = Undo::effect_savepoint;
    static constexpr bool contains_failures = true;  ///< a failed message rolls back alone
    void isolate(Tx& tx) { tx.savepoint(); }
    void keep(Tx& tx) { tx.release_savepoint(); }
    void drop(Tx& tx) { tx.rollback_to_savepoint(); }
    template <class ClaimNow>
    ClaimResult claim(ClaimNow&& claim_now) {
        return claim_now();
    }
};

/// @brief handle_batch() on a store that claimed the whole batch up front (claim_many): the claim
/// lies outside any message savepoint, so a message that fails or defers gives it back with
/// unclaim().
template <class Tx>
struct BatchUnclaimStrategy {
    static constexpr Undo undo = Undo::effect_savepoint;
    static constexpr bool contains_failures = true;
    const ClaimResult& claimed;  ///< this message's answer from claim_many
    std::string_view scope;
    std::string_view id;
    void isolate(Tx& /*tx*/) noexcept {}
    void keep(Tx& /*tx*/) noexcept {}
    void drop(Tx& tx) {
        if (claimed.status == ClaimStatus::claimed) tx.unclaim(scope, id);
    }
    template <class ClaimNow>
    ClaimResult claim(ClaimNow&& /*claim_now*/) const {
        return claimed;
    }
};

/// @brief One message whose claim came before the attempt, with the previous message's commit
/// (PipelinedLoop, pipeline.hpp): otherwise handle()'s, its effect in a savepoint (the loop
/// needs cheap savepoints: Redis).
template <class Tx>
struct PreclaimedStrategy {
    static constexpr Undo undo = Undo::effect_savepoint;
    static constexpr bool contains_failures = false;
    const ClaimResult& claimed;
    void isolate(Tx& /*tx*/) noexcept {}
    void keep(Tx& /*tx*/) noexcept {}
    void drop(Tx& /*tx*/) noexcept {}
    template <class ClaimNow>
    ClaimResult claim(ClaimNow&& /*claim_now*/) const {
        return claimed;
    }
};

template <class Strategy>
inline constexpr bool effect_savepoint_v = Strategy::undo == Undo::effect_savepoint;

/// What the handler measures of one delivery for its observer (only when one is set: a handler
/// without one never reads the clock). Filled in as the attempt goes, read by report().
struct Measure {
    std::optional<std::chrono::nanoseconds> effect_in{};
    std::optional<std::chrono::nanoseconds> commit_in{};
    bool effect_ran = false;
};

[[nodiscard]] inline std::chrono::nanoseconds since(
    std::chrono::steady_clock::time_point start) noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                                start);
}

/// Times the effect into a Measure from construction to destruction (the effect returning or
/// throwing); does nothing when the Measure is null.
class EffectTimer {
  public:
    explicit EffectTimer(Measure* measure) noexcept : measure_(measure) {
        if (measure_ != nullptr) start_ = std::chrono::steady_clock::now();
    }
    EffectTimer(const EffectTimer&) = delete;
    EffectTimer& operator=(const EffectTimer&) = delete;
    ~EffectTimer() {
        if (measure_ != nullptr) {
            measure_->effect_in = since(start_);
            measure_->effect_ran = true;
        }
    }

  private:
    Measure* measure_;
    std::chrono::steady_clock::time_point start_{};
};

}  // namespace detail

template <class Handler, class Tag>
class PipelinedLoop;

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
    static_assert(check_store<Store>(), "idem: Store does not fit (see above)");

  public:
    using Transaction = std::remove_reference_t<transaction_t<Store>>;
    using EffectType = Effect;

    IdempotentHandler(Store& store, Policy policy, Effect effect, Observer* observer = nullptr)
        : store_(&store),
          policy_(std::move(policy)),
          effect_(std::in_place, std::move(effect)),
          observer_(observer) {
        if constexpr (has_default_lease<Store>::value) {
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
        const Stopwatch watch(observer_ != nullptr);
        detail::Measure measure;
        Outcome outcome = decide(delivery, body, nullptr, watch.on() ? &measure : nullptr);
        report(delivery, body, outcome, watch.elapsed(), measure);
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
        const Stopwatch watch(observer_ != nullptr);
        detail::Measure measure;
        Outcome outcome = decide(delivery, body, &hook, watch.on() ? &measure : nullptr);
        report(delivery, body, outcome, watch.elapsed(), measure);
        return outcome;
    }

    /// @brief Handles many deliveries in ONE store transaction: each message in its own
    /// savepoint, so one that fails or defers rolls back alone while the others commit together.
    /// Returns one Outcome per delivery, in order; ack (should_ack) only after this returns —
    /// the batch is committed by then. If the commit fails, every outcome that needed it is
    /// `failed`; if it commits only part of the batch (partial_commit: a Redis Cluster's slot
    /// groups), the committed messages keep their outcomes and the others are `failed`.
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
        const Stopwatch watch(observer_ != nullptr);
        std::vector<detail::Measure> measures(watch.on() ? deliveries.size() : 0);
        std::vector<Outcome> outcomes =
            decide_batch(deliveries.data(), bodies.data(), deliveries.size(), nullptr,
                         measures.empty() ? nullptr : measures.data());
        report_batch(deliveries, bodies, outcomes, watch, measures);
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
        const Stopwatch watch(observer_ != nullptr);
        std::vector<detail::Measure> measures(watch.on() ? deliveries.size() : 0);
        std::vector<Outcome> outcomes =
            decide_batch(deliveries.data(), bodies.data(), deliveries.size(), hooks.data(),
                         measures.empty() ? nullptr : measures.data());
        report_batch(deliveries, bodies, outcomes, watch, measures);
        return outcomes;
    }

    [[nodiscard]] const Policy& policy() const noexcept { return policy_; }
    [[nodiscard]] Counters counters() const noexcept { return counters_.snapshot(); }
    [[nodiscard]] Store& store() noexcept { return *store_; }

    /// @brief The lease this handler's claims are held for, on a lease store (Redis): the
    /// policy's, or the store's default.
    template <class S = Store, class = std::enable_if_t<has_default_lease<S>::value>>
    [[nodiscard]] std::chrono::milliseconds effective_lease() const {
        return policy_.lease().value_or(store_->default_lease());
    }

    /// @brief Replaces the clock used to age messages against Policy::gateway_key_lifetime
    /// (tests); empty means the system clock.
    void set_clock(Clock clock) { clock_ = std::move(clock); }

  private:
    template <class Handler, class Tag>
    friend class PipelinedLoop;

    /// Stamps @p hook with the claim it belongs to, for the store to match it to its work.
    void bind_hook(CommitHook& hook, const Delivery& delivery) const {
        hook.scope = policy_.scope();
        hook.message_id = delivery.message_id;
        hook.acked_in_commit = false;
    }
    /// What one attempt ended with. A rejected or malformed message under
    /// Undo::second_transaction comes back with needs_second_transaction: its transaction must
    /// roll back, and record_without_effect() records the outcome in another.
    struct Attempt {
        Attempt() = default;
        Attempt(Outcome settled, bool second = false)  // NOLINT(google-explicit-constructor)
            : outcome(std::move(settled)), needs_second_transaction(second) {}
        Outcome outcome;
        bool needs_second_transaction = false;
    };

    /// Times handle() for the observer: reads steady_clock only when @p on (an observer is
    /// set), so a handler without one never touches the clock.
    class Stopwatch {
      public:
        explicit Stopwatch(bool on) noexcept : on_(on) {
            if (on) start_ = std::chrono::steady_clock::now();
        }
        [[nodiscard]] bool on() const noexcept { return on_; }
        [[nodiscard]] std::chrono::nanoseconds elapsed() const noexcept {
            if (!on_) return {};
            return detail::since(start_);
        }
        /// One message's share of a batch of @p n.
        [[nodiscard]] std::chrono::nanoseconds share(std::size_t n) const noexcept {
            const auto total = elapsed();
            return n == 0 ? total : total / static_cast<std::chrono::nanoseconds::rep>(n);
        }

      private:
        bool on_;
        std::chrono::steady_clock::time_point start_{};
    };

    template <class Body>
    void report(const Delivery& delivery, const Body& body, const Outcome& outcome,
                std::chrono::nanoseconds handled_in, const detail::Measure& measure) noexcept {
        counters_.count(delivery, outcome.disposition);
        if (observer_ == nullptr) return;
        try {
            OutcomeDetails details;
            details.handled_in = handled_in;
            details.effect_in = measure.effect_in;
            details.commit_in = measure.commit_in;
            details.effect_ran = measure.effect_ran;
            details.commit_refused_after_effect = outcome.disposition == Disposition::failed &&
                                                  outcome.cause == FailureCause::commit_failed &&
                                                  measure.effect_ran &&
                                                  measure.commit_in.has_value();
            std::string key;
            if constexpr (detail::chain_has_gateway_key<Effect, Body>()) {
                if (observer_->wants_gateway_key()) {
                    try {
                        key = detail::chain_gateway_key(*effect_, body);
                    } catch (...) {  // no key to show; the outcome stands
                    }
                    details.gateway_key = key;
                }
            }
            observer_->on_detailed_outcome(policy_.scope(), delivery, outcome, details);
        } catch (...) {  // observing must never change an outcome
        }
    }

    /// report() for each message of a batch, each with its share of the batch's time.
    template <class Body>
    void report_batch(const std::vector<Delivery>& deliveries, const std::vector<Body>& bodies,
                      const std::vector<Outcome>& outcomes, const Stopwatch& watch,
                      const std::vector<detail::Measure>& measures) noexcept {
        const auto share = watch.share(outcomes.size());
        const detail::Measure none;
        for (std::size_t i = 0; i < outcomes.size(); ++i)
            report(deliveries[i], bodies[i], outcomes[i], share,
                   measures.empty() ? none : measures[i]);
    }

    /// Text an exception (the effect's, the store's) puts into a reason, through the policy's
    /// redaction hook: it may quote the payload (a malformed_message saying what it could not
    /// parse, a constraint error quoting a value), and reasons reach dead letters, stored
    /// outcomes and every observer. A hook that throws withholds the text.
    [[nodiscard]] std::string quoted(const std::exception& error) const {
        // redaction_failed is idem's own text (the scope, what the hook threw), never a payload.
        if (dynamic_cast<const redaction_failed*>(&error) != nullptr) return error.what();
        return quoted(std::string_view(error.what()));
    }
    [[nodiscard]] std::string quoted(std::string_view text) const {
        if (policy_.options().redact_payload == nullptr) return std::string(text);
        try {
            return policy_.redact(text);
        } catch (...) {
            return "<text withheld: redact_payload threw>";
        }
    }

    /// handle(): validate, then one attempt in its own transaction.
    template <class Body>
    Outcome decide(const Delivery& delivery, const Body& body, CommitHook* hook,
                   detail::Measure* measure) {
        if (auto reason = unclaimable_reason(delivery)) {
            return park_malformed_delivery(delivery, body, std::move(*reason), hook, measure);
        }
        try {
            if constexpr (runs_before_claim) {
                if (auto done = decide_local(delivery, body, hook, measure))
                    return std::move(*done);
            }
            Attempt attempted;
            {
                Transaction tx = begin_transaction(hook, hook != nullptr ? 1 : 0);
                attempted =
                    attempt(tx, delivery, body, detail::SingleStrategy<Transaction>{}, measure);
                if (!attempted.needs_second_transaction) {
                    commit_if_stored(tx, attempted.outcome, measure);
                    return std::move(attempted.outcome);  // or tx rolls back: nothing stored
                }
            }  // rolled back: the effect's writes are gone, the claim with them
            return record_without_effect(delivery, body, std::move(attempted.outcome), hook,
                                         measure);
        } catch (const std::exception& e) {
            return failure(e);
        } catch (...) {
            return failed_outcome("non-standard exception", FailureCause::other);
        }
    }

    /// A local effect (local_effect(): only queued writes) on a store that claims and commits
    /// in one step: handle() runs the effect first, with no claim held, and sends its writes with
    /// the claim in one call (decide_local).
    static constexpr bool runs_before_claim =
        detail::chain_only_transaction_writes<Effect>() && has_claim_and_commit<Transaction>::value;

    /// The effect, then ONE claim_and_commit() with its writes. Nothing (the ordinary path takes
    /// the message, claim first) when the message needs its claim before the effect: a count at
    /// the poison limit or 0 (the effect must not run), a message older than the gateway's keys;
    /// or when the answer needs the ordinary path's steps: a deferral, a malformed message, a
    /// reused id (fingerprint differs), a takeover at the limit, a store that cannot send these
    /// writes with the claim (not_attempted: a Redis Cluster write outside the claim's hash
    /// slot). The effect is local, so running
    /// it again there leaves no trace.
    template <class Body>
    std::optional<Outcome> decide_local(const Delivery& delivery, const Body& body,
                                        CommitHook* hook, detail::Measure* measure) {
        const std::uint32_t count = delivery.delivery_count.value();
        if (count == 0 || count >= policy_.max_deliveries() || older_than_gateway_keys(delivery)) {
            return std::nullopt;
        }
        Transaction tx = begin_transaction(hook, hook != nullptr ? 1 : 0);
        const std::string fingerprint = fingerprint_of(body);
        ClaimAndCommit request;
        request.scope = policy_.scope();
        request.message_id = delivery.message_id;
        request.fingerprint = fingerprint;
        request.max_attempts = policy_.max_deliveries();
        std::string reason;
        std::optional<Outcome> threw;
        tx.savepoint();
        try {
            EffectResult result = EffectResult::applied();
            {
                const detail::EffectTimer timer(measure);
                result = detail::run_effect(*effect_, tx, body, delivery);
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
                    return std::nullopt;
            }
        } catch (const malformed_message&) {
            return std::nullopt;  // parked with its claim by the ordinary path
        } catch (const store_error&) {
            throw;  // failed, as on the ordinary path
        } catch (const std::exception& e) {
            threw = failed_outcome(fmt::format("effect threw: {}", e.what()),
                                   FailureCause::effect_threw);
        } catch (...) {
            threw =
                failed_outcome("effect threw a non-standard exception", FailureCause::effect_threw);
        }
        if (threw) tx.rollback_to_savepoint();  // the attempt is counted, nothing applied
        const auto sent = measure != nullptr ? std::chrono::steady_clock::now()
                                             : std::chrono::steady_clock::time_point{};
        const ClaimAndCommitResult answer = tx.claim_and_commit(request);
        if (measure != nullptr) measure->commit_in = detail::since(sent);
        switch (answer.status) {
            case ClaimAndCommitStatus::committed:
                if (threw) return threw;
                return Outcome{*request.outcome, std::move(reason)};
            case ClaimAndCommitStatus::duplicate:
                if (!fingerprint.empty() && !answer.claim.fingerprint.empty() &&
                    answer.claim.fingerprint != fingerprint) {
                    return std::nullopt;  // dead-lettered as a reused id by the ordinary path
                }
                return duplicate_outcome(answer.claim);
            case ClaimAndCommitStatus::in_progress:
                return in_progress_outcome(answer.claim);
            case ClaimAndCommitStatus::at_limit:
            case ClaimAndCommitStatus::not_attempted:
                return std::nullopt;
        }
        return std::nullopt;
    }

    /// The rare outcomes that keep the claim but none of the effect's writes (rejected, or parked
    /// as malformed), on a store whose savepoints cost a statement each: the first transaction
    /// rolled back, this one claims again and records the outcome the effect gave.
    template <class Body>
    Outcome record_without_effect(const Delivery& delivery, const Body& body, Outcome outcome,
                                  CommitHook* hook, detail::Measure* measure) {
        Transaction tx = begin_transaction(hook, hook != nullptr ? 1 : 0);
        const ClaimResult claim = claim_one<Body>(tx, delivery.message_id, fingerprint_of(body));
        // Another worker finished it, or holds it, meanwhile.
        if (claim.status == ClaimStatus::duplicate) return duplicate_outcome(claim);
        if (claim.status == ClaimStatus::in_progress) return in_progress_outcome(claim);
        record_or_park(tx, delivery, body, outcome.disposition, outcome.reason);
        commit_if_stored(tx, outcome, measure);
        return outcome;
    }

    /// handle_batch(): every message through the same attempt, in ONE transaction.
    template <class Body>
    std::vector<Outcome> decide_batch(const Delivery* deliveries, const Body* bodies,
                                      std::size_t count, CommitHook* hooks,
                                      detail::Measure* measures) {
        std::vector<Outcome> outcomes(count);
        if (count == 0) return outcomes;
        try {
            Transaction tx = begin_transaction(hooks, hooks != nullptr ? count : 0);
            // Stores that can claim many ids in one call (SQLite, PostgreSQL, Redis) do so up
            // front: one statement or round trip for the batch instead of one per message.
            std::vector<ClaimResult> claims;
            if constexpr (has_claim_many<Transaction>::value) {
                claims = claim_all(tx, deliveries, bodies, count);
            }
            for (std::size_t i = 0; i < count; ++i) {
                const Delivery& delivery = deliveries[i];
                if (auto reason = unclaimable_reason(delivery)) {
                    tx.dead_letter(make_dead_letter(delivery, bodies[i], *reason));
                    outcomes[i] = {Disposition::dead_lettered, std::move(*reason)};
                } else if constexpr (has_claim_many<Transaction>::value) {
                    outcomes[i] = attempt(tx, delivery, bodies[i],
                                          detail::BatchUnclaimStrategy<Transaction>{
                                              claims[i], policy_.scope(), delivery.message_id},
                                          measures != nullptr ? &measures[i] : nullptr)
                                      .outcome;
                } else {
                    outcomes[i] = attempt(tx, delivery, bodies[i],
                                          detail::BatchSavepointStrategy<Transaction>{},
                                          measures != nullptr ? &measures[i] : nullptr)
                                      .outcome;
                }
            }
            commit_if_stored(tx, outcomes, measures);
        } catch (const partial_commit& e) {
            // Some of the batch committed (a Redis Cluster's slot groups): those outcomes stand,
            // the others are failed as below.
            const Outcome failed = failure(e);
            for (std::size_t i = 0; i < count; ++i) {
                if (e.committed(policy_.scope(), deliveries[i].message_id)) continue;
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

    /// Begins a transaction, sets the policy's claim terms and offers it the broker's commit
    /// hooks (ignored by a store without the capability).
    Transaction begin_transaction(CommitHook* hooks = nullptr, std::size_t hook_count = 0) {
        Transaction tx = store_->begin();
        if constexpr (has_set_terms<Transaction>::value) {
            tx.set_terms(ClaimTerms{policy_.lease(), policy_.retention()});
        }
        for (std::size_t i = 0; i < hook_count; ++i)
            attach_commit_hook(tx, hooks[i]);
        return tx;
    }

    /// The commit of handle()'s transactions: only when the outcome stored something (else the
    /// transaction rolls back as it ends).
    static void commit_if_stored(Transaction& tx, const Outcome& outcome,
                                 detail::Measure* measure) {
        if (writes_something(outcome.disposition)) {
            timed_commit(
                tx,
                [measure](std::chrono::nanoseconds took) noexcept {
                    if (measure != nullptr) measure->commit_in = took;
                },
                measure != nullptr);
        }
    }

    /// The commit of handle_batch()'s transaction: when any outcome stored something. Each
    /// message it commits gets an equal share of its time.
    static void commit_if_stored(Transaction& tx, const std::vector<Outcome>& outcomes,
                                 detail::Measure* measures) {
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

    /// tx.commit(), its duration given to @p took (also when it throws) if @p timed.
    template <class Took>
    static void timed_commit(Transaction& tx, Took&& took, bool timed) {
        if (!timed) {
            tx.commit();
            return;
        }
        const auto start = std::chrono::steady_clock::now();
        try {
            tx.commit();
        } catch (...) {
            took(detail::since(start));
            throw;
        }
        took(detail::since(start));
    }

    // ---- the attempt: one message inside a transaction, alone or in a batch ----

    /// claim → fingerprint → poison → effect → settle; the outcome is recorded, not committed.
    /// The strategy says how the message is kept apart from the others in the transaction
    /// (isolate / keep / drop) and how it keeps its claim without the effect's writes (undo).
    template <class Strategy, class Body>
    Attempt attempt(Transaction& tx, const Delivery& delivery, const Body& body, Strategy strategy,
                    detail::Measure* measure) {
        static_assert(!Strategy::contains_failures || detail::effect_savepoint_v<Strategy>,
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

    /// A duplicate is acked, or dead-lettered when its fingerprint says the id was reused for
    /// another payload; in_progress leaves nothing. A new claim goes on.
    template <class Strategy, class Body>
    std::optional<Outcome> check_claim(Transaction& tx, const Delivery& delivery, const Body& body,
                                       const ClaimResult& claim, const std::string& fingerprint,
                                       Strategy& strategy) {
        if (claim.status == ClaimStatus::duplicate) {
            if (!fingerprint.empty() && !claim.fingerprint.empty() &&
                claim.fingerprint != fingerprint) {
                // Not a redelivery: the producer reused an id for another message. Acking it as
                // a duplicate would silently drop that message.
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
            // The span says whether the limit covered a real stretch of failing (the broker's
            // redelivery backoff) or a burst of redeliveries.
            std::string span;
            if (delivery.enqueued_at) {
                const auto age = std::chrono::duration_cast<std::chrono::milliseconds>(
                    std::chrono::system_clock::now() - *delivery.enqueued_at);
                span = fmt::format(", {:.1f} s after it was enqueued",
                                   static_cast<double>(age.count()) / 1000.0);
            }
            reason = fmt::format(
                "poison: {} {} {} reached max_deliveries {}{}; the effect was not run on this "
                "delivery; earlier deliveries may have run it",
                claim.attempts ? "attempt" : "delivery count", attempts,
                claim.attempts ? "(claims taken to run the effect, the store's count)" : "(broker)",
                policy_.max_deliveries(), span);
        }
        park(tx, delivery, body, reason);
        strategy.keep(tx);
        return Outcome{Disposition::dead_lettered, std::move(reason)};
    }

    /// The effect (or the reconcile callback, for a message older than the gateway's keys), in
    /// the effect's savepoint when the strategy undoes by one. What it throws ends here: a
    /// contained failure undoes the message alone, otherwise the transaction fails.
    template <class Strategy, class Body>
    Attempt effect_step(Transaction& tx, const Delivery& delivery, const Body& body,
                        Strategy& strategy, detail::Measure* measure) {
        if constexpr (detail::effect_savepoint_v<Strategy>) tx.savepoint();
        EffectResult result = EffectResult::applied();
        try {
            if (auto too_old = older_than_gateway_keys(delivery)) {
                std::optional<EffectResult> reconciled;
                {
                    const detail::EffectTimer timer(measure);
                    reconciled = detail::chain_reconcile(*effect_, tx, body, delivery);
                }
                if (!reconciled) {
                    if (measure != nullptr) *measure = detail::Measure{};  // nothing ran
                    return park_too_old(tx, delivery, body, strategy, *too_old);
                }
                result = std::move(*reconciled);
            } else {
                const detail::EffectTimer timer(measure);
                result = detail::run_effect(*effect_, tx, body, delivery);
            }
        } catch (const malformed_message& e) {
            // Its text may quote the payload, and it is stored with the dead letter.
            return settle_without_effect(tx, delivery, body, strategy, Disposition::dead_lettered,
                                         fmt::format("malformed message: {}", quoted(e.what())));
        } catch (const redaction_failed&) {
            throw;  // the too-old message's dead letter: failed as a whole, like the other parks
        } catch (const store_error& e) {
            if constexpr (!Strategy::contains_failures) {
                throw;
            } else {
                // The message's own savepoints also recover a transaction a failed statement
                // aborted (PostgreSQL); if even that fails, the whole batch fails.
                return abandon(tx, strategy,
                               failed_outcome(fmt::format("store error: {}", quoted(e.what())),
                                              failure_cause_of(e)));
            }
        } catch (const std::exception& e) {
            return abandon(tx, strategy,
                           failed_outcome(fmt::format("effect threw: {}", quoted(e.what())),
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
                if constexpr (detail::effect_savepoint_v<Strategy>) tx.release_savepoint();
                tx.record_outcome(policy_.scope(), delivery.message_id, Disposition::processed, {});
                strategy.keep(tx);
                return Outcome{Disposition::processed, {}};
            case EffectResult::Kind::rejected:
                // The refusal is final: keep the claim (so redeliveries are duplicates) but none
                // of the effect's writes.
                return settle_without_effect(tx, delivery, body, strategy, Disposition::rejected,
                                             result.reason());
            case EffectResult::Kind::deferred:  // nothing stored, not even the claim
                if constexpr (detail::effect_savepoint_v<Strategy>) tx.rollback_to_savepoint();
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
        if constexpr (Strategy::undo == detail::Undo::second_transaction) {
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
        if constexpr (detail::effect_savepoint_v<Strategy>) tx.rollback_to_savepoint();
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

    template <class Body>
    void record_or_park(Transaction& tx, const Delivery& delivery, const Body& body,
                        Disposition disposition, const std::string& reason) {
        if (disposition == Disposition::dead_lettered) {
            park(tx, delivery, body, reason);
        } else {
            tx.record_outcome(policy_.scope(), delivery.message_id, disposition, reason);
        }
    }

    // ---- the pieces ----

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
    /// Not acked; retry_after is what is left of the holder's lease when the store knows it,
    /// so a consumer can nack (or hide the message) for that long instead of at once.
    static Outcome in_progress_outcome(const ClaimResult& claim) {
        Outcome outcome{Disposition::in_progress, "another worker holds the claim"};
        outcome.retry_after = claim.retry_after;
        return outcome;
    }

    /// Outcomes stored by the commit: the claim with its outcome (and a dead letter).
    static bool writes_something(Disposition d) noexcept {
        return d == Disposition::processed || d == Disposition::rejected ||
               d == Disposition::dead_lettered;
    }

    Outcome failure(const std::exception& error) const {
        const FailureCause cause = failure_cause_of(error);
        if (cause == FailureCause::commit_failed) {
            return failed_outcome(fmt::format("commit failed: {}", quoted(error)), cause);
        }
        if (cause != FailureCause::other) {
            return failed_outcome(fmt::format("store error: {}", quoted(error)), cause);
        }
        return failed_outcome(fmt::format("error: {}", quoted(error)), cause);
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
                                    CommitHook* hook, detail::Measure* measure) {
        try {
            Transaction tx = begin_transaction(hook, hook != nullptr ? 1 : 0);
            tx.dead_letter(make_dead_letter(delivery, body, reason));
            Outcome parked{Disposition::dead_lettered, reason};
            commit_if_stored(tx, parked, measure);
            return parked;
        } catch (const std::exception& e) {
            return failed_outcome(
                fmt::format("{}; and the dead letter could not be stored: {}", reason, quoted(e)),
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
