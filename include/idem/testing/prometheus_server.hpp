#pragma once
/// @file
/// @brief idem::testing::PrometheusServer: a throwaway Prometheus server (Debian: prometheus)
/// scraping the given targets, for tests of a /metrics endpoint. Part of the idem::http
/// component (its HTTP API is read with cpp-httplib's client). POSIX/Linux; no gtest.
///
/// @code
/// idem::testing::PrometheusServer prometheus({"127.0.0.1:" + std::to_string(endpoint.port())});
/// auto value = prometheus.query_value("idem_deliveries_total{disposition=\"processed\"}");
/// @endcode
///
/// Started on a free 127.0.0.1 port in a fresh temp dir (its prometheus.yml, data/ and
/// prometheus.log), with `scrape_interval` 1 s by default; the destructor sends SIGTERM, SIGKILLs
/// after 5 s and removes the dir (ServerProcess). $IDEM_TEST_PROMETHEUS: the binary to use;
/// $IDEM_TEST_PROMETHEUS_TMPDIR: where the dir goes.

#include <httplib.h>
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/testing/process.hpp"
#include "idem/testing/server_process.hpp"

IDEM_BEGIN_NAMESPACE

namespace testing {

namespace detail {

inline Program find_prometheus() {
    return find_program("prometheus", "IDEM_TEST_PROMETHEUS", "Debian: prometheus");
}

}  // namespace detail

class PrometheusServer : public ServerProcess {
  public:
    /// Whether a prometheus binary exists; @p why says where it looked when not.
    static bool available(std::string* why = nullptr) {
        const auto found = detail::find_prometheus();
        if (found.path.empty() && why != nullptr) *why = found.why;
        return !found.path.empty();
    }

    /// Starts prometheus scraping @p targets ("127.0.0.1:9464", path /metrics) every
    /// @p scrape_interval, and waits until it is ready (/-/ready). Throws std::runtime_error
    /// with the log's tail.
    explicit PrometheusServer(std::vector<std::string> targets, std::string scrape_interval = "1s")
        : ServerProcess(traits()),
          targets_(std::move(targets)),
          scrape_interval_(std::move(scrape_interval)) {
        const auto found = detail::find_prometheus();
        if (found.path.empty()) throw std::runtime_error("PrometheusServer: " + found.why);
        binary_ = found.path;
        adopt_dir(make_temp_dir("IDEM_TEST_PROMETHEUS_TMPDIR", "idem-prometheus-"));
        write_config();
        start_on_free_port();
    }

    [[nodiscard]] std::string host() const { return "127.0.0.1"; }

    /// The value of an instant query (`/api/v1/query`) whose result is one sample; nullopt when
    /// it has none yet (or the API is not answering). Throws when the query is an error.
    [[nodiscard]] std::optional<double> query_value(const std::string& promql) const {
        httplib::Client client(host(), port());
        client.set_connection_timeout(std::chrono::seconds(2));
        client.set_read_timeout(std::chrono::seconds(5));
        const auto res =
            client.Get("/api/v1/query", httplib::Params{{"query", promql}}, httplib::Headers{});
        if (!res) return std::nullopt;
        if (res->status != 200) {
            throw std::runtime_error("PrometheusServer: query '" + promql + "': HTTP " +
                                     std::to_string(res->status) + ": " + res->body);
        }
        // {"status":"success","data":{"resultType":"vector","result":[{"metric":{...},
        //  "value":[1700000000.123,"42"]}]}}: the one sample's value is the string after the
        // timestamp.
        const std::string& body = res->body;
        const auto value = body.find("\"value\":[");
        if (value == std::string::npos) return std::nullopt;
        if (body.find("\"value\":[", value + 1) != std::string::npos) {
            throw std::runtime_error("PrometheusServer: query '" + promql +
                                     "' has more than one sample: " + body);
        }
        const auto comma = body.find(",\"", value);
        const auto end = comma == std::string::npos ? comma : body.find('"', comma + 2);
        if (end == std::string::npos) {
            throw std::runtime_error("PrometheusServer: unexpected reply: " + body);
        }
        return std::strtod(body.substr(comma + 2, end - comma - 2).c_str(), nullptr);
    }

    /// Graceful shutdown (SIGTERM). No-op when stopped.
    void stop() { stop_with(SIGTERM, std::chrono::seconds(30)); }

  private:
    std::vector<std::string> targets_;
    std::string scrape_interval_;
    std::filesystem::path binary_;

    static Traits traits() {
        Traits t;
        t.fixture = "PrometheusServer";
        t.program = "prometheus";
        t.log = "prometheus.log";
        t.port_busy = {"address already in use"};
        t.ready_within = std::chrono::seconds(60);
        t.ready_poll = std::chrono::milliseconds(50);
        t.quit_signal = SIGTERM;
        t.quit_signal_name = "TERM";
        t.quit_grace = std::chrono::seconds(5);
        t.hard_kill = &PrometheusServer::hard_kill;
        return t;
    }

    void write_config() const {
        std::ofstream out(dir() / "prometheus.yml");
        out << "global:\n  scrape_interval: " << scrape_interval_
            << "\n  evaluation_interval: " << scrape_interval_
            << "\nscrape_configs:\n  - job_name: idem\n    metrics_path: /metrics\n"
               "    static_configs:\n      - targets: [";
        for (std::size_t i = 0; i < targets_.size(); ++i)
            out << (i == 0 ? "" : ", ") << '"' << targets_[i] << '"';
        out << "]\n";
        if (!out.flush()) throw std::runtime_error("PrometheusServer: cannot write prometheus.yml");
    }

    bool launch(int port, bool* port_busy) override {
        *port_busy = false;
        const auto log_offset = log_size();
        const int log = open_log();
        Spawn s;
        s.argv = {binary_.string(), "--config.file=" + (dir() / "prometheus.yml").string(),
                  "--storage.tsdb.path=" + (dir() / "data").string(),
                  "--web.listen-address=127.0.0.1:" + std::to_string(port), "--log.level=info"};
        s.env = {"PATH=/usr/bin:/bin", "LC_ALL=C", "HOME=" + dir().string()};
        s.cwd = dir();
        s.out_fd = log;
        s.new_process_group = true;
        const pid_t pid = spawn_handing_over(s, log);
        if (!await_ready(pid, port, log_offset, [&] { return ready(port); })) {
            *port_busy = true;
            return false;
        }
        return true;
    }

    /// /-/ready answers 200 (and the log is ours: the dir's config was loaded).
    bool ready(int port) const {
        httplib::Client client(host(), port);
        client.set_connection_timeout(std::chrono::milliseconds(500));
        client.set_read_timeout(std::chrono::seconds(2));
        const auto res = client.Get("/-/ready");
        return res && res->status == 200 &&
               read_text(log_file()).find(dir().string()) != std::string::npos;
    }

    static void hard_kill(pid_t pid) noexcept { kill_group_and_reap(pid); }
};

}  // namespace testing

IDEM_END_NAMESPACE
