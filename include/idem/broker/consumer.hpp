#pragma once
/// @file
/// @brief broker::ConsumerBase: the base every broker consumer is written on (the spdlog
/// `base_sink` way, by CRTP, so the per-message path makes no virtual call). The base owns the
/// loop (poll_once, run, stop, the backoff after an error), the circuit breaker and store probe,
/// health reports, the single, batch and pipelined handle paths and the one decision of what an
/// outcome does at the broker (settlement_of); its options are in consumer_options.hpp, its
/// counters in consumer_stats.hpp. An adapter supplies reading, the mapping of a raw delivery to
/// an idem::Delivery and its body, settling and health (see Consumer). Includes no store and no
/// client library.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/broker/circuit_breaker.hpp"
#include "idem/broker/consumer_options.hpp"
#include "idem/broker/consumer_stats.hpp"
#include "idem/broker/dispatch.hpp"
#include "idem/broker/settlement.hpp"
#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/count_ahead.hpp"
#include "idem/delivery.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE
namespace broker {

/// @brief The base of a broker consumer. @p Adapter derives from it (CRTP) and befriends it;
/// @p Options derives from ConsumerOptions; @p Raw is a delivery as the adapter read it;
/// @p Message the body the handler sees.
///
/// What an adapter supplies, all called on the polling thread (the one in poll_once()/run()):
///
/// - `std::vector<Raw> read()`: connect and declare if needed, then read up to `batch_size`
///   deliveries, waiting up to `poll_wait` for the first. Throws on a broker failure
///   (broker_unavailable, store_unavailable, ...: run() backs off).
/// - `Delivery delivery_of(const Raw&) const`: the id (`id_field`, or the broker's own id), the
///   delivery count (1 on a first delivery; a broker without one counts attempts in the store
///   and says 1), the enqueue time. A malformed delivery keeps an empty id (or count 0): the
///   handler dead-letters it with the reason.
/// - `const Message& message_of(const Raw&) const`: the body the handler sees. An overload
///   taking `Raw&&` may move it out (batch mode moves every body into one vector and reads the
///   raw delivery's body no more).
/// - `Settlement::Kind settle(Raw&, const Message&, const Delivery&, const Outcome&,
///   const Settlement&)`: do what the settlement says (ack; publish the dead letter, confirmed,
///   then ack; redeliver after `settlement.delay`, nothing: the broker's clock) and return what
///   was done (a refused ack: redeliver). The Delivery is as_judged(). Throws on broker failure.
/// - `ConsumerHealth health()`: what the adapter knows (pending, dead-letter depth); the views
///   must outlive the call. What cannot be read is left unknown, or thrown (reported through
///   on_error, no report this time).
///
/// Optional hooks, each with a default in the base saying what it is for: commit_hook_of,
/// settle_all, unhandled, handling, handled, pipelines, in_progress_delay, blocked,
/// acked_in_commit, commit_publishes_dead_letters, idle. A broker without a delivery count that
/// settles by committing offsets in order (KafkaConsumer) fits them: kafka.hpp says how.
///
/// poll_once() and run() belong to one thread at a time; request_stop(), stop_requested() and
/// stats() may be called from any thread (request_stop() also from a signal handler).
template <class Adapter, class Options, class Raw, class Message>
class ConsumerBase {
  public:
    static_assert(std::is_base_of_v<ConsumerOptions, Options>,
                  "idem: an adapter's options derive from broker::ConsumerOptions");

    ConsumerBase(const ConsumerBase&) = delete;
    ConsumerBase& operator=(const ConsumerBase&) = delete;

    /// @brief One cycle: read up to batch_size deliveries, hand them to the handler (one at a
    /// time, pipelined, or together with handle_in_batches) and settle each as its outcome
    /// says. Returns how many were handled. After request_stop() it returns 0 without reading,
    /// and stops between deliveries: the rest stays unsettled. While the circuit breaker is
    /// open it first waits and probes the store until it answers, or returns 0 on a stop.
    /// @throws what read() and settle() throw: broker and store failures (counted in
    /// stats().connection_errors when the server is away), redaction_failed when the policy's
    /// redactor throws on a dead letter's copy (the delivery stays unsettled), usage_error.
    std::size_t poll_once() {
        if (!ready_to_read()) return 0;
        const std::size_t handled = counting_connection_errors([this] { return poll(); });
        if (health_due()) report_health();
        return handled;
    }

    /// @brief Polls until request_stop(). Store and broker errors (a lost connection, a
    /// restarted server) and a redactor that throws are reported (on_error) and retried after
    /// a bounded backoff (50 ms doubling to 1 s), never thrown; a usage_error is. Returns
    /// within about poll_wait of the stop, once the delivery in hand is settled.
    void run() {
        std::chrono::milliseconds backoff = min_backoff;
        while (!stop_requested()) {
            try {
                poll_once();
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

    /// @brief Asks run() to return. Lock-free: safe from another thread or a signal handler.
    void request_stop() noexcept { stop_.store(true, std::memory_order_release); }
    /// @brief True once request_stop() was called. Lock-free: safe from any thread.
    [[nodiscard]] bool stop_requested() const noexcept {
        return stop_.load(std::memory_order_acquire);
    }

    /// @brief A snapshot of the counters (relaxed loads: each field is exact, the set is not taken
    /// atomically). Safe from any thread.
    [[nodiscard]] ConsumerStats stats() const noexcept {
        return counters_.snapshot(breaker_.stats());
    }

    /// @brief The options in use (defaults filled in).
    [[nodiscard]] const Options& options() const noexcept { return options_; }
    /// @brief True when the handler's commit settles the delivery (the store accepts the
    /// adapter's commit hook).
    [[nodiscard]] bool acks_in_commit() const noexcept { return acks_in_commit_; }

  protected:
    /// @p options are validated already (validate_consumer_options() and the adapter's own).
    ConsumerBase(Options options, Dispatch<Message> dispatch, bool acks_in_commit = false)
        : options_(std::move(options)),
          dispatch_(std::move(dispatch)),
          acks_in_commit_(acks_in_commit),
          breaker_(options_.circuit_breaker, probe_of(dispatch_, options_),
                   [this](std::chrono::milliseconds d) { adapter().idle(d); }) {}
    ~ConsumerBase() = default;

    /// What @p outcome of @p delivery does at the broker when the consumer settles it.
    [[nodiscard]] Settlement settlement_of(const Outcome& outcome,
                                           const Delivery& delivery) const noexcept {
        return broker::settlement_of(outcome, delivery, rules(acks_in_commit_));
    }

    /// Counts one settled delivery: an ack (a dead letter's too), or left for redelivery.
    void count(Settlement::Kind kind, bool in_commit = false) noexcept {
        counters_.settled(kind, in_commit);
    }

    /// Tells options.on_error; never throws.
    void report(const std::exception& e) const noexcept {
        if (!options_.on_error) return;
        try {
            options_.on_error(e);
        } catch (...) {  // reporting must never stop the loop
        }
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

    /// How the handler is called (for an adapter that must know whether it batches or pipelines).
    [[nodiscard]] const Dispatch<Message>& dispatch() const noexcept { return dispatch_; }

    // The optional hooks' defaults: an adapter that defines one of these replaces it.
    /// Hook, called only when built with acks_in_commit: the request asking the store's commit
    /// to settle this delivery. Default: none.
    CommitHook commit_hook_of(const Raw&, const Delivery&) const { return CommitHook{}; }
    /// Hook: settle many in one round trip, counting each with count(). Default: settle() each
    /// of @p settling in order.
    void settle_all(std::vector<Raw>& batch, std::vector<ToSettle<Message>>& settling) {
        for (ToSettle<Message>& s : settling) {
            count(
                adapter().settle(batch[s.index], *s.message, s.delivery, s.outcome, s.settlement));
        }
    }
    /// Hook: the deliveries from `from` on were read but not handled (a stop, the store away):
    /// keep them for the next read, or leave them to the broker. Default: left to the broker.
    void unhandled(std::vector<Raw>&, std::size_t /*from*/) {}
    /// Hook, with handled(): around the handler's call for those deliveries (e.g. a heartbeat
    /// that keeps them). Default: nothing.
    void handling(Raw* /*first*/, std::size_t /*count*/) {}
    /// Hook: after the handler's call (see handling()). Default: nothing.
    void handled() {}
    /// Hook: true to handle one at a time through the handler's PipelinedLoop when its store
    /// pipelines (a commit sent with the next claim). Default: false.
    [[nodiscard]] bool pipelines() const noexcept { return false; }
    /// Hook: the redelivery delay of an in_progress outcome without a retry_after. Default:
    /// none, the broker's clock.
    [[nodiscard]] std::optional<std::chrono::milliseconds> in_progress_delay() const noexcept {
        return std::nullopt;
    }
    /// Hook: true when a delivery of the poll must wait (one before it in its partition is
    /// delivered again, and order is kept): not handled, settled or counted; the adapter reads
    /// it again later. One at a time only. Default: false.
    [[nodiscard]] bool blocked(const Raw&) const noexcept { return false; }
    /// Hook: the store's commit acked it (the commit hook was done). Default: nothing.
    void acked_in_commit(Raw&, const Outcome&) {}
    /// Hook: whether a commit that did a dead-lettered message's hook also delivered its dead
    /// letter (a Redis stream's XADD in the commit); false for a hook that only moves a read
    /// position, and the adapter publishes the copy. Default: true.
    [[nodiscard]] bool commit_publishes_dead_letters() const noexcept { return true; }
    /// Hook: how the consumer waits between two probes of its store while the circuit breaker
    /// is open (e.g. pause every partition and keep serving the group). Default: a sleep that
    /// returns early on request_stop().
    void idle(std::chrono::milliseconds duration) { sleep_unless_stopped(duration); }

    /// True while the circuit breaker is open (the handler's store found unreachable).
    [[nodiscard]] bool circuit_open() const noexcept { return breaker_.is_open(); }

    /// The options in use, readable by the adapter (validated before the base was built).
    Options options_;

  private:
    static constexpr std::chrono::milliseconds min_backoff{50};
    static constexpr std::chrono::milliseconds max_backoff{1000};
    static_assert(std::atomic<bool>::is_always_lock_free,
                  "idem: request_stop() needs a lock-free std::atomic<bool> (signal handlers)");

    Adapter& adapter() noexcept { return static_cast<Adapter&>(*this); }
    const Adapter& adapter() const noexcept { return static_cast<const Adapter&>(*this); }

    /// The IdempotentHandler's store probe; else the options' store_probe; else none.
    static std::function<void()> probe_of(const Dispatch<Message>& dispatch,
                                          const ConsumerOptions& options) {
        if (dispatch.store_probe()) return dispatch.store_probe();
        if (options.store_probe) return options.store_probe;
        return [] {};
    }

    SettlementRules rules(bool dead_letters_in_commit) const noexcept {
        return SettlementRules{&options_.redelivery_backoff, adapter().in_progress_delay(),
                               dead_letters_in_commit && adapter().commit_publishes_dead_letters()};
    }

    // -----------------------------------------------------------------------------------------
    // The loop

    /// Before a poll: false after request_stop(), or when a stop came while the breaker was
    /// open (waiting and probing the store until it answers).
    [[nodiscard]] bool ready_to_read() {
        if (stop_requested()) return false;
        if (breaker_.is_open() && !breaker_.wait_until_closed([this] { return stop_requested(); }))
            return false;
        return true;
    }
    /// Between deliveries of one poll: true when the rest must stay unhandled.
    [[nodiscard]] bool interrupted() const noexcept {
        return stop_requested() || breaker_.is_open();
    }
    /// After each outcome: opens the breaker on one caused by an unreachable store.
    void note(const Outcome& outcome) noexcept {
        if (breaker_.trips_on(outcome)) breaker_.open();
    }

    template <class Poll>
    auto counting_connection_errors(Poll&& poll) -> decltype(poll()) {
        try {
            return poll();
        } catch (const store_unavailable&) {
            counters_.connection_error();
            throw;
        } catch (const store_timeout&) {
            counters_.connection_error();
            throw;
        } catch (const broker_unavailable&) {
            counters_.connection_error();
            throw;
        }
    }

    void recover(const std::exception& e, std::chrono::milliseconds& backoff) {
        report(e);
        sleep_unless_stopped(backoff);
        backoff = std::min(backoff * 2, max_backoff);
    }

    [[nodiscard]] bool health_due() const noexcept {
        if (!options_.on_health) return false;
        return std::chrono::steady_clock::now() - last_health_ >= options_.health_interval;
    }
    /// The adapter's report, circuit_open filled in, to the sink; what throws (the adapter's
    /// gathering, the sink) is reported through on_error and ignored.
    void report_health() noexcept {
        last_health_ = std::chrono::steady_clock::now();
        try {
            ConsumerHealth health = adapter().health();
            health.circuit_open = breaker_.is_open();
            options_.on_health(health);
        } catch (const std::exception& e) {
            report(e);
        } catch (...) {
        }
    }

    // -----------------------------------------------------------------------------------------
    // The handle paths

    std::size_t poll() {
        std::vector<Raw> batch = adapter().read();
        if (options_.handle_in_batches) return handle_together(batch);
        if (adapter().pipelines() && dispatch_.sequences()) return handle_in_sequence(batch);
        std::size_t handled = 0;
        for (std::size_t i = 0; i < batch.size(); ++i) {
            if (interrupted()) {  // a stop, or the store found unreachable
                adapter().unhandled(batch, i);
                break;
            }
            if (adapter().blocked(batch[i])) continue;
            handle_one(batch, i);
            ++handled;
        }
        return handled;
    }

    /// The delivery of @p raw, counted as read or redelivered.
    Delivery delivery_counted(const Raw& raw) {
        Delivery delivery = adapter().delivery_of(raw);
        counters_.delivered(delivery);
        return delivery;
    }

    std::optional<CommitHook> hook_for(const Raw& raw, const Delivery& delivery) const {
        if (!acks_in_commit_) return std::nullopt;
        return adapter().commit_hook_of(raw, delivery);
    }

    /// Counts a delivery the store's commit settled (acked, and parked when it was a dead
    /// letter: the commit published its dead-letter copy).
    void count_in_commit(const Outcome& outcome, const Delivery& delivery) noexcept {
        count(broker::settlement_of(outcome, delivery, rules(true)).kind, /*in_commit=*/true);
    }

    void handle_one(std::vector<Raw>& batch, std::size_t i) {
        Raw& raw = batch[i];
        const Delivery delivery = delivery_counted(raw);
        const bool ahead = delivery.counted_by == DeliveryCounter::store;
        if (ahead) {  // a broker without a count: the next one's attempt counted in this commit
            ahead_.next_of(
                batch.begin() + i + 1, batch.end(),
                [&](const Raw& r) { return adapter().blocked(r); },
                [&](const Raw& r) { return adapter().delivery_of(r); });
        }
        const Message& message = adapter().message_of(raw);
        std::optional<CommitHook> hook = hook_for(raw, delivery);
        adapter().handling(&raw, 1);
        const Outcome outcome =
            dispatch_.call(delivery, message, hook ? &*hook : nullptr, ahead ? &ahead_ : nullptr);
        adapter().handled();
        note(outcome);
        if (hook && hook->acked_in_commit) {
            count_in_commit(outcome, delivery);
            adapter().acked_in_commit(raw, outcome);
            return;
        }
        const Settlement settlement = settlement_of(outcome, delivery);
        count(adapter().settle(raw, message, as_judged(delivery, outcome), outcome, settlement));
    }

    /// Batch mode: the poll to the handler at once (one handle_batch() for an
    /// IdempotentHandler; a plain handler per delivery, stopping between two when
    /// interrupted), then the ones the commit did not settle, through settle_all().
    std::size_t handle_together(std::vector<Raw>& batch) {
        if (batch.empty()) return 0;
        if (stop_requested()) {  // a stop leaves the whole batch unsettled
            adapter().unhandled(batch, 0);
            return 0;
        }
        std::vector<Delivery> deliveries;
        deliveries.reserve(batch.size());
        std::vector<CommitHook> hooks;
        if (acks_in_commit_) hooks.reserve(batch.size());
        for (const Raw& raw : batch) {
            deliveries.push_back(adapter().delivery_of(raw));
            if (acks_in_commit_) hooks.push_back(adapter().commit_hook_of(raw, deliveries.back()));
        }
        std::vector<Message> moved;  // the bodies moved out, unless a Raw is its own body
        const std::vector<Message>* bodies = &moved;
        if constexpr (std::is_same_v<Raw, Message>) {
            bodies = &batch;
        } else {
            moved.reserve(batch.size());
            for (Raw& raw : batch)
                moved.push_back(adapter().message_of(std::move(raw)));
        }
        const std::vector<Message>& messages = *bodies;

        adapter().handling(batch.data(), batch.size());
        std::vector<Outcome> outcomes;
        if (dispatch_.batches()) {
            outcomes =
                dispatch_.call_batch(deliveries, messages, acks_in_commit_ ? &hooks : nullptr);
            for (const Outcome& outcome : outcomes)
                note(outcome);
        } else {
            outcomes.reserve(messages.size());
            for (std::size_t i = 0; i < messages.size(); ++i) {
                if (i != 0 && interrupted()) break;  // the rest left unsettled
                outcomes.push_back(dispatch_.call(deliveries[i], messages[i], nullptr));
                note(outcomes.back());
            }
        }
        adapter().handled();
        if (outcomes.size() < batch.size()) adapter().unhandled(batch, outcomes.size());

        std::vector<ToSettle<Message>> settling;
        settling.reserve(outcomes.size());
        for (std::size_t i = 0; i < outcomes.size(); ++i) {
            counters_.delivered(deliveries[i]);
            if (!hooks.empty() && hooks[i].acked_in_commit) {
                count_in_commit(outcomes[i], deliveries[i]);
                adapter().acked_in_commit(batch[i], outcomes[i]);
                continue;
            }
            const Settlement settlement = settlement_of(outcomes[i], deliveries[i]);
            settling.push_back(ToSettle<Message>{i, &messages[i],
                                                 as_judged(std::move(deliveries[i]), outcomes[i]),
                                                 std::move(outcomes[i]), settlement});
        }
        if (!settling.empty()) adapter().settle_all(batch, settling);
        return outcomes.size();
    }

    /// One at a time through the handler's PipelinedLoop: each delivery's claim goes with the
    /// held commit of the one before; the settlements the commits did not do go through
    /// settle_all() after the poll's last delivery. No message stays held past the poll: the
    /// last commit is sent alone, also when the poll is cut short by a stop, an open breaker
    /// or an error.
    std::size_t handle_in_sequence(std::vector<Raw>& batch) {
        std::vector<Settled> settled;
        std::vector<ToSettle<Message>> settling;
        auto take = [&] {
            for (Settled& s : settled) {
                note(s.outcome);
                if (s.acked_in_commit) {
                    count_in_commit(s.outcome, s.delivery);
                    adapter().acked_in_commit(batch[s.tag], s.outcome);
                    continue;
                }
                const Settlement settlement = settlement_of(s.outcome, s.delivery);
                settling.push_back(ToSettle<Message>{s.tag, &adapter().message_of(batch[s.tag]),
                                                     as_judged(std::move(s.delivery), s.outcome),
                                                     std::move(s.outcome), settlement});
            }
            settled.clear();
        };
        std::size_t handled = 0;
        try {
            for (; handled < batch.size(); ++handled) {
                if (interrupted()) {  // the rest stays unsettled
                    adapter().unhandled(batch, handled);
                    break;
                }
                Raw& raw = batch[handled];
                const Delivery delivery = delivery_counted(raw);
                std::optional<CommitHook> hook = hook_for(raw, delivery);
                adapter().handling(&raw, 1);
                dispatch_.in_sequence(delivery, adapter().message_of(raw), handled,
                                      hook ? &*hook : nullptr, settled);
                adapter().handled();
                take();
            }
            dispatch_.flush_sequence(settled);
            take();
        } catch (...) {
            dispatch_.flush_sequence(settled);
            take();
            try {
                if (!settling.empty()) adapter().settle_all(batch, settling);
            } catch (const std::exception&) {  // left unsettled: their redelivery is a duplicate
            }
            throw;
        }
        if (!settling.empty()) adapter().settle_all(batch, settling);
        return handled;
    }

    Dispatch<Message> dispatch_;
    CountAhead ahead_;  ///< store-counted deliveries, one at a time: the next one's count
    bool acks_in_commit_;
    CircuitBreaker breaker_;  ///< after options_ and dispatch_: built from both
    std::atomic<bool> stop_{false};
    std::chrono::steady_clock::time_point last_health_{};
    ConsumerCounters counters_;
};

}  // namespace broker
IDEM_END_NAMESPACE
