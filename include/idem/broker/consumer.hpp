#pragma once
/// @file
/// @brief The shape every broker consumer shares (namespace idem::broker): what to do with a
/// delivery after the handler (Settlement), the handler dispatch (a plain function, an
/// IdempotentHandler, its batch form), batch mode's handler call (handle_together), the lease
/// check against the broker's redelivery timeout, the run loop with its backoff, stop flag,
/// circuit breaker and health reports, and the counters behind ConsumerStats. An adapter (Redis
/// Streams, RabbitMQ, NATS JetStream) adds only what its broker does differently: how it reads,
/// counts, acks, redelivers and dead-letters. Includes no store and no client library.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/circuit_breaker.hpp"
#include "idem/config.hpp"
#include "idem/consumer_health.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/store.hpp"
#include "idem/delivery.hpp"
#include "idem/error.hpp"
#include "idem/handler.hpp"
#include "idem/outcome.hpp"
#include "idem/pipeline.hpp"

IDEM_BEGIN_NAMESPACE
namespace broker {

/// @brief What a consumer has done so far (a snapshot). Every adapter reports the same fields.
struct ConsumerStats {
    std::size_t read = 0;  ///< first deliveries read from the broker
    /// Deliveries that came again (Redis: taken over by XCLAIM; RabbitMQ, NATS: a delivery
    /// count above 1).
    std::size_t reclaimed = 0;
    std::size_t acked = 0;              ///< settled for good, by the consumer or in the commit
    std::size_t dead_lettered = 0;      ///< of those, sent to the dead-letter destination first
    std::size_t not_acked = 0;          ///< left for redelivery: failed, deferred or in_progress
    std::size_t acked_in_commit = 0;    ///< acked by the store's commit itself (commit hook)
    std::size_t connection_errors = 0;  ///< broker (or its Redis) unreachable or timed out
    std::size_t circuit_opened = 0;     ///< times reading paused: the handler's store unreachable
    std::size_t store_probes = 0;       ///< probes of the store while paused (successful included)
};

/// @brief What a consumer does with a delivery once the handler returned.
enum class Settlement : std::uint8_t {
    ack,                   ///< settle it: never deliver it again
    dead_letter_then_ack,  ///< send it to the dead-letter destination, confirmed, then settle it
    redeliver,             ///< leave it (or give it back) to be delivered again
};

/// @brief The Settlement for an outcome when the CONSUMER settles (not the store's commit).
///
/// A duplicate of a message an earlier delivery dead-lettered goes to the dead-letter
/// destination again before its ack: a crash between the commit that parked it and the
/// consumer's dead-letter publish would otherwise lose the dead letter. Not so when
/// @p commit_publishes_dead_letters (the store's commit publishes a dead letter in the same
/// atomic step as it parks it, e.g. a RedisStore taking the stream's commit hook): that
/// duplicate's dead letter exists already and it is acked plainly.
[[nodiscard]] constexpr Settlement settlement_of(
    const Outcome& outcome, bool commit_publishes_dead_letters = false) noexcept {
    if (!should_ack(outcome)) return Settlement::redeliver;
    if (outcome.disposition == Disposition::dead_lettered ||
        (!commit_publishes_dead_letters && outcome.duplicate_of_dead_letter())) {
        return Settlement::dead_letter_then_ack;
    }
    return Settlement::ack;
}

/// @brief How long a redelivered message should wait, when the outcome says (a deferred
/// effect's retry_after, an in_progress claim's remaining lease). Nothing: the broker's own
/// redelivery delay.
[[nodiscard]] inline std::optional<std::chrono::milliseconds> redelivery_delay(
    const Outcome& outcome) {
    if (outcome.disposition == Disposition::failed) return std::nullopt;
    return outcome.retry_after;
}

/// @brief How a consumer calls its handler with a broker's message type: the plain form (the
/// outcome decides the settlement), or an IdempotentHandler (with a commit hook when the store
/// settles the delivery in its commit, and a batch form). A handler that throws gives a failed
/// outcome, never an ack.
template <class Message>
class Dispatch {
  public:
    using Handler = std::function<Outcome(const Delivery&, const Message&)>;
    using One = std::function<Outcome(const Delivery&, const Message&, CommitHook*)>;
    using Many = std::function<std::vector<Outcome>(
        const std::vector<Delivery>&, const std::vector<Message>&, std::vector<CommitHook>*)>;

    /// @brief A message a sequence settled (in_sequence(), flush_sequence()): the tag the
    /// consumer gave it (its position in the poll), its delivery, its outcome, and whether its
    /// commit acked it.
    struct Settled {
        std::size_t tag = 0;
        Delivery delivery{};
        Outcome outcome{};
        bool acked_in_commit = false;
    };

    /// @throws usage_error for an empty handler (@p who names the consumer).
    static Dispatch plain(Handler handler, std::string_view who) {
        if (!handler) throw usage_error(fmt::format("{}: the handler is empty", who));
        Dispatch d;
        d.one_ = [handler = std::move(handler)](const Delivery& delivery, const Message& message,
                                                CommitHook*) { return handler(delivery, message); };
        return d;
    }

    /// The handler must outlive the consumer (it is referenced, not copied).
    template <class Store, class Effect>
    static Dispatch idempotent(IdempotentHandler<Store, Effect>& handler) {
        Dispatch d;
        d.one_ = [&handler](const Delivery& delivery, const Message& message,
                            CommitHook* hook) -> Outcome {
            if (hook != nullptr) return handler.handle(delivery, message, *hook);
            return handler.handle(delivery, message);
        };
        d.many_ = [&handler](const std::vector<Delivery>& deliveries,
                             const std::vector<Message>& messages, std::vector<CommitHook>* hooks) {
            if (hooks != nullptr) return handler.handle_batch(deliveries, messages, *hooks);
            return handler.handle_batch(deliveries, messages);
        };
        using Loop = PipelinedLoop<IdempotentHandler<Store, Effect>, std::size_t>;
        if constexpr (Loop::pipelines) {
            d.sequence_ = std::make_shared<SequenceOf<Loop>>(handler);
        }
        d.scope_ = std::string(handler.policy().scope());
        d.probe_ = [&handler] { probe_store(handler.store()); };
        if (handler.policy().options().redact_payload) {
            d.redact_ = [&handler](std::string_view text) { return handler.policy().redact(text); };
        }
        return d;
    }

    /// The handler's outcome for one delivery; one that throws counts as failed.
    [[nodiscard]] Outcome call(const Delivery& delivery, const Message& message,
                               CommitHook* hook) const {
        try {
            return one_(delivery, message, hook);
        } catch (const std::exception& e) {
            return failed_outcome(fmt::format("handler threw: {}", e.what()), failure_cause_of(e));
        } catch (...) {
            return failed_outcome("handler threw a non-standard exception", FailureCause::other);
        }
    }

    /// True for an IdempotentHandler (handle_batch: one transaction for many deliveries).
    [[nodiscard]] bool batches() const noexcept { return static_cast<bool>(many_); }

    /// One outcome per delivery from handle_batch; a batch that throws (or answers with the
    /// wrong number of outcomes) fails every delivery in it. Requires batches().
    [[nodiscard]] std::vector<Outcome> call_batch(const std::vector<Delivery>& deliveries,
                                                  const std::vector<Message>& messages,
                                                  std::vector<CommitHook>* hooks) const {
        std::vector<Outcome> outcomes;
        try {
            outcomes = many_(deliveries, messages, hooks);
            if (outcomes.size() != messages.size()) {
                throw store_error(fmt::format("handle_batch returned {} outcomes for {} messages",
                                              outcomes.size(), messages.size()));
            }
        } catch (const std::exception& e) {
            outcomes.assign(messages.size(),
                            failed_outcome(fmt::format("batch handler threw: {}", e.what()),
                                           failure_cause_of(e)));
        } catch (...) {
            outcomes.assign(messages.size(),
                            failed_outcome("batch handler threw a non-standard exception",
                                           FailureCause::other));
        }
        return outcomes;
    }

    /// True for an IdempotentHandler whose store sends a commit with the next claim (a
    /// RedisStore): in_sequence() then pipelines (idem::PipelinedLoop).
    [[nodiscard]] bool sequences() const noexcept { return static_cast<bool>(sequence_); }

    /// @brief The next delivery of a sequence handled one at a time: its claim goes with the
    /// held commit of the one before (PipelinedLoop::handle). Returns what settled, in order —
    /// the one before once its commit's reply came, this one when it needed no commit; what
    /// the handler's commit has not yet confirmed is not in it. A delivery whose handling threw
    /// settles failed at once. Requires sequences().
    [[nodiscard]] std::vector<Settled> in_sequence(const Delivery& delivery, const Message& message,
                                                   std::size_t tag, CommitHook* hook) const {
        try {
            return sequence_->handle(delivery, message, tag, hook);
        } catch (const std::exception& e) {
            return {Settled{
                tag, delivery,
                failed_outcome(fmt::format("handler threw: {}", e.what()), failure_cause_of(e)),
                false}};
        }
    }
    /// @brief Sends the sequence's held commit alone and returns its message, settled (nothing
    /// when none is held). Call it before the consumer waits for more deliveries, and before it
    /// stops: a held message keeps its lease until its commit goes.
    [[nodiscard]] std::vector<Settled> flush_sequence() const {
        return sequence_ ? sequence_->flush() : std::vector<Settled>{};
    }

    /// True when the handler's policy redacts payloads (PolicyOptions::redact_payload): the
    /// consumer's own copy of a dead letter (the message's body or fields) goes through
    /// redact(). Not its reason: the handler has redacted the texts it puts in reasons already
    /// (a redactor need not be idempotent).
    [[nodiscard]] bool redacts() const noexcept { return static_cast<bool>(redact_); }
    /// @p text as the policy's redactor leaves it (unchanged without one).
    /// @throws redaction_failed when the redactor throws: the dead letter is then not published
    /// and the delivery not acked.
    [[nodiscard]] std::string redact(std::string_view text) const {
        return redact_ ? redact_(text) : std::string(text);
    }

    /// The handler's policy scope (dead letters name it); empty for a plain handler.
    [[nodiscard]] const std::string& scope() const noexcept { return scope_; }
    /// Probes the IdempotentHandler's store (its ping(), or a transaction begun and rolled
    /// back); empty for a plain handler.
    [[nodiscard]] const std::function<void()>& store_probe() const noexcept { return probe_; }

  private:
    /// The type-erased PipelinedLoop of in_sequence().
    class Sequence {
      public:
        virtual ~Sequence() = default;
        virtual std::vector<Settled> handle(const Delivery& delivery, const Message& message,
                                            std::size_t tag, CommitHook* hook) = 0;
        virtual std::vector<Settled> flush() = 0;
    };
    template <class Loop>
    class SequenceOf final : public Sequence {
      public:
        template <class Handler>
        explicit SequenceOf(Handler& handler) : loop_(handler) {}
        std::vector<Settled> handle(const Delivery& delivery, const Message& message,
                                    std::size_t tag, CommitHook* hook) override {
            return settled(hook != nullptr ? loop_.handle(delivery, message, tag, *hook)
                                           : loop_.handle(delivery, message, tag));
        }
        std::vector<Settled> flush() override { return settled(loop_.flush()); }

      private:
        static std::vector<Settled> settled(std::vector<typename Loop::Settled> from) {
            std::vector<Settled> out;
            out.reserve(from.size());
            for (auto& s : from) {
                out.push_back(
                    Settled{s.tag, std::move(s.delivery), std::move(s.outcome), s.acked_in_commit});
            }
            return out;
        }
        Loop loop_;
    };

    One one_;
    Many many_;
    std::shared_ptr<Sequence> sequence_;
    std::string scope_;
    std::function<void()> probe_;
    std::function<std::string(std::string_view)> redact_;
};

/// @brief Refuses a lease store's handler whose lease outlasts the broker's redelivery timeout
/// (visibility timeout, AckWait, consumer timeout): a worker that dies holding the lease would
/// block its message across redeliveries. @p who names the consumer and its queue.
/// @throws usage_error when the lease is longer.
template <class Store, class Effect>
void check_lease_fits(IdempotentHandler<Store, Effect>& handler,
                      std::chrono::milliseconds redelivery_timeout, std::string_view timeout_name,
                      std::string_view who) {
    if constexpr (has_default_lease<Store>::value) {
        const std::chrono::milliseconds lease = handler.effective_lease();
        if (lease > redelivery_timeout) {
            throw usage_error(fmt::format(
                "{}: the handler \"{}\" holds its claims for {} ms, longer than the {} ({} ms): a "
                "worker that dies holding the lease would block its message across redeliveries. "
                "Make the {} longer than the handler's p99 and the lease (PolicyOptions::lease or "
                "the store's lease option) equal to it or just under.",
                who, handler.policy().scope(), lease.count(), timeout_name,
                redelivery_timeout.count(), timeout_name));
        }
    } else {
        (void)handler;
        (void)redelivery_timeout;
        (void)timeout_name;
        (void)who;
    }
}

/// @brief The loop options every adapter's options carry under the same names.
struct LoopOptions {
    /// Told about each error run() recovers from (for logs); what it throws is ignored.
    std::function<void(const std::exception&)> on_error{};
    /// The pause while the handler's store is unreachable (see CircuitBreaker).
    CircuitBreakerOptions circuit_breaker{};
    /// How to probe a plain handler's store (throw while unreachable). Empty: no probe, one
    /// initial_backoff pause after each such outcome.
    std::function<void()> store_probe{};
    /// Receives a ConsumerHealth report after each poll, at most once per health_interval.
    HealthSink on_health{};
    std::chrono::milliseconds health_interval{1000};
};

/// @brief The run loop's state: the stop flag, the circuit breaker, the error backoff, health
/// reports and the counters. An adapter owns one and asks it between deliveries.
///
/// One thread polls; request_stop(), stop_requested() and stats() may be called from any
/// thread (request_stop() also from a signal handler).
class Loop {
  public:
    /// @p probe is the IdempotentHandler's store probe (Dispatch::store_probe()); empty: the
    /// options' store_probe, else none.
    Loop(LoopOptions options, std::function<void()> probe)
        : options_(std::move(options)),
          breaker_(options_.circuit_breaker,
                   probe                  ? std::move(probe)
                   : options_.store_probe ? options_.store_probe
                                          : std::function<void()>([] {}),
                   [this](std::chrono::milliseconds d) { sleep_unless_stopped(d); }) {}
    Loop(const Loop&) = delete;
    Loop& operator=(const Loop&) = delete;

    /// Before a poll: false after request_stop(), or when a stop came while the breaker was
    /// open (waiting and probing the store until it answers).
    [[nodiscard]] bool ready_to_read() {
        if (stop_requested()) return false;
        if (breaker_.is_open() && !breaker_.wait_until_closed([this] { return stop_requested(); }))
            return false;
        return true;
    }
    /// Between deliveries of one poll: true when the rest must stay unread (a stop, or the
    /// store found unreachable).
    [[nodiscard]] bool interrupted() const noexcept {
        return stop_requested() || breaker_.is_open();
    }
    /// After each outcome: opens the breaker on one caused by an unreachable store.
    void note(const Outcome& outcome) noexcept {
        if (breaker_.trips_on(outcome)) breaker_.open();
    }

    /// Calls @p poll until request_stop(). Store and broker errors (a lost connection, a
    /// restarted server) and a redactor that throws on a dead letter's copy (the delivery stays
    /// unacked) are reported and retried after a bounded backoff (50 ms doubling to 1 s), never
    /// thrown.
    template <class Poll>
    void run(Poll&& poll) {
        std::chrono::milliseconds backoff = min_backoff;
        while (!stop_requested()) {
            try {
                poll();
                backoff = min_backoff;
            } catch (const store_error& e) {
                recover(e, backoff);
            } catch (const broker_error& e) {
                recover(e, backoff);
            } catch (const redaction_failed& e) {  // the consumer's dead-letter copy: not acked
                recover(e, backoff);
            }
        }
    }

    /// Counts a connection error of a poll (store_unavailable / store_timeout /
    /// broker_unavailable) and rethrows it; other exceptions pass untouched.
    template <class Poll>
    auto counting_connection_errors(Poll&& poll) -> decltype(poll()) {
        try {
            return poll();
        } catch (const store_unavailable&) {
            connection_errors.fetch_add(1, std::memory_order_relaxed);
            throw;
        } catch (const store_timeout&) {
            connection_errors.fetch_add(1, std::memory_order_relaxed);
            throw;
        } catch (const broker_unavailable&) {
            connection_errors.fetch_add(1, std::memory_order_relaxed);
            throw;
        }
    }

    void request_stop() noexcept { stop_.store(true, std::memory_order_release); }
    [[nodiscard]] bool stop_requested() const noexcept {
        return stop_.load(std::memory_order_acquire);
    }

    /// Sleeps @p duration in short steps, returning early on request_stop().
    void sleep_unless_stopped(std::chrono::milliseconds duration) const {
        const auto until = std::chrono::steady_clock::now() + duration;
        while (!stop_requested()) {
            const auto now = std::chrono::steady_clock::now();
            if (now >= until) return;
            std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
                until - now, std::chrono::milliseconds(20)));
        }
    }

    /// Tells options.on_error; never throws.
    void report(const std::exception& e) const noexcept {
        if (!options_.on_error) return;
        try {
            options_.on_error(e);
        } catch (...) {  // reporting must never stop the loop
        }
    }

    /// True when a health report is due (a sink is set and health_interval has passed): the
    /// adapter then gathers what it knows (which may cost a round trip) and calls
    /// report_health().
    [[nodiscard]] bool health_due() const noexcept {
        if (!options_.on_health) return false;
        return std::chrono::steady_clock::now() - last_health_ >= options_.health_interval;
    }
    /// Gives @p health (circuit_open filled in here) to the sink; a sink that throws is
    /// reported through on_error and ignored.
    void report_health(ConsumerHealth health) noexcept {
        if (!options_.on_health) return;
        last_health_ = std::chrono::steady_clock::now();
        health.circuit_open = breaker_.is_open();
        try {
            options_.on_health(health);
        } catch (const std::exception& e) {
            report(e);
        } catch (...) {
        }
    }

    [[nodiscard]] ConsumerStats stats() const noexcept {
        ConsumerStats s;
        s.read = read.load(std::memory_order_relaxed);
        s.reclaimed = reclaimed.load(std::memory_order_relaxed);
        s.acked = acked.load(std::memory_order_relaxed);
        s.dead_lettered = dead_lettered.load(std::memory_order_relaxed);
        s.not_acked = not_acked.load(std::memory_order_relaxed);
        s.acked_in_commit = acked_in_commit.load(std::memory_order_relaxed);
        s.connection_errors = connection_errors.load(std::memory_order_relaxed);
        const CircuitBreakerStats breaker = breaker_.stats();
        s.circuit_opened = breaker.opened;
        s.store_probes = breaker.probes;
        return s;
    }

    /// Counts one settled delivery: an ack (a dead letter's too), or left for redelivery.
    void count(Settlement settlement, bool in_commit = false) noexcept {
        if (settlement == Settlement::redeliver) {
            not_acked.fetch_add(1, std::memory_order_relaxed);
            return;
        }
        acked.fetch_add(1, std::memory_order_relaxed);
        if (in_commit) acked_in_commit.fetch_add(1, std::memory_order_relaxed);
        if (settlement == Settlement::dead_letter_then_ack) {
            dead_lettered.fetch_add(1, std::memory_order_relaxed);
        }
    }

    [[nodiscard]] const LoopOptions& options() const noexcept { return options_; }
    [[nodiscard]] const CircuitBreaker& breaker() const noexcept { return breaker_; }

    // The counters behind stats(), for the adapter to bump.
    std::atomic<std::size_t> read{0};
    std::atomic<std::size_t> reclaimed{0};
    std::atomic<std::size_t> acked{0};
    std::atomic<std::size_t> dead_lettered{0};
    std::atomic<std::size_t> not_acked{0};
    std::atomic<std::size_t> acked_in_commit{0};
    std::atomic<std::size_t> connection_errors{0};

  private:
    static_assert(std::atomic<bool>::is_always_lock_free,
                  "idem: request_stop() needs a lock-free std::atomic<bool> (signal handlers)");
    static constexpr std::chrono::milliseconds min_backoff{50};
    static constexpr std::chrono::milliseconds max_backoff{1000};

    void recover(const std::exception& e, std::chrono::milliseconds& backoff) {
        report(e);
        sleep_unless_stopped(backoff);
        backoff = std::min(backoff * 2, max_backoff);
    }

    LoopOptions options_;
    CircuitBreaker breaker_;  ///< after options_: built from options_.circuit_breaker
    std::atomic<bool> stop_{false};
    std::chrono::steady_clock::time_point last_health_{};
};

/// @brief Batch mode's handler call (an adapter's handle_in_batches), the same on every broker:
/// an IdempotentHandler gets all of @p messages in ONE handle_batch() call (one store
/// transaction; @p hooks, when given, one commit hook per message); a plain handler is called
/// once per message, and stops between two when @p loop is interrupted (a stop, or its store
/// found unreachable). Every outcome goes to Loop::note (the circuit breaker).
///
/// Returns one outcome per message handled, in order: the adapter settles the first
/// outcomes.size() messages as their outcomes say and leaves the rest unsettled. A stop before
/// the batch is the adapter's to check (what it does with the unhandled batch differs).
template <class Message>
[[nodiscard]] std::vector<Outcome> handle_together(const Dispatch<Message>& dispatch, Loop& loop,
                                                   const std::vector<Delivery>& deliveries,
                                                   const std::vector<Message>& messages,
                                                   std::vector<CommitHook>* hooks = nullptr) {
    std::vector<Outcome> outcomes;
    if (dispatch.batches()) {
        outcomes = dispatch.call_batch(deliveries, messages, hooks);
        for (const Outcome& outcome : outcomes)
            loop.note(outcome);
        return outcomes;
    }
    outcomes.reserve(messages.size());
    for (std::size_t i = 0; i < messages.size(); ++i) {
        if (i != 0 && loop.interrupted()) break;  // the rest left unsettled
        outcomes.push_back(dispatch.call(deliveries[i], messages[i], nullptr));
        loop.note(outcomes.back());
    }
    return outcomes;
}

}  // namespace broker
IDEM_END_NAMESPACE
