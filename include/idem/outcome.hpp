#pragma once
/// @file
/// @brief What happened to a delivery (Disposition, Outcome) and what an effect may answer
/// (EffectResult).

#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"

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

/// @brief Writes the disposition's name (to_string()).
inline std::ostream& operator<<(std::ostream& out, Disposition d) {
    return out << to_string(d);
}

/// @brief Why an outcome is `failed`, as a value a consumer loop can act on (e.g. pause reading
/// while the store is unreachable: store_unreachable()).
enum class FailureCause : std::uint8_t {
    none,               ///< not failed
    effect_threw,       ///< the effect threw (an exception that is not a store error)
    store_unavailable,  ///< the store cannot be reached (connection refused or lost, I/O error)
    store_timeout,      ///< the store did not answer in time (busy or lock timeout)
    commit_failed,      ///< the commit was refused (on Redis also: the lease was lost)
    /// the commit was applied but not confirmed by enough replicas (RedisOptions::replicas_to_ack):
    /// outcome unknown, a failover may lose it
    commit_unconfirmed,
    store_error,  ///< another store error (an error reply, a failed statement)
    other,        ///< anything else (a non-store exception outside the effect)
};

/// @brief Name of a failure cause, for logs.
[[nodiscard]] constexpr std::string_view to_string(FailureCause c) noexcept {
    switch (c) {
        case FailureCause::none:
            return "none";
        case FailureCause::effect_threw:
            return "effect_threw";
        case FailureCause::store_unavailable:
            return "store_unavailable";
        case FailureCause::store_timeout:
            return "store_timeout";
        case FailureCause::commit_failed:
            return "commit_failed";
        case FailureCause::commit_unconfirmed:
            return "commit_unconfirmed";
        case FailureCause::store_error:
            return "store_error";
        case FailureCause::other:
            return "other";
    }
    return "unknown";
}

/// @brief Writes the failure cause's name (to_string()).
inline std::ostream& operator<<(std::ostream& out, FailureCause c) {
    return out << to_string(c);
}

/// @brief The cause a store or other exception stands for (commit_failed and commit_unconfirmed
/// before the classes they may also be, then store_timeout, store_unavailable, any other
/// store_error).
[[nodiscard]] inline FailureCause failure_cause_of(const std::exception& error) noexcept {
    if (dynamic_cast<const commit_unconfirmed*>(&error) != nullptr) {
        return FailureCause::commit_unconfirmed;
    }
    if (dynamic_cast<const commit_failed*>(&error) != nullptr) return FailureCause::commit_failed;
    if (dynamic_cast<const store_timeout*>(&error) != nullptr) return FailureCause::store_timeout;
    if (dynamic_cast<const store_unavailable*>(&error) != nullptr) {
        return FailureCause::store_unavailable;
    }
    if (dynamic_cast<const store_error*>(&error) != nullptr) return FailureCause::store_error;
    return FailureCause::other;
}

/// @brief How a message's effect failed before it was parked, as its store recorded it
/// (Store::note_failure()): the last failure's text and when the first and the last were.
struct NotedFailure {
    std::string text;                               ///< the last failed outcome's reason
    std::chrono::system_clock::time_point first{};  ///< when the first failure was noted
    std::chrono::system_clock::time_point last{};   ///< when the last one was
};

/// @brief The result of IdempotentHandler::handle(): a disposition and a human-readable reason.
struct Outcome {
    Disposition disposition = Disposition::failed;  ///< what happened (the contract table)
    std::string reason;                             ///< why, for logs and dead letters
    /// For a deferred outcome: how long the consumer should wait before the message comes back
    /// (e.g. the visibility timeout to set, or the delay of a requeue), when the effect says.
    /// For in_progress on a lease store (Redis): what is left of the holder's lease, the
    /// earliest a redelivery can take the claim over (unset where the store cannot tell: SQL).
    std::optional<std::chrono::milliseconds> retry_after{};
    /// For a failed outcome: why (FailureCause::none otherwise).
    FailureCause cause = FailureCause::none;
    /// For a duplicate: the outcome the earlier delivery recorded with the claim (a duplicate of
    /// a dead-lettered message must still reach the broker's dead-letter destination).
    std::optional<Disposition> recorded{};
    /// For a dead-lettered outcome: the count the handler judged the delivery by, as its
    /// DeadLetter record carries it: the store's attempt count where the store counts attempts
    /// (ClaimResult::attempts on a lease store, DeliveryCounter::store), else the broker's. A
    /// broker's dead-letter copy carries it (envelope::delivery_count).
    std::optional<std::uint32_t> delivery_count{};
    /// For a dead-lettered outcome (or a duplicate of a dead-lettered message): how its effect
    /// failed before, where the store keeps a record of it (Store::noted_failure()), as its
    /// DeadLetter record carries it; a broker's dead-letter copy carries it too.
    std::optional<NotedFailure> noted_failure{};

    /// @brief True for a failed outcome caused by a store that cannot be reached or does not
    /// answer: retrying the next message now would fail the same way, so a consumer loop pauses
    /// (and probes the store) instead of reading on.
    [[nodiscard]] constexpr bool store_unreachable() const noexcept {
        return disposition == Disposition::failed &&
               (cause == FailureCause::store_unavailable || cause == FailureCause::store_timeout);
    }
    /// @brief True for a duplicate of a message an earlier delivery dead-lettered.
    [[nodiscard]] constexpr bool duplicate_of_dead_letter() const noexcept {
        return disposition == Disposition::duplicate && recorded == Disposition::dead_lettered;
    }
};

/// @brief Whether the consumer should ack the message: should_ack() of its disposition.
[[nodiscard]] constexpr bool should_ack(const Outcome& outcome) noexcept {
    return should_ack(outcome.disposition);
}

/// @brief An Outcome for a failure, with its cause.
[[nodiscard]] inline Outcome failed_outcome(std::string reason, FailureCause cause) {
    Outcome outcome{Disposition::failed, std::move(reason)};
    outcome.cause = cause;
    return outcome;
}

/// @brief What an effect may return instead of void: applied, or a refusal as a value.
///
/// @code
/// return idem::EffectResult::rejected("payment 42 is refunded; capture is stale");
/// @endcode
class EffectResult {
  public:
    /// What the effect says: it applied the event, refused it, or it came early.
    enum class Kind { applied, rejected, deferred };

    /// The effect applied the event (what a `void` effect means).
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

    /// Applied, rejected or deferred.
    [[nodiscard]] Kind kind() const noexcept { return kind_; }
    /// Why it was rejected or deferred (empty when applied).
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

/// @cond fmt_formatters
/// @brief `fmt::format("{}", disposition)`: the disposition's name, with the string_view specs.
template <>
struct fmt::formatter<idem::Disposition> : fmt::formatter<std::string_view> {
    template <class FormatContext>
    auto format(idem::Disposition d, FormatContext& ctx) const {
        return fmt::formatter<std::string_view>::format(idem::to_string(d), ctx);
    }
};
/// @endcond

/// @cond fmt_formatters
/// @brief `fmt::format("{}", cause)`: the failure cause's name.
template <>
struct fmt::formatter<idem::FailureCause> : fmt::formatter<std::string_view> {
    template <class FormatContext>
    auto format(idem::FailureCause c, FormatContext& ctx) const {
        return fmt::formatter<std::string_view>::format(idem::to_string(c), ctx);
    }
};
/// @endcond
