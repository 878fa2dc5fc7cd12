#pragma once
/// @file
/// @brief idem::testing::RedisServer: a throwaway redis-server for your tests, and
/// RedisClient, a small synchronous client. Link idem::redis (hiredis) to use it. POSIX/Linux; no
/// gtest here: with GoogleTest, skip or fail when RedisServer::available() is false.
///
/// @code
/// #include <idem/testing/redis_server.hpp>
/// TEST(CaptureWorker, RedeliveryCapturesOnce) {
///     auto& redis = idem::testing::shared_redis();    // one per test process, started lazily
///     idem::RedisStore store{idem::RedisEndpoint{redis.host(), redis.port()}};
///     // ... run your handler twice on the same delivery id ...
///     EXPECT_EQ(redis.client().integer({"GET", "captures"}), 1);
/// }
/// @endcode
///
/// A throwaway redis-server for tests: a free 127.0.0.1 port, a fresh temp data dir (/dev/shm when
/// roomy), AOF with `appendfsync always` (every acknowledged write survives kill -9), no RDB
/// snapshots.
///
///   auto& redis = idem::testing::shared_redis();           // one per test process, started lazily
///   idem::testing::RedisClient c = redis.client();          // or RedisClient{redis.host(), port}
///   c.exec({"SET", key, value});  c.str({"GET", key});  // binary-safe arguments and replies
///   idem::testing::RedisServer own;                         // an independent server (crash tests)
///   own.kill9(); own.start();                           // crash + AOF replay, same port and data
///   idem::testing::RedisServer volatile_one{idem::testing::RedisServer::no_aof};  // appendonly no
///
/// How it runs:
/// - redis-server is a direct child of the test process (its own process group, a minimal
///   environment, no inherited descriptors), configured on its command line; its log and its
///   stdout/stderr go to <dir>/redis.log.
/// - Ready means: PING answers PONG and `CONFIG GET dir` names our data dir (so a port collision
///   with another server cannot fool us). A port taken between the probe and the bind is retried
///   on a new port (on the same port by start()).
/// - A Watchdog (process.hpp) stops the server and removes the dir if the test process dies
///   without running destructors. The life cycle (ports, restart, cleanup) is ServerProcess's
///   (server_process.hpp), shared with PostgresServer.
/// Not thread-safe for concurrent start/stop/kill9; a RedisClient belongs to one thread at a time.

#include <hiredis/hiredis.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
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

/// A minimal synchronous client for tests (hiredis). Connects on first use; a connection the
/// server closed while it was idle (a stop, kill9 or restart in between) is replaced before the
/// next command is sent. A command whose connection breaks in flight throws and is never retried
/// (it may or may not have run). Every call throws std::runtime_error on a connection failure or
/// an error reply.
class RedisClient {
  public:
    RedisClient(std::string host, int port,
                std::chrono::milliseconds timeout = std::chrono::seconds(5))
        : host_(std::move(host)), port_(port), timeout_(timeout) {}

    /// An integer reply (or a string reply holding an integer, as GET of a counter); nil ->
    /// nullopt.
    std::optional<long long> integer(const std::vector<std::string>& args) {
        const Reply reply = command(args);
        switch (reply->type) {
            case REDIS_REPLY_INTEGER:
                return reply->integer;
            case REDIS_REPLY_NIL:
                return std::nullopt;
            case REDIS_REPLY_STRING:
            case REDIS_REPLY_STATUS: {
                const std::string text(reply->str, reply->len);
                std::size_t used = 0;
                long long value = 0;
                try {
                    value = std::stoll(text, &used);
                } catch (const std::exception&) {
                    used = 0;
                }
                if (used == text.size() && used > 0) return value;
                throw std::runtime_error("RedisClient: " + args.front() +
                                         " replied a non-integer string: " + text);
            }
            default:
                throw unexpected(args, reply.get());
        }
    }

    /// A bulk or status string (an integer reply as its decimal text); nil -> nullopt.
    std::optional<std::string> str(const std::vector<std::string>& args) {
        const Reply reply = command(args);
        if (reply->type == REDIS_REPLY_NIL) return std::nullopt;
        if (auto text = scalar(reply.get())) return text;
        throw unexpected(args, reply.get());
    }

    /// A flat array of strings (integers as decimal text, nil elements as nullopt); a nil reply
    /// is an empty vector.
    std::vector<std::optional<std::string>> array(const std::vector<std::string>& args) {
        const Reply reply = command(args);
        std::vector<std::optional<std::string>> out;
        if (reply->type == REDIS_REPLY_NIL) return out;
        if (reply->type != REDIS_REPLY_ARRAY) throw unexpected(args, reply.get());
        for (std::size_t i = 0; i < reply->elements; ++i) {
            const redisReply* element = reply->element[i];
            if (element->type == REDIS_REPLY_NIL) {
                out.emplace_back();
            } else if (auto text = scalar(element)) {
                out.push_back(std::move(text));
            } else {
                throw unexpected(args, element);
            }
        }
        return out;
    }

    /// An array of flat arrays (SENTINEL REPLICAS: one array of fields per replica), each
    /// element as array() gives it; a nil reply is an empty vector.
    std::vector<std::vector<std::optional<std::string>>> arrays(
        const std::vector<std::string>& args) {
        const Reply reply = command(args);
        std::vector<std::vector<std::optional<std::string>>> out;
        if (reply->type == REDIS_REPLY_NIL) return out;
        if (reply->type != REDIS_REPLY_ARRAY) throw unexpected(args, reply.get());
        for (std::size_t i = 0; i < reply->elements; ++i) {
            const redisReply* inner = reply->element[i];
            if (inner->type != REDIS_REPLY_ARRAY) throw unexpected(args, inner);
            std::vector<std::optional<std::string>> row;
            for (std::size_t j = 0; j < inner->elements; ++j) {
                const redisReply* element = inner->element[j];
                if (element->type == REDIS_REPLY_NIL) {
                    row.emplace_back();
                } else if (auto text = scalar(element)) {
                    row.push_back(std::move(text));
                } else {
                    throw unexpected(args, element);
                }
            }
            out.push_back(std::move(row));
        }
        return out;
    }

    /// Any reply but an error.
    void exec(const std::vector<std::string>& args) { (void)command(args); }

    [[nodiscard]] bool connected() const { return ctx_ != nullptr; }
    void disconnect() noexcept { ctx_.reset(); }

  private:
    struct ContextFree {
        void operator()(redisContext* c) const noexcept { redisFree(c); }
    };
    struct ReplyFree {
        void operator()(redisReply* r) const noexcept { freeReplyObject(r); }
    };
    using Reply = std::unique_ptr<redisReply, ReplyFree>;

    std::string host_;
    int port_;
    std::chrono::milliseconds timeout_;
    std::unique_ptr<redisContext, ContextFree> ctx_;

    std::string where() const { return host_ + ":" + std::to_string(port_); }

    void connect() {
        timeval tv{};
        tv.tv_sec = static_cast<time_t>(timeout_.count() / 1000);
        tv.tv_usec = static_cast<suseconds_t>((timeout_.count() % 1000) * 1000);
        std::unique_ptr<redisContext, ContextFree> ctx{
            redisConnectWithTimeout(host_.c_str(), port_, tv)};
        if (!ctx) throw std::runtime_error("RedisClient: connect " + where() + ": out of memory");
        if (ctx->err != 0) {
            throw std::runtime_error("RedisClient: connect " + where() + ": " + ctx->errstr);
        }
        // Without a command timeout a stopped (SIGSTOP) server would hang the test forever.
        if (redisSetTimeout(ctx.get(), tv) != REDIS_OK) {
            throw std::runtime_error("RedisClient: set timeout on " + where() + ": " + ctx->errstr);
        }
        ctx_ = std::move(ctx);
    }

    /// One round trip; error replies and I/O failures throw (an I/O failure also drops the
    /// connection, so the next call reconnects).
    Reply command(const std::vector<std::string>& args) {
        if (args.empty()) throw std::invalid_argument("RedisClient: empty command");
        if (ctx_ && closed_by_peer()) ctx_.reset();
        if (!ctx_) connect();
        std::vector<const char*> argv;
        std::vector<std::size_t> lengths;
        for (const auto& a : args) {
            argv.push_back(a.data());
            lengths.push_back(a.size());
        }
        Reply reply{static_cast<redisReply*>(redisCommandArgv(
            ctx_.get(), static_cast<int>(argv.size()), argv.data(), lengths.data()))};
        if (!reply) {
            const std::string why = ctx_->err != 0 ? ctx_->errstr : "no reply";
            ctx_.reset();
            throw std::runtime_error("RedisClient: " + args.front() + " on " + where() + ": " +
                                     why);
        }
        if (reply->type == REDIS_REPLY_ERROR) {
            throw std::runtime_error("RedisClient: " + args.front() + ": " +
                                     std::string(reply->str, reply->len));
        }
        return reply;
    }

    /// EOF or a reset pending on the idle socket: nothing was sent yet, so reconnecting is safe.
    bool closed_by_peer() const {
        char byte = 0;
        const ssize_t n = ::recv(ctx_->fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0) return true;
        return n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
    }

    static std::optional<std::string> scalar(const redisReply* r) {
        if (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS) {
            return std::string(r->str, r->len);
        }
        if (r->type == REDIS_REPLY_INTEGER) return std::to_string(r->integer);
        return std::nullopt;
    }

    static std::runtime_error unexpected(const std::vector<std::string>& args,
                                         const redisReply* r) {
        return std::runtime_error("RedisClient: " + args.front() + ": unexpected reply type " +
                                  std::to_string(r->type));
    }
};

namespace detail {

/// IDEM_TEST_REDIS_SERVER (a full path), else redis-server in PATH, /usr/bin, /usr/sbin,
/// /usr/local/bin.
inline Program find_redis_server() {
    return find_program("redis-server", "IDEM_TEST_REDIS_SERVER", "Debian: redis-server");
}

}  // namespace detail

class RedisServer : public ServerProcess {
  public:
    /// Whether a redis-server binary exists; @p why says where it looked when not.
    static bool available(std::string* why = nullptr) {
        const auto found = detail::find_redis_server();
        if (found.path.empty() && why != nullptr) *why = found.why;
        return !found.path.empty();
    }

    /// How the server persists: AOF with appendfsync always (the default), or nothing at all
    /// (`appendonly no`, no RDB: a restart loses every key), which RedisStore refuses by default.
    enum Persistence { aof_always, no_aof };

    /// How to start it, beyond the defaults.
    struct Setup {
        Persistence persistence = aof_always;
        /// More redis-server options, after the fixture's own (e.g. {"--replicaof", "127.0.0.1",
        /// "7001"} for a replica).
        std::vector<std::string> arguments{};
        /// Not empty: a Sentinel (`redis-server <dir>/sentinel.conf --sentinel`) whose config
        /// file starts with this text (Sentinel rewrites the file as it learns).
        std::string sentinel_config{};
    };

    /// Starts redis-server and waits until it answers. Throws std::runtime_error with the log's
    /// tail.
    explicit RedisServer(Persistence persistence = aof_always)
        : RedisServer(Setup{persistence, {}, {}}) {}
    /// The same with @p extra_args at the end of redis-server's command line (a replica, a
    /// Cluster node).
    RedisServer(Persistence persistence, std::vector<std::string> extra_args)
        : RedisServer(Setup{persistence, std::move(extra_args), {}}) {}
    explicit RedisServer(Setup setup) : ServerProcess(traits()), setup_(std::move(setup)) {
        const auto found = detail::find_redis_server();
        if (found.path.empty()) throw std::runtime_error("RedisServer: " + found.why);
        binary_ = found.path;
        adopt_dir(make_temp_dir("IDEM_TEST_REDIS_TMPDIR", "idem-redis-"));
        if (sentinel()) {
            std::ofstream config(dir() / "sentinel.conf");
            config << setup_.sentinel_config << '\n';
            if (!config) throw std::runtime_error("RedisServer: cannot write sentinel.conf");
        }
        start_on_free_port();
    }

    // ~ServerProcess: SIGTERM (SIGKILL after 5 s), then the data dir is removed. Never throws.
    // port(), pid(), running(), dir(), log_file() (redis.log), log_tail(): ServerProcess's.
    // start(): again on the same port and data dir (after stop() or kill9()): the AOF is
    // replayed. kill9(): a crash, see hard_kill(); acknowledged writes are in the AOF
    // (appendfsync always).

    [[nodiscard]] std::string host() const { return "127.0.0.1"; }

    /// A new client for this server (it connects on first use).
    [[nodiscard]] RedisClient client() const { return RedisClient{host(), port()}; }

    /// FLUSHALL: every key of every database is gone (and the AOF says so).
    void flushall() { client().exec({"FLUSHALL"}); }

    /// Graceful shutdown (SIGTERM: the AOF is flushed). No-op when stopped.
    void stop() { stop_with(SIGTERM, std::chrono::seconds(30)); }

    /// Starts again (after stop() or kill9(), same port and dir) as a replica of @p host:@p port:
    /// the `--replicaof` of its Setup::arguments is replaced, for later start()s too. A killed
    /// master comes back as its successor's replica, never for a moment as a master of its stale
    /// data (or a replica of a server that is a replica itself now). No-op when running.
    void start_as_replica_of(const std::string& host, int port) {
        if (running()) return;
        auto& args = setup_.arguments;
        for (auto it = args.begin(); it != args.end();) {
            if ((*it == "--replicaof" || *it == "--slaveof") && args.end() - it >= 3) {
                it = args.erase(it, it + 3);
            } else {
                ++it;
            }
        }
        args.insert(args.end(), {"--replicaof", host, std::to_string(port)});
        start();
    }

    /// Whether this is a Sentinel (Setup::sentinel_config).
    [[nodiscard]] bool sentinel() const { return !setup_.sentinel_config.empty(); }

    /// SIGSTOP / SIGCONT: a server that hangs (its connections stay open, nothing answers).
    void pause() const { signal_server(SIGSTOP); }
    void resume() const { signal_server(SIGCONT); }

  private:
    std::filesystem::path binary_;
    Setup setup_;

    void signal_server(int signal) const {
        if (pid() <= 0 || ::kill(pid(), signal) != 0) {
            throw std::runtime_error("RedisServer: cannot signal redis-server (not running)");
        }
    }

    static Traits traits() {
        Traits t;
        t.fixture = "RedisServer";
        t.program = "redis-server";
        t.log = "redis.log";
        t.port_busy = {"Address already in use"};
        t.ready_within = std::chrono::seconds(10);
        t.ready_poll = std::chrono::milliseconds(10);
        t.quit_signal = SIGTERM;
        t.quit_signal_name = "TERM";
        t.quit_grace = std::chrono::seconds(5);
        t.hard_kill = &RedisServer::hard_kill;
        return t;
    }

    /// Starts redis-server on `port` and waits (10 s) until it answers. false + *port_busy when
    /// the port was taken; throws on other failures.
    bool launch(int port, bool* port_busy) override {
        *port_busy = false;
        const auto log_offset = log_size();
        const int log = open_log();
        Spawn s;
        if (sentinel())
            s.argv = {binary_.string(), (dir() / "sentinel.conf").string(), "--sentinel"};
        const std::vector<std::string> common = {
            "--port",    std::to_string(port), "--bind",
            "127.0.0.1", "--protected-mode",   "no",
            "--dir",     dir().string(),       "--daemonize",
            "no",        "--logfile",          log_file().string()};
        if (!sentinel()) s.argv = {binary_.string()};
        s.argv.insert(s.argv.end(), common.begin(), common.end());
        if (!sentinel()) {
            s.argv.insert(s.argv.end(),
                          {"--appendonly", setup_.persistence == aof_always ? "yes" : "no",
                           "--appendfsync", "always", "--save", ""});
        }
        s.argv.insert(s.argv.end(), setup_.arguments.begin(), setup_.arguments.end());
        s.env = {"PATH=/usr/bin:/bin", "LC_ALL=C", "HOME=" + dir().string()};
        s.cwd = dir();
        s.out_fd = log;  // what redis says before it opens --logfile (bad options)
        s.new_process_group = true;
        const pid_t pid = spawn_handing_over(s, log);

        RedisClient probe{host(), port, std::chrono::milliseconds(500)};
        if (!await_ready(pid, port, log_offset, [&] { return answers_as_ours(probe); })) {
            *port_busy = true;
            return false;
        }
        return true;
    }

    /// PONG (not -LOADING while the AOF is replayed) from a server whose dir is ours (a
    /// Sentinel, which has no CONFIG: whose config file is ours).
    bool answers_as_ours(RedisClient& probe) const {
        try {
            if (probe.str({"PING"}) != "PONG") return false;
            if (sentinel()) {
                const auto info = probe.str({"INFO", "server"});
                return info && info->find("config_file:" + (dir() / "sentinel.conf").string()) !=
                                   std::string::npos;
            }
            const auto reply = probe.array({"CONFIG", "GET", "dir"});
            std::error_code ec;
            return reply.size() == 2 && reply[1] &&
                   std::filesystem::equivalent(*reply[1], dir(), ec);
        } catch (const std::exception&) {
            probe.disconnect();
            return false;
        }
    }

    /// SIGKILL the process group (the server and any fork()ed AOF-rewrite child) and reap the
    /// server.
    static void hard_kill(pid_t pid) noexcept { kill_group_and_reap(pid); }
};

namespace detail {

/// The value of `field:` in an INFO reply (`role`, `master_link_status`...), "" when absent.
inline std::string info_field(const std::string& info, const std::string& field) {
    const std::string key = field + ":";
    std::size_t begin = key.size();
    if (info.compare(0, key.size(), key) != 0) {
        const std::size_t at = info.find("\n" + key);
        if (at == std::string::npos) return "";
        begin = at + 1 + key.size();
    }
    const std::size_t end = info.find_first_of("\r\n", begin);
    return info.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

/// info_field() as a number; @p otherwise when absent or not a number.
inline long long info_number(const std::string& info, const std::string& field,
                             long long otherwise = -1) {
    const std::string text = info_field(info, field);
    try {
        return text.empty() ? otherwise : std::stoll(text);
    } catch (const std::exception&) {
        return otherwise;
    }
}

}  // namespace detail

/// An `INFO replication` field of @p server as a number; -1 when it has none.
inline long long replication_offset(const RedisServer& server, const std::string& field) {
    const std::string info = server.client().str({"INFO", "replication"}).value_or("");
    const std::size_t at = info.find(field + ":");
    if (at == std::string::npos) return -1;
    return std::stoll(info.substr(at + field.size() + 1));
}

/// @brief Makes @p master's replicas fall behind from now on, all at the same offset: writes are
/// held (CLIENT PAUSE WRITE) until every replica has the master's whole stream, then each is
/// SIGSTOPped, the master drops its replication links (what it sends later would otherwise wait
/// in a stopped replica's socket buffer and arrive on SIGCONT) and writes resume. Stopped one
/// after the other without the hold, a replica could confirm a `WAIT 1` its sibling never saw,
/// and a failover promoting the sibling loses that write: a test of replicas_to_ack would then
/// measure which replica Redis promoted. false (nothing stopped) when they did not catch up in
/// @p timeout. resume() each replica afterwards.
inline bool stop_replicas_level(const RedisServer& master,
                                const std::vector<const RedisServer*>& replicas,
                                std::chrono::milliseconds timeout) {
    RedisClient client = master.client();
    client.exec({"CLIENT", "PAUSE", std::to_string(timeout.count() + 1000), "WRITE"});
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        const long long offset = replication_offset(master, "master_repl_offset");
        bool level = offset > 0;
        for (const RedisServer* replica : replicas)
            level = level && replication_offset(*replica, "slave_repl_offset") == offset;
        if (level) break;
        if (std::chrono::steady_clock::now() >= deadline) {
            client.exec({"CLIENT", "UNPAUSE"});
            return false;
        }
        ::usleep(1000);
    }
    for (const RedisServer* replica : replicas)
        replica->pause();
    client.exec({"CLIENT", "KILL", "TYPE", "replica"});
    client.exec({"CLIENT", "UNPAUSE"});
    return true;
}

/// One server per test process (shared_server()). Tests that stop or crash a server should use
/// their own RedisServer, not this one.
inline RedisServer& shared_redis() {
    return shared_server<RedisServer>("Redis");
}

}  // namespace testing

IDEM_END_NAMESPACE
