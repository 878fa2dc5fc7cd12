#pragma once
/// @file
/// @brief The dead-letter envelope: the names of the fields (Redis Streams) or headers
/// (RabbitMQ, NATS JetStream, Kafka) idem adds to the copy of a message it parks at the broker,
/// written once for every broker. The copy keeps the original's payload and headers; the
/// envelope says why it was parked and where it came from. The same message's DeadLetter record
/// in the store (records.hpp) carries the same reason, scope, id and count.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The envelope's field and header names (docs/brokers.md, "One vocabulary").
namespace envelope {

/// Why it was parked: the outcome's reason (the poison limit, malformed, a fingerprint
/// mismatch, ...).
inline constexpr const char* reason = "idem-reason";
/// The policy scope of the handler that parked it.
inline constexpr const char* scope = "idem-scope";
/// The message id idem claimed it under (empty for a delivery parked as malformed for lack of
/// one).
inline constexpr const char* message_id = "idem-message-id";
/// The count the handler judged the delivery by, the one its DeadLetter record in the store
/// carries (Outcome::delivery_count): the store's attempt count where the store counts attempts
/// (a lease store such as Redis; Kafka, whose broker keeps no count), else the broker's.
inline constexpr const char* delivery_count = "idem-delivery-count";

// Where the original was. Redis Streams: the stream key and the entry id; NATS JetStream: the
// stream, its sequence and the subject; RabbitMQ: the queue; Kafka: topic, partition, offset.
/// The stream it was read from (Redis Streams: the key; NATS JetStream: the stream's name).
inline constexpr const char* original_stream = "idem-original-stream";
/// Redis Streams: the original entry's id.
inline constexpr const char* original_entry_id = "idem-original-entry-id";
/// NATS JetStream: the original's stream sequence.
inline constexpr const char* original_sequence = "idem-original-sequence";
/// NATS JetStream: the subject it was published to.
inline constexpr const char* original_subject = "idem-original-subject";
/// RabbitMQ: the queue it was consumed from.
inline constexpr const char* original_queue = "idem-original-queue";
/// Kafka: the topic it was read from.
inline constexpr const char* original_topic = "idem-original-topic";
/// Kafka: its partition.
inline constexpr const char* original_partition = "idem-original-partition";
/// Kafka: its offset.
inline constexpr const char* original_offset = "idem-original-offset";
/// An original header the broker would act on if it were kept under its own name (NATS
/// JetStream's `Nats-*`: `Nats-Msg-Id` would dedupe the copy, `Nats-Expected-Stream` refuse it)
/// is kept under this prefix and its name: `idem-original-header-Nats-Msg-Id`.
inline constexpr const char* original_header_prefix = "idem-original-header-";

/// @brief The fields every broker's copy starts with, in this order: reason, scope, message id
/// and, where the broker keeps one, the delivery count.
[[nodiscard]] inline std::vector<std::pair<std::string, std::string>> common_fields(
    std::string_view why, std::string_view policy_scope, std::string_view id,
    std::optional<std::uint32_t> count) {
    std::vector<std::pair<std::string, std::string>> fields{
        {reason, std::string(why)},
        {scope, std::string(policy_scope)},
        {message_id, std::string(id)},
    };
    if (count) fields.emplace_back(delivery_count, std::to_string(*count));
    return fields;
}

}  // namespace envelope

IDEM_END_NAMESPACE
