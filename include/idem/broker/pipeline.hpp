#pragma once
/// @file
/// @brief PipelinedLoop: for a consumer loop that handles deliveries one at a time, each
/// message's commit goes out with the next message's claim, in ONE round trip (Redis), and a
/// message is settled (acked) only once its commit's reply says it committed. Each message
/// goes through the handler's attempt runner (handler/attempt.hpp), as in handle().

#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/store.hpp"
#include "idem/delivery.hpp"
#include "idem/handler.hpp"
#include "idem/handler/attempt.hpp"
#include "idem/handler/claim_and_commit.hpp"
#include "idem/handler/strategy.hpp"
#include "idem/handler/timing.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief One message's final outcome from a PipelinedLoop (and from a broker consumer's
/// pipelined path, whose tag is the delivery's position in its poll).
template <class Tag>
struct Settled {
    Tag tag{};                     ///< what handle() was given with it (an entry id, ...)
    Delivery delivery{};           ///< as handled
    Outcome outcome{};             ///< should_ack(outcome) says whether to ack
    bool acked_in_commit = false;  ///< its commit hook's ack went with its commit
};

/// @brief How a PipelinedLoop handles a local effect on a store that can claim and commit in
/// one step (see PipelinedLoop).
enum class LocalEffectPath {
    claim_and_commit,  ///< the handler's one-step path: one script, settled at once (default)
    pipelined,         ///< the claim with the previous commit, the commit with the next claim
};

/// @brief Runs a handler over a sequence of deliveries, holding each processed message's
/// commit until the next delivery comes, then sending that commit and the next claim together.
///
/// A message costs one round trip instead of two (claim, commit) when the next delivery is
/// already at hand. Its outcome comes back from the call that sent its commit: handle() returns
/// what settled during the call — the previous message, once its commit's reply came, and this
/// one when it needed no commit (duplicate, in_progress, deferred, failed) — and flush() sends a
/// held commit alone. Ack each Settled as its outcome says (should_ack, and not when
/// acked_in_commit): never before it is returned, so a message is acked only after its commit
/// said committed.
///
/// Call flush() before the loop blocks waiting for the next delivery (and before it stops): a
/// held message keeps its lease until its commit goes, so a loop that waits with one held keeps
/// the lease for the wait (a lease is held at most one effect longer than without the loop only
/// when the next delivery is at hand). A loop destroyed with a message held rolls it back (its
/// lease is released; not acked, the broker redelivers it).
///
/// If the held commit fails (lease lost, a write refused) that message is `failed` (not acked,
/// nothing stored) and the next message's fresh lease is KEPT: it is another id, its claim is
/// valid, and its effect runs. If the round trip itself fails (the connection dropped) both are
/// `failed`: the commit may or may not have happened (its redelivery is then a duplicate or
/// claims again), and the fresh lease, if it was taken, is released (by its token, through a
/// new connection if need be; if Redis is unreachable it expires) with the attempt it counted
/// taken back, since its effect never started. A failure after the commit's reply (the claim of
/// an id another worker holds) fails the next message only: the previous one settles as its
/// commit said.
///
/// The previous message's outcome reaches the observer (and the handler's counters) once the
/// next message's attempt has run, just before handle() returns it: an observer that takes
/// its time (or a worker that dies in it) then does not hold a claim whose effect has not
/// started.
///
/// On a store without commit_with_next_claim (everything but RedisStore) each handle() is the
/// handler's handle(), settled at once. Not thread-safe: one loop per consumer thread.
///
/// A local effect (idem::local_effect) on a store that claims and commits in one step (Redis)
/// takes that step by default (LocalEffectPath::claim_and_commit): handle() sends the held
/// commit, if any, and then handles the message as the handler's handle() does, its writes and
/// its claim in ONE script call, settled at once. It is one round trip a message as the
/// pipelined path is, with one script instead of a commit script plus a `SET` (fewer instructions
/// on both sides: docs/performance.md, redis_loop_local_*). LocalEffectPath::pipelined keeps
/// the two-step pipelined path for them (for comparison).
///
/// @code
/// idem::PipelinedLoop<decltype(handler), std::string> loop(handler);
/// while (running) {
///     auto entries = read_available();                   // without blocking
///     if (entries.empty()) { ack_all(loop.flush()); wait_for_more(); continue; }
///     for (auto& e : entries) ack_all(loop.handle(e.delivery, e.body, e.id));
/// }
/// ack_all(loop.flush());
/// @endcode
template <class Handler, class Tag = std::string>
class PipelinedLoop {
  public:
    using Transaction = typename Handler::Transaction;  ///< the store's transaction
    /// Whether the store sends a commit with the next claim (else handle() settles at once).
    static constexpr bool pipelines = has_commit_with_next_claim<Transaction>::value;
    /// Whether the handler's effect is local and its store claims and commits in one step, so
    /// LocalEffectPath applies.
    static constexpr bool one_step_effect =
        detail::runs_before_claim<typename Handler::StoreType, typename Handler::EffectType>;

    using Settled = idem::Settled<Tag>;  ///< one message's final outcome, with its tag

    /// A loop over @p handler (not owned; it must outlive the loop); @p local: see
    /// LocalEffectPath.
    explicit PipelinedLoop(Handler& handler,
                           LocalEffectPath local = LocalEffectPath::claim_and_commit)
        : handler_(&handler), local_(local) {}

    /// @brief Whether handle() takes the one-step path (a local effect, LocalEffectPath::
    /// claim_and_commit, a store that can) rather than the pipelined one.
    [[nodiscard]] bool takes_one_step() const noexcept {
        return one_step_effect && local_ == LocalEffectPath::claim_and_commit;
    }
    PipelinedLoop(const PipelinedLoop&) = delete;
    PipelinedLoop& operator=(const PipelinedLoop&) = delete;
    ~PipelinedLoop() = default;  // a held transaction rolls back: not acked, redelivered

    /// @brief Whether a processed message waits for its commit (flush() or the next handle()).
    [[nodiscard]] bool holding() const noexcept { return held_ != nullptr; }

    /// @brief Handles @p delivery (see the class); returns what settled, in order.
    template <class Body>
    std::vector<Settled> handle(const Delivery& delivery, const Body& body, Tag tag) {
        return run(delivery, body, std::move(tag), nullptr);
    }
    /// @brief The same with a commit hook (a stream ack the store can do in the commit).
    template <class Body>
    std::vector<Settled> handle(const Delivery& delivery, const Body& body, Tag tag,
                                CommitHook hook) {
        return run(delivery, body, std::move(tag), std::make_unique<CommitHook>(std::move(hook)));
    }

    /// @brief Sends the held commit alone (one round trip) and returns its message, settled.
    std::vector<Settled> flush() {
        std::vector<Settled> out;
        if (!held_) return out;
        std::unique_ptr<Held> held = std::move(held_);
        Outcome outcome = std::move(held->outcome);
        try {
            held->tx.commit();
        } catch (const std::exception& e) {
            outcome = handler_->runner_.failure(e);
        }
        settle(out, std::move(*held), std::move(outcome));
        return out;
    }

  private:
    struct Held {
        Transaction tx;
        Tag tag;
        Delivery delivery;
        Outcome outcome;  ///< what the attempt decided, final once the commit says committed
        std::unique_ptr<CommitHook> hook;
        std::chrono::nanoseconds handled_in{};
        detail::Measure measure{};
        std::function<void(const Delivery&, const Outcome&, std::chrono::nanoseconds,
                           const detail::Measure&)>
            report{};
    };

    template <class Body>
    std::vector<Settled> run(const Delivery& delivery, const Body& body, Tag tag,
                             std::unique_ptr<CommitHook> hook) {
        static_assert(detail::check_effect<typename Handler::EffectType, Transaction, Body>(),
                      "idem: effect does not fit (see above)");
        std::vector<Settled> out;
        if constexpr (!pipelines) {
            Outcome outcome =
                hook ? handler_->handle(delivery, body, *hook) : handler_->handle(delivery, body);
            const bool acked = hook && hook->acked_in_commit;
            out.push_back(Settled{std::move(tag), delivery, std::move(outcome), acked});
            return out;
        } else {
            // Parked in a commit of its own; a local effect's one step (claim_and_commit); or
            // a delivery whose attempts the store counts, in a commit before the attempt
            // (AttemptRunner::counted): the handler's own path, so no path skips that count.
            if (takes_one_step() || unclaimable_reason(delivery) ||
                delivery.counted_by == DeliveryCounter::store) {
                out = flush();
                Outcome outcome = hook ? handler_->handle(delivery, body, *hook)
                                       : handler_->handle(delivery, body);
                const bool acked = hook && hook->acked_in_commit;
                out.push_back(Settled{std::move(tag), delivery, std::move(outcome), acked});
                return out;
            }
            auto& p = handler_->runner_;
            std::vector<Report> later;  // the previous message's report, after this attempt
            if (hook) p.bind_hook(*hook, delivery);
            const detail::Stopwatch watch(p.observed());
            auto fresh = std::make_unique<Held>(Held{p.begin(hook.get(), hook ? 1 : 0),
                                                     std::move(tag),
                                                     delivery,
                                                     Outcome{},
                                                     std::move(hook),
                                                     {},
                                                     {},
                                                     {}});
            const std::string fingerprint = p.fingerprint_of(body);
            ClaimResult claim;
            try {
                if (held_) {
                    std::unique_ptr<Held> previous = std::move(held_);
                    CommitAndClaimResult both;
                    try {
                        both = previous->tx.commit_with_next_claim(
                            fresh->tx, p.policy().scope(), delivery.message_id, fingerprint);
                    } catch (const std::exception& e) {  // the round trip: both unknown
                        Outcome failed = p.failure(e);
                        settle(out, std::move(*previous), failed, &later);
                        throw;
                    }
                    Outcome previous_outcome = std::move(previous->outcome);
                    if (both.commit_error) previous_outcome = failure_of(both.commit_error);
                    settle(out, std::move(*previous), std::move(previous_outcome), &later);
                    if (both.next_error) std::rethrow_exception(both.next_error);
                    claim = std::move(both.next);
                } else {
                    claim = p.template claim_one<Body>(fresh->tx, delivery.message_id, fingerprint);
                }
                fresh->outcome = p.attempt(fresh->tx, delivery, body,
                                           detail::PreclaimedStrategy<Transaction>{claim},
                                           watch.on() ? &fresh->measure : nullptr)
                                     .outcome;
            } catch (const std::exception& e) {
                fresh->outcome = p.failure(e);
            }
            for (Report& report : later)
                deliver(report);
            fresh->handled_in = watch.elapsed();
            if (p.observed()) {
                // The observer's report may read the body (a gateway key): it settles later.
                fresh->report = [&p, body](const Delivery& d, const Outcome& o,
                                           std::chrono::nanoseconds in, const detail::Measure& m) {
                    p.report(d, body, o, in, m);
                };
            }
            if (detail::writes_something(fresh->outcome.disposition)) {
                held_ = std::move(fresh);  // its commit goes with the next claim, or flush()
            } else {
                Outcome outcome = std::move(fresh->outcome);
                settle(out, std::move(*fresh), std::move(outcome));  // rolls back: nothing kept
            }
            return out;
        }
    }

    Outcome failure_of(const std::exception_ptr& error) const {
        try {
            std::rethrow_exception(error);
        } catch (const std::exception& e) {
            return handler_->runner_.failure(e);
        } catch (...) {
            return failed_outcome("non-standard exception", FailureCause::other);
        }
    }

    /// A settled message's outcome for the observer (or the counters), given later.
    struct Report {
        std::function<void(const Delivery&, const Outcome&, std::chrono::nanoseconds,
                           const detail::Measure&)>
            report;
        Delivery delivery;
        Outcome outcome;
        std::chrono::nanoseconds handled_in{};
        detail::Measure measure{};
    };

    void deliver(const Report& r) {
        if (r.report) {
            r.report(r.delivery, r.outcome, r.handled_in, r.measure);
        } else {  // no observer: report() only counts
            handler_->runner_.count(r.delivery, r.outcome);
        }
    }

    /// Reports @p outcome for @p held's message (or leaves the report in @p later) and adds it
    /// to @p out; its transaction ends here (rolled back unless its commit went through).
    void settle(std::vector<Settled>& out, Held&& held, Outcome outcome,
                std::vector<Report>* later = nullptr) {
        {
            Transaction ended = std::move(held.tx);
            (void)ended;
        }
        handler_->runner_.recall_failure(held.delivery, outcome);
        Report report{std::move(held.report), held.delivery, outcome, held.handled_in,
                      held.measure};
        if (later != nullptr) {
            later->push_back(std::move(report));
        } else {
            deliver(report);
        }
        const bool acked =
            held.hook && held.hook->acked_in_commit && outcome.disposition != Disposition::failed;
        out.push_back(
            Settled{std::move(held.tag), std::move(held.delivery), std::move(outcome), acked});
    }

    Handler* handler_;
    LocalEffectPath local_;
    std::unique_ptr<Held> held_;
};

/// @brief A PipelinedLoop over @p handler, deducing its type.
template <class Tag = std::string, class Handler>
PipelinedLoop<Handler, Tag> pipelined_loop(
    Handler& handler, LocalEffectPath local = LocalEffectPath::claim_and_commit) {
    return PipelinedLoop<Handler, Tag>(handler, local);
}

IDEM_END_NAMESPACE
