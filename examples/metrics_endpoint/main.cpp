// metrics_endpoint: a consumer loop whose PrometheusObserver is served at GET /metrics
// (idem::serve_metrics, component idem::http).
//
// The loop handles --messages payment captures over a MemoryStore; the broker redelivers every
// third one (a lost ack), which idem absorbs as a duplicate. The endpoint listens on
// 127.0.0.1:--port (default 0: a free port). The example scrapes itself once, checks the page
// says what the observer counted, and with --serve-seconds S keeps serving for S seconds (point
// Prometheus or curl at it). The last line is one JSON object; the exit status is non-zero when
// the scrape disagrees with the counts.
//
//   metrics_endpoint [--messages N] [--port P] [--serve-seconds S]

#include <httplib.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "idem/idem.hpp"
#include "idem/observers/http.hpp"
#include "idem/observers/prometheus.hpp"
#include "idem/store/memory.hpp"

namespace {

struct Args {
    unsigned messages = 300;
    int port = 0;
    int serve_seconds = 0;
};

Args parse(int argc, char** argv) {
    Args a;
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string flag = argv[i];
        const long value = std::strtol(argv[i + 1], nullptr, 10);
        if (flag == "--messages") {
            a.messages = static_cast<unsigned>(value);
        } else if (flag == "--port") {
            a.port = static_cast<int>(value);
        } else if (flag == "--serve-seconds") {
            a.serve_seconds = static_cast<int>(value);
        } else {
            std::fprintf(stderr, "metrics_endpoint: unknown flag %s\n", flag.c_str());
            std::exit(2);
        }
    }
    return a;
}

}  // namespace

int main(int argc, char** argv) {
    const Args args = parse(argc, argv);

    idem::PrometheusObserver metrics;
    auto endpoint = idem::serve_metrics(metrics, args.port);
    std::fprintf(stderr, "metrics_endpoint: serving %s\n", endpoint.url().c_str());

    idem::MemoryStore store;
    long captured_cents = 0;
    auto capture = idem::make_handler(
        store, idem::Policy{"capture"},
        [&captured_cents](auto& tx, const std::string& body) {
            captured_cents += std::strtol(body.c_str(), nullptr, 10);
            tx.put("capture", body, "captured");
        },
        &metrics);

    // The consumer loop: every third message is delivered twice (the first ack was lost).
    unsigned redelivered = 0;
    for (unsigned i = 0; i < args.messages; ++i) {
        const std::string id = fmt::format("msg-{}", i);
        const std::string body = fmt::format("{}", 100 + i);
        (void)capture.handle(idem::Delivery{id, 1u}, body);
        if (i % 3 == 0) {
            (void)capture.handle(idem::Delivery{id, 2u}, body);
            ++redelivered;
        }
    }
    metrics.set_pending("capture-worker", 0);

    // Scrape ourselves, as Prometheus would.
    httplib::Client client("127.0.0.1", endpoint.port());
    const auto res = client.Get("/metrics");
    const std::string page = res ? res->body : std::string();
    const std::string processed_line = fmt::format(
        "idem_deliveries_total{{scope=\"capture\",disposition=\"processed\"}} {}\n", args.messages);
    const std::string duplicates_line =
        fmt::format("idem_duplicates_suppressed_total{{scope=\"capture\"}} {}\n", redelivered);
    const bool agrees = res && res->status == 200 &&
                        res->get_header_value("Content-Type") == "text/plain; version=0.0.4" &&
                        page.find(processed_line) != std::string::npos &&
                        page.find(duplicates_line) != std::string::npos;

    if (args.serve_seconds > 0)
        std::this_thread::sleep_for(std::chrono::seconds(args.serve_seconds));

    std::printf(
        "{\"messages\":%u,\"redelivered\":%u,\"processed\":%llu,\"duplicates\":%llu,"
        "\"port\":%d,\"scrape_bytes\":%zu,\"scrape_agrees\":%s}\n",
        args.messages, redelivered,
        static_cast<unsigned long long>(
            metrics.deliveries("capture", idem::Disposition::processed)),
        static_cast<unsigned long long>(
            metrics.deliveries("capture", idem::Disposition::duplicate)),
        endpoint.port(), page.size(), agrees ? "true" : "false");
    return agrees ? 0 : 1;
}
