#pragma once
/// @file
/// @brief What the broker tells us about one delivery of a message.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The broker's delivery count for one delivery (1 on the first delivery).
///
/// A distinct type rather than an integer so that it cannot be passed to idem::key(): a key
/// derived from the retry counter changes on every redelivery, which is the original bug.
///
/// Built implicitly only from an unsigned integer of at most 32 bits, which always fits:
/// `Delivery{msg.id(), msg.delivery_count()}` reads naturally for such a source, and a literal
/// is written `3u`. A signed or wider integer is refused at compile time (−1 would silently
/// become 4294967295, a poison dead letter; 2^32 + 1 a first delivery): convert it with
/// DeliveryCount::from(), which checks the range at run time.
class DeliveryCount {
    template <class T>
    static constexpr bool fits_v = std::is_integral_v<T>&& std::is_unsigned_v<T> &&
                                   !std::is_same_v<T, bool> && sizeof(T) <= sizeof(std::uint32_t);

  public:
    constexpr DeliveryCount() noexcept = default;
    // Implicit on purpose: `Delivery{msg.id(), msg.delivery_count()}` must read naturally.
    /// The count from an unsigned integer of at most 32 bits (`3u`, a broker's `uint32_t`).
    template <class T, std::enable_if_t<fits_v<T>, int> = 0>
    constexpr DeliveryCount(T count) noexcept  // NOLINT
        : count_(static_cast<std::uint32_t>(count)) {}
    /// A signed, wider or non-integer count could silently wrap: use DeliveryCount::from().
    template <class T, std::enable_if_t<std::is_arithmetic_v<T> && !fits_v<T>, int> = 0>
    DeliveryCount(T count) = delete;  // NOLINT signed or wider: use DeliveryCount::from(count)

    /// @brief The count from any integer, checked: @throws usage_error when it is negative or
    /// over 4294967295 (UINT32_MAX), naming the value.
    template <class T>
    [[nodiscard]] static DeliveryCount from(T count) {
        static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>,
                      "idem::DeliveryCount::from takes an integer");
        if constexpr (std::is_signed_v<T>) {
            if (count < 0) {
                throw usage_error(fmt::format(
                    "idem::DeliveryCount::from({}): a delivery count cannot be negative (is the "
                    "broker's field mapped, and read as the right type?)",
                    count));
            }
        }
        if (static_cast<std::make_unsigned_t<T>>(count) > UINT32_MAX) {
            throw usage_error(fmt::format(
                "idem::DeliveryCount::from({}): a delivery count must be at most 4294967295",
                count));
        }
        return DeliveryCount(static_cast<std::uint32_t>(count));
    }

    /// The count (0 when the broker gave none).
    [[nodiscard]] constexpr std::uint32_t value() const noexcept { return count_; }
    /// Equal when the counts are.
    friend constexpr bool operator==(DeliveryCount a, DeliveryCount b) noexcept {
        return a.count_ == b.count_;
    }
    /// Different when the counts are.
    friend constexpr bool operator!=(DeliveryCount a, DeliveryCount b) noexcept {
        return a.count_ != b.count_;
    }

  private:
    std::uint32_t count_ = 1;
};

/// @brief Who counts a message's deliveries for the poison limit (PolicyOptions::max_deliveries).
enum class DeliveryCounter : std::uint8_t {
    /// delivery_count is the broker's (Redis Streams, RabbitMQ quorum queues, NATS JetStream).
    broker,
    /// The broker keeps no count (Kafka). An IdempotentHandler counts each attempt in its store
    /// instead, in a write committed BEFORE the attempt's effect runs: on its own (the store's
    /// count_attempt()), or in the commit of the message before it (CountAhead); a lease store
    /// counts the claims it hands out, which serves the same. So a message that kills every
    /// worker is still parked after max_deliveries attempts.
    /// delivery_count then says how often this consumer has tried it (its redelivery backoff).
    store,
};

/// @brief One delivery of a message, as the broker reports it.
///
/// @code
/// idem::Delivery d{msg.id(), msg.delivery_count()};
/// @endcode
struct Delivery {
    /// The broker's message id (Redis stream entry id, SQS MessageId, ...). Binary-safe.
    std::string message_id;
    /// How many times the broker has handed this message out, this time included.
    DeliveryCount delivery_count{1u};
    /// When the broker accepted the message, if it says.
    std::optional<std::chrono::system_clock::time_point> enqueued_at{};
    /// Whose count the poison limit uses: the broker's delivery_count, or the store's.
    DeliveryCounter counted_by = DeliveryCounter::broker;
    /// Where the broker held it, as a place a sender publishes to (outbox.hpp's destination):
    /// the stream's key (Redis Streams), the queue (RabbitMQ), the subject (NATS JetStream), the
    /// topic (Kafka). The broker adapters fill it; a dead letter keeps it, so a redrive can send
    /// the message back where it came from. Empty: unknown.
    std::string origin{};
    /// Where in its origin it was, for an operator: the entry id (Redis Streams), `stream S
    /// sequence N` (NATS JetStream), `partition P offset O` (Kafka); empty where the broker
    /// names no position (RabbitMQ).
    std::string origin_position{};
};

/// Longest message id accepted; longer ids are dead-lettered as malformed.
inline constexpr std::size_t max_message_id_bytes = 512;

/// @brief Why a delivery's id cannot be claimed (empty, or over max_message_id_bytes), or an
/// empty optional when it can.
[[nodiscard]] inline std::optional<std::string> unclaimable_reason(const Delivery& delivery) {
    if (delivery.message_id.empty()) return std::string("malformed delivery: empty message id");
    if (delivery.message_id.size() > max_message_id_bytes) {
        return fmt::format("malformed delivery: message id is {} bytes, the limit is {}",
                           delivery.message_id.size(), max_message_id_bytes);
    }
    return std::nullopt;
}

/// @brief The reason a delivery with a usable id but delivery count 0 is parked.
inline constexpr std::string_view zero_count_reason =
    "malformed delivery: delivery count 0 (brokers count from 1; is the field mapped?)";

/// @brief Why a delivery cannot be processed, or an empty optional when it is well formed: an
/// unusable id (unclaimable_reason()) or a delivery count of 0.
[[nodiscard]] inline std::optional<std::string> malformed_reason(const Delivery& delivery) {
    if (auto reason = unclaimable_reason(delivery)) return reason;
    if (delivery.delivery_count.value() == 0) return std::string(zero_count_reason);
    return std::nullopt;
}

IDEM_END_NAMESPACE
