#pragma once
/// @file
/// @brief idem::kafka::Message: one consumed Kafka record (move-only, owns librdkafka's
/// message), with views of its topic, partition, offset, key, value and headers; and
/// TopicPartition, the (topic, partition, offset) triple the consumer's calls take. Link
/// idem::kafka.

#include <librdkafka/rdkafka.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/contract/dead_letter_envelope.hpp"

IDEM_BEGIN_NAMESPACE
namespace kafka {

/// @brief The record header carrying an idem message id: idem::KafkaSender writes the outbox
/// intent's idempotency key in it, and an idem consumer configured to read it claims that key
/// as the message id.
inline constexpr const char* message_id_header = envelope::message_id;

/// @brief A record header (a name may repeat; a value may be absent, stored as empty).
using Header = std::pair<std::string, std::string>;
/// @brief A record's headers, in order.
using Headers = std::vector<Header>;

/// @brief A partition of a topic and an offset in it. For commit() and the committed offsets:
/// the offset of the NEXT record to read (the last processed + 1), as Kafka stores it.
struct TopicPartition {
    /// The topic's name.
    std::string topic;
    /// The partition's number in the topic.
    std::int32_t partition = 0;
    /// The offset (see above); RD_KAFKA_OFFSET_INVALID: none (the group's committed offset, else
    /// auto.offset.reset).
    std::int64_t offset = RD_KAFKA_OFFSET_INVALID;
    /// The partition's own result, in a list the client returns (a commit's); not compared.
    rd_kafka_resp_err_t error = RD_KAFKA_RESP_ERR_NO_ERROR;

    /// @brief Same topic, partition and offset (the per-partition error is not compared).
    friend bool operator==(const TopicPartition& a, const TopicPartition& b) {
        return a.topic == b.topic && a.partition == b.partition && a.offset == b.offset;
    }
    /// @brief Not operator==.
    friend bool operator!=(const TopicPartition& a, const TopicPartition& b) { return !(a == b); }
};
/// @brief A list of partitions (an assignment, offsets to commit or committed).
using TopicPartitions = std::vector<TopicPartition>;

namespace detail {

struct PartitionListFree {
    void operator()(rd_kafka_topic_partition_list_t* list) const noexcept {
        rd_kafka_topic_partition_list_destroy(list);
    }
};
using PartitionListPtr = std::unique_ptr<rd_kafka_topic_partition_list_t, PartitionListFree>;

inline PartitionListPtr to_list(const TopicPartitions& partitions) {
    PartitionListPtr list(rd_kafka_topic_partition_list_new(static_cast<int>(partitions.size())));
    for (const auto& p : partitions) {
        rd_kafka_topic_partition_list_add(list.get(), p.topic.c_str(), p.partition)->offset =
            p.offset;
    }
    return list;
}

inline TopicPartitions from_list(const rd_kafka_topic_partition_list_t* list) {
    TopicPartitions out;
    if (list == nullptr) return out;
    out.reserve(static_cast<std::size_t>(list->cnt));
    for (int i = 0; i < list->cnt; ++i) {
        const auto& e = list->elems[i];
        out.push_back(TopicPartition{e.topic, e.partition, e.offset, e.err});
    }
    return out;
}

struct MessageFree {
    void operator()(rd_kafka_message_t* m) const noexcept { rd_kafka_message_destroy(m); }
};

}  // namespace detail

/// @brief One consumed record. The views (key(), value(), topic()) live as long as the Message.
class Message {
  public:
    /// Takes ownership of @p message (from rd_kafka_consumer_poll()).
    explicit Message(rd_kafka_message_t* message) noexcept : message_(message) {}

    /// The topic the record was read from.
    [[nodiscard]] std::string_view topic() const noexcept {
        return rd_kafka_topic_name(message_->rkt);
    }
    /// The partition the record was read from.
    [[nodiscard]] std::int32_t partition() const noexcept { return message_->partition; }
    /// The record's offset in its partition.
    [[nodiscard]] std::int64_t offset() const noexcept { return message_->offset; }
    /// Empty when the record has no key.
    [[nodiscard]] std::string_view key() const noexcept {
        return message_->key == nullptr
                   ? std::string_view()
                   : std::string_view(static_cast<const char*>(message_->key), message_->key_len);
    }
    /// Empty for an empty or null value (a tombstone: has_value() tells).
    [[nodiscard]] std::string_view value() const noexcept {
        return message_->payload == nullptr
                   ? std::string_view()
                   : std::string_view(static_cast<const char*>(message_->payload), message_->len);
    }
    /// False for a null value (a tombstone); true for any other, an empty one included.
    [[nodiscard]] bool has_value() const noexcept { return message_->payload != nullptr; }

    /// The record's headers, in order.
    [[nodiscard]] Headers headers() const {
        Headers out;
        rd_kafka_headers_t* hdrs = nullptr;
        if (rd_kafka_message_headers(message_.get(), &hdrs) != RD_KAFKA_RESP_ERR_NO_ERROR) {
            return out;
        }
        const char* name = nullptr;
        const void* value = nullptr;
        std::size_t size = 0;
        for (std::size_t i = 0;
             rd_kafka_header_get_all(hdrs, i, &name, &value, &size) == RD_KAFKA_RESP_ERR_NO_ERROR;
             ++i) {
            out.emplace_back(name, value == nullptr
                                       ? std::string()
                                       : std::string(static_cast<const char*>(value), size));
        }
        return out;
    }

    /// The value of the last header named @p name; nullopt when there is none.
    [[nodiscard]] std::optional<std::string_view> header(std::string_view name) const {
        rd_kafka_headers_t* hdrs = nullptr;
        if (rd_kafka_message_headers(message_.get(), &hdrs) != RD_KAFKA_RESP_ERR_NO_ERROR) {
            return std::nullopt;
        }
        const std::string key(name);
        const void* value = nullptr;
        std::size_t size = 0;
        if (rd_kafka_header_get_last(hdrs, key.c_str(), &value, &size) !=
            RD_KAFKA_RESP_ERR_NO_ERROR) {
            return std::nullopt;
        }
        return value == nullptr ? std::string_view()
                                : std::string_view(static_cast<const char*>(value), size);
    }

    /// The record's timestamp (create or log-append time); nullopt when it has none.
    [[nodiscard]] std::optional<std::chrono::system_clock::time_point> timestamp() const noexcept {
        rd_kafka_timestamp_type_t type = RD_KAFKA_TIMESTAMP_NOT_AVAILABLE;
        const std::int64_t ms = rd_kafka_message_timestamp(message_.get(), &type);
        if (type == RD_KAFKA_TIMESTAMP_NOT_AVAILABLE || ms < 0) return std::nullopt;
        return std::chrono::system_clock::time_point(std::chrono::milliseconds(ms));
    }

    /// This record's position as a commit wants it: its offset + 1.
    [[nodiscard]] TopicPartition next_position() const {
        return TopicPartition{std::string(topic()), partition(), offset() + 1};
    }

    /// The librdkafka message (still owned).
    [[nodiscard]] rd_kafka_message_t* raw() const noexcept { return message_.get(); }

  private:
    std::unique_ptr<rd_kafka_message_t, detail::MessageFree> message_;
};

}  // namespace kafka
IDEM_END_NAMESPACE
