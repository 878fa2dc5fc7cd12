#pragma once
/// @file
/// @brief What happened to a delivery (Disposition, Outcome) and what an effect may answer
/// (EffectResult).

#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief What the handler did with one delivery. See should_ack() for which ones ack.
enum class Disposition {
    processed,      ///< new id, effect applied, committed
    duplicate,      ///< the id was already claimed by a finished run
    dead_lettered,  ///< poison limit reached or malformed: parked with its reason
    rejected,       ///< the effect refused a stale or impossible transition
    deferred,       ///< the effect says the event came early; redeliver later
    in_progress,    ///< another live worker holds the claim
    failed,         ///< effect threw, commit failed, store unreachable: nothing stored
};

/// @brief Name of a disposition, as stored and logged.
[[nodiscard]] constexpr std::string_view to_string(Disposition d) noexcept {
    switch (d) {
        case Disposition::processed:
            return "processed";
        case Disposition::duplicate:
            return "duplicate";
        case Disposition::dead_lettered:
            return "dead_lettered";
        case Disposition::rejected:
            return "rejected";
        case Disposition::deferred:
            return "deferred";
        case Disposition::in_progress:
            return "in_progress";
        case Disposition::failed:
            return "failed";
    }
    return "unknown";
}

/// @brief Parses a stored disposition name; returns false on an unknown name.
[[nodiscard]] constexpr bool from_string(std::string_view name, Disposition& out) noexcept {
    constexpr Disposition all[] = {Disposition::processed,     Disposition::duplicate,
                                   Disposition::dead_lettered, Disposition::rejected,
                                   Disposition::deferred,      Disposition::in_progress,
                                   Disposition::failed};
    for (Disposition d : all) {
        if (to_string(d) == name) {
            out = d;
            return true;
        }
    }
    return false;
}

/// @brief True when the consumer loop should acknowledge the message to the broker.
///
/// Ack means "never deliver this again": only for outcomes whose result is durably stored
/// (processed, duplicate, dead_lettered, rejected). deferred, in_progress and failed must be
/// redelivered.
[[nodiscard]] constexpr bool should_ack(Disposition d) noexcept {
    switch (d) {
        case Disposition::processed:
        case Disposition::duplicate:
        case Disposition::dead_lettered:
        case Disposition::rejected:
            return true;
        case Disposition::deferred:
        case Disposition::in_progress:
        case Disposition::failed:
            return false;
    }
    return false;
}

/// @brief The result of IdempotentHandler::handle(): a disposition and a human-readable reason.
struct Outcome {
    Disposition disposition = Disposition::failed;
    std::string reason;
    /// For a deferred outcome: how long the consumer should wait before the message comes back
    /// (e.g. the visibility timeout to set, or the delay of a requeue), when the effect says.
    std::optional<std::chrono::milliseconds> retry_after{};
};

[[nodiscard]] constexpr bool should_ack(const Outcome& outcome) noexcept {
    return should_ack(outcome.disposition);
}

/// @brief What an effect may return instead of void: applied, or a refusal as a value.
///
/// @code
/// return idem::EffectResult::rejected("payment 42 is refunded; capture is stale");
/// @endcode
class EffectResult {
  public:
    enum class Kind { applied, rejected, deferred };

    [[nodiscard]] static EffectResult applied() { return EffectResult(Kind::applied, {}); }
    /// The event must not be applied (stale or impossible). Acked; the claim records it.
    [[nodiscard]] static EffectResult rejected(std::string reason) {
        return EffectResult(Kind::rejected, std::move(reason));
    }
    /// The event came early (its predecessor has not arrived). Not acked; nothing is stored,
    /// the broker redelivers and the delivery-count limit bounds the wait.
    [[nodiscard]] static EffectResult deferred(
        std::string reason, std::optional<std::chrono::milliseconds> retry_after = std::nullopt) {
        EffectResult result(Kind::deferred, std::move(reason));
        result.retry_after_ = retry_after;
        return result;
    }

    [[nodiscard]] Kind kind() const noexcept { return kind_; }
    [[nodiscard]] const std::string& reason() const noexcept { return reason_; }
    /// For deferred: the delay the effect asks for before the next delivery, if any.
    [[nodiscard]] std::optional<std::chrono::milliseconds> retry_after() const noexcept {
        return retry_after_;
    }

  private:
    EffectResult(Kind kind, std::string reason) : kind_(kind), reason_(std::move(reason)) {}
    Kind kind_;
    std::string reason_;
    std::optional<std::chrono::milliseconds> retry_after_{};
};

IDEM_END_NAMESPACE
