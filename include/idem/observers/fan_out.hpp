#pragma once
/// @file
/// @brief FanOutObserver: several observers on one handler (e.g. a PrometheusObserver and a
/// LoggingObserver), each receiving every outcome with everything the handler measured.
///
/// @code
/// idem::PrometheusObserver metrics;
/// idem::LoggingObserver logs(idem::function_logger(...));
/// idem::FanOutObserver both{&metrics, &logs};
/// auto handler = idem::make_handler(store, policy, effect, &both);
/// @endcode

#include <chrono>
#include <initializer_list>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/error.hpp"
#include "idem/observer.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief An Observer that forwards every call to each of its observers, in the order given.
///
/// It does not own them: each must outlive the handlers using the fan-out. An observer that
/// throws is skipped for that call; the others still receive it (and the outcome is unchanged,
/// as for any observer). The list is fixed at construction, so the fan-out is thread-safe
/// whenever its observers are.
class FanOutObserver final : public Observer {
  public:
    /// @throws usage_error when an observer is null or is this fan-out itself.
    FanOutObserver(std::initializer_list<Observer*> observers)
        : FanOutObserver(std::vector<Observer*>(observers)) {}

    /// @throws usage_error when an observer is null or is this fan-out itself.
    explicit FanOutObserver(std::vector<Observer*> observers) : observers_(std::move(observers)) {
        for (const Observer* o : observers_) {
            if (o == nullptr) throw usage_error("idem::FanOutObserver: an observer is null");
            if (o == this) throw usage_error("idem::FanOutObserver: cannot contain itself");
        }
    }

    void on_outcome(std::string_view scope, const Delivery& delivery,
                    const Outcome& outcome) override {
        for (Observer* o : observers_) {
            try {
                o->on_outcome(scope, delivery, outcome);
            } catch (...) {  // one observer's failure is not the others'
            }
        }
    }

    void on_timed_outcome(std::string_view scope, const Delivery& delivery, const Outcome& outcome,
                          std::chrono::nanoseconds handled_in) override {
        for (Observer* o : observers_) {
            try {
                o->on_timed_outcome(scope, delivery, outcome, handled_in);
            } catch (...) {
            }
        }
    }

    void on_detailed_outcome(std::string_view scope, const Delivery& delivery,
                             const Outcome& outcome, const OutcomeDetails& details) override {
        for (Observer* o : observers_) {
            try {
                o->on_detailed_outcome(scope, delivery, outcome, details);
            } catch (...) {
            }
        }
    }

    /// True when any of its observers wants the gateway key now (a logger's level may change).
    [[nodiscard]] bool wants_gateway_key() const override {
        for (const Observer* o : observers_) {
            try {
                if (o->wants_gateway_key()) return true;
            } catch (...) {
            }
        }
        return false;
    }

    /// @brief The observers told, in order (not owned).
    [[nodiscard]] const std::vector<Observer*>& observers() const noexcept { return observers_; }

  private:
    std::vector<Observer*> observers_;
};

IDEM_END_NAMESPACE
