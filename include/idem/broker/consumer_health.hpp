#pragma once
/// @file
/// @brief idem::ConsumerHealth: what a broker consumer knows about itself (pending deliveries,
/// dead-letter depth, circuit breaker), reported through a HealthSink after each poll. A leaf of
/// broker/ (it includes only config.hpp): the consumers include it, and so do the observers, so
/// neither includes the other: a consumer reports, an observer such as PrometheusObserver turns
/// reports into gauges.

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief One consumer's state after a poll. The views are valid during the call only.
struct ConsumerHealth {
    /// Names the consumer: "<stream>/<group>" (Redis Streams), the queue (RabbitMQ), the
    /// "<stream>/<durable>" (NATS JetStream).
    std::string_view consumer{};
    /// Deliveries the broker has handed to this consumer and not yet had settled (acked, nacked
    /// or terminated), where the broker reports it (XPENDING, unacked deliveries, NumAckPending).
    std::optional<std::uint64_t> pending{};
    /// Where dead letters go (a stream, an exchange, a subject); empty when there is none.
    std::string_view dead_letter_destination{};
    /// Messages waiting in the dead-letter destination, where the consumer can read it.
    std::optional<std::uint64_t> dead_letter_depth{};
    /// True while the consumer's circuit breaker is open (the store is unreachable).
    bool circuit_open = false;
};

/// @brief Receives a consumer's ConsumerHealth after each poll (the consumer's thread; must not
/// throw — a sink that throws is reported through the consumer's on_error and ignored).
using HealthSink = std::function<void(const ConsumerHealth&)>;

IDEM_END_NAMESPACE
