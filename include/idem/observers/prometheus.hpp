#pragma once
/// @file
/// @brief PrometheusObserver: idem's outcomes as Prometheus metrics, rendered by idem itself in
/// the text exposition format 0.0.4 (std and fmt only, no client library).
///
/// @code
/// idem::PrometheusObserver metrics;
/// auto handler = idem::make_handler(store, idem::Policy{"payments"}, effect, &metrics);
/// // ... serve metrics.render() at /metrics with your HTTP server of choice, or
/// auto endpoint = idem::serve_metrics(metrics, 9464);  // idem/observers/http.hpp (idem::http)
/// @endcode
///
/// Metrics (every counter per `scope`, the handler's Policy scope):
///   - `idem_deliveries_total{scope,disposition}`  every handled delivery, by its Disposition
///   - `idem_redeliveries_total{scope}`            deliveries whose broker count was > 1
///   - `idem_duplicates_suppressed_total{scope}`   duplicates absorbed (the effect did not run)
///   - `idem_dead_lettered_total{scope}`           messages parked in the dead-letter store
///   - `idem_failed_total{scope,cause}`            failed outcomes by Outcome::cause
///   - `idem_handle_seconds{scope}`                histogram of the time handle() took
///   - `idem_circuit_open{consumer}`, `idem_pending{consumer}`, `idem_dead_letter_depth{stream}`
///     gauges a consumer loop sets (set_circuit_open(), set_pending(), set_dead_letter_depth())
///   - `idem_observer_scopes_dropped_total`        outcomes not counted: more scopes than
///     PrometheusOptions::max_scopes
///
/// What idem can and cannot count: "effects applied twice" cannot be known by the library (an
/// effect that reached the outside world and then lost its transaction leaves no trace idem can
/// see). What it counts is the nearest observable: `idem_failed_total{cause="commit_failed"}`, a
/// commit refused after the effect ran (on Redis also a lost lease / fencing). Each one means an
/// external effect may have run twice if it had no gateway key. The true number is measured by
/// reconciliation against the external system, as the chaos harness does (docs/testing.md).
///
/// Lock-free hot path: a scope's series live in a fixed-capacity open-addressed table of atomic
/// pointers, probed without a lock; only the first outcome of a new scope takes a mutex to create
/// and publish its series (release store, acquire load). Series are never moved or freed while
/// the observer lives, so every later outcome is a probe plus relaxed atomic increments.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/error.hpp"
#include "idem/observer.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief Options of a PrometheusObserver.
struct PrometheusOptions {
    /// Upper bounds (seconds, ascending, finite, > 0) of idem_handle_seconds' buckets; +Inf is
    /// added. The default fits 100 µs … 30 s.
    std::vector<double> buckets = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                   0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30};
    /// How many scopes the observer keeps series for; outcomes of further scopes are counted only
    /// in idem_observer_scopes_dropped_total.
    std::size_t max_scopes = 256;
};

/// @brief A label value escaped for the text format: backslash, double quote and newline.
[[nodiscard]] inline std::string prometheus_escape_label(std::string_view value) {
    std::string out;
    out.reserve(value.size());
    for (char c : value) {
        switch (c) {
            case '\\':
                out += "\\\\";
                break;
            case '"':
                out += "\\\"";
                break;
            case '\n':
                out += "\\n";
                break;
            default:
                out += c;
        }
    }
    return out;
}

/// @brief An Observer keeping Prometheus counters and a latency histogram per scope; share one
/// between many handlers and threads. See the file's documentation for the metrics.
class PrometheusObserver final : public Observer {
  public:
    explicit PrometheusObserver(PrometheusOptions options = {})
        : buckets_(std::move(options.buckets)), max_scopes_(options.max_scopes) {
        for (std::size_t i = 0; i < buckets_.size(); ++i) {
            if (!std::isfinite(buckets_[i]) || buckets_[i] <= 0 ||
                (i > 0 && buckets_[i] <= buckets_[i - 1])) {
                throw usage_error(
                    "idem::PrometheusObserver: buckets must be finite, > 0 and ascending");
            }
        }
        if (max_scopes_ == 0) throw usage_error("idem::PrometheusObserver: max_scopes is 0");
        std::size_t capacity = 1;
        while (capacity < 2 * max_scopes_)
            capacity *= 2;  // at most half full: short probes
        mask_ = capacity - 1;
        slots_ = std::make_unique<std::atomic<Series*>[]>(capacity);
        for (std::size_t i = 0; i < capacity; ++i)
            slots_[i].store(nullptr, std::memory_order_relaxed);
        bounds_ns_.reserve(buckets_.size());
        for (double b : buckets_)
            bounds_ns_.push_back(static_cast<std::int64_t>(std::llround(b * 1e9)));
    }
    PrometheusObserver(const PrometheusObserver&) = delete;
    PrometheusObserver& operator=(const PrometheusObserver&) = delete;
    PrometheusObserver(PrometheusObserver&&) = delete;
    PrometheusObserver& operator=(PrometheusObserver&&) = delete;
    ~PrometheusObserver() override = default;

    /// Counts the outcome without a duration (the histogram is not touched).
    void on_outcome(std::string_view scope, const Delivery& delivery,
                    const Outcome& outcome) override {
        if (Series* s = series(scope)) count(*s, delivery, outcome);
    }

    /// Counts the outcome and observes @p handled_in in idem_handle_seconds.
    void on_timed_outcome(std::string_view scope, const Delivery& delivery, const Outcome& outcome,
                          std::chrono::nanoseconds handled_in) override {
        Series* s = series(scope);
        if (s == nullptr) return;
        count(*s, delivery, outcome);
        const std::int64_t ns = std::max<std::int64_t>(0, handled_in.count());
        const auto bucket = static_cast<std::size_t>(
            std::lower_bound(bounds_ns_.begin(), bounds_ns_.end(), ns) - bounds_ns_.begin());
        s->buckets[bucket].fetch_add(1, std::memory_order_relaxed);
        s->sum_ns.fetch_add(static_cast<std::uint64_t>(ns), std::memory_order_relaxed);
    }

    // ---- gauges a consumer loop sets (not the hot path: a mutex) ----

    /// idem_circuit_open{consumer}: 1 while the consumer's circuit breaker is open.
    void set_circuit_open(std::string_view consumer, bool open) {
        set_gauge(circuit_open_, consumer, open ? 1.0 : 0.0);
    }
    /// idem_pending{consumer}: messages delivered to the consumer and not yet acked (e.g. the
    /// count XPENDING reports for it).
    void set_pending(std::string_view consumer, std::uint64_t pending) {
        set_gauge(pending_, consumer, static_cast<double>(pending));
    }
    /// idem_dead_letter_depth{stream}: messages in the dead-letter destination of @p stream.
    void set_dead_letter_depth(std::string_view stream, std::uint64_t depth) {
        set_gauge(dead_letter_depth_, stream, static_cast<double>(depth));
    }

    // ---- reading back (tests, logs) ----

    [[nodiscard]] std::uint64_t deliveries(std::string_view scope, Disposition d) const {
        const Series* s = find(scope);
        return s == nullptr ? 0 : load(s->by_disposition[static_cast<std::size_t>(d)]);
    }
    [[nodiscard]] std::uint64_t redeliveries(std::string_view scope) const {
        const Series* s = find(scope);
        return s == nullptr ? 0 : load(s->redeliveries);
    }
    [[nodiscard]] std::uint64_t failed(std::string_view scope, FailureCause cause) const {
        const Series* s = find(scope);
        return s == nullptr ? 0 : load(s->by_cause[static_cast<std::size_t>(cause)]);
    }
    /// Observations of idem_handle_seconds per bucket, NOT cumulative; the last is +Inf.
    [[nodiscard]] std::vector<std::uint64_t> bucket_counts(std::string_view scope) const {
        std::vector<std::uint64_t> out(buckets_.size() + 1, 0);
        if (const Series* s = find(scope)) {
            for (std::size_t i = 0; i < out.size(); ++i)
                out[i] = load(s->buckets[i]);
        }
        return out;
    }
    [[nodiscard]] const std::vector<double>& buckets() const noexcept { return buckets_; }
    [[nodiscard]] std::uint64_t scopes_dropped() const noexcept { return load(dropped_); }

    /// @brief Every metric in the Prometheus text exposition format 0.0.4 (serve it with
    /// `Content-Type: text/plain; version=0.0.4`).
    [[nodiscard]] std::string render() const {
        std::vector<const Series*> all;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            for (const auto& s : owned_)
                all.push_back(s.get());
        }
        std::sort(all.begin(), all.end(),
                  [](const Series* a, const Series* b) { return a->scope < b->scope; });

        std::string out;
        auto head = [&out](std::string_view name, std::string_view type, std::string_view help) {
            out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
        };
        head("idem_deliveries_total", "counter", "Deliveries handled, by outcome disposition.");
        for (const Series* s : all) {
            for (std::size_t d = 0; d < disposition_count; ++d) {
                out += fmt::format("idem_deliveries_total{{scope=\"{}\",disposition=\"{}\"}} {}\n",
                                   s->label, to_string(static_cast<Disposition>(d)),
                                   load(s->by_disposition[d]));
            }
        }
        head("idem_redeliveries_total", "counter",
             "Deliveries whose broker delivery count was greater than 1.");
        for (const Series* s : all)
            out += fmt::format("idem_redeliveries_total{{scope=\"{}\"}} {}\n", s->label,
                               load(s->redeliveries));
        head("idem_duplicates_suppressed_total", "counter",
             "Duplicate deliveries absorbed without running the effect.");
        for (const Series* s : all)
            out += fmt::format("idem_duplicates_suppressed_total{{scope=\"{}\"}} {}\n", s->label,
                               load(s->by_disposition[index(Disposition::duplicate)]));
        head("idem_dead_lettered_total", "counter", "Messages dead-lettered.");
        for (const Series* s : all)
            out += fmt::format("idem_dead_lettered_total{{scope=\"{}\"}} {}\n", s->label,
                               load(s->by_disposition[index(Disposition::dead_lettered)]));
        head("idem_failed_total", "counter",
             "Failed outcomes (nothing stored, redelivered) by cause; commit_failed means a commit "
             "was refused after the effect ran.");
        for (const Series* s : all) {
            for (std::size_t c = 1; c < cause_count; ++c) {  // 0 is FailureCause::none
                out += fmt::format("idem_failed_total{{scope=\"{}\",cause=\"{}\"}} {}\n", s->label,
                                   to_string(static_cast<FailureCause>(c)), load(s->by_cause[c]));
            }
        }
        head("idem_handle_seconds", "histogram", "Time the handler took per delivery.");
        for (const Series* s : all) {
            std::uint64_t cumulative = 0;
            for (std::size_t i = 0; i < buckets_.size(); ++i) {
                cumulative += load(s->buckets[i]);
                out += fmt::format("idem_handle_seconds_bucket{{scope=\"{}\",le=\"{}\"}} {}\n",
                                   s->label, buckets_[i], cumulative);
            }
            cumulative += load(s->buckets[buckets_.size()]);
            out += fmt::format("idem_handle_seconds_bucket{{scope=\"{}\",le=\"+Inf\"}} {}\n",
                               s->label, cumulative);
            out += fmt::format("idem_handle_seconds_sum{{scope=\"{}\"}} {}\n", s->label,
                               static_cast<double>(load(s->sum_ns)) / 1e9);
            // The count is the +Inf bucket as read, so the two agree under concurrent updates.
            out +=
                fmt::format("idem_handle_seconds_count{{scope=\"{}\"}} {}\n", s->label, cumulative);
        }
        head("idem_observer_scopes_dropped_total", "counter",
             "Outcomes not counted because the observer already holds max_scopes scopes.");
        out += fmt::format("idem_observer_scopes_dropped_total {}\n", load(dropped_));

        std::lock_guard<std::mutex> lock(gauge_mutex_);
        render_gauge(out, "idem_circuit_open", "consumer",
                     "1 while the consumer's circuit breaker is open.", circuit_open_);
        render_gauge(out, "idem_pending", "consumer",
                     "Messages delivered to the consumer and not yet acknowledged.", pending_);
        render_gauge(out, "idem_dead_letter_depth", "stream",
                     "Messages in the stream's dead-letter destination.", dead_letter_depth_);
        return out;
    }

  private:
    static constexpr std::size_t disposition_count = 7;
    static constexpr std::size_t cause_count = 8;
    static constexpr std::size_t index(Disposition d) noexcept {
        return static_cast<std::size_t>(d);
    }

    struct Series {
        Series(std::string_view name, std::size_t bucket_count)
            : scope(name),
              label(prometheus_escape_label(name)),
              buckets(std::make_unique<std::atomic<std::uint64_t>[]>(bucket_count)) {
            for (std::size_t i = 0; i < bucket_count; ++i)
                buckets[i].store(0, std::memory_order_relaxed);
        }
        const std::string scope;
        const std::string label;  ///< escaped once
        std::atomic<std::uint64_t> by_disposition[disposition_count] = {};
        std::atomic<std::uint64_t> redeliveries{0};
        std::atomic<std::uint64_t> by_cause[cause_count] = {};
        std::unique_ptr<std::atomic<std::uint64_t>[]> buckets;  ///< per bucket, then +Inf
        std::atomic<std::uint64_t> sum_ns{0};
    };

    static std::uint64_t load(const std::atomic<std::uint64_t>& a) noexcept {
        return a.load(std::memory_order_relaxed);
    }

    static void count(Series& s, const Delivery& delivery, const Outcome& outcome) noexcept {
        s.by_disposition[index(outcome.disposition)].fetch_add(1, std::memory_order_relaxed);
        if (delivery.delivery_count.value() > 1)
            s.redeliveries.fetch_add(1, std::memory_order_relaxed);
        if (outcome.disposition == Disposition::failed) {
            const FailureCause cause =
                outcome.cause == FailureCause::none ? FailureCause::other : outcome.cause;
            s.by_cause[static_cast<std::size_t>(cause)].fetch_add(1, std::memory_order_relaxed);
        }
    }

    /// The lock-free probe: the series of @p scope, or nullptr when it has none yet.
    [[nodiscard]] Series* find(std::string_view scope) const noexcept {
        std::size_t i = std::hash<std::string_view>{}(scope)&mask_;
        for (std::size_t probes = 0; probes <= mask_; ++probes, i = (i + 1) & mask_) {
            Series* s = slots_[i].load(std::memory_order_acquire);
            if (s == nullptr) return nullptr;
            if (s->scope == scope) return s;
        }
        return nullptr;
    }

    /// find(), or registers the scope (under the mutex, first sight only).
    Series* series(std::string_view scope) {
        if (Series* s = find(scope)) return s;
        std::lock_guard<std::mutex> lock(mutex_);
        if (Series* s = find(scope)) return s;  // registered meanwhile
        if (owned_.size() >= max_scopes_) {
            dropped_.fetch_add(1, std::memory_order_relaxed);
            return nullptr;
        }
        owned_.push_back(std::make_unique<Series>(scope, buckets_.size() + 1));
        Series* created = owned_.back().get();
        std::size_t i = std::hash<std::string_view>{}(scope)&mask_;
        while (slots_[i].load(std::memory_order_relaxed) != nullptr)
            i = (i + 1) & mask_;  // the table is at most half full: a free slot exists
        slots_[i].store(created, std::memory_order_release);
        return created;
    }

    using Gauges = std::map<std::string, double, std::less<>>;
    void set_gauge(Gauges& gauges, std::string_view label, double value) {
        std::lock_guard<std::mutex> lock(gauge_mutex_);
        auto it = gauges.find(label);
        if (it == gauges.end()) {
            gauges.emplace(std::string(label), value);
        } else {
            it->second = value;
        }
    }
    static void render_gauge(std::string& out, std::string_view name, std::string_view label,
                             std::string_view help, const Gauges& gauges) {
        if (gauges.empty()) return;
        out += fmt::format("# HELP {} {}\n# TYPE {} gauge\n", name, help, name);
        for (const auto& [key, value] : gauges)
            out += fmt::format("{}{{{}=\"{}\"}} {}\n", name, label, prometheus_escape_label(key),
                               value);
    }

    const std::vector<double> buckets_;
    std::vector<std::int64_t> bounds_ns_;  ///< buckets_ in ns, for the lock-free observe
    const std::size_t max_scopes_;
    std::size_t mask_ = 0;
    std::unique_ptr<std::atomic<Series*>[]> slots_;
    mutable std::mutex mutex_;                    ///< registration and render's list
    std::vector<std::unique_ptr<Series>> owned_;  ///< never shrinks: published pointers stay valid
    std::atomic<std::uint64_t> dropped_{0};
    mutable std::mutex gauge_mutex_;
    Gauges circuit_open_;
    Gauges pending_;
    Gauges dead_letter_depth_;
};

IDEM_END_NAMESPACE
