// idem_chaos (driver): starts redis-server (and PostgreSQL / MariaDB for --store postgres / mysql)
// on free loopback ports in temp dirs, produces the capture messages, runs K worker processes (this
// executable with --worker), kills random workers with SIGKILL at random moments and restarts them,
// waits until the stream is drained, stops the workers and verifies every order. Prints a summary
// and, as its last stdout line, one JSON object.

#include <libpq-fe.h>
#include <signal.h>
#include <sqlite3.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "broker.hpp"
#include "chaos.hpp"
#include "gateway.hpp"
#include "idem/store/mysql.hpp"
#include "idem/store/postgres.hpp"
#include "idem/store/redis.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/mariadb_server.hpp"
#include "idem/testing/postgres_server.hpp"
#include "idem/testing/process.hpp"
#include "idem/testing/redis_cluster.hpp"
#include "idem/testing/redis_server.hpp"

extern char** environ;

namespace chaos {
namespace {

using SteadyClock = std::chrono::steady_clock;
using namespace std::chrono_literals;

volatile sig_atomic_t interrupted = 0;
extern "C" void on_interrupt(int) {
    interrupted = 1;
}

constexpr int exit_failed = 1;   // the run proved something wrong (or nothing)
constexpr int exit_harness = 2;  // the harness itself could not do its job
constexpr int exit_skip = 77;    // no server here (never in CI)

std::string self_executable() {
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

long long integer_of(const idem::redis::Reply& reply) {
    if (reply.type == idem::redis::Reply::Type::integer) return reply.integer;
    if (reply.is_nil() || reply.str.empty()) return 0;
    return std::stoll(reply.str);
}

long long get_int(idem::redis::Connection& redis, const std::string& key) {
    return integer_of(redis.checked({"GET", key}, "GET"));
}

std::map<std::string, long long> hash_of(idem::redis::Connection& redis, const std::string& key) {
    std::map<std::string, long long> out;
    const idem::redis::Reply reply = redis.checked({"HGETALL", key}, "HGETALL");
    for (std::size_t i = 0; i + 1 < reply.elements.size(); i += 2)
        out[reply.elements[i].str] = integer_of(reply.elements[i + 1]);
    return out;
}

/// Every list named by @p keys (LRANGE 0 -1), pipelined.
std::vector<std::vector<std::string>> lists_of(idem::redis::Connection& redis,
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
    Fleet(const Options& options, std::vector<std::string> worker_args)
        : options_(options),
          exe_(self_executable()),
          args_(std::move(worker_args)),
          workers_(static_cast<std::size_t>(options.workers)) {
        for (char** e = environ; e != nullptr && *e != nullptr; ++e)
            env_.emplace_back(*e);
    }
    Fleet(const Fleet&) = delete;
    Fleet& operator=(const Fleet&) = delete;
    ~Fleet() { stop(); }

    void start() {
        for (int slot = 0; slot < options_.workers; ++slot)
            spawn(slot);
    }

    /// Restarts every worker that died on its own (a self-kill, or an error).
    void reap() {
        for (int slot = 0; slot < options_.workers; ++slot) {
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
        const int slot = std::uniform_int_distribution<int>(0, options_.workers - 1)(random);
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
        for (int slot = 0; slot < options_.workers; ++slot) {
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

    [[nodiscard]] long kills() const { return kills_; }
    [[nodiscard]] long driver_kills() const { return driver_kills_; }
    [[nodiscard]] long starts() const { return starts_; }
    [[nodiscard]] const std::vector<std::string>& errors() const { return errors_; }

  private:
    struct Worker {
        pid_t pid = -1;
        int incarnation = 0;
    };

    const Options& options_;
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

CapturesByOrder sqlite_captures(idem::SqliteStore& store) {
    CapturesByOrder out;
    sqlite3_stmt* stmt = nullptr;
    if (sqlite3_prepare_v2(store.db(), "SELECT order_id, gateway_reference FROM captures", -1,
                           &stmt, nullptr) != SQLITE_OK) {
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

CapturesByOrder postgres_captures(const idem::testing::PostgresServer& server) {
    CapturesByOrder out;
    idem::testing::PgConnection conn{server.connect()};
    std::unique_ptr<PGresult, decltype(&PQclear)> result{
        PQexec(conn.get(), "SELECT order_id, gateway_reference FROM captures"), &PQclear};
    if (PQresultStatus(result.get()) != PGRES_TUPLES_OK) {
        throw std::runtime_error(std::string("SELECT captures: ") + PQerrorMessage(conn.get()));
    }
    for (int row = 0; row < PQntuples(result.get()); ++row) {
        out[std::stol(PQgetvalue(result.get(), row, 0))].emplace_back(
            PQgetvalue(result.get(), row, 1));
    }
    return out;
}

CapturesByOrder mysql_captures(idem::testing::MariadbServer& server) {
    CapturesByOrder out;
    for (const auto& row :
         server.client().query("SELECT order_id, gateway_reference FROM captures"))
        out[std::stol(row.at(0).value_or("0"))].push_back(row.at(1).value_or(""));
    return out;
}

/// --store redis-cluster: every "chaos:captures:<order>{<claim tag>}" list on every live master.
CapturesByOrder redis_cluster_captures(idem::testing::RedisCluster& cluster) {
    CapturesByOrder out;
    for (std::size_t node = 0; node < cluster.size(); ++node) {
        if (!cluster.server(node).running() || !cluster.is_master(node)) continue;
        idem::RedisEndpoint endpoint;
        endpoint.host = cluster.host();
        endpoint.port = cluster.port(node);
        idem::redis::Connection redis{endpoint};
        std::vector<std::string> keys;
        std::string cursor = "0";
        do {
            const auto reply = redis.checked(
                {"SCAN", cursor, "MATCH", "chaos:captures:*", "COUNT", "1000"}, "SCAN");
            cursor = reply.elements.at(0).str;
            for (const auto& key : reply.elements.at(1).elements)
                keys.push_back(key.str);
        } while (cursor != "0");
        std::sort(keys.begin(), keys.end());
        keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
        const auto lists = lists_of(redis, keys);
        for (std::size_t k = 0; k < keys.size(); ++k) {
            const std::string digits = keys[k].substr(std::strlen("chaos:captures:"));
            auto& captures = out[std::stol(digits)];
            captures.insert(captures.end(), lists[k].begin(), lists[k].end());
        }
    }
    return out;
}

CapturesByOrder redis_captures(idem::redis::Connection& redis, long messages) {
    std::vector<std::string> keys;
    for (long order = 1; order <= messages; ++order)
        keys.push_back(redis_captures_key(order));
    const auto lists = lists_of(redis, keys);
    CapturesByOrder out;
    for (long order = 1; order <= messages; ++order) {
        const auto& list = lists[static_cast<std::size_t>(order - 1)];
        if (!list.empty()) out[order] = list;
    }
    return out;
}

// ---------------------------------------------------------------------------------------------

std::vector<std::string> worker_args(const Options& o, int redis_port, const std::string& db,
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
    if (o.naive) args.emplace_back("--naive");
    if (o.pipelined) args.emplace_back("--pipelined");
    if (o.offsets_in_store) args.insert(args.end(), {"--offsets", "store"});
    return args;
}

int missing_server(const char* what, const std::string& why) {
    if (idem::testing::running_in_ci()) {
        std::printf("idem_chaos: %s is required in CI (CI=true): %s\n", what, why.c_str());
        return exit_harness;
    }
    std::printf("idem_chaos: skipped: %s not available (set CI=true to make this a failure): %s\n",
                what, why.c_str());
    return exit_skip;
}

}  // namespace

int run_driver(const Options& o) {
    std::string why;
    if (!idem::testing::RedisServer::available(&why)) return missing_server("redis-server", why);
    if (o.store == StoreKind::postgres && !idem::testing::PostgresServer::available(&why)) {
        return missing_server("PostgreSQL", why);
    }
    if (o.store == StoreKind::mysql && !idem::testing::MariadbServer::available(&why)) {
        return missing_server("MariaDB", why);
    }
    if (o.store == StoreKind::redis_cluster && !idem::testing::RedisCluster::available(&why)) {
        return missing_server("Redis Cluster (redis-server, redis-cli)", why);
    }
    struct sigaction action {};
    action.sa_handler = on_interrupt;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGINT, &action, nullptr);
    ::sigaction(SIGTERM, &action, nullptr);
    ::signal(SIGPIPE, SIG_IGN);

    const bool progress = ::isatty(STDERR_FILENO) != 0;
    auto say = [&](const std::string& text) {
        if (progress) std::fprintf(stderr, "\r\033[K[chaos] %s", text.c_str());
    };

    // --- servers and stores --------------------------------------------------------------------
    say("starting redis-server");
    idem::testing::RedisServer redis_server;
    idem::RedisEndpoint endpoint;
    endpoint.host = redis_server.host();
    endpoint.port = redis_server.port();
    idem::redis::Connection redis{endpoint};

    std::optional<idem::testing::PostgresServer> pg;
    std::optional<idem::testing::MariadbServer> maria;
    std::optional<idem::testing::RedisCluster>
        cluster;  // the store; the stream and gateway stay out
    RunDir run_dir;
    std::string db;
    switch (o.store) {
        case StoreKind::sqlite: {
            db = (run_dir.path / "shop.db").string();
            idem::SqliteStore store{db};  // creates idem's tables and switches to WAL
            store.execute(
                "CREATE TABLE captures(order_id INTEGER NOT NULL, gateway_reference TEXT NOT "
                "NULL)");
            break;
        }
        case StoreKind::postgres: {
            say("starting PostgreSQL");
            pg.emplace();
            pg->exec(
                "CREATE TABLE captures(order_id BIGINT NOT NULL, gateway_reference TEXT NOT "
                "NULL)");
            db = pg->conninfo();
            idem::PostgresStore store{db};  // creates idem's tables once, before the workers race
            break;
        }
        case StoreKind::mysql: {
            say("starting MariaDB");
            maria.emplace();
            maria->client().exec(
                "CREATE TABLE captures(order_id BIGINT NOT NULL, gateway_reference TEXT NOT "
                "NULL) ENGINE=InnoDB");
            db = fmt::format("{}:{}/idem_test", maria->host(), maria->port());
            idem::MysqlStore store{mysql_endpoint_of(db)};  // idem's tables, before the race
            break;
        }
        case StoreKind::redis:
            break;
        case StoreKind::redis_cluster: {
            say("starting a Redis Cluster");
            cluster.emplace(3, 1, std::chrono::milliseconds(1000));
            for (std::size_t node = 0; node < cluster->size(); ++node)
                db += fmt::format("{}{}:{}", node == 0 ? "" : ",", cluster->host(),
                                  cluster->port(node));
            break;
        }
    }

    // --- broker and producer ---------------------------------------------------------------------
    say(std::string("starting the broker: ") + to_string(o.broker));
    std::unique_ptr<BrokerRun> broker;
    try {
        broker = start_broker(o, redis_server.port(), run_dir.path);
    } catch (const server_missing& e) {
        return missing_server(e.what_server.c_str(), e.what());
    }
    const auto started = SteadyClock::now();
    broker->publish(o.messages);

    // --- workers, faults, drain ------------------------------------------------------------------
    std::mt19937_64 random(o.seed);
    auto next_kill_after = [&]() -> SteadyClock::duration {
        const double factor = std::uniform_real_distribution<double>(0.5, 1.5)(random);
        return std::chrono::duration_cast<SteadyClock::duration>(o.kill_interval * factor);
    };
    Fleet fleet{o, worker_args(o, redis_server.port(), db, broker->worker_address())};
    fleet.start();
    const auto deadline = started + o.timeout;
    auto next_kill = SteadyClock::now() + next_kill_after();
    auto next_look = SteadyClock::now();
    bool drained = false;
    bool timed_out = false;
    bool master_killed = false;
    while (!interrupted) {
        fleet.reap();
        const auto now = SteadyClock::now();
        if (o.kill_interval.count() > 0 && now >= next_kill) {
            fleet.kill_random(random);
            next_kill = SteadyClock::now() + next_kill_after();
        }
        if (now >= next_look) {
            next_look = now + 50ms;
            // --store redis-cluster: a third of the way in (by the deliveries the workers
            // counted, whatever the broker), the master of slot 0 is SIGKILLed; once its replica
            // took over, it comes back as that replica's replica.
            if (cluster && !master_killed && get_int(redis, delivered_key) >= o.messages / 3) {
                master_killed = true;
                const std::size_t victim = cluster->master_index_of(0);
                say("killing a Redis Cluster master");
                cluster->kill_node(victim);
                if (!cluster->wait_until_ok(std::chrono::seconds(60))) {
                    throw std::runtime_error(
                        "the Redis Cluster did not recover from the kill within 60 s (waiting "
                        "for every live node to say cluster_state:ok with every slot served "
                        "and every replica known)\n" +
                        cluster->state());
                }
                cluster->restart_node(victim);
            }
            if (broker->drained()) {
                drained = true;
                break;
            }
            if (progress) {
                say(fmt::format("{} on {} {}: {}, delivered {}, kills {}", to_string(o.store),
                                to_string(o.broker), o.naive ? "naive" : "idem", broker->progress(),
                                get_int(redis, delivered_key), fleet.kills()));
            }
        }
        if (now >= deadline) {
            timed_out = true;
            break;
        }
        if (fleet.errors().size() > 20) break;
        std::this_thread::sleep_for(5ms);
    }
    say("stopping the workers");
    fleet.stop();
    if (progress) std::fprintf(stderr, "\r\033[K");

    // --- verification --------------------------------------------------------------------------
    CapturesByOrder captures_by_order;
    std::map<std::string, std::string> store_letters;  // the store's dead letters: id → reason
    switch (o.store) {
        case StoreKind::sqlite: {
            idem::SqliteStore store{db};
            captures_by_order = sqlite_captures(store);
            for (const auto& letter : store.dead_letters())
                store_letters[letter.message_id] = letter.reason;
            break;
        }
        case StoreKind::postgres: {
            captures_by_order = postgres_captures(*pg);
            idem::PostgresStore store{db};
            for (const auto& letter : store.dead_letters())
                store_letters[letter.message_id] = letter.reason;
            break;
        }
        case StoreKind::mysql: {
            captures_by_order = mysql_captures(*maria);
            idem::MysqlStore store{mysql_endpoint_of(db)};
            for (const auto& letter : store.dead_letters())
                store_letters[letter.message_id] = letter.reason;
            break;
        }
        case StoreKind::redis: {
            captures_by_order = redis_captures(redis, o.messages);
            idem::RedisStore store{endpoint};
            for (const auto& letter : store.dead_letters())
                store_letters[letter.message_id] = letter.reason;
            break;
        }
        case StoreKind::redis_cluster: {
            cluster->wait_until_ok(std::chrono::seconds(60));
            captures_by_order = redis_cluster_captures(*cluster);
            idem::RedisStore store{redis_cluster_seeds_of(db)};
            for (const auto& letter : store.dead_letters())
                store_letters[letter.message_id] = letter.reason;
            break;
        }
    }
    const std::set<long> pending_orders = broker->unsettled_orders();
    const std::map<long, std::string> broker_letters = broker->dead_letters();
    std::set<long> dead_lettered_orders;
    for (const auto& [order, reason] : broker_letters)
        dead_lettered_orders.insert(order);
    for (const auto& [id, reason] : store_letters)
        dead_lettered_orders.insert(broker->order_of(id).value_or(0));

    // What the store says of a message's claim (and, on a lease store, its attempts).
    auto describe_claim = [&](const std::string& id) -> std::string {
        std::optional<idem::ClaimRecord> claim;
        std::string attempts;
        switch (o.store) {
            case StoreKind::sqlite: {
                idem::SqliteStore store{db};
                claim = store.find_claim(scope_name, id);
                break;
            }
            case StoreKind::postgres: {
                idem::PostgresStore store{db};
                claim = store.find_claim(scope_name, id);
                break;
            }
            case StoreKind::mysql: {
                idem::MysqlStore store{mysql_endpoint_of(db)};
                claim = store.find_claim(scope_name, id);
                break;
            }
            case StoreKind::redis:
            case StoreKind::redis_cluster: {
                std::optional<idem::RedisStore> store;
                if (o.store == StoreKind::redis) {
                    store.emplace(endpoint);
                } else {
                    store.emplace(redis_cluster_seeds_of(db));
                }
                claim = store->find_claim(scope_name, id);
                attempts = fmt::format(", claims counted {}", store->attempts(scope_name, id));
                break;
            }
        }
        if (!claim) return "no claim" + attempts;
        return fmt::format("claim {}{}{}", idem::to_string(claim->disposition),
                           claim->reason.empty() ? "" : " (" + claim->reason + ")", attempts);
    };

    // Every divergence explained: what each delivery of the order did, what the store and the
    // dead letters say.
    auto explain = [&](long order, const std::vector<std::string>& captures_of,
                       const std::vector<std::string>& charges_of, bool pending) {
        const std::string id = broker->message_id_of_order(order);
        std::string text = fmt::format(
            "divergence: order {} (message id {}): captures [{}], charges [{}], {}", order,
            id.empty() ? "?" : id, fmt::join(captures_of, " "), fmt::join(charges_of, " "),
            pending ? "still pending at the broker" : "settled at the broker");
        const auto letter = broker_letters.find(order);
        if (letter != broker_letters.end())
            text += fmt::format("\n  broker dead letter: {}", letter->second);
        const auto stored_letter = store_letters.find(id);
        if (stored_letter != store_letters.end())
            text += fmt::format("\n  store dead letter: {}", stored_letter->second);
        if (id.empty()) return text;
        text += "\n  store: " + describe_claim(id);
        const auto history = lists_of(redis, {history_key(id)}).front();
        long long first = -1;
        text += fmt::format(
            "\n  deliveries ({} lines; a start without an outcome: the worker "
            "died):",
            history.size());
        for (const std::string& line : history) {
            const std::size_t space = line.find(' ');
            const long long at = std::stoll(line.substr(0, space));
            if (first < 0) first = at;
            text += fmt::format("\n    +{:.3f} s {}", static_cast<double>(at - first) / 1000.0,
                                line.substr(space + 1));
        }
        return text;
    };

    std::vector<std::string> charged_keys;
    for (long order = 1; order <= o.messages; ++order)
        charged_keys.push_back(gw_charged_key(order));
    const auto charges_by_order = lists_of(redis, charged_keys);

    long captures = 0, divergences = 0;
    long no_capture = 0, extra_captures = 0, extra_charges = 0, mismatched = 0;
    std::vector<std::string> explained;  // one block per divergent order
    for (long order = 1; order <= o.messages; ++order) {
        static const std::vector<std::string> none;
        const auto found = captures_by_order.find(order);
        const auto& c = found != captures_by_order.end() ? found->second : none;
        const auto& g = charges_by_order[static_cast<std::size_t>(order - 1)];
        captures += static_cast<long>(c.size());
        no_capture += c.empty() ? 1 : 0;
        extra_captures += c.size() > 1 ? 1 : 0;
        extra_charges += g.size() > 1 ? 1 : 0;
        const bool agree = c.size() == 1 && g.size() == 1 && c[0] == g[0];
        mismatched += (c.size() == 1 && g.size() == 1 && !agree) ? 1 : 0;
        if (!agree || pending_orders.count(order) != 0 || dead_lettered_orders.count(order) != 0) {
            ++divergences;
            explained.push_back(explain(order, c, g, pending_orders.count(order) != 0));
        }
    }
    const long delivered = static_cast<long>(get_int(redis, delivered_key));
    // The field note's count: deliveries beyond one per message (0 for a run that did not drain).
    const long redeliveries = std::max(0L, delivered - o.messages);
    const long gateway_requests = static_cast<long>(get_int(redis, gw_requests_key));
    const long gateway_calls = static_cast<long>(get_int(redis, gw_charges_key));
    const long gateway_refused = static_cast<long>(get_int(redis, gw_refused_key));
    const long dead_lettered = static_cast<long>(dead_lettered_orders.size());
    const double seconds = std::chrono::duration<double>(SteadyClock::now() - started).count();

    // --- report --------------------------------------------------------------------------------
    const auto outcomes = hash_of(redis, outcomes_key);
    const auto self_kills = hash_of(redis, self_kills_key);
    std::string outcome_text;
    for (const auto& [name, count] : outcomes)
        outcome_text += fmt::format("{}{} {}", outcome_text.empty() ? "" : ", ", count, name);
    std::map<long long, long long> by_count;  // delivery count → deliveries, in numeric order
    for (const auto& [count, deliveries] : hash_of(redis, counts_key))
        by_count[std::stoll(count)] = deliveries;
    std::string count_text;
    for (const auto& [count, deliveries] : by_count)
        count_text += fmt::format("{}{}: {}", count_text.empty() ? "" : ", ", count, deliveries);
    std::string window_text;
    for (const char* window : window_names) {
        const auto found = self_kills.find(window);
        window_text +=
            fmt::format(", {} {}", found != self_kills.end() ? found->second : 0, window);
    }
    std::printf(
        "%s handler on %s over %s, %ld messages, %d workers, seed %llu: %ld deliveries (%s; by "
        "delivery "
        "count %s); kills: %ld "
        "by the driver%s; %ld worker starts; gateway: %ld requests, %ld charges, %ld refused in "
        "flight; orders without a capture %ld, with several captures %ld, with several charges "
        "%ld, capture and charge disagree %ld; pending at the end %zu\n",
        o.naive              ? "naive"
        : o.pipelined        ? "idem pipelined"
        : o.offsets_in_store ? "idem (offsets in the store)"
                             : "idem",
        to_string(o.store), to_string(o.broker), o.messages, o.workers,
        static_cast<unsigned long long>(o.seed), delivered, outcome_text.c_str(),
        count_text.c_str(), fleet.driver_kills(), window_text.c_str(), fleet.starts(),
        gateway_requests, gateway_calls, gateway_refused, no_capture, extra_captures, extra_charges,
        mismatched, pending_orders.size());

    int status = 0;
    if (interrupted) {
        std::printf("idem_chaos: interrupted\n");
        status = exit_harness;
    }
    if (timed_out) {
        std::printf("idem_chaos: the stream did not drain within %lld s\n",
                    static_cast<long long>(o.timeout.count()));
        status = std::max(status, exit_failed);
    }
    if (!drained && !timed_out && !interrupted) status = exit_harness;
    for (const auto& error : fleet.errors()) {
        std::printf("idem_chaos: %s\n", error.c_str());
        status = exit_harness;
    }
    for (const std::string& block : explained)
        std::printf("%s\n", block.c_str());
    if (divergences > 0) {
        std::printf("idem_chaos: %ld of %ld orders diverge\n", divergences, o.messages);
        status = std::max(status, exit_failed);
    }
    if (drained && redeliveries * 20 < o.messages) {
        std::printf(
            "idem_chaos: only %ld redeliveries (< 5%% of %ld messages): the run proved too little; "
            "raise --kill-rate or lower --kill-interval-ms\n",
            redeliveries, o.messages);
        status = std::max(status, exit_failed);
    }
    if (fleet.kills() == 0) {
        std::printf("idem_chaos: no worker was killed: the run proved nothing\n");
        status = std::max(status, exit_failed);
    }
    if (cluster) {
        if (master_killed) {
            std::printf(
                "redis-cluster: the master of slot 0 was SIGKILLed a third of the way in; "
                "its replica took over, the killed node came back as its replica\n");
        } else {
            std::printf(
                "idem_chaos: no Redis Cluster master was killed: the run proved nothing "
                "about a failover\n");
            status = std::max(status, exit_failed);
        }
    }
    std::printf(
        "{\"store\":\"%s\",\"broker\":\"%s\",%s%s\"messages\":%ld,\"workers\":%d,\"kills\":%ld,"
        "\"delivered\":%ld,"
        "\"redeliveries\":%ld,\"captures\":%ld,\"gateway_requests\":%ld,\"gateway_calls\":%ld,"
        "\"divergences\":%ld,\"dead_lettered\":%ld,\"seconds\":%.1f}\n",
        to_string(o.store), to_string(o.broker), o.pipelined ? "\"pipelined\":true," : "",
        o.offsets_in_store ? "\"offsets\":\"store\"," : "", o.messages, o.workers, fleet.kills(),
        delivered, redeliveries, captures, gateway_requests, gateway_calls, divergences,
        dead_lettered, seconds);
    std::fflush(stdout);
    return status;
}

}  // namespace chaos
