#pragma once
/// @file
/// @brief Policy: what a handler's claims are scoped to, and the limits that keep them safe.

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"

IDEM_BEGIN_NAMESPACE

/// A duration in days, for retention and redelivery windows (C++17 has no std::chrono::days).
using days = std::chrono::duration<std::int64_t, std::ratio<86400>>;

/// @brief The tunable numbers of a Policy. Defaults: 5 deliveries, claims kept 14 days against
/// a broker that redelivers for 7.
///
/// @code
/// idem::PolicyOptions options;            // C++20: idem::Policy{"capture", {.max_deliveries = 3}}
/// options.max_deliveries = 3;
/// idem::Policy policy{"capture-payment", options};
/// @endcode
struct PolicyOptions {
    /// A delivery whose broker count reaches this is dead-lettered without running the effect.
    std::uint32_t max_deliveries = 5;
    /// How long a claim is kept; purge() removes older ones.
    std::chrono::seconds retention = days(14);
    /// The longest time the broker may still redeliver a message after first delivering it.
    std::chrono::seconds redelivery_window = days(7);
    /// How long the gateway remembers an idempotency key (24 h is common), if the effect calls
    /// one. A message enqueued longer ago than this is not sent blindly: the key no longer
    /// protects it, so it is dead-lettered for reconciliation (or given to the effect's
    /// reconcile callback, see reconcile.hpp). Needs Delivery::enqueued_at.
    std::optional<std::chrono::seconds> gateway_key_lifetime{};
    /// Lease stores (Redis): how long a claim is held before another worker may take it over
    /// (a crashed holder's message waits this long). Unset: the store's default lease.
    std::optional<std::chrono::milliseconds> lease{};
    /// The broker's visibility timeout: how long an unacked message stays with its consumer
    /// before it is redelivered (Redis Streams' XCLAIM min-idle, SQS's VisibilityTimeout).
    /// When set, a lease longer than it is refused. Choose it above the handler's p99 and the
    /// lease equal to it or just under (docs/redis.md).
    std::optional<std::chrono::milliseconds> visibility_timeout{};
    /// Applied to the payload bytes of every dead letter before it is stored (text and typed
    /// bodies alike): what failed-job storage keeps must not hold a card number. Empty: kept as
    /// they are. `idem::mask_card_numbers` (payload.hpp) masks 13-19 digit runs to their last 4.
    /// If it throws, nothing is stored and the outcome is `failed` (not acked); see
    /// `docs/contract.md`, "Payloads in dead letters". Also reachable as Policy::redact(). Called
    /// from every thread the handler runs on: it must be thread-safe if the handler is shared.
    std::function<std::string(std::string_view payload)> redact_payload{};
};

/// @brief Thrown by Policy::redact() when the policy's redact_payload hook throws: the payload
/// could not be made safe to keep, so it is not kept anywhere. The handler turns it into
/// `failed` (nothing stored, not acked).
class redaction_failed : public error {
  public:
    using error::error;
};

/// Longest scope accepted; a scope is a handler name, not data.
inline constexpr std::size_t max_scope_bytes = 128;

/// @brief The scope of a handler's claims and its limits, validated at construction.
///
/// @throws usage_error when the scope is empty or too long, max_deliveries is 0, or the
/// retention is not longer than the redelivery window (a late redelivery would find its claim
/// purged and run the effect again).
class Policy {
  public:
    /// @brief The policy of the handlers of @p scope (claims are kept per scope and message id);
    /// what it refuses: the class's @c throws.
    explicit Policy(std::string scope, PolicyOptions options = {})
        : scope_(std::move(scope)), options_(options) {
        if (scope_.empty()) {
            throw usage_error(
                "idem::Policy: the scope is empty; name the handler (e.g. \"capture-payment\") "
                "so its claims do not collide with another handler's");
        }
        if (scope_.size() > max_scope_bytes) {
            throw usage_error(fmt::format("idem::Policy: the scope is {} bytes, the limit is {}",
                                          scope_.size(), max_scope_bytes));
        }
        if (options_.max_deliveries == 0) {
            throw usage_error(fmt::format(
                "idem::Policy(\"{}\"): max_deliveries is 0, so no delivery could ever run; use "
                "at least 1 (default 5)",
                scope_));
        }
        if (options_.redelivery_window.count() <= 0) {
            throw usage_error(fmt::format(
                "idem::Policy(\"{}\"): redelivery_window must be positive (the broker's longest "
                "redelivery delay, e.g. 7 days)",
                scope_));
        }
        if (options_.gateway_key_lifetime && options_.gateway_key_lifetime->count() <= 0) {
            throw usage_error(fmt::format(
                "idem::Policy(\"{}\"): gateway_key_lifetime must be positive (e.g. 24 hours) or "
                "left unset",
                scope_));
        }
        if (options_.lease && options_.lease->count() <= 0) {
            throw usage_error(fmt::format(
                "idem::Policy(\"{}\"): lease must be positive (e.g. the broker's visibility "
                "timeout) or left unset",
                scope_));
        }
        if (options_.visibility_timeout && options_.visibility_timeout->count() <= 0) {
            throw usage_error(fmt::format(
                "idem::Policy(\"{}\"): visibility_timeout must be positive or left unset", scope_));
        }
        if (options_.lease && options_.visibility_timeout) {
            check_lease_fits(*options_.lease);
        }
        if (options_.retention <= options_.redelivery_window) {
            throw usage_error(fmt::format(
                "idem::Policy(\"{}\"): retention ({}s) must be longer than the broker's "
                "redelivery window ({}s): a redelivery arriving after its claim was purged would "
                "run the effect again. Raise retention (e.g. 14 days against a 7-day window) or "
                "set redelivery_window to the broker's real maximum.",
                scope_, options_.retention.count(), options_.redelivery_window.count()));
        }
    }

    /// The scope the claims are taken in.
    [[nodiscard]] const std::string& scope() const noexcept { return scope_; }
    /// PolicyOptions::max_deliveries.
    [[nodiscard]] std::uint32_t max_deliveries() const noexcept { return options_.max_deliveries; }
    /// PolicyOptions::retention.
    [[nodiscard]] std::chrono::seconds retention() const noexcept { return options_.retention; }
    /// PolicyOptions::redelivery_window.
    [[nodiscard]] std::chrono::seconds redelivery_window() const noexcept {
        return options_.redelivery_window;
    }
    /// PolicyOptions::gateway_key_lifetime.
    [[nodiscard]] std::optional<std::chrono::seconds> gateway_key_lifetime() const noexcept {
        return options_.gateway_key_lifetime;
    }
    /// PolicyOptions::lease.
    [[nodiscard]] std::optional<std::chrono::milliseconds> lease() const noexcept {
        return options_.lease;
    }
    /// PolicyOptions::visibility_timeout.
    [[nodiscard]] std::optional<std::chrono::milliseconds> visibility_timeout() const noexcept {
        return options_.visibility_timeout;
    }
    /// All the options.
    [[nodiscard]] const PolicyOptions& options() const noexcept { return options_; }

    /// @brief The payload as it may be kept outside the message itself (dead letters; logs):
    /// through PolicyOptions::redact_payload, or unchanged when there is none.
    /// @throws redaction_failed when the hook throws anything, naming the scope.
    [[nodiscard]] std::string redact(std::string_view payload) const {
        if (!options_.redact_payload) return std::string(payload);
        try {
            return options_.redact_payload(payload);
        } catch (const std::exception& e) {
            throw redaction_failed(fmt::format(
                "idem::Policy(\"{}\"): redact_payload threw: {}; the payload was not kept", scope_,
                e.what()));
        } catch (...) {
            throw redaction_failed(fmt::format(
                "idem::Policy(\"{}\"): redact_payload threw a non-standard exception; the "
                "payload was not kept",
                scope_));
        }
    }

    /// @brief Refuses a lease longer than the broker's visibility timeout, when one is set.
    /// Called with the policy's own lease, and by lease stores and consumers with the lease they
    /// will really use.
    /// @throws usage_error naming both durations.
    void check_lease_fits(std::chrono::milliseconds lease) const {
        if (!options_.visibility_timeout || lease <= *options_.visibility_timeout) return;
        throw usage_error(fmt::format(
            "idem::Policy(\"{}\"): the lease ({} ms) is longer than the broker's visibility "
            "timeout ({} ms): a worker that dies holding the lease would block its message across "
            "redeliveries. Make the visibility timeout longer than the handler's p99 and the "
            "lease equal to it or just under.",
            scope_, lease.count(), options_.visibility_timeout->count()));
    }

  private:
    std::string scope_;
    PolicyOptions options_;
};

IDEM_END_NAMESPACE
