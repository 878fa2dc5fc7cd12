#pragma once
/// @file
/// @brief idem::rabbitmq::Message (user-facing as idem::RabbitMessage): one delivery of a
/// RabbitMQ queue as read, with its properties and headers; and FieldValue / Table, the AMQP
/// field-table values idem reads and writes. Plain values: no rabbitmq-c header here.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace rabbitmq {

/// @brief An AMQP field value as idem sees it: nothing (void), a boolean, an integer (every
/// width, and timestamps), a floating-point number, or a string (long strings and byte arrays:
/// binary-safe). Nested tables, arrays and decimals are kept only in Message::encoded_headers
/// (so a republished message keeps them exactly) and show here as std::monostate.
using FieldValue = std::variant<std::monostate, bool, std::int64_t, double, std::string>;

/// @brief An AMQP field table, in order (queue arguments, message headers).
using Table = std::vector<std::pair<std::string, FieldValue>>;

/// @brief The value of the first entry named @p name of @p table.
[[nodiscard]] inline const FieldValue* find_field(const Table& table, std::string_view name) {
    for (const auto& [key, value] : table) {
        if (key == name) return &value;
    }
    return nullptr;
}

/// @brief The basic properties idem reads and carries over (others are dropped on a republish).
struct Properties {
    /// MIME type of the body.
    std::optional<std::string> content_type{};
    /// E.g. gzip.
    std::optional<std::string> content_encoding{};
    /// The producer's id (an idem sender's idempotency key).
    std::optional<std::string> message_id{};
    /// The request it answers (RPC).
    std::optional<std::string> correlation_id{};
    /// The producer's message type name.
    std::optional<std::string> type{};
    /// The producing application.
    std::optional<std::string> app_id{};
    std::optional<std::string> expiration{};      ///< per-message TTL, milliseconds as text
    std::optional<std::uint64_t> timestamp{};     ///< seconds since the epoch
    std::optional<std::uint8_t> delivery_mode{};  ///< 2: persistent
    /// Priority 0-9 (for a priority queue).
    std::optional<std::uint8_t> priority{};
};

/// @brief One delivery (basic.deliver) as read from a channel.
struct Message {
    /// The payload, as it came.
    std::string body;
    /// Its basic properties.
    Properties properties{};
    /// The headers property, decoded (see FieldValue for what shows).
    Table headers{};
    /// The headers property in AMQP wire encoding (empty: no headers), so that a dead letter or
    /// a retry republishes the original headers, nested values included: byte for byte for a
    /// canonical table; rabbitmq-c re-encodes what it decoded, so a boolean byte other than 0
    /// reads as 1 and a table's length prefix is its entries' length.
    std::string encoded_headers{};
    /// The exchange it was published to ("": the default).
    std::string exchange{};
    /// The routing key it was published with.
    std::string routing_key{};
    /// The consumer it was delivered to.
    std::string consumer_tag{};
    std::uint64_t delivery_tag = 0;  ///< valid on its channel only: see channel_epoch
    /// The broker delivered it before (its redelivered flag).
    bool redelivered = false;
    /// The channel it came on, where it must be acked.
    std::uint16_t channel = 0;
    /// Which incarnation of the channel delivered it: a channel reopened after an error (or a
    /// reconnect) has a new epoch, and a delivery tag of an older epoch must never be acked.
    std::uint64_t channel_epoch = 0;

    /// @brief The header @p name, if present.
    [[nodiscard]] const FieldValue* header(std::string_view name) const {
        return find_field(headers, name);
    }
    /// @brief The header @p name as an integer, if it is one.
    [[nodiscard]] std::optional<std::int64_t> header_integer(std::string_view name) const {
        const FieldValue* value = header(name);
        if (value == nullptr) return std::nullopt;
        if (const auto* i = std::get_if<std::int64_t>(value)) return *i;
        return std::nullopt;
    }
    /// @brief The header @p name as a string, if it is one.
    [[nodiscard]] std::optional<std::string_view> header_string(std::string_view name) const {
        const FieldValue* value = header(name);
        if (value == nullptr) return std::nullopt;
        if (const auto* s = std::get_if<std::string>(value)) return std::string_view(*s);
        return std::nullopt;
    }
};

}  // namespace rabbitmq

/// @brief The user-facing name of rabbitmq::Message.
using RabbitMessage = rabbitmq::Message;

IDEM_END_NAMESPACE
