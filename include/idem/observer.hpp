#pragma once
/// @file
/// @brief Observability: per-scope counters and an observer hook that sees every outcome.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief A snapshot of one scope's counters.
///
/// `duplicates` rising is healthy (redeliveries absorbed); alarm on a redelivery rate over 1 %
/// (redeliveries / deliveries) and on dead_lettered > 0.
struct Counters {
    std::uint64_t deliveries = 0;     ///< every delivery handled
    std::uint64_t redeliveries = 0;   ///< deliveries whose broker count was > 1
    std::uint64_t processed = 0;      ///< outcomes Disposition::processed
    std::uint64_t duplicates = 0;     ///< outcomes Disposition::duplicate
    std::uint64_t dead_lettered = 0;  ///< outcomes Disposition::dead_lettered
    std::uint64_t rejected = 0;       ///< outcomes Disposition::rejected
    std::uint64_t deferred = 0;       ///< outcomes Disposition::deferred
    std::uint64_t in_progress = 0;    ///< outcomes Disposition::in_progress
    std::uint64_t failed = 0;         ///< outcomes Disposition::failed
};

/// @brief What the handler measured of one delivery, besides its outcome (see
/// Observer::on_detailed_outcome()). The views are valid during the call only.
struct OutcomeDetails {
    /// Time the handler spent on the delivery (steady_clock around handle(); in handle_batch()
    /// each message gets the batch's time divided by the number of messages).
    std::chrono::nanoseconds handled_in{};
    /// Time the effect took (or the reconcile callback, for a message older than the gateway's
    /// keys); empty when it did not run (duplicate, in_progress, parked before the effect).
    std::optional<std::chrono::nanoseconds> effect_in{};
    /// Time the commit took, when the outcome needed one (processed, rejected, dead_lettered) or
    /// failed in it (commit_failed); in handle_batch() the batch's commit time divided by the
    /// number of messages it committed. Empty when nothing was committed.
    std::optional<std::chrono::nanoseconds> commit_in{};
    /// True when the effect ran in this attempt (even if it then threw or its commit failed).
    bool effect_ran = false;
    /// True when this delivery's commit was attempted and refused (FailureCause::commit_failed)
    /// after its effect had run: the one event idem sees that may mean an external effect ran
    /// without its record (the redelivery runs it again; harmless only with a gateway key).
    bool commit_refused_after_effect = false;
    /// The gateway idempotency key of this message, from the effect chain's with_gateway_key()
    /// (effects/gateway_key.hpp); empty when the chain names none or the observer does not want
    /// it (Observer::wants_gateway_key()). A key is built from business ids, never the payload.
    std::string_view gateway_key{};
};

/// @brief Receives every outcome with its reason. Called on the handling thread after the
/// outcome is final (after the commit); must be thread-safe if the handler is shared.
/// Exceptions it throws are swallowed: observing must never change an outcome.
///
/// The handler calls on_detailed_outcome() (only when an observer is set, so a handler without
/// one never reads the clock); its default forwards to on_timed_outcome(), whose default
/// forwards to on_outcome(), so an observer written for either older hook keeps working
/// unchanged. Override the most detailed hook you need.
class Observer {
  public:
    virtual ~Observer() = default;
    /// @brief Called once per delivery with its outcome, on the thread that handled it.
    virtual void on_outcome(std::string_view scope, const Delivery& delivery,
                            const Outcome& outcome) = 0;
    /// @brief on_outcome() with the time the handler spent on this delivery
    /// (OutcomeDetails::handled_in).
    virtual void on_timed_outcome(std::string_view scope, const Delivery& delivery,
                                  const Outcome& outcome, std::chrono::nanoseconds handled_in) {
        static_cast<void>(handled_in);
        on_outcome(scope, delivery, outcome);
    }
    /// @brief on_timed_outcome() with everything the handler measured: the effect's and the
    /// commit's durations, whether a commit was refused after the effect, the gateway key.
    virtual void on_detailed_outcome(std::string_view scope, const Delivery& delivery,
                                     const Outcome& outcome, const OutcomeDetails& details) {
        on_timed_outcome(scope, delivery, outcome, details.handled_in);
    }
    /// @brief True when this observer uses OutcomeDetails::gateway_key (the handler computes
    /// the key only then). Default: false.
    [[nodiscard]] virtual bool wants_gateway_key() const { return false; }
};

namespace detail {

/// Lock-free counters kept by each handler.
class AtomicCounters {
  public:
    AtomicCounters() noexcept = default;
    AtomicCounters(const AtomicCounters&) = delete;
    AtomicCounters& operator=(const AtomicCounters&) = delete;
    /// Moves the values (not atomically as a whole: nobody may count on either meanwhile).
    AtomicCounters(AtomicCounters&& other) noexcept { take(other); }
    AtomicCounters& operator=(AtomicCounters&& other) noexcept {
        if (this != &other) take(other);
        return *this;
    }
    ~AtomicCounters() = default;

    void count(const Delivery& delivery, Disposition disposition) noexcept {
        deliveries_.fetch_add(1, std::memory_order_relaxed);
        if (delivery.delivery_count.value() > 1) {
            redeliveries_.fetch_add(1, std::memory_order_relaxed);
        }
        slot(disposition).fetch_add(1, std::memory_order_relaxed);
    }

    [[nodiscard]] Counters snapshot() const noexcept {
        Counters c;
        c.deliveries = deliveries_.load(std::memory_order_relaxed);
        c.redeliveries = redeliveries_.load(std::memory_order_relaxed);
        c.processed = by_disposition_[index(Disposition::processed)].load();
        c.duplicates = by_disposition_[index(Disposition::duplicate)].load();
        c.dead_lettered = by_disposition_[index(Disposition::dead_lettered)].load();
        c.rejected = by_disposition_[index(Disposition::rejected)].load();
        c.deferred = by_disposition_[index(Disposition::deferred)].load();
        c.in_progress = by_disposition_[index(Disposition::in_progress)].load();
        c.failed = by_disposition_[index(Disposition::failed)].load();
        return c;
    }

  private:
    void take(AtomicCounters& other) noexcept {
        auto move = [](std::atomic<std::uint64_t>& to, std::atomic<std::uint64_t>& from) {
            to.store(from.exchange(0, std::memory_order_relaxed), std::memory_order_relaxed);
        };
        move(deliveries_, other.deliveries_);
        move(redeliveries_, other.redeliveries_);
        for (std::size_t i = 0; i < std::size(by_disposition_); ++i)
            move(by_disposition_[i], other.by_disposition_[i]);
    }

    static constexpr std::size_t index(Disposition d) noexcept {
        return static_cast<std::size_t>(d);
    }
    std::atomic<std::uint64_t>& slot(Disposition d) noexcept { return by_disposition_[index(d)]; }

    std::atomic<std::uint64_t> deliveries_{0};
    std::atomic<std::uint64_t> redeliveries_{0};
    std::atomic<std::uint64_t> by_disposition_[7] = {};
};

inline void add(Counters& into, const Delivery& delivery, Disposition disposition) noexcept {
    ++into.deliveries;
    if (delivery.delivery_count.value() > 1) ++into.redeliveries;
    switch (disposition) {
        case Disposition::processed:
            ++into.processed;
            break;
        case Disposition::duplicate:
            ++into.duplicates;
            break;
        case Disposition::dead_lettered:
            ++into.dead_lettered;
            break;
        case Disposition::rejected:
            ++into.rejected;
            break;
        case Disposition::deferred:
            ++into.deferred;
            break;
        case Disposition::in_progress:
            ++into.in_progress;
            break;
        case Disposition::failed:
            ++into.failed;
            break;
    }
}

}  // namespace detail

/// @brief An observer that keeps counters per scope, for several handlers at once.
class CountingObserver final : public Observer {
  public:
    /// Counts @p outcome under @p scope.
    void on_outcome(std::string_view scope, const Delivery& delivery,
                    const Outcome& outcome) override {
        std::lock_guard<std::mutex> lock(mutex_);
        detail::add(by_scope_[std::string(scope)], delivery, outcome.disposition);
    }

    /// Counters of one scope (all zero for a scope never seen).
    [[nodiscard]] Counters counters(std::string_view scope) const {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = by_scope_.find(std::string(scope));
        return it == by_scope_.end() ? Counters{} : it->second;
    }

    /// Counters of every scope seen, by name.
    [[nodiscard]] std::map<std::string, Counters> all() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return by_scope_;
    }

  private:
    mutable std::mutex mutex_;
    std::map<std::string, Counters> by_scope_;
};

IDEM_END_NAMESPACE
