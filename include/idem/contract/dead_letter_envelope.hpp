#pragma once
/// @file
/// @brief The dead-letter envelope: the names of the fields (Redis Streams) or headers
/// (RabbitMQ, NATS JetStream, Kafka) idem adds to the copy of a message it parks at the broker,
/// written once for every broker. The copy keeps the original's payload and headers; the
/// envelope says why it was parked, how its effect failed and where it came from. The same
/// message's DeadLetter record in the store (records.hpp) carries the same reason, scope, id,
/// count and failures.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/contract/time.hpp"
#include "idem/delivery.hpp"
#include "idem/outcome.hpp"

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
/// How its effect last failed before it was parked (DeadLetter::failure), where the store
/// noted it (Store::note_failure()); absent when none was noted.
inline constexpr const char* failure = "idem-failure";
/// When the first of those failures was noted: Unix milliseconds, as every idem store keeps
/// times (DeadLetter::first_failed_at); absent with idem-failure.
inline constexpr const char* first_failed_at = "idem-first-failed-at";
/// When the last one was (DeadLetter::last_failed_at), Unix milliseconds.
inline constexpr const char* last_failed_at = "idem-last-failed-at";

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

/// @brief The fields every broker's copy starts with, in this order: reason, scope, message id,
/// the delivery count and, when the store noted how the effect failed, the failure and when
/// the first and the last were.
[[nodiscard]] inline std::vector<std::pair<std::string, std::string>> common_fields(
    std::string_view why, std::string_view policy_scope, std::string_view id, std::uint32_t count,
    const std::optional<NotedFailure>& noted) {
    std::vector<std::pair<std::string, std::string>> fields{
        {reason, std::string(why)},
        {scope, std::string(policy_scope)},
        {message_id, std::string(id)},
        {delivery_count, std::to_string(count)},
    };
    if (noted) {
        fields.emplace_back(failure, noted->text);
        fields.emplace_back(first_failed_at, std::to_string(to_unix_ms(noted->first)));
        fields.emplace_back(last_failed_at, std::to_string(to_unix_ms(noted->last)));
    }
    return fields;
}

/// @brief common_fields() of a dead-lettered @p outcome of @p delivery (the count it was judged
/// by: broker::as_judged) under @p policy_scope.
[[nodiscard]] inline std::vector<std::pair<std::string, std::string>> fields_of(
    const Outcome& outcome, const Delivery& delivery, std::string_view policy_scope) {
    return common_fields(outcome.reason, policy_scope, delivery.message_id,
                         delivery.delivery_count.value(), outcome.noted_failure);
}

}  // namespace envelope

IDEM_END_NAMESPACE
