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
///   - `idem_commits_refused_after_effect_total{scope}`  commits refused (commit_failed: a lost
///     lease, fencing, a failed COMMIT) after the effect had run
///   - `idem_handle_seconds{scope}`                histogram of the time handle() took
///   - `idem_effect_seconds{scope}`                histogram of the time the effect took
///   - `idem_commit_seconds{scope}`                histogram of the time the commit took
///   - `idem_circuit_open{consumer}`, `idem_pending{consumer}`, `idem_dead_letter_depth{stream}`
///     gauges a consumer loop sets (set_circuit_open(), set_pending(), set_dead_letter_depth(),
///     or all three from the consumer's own reports: health_sink())
///   - `idem_purge_duration_seconds{store}`, `idem_purge_claims_deleted{store}`,
///     `idem_purge_last_completed_timestamp_seconds{store}`  gauges of the last store.purge()
///     run, set by report_purge() (a purge that takes longer and longer cannot keep up with the
///     claims coming in: docs/alerts.yml IdemPurgeSlow, IdemPurgeNotRunning)
///   - `idem_observer_scopes_dropped_total`        outcomes not counted: more scopes than
///     PrometheusOptions::max_scopes
///
/// What idem can and cannot count: "effects applied twice" cannot be known by the library (an
/// effect that reached the outside world and then lost its transaction leaves no trace idem can
/// see). What it counts is the nearest observable: `idem_commits_refused_after_effect_total`, a
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

#include "idem/broker/consumer_health.hpp"
#include "idem/config.hpp"
#include "idem/contract/records.hpp"
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
    /// Bounds of idem_effect_seconds (same rules); empty: `buckets`.
    std::vector<double> effect_buckets{};
    /// Bounds of idem_commit_seconds (same rules); empty: `buckets`.
    std::vector<double> commit_buckets{};
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

/// @brief Which of a PrometheusObserver's histograms (bucket_counts(), buckets()).
enum class PrometheusHistogram : std::uint8_t {
    handle,  ///< idem_handle_seconds
    effect,  ///< idem_effect_seconds
    commit,  ///< idem_commit_seconds
};

/// @brief An Observer keeping Prometheus counters and latency histograms per scope; share one
/// between many handlers and threads. See the file's documentation for the metrics.
class PrometheusObserver final : public Observer {
  public:
    /// @brief An observer with no series yet; histograms with @p options' buckets (the effect's and
    /// commit's default to the handle's when empty).
    /// @throws usage_error when max_scopes is 0, or a bucket list is not finite, positive and
    /// ascending.
    explicit PrometheusObserver(PrometheusOptions options = {})
        : bounds_{Bounds(std::move(options.buckets)),
                  options.effect_buckets.empty() ? Bounds{}
                                                 : Bounds(std::move(options.effect_buckets)),
                  options.commit_buckets.empty() ? Bounds{}
                                                 : Bounds(std::move(options.commit_buckets))},
          max_scopes_(options.max_scopes) {
        if (bounds_[1].seconds.empty()) bounds_[1] = bounds_[0];
        if (bounds_[2].seconds.empty()) bounds_[2] = bounds_[0];
        if (max_scopes_ == 0) throw usage_error("idem::PrometheusObserver: max_scopes is 0");
        std::size_t capacity = 1;
        while (capacity < 2 * max_scopes_)
            capacity *= 2;  // at most half full: short probes
        mask_ = capacity - 1;
        slots_ = std::make_unique<std::atomic<Series*>[]>(capacity);
        for (std::size_t i = 0; i < capacity; ++i)
            slots_[i].store(nullptr, std::memory_order_relaxed);
    }
    PrometheusObserver(const PrometheusObserver&) = delete;
    PrometheusObserver& operator=(const PrometheusObserver&) = delete;
    PrometheusObserver(PrometheusObserver&&) = delete;
    PrometheusObserver& operator=(PrometheusObserver&&) = delete;
    ~PrometheusObserver() override = default;

    /// Counts the outcome without a duration (the histograms are not touched).
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
        observe(*s, PrometheusHistogram::handle, handled_in);
    }

    /// on_timed_outcome(), the effect's and the commit's durations in idem_effect_seconds and
    /// idem_commit_seconds when they happened, and a commit refused after the effect in
    /// idem_commits_refused_after_effect_total.
    void on_detailed_outcome(std::string_view scope, const Delivery& delivery,
                             const Outcome& outcome, const OutcomeDetails& details) override {
        Series* s = series(scope);
        if (s == nullptr) return;
        count(*s, delivery, outcome);
        observe(*s, PrometheusHistogram::handle, details.handled_in);
        if (details.effect_in) observe(*s, PrometheusHistogram::effect, *details.effect_in);
        if (details.commit_in) observe(*s, PrometheusHistogram::commit, *details.commit_in);
        if (details.commit_refused_after_effect)
            s->refused_after_effect.fetch_add(1, std::memory_order_relaxed);
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

    /// @brief Sets the purge gauges of @p store (a name of your choice: "orders-db") from one
    /// store.purge() run that took @p took: idem_purge_duration_seconds, idem_purge_claims_deleted
    /// and idem_purge_last_completed_timestamp_seconds (now, Unix seconds). Call it after each
    /// scheduled purge:
    /// @code
    /// const auto start = std::chrono::steady_clock::now();
    /// const idem::PurgeResult purged = store.purge(std::chrono::hours(24 * 14));
    /// metrics.report_purge("orders-db", purged, std::chrono::steady_clock::now() - start);
    /// @endcode
    void report_purge(std::string_view store, const PurgeResult& result,
                      std::chrono::nanoseconds took) {
        set_gauge(purge_seconds_, store, std::chrono::duration<double>(took).count());
        set_gauge(purge_claims_, store, static_cast<double>(result.claims));
        set_gauge(purge_completed_, store,
                  std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
                      .count());
    }

    /// @brief Sets the three gauges from one consumer's report: idem_circuit_open and (when
    /// reported) idem_pending under ConsumerHealth::consumer, and (when reported)
    /// idem_dead_letter_depth under its dead_letter_destination (the consumer's name when it has
    /// none). Never throws (a gauge that cannot be stored is left as it was).
    void report_health(const ConsumerHealth& health) noexcept {
        try {
            set_circuit_open(health.consumer, health.circuit_open);
            if (health.pending) set_pending(health.consumer, *health.pending);
            if (health.dead_letter_depth) {
                set_dead_letter_depth(health.dead_letter_destination.empty()
                                          ? health.consumer
                                          : health.dead_letter_destination,
                                      *health.dead_letter_depth);
            }
        } catch (...) {  // out of memory for a label: the gauge keeps its last value
        }
    }

    /// @brief A HealthSink (broker/consumer_health.hpp) that calls report_health(): give it to a
    /// broker consumer and the gauges follow each poll. The observer must outlive the consumer.
    /// @code
    /// consumer_options.on_health = metrics.health_sink();  // broker::ConsumerOptions,
    /// idem/broker/consumer.hpp
    /// @endcode
    [[nodiscard]] HealthSink health_sink() noexcept {
        return [this](const ConsumerHealth& health) { report_health(health); };
    }

    // ---- reading back (tests, logs) ----

    /// idem_deliveries_total of @p scope and disposition @p d (0 for a scope never seen).
    [[nodiscard]] std::uint64_t deliveries(std::string_view scope, Disposition d) const {
        const Series* s = find(scope);
        return s == nullptr ? 0 : load(s->by_disposition[static_cast<std::size_t>(d)]);
    }
    /// idem_redeliveries_total of @p scope (0 for a scope never seen).
    [[nodiscard]] std::uint64_t redeliveries(std::string_view scope) const {
        const Series* s = find(scope);
        return s == nullptr ? 0 : load(s->redeliveries);
    }
    /// idem_failed_total of @p scope and @p cause (0 for a scope never seen).
    [[nodiscard]] std::uint64_t failed(std::string_view scope, FailureCause cause) const {
        const Series* s = find(scope);
        return s == nullptr ? 0 : load(s->by_cause[static_cast<std::size_t>(cause)]);
    }
    /// idem_commits_refused_after_effect_total of @p scope.
    [[nodiscard]] std::uint64_t commits_refused_after_effect(std::string_view scope) const {
        const Series* s = find(scope);
        return s == nullptr ? 0 : load(s->refused_after_effect);
    }
    /// Observations of a histogram per bucket, NOT cumulative; the last is +Inf.
    [[nodiscard]] std::vector<std::uint64_t> bucket_counts(
        std::string_view scope, PrometheusHistogram which = PrometheusHistogram::handle) const {
        const Bounds& bounds = bounds_[index(which)];
        std::vector<std::uint64_t> out(bounds.seconds.size() + 1, 0);
        if (const Series* s = find(scope)) {
            for (std::size_t i = 0; i < out.size(); ++i)
                out[i] = load(s->histograms[index(which)].buckets[i]);
        }
        return out;
    }
    /// The sum of a histogram's observations, in seconds.
    [[nodiscard]] double sum_seconds(
        std::string_view scope, PrometheusHistogram which = PrometheusHistogram::handle) const {
        const Series* s = find(scope);
        return s == nullptr ? 0.0
                            : static_cast<double>(load(s->histograms[index(which)].sum_ns)) / 1e9;
    }
    /// A histogram's upper bounds (seconds), without +Inf.
    [[nodiscard]] const std::vector<double>& buckets(
        PrometheusHistogram which = PrometheusHistogram::handle) const noexcept {
        return bounds_[index(which)].seconds;
    }
    /// idem_observer_scopes_dropped_total: outcomes not counted because max_scopes scopes were
    /// held.
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
        auto per_scope = [&](std::string_view name, std::string_view help, auto value_of) {
            head(name, "counter", help);
            for (const Series* s : all)
                out += fmt::format("{}{{scope=\"{}\"}} {}\n", name, s->label, value_of(*s));
        };
        head("idem_deliveries_total", "counter", "Deliveries handled, by outcome disposition.");
        for (const Series* s : all) {
            for (std::size_t d = 0; d < disposition_count; ++d) {
                out += fmt::format("idem_deliveries_total{{scope=\"{}\",disposition=\"{}\"}} {}\n",
                                   s->label, to_string(static_cast<Disposition>(d)),
                                   load(s->by_disposition[d]));
            }
        }
        per_scope("idem_redeliveries_total",
                  "Deliveries whose broker delivery count was greater than 1.",
                  [](const Series& s) { return load(s.redeliveries); });
        per_scope("idem_duplicates_suppressed_total",
                  "Duplicate deliveries absorbed without running the effect.", [](const Series& s) {
                      return load(s.by_disposition[index(Disposition::duplicate)]);
                  });
        per_scope("idem_dead_lettered_total", "Messages dead-lettered.", [](const Series& s) {
            return load(s.by_disposition[index(Disposition::dead_lettered)]);
        });
        head("idem_failed_total", "counter",
             "Failed outcomes (nothing stored, redelivered) by cause; commit_failed means a commit "
             "was refused.");
        for (const Series* s : all) {
            for (std::size_t c = 1; c < cause_count; ++c) {  // 0 is FailureCause::none
                out += fmt::format("idem_failed_total{{scope=\"{}\",cause=\"{}\"}} {}\n", s->label,
                                   to_string(static_cast<FailureCause>(c)), load(s->by_cause[c]));
            }
        }
        per_scope("idem_commits_refused_after_effect_total",
                  "Commits refused after the effect ran (lease lost, fencing, failed commit): an "
                  "external effect without a gateway key may have run twice.",
                  [](const Series& s) { return load(s.refused_after_effect); });
        render_histogram(out, all, PrometheusHistogram::handle, "idem_handle_seconds",
                         "Time the handler took per delivery.");
        render_histogram(out, all, PrometheusHistogram::effect, "idem_effect_seconds",
                         "Time the effect took, per delivery that ran it.");
        render_histogram(out, all, PrometheusHistogram::commit, "idem_commit_seconds",
                         "Time the commit took, per delivery it committed or refused.");
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
        render_gauge(out, "idem_purge_duration_seconds", "store",
                     "How long the last store.purge() run took.", purge_seconds_);
        render_gauge(out, "idem_purge_claims_deleted", "store",
                     "Expired claims the last store.purge() run deleted.", purge_claims_);
        render_gauge(out, "idem_purge_last_completed_timestamp_seconds", "store",
                     "When the last store.purge() run completed (Unix time).", purge_completed_);
        return out;
    }

  private:
    static constexpr std::size_t disposition_count = 7;
    static constexpr std::size_t cause_count = 8;
    static constexpr std::size_t histogram_count = 3;
    static constexpr std::size_t index(Disposition d) noexcept {
        return static_cast<std::size_t>(d);
    }
    static constexpr std::size_t index(PrometheusHistogram h) noexcept {
        return static_cast<std::size_t>(h);
    }

    /// A histogram's bounds, checked, in seconds (rendered) and nanoseconds (observed).
    struct Bounds {
        Bounds() = default;
        explicit Bounds(std::vector<double> bounds) : seconds(std::move(bounds)) {
            for (std::size_t i = 0; i < seconds.size(); ++i) {
                if (!std::isfinite(seconds[i]) || seconds[i] <= 0 ||
                    (i > 0 && seconds[i] <= seconds[i - 1])) {
                    throw usage_error(
                        "idem::PrometheusObserver: buckets must be finite, > 0 and ascending");
                }
            }
            ns.reserve(seconds.size());
            for (double b : seconds)
                ns.push_back(static_cast<std::int64_t>(std::llround(b * 1e9)));
        }
        std::vector<double> seconds;
        std::vector<std::int64_t> ns;
    };

    struct Histogram {
        std::unique_ptr<std::atomic<std::uint64_t>[]> buckets;  ///< per bucket, then +Inf
        std::atomic<std::uint64_t> sum_ns{0};
    };

    struct Series {
        Series(std::string_view name, const Bounds* bounds)
            : scope(name), label(prometheus_escape_label(name)) {
            for (std::size_t h = 0; h < histogram_count; ++h) {
                const std::size_t n = bounds[h].ns.size() + 1;
                histograms[h].buckets = std::make_unique<std::atomic<std::uint64_t>[]>(n);
                for (std::size_t i = 0; i < n; ++i)
                    histograms[h].buckets[i].store(0, std::memory_order_relaxed);
            }
        }
        const std::string scope;
        const std::string label;  ///< escaped once
        std::atomic<std::uint64_t> by_disposition[disposition_count] = {};
        std::atomic<std::uint64_t> redeliveries{0};
        std::atomic<std::uint64_t> by_cause[cause_count] = {};
        std::atomic<std::uint64_t> refused_after_effect{0};
        Histogram histograms[histogram_count];
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

    void observe(Series& s, PrometheusHistogram which, std::chrono::nanoseconds took) noexcept {
        const std::vector<std::int64_t>& bounds = bounds_[index(which)].ns;
        const std::int64_t ns = std::max<std::int64_t>(0, took.count());
        const auto bucket = static_cast<std::size_t>(
            std::lower_bound(bounds.begin(), bounds.end(), ns) - bounds.begin());
        Histogram& h = s.histograms[index(which)];
        h.buckets[bucket].fetch_add(1, std::memory_order_relaxed);
        h.sum_ns.fetch_add(static_cast<std::uint64_t>(ns), std::memory_order_relaxed);
    }

    void render_histogram(std::string& out, const std::vector<const Series*>& all,
                          PrometheusHistogram which, std::string_view name,
                          std::string_view help) const {
        const std::vector<double>& bounds = bounds_[index(which)].seconds;
        out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
        for (const Series* s : all) {
            const Histogram& h = s->histograms[index(which)];
            std::uint64_t cumulative = 0;
            for (std::size_t i = 0; i < bounds.size(); ++i) {
                cumulative += load(h.buckets[i]);
                out += fmt::format("{}_bucket{{scope=\"{}\",le=\"{}\"}} {}\n", name, s->label,
                                   bounds[i], cumulative);
            }
            cumulative += load(h.buckets[bounds.size()]);
            out += fmt::format("{}_bucket{{scope=\"{}\",le=\"+Inf\"}} {}\n", name, s->label,
                               cumulative);
            out += fmt::format("{}_sum{{scope=\"{}\"}} {}\n", name, s->label,
                               static_cast<double>(load(h.sum_ns)) / 1e9);
            // The count is the +Inf bucket as read, so the two agree under concurrent updates.
            out += fmt::format("{}_count{{scope=\"{}\"}} {}\n", name, s->label, cumulative);
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
        owned_.push_back(std::make_unique<Series>(scope, bounds_));
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

    Bounds bounds_[histogram_count];  ///< handle, effect, commit
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
    Gauges purge_seconds_;
    Gauges purge_claims_;
    Gauges purge_completed_;
};

IDEM_END_NAMESPACE
