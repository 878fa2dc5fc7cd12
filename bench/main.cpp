// idem_bench: idem against the same writes issued by hand, one JSON object per line on stdout
// (progress on stderr). Run through scripts/bench.sh, which builds it in Release.
//
//   idem_bench [--quick] [--filter REGEX] [--rounds N] [--min-time SECONDS] [--no-pin] [--cpu N]
//              [--e2e-messages N] [--rss-messages N] [--keep]
//   idem_bench --profile NAME [--messages N]     (for callgrind; see --help)
//   idem_bench --list

#include <benchmark/benchmark.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
#include <optional>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "bench.hpp"

namespace {

using idem_bench::config;

const char* const usage_text =
    "usage: idem_bench [options]\n"
    "  --quick              a fast smoke run: 2 rounds, short samples, 100,000-message RSS run\n"
    "  --filter REGEX       only the benches whose name matches (e.g. 'sqlite|memory')\n"
    "  --rounds N           idem/raw pairs per case (default 7; the median of each is reported)\n"
    "  --min-time SECONDS   length of one Google Benchmark sample (default 0.5)\n"
    "  --no-pin             do not pin client and servers to one CPU for the round-trip cases\n"
    "  --cpu N              the CPU to pin to (default 0)\n"
    "  --e2e-messages N     stream entries per end-to-end sample (default 4000; PostgreSQL half)\n"
    "  --rss-messages N     messages of the RSS run (default 1000000, sampled every tenth)\n"
    "  --keep               keep the temp dir with the SQLite files\n"
    "  --retained-10m       the <store>_retained cases also fill 10,000,000 claims (minutes)\n"
    "  --scale-messages N   messages per sample of the retained and purge cases (20000)\n"
    "  --sqlite-pragma P    run PRAGMA P on each SQLite store of those cases (repeatable)\n"
    "Opt-in cases (run only when --filter names them): <store>_retained_1m, _10m,\n"
    "  <store>_purge_under_load, <store>_workers, rss_flat_<store> (sqlite, postgres, mysql,\n"
    "  redis; rss_flat_memory too), redis_expiry_under_load,\n"
    "  postgres_partitioned_purge_under_load, mysql_partitioned_purge_under_load,\n"
    "  e.g. --filter 'retained|purge|expiry|workers|rss_flat_'\n"
    "  --profile NAME       run one side of a case for --messages N (default 20000) and exit,\n"
    "                       for valgrind --tool=callgrind --toggle-collect='*profiled_loop*':\n"
    "                       memory_single, memory_observed, sqlite_single, sqlite_batch,\n"
    "                       redis_single, postgres_single (idem) or memory_single_raw,\n"
    "                       sqlite_single_raw, sqlite_batch_raw (the raw twins)\n"
    "  --list               print the bench names and exit\n";

const std::vector<std::string> bench_names{"rss_flat",
                                           "memory_single",
                                           "memory_observed",
                                           "sqlite_single",
                                           "sqlite_batch",
                                           "postgres_single",
                                           "postgres_statement_costs (with postgres_single)",
                                           "postgres_batch",
                                           "mysql_single",
                                           "mysql_batch",
                                           "redis_single",
                                           "redis_batch",
                                           "redis_single_write",
                                           "redis_single_local",
                                           "redis_stream_pipelined",
                                           "redis_stream_consumer",
                                           "redis_loop_local_one_step",
                                           "redis_loop_local_pipelined",
                                           "redis_replicas_to_ack",
                                           "redis_server_time (with redis_*)",
                                           "redis_cluster_single",
                                           "redis_cluster_batch",
                                           "e2e_stream_sqlite",
                                           "e2e_stream_postgres",
                                           "e2e_rabbitmq_sqlite (with idem::rabbitmq)",
                                           "e2e_nats_sqlite (built with the nats component)",
                                           "e2e_kafka_sqlite (built with the kafka component)",
                                           "e2e_kafka_postgres (built with the kafka component)",
                                           "<store>_retained_1m, _10m (opt-in: --filter)",
                                           "<store>_purge_under_load (opt-in: --filter)",
                                           "redis_expiry_under_load (opt-in: --filter)",
                                           "<store>_workers (opt-in: --filter)",
                                           "rss_flat_<store> (opt-in: --filter)"};

[[noreturn]] void usage(int status) {
    std::fputs(usage_text, status == 0 ? stdout : stderr);
    std::exit(status);
}

std::size_t count_arg(const char* text) {
    char* end = nullptr;
    const unsigned long long value = std::strtoull(text, &end, 10);
    if (end == text || *end != '\0') usage(2);
    return static_cast<std::size_t>(value);
}

/// Runs one group of cases; an exception becomes an error line, and the run goes on.
void guarded(const char* group, const std::function<void()>& run) {
    try {
        run();
    } catch (const std::exception& e) {
        idem_bench::emit(idem_bench::Json().str("bench", group).str("error", e.what()));
    }
}

}  // namespace

int main(int argc, char** argv) {
    auto& cfg = config();
    std::string profile;
    std::size_t profile_messages = 20'000;
    bool keep = false;
    std::optional<std::size_t> e2e_messages;
    std::optional<std::size_t> rss_messages;
    std::optional<std::size_t> scale_messages;
    std::optional<int> rounds;
    std::optional<double> min_time;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        auto value = [&]() -> const char* {
            if (i + 1 >= argc) usage(2);
            return argv[++i];
        };
        if (arg == "--quick") {
            cfg.quick = true;
        } else if (arg == "--filter") {
            cfg.filter_text = value();
            cfg.filter.emplace(cfg.filter_text);
        } else if (arg == "--rounds") {
            rounds = static_cast<int>(count_arg(value()));
            if (*rounds < 1) usage(2);
        } else if (arg == "--min-time") {
            min_time = std::atof(value());
            if (*min_time <= 0) usage(2);
        } else if (arg == "--no-pin") {
            cfg.pin = false;
        } else if (arg == "--cpu") {
            cfg.cpu = static_cast<int>(count_arg(value()));
        } else if (arg == "--e2e-messages") {
            e2e_messages = count_arg(value());
        } else if (arg == "--rss-messages") {
            rss_messages = count_arg(value());
        } else if (arg == "--retained-10m") {
            cfg.retained_10m = true;
        } else if (arg == "--sqlite-pragma") {
            cfg.sqlite_pragmas.push_back(value());
        } else if (arg == "--scale-messages") {
            scale_messages = std::max<std::size_t>(count_arg(value()), 100);
        } else if (arg == "--keep") {
            keep = true;
        } else if (arg == "--profile") {
            profile = value();
        } else if (arg == "--messages") {
            profile_messages = count_arg(value());
        } else if (arg == "--list") {
            for (const auto& name : bench_names)
                std::puts(name.c_str());
            return 0;
        } else if (arg == "-h" || arg == "--help") {
            usage(0);
        } else {
            std::fprintf(stderr, "idem_bench: unknown argument '%s'\n", arg.c_str());
            usage(2);
        }
    }
    if (cfg.quick) {
        cfg.rounds = 2;
        cfg.min_time = 0.1;
        cfg.e2e_messages = 1000;
        cfg.e2e_pg_messages = 500;
        cfg.rss_messages = 100'000;
        cfg.scale_messages = 2000;
    }
    if (scale_messages) cfg.scale_messages = *scale_messages;
    if (rounds) cfg.rounds = *rounds;
    if (min_time) cfg.min_time = *min_time;
    if (e2e_messages) {
        cfg.e2e_messages = *e2e_messages;
        cfg.e2e_pg_messages = std::max<std::size_t>(*e2e_messages / 2, 1);
    }
    if (rss_messages) cfg.rss_messages = *rss_messages;
    cfg.rss_messages = std::max<std::size_t>(cfg.rss_messages / idem_bench::batch_size, 1) *
                       idem_bench::batch_size;
    cfg.rss_every = std::max<std::size_t>(cfg.rss_messages / 10 / idem_bench::batch_size, 1) *
                    idem_bench::batch_size;

    // SQLite files on disk (TMPDIR or /tmp), like an application's database.
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern =
        (std::filesystem::path(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") / "idem-bench-XXXXXX")
            .string();
    if (::mkdtemp(pattern.data()) == nullptr) {
        std::perror("idem_bench: mkdtemp");
        return 1;
    }
    cfg.sqlite_dir = pattern;
    struct RemoveDir {
        bool keep;
        ~RemoveDir() {
            std::error_code ec;
            if (keep) {
                idem_bench::note("kept " + config().sqlite_dir.string());
            } else {
                std::filesystem::remove_all(config().sqlite_dir, ec);
            }
        }
    } remove_dir{keep};

    int gb_argc = 1;
    benchmark::Initialize(&gb_argc, argv);

    if (!profile.empty()) return idem_bench::run_profile(profile, profile_messages);
#ifdef IDEM_BENCH_WITH_KAFKA
    idem_bench::prepare_kafka_cluster();
#endif

    const auto start = std::chrono::steady_clock::now();
    // The RSS run first: nothing allocated and freed by other cases hides its growth.
    guarded("rss_flat", idem_bench::run_rss_case);
    guarded("memory", idem_bench::run_memory_cases);
    guarded("memory_observed", idem_bench::run_observer_cases);
    guarded("sqlite", idem_bench::run_sqlite_cases);
    guarded("postgres", idem_bench::run_postgres_cases);
    guarded("mysql", idem_bench::run_mysql_cases);
    guarded("redis", idem_bench::run_redis_cases);
    guarded("redis_cluster", idem_bench::run_redis_cluster_cases);
    guarded("e2e", idem_bench::run_e2e_cases);
#ifdef IDEM_BENCH_WITH_RABBITMQ
    guarded("e2e_rabbitmq", idem_bench::run_rabbitmq_cases);
#endif
#ifdef IDEM_BENCH_WITH_NATS
    guarded("e2e_nats", idem_bench::run_e2e_nats_cases);
#endif
#ifdef IDEM_BENCH_WITH_KAFKA
    guarded("e2e_kafka", idem_bench::run_e2e_kafka_cases);
#endif
    guarded("scale", idem_bench::run_scale_cases);
    idem_bench::note(fmt::format(
        "done in {:.0f} s",
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()));
    return 0;
}
