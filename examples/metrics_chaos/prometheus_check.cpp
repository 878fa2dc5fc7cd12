// metrics_chaos --check-with-prometheus: runs the consumer (this same program) as a child process,
// starts a real Prometheus (idem::testing::PrometheusServer: a temp dir, a free loopback port,
// scrape_interval 1 s) scraping it while the chaos workload runs, reads the numbers the consumer
// printed, and checks that Prometheus' query API (/api/v1/query) returns the same ones.

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "idem/testing/process.hpp"
#include "idem/testing/prometheus_server.hpp"

#include "metrics_chaos.hpp"

extern char** environ;

namespace metrics_chaos {

namespace {

namespace t = idem::testing;

/// The consumer child: started in its own process group, stopped (SIGTERM, then SIGKILL) by its
/// pid when this goes out of scope.
class Consumer {
  public:
    Consumer(const Args& args, const std::filesystem::path& log) : log_(log) {
        t::Spawn s;
        s.argv = {std::filesystem::read_symlink("/proc/self/exe").string(),
                  "--messages",
                  std::to_string(args.messages),
                  "--workers",
                  std::to_string(args.workers),
                  "--seed",
                  std::to_string(args.seed),
                  "--pace-ms",
                  "2",  // the run lasts a few seconds, so Prometheus scrapes it while it runs
                  "--serve-seconds",
                  "120"};
        for (char** e = environ; *e != nullptr; ++e)
            s.env.emplace_back(*e);
        s.cwd = std::filesystem::current_path();
        s.new_process_group = true;
        const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd < 0) throw std::runtime_error("cannot open " + log.string());
        s.out_fd = fd;
        pid_ = t::spawn_handing_over(s, fd);
    }
    Consumer(const Consumer&) = delete;
    Consumer& operator=(const Consumer&) = delete;
    ~Consumer() { stop(); }

    void stop() noexcept {
        if (pid_ <= 0) return;
        ::kill(pid_, SIGTERM);
        if (!t::wait_for(pid_, std::chrono::seconds(5))) {
            ::kill(pid_, SIGKILL);
            (void)t::wait_for(pid_, std::chrono::seconds(5));
        }
        pid_ = -1;
    }

    /// The first line of its output that starts with @p prefix, waiting up to @p within; throws
    /// when the child exits without printing it.
    std::string await_line(const std::string& prefix, std::chrono::seconds within) {
        const auto deadline = std::chrono::steady_clock::now() + within;
        for (;;) {
            const std::string text = t::read_text(log_);
            std::size_t at = 0;
            while (at < text.size()) {
                const auto end = text.find('\n', at);
                if (end == std::string::npos) break;  // a line still being written
                if (text.compare(at, prefix.size(), prefix) == 0) return text.substr(at, end - at);
                at = end + 1;
            }
            int status = 0;
            if (::waitpid(pid_, &status, WNOHANG) == pid_) {
                pid_ = -1;
                throw std::runtime_error("the consumer exited before printing '" + prefix + "':\n" +
                                         t::tail(t::read_text(log_)));
            }
            if (std::chrono::steady_clock::now() > deadline) {
                throw std::runtime_error("the consumer printed no '" + prefix + "' in time:\n" +
                                         t::tail(t::read_text(log_)));
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
    }

  private:
    std::filesystem::path log_;
    pid_t pid_ = -1;
};

struct Check {
    std::string name;
    std::uint64_t printed = 0;
    std::optional<double> scraped;
    [[nodiscard]] bool agrees() const {
        return scraped && *scraped == static_cast<double>(printed);
    }
};

int check(const Args& args) {
    const auto log = std::filesystem::absolute("metrics_chaos.consumer.log");
    Consumer consumer(args, log);
    const std::string serving =
        consumer.await_line("metrics_chaos: serving ", std::chrono::seconds(30));
    const auto colon = serving.rfind(':');
    const int port = std::atoi(serving.c_str() + colon + 1);
    if (port <= 0) throw std::runtime_error("no port in: " + serving);

    // Prometheus comes up while the workload runs and scrapes it every second.
    t::PrometheusServer prometheus({fmt::format("127.0.0.1:{}", port)});
    const std::string summary = consumer.await_line("{\"messages\":", std::chrono::seconds(120));
    std::fprintf(stderr, "consumer: %s\n", summary.c_str());
    auto printed = [&summary](const char* field) {
        const auto value = json_number(summary, field);
        if (!value) throw std::runtime_error(std::string("no ") + field + " in: " + summary);
        return *value;
    };

    std::vector<Check> checks = {
        {"idem_deliveries_total{job=\"idem\",scope=\"capture\",disposition=\"processed\"}",
         printed("processed"), std::nullopt},
        {"idem_duplicates_suppressed_total{job=\"idem\",scope=\"capture\"}", printed("duplicates"),
         std::nullopt},
        {"idem_deliveries_total{job=\"idem\",scope=\"capture\",disposition=\"failed\"}",
         printed("failed"), std::nullopt},
        {"idem_redeliveries_total{job=\"idem\",scope=\"capture\"}", printed("redeliveries"),
         std::nullopt},
        {"idem_commits_refused_after_effect_total{job=\"idem\",scope=\"capture\"}",
         printed("commits_refused_after_effect"), std::nullopt},
    };
    const auto started = std::chrono::steady_clock::now();
    const auto deadline = started + std::chrono::seconds(60);
    bool all = false;
    while (!all && std::chrono::steady_clock::now() < deadline) {
        all = true;
        for (Check& c : checks) {
            c.scraped = prometheus.query_value(c.name);
            all = all && c.agrees();
        }
        if (!all) std::this_thread::sleep_for(std::chrono::milliseconds(250));
    }
    const auto up = prometheus.query_value("up{job=\"idem\"}");
    consumer.stop();

    const std::uint64_t messages = printed("messages");
    bool ok = all && up == 1.0;
    for (const Check& c : checks) {
        std::fprintf(stderr, "%-90s printed %llu, Prometheus %s%s\n", c.name.c_str(),
                     static_cast<unsigned long long>(c.printed),
                     c.scraped ? fmt::format("{}", *c.scraped).c_str() : "nothing",
                     c.agrees() ? "" : "   <-- differs");
    }
    // What the issue asks of the numbers themselves.
    const bool every_message_processed = checks[0].printed == messages;
    const bool duplicates_suppressed = checks[1].printed > 0;
    const bool reconciled = printed("divergences") == 0;
    ok = ok && every_message_processed && duplicates_suppressed && reconciled;
    if (!ok) std::fprintf(stderr, "prometheus log:\n%s\n", prometheus.log_tail().c_str());
    std::printf(
        "{\"messages\":%llu,\"processed\":%llu,\"duplicates\":%llu,\"prometheus_agrees\":%s,"
        "\"every_message_processed\":%s,\"duplicates_suppressed\":%s,\"reconciled\":%s,"
        "\"scraped_after_ms\":%lld}\n",
        static_cast<unsigned long long>(messages),
        static_cast<unsigned long long>(checks[0].printed),
        static_cast<unsigned long long>(checks[1].printed), all ? "true" : "false",
        every_message_processed ? "true" : "false", duplicates_suppressed ? "true" : "false",
        reconciled ? "true" : "false",
        static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::steady_clock::now() - started)
                                   .count()));
    return ok ? 0 : 1;
}

}  // namespace

int check_with_prometheus(const Args& args) {
    std::string why;
    if (!t::PrometheusServer::available(&why)) {
        if (t::running_in_ci()) {
            std::fprintf(stderr, "metrics_chaos: prometheus is required in CI: %s\n", why.c_str());
            return 1;
        }
        std::printf("metrics_chaos: prometheus not available, skipped (CI=true fails): %s\n",
                    why.c_str());
        return 77;
    }
    try {
        return check(args);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "metrics_chaos: %s\n", e.what());
        return 1;
    }
}

}  // namespace metrics_chaos
