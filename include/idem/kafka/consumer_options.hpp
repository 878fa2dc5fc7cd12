#pragma once
/// @file
/// @brief What idem::KafkaConsumer (idem/broker/kafka.hpp) takes and hands out: its options
/// (KafkaConsumerOptions, KafkaOffsets) with their checks, and KafkaMessage, the copy of a record
/// its handler sees. Link idem::kafka.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/broker/consumer_options.hpp"
#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/error.hpp"
#include "idem/kafka/config.hpp"
#include "idem/kafka/message.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief One Kafka record as the handler sees it (a copy: the consumer keeps the librdkafka
/// message for its position).
struct KafkaMessage {
    /// The topic it was read from.
    std::string topic;
    /// Its partition in the topic.
    std::int32_t partition = 0;
    /// Its offset in the partition.
    std::int64_t offset = 0;
    /// The record's key (empty when it has none).
    std::string key;
    /// The record's value: the body.
    std::string value;
    /// The record's headers, in order (a name may repeat).
    kafka::Headers headers;
    /// The record's timestamp (create or log-append time, as the topic says); nullopt when it has
    /// none. The delivery's enqueued_at.
    std::optional<std::chrono::system_clock::time_point> timestamp{};

    /// @brief The last value of header @p name, if any.
    [[nodiscard]] std::optional<std::string_view> header(std::string_view name) const {
        for (auto it = headers.rbegin(); it != headers.rend(); ++it) {
            if (it->first == name) return std::string_view(it->second);
        }
        return std::nullopt;
    }
};

/// @brief What a dead letter keeps of a Kafka record (found by ADL by the handler): its value.
[[nodiscard]] inline std::string idem_payload(const KafkaMessage& message) {
    return message.value;
}

/// @brief Where a KafkaConsumer keeps its read position.
enum class KafkaOffsets : std::uint8_t {
    /// Kafka's group offsets, committed only after the store's commit (asynchronously, once
    /// per poll, while running; synchronously when partitions are revoked and on close()). A
    /// member killed between the two hands its records to the next owner again: duplicates,
    /// absorbed by the claims.
    commit_after_store,
    /// The next offset per (group, topic, partition) in the handler's store, written in the
    /// same transaction as the claim and the effect (a store with stored_offset(): MemoryStore,
    /// SqliteStore, PostgresStore, MysqlStore). On assignment the consumer starts each
    /// partition at its stored offset, so a rebalance replays nothing that committed. Kafka's
    /// group offsets are still committed afterwards, for lag monitoring.
    in_store,
};

/// @brief What a KafkaConsumer reads and how; the shared options (broker::ConsumerOptions)
/// under their common names. On Kafka:
/// - `batch_size`: records per poll (from any of the assigned partitions; with
///   handle_in_batches, from one partition);
/// - `poll_wait`: how long a poll waits for the first record;
/// - `visibility_timeout`: max.poll.interval.ms (at least session.timeout.ms): a member that
///   does not poll within it leaves the group and its partitions move. Keep it above the
///   handler's p99 (a batch's, with handle_in_batches);
/// - `redelivery_backoff`: how long a partition pauses before a failed (or deferred, without
///   its own retry_after) record is tried again in place. RedeliveryBackoff::none(): at once;
/// - `id_field`: the header carrying the message id (a producer-set id, e.g. the relay's key in
///   `idem-message-id`); empty (the default): `<topic>/<partition>/<offset>`. A record without
///   the header gets an empty id and is dead-lettered as malformed. The offset is stable across
///   redeliveries of one stored record, but a producer retry without enable.idempotence can
///   store one message at two offsets: only a producer-set id makes that a duplicate;
/// - `dead_letter`: the topic dead letters go to; empty: `<topic>.DLT` of the record's topic;
/// - `declare`: nothing to declare (topics are created by their owners; the dead-letter topic
///   must exist or be auto-created by the cluster);
/// - `on_health`: pending = the assigned partitions' lag (high watermark − position, as the
///   client last saw them; no request).
struct KafkaConsumerOptions : broker::ConsumerOptions {
    KafkaConsumerOptions() = default;
    /// @brief Options for consuming @p topics_ in consumer group @p group_, the rest defaults.
    KafkaConsumerOptions(std::vector<std::string> topics_, std::string group_)
        : topics(std::move(topics_)), group(std::move(group_)) {}

    std::vector<std::string> topics;  ///< subscribed to
    std::string group;                ///< the consumer group (group.id)
    /// Where the group's read position is kept (see KafkaOffsets); in_store needs a store with
    /// stored_offset().
    KafkaOffsets offsets = KafkaOffsets::commit_after_store;
    /// The dead-letter producer's configuration; nothing: bootstrap.servers of the consumer's
    /// Config, an idempotent producer.
    std::optional<kafka::Config> dead_letter_producer{};
    /// How long a dead letter's delivery report may take before the record is left unsettled.
    std::chrono::milliseconds dead_letter_timeout{10000};
};

namespace kafka::detail {

/// The copy of @p record a handler sees.
inline KafkaMessage copy_of(const Message& record) {
    KafkaMessage body;
    body.topic = std::string(record.topic());
    body.partition = record.partition();
    body.offset = record.offset();
    body.key = std::string(record.key());
    body.value = std::string(record.value());
    body.headers = record.headers();
    body.timestamp = record.timestamp();
    return body;
}

/// The checks of @p options' group and topics (before the shared options' checks); @p who
/// names the consumer. @throws usage_error saying which value and why.
inline void check_topics(const KafkaConsumerOptions& options, const std::string& who) {
    auto refuse = [&](std::string_view why) { throw usage_error(fmt::format("{}: {}", who, why)); };
    if (options.group.empty()) refuse("options.group is empty; name the consumer group");
    if (options.topics.empty()) refuse("options.topics is empty; name the topics to read");
    for (const std::string& topic : options.topics) {
        if (topic.empty()) refuse("options.topics holds an empty topic name");
        if (options.dead_letter.empty()
                ? topic.size() > 4 && topic.compare(topic.size() - 4, 4, ".DLT") == 0
                : topic == options.dead_letter) {
            refuse(fmt::format(
                "the topic \"{}\" is a dead-letter topic; reading it would hand its dead "
                "letters to the handler again",
                topic));
        }
    }
}

/// The checks of KafkaOffsets::in_store (after the shared options' checks);
/// @p store_keeps_offsets: an IdempotentHandler whose store has stored_offset().
/// @throws usage_error saying which value and why.
inline void check_offsets(const KafkaConsumerOptions& options, bool store_keeps_offsets,
                          const std::string& who) {
    if (options.offsets != KafkaOffsets::in_store) return;
    auto refuse = [&](std::string_view why) { throw usage_error(fmt::format("{}: {}", who, why)); };
    if (!store_keeps_offsets) {
        refuse(
            "KafkaOffsets::in_store needs an IdempotentHandler whose store keeps offsets "
            "(stored_offset(): MemoryStore, SqliteStore, PostgresStore, MysqlStore)");
    }
    if (options.handle_in_batches) {
        refuse(
            "KafkaOffsets::in_store with handle_in_batches: a batch commits its other "
            "records when one fails, and their stored offset would pass the failed one. "
            "Use one of the two");
    }
}

/// The Delivery of record @p body, tried @p tries times by this consumer: its id from header
/// @p id_field (the last one of that name), or `<topic>/<partition>/<offset>` without one; the
/// attempts counted by the store (Kafka keeps no count); where it was, for its dead letter.
inline Delivery kafka_delivery(const KafkaMessage& body, std::uint32_t tries,
                               std::string_view id_field) {
    Delivery delivery;
    if (id_field.empty()) {
        delivery.message_id = fmt::format("{}/{}/{}", body.topic, body.partition, body.offset);
    } else if (auto id = body.header(id_field)) {
        delivery.message_id = std::string(*id);
    }  // else empty: the handler dead-letters it as malformed
    delivery.delivery_count = tries;
    delivery.counted_by = DeliveryCounter::store;
    delivery.enqueued_at = body.timestamp;
    delivery.origin = body.topic;
    delivery.origin_position = fmt::format("partition {} offset {}", body.partition, body.offset);
    return delivery;
}

}  // namespace kafka::detail
IDEM_END_NAMESPACE
