#pragma once
/// @file
/// @brief idem::testing::MariadbServer: a throwaway MariaDB server for your tests
/// (mariadb-install-db into a fresh temp dir, mariadbd on a free port), and MariadbClient. Link
/// idem::mysql (libmariadb) to use it. POSIX/Linux; no gtest here: with GoogleTest, skip or fail
/// when MariadbServer::available() is false.
///
/// @code
/// #include <idem/testing/mariadb_server.hpp>
/// TEST(CaptureWorker, RedeliveryCapturesOnce) {
///     auto& db = idem::testing::shared_mariadb();       // one per test process, started lazily
///     idem::testing::MariadbClient c = db.client();
///     c.exec("CREATE TABLE captures(order_id VARCHAR(64) PRIMARY KEY)");
///     // ... run your handler twice on the same delivery id ...
///     EXPECT_EQ(c.value("SELECT count(*) FROM captures"), "1");
/// }
/// @endcode
///
/// A throwaway MariaDB server for tests: mariadb-install-db into a fresh temp dir, mariadbd on a
/// free 127.0.0.1 port, a database `idem_test`, user root@127.0.0.1 with an empty password and
/// real authentication (mysql_native_password, no --skip-grant-tables).
///
///   auto& db = idem::testing::shared_mariadb();   // one per test process, started lazily
///   idem::testing::MariadbClient c = db.client();  // or MariadbClient{host, port, "idem_test"}
///   c.exec("CREATE TABLE ...");  c.value("SELECT 1");  // c.query(sql): every row, as text
///   idem::testing::MariadbServer own;              // an independent server (crash tests)
///   own.kill9(); own.start();                      // crash + InnoDB recovery, same port/data
///
/// How it runs:
/// - mariadb-install-db --no-defaults --auth-root-authentication-method=normal --skip-test-db
///   creates <dir>/data (the system tables; root has no password). mariadbd then runs with
///   --no-defaults (no /etc/mysql, no ~/.my.cnf), its own socket <dir>/mysqld.sock, pid file and
///   error log <dir>/mariadbd.log, so it never collides with a system mariadbd.
/// - mariadbd refuses to run as root unless told --user=root: as root both get --user=root
///   (nothing is chowned; the temp dir stays root's). Otherwise they run as the current user.
/// - mariadbd is a direct child of the test process (its own process group, a minimal
///   environment, no inherited descriptors); its stdout/stderr go to the error log too (what it
///   says before it opens the log: bad options, "run as root").
/// - Durability is the server's default (InnoDB, innodb_flush_log_at_trx_commit=1, doublewrite):
///   a committed row survives kill9(). Only the sizes are small (16 MB buffer pool, 8 MB redo
///   log) and the binary log is off.
/// - Ready means: a libmariadb connection over TCP to 127.0.0.1:port answers `SELECT @@datadir`
///   with our data dir (so a port collision with another server cannot fool us). A port taken
///   between the probe and the bind is retried on a new port (on the same port by start()).
/// - A Watchdog (process.hpp) stops the server and removes the dir if the test process dies
///   without running destructors. The life cycle (ports, restart, cleanup) is ServerProcess's
///   (server_process.hpp), shared with PostgresServer and RedisServer.
/// Not thread-safe for concurrent start/stop/kill9; a MariadbClient belongs to one thread at a
/// time (one connection each).

#include <mysql.h>
#include <pwd.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/testing/process.hpp"
#include "idem/testing/server_process.hpp"

IDEM_BEGIN_NAMESPACE

namespace testing {

namespace detail {

/// mysql_library_init once, before any thread calls mysql_init (which is not thread-safe the
/// first time).
inline void library_init() {
    static const bool ok = mysql_library_init(0, nullptr, nullptr) == 0;
    if (!ok) throw std::runtime_error("MariadbClient: mysql_library_init failed");
}

}  // namespace detail

/// A minimal synchronous client for tests (libmariadb's C API, over TCP). Connects on first use;
/// a connection the server closed while it was idle (a stop, kill9 or restart in between) is
/// replaced before the next statement is sent, as is one a client error (2000-2999) broke. A
/// statement whose connection breaks in flight throws and is never retried (it may or may not
/// have run); its session (an open transaction, SET SESSION ...) is gone either way. Statements may
/// be several, split by ';' (CLIENT_MULTI_STATEMENTS). Every call throws std::runtime_error with
/// the server's message and error number on failure.
class MariadbClient {
  public:
    using Row = std::vector<std::optional<std::string>>;  ///< NULL -> nullopt

    MariadbClient(std::string host, int port, std::string database = "idem_test",
                  std::string user = "root", std::chrono::seconds timeout = std::chrono::seconds(5))
        : host_(std::move(host)),
          port_(port),
          database_(std::move(database)),
          user_(std::move(user)),
          timeout_(timeout) {}

    /// The rows of the last statement that returned any (empty when none did), as text.
    std::vector<Row> query(const std::string& sql) {
        if (conn_ && closed_by_peer()) conn_.reset();
        if (!conn_) connect();
        MYSQL* c = conn_.get();
        if (mysql_real_query(c, sql.data(), static_cast<unsigned long>(sql.size())) != 0) {
            fail(sql);
        }
        std::vector<Row> rows;
        for (;;) {
            if (MYSQL_RES* res = mysql_store_result(c); res != nullptr) {
                const std::unique_ptr<MYSQL_RES, ResultFree> owned{res};
                rows.clear();
                const unsigned int fields = mysql_num_fields(res);
                while (MYSQL_ROW row = mysql_fetch_row(res)) {
                    const unsigned long* lengths = mysql_fetch_lengths(res);
                    Row out;
                    for (unsigned int i = 0; i < fields; ++i) {
                        if (row[i] == nullptr) {
                            out.emplace_back();
                        } else {
                            out.emplace_back(std::string(row[i], lengths[i]));
                        }
                    }
                    rows.push_back(std::move(out));
                }
            } else if (mysql_field_count(c) != 0) {
                fail(sql);  // a result set that could not be read
            }
            const int next = mysql_next_result(c);
            if (next < 0) break;
            if (next > 0) fail(sql);
        }
        return rows;
    }

    /// Any statement(s); rows are read and dropped.
    void exec(const std::string& sql) { (void)query(sql); }

    /// First column of the first row (NULL -> nullopt); throws when there is no row.
    std::optional<std::string> value(const std::string& sql) {
        const auto rows = query(sql);
        if (rows.empty() || rows.front().empty()) {
            throw std::runtime_error("MariadbClient: no row (SQL: " + sql + ")");
        }
        return rows.front().front();
    }

    [[nodiscard]] bool connected() const { return conn_ != nullptr; }
    void disconnect() noexcept { conn_.reset(); }

    /// The server's id of this connection (CONNECTION_ID()); 0 when not connected.
    [[nodiscard]] unsigned long thread_id() const {
        return conn_ ? mysql_thread_id(conn_.get()) : 0;
    }

  private:
    struct ConnClose {
        void operator()(MYSQL* c) const noexcept { mysql_close(c); }
    };
    struct ResultFree {
        void operator()(MYSQL_RES* r) const noexcept { mysql_free_result(r); }
    };

    std::string host_;
    int port_;
    std::string database_;
    std::string user_;
    std::chrono::seconds timeout_;
    std::unique_ptr<MYSQL, ConnClose> conn_;

    std::string where() const {
        return user_ + "@" + host_ + ":" + std::to_string(port_) + "/" + database_;
    }

    void connect() {
        detail::library_init();
        std::unique_ptr<MYSQL, ConnClose> conn{mysql_init(nullptr)};
        if (!conn) throw std::runtime_error("MariadbClient: mysql_init: out of memory");
        const unsigned int seconds = static_cast<unsigned int>(timeout_.count());
        const unsigned int protocol = MYSQL_PROTOCOL_TCP;
        // Without read/write timeouts a stopped (SIGSTOP) server would hang the test forever.
        mysql_options(conn.get(), MYSQL_OPT_CONNECT_TIMEOUT, &seconds);
        mysql_options(conn.get(), MYSQL_OPT_READ_TIMEOUT, &seconds);
        mysql_options(conn.get(), MYSQL_OPT_WRITE_TIMEOUT, &seconds);
        mysql_options(conn.get(), MYSQL_OPT_PROTOCOL, &protocol);
        mysql_options(conn.get(), MYSQL_SET_CHARSET_NAME, "utf8mb4");
        const char* db = database_.empty() ? nullptr : database_.c_str();
        if (mysql_real_connect(conn.get(), host_.c_str(), user_.c_str(), "", db,
                               static_cast<unsigned int>(port_), nullptr,
                               CLIENT_MULTI_STATEMENTS) == nullptr) {
            throw std::runtime_error("MariadbClient: connect " + where() + ": " +
                                     mysql_error(conn.get()) + " (" +
                                     std::to_string(mysql_errno(conn.get())) + ")");
        }
        conn_ = std::move(conn);
    }

    /// EOF or a reset pending on the idle socket (the server stopped or died since the last
    /// statement): nothing was sent yet, so connecting again is safe.
    bool closed_by_peer() const {
        const my_socket fd = mysql_get_socket(conn_.get());
        if (fd == MARIADB_INVALID_SOCKET) return true;
        char byte = 0;
        const ssize_t n = ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0) return true;
        return n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
    }

    /// Throws the connection's error; a client-side error (2000-2999: the connection broke)
    /// drops the connection so the next call reconnects.
    [[noreturn]] void fail(const std::string& sql) {
        const unsigned int code = mysql_errno(conn_.get());
        const std::string msg = std::string(mysql_error(conn_.get())) + " (" +
                                std::to_string(code) + ") on " + where() + " (SQL: " + sql + ")";
        if (code >= 2000 && code < 3000) conn_.reset();
        throw std::runtime_error("MariadbClient: " + msg);
    }
};

namespace detail {

struct Binaries {
    std::filesystem::path install_db;  // empty when not found
    std::filesystem::path mariadbd;    // empty when not found
    std::string why;                   // reason when not found
};

/// IDEM_TEST_MARIADB_INSTALL_DB and IDEM_TEST_MARIADBD (full paths), else mariadb-install-db and
/// mariadbd in PATH, /usr/bin, /usr/sbin, /usr/local/bin (find_program()).
inline Binaries find_binaries() {
    constexpr const char* hint = "Debian: mariadb-server libmariadb-dev";
    const auto install_db =
        find_program("mariadb-install-db", "IDEM_TEST_MARIADB_INSTALL_DB", hint);
    const auto mariadbd = find_program("mariadbd", "IDEM_TEST_MARIADBD", hint);
    Binaries out{install_db.path, mariadbd.path, install_db.why};
    if (!mariadbd.why.empty()) out.why += (out.why.empty() ? "" : "; ") + mariadbd.why;
    return out;
}

/// --user=<name> for mariadb-install-db and mariadbd when we are root (mariadbd refuses root
/// without it); nothing otherwise (they run as the current user, and --user would only warn).
inline std::vector<std::string> user_args() {
    if (::geteuid() != 0) return {};
    std::vector<char> buf(16384);
    passwd pw{};
    passwd* found = nullptr;
    if (::getpwuid_r(::geteuid(), &pw, buf.data(), buf.size(), &found) != 0 || found == nullptr) {
        return {"--user=root"};
    }
    return {std::string("--user=") + pw.pw_name};
}

}  // namespace detail

class MariadbServer : public ServerProcess {
  public:
    /// Whether mariadb-install-db and mariadbd exist; @p why says where it looked when not.
    static bool available(std::string* why = nullptr) {
        const auto found = detail::find_binaries();
        if (found.why.empty()) return true;
        if (why != nullptr) *why = found.why;
        return false;
    }

    /// mariadb-install-db + start + CREATE DATABASE idem_test. Throws std::runtime_error with the
    /// log's tail.
    MariadbServer() : ServerProcess(traits()) {
        const auto found = detail::find_binaries();
        if (!found.why.empty()) throw std::runtime_error("MariadbServer: " + found.why);
        install_db_ = found.install_db;
        mariadbd_ = found.mariadbd;
        adopt_dir(make_temp_dir("IDEM_TEST_MARIADB_TMPDIR", "idem-mariadb-"));
        if (socket_path().string().size() >= sizeof(sockaddr_un{}.sun_path)) {
            throw std::runtime_error("MariadbServer: socket path " + socket_path().string() +
                                     " is too long for a unix socket; set IDEM_TEST_MARIADB_TMPDIR"
                                     " to a shorter dir");
        }
        std::filesystem::create_directories(tmp_dir());
        // What mariadb-install-db makes, from a template made once per machine.
        copy_of_template("mariadb-" + std::to_string(std::hash<std::string>{}(install_db_.string() +
                                                                              mariadbd_.string())),
                         "IDEM_TEST_MARIADB_TMPDIR", data_dir(), RunAs{},
                         [this](const std::filesystem::path& data) { install_db(data); });
        start_on_free_port();
        client("").exec("CREATE DATABASE idem_test");
    }

    // ~ServerProcess: SIGTERM (a clean shutdown; SIGKILL after 10 s), then the temp dir is
    // removed. Never throws. port(), pid(), running(), dir(), log_file() (mariadbd.log),
    // log_tail(): ServerProcess's. start(): again on the same port and data dir (after stop() or
    // kill9(): InnoDB crash recovery). kill9(): SIGKILL; clients see their connections drop.

    [[nodiscard]] std::string host() const { return "127.0.0.1"; }
    [[nodiscard]] std::string user() const { return "root"; }
    [[nodiscard]] std::filesystem::path data_dir() const { return dir() / "data"; }
    [[nodiscard]] std::filesystem::path socket_path() const { return dir() / "mysqld.sock"; }

    /// A new client for @p database ("": none) of this server (it connects on first use).
    [[nodiscard]] MariadbClient client(const std::string& database = "idem_test") const {
        return MariadbClient{host(), port(), database, user()};
    }

    /// Clean shutdown (SIGTERM: InnoDB flushes and shuts down). No-op when stopped.
    void stop() { stop_with(SIGTERM, std::chrono::seconds(60)); }

  private:
    std::filesystem::path install_db_;
    std::filesystem::path mariadbd_;

    static Traits traits() {
        Traits t;
        t.fixture = "MariadbServer";
        t.program = "mariadbd";
        t.log = "mariadbd.log";  // --log-error without an extension would get ".err" appended
        t.port_busy = {"Address already in use", "Bind on TCP/IP port"};
        t.ready_within = std::chrono::seconds(60);
        t.ready_poll = std::chrono::milliseconds(10);
        t.quit_signal = SIGTERM;
        t.quit_signal_name = "TERM";
        t.quit_grace = std::chrono::seconds(10);
        t.hard_kill = &ServerProcess::kill_group_and_reap;
        return t;
    }

    std::vector<std::string> child_env() const {
        return {"PATH=/usr/bin:/bin:/usr/sbin:/sbin", "LC_ALL=C", "LANG=C", "TZ=UTC",
                "HOME=" + dir().string()};
    }

    /// The InnoDB sizes: the same for mariadb-install-db's bootstrap and every start.
    static std::vector<std::string> innodb_args() {
        return {"--innodb-buffer-pool-size=16M", "--innodb-log-file-size=8M",
                "--innodb-log-buffer-size=1M",
                // ibtmp1 is otherwise written full (12 MB) on every start
                "--innodb-temp-data-file-path=ibtmp1:1M:autoextend",
                // io_uring/libaio may be denied in containers (seccomp); tmpfs gains nothing
                "--innodb-use-native-aio=OFF"};
    }

    /// Our own tmpdir: the bootstrap's temporary tables are named by pid and counter, and two
    /// installs sharing /tmp (parallel test binaries) were seen to delete each other's.
    [[nodiscard]] std::filesystem::path tmp_dir() const { return dir() / "tmp"; }

    /// What the bootstrap and the server are started with alike: the user and InnoDB options,
    /// the environment, our dir, the log, a process group of their own.
    void prepare_spawn(Spawn& s, int log) const {
        for (auto& a : detail::user_args())
            s.argv.push_back(std::move(a));
        for (auto& a : innodb_args())
            s.argv.push_back(std::move(a));
        s.env = child_env();
        s.cwd = dir();
        s.out_fd = log;
        s.new_process_group = true;
    }

    void install_db(const std::filesystem::path& data) {
        const int log = open_log("install-db.log");
        Spawn s;
        s.argv = {install_db_.string(),
                  "--no-defaults",
                  "--datadir=" + data.string(),
                  "--tmpdir=" + tmp_dir().string(),
                  "--auth-root-authentication-method=normal",
                  "--skip-test-db",
                  "--skip-name-resolve",
                  "--skip-log-bin"};
        prepare_spawn(s, log);
        const pid_t pid = spawn_handing_over(s, log);
        const auto status = wait_for(pid, std::chrono::seconds(120));
        if (!status) kill_group_and_reap(pid);
        if (!status || !WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
            throw std::runtime_error("MariadbServer: mariadb-install-db failed: " +
                                     tail(read_text(dir() / "install-db.log")));
        }
    }

    /// Starts mariadbd on `port` and waits until it answers as ours. false + *port_busy when the
    /// port was taken; throws on other failures.
    bool launch(int port, bool* port_busy) override {
        *port_busy = false;
        const auto log_offset = log_size();
        const int log = open_log();
        Spawn s;
        s.argv = {mariadbd_.string(),
                  "--no-defaults",
                  "--datadir=" + data_dir().string(),
                  "--tmpdir=" + tmp_dir().string(),
                  "--port=" + std::to_string(port),
                  "--bind-address=127.0.0.1",
                  "--socket=" + socket_path().string(),
                  "--pid-file=" + (dir() / "mariadbd.pid").string(),
                  "--log-error=" + log_file().string(),
                  "--skip-log-bin",
                  "--skip-name-resolve",
                  "--character-set-server=utf8mb4",
                  "--collation-server=utf8mb4_general_ci",
                  "--max-connections=100",
                  "--innodb-buffer-pool-load-at-startup=OFF",
                  "--innodb-buffer-pool-dump-at-shutdown=OFF"};
        prepare_spawn(s, log);
        const pid_t pid = spawn_handing_over(s, log);

        MariadbClient probe{host(), port, "", user(), std::chrono::seconds(1)};
        if (!await_ready(pid, port, log_offset, [&] { return answers_as_ours(probe); })) {
            *port_busy = true;
            return false;
        }
        return true;
    }

    /// `SELECT @@datadir` names our data dir (mariadbd accepts connections only once InnoDB
    /// recovery is done).
    bool answers_as_ours(MariadbClient& probe) const {
        try {
            const auto datadir = probe.value("SELECT @@datadir");
            std::error_code ec;
            return datadir && std::filesystem::equivalent(*datadir, data_dir(), ec);
        } catch (const std::exception&) {
            probe.disconnect();
            return false;
        }
    }
};

/// One server per test process (shared_server()). Tests that stop or crash a server should use
/// their own MariadbServer, not this one.
inline MariadbServer& shared_mariadb() {
    return shared_server<MariadbServer>("MariaDB");
}

}  // namespace testing

IDEM_END_NAMESPACE
