#pragma once
/// @file
/// @brief broker::ConsumerOptions, the options every adapter's options inherit, and
/// validate_consumer_options(), their checks; broker::ToSettle, a delivery the consumer settles
/// after the handler. Part of the broker base (consumer.hpp); includes no client library.

#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "idem/broker/circuit_breaker.hpp"
#include "idem/broker/consumer_health.hpp"
#include "idem/broker/redelivery_backoff.hpp"
#include "idem/broker/settlement.hpp"
#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE
namespace broker {

/// @brief The options every adapter's options inherit, under the same names with the same
/// meaning (docs/brokers.md has them in one table, broker by broker).
struct ConsumerOptions {
    /// Deliveries read per poll, at most (with handle_in_batches: handled together).
    std::size_t batch_size = 16;
    /// How long a read waits for messages; also how long run() may take to notice
    /// request_stop().
    std::chrono::milliseconds poll_wait{1000};
    /// How long a delivery stays with this consumer before the broker gives it to another.
    /// Keep it above the handler's p99; a lease store's lease must not exceed it.
    std::chrono::milliseconds visibility_timeout{30000};
    /// How long a delivery that was not acked waits before its next delivery, growing with its
    /// delivery count. RedeliveryBackoff::none(): the broker's own clock.
    RedeliveryBackoff redelivery_backoff{};
    /// The field or header carrying a producer-set message id (a business id, so a message
    /// sent twice is claimed once). Empty: the broker's own id. A delivery without it gets an
    /// empty id, which an IdempotentHandler dead-letters as malformed.
    std::string id_field{};
    /// Where dead letters go. Empty: `<source>.dead-letters` (see each adapter).
    std::string dead_letter{};
    /// Create the broker objects this consumer needs on start (group, queue, consumer) when
    /// they do not exist.
    bool declare = true;
    /// Handle each poll's deliveries together: an IdempotentHandler gets them in ONE
    /// handle_batch() call (one store transaction, each message in its own savepoint), then
    /// each is settled. The lease and the visibility timeout must then cover a whole batch,
    /// and a stop waits for the batch in hand. Off: one at a time.
    bool handle_in_batches = false;
    /// Told about each error run() recovers from before it backs off and retries; for logs.
    /// What it throws is ignored. Empty: only counted.
    std::function<void(const std::exception&)> on_error{};
    /// The pause while the handler's store is unreachable: after an outcome failed with
    /// Outcome::store_unreachable() the consumer stops reading (the rest of the poll stays
    /// unsettled), waits and probes the store, and reads again only once a probe succeeds. So
    /// delivery counts do not grow during an outage.
    CircuitBreakerOptions circuit_breaker{};
    /// How to probe a plain handler's store (throw while unreachable). Empty: no probe, one
    /// initial_backoff pause after each such outcome. An IdempotentHandler's store is probed
    /// with idem::probe_store (its ping(), else a transaction begun and rolled back).
    std::function<void()> store_probe{};
    /// Receives a ConsumerHealth report after a poll, at most once per health_interval (each
    /// may cost the adapter a round trip). Empty: none. E.g. PrometheusObserver's health_sink().
    HealthSink on_health{};
    /// The least time between two on_health reports.
    std::chrono::milliseconds health_interval{1000};
};

/// @brief The checks of the options every adapter shares; @p who names the consumer in the
/// message. @throws usage_error saying which value and why.
inline void validate_consumer_options(const ConsumerOptions& options, std::string_view who) {
    auto refuse = [&](std::string_view why) { throw usage_error(fmt::format("{}: {}", who, why)); };
    if (options.batch_size == 0) refuse("batch_size is 0; read at least 1 message per poll");
    if (options.poll_wait.count() <= 0) {
        refuse(
            "poll_wait must be positive (e.g. 1000 ms); 0 would make a read wait forever or "
            "never, and run() could not stop");
    }
    if (options.visibility_timeout.count() <= 0) {
        refuse(
            "visibility_timeout must be positive: choose it above the handler's p99 (e.g. "
            "30000 ms)");
    }
    options.redelivery_backoff.validate(who);
}

/// @brief A delivery the consumer settles after the handler: where it is in the poll, its
/// body, delivery and outcome, and what settlement_of() decided.
template <class Message>
struct ToSettle {
    std::size_t index = 0;  ///< its place in the poll's batch
    /// Its body, in the poll's batch (or the moved bodies).
    const Message* message = nullptr;
    /// What the handler was given.
    Delivery delivery{};
    /// What the handler returned.
    Outcome outcome{};
    /// What settlement_of() decided for the outcome.
    Settlement settlement{};
};

}  // namespace broker
IDEM_END_NAMESPACE
