#pragma once
/// @file
/// @brief What an outcome does at the broker (namespace idem::broker): ack it, send it to the
/// dead-letter destination and then ack it, or leave it to be delivered again after a delay.
/// settlement_of() is the one place that decides it, for the consumer's own settling and for
/// the accounting of a delivery the store's commit settled. Core header: no client library.

#include <chrono>
#include <cstdint>
#include <optional>

#include "idem/broker/redelivery_backoff.hpp"
#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE
namespace broker {

/// @brief What a consumer does with a delivery once the handler returned.
struct Settlement {
    /// @brief The three things a consumer can do with a delivery.
    enum class Kind : std::uint8_t {
        ack,                   ///< settle it: never deliver it again
        dead_letter_then_ack,  ///< send it to the dead-letter destination, confirmed, then ack
        redeliver,             ///< leave it (or give it back) to be delivered again
    };
    /// What is done with the delivery.
    Kind kind = Kind::redeliver;
    /// For redeliver: how long the delivery should wait before it comes again. Nothing: the
    /// broker's own clock (the visibility timeout). A broker that can only redeliver on its
    /// own clock (Redis Streams: the next take-over) ignores it.
    std::optional<std::chrono::milliseconds> delay{};

    /// @brief True when the delivery is acked (after its dead letter, if any): it is not delivered
    /// again.
    [[nodiscard]] constexpr bool acks() const noexcept { return kind != Kind::redeliver; }
};

/// @brief How the settlement is decided besides the outcome: the consumer's options.
struct SettlementRules {
    /// The delay of a failed outcome (and a deferred one without its own retry_after), by the
    /// delivery count of the next delivery. off(): no delay (the broker's clock).
    const RedeliveryBackoff* redelivery_backoff = nullptr;
    /// The delay of an in_progress outcome without a retry_after; nothing: the broker's clock.
    std::optional<std::chrono::milliseconds> in_progress_delay{};
    /// True when the store's commit publishes a dead letter in the same atomic step as it parks
    /// it (a RedisStore taking the stream's commit hook): a duplicate of a dead-lettered
    /// message then has its dead letter already and is acked plainly.
    bool commit_publishes_dead_letters = false;
};

/// @brief What @p outcome of @p delivery does at the broker.
///
/// - processed, rejected, duplicate: ack.
/// - dead_lettered: dead_letter_then_ack. So is a duplicate of a message an earlier delivery
///   dead-lettered, unless rules.commit_publishes_dead_letters: a crash between the commit
///   that parked it and the consumer's dead-letter publish would otherwise lose the letter.
/// - failed, deferred, in_progress: redeliver, with the delay the outcome asks for (retry_after
///   of a deferred effect, or an in_progress claim's remaining lease), else
///   rules.in_progress_delay for in_progress, else the redelivery backoff of the next delivery.
[[nodiscard]] inline Settlement settlement_of(const Outcome& outcome, const Delivery& delivery,
                                              const SettlementRules& rules) noexcept {
    using Kind = Settlement::Kind;
    if (should_ack(outcome)) {
        const bool dead_letter =
            outcome.disposition == Disposition::dead_lettered ||
            (!rules.commit_publishes_dead_letters && outcome.duplicate_of_dead_letter());
        return Settlement{dead_letter ? Kind::dead_letter_then_ack : Kind::ack, std::nullopt};
    }
    Settlement settlement{Kind::redeliver, std::nullopt};
    if (outcome.disposition != Disposition::failed) settlement.delay = outcome.retry_after;
    if (settlement.delay) return settlement;
    if (outcome.disposition == Disposition::in_progress) {
        settlement.delay = rules.in_progress_delay;
    } else if (rules.redelivery_backoff != nullptr && !rules.redelivery_backoff->off()) {
        settlement.delay = rules.redelivery_backoff->before(delivery.delivery_count.value() + 1,
                                                            delivery.message_id);
    }
    return settlement;
}

/// @brief @p delivery as the adapter settles it: a dead letter carries the count the handler
/// judged (Outcome::delivery_count: the store's attempts where the store counts them, as its
/// DeadLetter record has it), so every broker's envelope (envelope::delivery_count) says the
/// same; any other outcome keeps the broker's count.
[[nodiscard]] inline Delivery as_judged(Delivery delivery, const Outcome& outcome) {
    if (outcome.disposition == Disposition::dead_lettered && outcome.delivery_count)
        delivery.delivery_count = *outcome.delivery_count;
    return delivery;
}

}  // namespace broker
IDEM_END_NAMESPACE
