#pragma once
/// @file
/// @brief idem::testing::RabbitmqServer: a throwaway RabbitMQ broker for your tests (the
/// rabbitmq-server of Debian's package, run as a child in a fresh temp dir). Link idem::rabbitmq
/// (rabbitmq-c) to use it. POSIX/Linux; no gtest here: with GoogleTest, skip or fail when
/// RabbitmqServer::available() is false.
///
/// @code
/// #include <idem/testing/rabbitmq_server.hpp>
/// TEST(CaptureWorker, RedeliveryCapturesOnce) {
///     auto& rabbit = idem::testing::shared_rabbitmq();  // one per test process (~7 s to start)
///     idem::rabbitmq::Connection c{rabbit.endpoint()};
///     c.connect();
///     // ... declare a quorum queue, publish, consume ...
/// }
/// @endcode
///
///   auto& rabbit = idem::testing::shared_rabbitmq();    // one per test process, started lazily
///   rabbit.endpoint()                                    // guest/guest on 127.0.0.1:port()
///   idem::testing::RabbitmqServer own;                   // an independent broker (restart tests)
///   own.kill9(); own.start();                            // crash, then the same node and data
///   own.stop();  own.start();                            // a clean shutdown, then the same
///
/// How it runs:
/// - /usr/lib/rabbitmq/bin/rabbitmq-server (the script behind Debian's /usr/sbin wrapper, which
///   would switch to the rabbitmq user and its /var/lib/rabbitmq) is a direct child of the test
///   process, in its own process group, with an environment of its own: HOME, the Mnesia and log
///   bases in the temp dir (the Erlang cookie is written to HOME), node name
///   rabbit-<port>@localhost, the AMQP listener, the Erlang distribution port and epmd all on
///   127.0.0.1 and free ports, no /etc/rabbitmq file read (its own rabbitmq.conf, an empty
///   rabbitmq-env.conf and advanced.config, enabled_plugins `[]`: no management plugin).
/// - epmd (the Erlang port mapper) is started by the fixture itself, in the foreground, on its own
///   port and 127.0.0.1, before the broker (which then finds it rather than daemonizing one): the
///   fixture knows its pid and stops it after the broker, so nothing is left behind.
/// - Ready means: an AMQP login (guest/guest, allowed over loopback) to 127.0.0.1:port succeeds
///   and the broker's cluster_name is our node's (rabbit-<port>@<host>: a port collision cannot
///   fool us).
/// - stop(): SIGTERM to the script, which stops the node cleanly; kill9() SIGKILLs the whole
///   process group (the script, beam.smp and its helpers). start() brings the same node back on
///   the same ports and data dir: durable queues and their persistent messages come back.
/// - A Watchdog (process.hpp) stops the broker and removes the dir if the test process dies
///   without running destructors; a second one stops epmd.
/// Not thread-safe for concurrent start/stop/kill9.

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "idem/config.hpp"
#include "idem/rabbitmq/connection.hpp"
#include "idem/rabbitmq/endpoint.hpp"
#include "idem/testing/process.hpp"
#include "idem/testing/server_process.hpp"

IDEM_BEGIN_NAMESPACE

namespace testing {

namespace detail {

/// IDEM_TEST_RABBITMQ_SERVER (a full path to the rabbitmq-server script), else the one Debian's
/// package installs under /usr/lib/rabbitmq/bin.
inline Program find_rabbitmq_server() {
    if (const char* env = std::getenv("IDEM_TEST_RABBITMQ_SERVER"); env != nullptr && *env) {
        if (is_executable(env)) return {env, {}};
        return {{}, std::string("IDEM_TEST_RABBITMQ_SERVER=") + env + " is not an executable file"};
    }
    const std::filesystem::path debian = "/usr/lib/rabbitmq/bin/rabbitmq-server";
    if (is_executable(debian)) return {debian, {}};
    return {{},
            "rabbitmq-server not found at " + debian.string() +
                " (or IDEM_TEST_RABBITMQ_SERVER). Install it with scripts/deps.sh (Debian: "
                "rabbitmq-server)"};
}

inline Program find_epmd() {
    return find_program("epmd", "IDEM_TEST_EPMD", "Debian: erlang-base");
}

}  // namespace detail

/// @brief Broker settings a test may change (each becomes a line of rabbitmq.conf).
struct RabbitmqOptions {
    /// consumer_timeout: a delivery unacked this long closes its channel (and is redelivered).
    /// RabbitMQ checks it about once a minute; 0 leaves the broker's default (30 min).
    std::chrono::milliseconds consumer_timeout{0};
    /// How often a channel checks its consumer timeout (advanced.config channel_tick_interval;
    /// the broker's default is 60 s). 0: the default.
    std::chrono::milliseconds channel_tick_interval{0};
    /// More rabbitmq.conf lines, verbatim.
    std::vector<std::string> extra_config{};
};

class RabbitmqServer : public ServerProcess {
  public:
    /// Whether rabbitmq-server and epmd exist; @p why says where it looked when not.
    static bool available(std::string* why = nullptr) {
        const auto server = detail::find_rabbitmq_server();
        const auto epmd = detail::find_epmd();
        if (server.path.empty() || epmd.path.empty()) {
            if (why != nullptr) *why = server.path.empty() ? server.why : epmd.why;
            return false;
        }
        return true;
    }

    /// Starts epmd and rabbitmq-server and waits until AMQP accepts a login. Throws
    /// std::runtime_error with the log's tail.
    explicit RabbitmqServer(RabbitmqOptions options = {})
        : ServerProcess(traits()), options_(std::move(options)) {
        const auto server = detail::find_rabbitmq_server();
        if (server.path.empty()) throw std::runtime_error("RabbitmqServer: " + server.why);
        const auto epmd = detail::find_epmd();
        if (epmd.path.empty()) throw std::runtime_error("RabbitmqServer: " + epmd.why);
        script_ = server.path;
        epmd_binary_ = epmd.path;
        adopt_dir(make_temp_dir("IDEM_TEST_RABBITMQ_TMPDIR", "idem-rabbitmq-"));
        epmd_watchdog_.start(dir() / "epmd-watchdog", "TERM");
        start_on_free_port();
    }

    /// The broker first (a clean stop, then SIGKILL), then epmd; never throws.
    ~RabbitmqServer() override {
        if (::getpid() != owner_) {
            epmd_watchdog_.abandon();
            return;
        }
        try {
            stop();
        } catch (...) {  // stop_with() killed it already
        }
        stop_epmd();
        epmd_watchdog_.stop();
    }

    // port() (AMQP), pid() (the script), running(), dir(), log_file() (rabbitmq.log),
    // log_tail(), start(), kill9(): ServerProcess's.

    [[nodiscard]] std::string host() const { return "127.0.0.1"; }
    [[nodiscard]] std::string node_name() const { return node_name(port()); }
    [[nodiscard]] int dist_port() const { return dist_port_; }
    [[nodiscard]] int epmd_port() const { return epmd_port_; }
    [[nodiscard]] pid_t epmd_pid() const { return epmd_pid_; }

    /// guest/guest on 127.0.0.1:port(), vhost "/".
    [[nodiscard]] rabbitmq::Endpoint endpoint() const {
        rabbitmq::Endpoint e;
        e.host = host();
        e.port = port();
        return e;
    }

    /// Runs rabbitmqctl against this node (its cookie, epmd and node name) with @p args and
    /// returns what it printed; throws std::runtime_error (with the output) when it fails. Takes
    /// a second or more (an Erlang VM starts): for what AMQP does not say, e.g.
    /// `ctl({"list_queues", "name", "messages_unacknowledged"})`.
    std::string ctl(const std::vector<std::string>& args,
                    std::chrono::seconds limit = std::chrono::seconds(60)) const {
        const std::filesystem::path out = dir() / ("ctl-" + std::to_string(::getpid()) + ".out");
        const int fd = open_log(out.filename());
        Spawn s;
        s.argv = {(script_.parent_path() / "rabbitmqctl").string(), "-n", node_name(), "-q"};
        s.argv.insert(s.argv.end(), args.begin(), args.end());
        s.env = {"PATH=/usr/bin:/bin",
                 "LC_ALL=C.UTF-8",
                 "LANG=C.UTF-8",
                 "HOME=" + dir().string(),
                 "RABBITMQ_CONF_ENV_FILE=" + (dir() / "rabbitmq-env.conf").string(),
                 "RABBITMQ_CTL_ERL_ARGS=-kernel inet_dist_use_interface {127,0,0,1}",
                 "ERL_EPMD_ADDRESS=127.0.0.1",
                 "ERL_EPMD_PORT=" + std::to_string(epmd_port_)};
        s.cwd = dir();
        s.out_fd = fd;
        s.new_process_group = true;
        const pid_t pid = spawn_handing_over(s, fd);
        const auto status = wait_for(pid, limit);
        if (!status) kill_group_and_reap(pid);
        std::string text = read_text(out);
        std::error_code ec;
        std::filesystem::remove(out, ec);
        if (!status) {
            throw std::runtime_error("RabbitmqServer: rabbitmqctl " + args_text(args) +
                                     " did not finish within " + std::to_string(limit.count()) +
                                     " s (killed): " + tail(text));
        }
        if (!WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
            const std::string how = WIFEXITED(*status)
                                        ? "exit code " + std::to_string(WEXITSTATUS(*status))
                                        : "signal " + std::to_string(WTERMSIG(*status));
            throw std::runtime_error("RabbitmqServer: rabbitmqctl " + args_text(args) +
                                     " failed (" + how + "): " + tail(text));
        }
        return text;
    }

    /// A clean shutdown (SIGTERM: the node stops its queues and flushes them). No-op when
    /// stopped. epmd stays (start() reuses it).
    void stop() { stop_with(SIGTERM, std::chrono::seconds(60)); }

  private:
    std::filesystem::path script_;
    std::filesystem::path epmd_binary_;
    RabbitmqOptions options_;
    int dist_port_ = 0;
    int epmd_port_ = 0;
    pid_t epmd_pid_ = -1;
    Watchdog epmd_watchdog_;
    pid_t owner_ = ::getpid();

    static std::string args_text(const std::vector<std::string>& args) {
        std::string out;
        for (const std::string& a : args)
            out += (out.empty() ? "" : " ") + a;
        return out;
    }

    static std::string node_name(int port) {
        return "rabbit-" + std::to_string(port) + "@localhost";
    }

    static Traits traits() {
        Traits t;
        t.fixture = "RabbitmqServer";
        t.program = "rabbitmq-server";
        t.log = "rabbitmq.log";
        t.port_busy = {"eaddrinuse", "dist_port_already_used"};
        t.ready_within = std::chrono::seconds(90);  // ~7 s on an idle machine
        t.ready_poll = std::chrono::milliseconds(100);
        t.quit_signal = SIGTERM;
        t.quit_signal_name = "TERM";
        t.quit_grace = std::chrono::seconds(30);
        t.hard_kill = &ServerProcess::kill_group_and_reap;
        return t;
    }

    /// epmd on its own free port (once; kept across restarts of the broker).
    void ensure_epmd() {
        if (epmd_pid_ > 0 && !process_gone(epmd_pid_)) return;
        epmd_port_ = probe_free_port();
        const int log = open_log("epmd.log");
        Spawn s;
        s.argv = {epmd_binary_.string(), "-port", std::to_string(epmd_port_), "-address",
                  "127.0.0.1"};
        s.env = {"PATH=/usr/bin:/bin", "LC_ALL=C", "HOME=" + dir().string()};
        s.cwd = dir();
        s.out_fd = log;
        s.new_process_group = true;
        epmd_pid_ = spawn_handing_over(s, log);
        epmd_watchdog_.watch(epmd_pid_);
    }

    void stop_epmd() noexcept {
        if (epmd_pid_ <= 0) return;
        const pid_t pid = epmd_pid_;
        epmd_pid_ = -1;
        epmd_watchdog_.watch(0);
        ::kill(pid, SIGTERM);
        try {
            if (!wait_for(pid, std::chrono::seconds(5))) {
                ::kill(pid, SIGKILL);
                wait_for(pid, std::chrono::seconds(5));
            }
        } catch (...) {
        }
    }

    void write_config(int port) const {
        std::ofstream conf(dir() / "rabbitmq.conf", std::ios::trunc);
        conf << "listeners.tcp.1 = 127.0.0.1:" << port << "\n"
             << "loopback_users.guest = true\n"
             << "log.console = true\n"
             << "log.console.level = info\n"
             << "log.file = false\n";
        if (options_.consumer_timeout.count() > 0) {
            conf << "consumer_timeout = " << options_.consumer_timeout.count() << "\n";
        }
        for (const auto& line : options_.extra_config)
            conf << line << "\n";
        std::ofstream advanced(dir() / "advanced.config", std::ios::trunc);
        if (options_.channel_tick_interval.count() > 0) {
            advanced << "[{rabbit, [{channel_tick_interval, "
                     << options_.channel_tick_interval.count() << "}]}].\n";
        } else {
            advanced << "[].\n";
        }
        std::ofstream(dir() / "enabled_plugins", std::ios::trunc) << "[].\n";
        std::ofstream(dir() / "rabbitmq-env.conf", std::ios::trunc) << "";
    }

    bool launch(int port, bool* port_busy) override {
        *port_busy = false;
        ensure_epmd();
        // A fresh distribution port on every launch: nothing outside the node uses it, and a
        // port taken between the probe and the bind is then simply retried with new ones.
        dist_port_ = probe_free_port();
        write_config(port);
        const auto log_offset = log_size();
        const int log = open_log();
        const std::string d = dir().string();
        Spawn s;
        s.argv = {script_.string()};
        s.env = {"PATH=/usr/bin:/bin",
                 "LC_ALL=C.UTF-8",
                 "LANG=C.UTF-8",
                 "HOME=" + d,
                 "RABBITMQ_MNESIA_BASE=" + d + "/mnesia",
                 "RABBITMQ_LOG_BASE=" + d + "/log",
                 "RABBITMQ_LOGS=-",
                 "RABBITMQ_NODENAME=" + node_name(port),
                 "RABBITMQ_NODE_IP_ADDRESS=127.0.0.1",
                 "RABBITMQ_NODE_PORT=" + std::to_string(port),
                 "RABBITMQ_DIST_PORT=" + std::to_string(dist_port_),
                 "RABBITMQ_CONFIG_FILE=" + d + "/rabbitmq.conf",
                 "RABBITMQ_CONF_ENV_FILE=" + d + "/rabbitmq-env.conf",
                 "RABBITMQ_ADVANCED_CONFIG_FILE=" + d + "/advanced.config",
                 "RABBITMQ_ENABLED_PLUGINS_FILE=" + d + "/enabled_plugins",
                 "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=-kernel inet_dist_use_interface {127,0,0,1}",
                 "ERL_EPMD_ADDRESS=127.0.0.1",
                 "ERL_EPMD_PORT=" + std::to_string(epmd_port_)};
        s.cwd = dir();
        s.out_fd = log;
        s.new_process_group = true;
        const pid_t pid = spawn_handing_over(s, log);

        rabbitmq::Endpoint probe;
        probe.host = host();
        probe.port = port;
        probe.connect_timeout = std::chrono::milliseconds(1000);
        probe.rpc_timeout = std::chrono::milliseconds(2000);
        probe.heartbeat = std::chrono::seconds(0);
        // cluster_name defaults to the node's name with the host's own name after the @
        // (rabbit-<port>@<hostname>), whatever RABBITMQ_NODENAME says after it.
        const std::string ours = "rabbit-" + std::to_string(port) + "@";
        if (!await_ready(pid, port, log_offset, [&] { return answers_as_ours(probe, ours); })) {
            *port_busy = true;
            return false;
        }
        return true;
    }

    static bool answers_as_ours(const rabbitmq::Endpoint& endpoint, const std::string& prefix) {
        try {
            rabbitmq::Connection c{endpoint};
            c.connect();
            const auto name = c.server_property("cluster_name");
            return name && std::holds_alternative<std::string>(*name) &&
                   std::get<std::string>(*name).rfind(prefix, 0) == 0;
        } catch (const std::exception&) {
            return false;
        }
    }
};

/// One broker per test process (shared_server()). Tests that stop or crash a broker should use
/// their own RabbitmqServer, not this one.
inline RabbitmqServer& shared_rabbitmq() {
    return shared_server<RabbitmqServer>("RabbitMQ");
}

}  // namespace testing

IDEM_END_NAMESPACE
