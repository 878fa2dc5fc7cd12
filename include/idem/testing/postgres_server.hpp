#pragma once
/// @file
/// @brief idem::testing::PostgresServer: a throwaway PostgreSQL cluster for your tests (initdb
/// into a fresh temp dir, a postmaster on a free port). Link idem::postgres (libpq) to use it.
/// POSIX/Linux; no gtest here: with GoogleTest, skip or fail when PostgresServer::available() is
/// false.
///
/// @code
/// #include <idem/testing/postgres_server.hpp>
/// TEST(CaptureWorker, RedeliveryCapturesOnce) {
///     auto& pg = idem::testing::shared_postgres();      // one per test process, started lazily
///     const std::string db = pg.fresh_database();       // a database of this test's own
///     pg.exec("CREATE TABLE captures(order_id TEXT PRIMARY KEY)", db);
///     idem::PostgresStore store{pg.conninfo(db)};
///     // ... run your handler twice on the same delivery id, then count the captures ...
/// }
/// @endcode
///
/// A throwaway PostgreSQL cluster for tests: initdb into a fresh temp dir, a postmaster on a free
/// 127.0.0.1 port, a database `idem_test`, superuser `idem` with trust auth.
///
///   auto& pg = idem::testing::shared_postgres();          // one per test process, started lazily
///   PGconn* c = pg.connect();  ...  PQfinish(c);       // or pg.exec("CREATE TABLE ...")
///   idem::testing::PostgresServer own;                     // an independent cluster (crash tests)
///   own.kill9(); own.start();                          // crash + recovery, same port and data
///
/// How it runs:
/// - initdb and postgres refuse to run as root. As root they run as the `postgres` system user
///   (fork + setgid/setuid, the temp dir chowned to it); otherwise as the current user.
/// - The postmaster is a direct child of the test process (its own process group, a minimal
///   environment, no inherited descriptors); stdout/stderr go to <dir>/server.log.
/// - Ready means: postmaster.pid says "ready" (as `pg_ctl -w` checks) and a libpq connection to
///   our own data directory works (so a port collision with another cluster cannot fool us).
/// - A port taken between the probe and the postmaster's bind is retried on a new port.
/// - A Watchdog (process.hpp): if the test process dies without running destructors (crash,
///   abort, SIGKILL, ctest timeout), it stops the postmaster and removes the temp dir. The life
///   cycle (ports, restart, cleanup) is ServerProcess's (server_process.hpp), shared with
///   RedisServer.
/// Not thread-safe for concurrent start/stop/kill9; conninfo()/connect()/exec() are.

#include <libpq-fe.h>
#include <pwd.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/testing/process.hpp"
#include "idem/testing/server_process.hpp"

IDEM_BEGIN_NAMESPACE

namespace testing {

/// unique_ptr deleter for PGconn (`PgConnection c{server.connect()};`).
struct PgConnCloser {
    void operator()(PGconn* conn) const noexcept { PQfinish(conn); }
};
using PgConnection = std::unique_ptr<PGconn, PgConnCloser>;

namespace detail {

inline bool has_server_binaries(const std::filesystem::path& dir) {
    return is_executable(dir / "initdb") && is_executable(dir / "postgres");
}

struct BinDirResult {
    std::filesystem::path dir;  // empty when not found
    std::string why;            // reason when not found
};

/// IDEM_TEST_PG_BINDIR, else `pg_config --bindir`, else the newest /usr/lib/postgresql/*/bin.
inline BinDirResult find_bindir() {
    std::vector<std::string> tried;
    if (const char* env = std::getenv("IDEM_TEST_PG_BINDIR"); env != nullptr && *env != '\0') {
        if (has_server_binaries(env)) return {env, {}};
        return {{}, std::string("IDEM_TEST_PG_BINDIR=") + env + " has no initdb/postgres"};
    }
    if (FILE* pipe = ::popen("pg_config --bindir 2>/dev/null", "r"); pipe != nullptr) {
        std::string out;
        char buf[512];
        while (std::fgets(buf, sizeof buf, pipe) != nullptr)
            out += buf;
        ::pclose(pipe);
        out = trim(out);
        if (!out.empty()) {
            if (has_server_binaries(out)) return {out, {}};
            tried.push_back(out + " (from pg_config --bindir)");
        }
    }
    std::vector<std::pair<int, std::filesystem::path>> candidates;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator("/usr/lib/postgresql", ec)) {
        const std::string name = entry.path().filename().string();
        int version = 0;
        try {
            version = std::stoi(name);
        } catch (const std::exception&) {
            continue;
        }
        candidates.emplace_back(version, entry.path() / "bin");
    }
    std::sort(candidates.rbegin(), candidates.rend());
    for (const auto& [version, dir] : candidates) {
        if (has_server_binaries(dir)) return {dir, {}};
        tried.push_back(dir.string());
    }
    tried.push_back("/usr/lib/postgresql/*/bin");
    std::string why = "PostgreSQL server binaries (initdb, postgres) not found; looked in:";
    for (const auto& t : tried)
        why += " " + t;
    why += ". Install them with scripts/deps.sh (Debian: postgresql libpq-dev)";
    return {{}, why};
}

inline const BinDirResult& bindir() {
    static const BinDirResult result = find_bindir();
    return result;
}

/// Who runs initdb/postgres: the `postgres` user when we are root, else ourselves.
inline RunAs run_as() {
    RunAs r;
    if (::geteuid() != 0) return r;
    const char* name = std::getenv("IDEM_TEST_PG_USER");
    if (name == nullptr || *name == '\0') name = "postgres";
    std::vector<char> buf(16384);
    passwd pw{};
    passwd* found = nullptr;
    if (::getpwnam_r(name, &pw, buf.data(), buf.size(), &found) != 0 || found == nullptr) {
        r.why = std::string("running as root, and initdb/postgres refuse root, but there is no '") +
                name + "' user to run them as (Debian's postgresql package creates it)";
        return r;
    }
    if (pw.pw_uid == 0) {
        r.why = std::string("user '") + name + "' is root; initdb/postgres refuse root";
        return r;
    }
    r.switch_user = true;
    r.uid = pw.pw_uid;
    r.gid = pw.pw_gid;
    return r;
}

/// The children of pid, from /proc (postgres backends are their own session leaders, so a
/// process-group kill does not reach them).
inline std::vector<pid_t> children_of(pid_t parent) {
    std::vector<pid_t> out;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
        const std::string name = entry.path().filename().string();
        if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
        std::ifstream stat(entry.path() / "stat");
        std::string content((std::istreambuf_iterator<char>(stat)),
                            std::istreambuf_iterator<char>());
        const auto close_paren = content.rfind(')');
        if (close_paren == std::string::npos) continue;
        std::istringstream rest(content.substr(close_paren + 2));
        char state = 0;
        long ppid = 0;
        rest >> state >> ppid;
        if (ppid == parent) out.push_back(static_cast<pid_t>(std::stol(name)));
    }
    return out;
}

}  // namespace detail

class PostgresServer : public ServerProcess {
  public:
    enum class StopMode { fast, immediate };

    /// Whether initdb/postgres exist (and, as root, a user to run them as). Cheap; cached.
    static bool available(std::string* why = nullptr) {
        const auto& bin = detail::bindir();
        if (bin.dir.empty()) {
            if (why != nullptr) *why = bin.why;
            return false;
        }
        const auto user = detail::run_as();
        if (!user.why.empty()) {
            if (why != nullptr) *why = user.why;
            return false;
        }
        return true;
    }

    /// initdb + start + CREATE DATABASE idem_test. Throws std::runtime_error with the log's tail.
    PostgresServer() : ServerProcess(traits()) {
        std::string why;
        if (!available(&why)) throw std::runtime_error("PostgresServer: " + why);
        bindir_ = detail::bindir().dir;
        user_ = detail::run_as();
        adopt_dir(make_temp_dir("IDEM_TEST_PG_TMPDIR", "idem-pg-", user_.switch_user));
        if (user_.switch_user && ::chown(dir().c_str(), user_.uid, user_.gid) != 0) {
            throw std::system_error(errno, std::generic_category(), "chown " + dir().string());
        }
        // The cluster initdb makes, from a template made once per machine (copy_of_template).
        copy_of_template("pg-" + std::to_string(std::hash<std::string>{}(bindir_.string())),
                         "IDEM_TEST_PG_TMPDIR", data_dir(), user_,
                         [this](const std::filesystem::path& data) { initdb(data); });
        start_on_free_port();
        exec("CREATE DATABASE idem_test", "postgres");
    }

    // ~ServerProcess: immediate shutdown (SIGQUIT, like `pg_ctl stop -m immediate`), then the
    // temp dir is removed. port(), running(), dir(), log_file() (server.log), log_tail():
    // ServerProcess's. start(): again on the same port and data dir (after stop() or kill9();
    // crash recovery runs after kill9). kill9(): a crash, see hard_kill(); clients see their
    // connections drop.

    [[nodiscard]] pid_t postmaster_pid() const { return pid(); }
    [[nodiscard]] std::filesystem::path data_dir() const { return dir() / "data"; }

    [[nodiscard]] std::string conninfo(const std::string& dbname = "idem_test") const {
        return "host=127.0.0.1 port=" + std::to_string(port()) + " user=idem dbname=" + dbname;
    }

    /// A new connection (the caller PQfinish'es it, or wraps it in PgConnection). Throws.
    [[nodiscard]] PGconn* connect(const std::string& dbname = "idem_test") const {
        PGconn* conn = PQconnectdb(conninfo(dbname).c_str());
        if (PQstatus(conn) != CONNECTION_OK) {
            std::string msg = trim(PQerrorMessage(conn));
            PQfinish(conn);
            throw std::runtime_error("PostgresServer: connect(" + conninfo(dbname) + "): " + msg);
        }
        PQsetNoticeProcessor(
            conn, [](void*, const char*) {}, nullptr);
        return conn;
    }

    /// Runs SQL (one or more statements) on a fresh connection; throws with the server message.
    void exec(const std::string& sql, const std::string& dbname = "idem_test") const {
        PgConnection conn{connect(dbname)};
        PGresult* res = PQexec(conn.get(), sql.c_str());
        const auto status = PQresultStatus(res);
        if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK) {
            std::string msg = trim(PQerrorMessage(conn.get()));
            PQclear(res);
            throw std::runtime_error("PostgresServer: " + msg + " (SQL: " + sql + ")");
        }
        PQclear(res);
    }

    /// First column of the first row as text (NULL -> nullopt); throws on error or no row.
    [[nodiscard]] std::optional<std::string> query_value(
        const std::string& sql, const std::string& dbname = "idem_test") const {
        PgConnection conn{connect(dbname)};
        PGresult* res = PQexec(conn.get(), sql.c_str());
        if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) < 1 || PQnfields(res) < 1) {
            std::string msg = PQresultStatus(res) == PGRES_TUPLES_OK
                                  ? std::string("no row")
                                  : trim(PQerrorMessage(conn.get()));
            PQclear(res);
            throw std::runtime_error("PostgresServer: " + msg + " (SQL: " + sql + ")");
        }
        std::optional<std::string> value;
        if (PQgetisnull(res, 0, 0) == 0) value = PQgetvalue(res, 0, 0);
        PQclear(res);
        return value;
    }

    /// CREATE DATABASE with a new unique name (idem_t1, idem_t2, ...); returns the name.
    std::string fresh_database() {
        static std::atomic<int> counter{0};
        std::string name = "idem_t" + std::to_string(++counter);
        exec("DROP DATABASE IF EXISTS " + name, "postgres");
        exec("CREATE DATABASE " + name, "postgres");
        return name;
    }

    /// Clean shutdown (fast: SIGINT, checkpoint; immediate: SIGQUIT). No-op when stopped.
    void stop(StopMode mode = StopMode::fast) {
        stop_with(mode == StopMode::fast ? SIGINT : SIGQUIT, std::chrono::seconds(60));
    }

  private:
    std::filesystem::path bindir_;
    RunAs user_;

    static Traits traits() {
        Traits t;
        t.fixture = "PostgresServer";
        t.program = "postgres";
        t.log = "server.log";
        t.port_busy = {"could not bind", "Address already in use",
                       "could not create any TCP/IP sockets"};
        t.ready_within = std::chrono::seconds(60);
        t.ready_poll = std::chrono::milliseconds(5);
        t.quit_signal = SIGQUIT;  // postgres: SIGQUIT is an immediate shutdown
        t.quit_signal_name = "QUIT";
        t.quit_grace = std::chrono::seconds(10);
        t.hard_kill = &PostgresServer::hard_kill;
        return t;
    }

    std::vector<std::string> child_env() const {
        std::vector<std::string> env{"PATH=/usr/bin:/bin", "LC_ALL=C", "LANG=C", "TZ=UTC",
                                     "HOME=" + dir().string()};
        return env;
    }

    void initdb(const std::filesystem::path& data) {
        const int log = open_log("initdb.log");
        Spawn s;
        s.argv = {(bindir_ / "initdb").string(),
                  "-D",
                  data.string(),
                  "-U",
                  "idem",
                  "--auth=trust",
                  "--no-sync",
                  "--encoding=UTF8",
                  "--locale=C"};
        s.env = child_env();
        s.cwd = dir();
        s.out_fd = log;
        s.user = &user_;
        const pid_t pid = spawn_handing_over(s, log);
        const auto status = wait_for(pid, std::chrono::seconds(120));
        if (!status) {
            ::kill(pid, SIGKILL);
            wait_for(pid, std::chrono::seconds(5));
        }
        if (!status || !WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
            throw std::runtime_error("PostgresServer: initdb failed: " +
                                     tail(read_text(dir() / "initdb.log")));
        }
    }

    /// Starts the postmaster on `port` and waits until it is ready. false + *port_busy when the
    /// port was taken; throws on other failures.
    bool launch(int port, bool* port_busy) override {
        *port_busy = false;
        const auto log_offset = log_size();
        const int log = open_log();
        Spawn s;
        s.argv = {(bindir_ / "postgres").string(),
                  "-D",
                  data_dir().string(),
                  "-p",
                  std::to_string(port),
                  "-c",
                  "listen_addresses=127.0.0.1",
                  "-c",
                  "unix_socket_directories=",
                  "-c",
                  "fsync=off",
                  "-c",
                  "full_page_writes=off",
                  "-c",
                  "shared_buffers=16MB",
                  "-c",
                  "max_connections=50",
                  "-c",
                  "huge_pages=off",
                  "-c",
                  "autovacuum=off",
                  "-c",
                  "max_wal_size=256MB"};
        s.env = child_env();
        s.cwd = dir();
        s.out_fd = log;
        s.user = &user_;
        s.new_process_group = true;
        const pid_t pid = spawn_handing_over(s, log);
        if (!await_ready(pid, port, log_offset, [&] { return postmaster_ready(pid); })) {
            *port_busy = true;
            return false;
        }
        // The port answers; make sure it is our cluster, not another one that won the port.
        try {
            const auto data = query_value("SHOW data_directory", "postgres");
            std::error_code ec;
            if (!data || !std::filesystem::equivalent(*data, data_dir(), ec)) {
                throw std::runtime_error("port " + std::to_string(port) +
                                         " is served by another cluster (" + data.value_or("?") +
                                         ")");
            }
        } catch (...) {
            kill9();
            throw;
        }
        return true;
    }

    /// postmaster.pid's status line (line 8) says "ready" and names our pid.
    bool postmaster_ready(pid_t pid) const {
        std::ifstream in(data_dir() / "postmaster.pid");
        if (!in) return false;
        std::vector<std::string> lines;
        for (std::string line; std::getline(in, line);)
            lines.push_back(line);
        if (lines.size() < 8) return false;
        if (trim(lines[0]) != std::to_string(pid)) return false;
        return lines[7].rfind("ready", 0) == 0;
    }

    /// SIGSTOP the postmaster (no new children), SIGKILL it and its children, wait for all.
    static void hard_kill(pid_t pid) noexcept {
        try {
            ::kill(pid, SIGSTOP);
            const auto children = detail::children_of(pid);
            ::kill(pid, SIGKILL);
            for (pid_t child : children)
                ::kill(child, SIGKILL);
            wait_for(pid, std::chrono::seconds(10));
            const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
            for (pid_t child : children) {
                while (!process_gone(child) && std::chrono::steady_clock::now() < deadline) {
                    std::this_thread::sleep_for(std::chrono::milliseconds(2));
                }
            }
        } catch (...) {
        }
    }
};

/// One server per test process (shared_server()); a failed start is not retried (no second
/// initdb). Tests that stop or crash a server should use their own PostgresServer, not this one.
inline PostgresServer& shared_postgres() {
    return shared_server<PostgresServer>("PostgreSQL");
}

}  // namespace testing

IDEM_END_NAMESPACE
