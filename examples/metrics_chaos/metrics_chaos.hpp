// metrics_chaos: what the consumer (main.cpp) and the Prometheus check (prometheus_check.cpp)
// share: the arguments, the numbers the consumer prints and how the check reads them back.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include <fmt/format.h>

namespace metrics_chaos {

struct Args {
    unsigned messages = 400;
    unsigned workers = 3;
    std::uint64_t seed = 15;
    int port = 0;
    int pace_ms = 0;
    int serve_seconds = 0;
    bool check_with_prometheus = false;
};

inline Args parse(int argc, char** argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        const std::string flag = argv[i];
        if (flag == "--check-with-prometheus") {
            a.check_with_prometheus = true;
            continue;
        }
        if (i + 1 >= argc) {
            std::fprintf(stderr, "metrics_chaos: %s needs a value\n", flag.c_str());
            std::exit(2);
        }
        const long long value = std::strtoll(argv[++i], nullptr, 10);
        if (flag == "--messages") {
            a.messages = static_cast<unsigned>(value);
        } else if (flag == "--workers") {
            a.workers = static_cast<unsigned>(value);
        } else if (flag == "--seed") {
            a.seed = static_cast<std::uint64_t>(value);
        } else if (flag == "--port") {
            a.port = static_cast<int>(value);
        } else if (flag == "--pace-ms") {
            a.pace_ms = static_cast<int>(value);
        } else if (flag == "--serve-seconds") {
            a.serve_seconds = static_cast<int>(value);
        } else {
            std::fprintf(stderr, "metrics_chaos: unknown flag %s\n", flag.c_str());
            std::exit(2);
        }
    }
    if (a.messages == 0 || a.workers == 0) {
        std::fprintf(stderr, "metrics_chaos: --messages and --workers must be > 0\n");
        std::exit(2);
    }
    return a;
}

/// What the consumer counted (the observer's numbers, and what the workers saw).
struct Tally {
    std::uint64_t deliveries = 0;  ///< handle() calls
    std::uint64_t crashes = 0;     ///< simulated worker crashes (before handling, before the ack)
    std::uint64_t processed = 0;
    std::uint64_t duplicates = 0;
    std::uint64_t failed = 0;
    std::uint64_t refused_after_effect = 0;
    std::uint64_t redeliveries = 0;
};

/// The consumer's last line: one JSON object.
inline std::string summary_json(const Args& args, const Tally& t, unsigned long gateway_calls,
                                std::size_t gateway_charges, unsigned long repeated_gateway_calls,
                                unsigned long divergences, int port, double seconds) {
    return fmt::format(
        "{{\"messages\":{},\"workers\":{},\"seed\":{},\"deliveries\":{},\"crashes\":{},"
        "\"processed\":{},\"duplicates\":{},\"failed\":{},\"redeliveries\":{},"
        "\"commits_refused_after_effect\":{},\"gateway_calls\":{},\"gateway_charges\":{},"
        "\"repeated_gateway_calls\":{},\"divergences\":{},\"port\":{},\"seconds\":{:.3f}}}",
        args.messages, args.workers, args.seed, t.deliveries, t.crashes, t.processed, t.duplicates,
        t.failed, t.redeliveries, t.refused_after_effect, gateway_calls, gateway_charges,
        repeated_gateway_calls, divergences, port, seconds);
}

/// The number after `"field":` in a JSON line like summary_json()'s, if there is one.
inline std::optional<std::uint64_t> json_number(const std::string& line, const std::string& field) {
    const std::string tag = "\"" + field + "\":";
    const auto at = line.find(tag);
    if (at == std::string::npos) return std::nullopt;
    char* end = nullptr;
    const char* begin = line.c_str() + at + tag.size();
    const unsigned long long value = std::strtoull(begin, &end, 10);
    if (end == begin) return std::nullopt;
    return static_cast<std::uint64_t>(value);
}

/// The --check-with-prometheus run (prometheus_check.cpp).
int check_with_prometheus(const Args& args);

}  // namespace metrics_chaos
