#pragma once
/// @file
/// @brief What the handler tells about a delivery once its outcome is final: the counters, the
/// observer (Reporter), and the text of an exception put into a reason, through the policy's
/// redaction hook (quoted, failure_outcome).

#include <chrono>
#include <exception>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/effect.hpp"
#include "idem/error.hpp"
#include "idem/handler/timing.hpp"
#include "idem/observer.hpp"
#include "idem/outcome.hpp"
#include "idem/policy.hpp"

IDEM_BEGIN_NAMESPACE
namespace detail {

/// @p text through the policy's redaction hook: it may quote the payload, and reasons reach
/// dead letters, stored outcomes and every observer. A hook that throws withholds the text.
[[nodiscard]] inline std::string quoted(const Policy& policy, std::string_view text) {
    if (policy.options().redact_payload == nullptr) return std::string(text);
    try {
        return policy.redact(text);
    } catch (...) {
        return "<text withheld: redact_payload threw>";
    }
}

/// The text of an exception (the effect's, the store's: a malformed_message saying what it
/// could not parse, a constraint error quoting a value) through the redaction hook.
[[nodiscard]] inline std::string quoted(const Policy& policy, const std::exception& error) {
    // redaction_failed is idem's own text (the scope, what the hook threw), never a payload.
    if (dynamic_cast<const redaction_failed*>(&error) != nullptr) return error.what();
    return quoted(policy, std::string_view(error.what()));
}

/// The failed outcome of an infrastructure error (a commit refused, the store unreachable).
[[nodiscard]] inline Outcome failure_outcome(const Policy& policy, const std::exception& error) {
    const FailureCause cause = failure_cause_of(error);
    if (cause == FailureCause::commit_failed) {
        return failed_outcome(fmt::format("commit failed: {}", quoted(policy, error)), cause);
    }
    if (cause != FailureCause::other) {
        return failed_outcome(fmt::format("store error: {}", quoted(policy, error)), cause);
    }
    return failed_outcome(fmt::format("error: {}", quoted(policy, error)), cause);
}

/// The handler's counters and its observer (none: only the counters).
class Reporter {
  public:
    explicit Reporter(Observer* observer) noexcept : observer_(observer) {}

    /// Whether an observer is set (then the handler times what it does).
    [[nodiscard]] bool observed() const noexcept { return observer_ != nullptr; }
    [[nodiscard]] Counters counters() const noexcept { return counters_.snapshot(); }

    /// Counts @p disposition and, with an observer, tells it the outcome in detail. Never
    /// throws: observing must never change an outcome.
    template <class Effect, class Body>
    void report(std::string_view scope, Effect& effect, const Delivery& delivery, const Body& body,
                const Outcome& outcome, std::chrono::nanoseconds handled_in,
                const Measure& measure) noexcept {
        counters_.count(delivery, outcome.disposition);
        if (observer_ == nullptr) return;
        try {
            OutcomeDetails details;
            details.handled_in = handled_in;
            details.effect_in = measure.effect_in;
            details.commit_in = measure.commit_in;
            details.effect_ran = measure.effect_ran;
            details.commit_refused_after_effect = outcome.disposition == Disposition::failed &&
                                                  outcome.cause == FailureCause::commit_failed &&
                                                  measure.effect_ran &&
                                                  measure.commit_in.has_value();
            std::string key;
            if constexpr (chain_has_gateway_key<Effect, Body>()) {
                if (observer_->wants_gateway_key()) {
                    try {
                        key = chain_gateway_key(effect, body);
                    } catch (...) {  // no key to show; the outcome stands
                    }
                    details.gateway_key = key;
                }
            }
            observer_->on_detailed_outcome(scope, delivery, outcome, details);
        } catch (...) {  // observing must never change an outcome
        }
    }

    /// Counts @p disposition alone (a message whose report has no observer to reach).
    void count(const Delivery& delivery, Disposition disposition) noexcept {
        counters_.count(delivery, disposition);
    }

  private:
    Observer* observer_;
    AtomicCounters counters_;
};

}  // namespace detail
IDEM_END_NAMESPACE
