#pragma once
/// @file
/// @brief What the broker tells us about one delivery of a message.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The broker's delivery count for one delivery (1 on the first delivery).
///
/// A distinct type rather than an integer so that it cannot be passed to idem::key(): a key
/// derived from the retry counter changes on every redelivery, which is the original bug.
class DeliveryCount {
  public:
    constexpr DeliveryCount() noexcept = default;
    // Implicit on purpose: `Delivery{msg.id(), msg.delivery_count()}` must read naturally.
    constexpr DeliveryCount(std::uint32_t count) noexcept : count_(count) {}  // NOLINT
    [[nodiscard]] constexpr std::uint32_t value() const noexcept { return count_; }
    friend constexpr bool operator==(DeliveryCount a, DeliveryCount b) noexcept {
        return a.count_ == b.count_;
    }
    friend constexpr bool operator!=(DeliveryCount a, DeliveryCount b) noexcept {
        return a.count_ != b.count_;
    }

  private:
    std::uint32_t count_ = 1;
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
    DeliveryCount delivery_count{1};
    /// When the broker accepted the message, if it says.
    std::optional<std::chrono::system_clock::time_point> enqueued_at{};
};

/// Longest message id accepted; longer ids are dead-lettered as malformed.
inline constexpr std::size_t max_message_id_bytes = 512;

/// @brief Why a delivery cannot be processed, or an empty optional when it is well formed.
[[nodiscard]] inline std::optional<std::string> malformed_reason(const Delivery& delivery) {
    if (delivery.message_id.empty()) return std::string("malformed delivery: empty message id");
    if (delivery.message_id.size() > max_message_id_bytes) {
        return fmt::format("malformed delivery: message id is {} bytes, the limit is {}",
                           delivery.message_id.size(), max_message_id_bytes);
    }
    if (delivery.delivery_count.value() == 0) {
        return std::string(
            "malformed delivery: delivery count 0 (brokers count from 1; is the field mapped?)");
    }
    return std::nullopt;
}

IDEM_END_NAMESPACE
