// PrometheusObserver: counters and the latency histograms (handle, effect, commit) after real
// handle() and handle_batch() calls on a MemoryStore (faults injected for the failure causes and
// for a commit refused after the effect), the gauges set through a HealthSink, label escaping,
// exact totals under threads, and `promtool check metrics` on the rendered text (a failure in CI
// when promtool is missing; a skip elsewhere).

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <unistd.h>

#include "idem/idem.hpp"
#include "idem/observers/prometheus.hpp"
#include "idem/store/memory.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;
using idem::FailureCause;

bool contains(const std::string& text, const std::string& needle) {
    return text.find(needle) != std::string::npos;
}

struct Prometheus : ::testing::Test {
    idem::MemoryStore store;
    idem::PrometheusObserver metrics;
    bool throw_in_effect = false;
    std::chrono::milliseconds sleep{0};

    auto handler(const std::string& scope) {
        return idem::make_handler(
            store, idem::Policy{scope},
            [this](auto& tx, const std::string& body) {
                if (sleep.count() > 0) std::this_thread::sleep_for(sleep);
                if (throw_in_effect) throw std::runtime_error("gateway 502");
                tx.put("captures", body, "done");
            },
            &metrics);
    }
};

TEST_F(Prometheus, CountsPerScopeAndDisposition) {
    auto capture = handler("capture");
    auto refund = handler("refund");
    (void)capture.handle(Delivery{"a", 1u}, std::string("o"));
    (void)capture.handle(Delivery{"a", 2u}, std::string("o"));  // duplicate, redelivery
    (void)capture.handle(Delivery{"b", 3u}, std::string("o"));  // redelivery
    (void)capture.handle(Delivery{"c", 9u}, std::string("o"));  // over max_deliveries
    (void)refund.handle(Delivery{"a", 1u}, std::string("o"));

    EXPECT_EQ(metrics.deliveries("capture", Disposition::processed), 2u);
    EXPECT_EQ(metrics.deliveries("capture", Disposition::duplicate), 1u);
    EXPECT_EQ(metrics.deliveries("capture", Disposition::dead_lettered), 1u);
    EXPECT_EQ(metrics.redeliveries("capture"), 3u);
    EXPECT_EQ(metrics.deliveries("refund", Disposition::processed), 1u);
    EXPECT_EQ(metrics.redeliveries("refund"), 0u);
    EXPECT_EQ(metrics.deliveries("never-seen", Disposition::processed), 0u);

    const std::string text = metrics.render();
    EXPECT_TRUE(contains(text, "# TYPE idem_deliveries_total counter\n")) << text;
    EXPECT_TRUE(contains(text, "# HELP idem_deliveries_total ")) << text;
    EXPECT_TRUE(
        contains(text, "idem_deliveries_total{scope=\"capture\",disposition=\"processed\"} 2\n"))
        << text;
    EXPECT_TRUE(
        contains(text, "idem_deliveries_total{scope=\"capture\",disposition=\"deferred\"} 0\n"))
        << text;
    EXPECT_TRUE(contains(text, "idem_redeliveries_total{scope=\"capture\"} 3\n")) << text;
    EXPECT_TRUE(contains(text, "idem_duplicates_suppressed_total{scope=\"capture\"} 1\n")) << text;
    EXPECT_TRUE(contains(text, "idem_dead_lettered_total{scope=\"capture\"} 1\n")) << text;
    EXPECT_TRUE(
        contains(text, "idem_deliveries_total{scope=\"refund\",disposition=\"processed\"} 1\n"))
        << text;
    EXPECT_TRUE(contains(text, "idem_handle_seconds_count{scope=\"capture\"} 4\n")) << text;
}

TEST_F(Prometheus, FailedOutcomesAreCountedByCause) {
    auto capture = handler("capture");
    store.inject(idem::Fault::begin);
    (void)capture.handle(Delivery{"m-1", 1u}, std::string("o-1"));
    store.inject(idem::Fault::claim);
    (void)capture.handle(Delivery{"m-2", 1u}, std::string("o-2"));
    store.inject(idem::Fault::commit);
    (void)capture.handle(Delivery{"m-3", 1u}, std::string("o-3"));
    throw_in_effect = true;
    (void)capture.handle(Delivery{"m-4", 1u}, std::string("o-4"));

    EXPECT_EQ(metrics.deliveries("capture", Disposition::failed), 4u);
    EXPECT_EQ(metrics.failed("capture", FailureCause::store_unavailable), 2u);
    EXPECT_EQ(metrics.failed("capture", FailureCause::commit_failed), 1u);
    EXPECT_EQ(metrics.failed("capture", FailureCause::effect_threw), 1u);
    EXPECT_EQ(metrics.failed("capture", FailureCause::store_timeout), 0u);

    // Causes the memory store cannot produce, straight through the interface.
    metrics.on_outcome("capture", Delivery{"m-5", 1u},
                       idem::failed_outcome("busy", FailureCause::store_timeout));
    metrics.on_outcome("capture", Delivery{"m-6", 1u},
                       idem::failed_outcome("lease lost", FailureCause::commit_failed));
    EXPECT_EQ(metrics.failed("capture", FailureCause::store_timeout), 1u);
    EXPECT_EQ(metrics.failed("capture", FailureCause::commit_failed), 2u);

    const std::string text = metrics.render();
    EXPECT_TRUE(
        contains(text, "idem_failed_total{scope=\"capture\",cause=\"store_unavailable\"} 2\n"))
        << text;
    EXPECT_TRUE(contains(text, "idem_failed_total{scope=\"capture\",cause=\"commit_failed\"} 2\n"))
        << text;
    EXPECT_TRUE(contains(text, "idem_failed_total{scope=\"capture\",cause=\"effect_threw\"} 1\n"))
        << text;
    EXPECT_TRUE(contains(text, "idem_failed_total{scope=\"capture\",cause=\"store_timeout\"} 1\n"))
        << text;
    EXPECT_FALSE(contains(text, "cause=\"none\"")) << text;
    // on_outcome() without a duration does not touch the histogram.
    EXPECT_TRUE(contains(text, "idem_handle_seconds_count{scope=\"capture\"} 4\n")) << text;
}

TEST_F(Prometheus, HistogramBucketsSumToTheCountAndASlowEffectLandsInItsBucket) {
    auto capture = handler("capture");
    for (int i = 0; i < 5; ++i)
        (void)capture.handle(Delivery{fmt::format("fast-{}", i), 1u}, std::string("o"));
    sleep = std::chrono::milliseconds(30);
    (void)capture.handle(Delivery{"slow", 1u}, std::string("o"));

    const std::vector<double>& bounds = metrics.buckets();
    const std::vector<std::uint64_t> counts = metrics.bucket_counts("capture");
    ASSERT_EQ(counts.size(), bounds.size() + 1);
    EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), std::uint64_t{0}), 6u);
    // 30 ms (plus scheduling) is above 0.025 and, on any sane machine, below 0.25 s.
    std::uint64_t in_25ms_to_250ms = 0;
    std::uint64_t at_most_25ms = 0;
    for (std::size_t i = 0; i < bounds.size(); ++i) {
        if (bounds[i] <= 0.025) at_most_25ms += counts[i];
        if (bounds[i] > 0.025 && bounds[i] <= 0.25) in_25ms_to_250ms += counts[i];
    }
    EXPECT_EQ(in_25ms_to_250ms, 1u);
    EXPECT_EQ(at_most_25ms, 5u);

    const std::string text = metrics.render();
    EXPECT_TRUE(contains(text, "# TYPE idem_handle_seconds histogram\n")) << text;
    EXPECT_TRUE(contains(text, "idem_handle_seconds_bucket{scope=\"capture\",le=\"0.025\"} 5\n"))
        << text;
    EXPECT_TRUE(contains(text, "idem_handle_seconds_bucket{scope=\"capture\",le=\"0.25\"} 6\n"))
        << text;
    EXPECT_TRUE(contains(text, "idem_handle_seconds_bucket{scope=\"capture\",le=\"+Inf\"} 6\n"))
        << text;
    EXPECT_TRUE(contains(text, "idem_handle_seconds_count{scope=\"capture\"} 6\n")) << text;
    EXPECT_TRUE(contains(text, "idem_handle_seconds_sum{scope=\"capture\"} 0.0")) << text;
}

std::uint64_t total(const std::vector<std::uint64_t>& counts) {
    return std::accumulate(counts.begin(), counts.end(), std::uint64_t{0});
}

TEST_F(Prometheus, EffectAndCommitHistogramsCountWhatRanAndASleepingEffectLandsInItsBucket) {
    using idem::PrometheusHistogram;
    auto capture = handler("capture");
    for (int i = 0; i < 4; ++i)
        (void)capture.handle(Delivery{fmt::format("fast-{}", i), 1u}, std::string("o"));
    (void)capture.handle(Delivery{"fast-0", 2u}, std::string("o"));  // duplicate: nothing ran
    (void)capture.handle(Delivery{"poison", 9u}, std::string("o"));  // parked: commit, no effect
    sleep = std::chrono::milliseconds(30);
    (void)capture.handle(Delivery{"slow", 1u}, std::string("o"));
    sleep = std::chrono::milliseconds(0);

    const auto handle = metrics.bucket_counts("capture", PrometheusHistogram::handle);
    const auto effect = metrics.bucket_counts("capture", PrometheusHistogram::effect);
    const auto commit = metrics.bucket_counts("capture", PrometheusHistogram::commit);
    EXPECT_EQ(total(handle), 7u);  // every delivery
    EXPECT_EQ(total(effect), 5u);  // the four fast ones and the slow one
    EXPECT_EQ(total(commit), 6u);  // those five and the dead letter
    // The slow effect took at least 30 ms: above the 0.025 bucket; below 30 s on any machine.
    const std::vector<double>& bounds = metrics.buckets(PrometheusHistogram::effect);
    ASSERT_EQ(effect.size(), bounds.size() + 1);
    std::uint64_t above_25ms = 0;
    for (std::size_t i = 0; i < bounds.size(); ++i) {
        if (bounds[i] > 0.025) above_25ms += effect[i];
    }
    EXPECT_EQ(above_25ms, 1u);
    EXPECT_EQ(effect.back(), 0u);  // +Inf only
    EXPECT_GE(metrics.sum_seconds("capture", PrometheusHistogram::effect), 0.030);
    EXPECT_GE(metrics.sum_seconds("capture", PrometheusHistogram::handle),
              metrics.sum_seconds("capture", PrometheusHistogram::effect));

    // The rendered histograms: cumulative buckets ending in the count.
    const std::string text = metrics.render();
    for (const char* name : {"idem_handle_seconds", "idem_effect_seconds", "idem_commit_seconds"})
        EXPECT_TRUE(contains(text, fmt::format("# TYPE {} histogram\n", name))) << text;
    EXPECT_TRUE(contains(text, "idem_effect_seconds_bucket{scope=\"capture\",le=\"0.025\"} 4\n"))
        << text;
    EXPECT_TRUE(contains(text, "idem_effect_seconds_bucket{scope=\"capture\",le=\"+Inf\"} 5\n"))
        << text;
    EXPECT_TRUE(contains(text, "idem_effect_seconds_count{scope=\"capture\"} 5\n")) << text;
    EXPECT_TRUE(contains(text, "idem_commit_seconds_bucket{scope=\"capture\",le=\"+Inf\"} 6\n"))
        << text;
    EXPECT_TRUE(contains(text, "idem_commit_seconds_count{scope=\"capture\"} 6\n")) << text;
}

TEST_F(Prometheus, ACommitRefusedAfterTheEffectIsCountedApart) {
    auto capture = handler("capture");
    store.inject(idem::Fault::commit);  // the effect ran, then its commit was refused
    EXPECT_EQ(capture.handle(Delivery{"m-1", 1u}, std::string("o")).cause,
              FailureCause::commit_failed);
    store.inject(idem::Fault::begin);  // failed before any effect
    (void)capture.handle(Delivery{"m-2", 1u}, std::string("o"));
    throw_in_effect = true;  // the effect threw: no commit at all
    (void)capture.handle(Delivery{"m-3", 1u}, std::string("o"));
    throw_in_effect = false;
    // A commit_failed without details (on_outcome): not known to follow an effect.
    metrics.on_outcome("capture", Delivery{"m-4", 1u},
                       idem::failed_outcome("lease lost", FailureCause::commit_failed));

    EXPECT_EQ(metrics.commits_refused_after_effect("capture"), 1u);
    EXPECT_EQ(metrics.failed("capture", FailureCause::commit_failed), 2u);
    // The refused commit was timed too.
    EXPECT_EQ(total(metrics.bucket_counts("capture", idem::PrometheusHistogram::commit)), 1u);
    const std::string text = metrics.render();
    EXPECT_TRUE(contains(text, "# TYPE idem_commits_refused_after_effect_total counter\n")) << text;
    EXPECT_TRUE(contains(text, "idem_commits_refused_after_effect_total{scope=\"capture\"} 1\n"))
        << text;
}

TEST_F(Prometheus, ABatchTimesEachEffectAndSharesItsCommit) {
    using idem::PrometheusHistogram;
    auto capture = handler("capture");
    (void)capture.handle(Delivery{"a", 1u}, std::string("o"));
    const std::vector<Delivery> deliveries = {Delivery{"a", 2u}, Delivery{"b", 1u},
                                              Delivery{"c", 1u}, Delivery{"", 1u}};
    const std::vector<std::string> bodies(deliveries.size(), "o");
    const auto outcomes = capture.handle_batch(deliveries, bodies);
    ASSERT_EQ(outcomes[0].disposition, Disposition::duplicate);
    ASSERT_EQ(outcomes[3].disposition, Disposition::dead_lettered);  // empty id
    EXPECT_EQ(total(metrics.bucket_counts("capture", PrometheusHistogram::handle)), 5u);
    EXPECT_EQ(total(metrics.bucket_counts("capture", PrometheusHistogram::effect)), 3u);  // a, b, c
    // a alone, then b, c and the dead letter in the batch's one commit.
    EXPECT_EQ(total(metrics.bucket_counts("capture", PrometheusHistogram::commit)), 4u);

    store.inject(idem::Fault::commit);
    const auto refused = capture.handle_batch(
        std::vector<Delivery>{Delivery{"d", 1u}, Delivery{"e", 1u}, Delivery{"a", 3u}},
        std::vector<std::string>(3, "o"));
    for (const auto& outcome : refused)
        EXPECT_EQ(outcome.cause, FailureCause::commit_failed) << outcome.reason;
    // d and e ran their effect; the duplicate a wrote nothing the commit refused.
    EXPECT_EQ(metrics.commits_refused_after_effect("capture"), 2u);
}

TEST(PrometheusOptions, EffectAndCommitBucketsAreTheirOwnWhenGiven) {
    using idem::PrometheusHistogram;
    idem::PrometheusOptions options;
    options.buckets = {0.001, 1};
    options.commit_buckets = {0.5};
    idem::PrometheusObserver metrics{options};
    EXPECT_EQ(metrics.buckets(PrometheusHistogram::effect), (std::vector<double>{0.001, 1}));
    EXPECT_EQ(metrics.buckets(PrometheusHistogram::commit), (std::vector<double>{0.5}));
    idem::OutcomeDetails details;
    details.handled_in = std::chrono::milliseconds(700);
    details.effect_in = std::chrono::milliseconds(600);
    details.commit_in = std::chrono::milliseconds(600);
    metrics.on_detailed_outcome("s", Delivery{"m", 1u}, idem::Outcome{Disposition::processed, ""},
                                details);
    EXPECT_EQ(metrics.bucket_counts("s", PrometheusHistogram::effect),
              (std::vector<std::uint64_t>{0, 1, 0}));
    EXPECT_EQ(metrics.bucket_counts("s", PrometheusHistogram::commit),
              (std::vector<std::uint64_t>{0, 1}));
    EXPECT_TRUE(
        contains(metrics.render(), "idem_commit_seconds_bucket{scope=\"s\",le=\"0.5\"} 0\n"));
    options.effect_buckets = {2, 1};
    EXPECT_THROW(idem::PrometheusObserver{options}, idem::usage_error);
}

TEST(PrometheusHealth, TheHealthSinkSetsTheConsumerGauges) {
    idem::PrometheusObserver metrics;
    const idem::HealthSink sink = metrics.health_sink();
    idem::ConsumerHealth health;
    health.consumer = "payments/capture";
    health.pending = 12;
    health.dead_letter_destination = "payments:dead";
    health.dead_letter_depth = 3;
    health.circuit_open = true;
    sink(health);
    std::string text = metrics.render();
    EXPECT_TRUE(contains(text, "idem_circuit_open{consumer=\"payments/capture\"} 1\n")) << text;
    EXPECT_TRUE(contains(text, "idem_pending{consumer=\"payments/capture\"} 12\n")) << text;
    EXPECT_TRUE(contains(text, "idem_dead_letter_depth{stream=\"payments:dead\"} 3\n")) << text;

    // A later report: what it leaves out keeps its last value.
    idem::ConsumerHealth later;
    later.consumer = "payments/capture";
    later.pending = 0;
    sink(later);
    text = metrics.render();
    EXPECT_TRUE(contains(text, "idem_circuit_open{consumer=\"payments/capture\"} 0\n")) << text;
    EXPECT_TRUE(contains(text, "idem_pending{consumer=\"payments/capture\"} 0\n")) << text;
    EXPECT_TRUE(contains(text, "idem_dead_letter_depth{stream=\"payments:dead\"} 3\n")) << text;

    // No destination named: the depth goes under the consumer's name.
    idem::ConsumerHealth unnamed;
    unnamed.consumer = "refunds";
    unnamed.dead_letter_depth = 1;
    sink(unnamed);
    EXPECT_TRUE(contains(metrics.render(), "idem_dead_letter_depth{stream=\"refunds\"} 1\n"));
}

TEST(PrometheusOptions, CustomBucketsAndBadOnesAreRefused) {
    idem::PrometheusOptions options;
    options.buckets = {0.001, 1};
    idem::PrometheusObserver metrics{options};
    metrics.on_timed_outcome("s", Delivery{"m", 1u}, idem::Outcome{Disposition::processed, ""},
                             std::chrono::milliseconds(1));  // le is inclusive
    metrics.on_timed_outcome("s", Delivery{"n", 1u}, idem::Outcome{Disposition::processed, ""},
                             std::chrono::seconds(2));
    EXPECT_EQ(metrics.bucket_counts("s"), (std::vector<std::uint64_t>{1, 0, 1}));
    const std::string text = metrics.render();
    EXPECT_TRUE(contains(text, "idem_handle_seconds_bucket{scope=\"s\",le=\"0.001\"} 1\n")) << text;
    EXPECT_TRUE(contains(text, "idem_handle_seconds_bucket{scope=\"s\",le=\"1\"} 1\n")) << text;
    EXPECT_TRUE(contains(text, "idem_handle_seconds_sum{scope=\"s\"} 2.001\n")) << text;

    options.buckets = {1, 0.5};
    EXPECT_THROW(idem::PrometheusObserver{options}, idem::usage_error);
    options.buckets = {-1};
    EXPECT_THROW(idem::PrometheusObserver{options}, idem::usage_error);
}

TEST(PrometheusLabels, ValuesAreEscaped) {
    EXPECT_EQ(idem::prometheus_escape_label("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
    idem::PrometheusObserver metrics;
    metrics.on_outcome("we\"ird\\sc\nope", Delivery{"m", 1u},
                       idem::Outcome{Disposition::processed, ""});
    metrics.set_pending("con\"sumer", 7);
    const std::string text = metrics.render();
    EXPECT_TRUE(contains(
        text,
        "idem_deliveries_total{scope=\"we\\\"ird\\\\sc\\nope\",disposition=\"processed\"} 1\n"))
        << text;
    EXPECT_TRUE(contains(text, "idem_pending{consumer=\"con\\\"sumer\"} 7\n")) << text;
    EXPECT_EQ(metrics.deliveries("we\"ird\\sc\nope", Disposition::processed), 1u);
}

TEST(PrometheusGauges, ConsumerLoopsSetThem) {
    idem::PrometheusObserver metrics;
    EXPECT_FALSE(contains(metrics.render(), "idem_circuit_open"));
    metrics.set_circuit_open("capture-worker", true);
    metrics.set_pending("capture-worker", 12);
    metrics.set_dead_letter_depth("payments", 3);
    metrics.set_pending("capture-worker", 4);
    const std::string text = metrics.render();
    EXPECT_TRUE(contains(text, "# TYPE idem_circuit_open gauge\n")) << text;
    EXPECT_TRUE(contains(text, "idem_circuit_open{consumer=\"capture-worker\"} 1\n")) << text;
    EXPECT_TRUE(contains(text, "idem_pending{consumer=\"capture-worker\"} 4\n")) << text;
    EXPECT_TRUE(contains(text, "idem_dead_letter_depth{stream=\"payments\"} 3\n")) << text;
    metrics.set_circuit_open("capture-worker", false);
    EXPECT_TRUE(contains(metrics.render(), "idem_circuit_open{consumer=\"capture-worker\"} 0\n"));
}

TEST(PrometheusScopes, MoreThanMaxScopesAreDroppedAndCounted) {
    idem::PrometheusOptions options;
    options.max_scopes = 2;
    idem::PrometheusObserver metrics{options};
    for (const char* scope : {"a", "b", "c", "a", "d"})
        metrics.on_outcome(scope, Delivery{"m", 1u}, idem::Outcome{Disposition::processed, ""});
    EXPECT_EQ(metrics.deliveries("a", Disposition::processed), 2u);
    EXPECT_EQ(metrics.deliveries("b", Disposition::processed), 1u);
    EXPECT_EQ(metrics.deliveries("c", Disposition::processed), 0u);
    EXPECT_EQ(metrics.scopes_dropped(), 2u);
    EXPECT_TRUE(contains(metrics.render(), "idem_observer_scopes_dropped_total 2\n"));
}

TEST(PrometheusThreads, EightThreadsHammeringOneObserverGiveExactTotals) {
    constexpr int threads = 8;
    constexpr int per_thread = 2000;
    idem::MemoryStore store;
    idem::PrometheusObserver metrics;
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
        workers.emplace_back([&, t] {
            // Two scopes per thread pair, registered concurrently on first sight.
            auto h = idem::make_handler(
                store, idem::Policy{fmt::format("scope-{}", t % 4)},
                [](auto& tx, const std::string& body) { tx.put("e", body, "1"); }, &metrics);
            for (int i = 0; i < per_thread; ++i) {
                const std::string id = fmt::format("t{}-{}", t, i);
                (void)h.handle(Delivery{id, 1u}, id);
                (void)h.handle(Delivery{id, 2u}, id);  // a duplicate, a redelivery
            }
        });
    }
    for (auto& w : workers)
        w.join();
    std::uint64_t processed = 0;
    std::uint64_t duplicates = 0;
    std::uint64_t redeliveries = 0;
    std::uint64_t observed = 0;
    for (int s = 0; s < 4; ++s) {
        const std::string scope = fmt::format("scope-{}", s);
        processed += metrics.deliveries(scope, Disposition::processed);
        duplicates += metrics.deliveries(scope, Disposition::duplicate);
        redeliveries += metrics.redeliveries(scope);
        const auto counts = metrics.bucket_counts(scope);
        observed += std::accumulate(counts.begin(), counts.end(), std::uint64_t{0});
        EXPECT_EQ(metrics.deliveries(scope, Disposition::processed), 2u * per_thread);
    }
    EXPECT_EQ(processed, std::uint64_t{threads} * per_thread);
    EXPECT_EQ(duplicates, std::uint64_t{threads} * per_thread);
    EXPECT_EQ(redeliveries, std::uint64_t{threads} * per_thread);
    EXPECT_EQ(observed, 2u * std::uint64_t{threads} * per_thread);
    EXPECT_EQ(metrics.scopes_dropped(), 0u);
}

// ---- promtool ----

bool in_ci() {
    const char* ci = std::getenv("CI");
    return ci != nullptr && std::string(ci) == "true";
}

bool have_promtool() {
    return std::system("command -v promtool >/dev/null 2>&1") == 0;
}

TEST(Promtool, CheckMetricsAcceptsTheRenderedText) {
    if (!have_promtool()) {
        if (in_ci()) FAIL() << "promtool not found (Debian package prometheus; scripts/deps.sh)";
        GTEST_SKIP() << "promtool not found: install the Debian package prometheus "
                        "(scripts/deps.sh) to run this check";
    }
    idem::MemoryStore store;
    idem::PrometheusObserver metrics;
    auto h = idem::make_handler(
        store, idem::Policy{"capture"},
        [](auto& tx, const std::string& body) { tx.put("e", body, "1"); }, &metrics);
    (void)h.handle(Delivery{"a", 1u}, std::string("o"));
    (void)h.handle(Delivery{"a", 2u}, std::string("o"));
    store.inject(idem::Fault::commit);
    (void)h.handle(Delivery{"b", 1u}, std::string("o"));
    metrics.on_outcome("we\"ird\\sc\nope", Delivery{"m", 1u},
                       idem::Outcome{Disposition::processed, ""});
    metrics.set_circuit_open("capture-worker", true);
    metrics.set_pending("capture-worker", 12);
    metrics.set_dead_letter_depth("payments", 0);
    idem::ConsumerHealth health;
    health.consumer = "payments/refund";
    health.pending = 2;
    health.dead_letter_destination = "payments:dead";
    health.dead_letter_depth = 1;
    metrics.health_sink()(health);
    ASSERT_EQ(metrics.commits_refused_after_effect("capture"), 1u);
    for (const char* name : {"idem_effect_seconds_count{scope=\"capture\"} 2\n",
                             "idem_commit_seconds_count{scope=\"capture\"} 2\n"})
        ASSERT_TRUE(contains(metrics.render(), name)) << metrics.render();

    const std::string path =
        fmt::format("{}/idem-prometheus-{}.prom", ::testing::TempDir(), ::getpid());
    {
        std::ofstream out(path);
        out << metrics.render();
    }
    const std::string log = path + ".log";
    const int rc =
        std::system(fmt::format("promtool check metrics < '{}' > '{}' 2>&1", path, log).c_str());
    std::ifstream in(log);
    const std::string output((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
    EXPECT_EQ(rc, 0) << output << "\n--- rendered:\n" << metrics.render();
    EXPECT_EQ(output, "") << "promtool lint findings:\n" << output;
    std::remove(path.c_str());
    std::remove(log.c_str());
}

}  // namespace

TEST(PrometheusGauges, PurgeReportSetsThem) {
    idem::PrometheusObserver metrics;
    EXPECT_FALSE(contains(metrics.render(), "idem_purge_duration_seconds"));
    idem::PurgeResult purged;
    purged.claims = 5000;
    purged.expired_locks = 2;
    const double before =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    metrics.report_purge("orders-db", purged, std::chrono::milliseconds(1500));
    purged.claims = 12;
    metrics.report_purge("audit", purged, std::chrono::milliseconds(20));
    const std::string text = metrics.render();
    EXPECT_TRUE(contains(text, "# TYPE idem_purge_duration_seconds gauge\n")) << text;
    EXPECT_TRUE(contains(text, "idem_purge_duration_seconds{store=\"orders-db\"} 1.5\n")) << text;
    EXPECT_TRUE(contains(text, "idem_purge_duration_seconds{store=\"audit\"} 0.02\n")) << text;
    EXPECT_TRUE(contains(text, "idem_purge_claims_deleted{store=\"orders-db\"} 5000\n")) << text;
    EXPECT_TRUE(contains(text, "idem_purge_claims_deleted{store=\"audit\"} 12\n")) << text;
    const std::string key = "idem_purge_last_completed_timestamp_seconds{store=\"audit\"} ";
    const auto at = text.find(key);
    ASSERT_NE(at, std::string::npos) << text;
    const double stamp = std::stod(text.substr(at + key.size()));
    EXPECT_GE(stamp, before - 1);
    EXPECT_LE(stamp, before + 60);
}
