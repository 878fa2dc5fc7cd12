#pragma once
/// @file
/// @brief idem::testing::NatsServer: a throwaway nats-server with JetStream for your tests.
/// POSIX/Linux; no gtest; needs only the standard library (the readiness probe speaks the NATS
/// text protocol's first line itself), shipped with the idem::nats component.
///
/// @code
/// #include <idem/testing/nats_server.hpp>
/// TEST(CaptureWorker, RedeliveryCapturesOnce) {
///     auto& nats = idem::testing::shared_nats();       // one per test process, started lazily
///     idem::nats::Connection connection{{nats.url()}};
///     // ... create a stream and a consumer, publish, run the consumer ...
/// }
/// @endcode
///
///   auto& nats = idem::testing::shared_nats();   // one per test process, started lazily
///   nats.url()                                   // "nats://127.0.0.1:<port>"
///   idem::testing::NatsServer own;               // an independent server (restart tests)
///   own.kill9(); own.start();                    // a crash, then the same port and store dir
///   own.stop();  own.start();                    // a clean shutdown (SIGTERM), then again
///
/// How it runs: `nats-server -a 127.0.0.1 -p PORT -js -sd <dir>/jetstream -n <unique name>` as a
/// direct child in its own process group, a minimal environment, no inherited descriptors; its
/// log goes to <dir>/nats.log. Ready means: a TCP connection to the port gets the server's INFO
/// line naming our unique server name (so another server on a recycled port cannot fool us) with
/// JetStream on. JetStream's file store syncs every 2 minutes by default: a kill9() may lose the
/// last writes, as a real crash of a single unclustered server would; stop() loses nothing.
/// $IDEM_TEST_NATS_SERVER: the binary to use; $IDEM_TEST_NATS_TMPDIR: where the dir goes. The
/// life cycle (ports, restart, cleanup, the Watchdog) is ServerProcess's (server_process.hpp).

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/types.h>
#include <unistd.h>

#include <arpa/inet.h>

#include <chrono>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <utility>

#include "idem/config.hpp"
#include "idem/testing/process.hpp"
#include "idem/testing/server_process.hpp"

IDEM_BEGIN_NAMESPACE

namespace testing {

namespace detail {

/// IDEM_TEST_NATS_SERVER (a full path), else nats-server in PATH, /usr/bin, /usr/sbin,
/// /usr/local/bin.
inline Program find_nats_server() {
    return find_program("nats-server", "IDEM_TEST_NATS_SERVER", "Debian: nats-server");
}

/// The first line a NATS server sends on a new connection (`INFO {...}`), or empty when it
/// cannot be read within @p timeout.
inline std::string nats_info_line(int port, std::chrono::milliseconds timeout) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return {};
    timeval tv{};
    tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
    tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<std::uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    std::string line;
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0) {
        char buffer[1024];
        while (line.find('\n') == std::string::npos && line.size() < 16384) {
            const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
            if (n <= 0) break;
            line.append(buffer, static_cast<std::size_t>(n));
        }
    }
    ::close(fd);
    return line;
}

}  // namespace detail

class NatsServer : public ServerProcess {
  public:
    /// Whether a nats-server binary exists; @p why says where it looked when not.
    static bool available(std::string* why = nullptr) {
        const auto found = detail::find_nats_server();
        if (found.path.empty() && why != nullptr) *why = found.why;
        return !found.path.empty();
    }

    /// Starts nats-server with JetStream and waits until it answers. Throws std::runtime_error
    /// with the log's tail.
    NatsServer() : ServerProcess(traits()) {
        const auto found = detail::find_nats_server();
        if (found.path.empty()) throw std::runtime_error("NatsServer: " + found.why);
        binary_ = found.path;
        adopt_dir(make_temp_dir("IDEM_TEST_NATS_TMPDIR", "idem-nats-"));
        name_ = "idem-" + dir().filename().string();
        start_on_free_port();
    }

    // ~ServerProcess: SIGTERM (SIGKILL after 5 s), then the dir is removed. Never throws.
    // port(), pid(), running(), dir(), log_file() (nats.log), log_tail(): ServerProcess's.
    // start(): again on the same port and store dir (after stop() or kill9()): JetStream
    // recovers its streams and consumers from the store. kill9(): a crash (SIGKILL).

    [[nodiscard]] std::string host() const { return "127.0.0.1"; }
    /// The client URL, "nats://127.0.0.1:<port>".
    [[nodiscard]] std::string url() const {
        return "nats://" + host() + ":" + std::to_string(port());
    }
    /// The server name it runs under (unique per fixture: the INFO line says it).
    [[nodiscard]] const std::string& name() const noexcept { return name_; }
    /// JetStream's store directory.
    [[nodiscard]] std::filesystem::path store_dir() const { return dir() / "jetstream"; }

    /// Graceful shutdown (SIGTERM: JetStream flushes its store). No-op when stopped.
    void stop() { stop_with(SIGTERM, std::chrono::seconds(30)); }

  private:
    std::filesystem::path binary_;
    std::string name_;

    static Traits traits() {
        Traits t;
        t.fixture = "NatsServer";
        t.program = "nats-server";
        t.log = "nats.log";
        t.port_busy = {"address already in use"};
        t.ready_within = std::chrono::seconds(20);
        t.ready_poll = std::chrono::milliseconds(10);
        t.quit_signal = SIGTERM;
        t.quit_signal_name = "TERM";
        t.quit_grace = std::chrono::seconds(5);
        t.hard_kill = &NatsServer::hard_kill;
        return t;
    }

    bool launch(int port, bool* port_busy) override {
        *port_busy = false;
        const auto log_offset = log_size();
        const int log = open_log();
        Spawn s;
        s.argv = {binary_.string(),     "-a", host(), "-p", std::to_string(port), "-js", "-sd",
                  store_dir().string(), "-n", name_};
        s.env = {"PATH=/usr/bin:/bin", "LC_ALL=C", "HOME=" + dir().string()};
        s.cwd = dir();
        s.out_fd = log;  // nats-server logs to stderr
        s.new_process_group = true;
        const pid_t pid = spawn_handing_over(s, log);
        if (!await_ready(pid, port, log_offset, [&] { return answers_as_ours(port); })) {
            *port_busy = true;
            return false;
        }
        return true;
    }

    /// Our server name and JetStream on, in the INFO line.
    bool answers_as_ours(int port) const {
        const std::string info = detail::nats_info_line(port, std::chrono::milliseconds(500));
        return info.rfind("INFO ", 0) == 0 &&
               info.find("\"server_name\":\"" + name_ + "\"") != std::string::npos &&
               info.find("\"jetstream\":true") != std::string::npos;
    }

    static void hard_kill(pid_t pid) noexcept { kill_group_and_reap(pid); }
};

/// One server per test process (shared_server()). Tests that stop or crash a server should use
/// their own NatsServer, not this one.
inline NatsServer& shared_nats() {
    return shared_server<NatsServer>("NATS");
}

}  // namespace testing

IDEM_END_NAMESPACE
