#pragma once
/// @file
/// @brief What a RabbitMqConsumer (broker/rabbitmq.hpp) reads and is given: idem_payload() of a
/// rabbitmq::Message (what a dead letter keeps of it), the headers idem writes on what it
/// republishes, delivery_count_of(), and RabbitMqConsumerOptions. Link idem::rabbitmq.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "idem/broker/consumer_options.hpp"
#include "idem/config.hpp"
#include "idem/contract/dead_letter_envelope.hpp"
#include "idem/rabbitmq/message.hpp"

IDEM_BEGIN_NAMESPACE
namespace rabbitmq {

/// @brief The bytes a dead letter keeps of a delivery in the store (found by ADL by the
/// handler): its body.
[[nodiscard]] inline std::string idem_payload(const Message& message) {
    return message.body;
}

/// Headers idem writes on the messages it republishes (dead letters, delayed retries): the
/// dead-letter envelope's (contract/dead_letter_envelope.hpp), named here as before.
/// Why it was republished (the outcome's reason).
inline constexpr const char* header_reason = envelope::reason;
/// The policy scope of the handler that republished it.
inline constexpr const char* header_scope = envelope::scope;
/// The message id idem claimed it under.
inline constexpr const char* header_message_id = envelope::message_id;
/// Its delivery count when it was republished (delivery_count_of()).
inline constexpr const char* header_delivery_count = envelope::delivery_count;
/// The queue it was consumed from.
inline constexpr const char* header_queue = envelope::original_queue;
/// On a delayed retry: the deliveries the message had before it was moved to the retry queue
/// (a republished message starts a new x-delivery-count; this carries the old one over).
inline constexpr const char* header_prior_deliveries = "x-idem-prior-deliveries";

/// @brief The delivery count of @p message: the deliveries before a delayed retry
/// (x-idem-prior-deliveries) + the quorum queue's x-delivery-count (the times it was returned:
/// absent or 0 on a first delivery) + 1.
[[nodiscard]] inline std::uint32_t delivery_count_of(const Message& message) {
    auto non_negative = [](std::optional<std::int64_t> v) -> std::uint64_t {
        return v && *v > 0 ? static_cast<std::uint64_t>(*v) : 0;
    };
    const std::uint64_t count = non_negative(message.header_integer(header_prior_deliveries)) +
                                non_negative(message.header_integer("x-delivery-count")) + 1;
    return static_cast<std::uint32_t>(std::min<std::uint64_t>(count, UINT32_MAX));
}

}  // namespace rabbitmq

/// @brief Where a RabbitMqConsumer reads and how it paces itself; the shared options
/// (broker::ConsumerOptions) under their common names. On RabbitMQ:
/// - `visibility_timeout`: the broker's consumer_timeout (rabbitmq.conf; 30 min by default, the
///   default here too): a delivery held unacked longer has its channel closed by the broker
///   (effective once the consumer reads again) and comes back. With it, twice the endpoint's
///   heartbeat bounds a handler call (the broker drops a connection that missed two heartbeats,
///   and rabbitmq-c answers them only between calls); a lease store's lease must not exceed the
///   smaller of the two;
/// - `poll_wait`: how long a poll waits for the first delivery (the rest up to batch_size only
///   if already there);
/// - `redelivery_backoff`: a failed outcome, or a deferred one without its own retry_after,
///   goes to the retry queue with the delay before its next delivery: RabbitMQ itself
///   redelivers a nacked message at once, which would spend the poison limit within
///   milliseconds. RedeliveryBackoff::none(): basic.nack with requeue;
/// - `declare`: declare what is missing at start: the queue (quorum, with queue_arguments), the
///   dead-letter exchange (fanout) with a quorum queue of the same name bound to it, and the
///   retry queues. Off: they must exist (a dead letter no queue takes is refused by the broker
///   and the original stays unacked);
/// - `id_field`: the header (a string) carrying the message id; empty: the message_id property;
/// - `dead_letter`: the exchange dead letters are published to (with publisher confirms, before
///   the original is acked); empty: `<queue>.dead-letters`;
/// - `handle_in_batches`: needs prefetch >= batch_size; twice the endpoint's heartbeat must then
///   cover a whole batch too;
/// - `on_health`: the dead-letter queue's depth when idem declared it.
struct RabbitMqConsumerOptions : broker::ConsumerOptions {
    RabbitMqConsumerOptions() { visibility_timeout = std::chrono::minutes(30); }
    /// @brief Options for consuming quorum queue @p queue_, the rest defaults (visibility_timeout
    /// 30 minutes). Implicit, so `{"orders"}` reads as the queue.
    RabbitMqConsumerOptions(std::string queue_) : RabbitMqConsumerOptions() {  // NOLINT: {"orders"}
        queue = std::move(queue_);
    }

    /// The queue: a quorum queue (x-queue-type=quorum). A classic or stream queue is refused at
    /// start: it gives no delivery count (only a `redelivered` flag), so the poison limit could
    /// not work.
    std::string queue;
    /// This consumer's tag, unique per running instance; empty: the broker picks one.
    std::string consumer_tag{};
    /// basic.qos: at most this many deliveries unacked at a time on the consumer's channel. With
    /// handle_in_batches it must be at least batch_size (the broker sends no more than this many
    /// before an ack, so a larger batch could never fill).
    std::uint16_t prefetch = 16;
    /// The routing key of dead letters. Empty: the queue's name.
    std::string dead_letter_routing_key{};
    /// Where a message waits out its delay before it comes back (failed: its redelivery
    /// backoff; deferred with a retry_after, or in_progress with the holder's lease left: that
    /// delay): published with a per-message TTL of the delay, it is dead-lettered back to
    /// `queue` when the TTL expires. Empty: queue + ".retry". With `declare`, one retry queue
    /// per range of delays, `<retry_queue>.<T>` for the delays from T/2 to T ms (T a power of
    /// two), each declared when first used: RabbitMQ expires messages only at the head of a
    /// queue, so one queue for every delay would hold a short delay behind a long one; this
    /// way a message waits at most twice its delay. Without `declare`, every delay goes to
    /// retry_queue itself (which must exist), and a long delay ahead holds shorter ones behind
    /// it.
    std::string retry_queue{};
    /// An in_progress outcome (another live worker holds the claim) goes to the retry queue
    /// with this delay, so the message does not bounce between the queue and this consumer
    /// while the holder works. 0: basic.nack with requeue at once.
    std::chrono::milliseconds in_progress_delay{1000};
    /// Arguments the queue is declared with besides x-queue-type=quorum; the start check
    /// redeclares the queue with them, so they must match the existing queue's.
    rabbitmq::Table queue_arguments{};
};

IDEM_END_NAMESPACE
