#pragma once
// What the chaos runs' drivers share (driver.cpp: one broker; chain.cpp: two services chained by
// an outbox relay): the exit statuses, the run's directory, reading the run's Redis, the fleet
// of worker processes the driver SIGKILLs and restarts, the SQLite captures.

#include <signal.h>
#include <sqlite3.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "chaos.hpp"
#include "idem/redis/connection.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/process.hpp"

extern char** environ;

namespace chaos::harness {

using SteadyClock = std::chrono::steady_clock;
using namespace std::chrono_literals;

inline volatile sig_atomic_t interrupted = 0;
extern "C" inline void on_interrupt(int) {
    interrupted = 1;
}

/// SIGINT and SIGTERM set `interrupted`; SIGPIPE is ignored.
inline void install_interrupt_handlers() {
    struct sigaction action {};
    action.sa_handler = on_interrupt;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGINT, &action, nullptr);
    ::sigaction(SIGTERM, &action, nullptr);
    ::signal(SIGPIPE, SIG_IGN);
}

constexpr int exit_failed = 1;       // the run proved something wrong (or nothing)
constexpr int exit_harness = 2;      // the harness itself could not do its job
constexpr int exit_not_drained = 3;  // nothing diverged, but the run ended before it drained
constexpr int exit_skip = 77;        // no server here (never in CI)

inline std::string self_executable() {
    std::error_code ec;
    auto path = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (ec) throw std::system_error(ec, "readlink /proc/self/exe");
    return path.string();
}

/// The run's own directory (the SQLite file), removed at the end.
struct RunDir {
    std::filesystem::path path = idem::testing::make_temp_dir("IDEM_CHAOS_TMPDIR", "idem-chaos-");
    RunDir() = default;
    RunDir(const RunDir&) = delete;
    RunDir& operator=(const RunDir&) = delete;
    ~RunDir() {
        std::error_code ignored;
        std::filesystem::remove_all(path, ignored);
    }
};

// ---------------------------------------------------------------------------------------------
// Reading the run's Redis.

inline long long integer_of(const idem::redis::Reply& reply) {
    if (reply.type == idem::redis::Reply::Type::integer) return reply.integer;
    if (reply.is_nil() || reply.str.empty()) return 0;
    return std::stoll(reply.str);
}

inline long long get_int(idem::redis::Connection& redis, const std::string& key) {
    return integer_of(redis.checked({"GET", key}, "GET"));
}

inline std::map<std::string, long long> hash_of(idem::redis::Connection& redis,
                                                const std::string& key) {
    std::map<std::string, long long> out;
    const idem::redis::Reply reply = redis.checked({"HGETALL", key}, "HGETALL");
    for (std::size_t i = 0; i + 1 < reply.elements.size(); i += 2)
        out[reply.elements[i].str] = integer_of(reply.elements[i + 1]);
    return out;
}

/// Every list named by @p keys (LRANGE 0 -1), pipelined.
inline std::vector<std::vector<std::string>> lists_of(idem::redis::Connection& redis,
                                                      const std::vector<std::string>& keys) {
    std::vector<std::vector<std::string>> out;
    out.reserve(keys.size());
    constexpr std::size_t chunk = 500;
    for (std::size_t i = 0; i < keys.size(); i += chunk) {
        std::vector<std::vector<std::string>> commands;
        for (std::size_t k = i; k < std::min(keys.size(), i + chunk); ++k)
            commands.push_back({"LRANGE", keys[k], "0", "-1"});
        for (const idem::redis::Reply& reply : redis.pipeline(commands)) {
            if (reply.is_error()) throw std::runtime_error("LRANGE: " + reply.str);
            std::vector<std::string> items;
            for (const auto& element : reply.elements)
                items.push_back(element.str);
            out.push_back(std::move(items));
        }
    }
    return out;
}

// ---------------------------------------------------------------------------------------------
// The workers.

class Fleet {
  public:
    /// @p count processes of this executable, each started with @p worker_args.
    Fleet(int count, std::vector<std::string> worker_args)
        : count_(count),
          exe_(self_executable()),
          args_(std::move(worker_args)),
          workers_(static_cast<std::size_t>(count)) {
        for (char** e = environ; e != nullptr && *e != nullptr; ++e)
            env_.emplace_back(*e);
    }
    Fleet(const Fleet&) = delete;
    Fleet& operator=(const Fleet&) = delete;
    ~Fleet() { stop(); }

    void start() {
        for (int slot = 0; slot < count_; ++slot)
            spawn(slot);
    }

    /// Restarts every worker that died on its own (a self-kill, or an error).
    void reap() {
        for (int slot = 0; slot < count_; ++slot) {
            Worker& w = workers_[static_cast<std::size_t>(slot)];
            if (w.pid <= 0) continue;
            int status = 0;
            const pid_t r = ::waitpid(w.pid, &status, WNOHANG);
            if (r != w.pid) continue;
            died(slot, status, false);
            spawn(slot);
        }
    }

    /// SIGKILL a random worker at this random moment, then restart it.
    void kill_random(std::mt19937_64& random) {
        const int slot = std::uniform_int_distribution<int>(0, count_ - 1)(random);
        Worker& w = workers_[static_cast<std::size_t>(slot)];
        if (w.pid <= 0) return;
        ::kill(w.pid, SIGKILL);
        ++driver_kills_;
        int status = 0;
        while (::waitpid(w.pid, &status, 0) < 0 && errno == EINTR) {
        }
        died(slot, status, false);
        spawn(slot);
    }

    /// SIGTERM: each worker finishes the entry in hand and exits (SIGKILL after 10 s).
    void stop() {
        for (Worker& w : workers_)
            if (w.pid > 0) ::kill(w.pid, SIGTERM);
        for (int slot = 0; slot < count_; ++slot) {
            Worker& w = workers_[static_cast<std::size_t>(slot)];
            if (w.pid <= 0) continue;
            auto status = idem::testing::wait_for(w.pid, 10s);
            if (!status) {
                errors_.push_back(
                    fmt::format("worker {} (pid {}) did not stop within 10 s", slot, w.pid));
                ::kill(w.pid, SIGKILL);
                status = idem::testing::wait_for(w.pid, 10s);
                w.pid = -1;
                continue;
            }
            died(slot, *status, true);
        }
    }

    [[nodiscard]] int size() const { return count_; }
    [[nodiscard]] long kills() const { return kills_; }
    [[nodiscard]] long driver_kills() const { return driver_kills_; }
    [[nodiscard]] long starts() const { return starts_; }
    [[nodiscard]] const std::vector<std::string>& errors() const { return errors_; }

  private:
    struct Worker {
        pid_t pid = -1;
        int incarnation = 0;
    };

    int count_;
    std::string exe_;
    std::vector<std::string> args_;
    std::vector<std::string> env_;
    std::vector<Worker> workers_;
    long kills_ = 0;
    long driver_kills_ = 0;
    long starts_ = 0;
    std::vector<std::string> errors_;

    void spawn(int slot) {
        if (errors_.size() > 20) return;  // something is badly wrong: do not spin
        Worker& w = workers_[static_cast<std::size_t>(slot)];
        idem::testing::Spawn s;
        s.argv = {exe_};
        s.argv.insert(s.argv.end(), args_.begin(), args_.end());
        s.argv.insert(s.argv.end(),
                      {"--slot", std::to_string(slot), "--incarnation",
                       std::to_string(++w.incarnation), "--parent", std::to_string(::getpid())});
        s.env = env_;
        s.out_fd = STDERR_FILENO;  // a worker's messages (and sanitizer reports) go to our stderr
        w.pid = idem::testing::spawn(s);
        ++starts_;
    }

    void died(int slot, int status, bool stopping) {
        Worker& w = workers_[static_cast<std::size_t>(slot)];
        const pid_t pid = w.pid;
        w.pid = -1;
        if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) {
            ++kills_;
            return;
        }
        if (stopping && ((WIFEXITED(status) && WEXITSTATUS(status) == 0) ||
                         (WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM))) {
            return;
        }
        errors_.push_back(
            WIFEXITED(status)
                ? fmt::format("worker {} (pid {}) exited with status {}", slot, pid,
                              WEXITSTATUS(status))
                : fmt::format("worker {} (pid {}) died of signal {} ({})", slot, pid,
                              WIFSIGNALED(status) ? WTERMSIG(status) : 0,
                              WIFSIGNALED(status) ? strsignal(WTERMSIG(status)) : "?"));
        std::fprintf(stderr, "idem_chaos: %s\n", errors_.back().c_str());
    }
};

// ---------------------------------------------------------------------------------------------
// The captures, as each store holds them: order → gateway references, one per capture row.

using CapturesByOrder = std::map<long, std::vector<std::string>>;

/// The rows of @p table (order_id, gateway_reference) by order.
inline CapturesByOrder sqlite_captures(idem::SqliteStore& store,
                                       const std::string& table = "captures") {
    CapturesByOrder out;
    sqlite3_stmt* stmt = nullptr;
    const std::string select = "SELECT order_id, gateway_reference FROM " + table;
    if (sqlite3_prepare_v2(store.db(), select.c_str(), -1, &stmt, nullptr) != SQLITE_OK) {
        throw std::runtime_error(std::string("SELECT captures: ") + sqlite3_errmsg(store.db()));
    }
    int rc = 0;
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
        out[static_cast<long>(sqlite3_column_int64(stmt, 0))].emplace_back(
            reinterpret_cast<const char*>(sqlite3_column_text(stmt, 1)));
    }
    sqlite3_finalize(stmt);
    if (rc != SQLITE_DONE) throw std::runtime_error("SELECT captures failed");
    return out;
}

/// The arguments of a worker process of the run @p o (this executable with --worker).
inline std::vector<std::string> worker_args(const Options& o, int redis_port, const std::string& db,
                                            const std::string& broker_address) {
    std::vector<std::string> args{"--worker",
                                  "--store",
                                  to_string(o.store),
                                  "--broker",
                                  to_string(o.broker),
                                  "--broker-address",
                                  broker_address,
                                  "--redis-port",
                                  std::to_string(redis_port),
                                  "--db",
                                  db,
                                  "--seed",
                                  std::to_string(o.seed),
                                  "--kill-rate",
                                  fmt::format("{}", o.kill_rate),
                                  "--visibility-ms",
                                  std::to_string(o.visibility.count()),
                                  "--latency-ms",
                                  std::to_string(o.latency.count()),
                                  "--inflight-ms",
                                  std::to_string(o.inflight.count()),
                                  "--max-deliveries",
                                  std::to_string(o.max_deliveries)};
    if (o.backoff_initial.count() >= 0) {
        args.insert(args.end(), {"--backoff-ms", std::to_string(o.backoff_initial.count())});
    }
    if (o.backoff_max.count() >= 0) {
        args.insert(args.end(), {"--backoff-max-ms", std::to_string(o.backoff_max.count())});
    }
    if (o.naive) args.emplace_back("--naive");
    if (o.pipelined) args.emplace_back("--pipelined");
    if (o.offsets_in_store) args.insert(args.end(), {"--offsets", "store"});
    if (o.poll != 1) args.insert(args.end(), {"--poll", std::to_string(o.poll)});
    if (o.batch) args.emplace_back("--batch");
    if (o.redrive) args.emplace_back("--redrive");
    if (o.store_outage.count() > 0) {
        args.insert(args.end(), {"--store-outage-ms", std::to_string(o.store_outage.count())});
    }
    if (o.claim_partition_minutes > 0) {
        args.insert(args.end(),
                    {"--claim-partition-minutes", std::to_string(o.claim_partition_minutes)});
    }
    return args;
}

inline int missing_server(const char* what, const std::string& why) {
    if (idem::testing::running_in_ci()) {
        std::printf("idem_chaos: %s is required in CI (CI=true): %s\n", what, why.c_str());
        return exit_harness;
    }
    std::printf("idem_chaos: skipped: %s not available (set CI=true to make this a failure): %s\n",
                what, why.c_str());
    return exit_skip;
}

}  // namespace chaos::harness
