#pragma once
/// @file
/// @brief idem::testing::ServerProcess: what the throwaway server fixtures (RedisServer,
/// PostgresServer, MariadbServer) share: one server process in a fresh temp dir, on a free
/// 127.0.0.1 port, watched by a Watchdog (process.hpp). POSIX/Linux; no gtest; needs only the
/// standard library (part of idem::idem). A fixture for another server derives from it:
///
/// @code
/// #include <idem/testing/server_process.hpp>
/// class MemcachedServer : public idem::testing::ServerProcess {
///   public:
///     MemcachedServer() : ServerProcess(traits()) {
///         adopt_dir(idem::testing::make_temp_dir("MY_TMPDIR", "memcached-"));
///         start_on_free_port();
///     }
///   private:
///     static Traits traits();                           // names, log, signals, hard_kill
///     bool launch(int port, bool* port_busy) override;  // spawn(), then await_ready()
/// };
/// @endcode
///
/// What the throwaway server fixtures (redis_server.hpp, postgres_server.hpp, mariadb_server.hpp)
/// share: one server process in a fresh temp dir, on a free 127.0.0.1 port, watched by a Watchdog
/// (process.hpp).
/// POSIX/Linux; no gtest here.
///
///   class FooServer : public ServerProcess    supplies launch(port, &port_busy) and, in its
///                                             Traits, how the server is named and killed
///   adopt_dir(make_temp_dir(...))             the server's dir, removed by the Watchdog too
///   start_on_free_port()                      probe a port and launch; a port taken meanwhile: a
///                                             new port (20 tries)
///   start()                                   launch again on the same port and dir
///   await_ready(pid, port, offset, ready)     in launch(), after the spawn
///   stop_with(signal, limit)  kill9()         a clean shutdown; a crash (Traits::hard_kill)
///   kill_group_and_reap(pid)                  a hard_kill for a one-process-group server
///   ~ServerProcess()                          quit signal, hard_kill after a grace period, the
///                                             dir removed (nothing in a fork()ed copy)
///   shared_server<FooServer>("Foo")           one per test process, started on first use
///   orphan_server<FooServer>()                for the fixtures' tests: its owner is SIGKILLed

#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/testing/process.hpp"

IDEM_BEGIN_NAMESPACE

namespace testing {

class ServerProcess {
  public:
    ServerProcess(const ServerProcess&) = delete;
    ServerProcess& operator=(const ServerProcess&) = delete;

    [[nodiscard]] int port() const { return port_; }
    [[nodiscard]] pid_t pid() const { return pid_; }
    [[nodiscard]] bool running() const { return pid_ > 0; }
    [[nodiscard]] const std::filesystem::path& dir() const { return dir_; }
    [[nodiscard]] std::filesystem::path log_file() const { return dir_ / traits_.log; }
    [[nodiscard]] std::string log_tail(std::size_t max_chars = 4000) const {
        return tail(read_text(log_file()), max_chars);
    }

    /// Starts again on the same port and dir (after a stop or kill9()). Retries for a few
    /// seconds if someone else holds the port meanwhile.
    void start() {
        if (pid_ > 0) return;
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        for (;;) {
            bool port_busy = false;
            if (launch(port_, &port_busy)) return;
            if (!port_busy || std::chrono::steady_clock::now() >= deadline) {
                throw std::runtime_error(std::string(traits_.fixture) + ": restart on port " +
                                         std::to_string(port_) + " failed: " + log_tail());
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
        }
    }

    /// A crash: Traits::hard_kill, no clean shutdown; start() can reuse the dir right away.
    void kill9() {
        if (pid_ <= 0) return;
        const pid_t pid = pid_;
        pid_ = -1;
        watchdog_.watch(0);
        traits_.hard_kill(pid);
    }

  protected:
    /// How a fixture's server is named in errors, started and stopped.
    struct Traits {
        const char* fixture = "";  ///< "RedisServer": the start of every error message
        const char* program = "";  ///< "redis-server"
        const char* log = "";      ///< the server's log in dir(), read on startup failures
        /// Log text of a server that exited at startup because its port was taken.
        std::vector<std::string> port_busy;
        std::chrono::seconds ready_within{10};            ///< await_ready()'s limit
        std::chrono::milliseconds ready_poll{10};         ///< how often await_ready() asks
        int quit_signal = SIGTERM;                        ///< the destructor's first signal
        const char* quit_signal_name = "TERM";            ///< the same for the Watchdog
        std::chrono::seconds quit_grace{5};               ///< then hard_kill
        void (*hard_kill)(pid_t pid) noexcept = nullptr;  ///< SIGKILL all it started, reap
    };

    explicit ServerProcess(Traits traits) : traits_(std::move(traits)) {}

    /// Quit signal, hard_kill after Traits::quit_grace, the dir removed. Never throws. Also runs
    /// when the fixture's constructor throws.
    virtual ~ServerProcess() {
        if (::getpid() != owner_) {  // in a fork()ed copy of the owner: touch nothing shared
            watchdog_.abandon();
            return;
        }
        if (pid_ > 0) {
            const pid_t pid = pid_;
            pid_ = -1;
            ::kill(pid, traits_.quit_signal);
            watchdog_.watch(0);
            bool stopped = false;
            try {
                stopped = wait_for(pid, traits_.quit_grace).has_value();
            } catch (...) {
            }
            if (!stopped) traits_.hard_kill(pid);
        }
        if (!dir_.empty()) {
            std::error_code ec;
            std::filesystem::remove_all(dir_, ec);
        }
        watchdog_.stop();
    }

    /// Starts the server on @p port and waits until it is ready (await_ready()). false and
    /// *port_busy when the port was taken; throws on other failures.
    virtual bool launch(int port, bool* port_busy) = 0;

    /// Takes @p dir (a fresh temp dir) as the server's: the destructor removes it, or the
    /// Watchdog if the test process dies without running destructors.
    void adopt_dir(std::filesystem::path dir) {
        dir_ = std::move(dir);
        watchdog_.start(dir_, traits_.quit_signal_name);
    }

    void start_on_free_port() {
        for (int attempt = 1;; ++attempt) {
            const int port = probe_free_port();
            bool port_busy = false;
            if (launch(port, &port_busy)) return;
            if (!port_busy || attempt >= 20) {
                throw std::runtime_error(std::string(traits_.fixture) + ": " + traits_.program +
                                         " did not start: " + log_tail());
            }
        }
    }

    /// A Traits::hard_kill for a server spawned with new_process_group: SIGKILL its process group
    /// (the server and anything it fork()ed) and reap it.
    static void kill_group_and_reap(pid_t pid) noexcept {
        ::kill(-pid, SIGKILL);
        ::kill(pid, SIGKILL);
        try {
            wait_for(pid, std::chrono::seconds(10));
        } catch (...) {
        }
    }

    /// The server's log (Traits::log) opened for appending, for its stdout and stderr.
    int open_log() const { return open_log(traits_.log); }

    /// A file in dir() opened for appending (a log a child's stdout and stderr go to).
    int open_log(const std::filesystem::path& name) const {
        const auto path = dir_ / name;
        const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (fd < 0)
            throw std::system_error(errno, std::generic_category(), "open " + path.string());
        return fd;
    }

    /// The log's size now: await_ready() reads only what a launch wrote after it.
    std::size_t log_size() const {
        std::error_code ec;
        const auto size = std::filesystem::file_size(log_file(), ec);
        return ec ? 0 : static_cast<std::size_t>(size);
    }

    /// In launch(), once the server was spawned as @p pid on @p port: waits until @p ready()
    /// (asked every Traits::ready_poll); then pid() and port() are the new ones and it returns
    /// true. false when the server exited because the port was taken (Traits::port_busy in its
    /// log after @p log_offset); throws when it exited otherwise, or was not ready within
    /// Traits::ready_within (then it is killed).
    template <class Ready>
    bool await_ready(pid_t pid, int port, std::size_t log_offset, Ready&& ready) {
        watchdog_.watch(pid);
        const auto deadline = std::chrono::steady_clock::now() + traits_.ready_within;
        for (;;) {
            int status = 0;
            if (::waitpid(pid, &status, WNOHANG) == pid) {
                watchdog_.watch(0);
                const std::string whole = read_text(log_file());
                const std::string log_text = whole.substr(std::min(log_offset, whole.size()));
                for (const auto& busy : traits_.port_busy) {
                    if (log_text.find(busy) != std::string::npos) return false;
                }
                throw std::runtime_error(std::string(traits_.fixture) + ": " + traits_.program +
                                         " exited during startup: " + tail(log_text));
            }
            if (ready()) break;
            if (std::chrono::steady_clock::now() >= deadline) {
                watchdog_.watch(0);
                traits_.hard_kill(pid);
                throw std::runtime_error(
                    std::string(traits_.fixture) + ": " + traits_.program + " not ready within " +
                    std::to_string(traits_.ready_within.count()) + " s: " + log_tail());
            }
            std::this_thread::sleep_for(traits_.ready_poll);
        }
        pid_ = pid;
        port_ = port;
        return true;
    }

    /// A clean shutdown: @p signal, and hard_kill if the server is still there after @p limit
    /// (then throws). No-op when stopped.
    void stop_with(int signal, std::chrono::seconds limit) {
        if (pid_ <= 0) return;
        const pid_t pid = pid_;
        pid_ = -1;
        ::kill(pid, signal);
        watchdog_.watch(0);
        if (!wait_for(pid, limit)) {
            traits_.hard_kill(pid);
            throw std::runtime_error(std::string(traits_.fixture) + ": " + traits_.program +
                                     " did not stop within " + std::to_string(limit.count()) +
                                     " s; killed. " + log_tail());
        }
    }

  private:
    Traits traits_;
    std::filesystem::path dir_;
    int port_ = 0;
    pid_t pid_ = -1;
    Watchdog watchdog_;
    pid_t owner_ = ::getpid();  // a fork()ed child (death test) must not tear down our server
};

/// One @p Server per test process, started on first use (thread-safe), stopped and removed at
/// exit by a static destructor (and by the watchdog if the process dies abnormally). A failed
/// start is remembered: later calls throw the same reason at once ("shared <what> server did not
/// start: ..."). Tests that stop or crash a server should use their own, not this one.
template <class Server>
Server& shared_server(const char* what) {
    static std::string failure;
    static const std::unique_ptr<Server> server = []() -> std::unique_ptr<Server> {
        try {
            return std::make_unique<Server>();
        } catch (const std::exception& e) {
            failure = e.what();
            return nullptr;
        }
    }();
    if (!server) {
        throw std::runtime_error(std::string("shared ") + what +
                                 " server did not start: " + failure);
    }
    return *server;
}

/// For the fixtures' own tests: a server whose owner died without running destructors.
struct Orphan {
    int status = 0;         ///< the owner's wait status
    std::string report;     ///< what the owner wrote: "<pid> <port> <dir>\n" or "error <what>\n"
    bool reported = false;  ///< pid, port and dir were read from the report
    pid_t pid = -1;         ///< the server's
    int port = 0;
    std::filesystem::path dir;
};

/// A fork()ed owner starts a @p Server, reports its pid, port and dir, and dies by SIGKILL
/// (killed_while()): what is left of the server is the Watchdog's to clean up.
template <class Server>
Orphan orphan_server() {
    const KilledChild owner = killed_while([](const auto& die) {
        Server server;
        die(std::to_string(server.pid()) + " " + std::to_string(server.port()) + " " +
            server.dir().string());
    });
    Orphan out;
    out.status = owner.status;
    out.report = owner.report;
    long pid = 0;
    char dir[4096] = {};
    if (std::sscanf(owner.report.c_str(), "%ld %d %4095s", &pid, &out.port, dir) == 3) {
        out.reported = true;
        out.pid = static_cast<pid_t>(pid);
        out.dir = dir;
    }
    return out;
}

}  // namespace testing

IDEM_END_NAMESPACE
