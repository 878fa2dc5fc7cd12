#pragma once
/// @file
/// @brief What a JetStreamConsumer (broker/nats_jetstream.hpp) reads and is given:
/// JetStreamMessage, with idem_payload() (what a dead letter keeps of it),
/// JetStreamConsumerOptions, jetstream_backoff() (the BackOff its consumer needs) and the Delivery
/// of a message's metadata. Link idem::nats.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/broker/consumer_options.hpp"
#include "idem/broker/redelivery_backoff.hpp"
#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/nats/message.hpp"

IDEM_BEGIN_NAMESPACE
/// @brief One JetStream message as the handler sees it (a copy: the consumer keeps the
/// natsMsg for its acknowledgements).
struct JetStreamMessage {
    /// The stream it was read from.
    std::string stream;
    /// The subject it was published on.
    std::string subject;
    /// The payload: the body.
    std::string data;
    /// Its headers, in order (a name may repeat).
    nats::Headers headers;
    std::uint64_t stream_sequence = 0;  ///< the same on every delivery of this message

    /// @brief The first value of header @p name (case-sensitive), if any.
    [[nodiscard]] std::optional<std::string_view> header(std::string_view name) const {
        for (const auto& [key, value] : headers) {
            if (key == name) return std::string_view(value);
        }
        return std::nullopt;
    }
};

/// @brief What a dead letter keeps of a JetStream message (found by ADL by the handler): its
/// data, as it is. The headers travel with the copy on the dead-letter subject.
[[nodiscard]] inline std::string idem_payload(const JetStreamMessage& message) {
    return message.data;
}

/// @brief Where a JetStreamConsumer pulls from and how it paces itself; the shared options
/// (broker::ConsumerOptions) under their common names. On NATS JetStream:
/// - `visibility_timeout`: the consumer's AckWait: a delivery not acked within it is delivered
///   again. Checked against the consumer's AckWait on the server at start (a mismatch is
///   refused);
/// - `poll_wait`: how long a fetch waits for the first message;
/// - `redelivery_backoff`: a failed outcome, or a deferred one without its own retry_after, is
///   nacked with the delay before its next delivery (NakWithDelay). RedeliveryBackoff::none():
///   left unsettled, back after AckWait;
/// - `declare`: create the durable pull consumer (explicit acks, AckWait = visibility_timeout,
///   MaxDeliver unlimited (2·10⁹ with a BackOff): idem's policy dead-letters, BackOff =
///   jetstream_backoff(): a message whose worker died comes back no sooner than its redelivery
///   backoff) when it does not exist. A consumer that has a BackOff must have that one (checked at
///   start);
/// - `id_field`: the header carrying the message id, by default Nats-Msg-Id (the producer's id
///   the stream deduplicates on); a message an idem::JetStreamSender published carries its id in
///   `idem-message-id` (nats::message_id_header), which is taken first; empty: the stream
///   sequence, `<stream>:<sequence>`. A message
///   without the header gets the stream sequence when sequence_when_no_id_field, an empty id
///   (dead-lettered as malformed) otherwise. Both are stable across redeliveries of one stored
///   message; only the header is stable across a producer's second publish of the same
///   business message (outside the stream's duplicate window) and across a stream deleted and
///   created again (sequences restart);
/// - `dead_letter`: the subject dead letters are published to (with the reason and the original
///   headers), before the original is terminated; empty: `idem.dead-letters.<stream>.<durable>`.
///   A stream must capture it (the publish waits for the stream's pub ack), and it must not be
///   the consumed stream's own (they would be read again): both are checked at start;
/// - `handle_in_batches`: AckWait (and a lease) must then cover the whole batch;
/// - `on_health`: pending = the consumer's NumAckPending (one JetStream request),
///   dead_letter_depth = the messages of dead_letter_stream when it is named (one more).
struct JetStreamConsumerOptions : broker::ConsumerOptions {
    JetStreamConsumerOptions() { id_field = "Nats-Msg-Id"; }
    /// @brief Options for the durable pull consumer @p durable_ of stream @p stream_, the rest
    /// defaults (id_field Nats-Msg-Id).
    JetStreamConsumerOptions(std::string stream_, std::string durable_)
        : JetStreamConsumerOptions() {
        stream = std::move(stream_);
        durable = std::move(durable_);
    }

    std::string stream;   ///< the stream
    std::string durable;  ///< the durable pull consumer (one per kind of handler)
    /// The stream that captures `dead_letter`, when the consumer should report its depth
    /// (ConsumerHealth::dead_letter_depth); empty: not reported.
    std::string dead_letter_stream{};
    /// A message without the id_field header gets its stream sequence as its id (else an empty
    /// id, which an IdempotentHandler dead-letters as malformed).
    bool sequence_when_no_id_field = true;
    /// With declare: only this subject of the stream (empty: all).
    std::string filter_subject{};
    /// Send +WPI (InProgress) for the message in hand every half AckWait while the handler
    /// runs, so a slow but alive handler is not redelivered. It holds off the broker only: a
    /// lease store's lease still ends when it ends (the commit then fails and the message comes
    /// back). Off by default: a hung handler would hold its message forever.
    bool in_progress_heartbeat = false;
};

namespace detail {
/// A message as a JetStreamConsumer fetched it: the natsMsg (for its acknowledgements) and the
/// copy the handler sees.
struct JetStreamItem {
    nats::Message message;
    JetStreamMessage body;
};

/// The Delivery of a message with metadata @p meta (from the server's ack subject) and
/// @p id_header, the value of its header @p id_field (nothing when it has none or @p id_field is
/// empty): the id is that value or, when @p sequence_when_no_id_field or there is no
/// @p id_field, `<stream>:<stream sequence>` (else empty); the count and enqueue time are the
/// metadata's. Never throws: a malformed delivery keeps an empty id or a count of 0, and the
/// handler dead-letters it.
inline Delivery jetstream_delivery(const nats::Metadata& meta,
                                   std::optional<std::string_view> id_header,
                                   std::string_view id_field, bool sequence_when_no_id_field) {
    Delivery delivery;
    if (!id_field.empty() && id_header) {
        delivery.message_id = std::string(*id_header);
    } else if (id_field.empty() || sequence_when_no_id_field) {
        delivery.message_id = fmt::format("{}:{}", meta.stream, meta.stream_sequence);
    }  // else empty: the handler dead-letters it as malformed
    // NumDelivered is 64-bit; a count past 2^32 is absurd (a corrupt ack subject): count 0,
    // which the handler dead-letters as malformed instead of failing every poll.
    delivery.delivery_count = meta.num_delivered <= UINT32_MAX
                                  ? DeliveryCount::from(meta.num_delivered)
                                  : DeliveryCount(0u);
    if (meta.timestamp_ns > 0) {
        delivery.enqueued_at = std::chrono::system_clock::time_point{} +
                               std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                   std::chrono::nanoseconds(meta.timestamp_ns));
    }
    delivery.origin_position =
        fmt::format("stream {} sequence {}", meta.stream, meta.stream_sequence);
    return delivery;
}

}  // namespace detail

/// @brief The BackOff a JetStream consumer needs so that a delivery nobody settled (its worker
/// was killed, its connection lost) comes back no sooner than a failed one would: entry n − 1
/// is how long delivery n waits for its ack, the longer of the visibility timeout and the
/// redelivery backoff's nominal delay before delivery n + 1; the last entry (where the delays
/// stop growing) serves every later delivery. Empty when no entry would exceed the visibility
/// timeout (AckWait alone waits as long). With `declare` the consumer is created with it; give
/// a consumer you create yourself the same (nats::ConsumerSpec::backoff).
[[nodiscard]] inline std::vector<std::chrono::milliseconds> jetstream_backoff(
    const JetStreamConsumerOptions& options) {
    std::vector<std::chrono::milliseconds> waits;
    const RedeliveryBackoff& backoff = options.redelivery_backoff;
    if (backoff.off()) return waits;
    bool longer = false;
    // Until the delay reaches its cap (or stops growing); 64 entries at most.
    for (std::uint32_t delivery = 1; delivery <= 64; ++delivery) {
        const std::chrono::milliseconds delay = backoff.nominal_before(delivery + 1);
        waits.push_back(std::max(options.visibility_timeout, delay));
        longer = longer || delay > options.visibility_timeout;
        if (delay >= backoff.max || delay == backoff.nominal_before(delivery)) break;
    }
    if (!longer) waits.clear();
    return waits;
}

IDEM_END_NAMESPACE
