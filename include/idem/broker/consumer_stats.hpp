#pragma once
/// @file
/// @brief broker::ConsumerStats, what a consumer has done so far, and broker::ConsumerCounters,
/// the counters behind it. Part of the broker base (consumer.hpp); includes no client library.

#include <atomic>
#include <cstddef>

#include "idem/broker/circuit_breaker.hpp"
#include "idem/broker/settlement.hpp"
#include "idem/config.hpp"
#include "idem/delivery.hpp"

IDEM_BEGIN_NAMESPACE
namespace broker {

/// @brief What a consumer has done so far (a snapshot). The same fields, with the same
/// meaning, on every adapter.
struct ConsumerStats {
    std::size_t read = 0;             ///< first deliveries (delivery count 1) handed to the handler
    std::size_t redelivered = 0;      ///< deliveries that came again (delivery count above 1)
    std::size_t acked = 0;            ///< settled for good, by the consumer or in the commit
    std::size_t dead_lettered = 0;    ///< of those, sent to the dead-letter destination first
    std::size_t not_acked = 0;        ///< left for redelivery: failed, deferred or in_progress
    std::size_t acked_in_commit = 0;  ///< acked by the store's commit itself (commit hook)
    std::size_t connection_errors = 0;  ///< broker (or its Redis) unreachable or timed out
    std::size_t circuit_opened = 0;     ///< times reading paused: the handler's store unreachable
    std::size_t store_probes = 0;       ///< probes of the store while paused (successful included)
};

/// @brief The counters behind ConsumerStats: bumped on the polling thread, read from any
/// (relaxed: each field is exact, the set is not taken atomically).
class ConsumerCounters {
  public:
    /// A delivery handed to the handler: read (delivery count 1) or redelivered.
    void delivered(const Delivery& delivery) noexcept {
        bump(delivery.delivery_count.value() > 1 ? redelivered_ : read_);
    }
    /// One settled delivery: an ack (a dead letter's too, @p in_commit when the store's commit
    /// did it), or left for redelivery.
    void settled(Settlement::Kind kind, bool in_commit) noexcept {
        if (kind == Settlement::Kind::redeliver) {
            bump(not_acked_);
            return;
        }
        bump(acked_);
        if (in_commit) bump(acked_in_commit_);
        if (kind == Settlement::Kind::dead_letter_then_ack) bump(dead_lettered_);
    }
    /// The broker, or the store, unreachable or timed out.
    void connection_error() noexcept { bump(connection_errors_); }

    /// The counters, with the circuit breaker's.
    [[nodiscard]] ConsumerStats snapshot(const CircuitBreakerStats& breaker) const noexcept {
        ConsumerStats s;
        s.read = read_.load(std::memory_order_relaxed);
        s.redelivered = redelivered_.load(std::memory_order_relaxed);
        s.acked = acked_.load(std::memory_order_relaxed);
        s.dead_lettered = dead_lettered_.load(std::memory_order_relaxed);
        s.not_acked = not_acked_.load(std::memory_order_relaxed);
        s.acked_in_commit = acked_in_commit_.load(std::memory_order_relaxed);
        s.connection_errors = connection_errors_.load(std::memory_order_relaxed);
        s.circuit_opened = breaker.opened;
        s.store_probes = breaker.probes;
        return s;
    }

  private:
    static void bump(std::atomic<std::size_t>& counter) noexcept {
        counter.fetch_add(1, std::memory_order_relaxed);
    }

    std::atomic<std::size_t> read_{0};
    std::atomic<std::size_t> redelivered_{0};
    std::atomic<std::size_t> acked_{0};
    std::atomic<std::size_t> dead_lettered_{0};
    std::atomic<std::size_t> not_acked_{0};
    std::atomic<std::size_t> acked_in_commit_{0};
    std::atomic<std::size_t> connection_errors_{0};
};

}  // namespace broker
IDEM_END_NAMESPACE
