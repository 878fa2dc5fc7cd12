#pragma once
/// @file
/// @brief IdempotentHandler: wraps a user's effect so each message has its effect exactly once.
///
/// The face: handle() and handle_batch() run each message through one attempt runner
/// (handler/attempt.hpp: claim → fingerprint → poison → effect → settle, after the delivery
/// was validated); alone (handler/single.hpp, with handler/claim_and_commit.hpp for a local
/// effect) and in a batch (handler/batch.hpp) differ only in their strategy
/// (handler/strategy.hpp), chosen at compile time. Calling the effect is effect.hpp's.

#include <chrono>
#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/records.hpp"
#include "idem/contract/store.hpp"
#include "idem/count_ahead.hpp"
#include "idem/delivery.hpp"
#include "idem/effect.hpp"
#include "idem/error.hpp"
#include "idem/handler/attempt.hpp"
#include "idem/handler/batch.hpp"
#include "idem/handler/single.hpp"
#include "idem/handler/timing.hpp"
#include "idem/observer.hpp"
#include "idem/outcome.hpp"
#include "idem/payload.hpp"
#include "idem/policy.hpp"

IDEM_BEGIN_NAMESPACE

template <class Handler, class Tag>
class PipelinedLoop;  // broker/pipeline.hpp

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
/// It must not be moved while another thread uses it, nor after a RedisStreamConsumer was built on
/// it (the consumer keeps a reference).
template <class Store, class Effect>
class IdempotentHandler {
    static_assert(check_store<Store>(), "idem: Store does not fit (see above)");

  public:
    /// The store's transaction, as the effect receives it.
    using Transaction = typename detail::AttemptRunner<Store, Effect>::Transaction;
    using EffectType = Effect;  ///< the effect, as given
    using StoreType = Store;    ///< the store, as given

    /// @brief A handler of @p policy's scope over @p store (not owned: it must outlive the
    /// handler) running @p effect; @p observer (not owned, may be null) sees every outcome.
    /// make_handler() deduces the types.
    IdempotentHandler(Store& store, Policy policy, Effect effect, Observer* observer = nullptr)
        : runner_(store, std::move(policy), std::move(effect), observer) {}

    IdempotentHandler(const IdempotentHandler&) = delete;
    IdempotentHandler& operator=(const IdempotentHandler&) = delete;
    /// @brief Moves the handler, its counters' values included. Not while another thread uses
    /// either handler.
    IdempotentHandler(IdempotentHandler&&) = default;
    /// @brief Move assignment; the effect is rebuilt from the other's (closures cannot be
    /// assigned). Not while another thread uses either handler.
    IdempotentHandler& operator=(IdempotentHandler&&) = default;
    ~IdempotentHandler() = default;

    /// @brief Handles one delivery; the returned Outcome says whether to ack (should_ack()).
    template <class Body>
    Outcome handle(const Delivery& delivery, const Body& body) {
        return handle_one(delivery, body, nullptr, nullptr);
    }

    /// @brief handle() for a broker that can ack inside the store's commit: @p hook
    /// (idem/contract/commit_hook.hpp) is offered to the transaction; a store that can do it
    /// (a RedisStore on the stream's database) acks in its commit and sets
    /// hook.acked_in_commit, any other ignores it. Ack yourself only when acked_in_commit is
    /// false and should_ack(outcome).
    template <class Body>
    Outcome handle(const Delivery& delivery, const Body& body, CommitHook& hook) {
        runner_.bind_hook(hook, delivery);
        return handle_one(delivery, body, &hook, nullptr);
    }

    /// @brief handle() for a broker that keeps no delivery count (DeliveryCounter::store), in a
    /// loop that knows the next delivery: @p ahead (count_ahead.hpp) names it, and its attempt
    /// is counted in this message's commit rather than in a commit of its own.
    template <class Body>
    Outcome handle(const Delivery& delivery, const Body& body, CountAhead& ahead) {
        return handle_one(delivery, body, nullptr, &ahead);
    }

    /// @brief Both: the commit hook and the count ahead.
    template <class Body>
    Outcome handle(const Delivery& delivery, const Body& body, CommitHook& hook,
                   CountAhead& ahead) {
        runner_.bind_hook(hook, delivery);
        return handle_one(delivery, body, &hook, &ahead);
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
        const detail::Stopwatch watch(runner_.observed());
        std::vector<detail::Measure> measures(watch.on() ? deliveries.size() : 0);
        std::vector<Outcome> outcomes =
            detail::handle_many(runner_, deliveries.data(), bodies.data(), deliveries.size(),
                                nullptr, measures.empty() ? nullptr : measures.data());
        detail::report_batch(runner_, deliveries, bodies, outcomes, watch, measures);
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
            runner_.bind_hook(hooks[i], deliveries[i]);
        const detail::Stopwatch watch(runner_.observed());
        std::vector<detail::Measure> measures(watch.on() ? deliveries.size() : 0);
        std::vector<Outcome> outcomes =
            detail::handle_many(runner_, deliveries.data(), bodies.data(), deliveries.size(),
                                hooks.data(), measures.empty() ? nullptr : measures.data());
        detail::report_batch(runner_, deliveries, bodies, outcomes, watch, measures);
        return outcomes;
    }

    /// The policy the handler was made with.
    [[nodiscard]] const Policy& policy() const noexcept { return runner_.policy(); }
    /// A snapshot of the handler's counters (atomic; any thread).
    [[nodiscard]] Counters counters() const noexcept { return runner_.counters(); }
    /// The store the handler claims in.
    [[nodiscard]] Store& store() noexcept { return runner_.store(); }

    /// @brief The lease this handler's claims are held for, on a lease store (Redis): the
    /// policy's, or the store's default.
    template <class S = Store, class = std::enable_if_t<has_default_lease<S>::value>>
    [[nodiscard]] std::chrono::milliseconds effective_lease() const {
        return runner_.effective_lease();
    }

    /// @brief Replaces the clock used to age messages against Policy::gateway_key_lifetime
    /// (tests); empty means the system clock.
    void set_clock(Clock clock) { runner_.set_clock(std::move(clock)); }

  private:
    template <class Body>
    Outcome handle_one(const Delivery& delivery, const Body& body, CommitHook* hook,
                       CountAhead* ahead) {
        static_assert(detail::check_effect<Effect, Transaction, Body>(),
                      "idem: effect does not fit (see above)");
        const detail::Stopwatch watch(runner_.observed());
        detail::Measure measure;
        Outcome outcome = detail::handle_one(runner_, delivery, body, hook,
                                             watch.on() ? &measure : nullptr, ahead);
        runner_.recall_failure(delivery, outcome);
        runner_.report(delivery, body, outcome, watch.elapsed(), measure);
        return outcome;
    }

    // The pipelined loop is another way to run this handler's attempts (each commit sent with
    // the next claim): it drives the same runner, step by step.
    template <class Handler, class Tag>
    friend class PipelinedLoop;

    detail::AttemptRunner<Store, Effect> runner_;
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
