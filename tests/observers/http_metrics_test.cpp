// idem::serve_metrics (idem/observers/http.hpp): GET /metrics serves PrometheusObserver::render()
// with the 0.0.4 content type, its address forms and errors, and a real Prometheus server
// (testing/prometheus_server.hpp) scraping it until its HTTP API reports the handler's counts.
// No prometheus binary: a skip, a failure in CI (CI=true).

#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "idem/idem.hpp"
#include "idem/observers/http.hpp"
#include "idem/observers/prometheus.hpp"
#include "idem/store/memory.hpp"
#include "idem/testing/prometheus_server.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;

/// @p processed new messages, then @p duplicates redeliveries of the first ones, through a real
/// handler over a MemoryStore.
void feed(idem::PrometheusObserver& metrics, unsigned processed, unsigned duplicates) {
    idem::MemoryStore store;
    auto h = idem::make_handler(
        store, idem::Policy{"capture"},
        [](auto& tx, const std::string& body) { tx.put("e", body, "1"); }, &metrics);
    for (unsigned i = 0; i < processed; ++i)
        ASSERT_EQ(h.handle(Delivery{fmt::format("m{}", i), 1u}, fmt::format("o{}", i)).disposition,
                  Disposition::processed);
    for (unsigned i = 0; i < duplicates; ++i) {
        const unsigned m = i % processed;
        ASSERT_EQ(h.handle(Delivery{fmt::format("m{}", m), 2u}, fmt::format("o{}", m)).disposition,
                  Disposition::duplicate);
    }
}

TEST(HttpMetrics, ServesRenderAtMetricsWithTheTextFormatContentType) {
    idem::PrometheusObserver metrics;
    feed(metrics, 3u, 2u);
    auto endpoint = idem::serve_metrics(metrics, 0);
    ASSERT_GT(endpoint.port(), 0);
    EXPECT_EQ(endpoint.host(), "127.0.0.1");
    EXPECT_EQ(endpoint.url(), fmt::format("http://127.0.0.1:{}/metrics", endpoint.port()));

    httplib::Client client("127.0.0.1", endpoint.port());
    const auto res = client.Get("/metrics");
    ASSERT_TRUE(res) << httplib::to_string(res.error());
    EXPECT_EQ(res->status, 200);
    EXPECT_EQ(res->get_header_value("Content-Type"), "text/plain; version=0.0.4");
    EXPECT_EQ(res->body, metrics.render());
    EXPECT_NE(
        res->body.find("idem_deliveries_total{scope=\"capture\",disposition=\"processed\"} 3"),
        std::string::npos);

    const auto other = client.Get("/");
    ASSERT_TRUE(other);
    EXPECT_EQ(other->status, 404);
}

TEST(HttpMetrics, EveryScrapeRendersTheCountsOfNow) {
    idem::PrometheusObserver metrics;
    auto endpoint = idem::serve_metrics(metrics, "127.0.0.1:0");
    httplib::Client client("127.0.0.1", endpoint.port());
    const std::string line = "idem_duplicates_suppressed_total{scope=\"capture\"} 4\n";
    auto before = client.Get("/metrics");
    ASSERT_TRUE(before);
    EXPECT_EQ(before->body.find(line), std::string::npos);
    feed(metrics, 5u, 4u);
    auto after = client.Get("/metrics");
    ASSERT_TRUE(after);
    EXPECT_NE(after->body.find(line), std::string::npos) << after->body;
}

TEST(HttpMetrics, AddressFormsAndErrors) {
    idem::PrometheusObserver metrics;
    {
        auto endpoint = idem::serve_metrics(metrics, "0");  // a port alone: 127.0.0.1
        EXPECT_EQ(endpoint.host(), "127.0.0.1");
        EXPECT_GT(endpoint.port(), 0);
        // The port is taken: an error, not a silent endpoint that never serves.
        EXPECT_THROW((void)idem::serve_metrics(metrics, endpoint.port()), idem::error);
        EXPECT_THROW(
            (void)idem::serve_metrics(metrics, fmt::format("127.0.0.1:{}", endpoint.port())),
            idem::error);
    }
    for (const char* bad : {"", ":", "127.0.0.1:", ":80", "host:port", "127.0.0.1:65536",
                            "127.0.0.1:-1", "127.0.0.1:123456"}) {
        EXPECT_THROW((void)idem::serve_metrics(metrics, bad), idem::usage_error) << bad;
    }
    EXPECT_THROW((void)idem::serve_metrics(metrics, -1), idem::usage_error);
    EXPECT_THROW((void)idem::serve_metrics(metrics, 70000), idem::usage_error);
}

TEST(HttpMetrics, DestroyedRightAfterConstructionStopsCleanly) {
    idem::PrometheusObserver metrics;
    for (int i = 0; i < 50; ++i) {
        auto endpoint = idem::serve_metrics(metrics, 0);
        (void)endpoint;
    }
}

// ---- a real Prometheus server scraping the endpoint ----

TEST(HttpMetricsScrape, PrometheusScrapesTheHandlerCounts) {
    std::string why;
    if (!idem::testing::PrometheusServer::available(&why)) {
        if (idem::testing::running_in_ci()) FAIL() << "prometheus is required in CI: " << why;
        GTEST_SKIP() << "prometheus not available (set CI=true to make this a failure): " << why;
    }
    constexpr unsigned processed = 7u;
    constexpr unsigned duplicates = 3u;
    idem::PrometheusObserver metrics;
    feed(metrics, processed, duplicates);
    auto endpoint = idem::serve_metrics(metrics, 0);

    std::optional<idem::testing::PrometheusServer> server;
    server.emplace(std::vector<std::string>{fmt::format("127.0.0.1:{}", endpoint.port())});
    auto& prometheus = *server;
    const std::string processed_query =
        "idem_deliveries_total{job=\"idem\",scope=\"capture\",disposition=\"processed\"}";
    const std::string duplicates_query =
        "idem_duplicates_suppressed_total{job=\"idem\",scope=\"capture\"}";
    std::optional<double> seen_processed;
    std::optional<double> seen_duplicates;
    const auto started = std::chrono::steady_clock::now();
    const auto deadline = started + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < deadline) {
        seen_processed = prometheus.query_value(processed_query);
        seen_duplicates = prometheus.query_value(duplicates_query);
        if (seen_processed == double{processed} && seen_duplicates == double{duplicates}) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    ASSERT_TRUE(seen_processed.has_value()) << "never scraped: " << prometheus.log_tail();
    EXPECT_EQ(*seen_processed, double{processed});
    ASSERT_TRUE(seen_duplicates.has_value()) << prometheus.log_tail();
    EXPECT_EQ(*seen_duplicates, double{duplicates});
    EXPECT_EQ(prometheus.query_value("up{job=\"idem\"}"), 1.0);  // the scrape itself was healthy
    std::printf("scraped after %lld ms\n",
                static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                           std::chrono::steady_clock::now() - started)
                                           .count()));

    // Stopped by pid (SIGTERM, SIGKILL after the grace period), then its dir is removed.
    const pid_t pid = prometheus.pid();
    const auto dir = prometheus.dir();
    prometheus.stop();
    EXPECT_TRUE(idem::testing::process_gone(pid));
    server.reset();
    EXPECT_FALSE(std::filesystem::exists(dir)) << dir;
}

}  // namespace
