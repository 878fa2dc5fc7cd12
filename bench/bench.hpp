#pragma once
// Shared pieces of idem_bench (scripts/bench.sh): options, JSON lines, CPU pinning, the servers
// (the test fixtures of idem/testing/, started on loopback in temp dirs), the Google Benchmark
// runner that alternates the idem and raw twin of a case, and the raw SQLite / libpq / hiredis
// clients that issue the same writes by hand.

#include <hiredis/hiredis.h>
#include <libpq-fe.h>
#include <sched.h>
#include <sqlite3.h>
#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <regex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "idem/delivery.hpp"
#include "idem/outcome.hpp"
#include "idem/redis/connection.hpp"
#include "idem/testing/mariadb_server.hpp"
#include "idem/testing/postgres_server.hpp"
#include "idem/testing/redis_server.hpp"

namespace idem_bench {

// ---------------------------------------------------------------------------------------------
// Options

struct Config {
    bool quick = false;
    int rounds = 7;         ///< idem/raw pairs per case; the median of each side is reported
    double min_time = 0.5;  ///< seconds per Google Benchmark run (one sample)
    std::size_t e2e_messages = 4000;     ///< stream entries per end-to-end sample
    std::size_t e2e_pg_messages = 2000;  ///< the same, for the PostgreSQL end-to-end case
    std::size_t rss_messages = 1'000'000;
    std::size_t rss_every = 100'000;
    bool pin = true;  ///< pin client and servers to `cpu` for the round-trip cases
    int cpu = 0;
    std::optional<std::regex> filter;  ///< bench names to run (std::regex_search)
    std::string filter_text;
    std::filesystem::path sqlite_dir;  ///< where the SQLite files go (a fresh temp dir)
    /// The scale cases (bench/scale_cases.cpp) run only when --filter names them.
    bool retained_10m = false;            ///< --retained-10m: the 10M-claim level too
    std::size_t scale_messages = 20'000;  ///< --scale-messages: per retained/purge sample
    /// --sqlite-pragma (repeatable): run on each SQLite store of the scale cases as it opens
    /// ("cache_size=-65536", "mmap_size=1073741824"): the knobs measured one by one.
    std::vector<std::string> sqlite_pragmas;
};

Config& config();
/// Whether the case @p name passes --filter.
bool selected(const std::string& name);
/// Whether the opt-in case @p name was asked for: --filter given and matching it (the scale
/// cases are long; a run without --filter leaves them out).
bool opted_in(const std::string& name);

// ---------------------------------------------------------------------------------------------
// Output: one JSON object per line on stdout

class Json {
  public:
    Json& str(std::string_view key, std::string_view value);
    Json& num(std::string_view key, double value, int decimals = 1);
    Json& integer(std::string_view key, long long value);
    Json& boolean(std::string_view key, bool value);
    Json& null(std::string_view key);
    Json& nums(std::string_view key, const std::vector<double>& values, int decimals = 1);
    Json& ints(std::string_view key, const std::vector<long long>& values);
    /// A bool, or null when it cannot be decided (e.g. the case it compares with was filtered).
    Json& maybe(std::string_view key, std::optional<bool> value);
    [[nodiscard]] std::string text() const { return "{" + body_ + "}"; }

  private:
    void key(std::string_view k);
    std::string body_;
};

void emit(const Json& line);
/// A progress note on stderr (stdout carries only the JSON lines).
void note(const std::string& text);

double median(std::vector<double> values);
/// The median of the per-round ratios idem[i] / raw[i]: each pair ran back to back, so a machine
/// that slows down for a while (a neighbour's build) moves both; steadier than the ratio of the
/// two medians when the samples are bimodal.
double paired_ratio(const std::vector<double>& idem, const std::vector<double>& raw);
/// The interquartile range of those per-round ratios over their median (needs 4 rounds, else
/// NaN): a change of the ratio smaller than about this cannot be told from the noise of one run.
double paired_spread(const std::vector<double>& idem, const std::vector<double>& raw);

/// The fields every idem-vs-raw throughput row carries, from the two sides' samples (msgs/s):
/// idem_msgs_per_s and raw_msgs_per_s (medians), ratio, paired_ratio, ns per message, samples.
Json& add_rates(Json& line, const std::vector<double>& idem_rates,
                const std::vector<double>& raw_rates);

// ---------------------------------------------------------------------------------------------
// CPU pinning. On a 2-vCPU VM a request/reply between two processes on different CPUs pays for
// waking an idle CPU on every round trip; both ends on one CPU do not (issue 6).

/// Pins the calling thread to config().cpu while alive (if config().pin and @p wanted); servers
/// started meanwhile inherit the mask, exactly as `taskset -c <cpu> redis-server` would.
class PinScope {
  public:
    explicit PinScope(bool wanted = true);
    ~PinScope();
    PinScope(const PinScope&) = delete;
    PinScope& operator=(const PinScope&) = delete;
    [[nodiscard]] bool active() const noexcept { return active_; }

  private:
    bool active_ = false;
    cpu_set_t previous_{};
};

/// Cpus_allowed_list of one task (/proc/<pid>/status), e.g. "0" or "0-1".
std::string cpus_allowed(pid_t pid);
/// The distinct Cpus_allowed_list values of every thread of @p pid, joined with " " ("0").
std::string process_cpus(pid_t pid);
/// The calling thread's Cpus_allowed_list.
std::string own_cpus();

/// Adds pinned_cpu (null when unpinned), client_cpus and server_cpus (read back, not assumed).
void add_pinning(Json& line, bool pinned, pid_t server_pid);

// ---------------------------------------------------------------------------------------------
// Servers (started on first use, pinned when pinning is on; stopped at exit)

idem::testing::RedisServer& redis_server();
idem::RedisEndpoint redis_endpoint();
idem::testing::PostgresServer& postgres_server();
idem::testing::MariadbServer& mariadb_server();

/// Resident set size of this process in KiB (/proc/self/statm).
long long rss_kb();

/// CPU time a task (a process' main thread, or a thread id) has run, in ns
/// (/proc/<pid>/schedstat): the server side of a round trip, measured around a sample.
std::uint64_t task_cpu_ns(pid_t pid);
/// CPU time of the calling thread, in ns.
std::uint64_t thread_cpu_ns();

// ---------------------------------------------------------------------------------------------
// Google Benchmark runs, alternated

/// One Google Benchmark run (one sample). The benchmark function sets the counters "msgs" (the
/// messages it handled) and optionally "round_trips".
struct Sample {
    double msgs_per_s = 0;
    double ns_per_msg = 0;
    double round_trips_per_msg = -1;    ///< < 0: not counted
    double client_cpu_ns_per_msg = 0;   ///< this thread's CPU time (Google Benchmark's cpu time)
    double server_cpu_ns_per_msg = -1;  ///< the server task's CPU time; < 0: not measured
    std::string error;                  ///< non-empty: the run failed (SkipWithError)
};

struct Alternated {
    std::vector<Sample> idem;
    std::vector<Sample> raw;
    std::string error;  ///< the first error of either side
    [[nodiscard]] double idem_rate() const;
    [[nodiscard]] double raw_rate() const;
    [[nodiscard]] double idem_ns() const;
    [[nodiscard]] double raw_ns() const;
    [[nodiscard]] std::vector<double> idem_rates() const;
    [[nodiscard]] std::vector<double> raw_rates() const;
};

/// Runs the registered Google Benchmarks @p idem_name and @p raw_name config().rounds times each,
/// alternating (ABBA: idem first in even rounds, raw first in odd ones).
Alternated alternate(const std::string& idem_name, const std::string& raw_name);

/// Adds bench/store/batch, the idem and raw medians, their samples and the ratio.
void add_rates(Json& line, const std::string& bench, const std::string& store, int batch,
               const Alternated& result);

// ---------------------------------------------------------------------------------------------
// Raw twins: the same rows written by hand

/// The effect row every SQL case writes (idem and raw alike).
struct Order {
    std::string order_id;
    std::int64_t amount = 0;
};
// What a dead letter keeps of an order (found by ADL); the bench never dead-letters one.
inline std::string idem_payload(const Order& o) {
    return o.order_id + ":" + std::to_string(o.amount);
}

std::int64_t now_ms();

constexpr int batch_size = 100;
constexpr const char* scope = "bench";

inline std::string message_id(std::uint64_t n) {
    return "m" + std::to_string(n);
}

/// Fills @p deliveries and @p bodies with the next batch_size messages (ids m<seq+1>...).
inline void next_batch(std::uint64_t& seq, std::vector<idem::Delivery>& deliveries,
                       std::vector<Order>& bodies) {
    deliveries.clear();
    bodies.clear();
    for (int i = 0; i < batch_size; ++i) {
        std::string id = message_id(++seq);
        bodies.push_back(Order{id, static_cast<std::int64_t>(seq)});
        deliveries.push_back(idem::Delivery{std::move(id), 1u});
    }
}

/// handler.handle of the next message (id m<seq+1>, amount seq+1).
template <class Handler>
idem::Outcome handle_next(Handler& handler, std::uint64_t& seq) {
    std::string id = message_id(++seq);
    const Order order{id, static_cast<std::int64_t>(seq)};
    return handler.handle(idem::Delivery{std::move(id), 1u}, order);
}

/// Throws "<what>: <reason>" unless @p outcome is processed (outside a Google Benchmark run).
inline void require_processed(const idem::Outcome& outcome, const char* what) {
    if (outcome.disposition != idem::Disposition::processed) {
        throw std::runtime_error(std::string(what) + ": " + outcome.reason);
    }
}

// ---------------------------------------------------------------------------------------------
// --profile: one side of a case alone, for callgrind (--toggle-collect='*profiled_loop*')

/// The idem side: n messages through handler.handle, or through handle_batch batch_size at a
/// time (generic lambdas, so that profile_with() takes them for any handler).
inline constexpr auto loop_single = [](auto& handler, std::uint64_t& seq, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i)
        require_processed(handle_next(handler, seq), "profile");
};
inline constexpr auto loop_batch = [](auto& handler, std::uint64_t& seq, std::size_t n) {
    std::vector<idem::Delivery> deliveries;
    std::vector<Order> bodies;
    for (std::size_t i = 0; i < n; i += batch_size) {
        next_batch(seq, deliveries, bodies);
        for (const auto& outcome : handler.handle_batch(deliveries, bodies))
            require_processed(outcome, "profile");
    }
};

/// The one function callgrind collects in (--toggle-collect='*profiled_loop*'); the warm-up runs
/// the same loop outside it.
template <class Loop, class Target>
__attribute__((noinline)) void profiled_loop(Loop& loop, Target& target, std::uint64_t& seq,
                                             std::size_t n) {
    loop(target, seq, n);
}

/// 1,000 messages of @p loop on @p target untimed, then @p messages in profiled_loop; prints
/// {"profile": name, "messages", "seconds"}.
template <class Loop, class Target>
int profile_with(Loop loop, Target& target, const std::string& name, std::size_t messages) {
    std::uint64_t seq = 0;
    loop(target, seq, 1000);  // warm-up: statements prepared, scripts loaded, caches filled
    const auto start = std::chrono::steady_clock::now();
    profiled_loop(loop, target, seq, messages);
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    emit(Json()
             .str("profile", name)
             .integer("messages", static_cast<long long>(messages))
             .num("seconds", took.count(), 3));
    return 0;
}

/// The raw twin of one message on RawSqlite or RawPostgres: BEGIN, INSERT claim, INSERT effect,
/// COMMIT.
template <class Raw>
void raw_single(Raw& raw, std::uint64_t& seq) {
    const std::string id = message_id(++seq);
    raw.begin();
    raw.insert_claim(scope, id);
    raw.insert_effect(id, static_cast<std::int64_t>(seq));
    raw.commit();
}

/// The raw twin of a batch: the INSERTs of batch_size messages in one transaction.
template <class Raw>
void raw_batch(Raw& raw, std::uint64_t& seq) {
    raw.begin();
    for (int i = 0; i < batch_size; ++i) {
        const std::string id = message_id(++seq);
        raw.insert_claim(scope, id);
        raw.insert_effect(id, static_cast<std::int64_t>(seq));
    }
    raw.commit();
}

/// The effects of the idem side of the store cases, the same rows the raw twins write: one row
/// in `effects` (SQLite, create_sqlite_effects) or `idem_effects` (PostgreSQL,
/// create_postgres_effects). Redis: issue 6's case is claim + complete against one SET NX per
/// message, so its effect writes nothing; redis_single_write adds one key per message.
inline constexpr auto sqlite_effect = [](auto& tx, const Order& o) {
    tx.execute("INSERT INTO effects(order_id, amount) VALUES (?1, ?2)", o.order_id, o.amount);
};
inline constexpr auto postgres_effect = [](auto& tx, const Order& o) {
    tx.execute("INSERT INTO idem_effects(order_id, amount) VALUES ($1, $2)", o.order_id, o.amount);
};
inline constexpr auto mysql_effect = [](auto& tx, const Order& o) {
    tx.execute("INSERT INTO idem_effects(order_id, amount) VALUES (?, ?)", o.order_id, o.amount);
};
inline constexpr auto redis_claim_only_effect = [](auto&, const Order&) {};
inline constexpr auto redis_write_effect = [](auto& tx, const Order& o) {
    tx.write("SET", "fx:" + o.order_id, "1");
};

/// One SQLite connection with the same settings as the idem store (WAL, synchronous=NORMAL), a
/// claims table shaped like idem_claims and an effects table, and prepared statements.
class RawSqlite {
  public:
    explicit RawSqlite(const std::filesystem::path& file);
    ~RawSqlite();
    RawSqlite(const RawSqlite&) = delete;
    RawSqlite& operator=(const RawSqlite&) = delete;

    void begin();  ///< BEGIN IMMEDIATE
    void commit();
    void insert_claim(std::string_view scope, std::string_view id);
    void insert_effect(std::string_view order_id, std::int64_t amount);
    [[nodiscard]] long long count(const char* table);

  private:
    void step(sqlite3_stmt* stmt, const char* what);
    sqlite3* db_ = nullptr;
    sqlite3_stmt* begin_ = nullptr;
    sqlite3_stmt* commit_ = nullptr;
    sqlite3_stmt* claim_ = nullptr;
    sqlite3_stmt* effect_ = nullptr;
};

/// The effects table of the SQLite stores (idem side): the same shape as the raw one.
void create_sqlite_effects(sqlite3* db, const char* table);

/// One libpq connection: BEGIN, INSERT claim, INSERT effect, COMMIT as separate statements (one
/// round trip each), prepared once.
class RawPostgres {
  public:
    /// @p effects_table is created if missing, shaped like the idem side's.
    RawPostgres(const std::string& conninfo, const std::string& effects_table);
    ~RawPostgres();
    RawPostgres(const RawPostgres&) = delete;
    RawPostgres& operator=(const RawPostgres&) = delete;

    void begin();
    void commit();
    void insert_claim(std::string_view scope, std::string_view id);
    void insert_effect(std::string_view order_id, std::int64_t amount);
    [[nodiscard]] std::uint64_t round_trips() const noexcept { return round_trips_; }
    [[nodiscard]] PGconn* conn() const noexcept { return conn_; }

    /// The raw transaction plus one or more of the statements idem's transaction had at the
    /// suite's first run (the postgres_statement_costs diagnostic), each its own round trip.
    struct Extras {
        bool set_local = false;  ///< SET LOCAL lock_timeout after BEGIN
        bool claim_cte = false;  ///< the claim as a CTE (INSERT ... RETURNING, UNION ALL SELECT)
        bool savepoint = false;  ///< SAVEPOINT / RELEASE around the effect
        bool update = false;     ///< claim inserted 'claimed', UPDATE to the outcome before COMMIT
    };
    void message(const Extras& extras, std::string_view scope, std::string_view id,
                 std::int64_t amount);
    void simple(const char* sql);

  private:
    void prepared(const char* name, int count, const char* const* values, const int* lengths,
                  const int* formats);
    PGconn* conn_ = nullptr;
    std::uint64_t round_trips_ = 0;
};

/// Runs SQL (setup) on a fresh connection; throws with the server's message.
void pg_exec(const std::string& conninfo, const std::string& sql);

/// An effects table of the PostgreSQL cases (idem side), shaped like RawPostgres's.
void create_postgres_effects(const std::string& conninfo, const std::string& table);

/// One libmariadb connection (text protocol, as MysqlStore's driver): START TRANSACTION, INSERT
/// claim (raw_claims shaped like idem_claims, its hashed unique key included), INSERT effect,
/// COMMIT, a round trip each.
class RawMysql {
  public:
    /// Creates raw_claims and @p effects_table (if missing) in the server's idem_test database.
    RawMysql(idem::testing::MariadbServer& server, const std::string& effects_table);
    ~RawMysql();
    RawMysql(const RawMysql&) = delete;
    RawMysql& operator=(const RawMysql&) = delete;

    void begin();
    void commit();
    void insert_claim(std::string_view scope, std::string_view id);
    void insert_effect(std::string_view order_id, std::int64_t amount);

  private:
    void simple(const std::string& sql);
    MYSQL* conn_ = nullptr;
    std::string effects_;
};

/// A plain hiredis connection for the raw Redis twins and for filling streams.
class RawRedis {
  public:
    RawRedis(const std::string& host, int port);
    ~RawRedis();
    RawRedis(const RawRedis&) = delete;
    RawRedis& operator=(const RawRedis&) = delete;

    /// One command, one round trip; throws on an error reply. The caller frees nothing.
    std::unique_ptr<redisReply, void (*)(void*)> command(const std::vector<std::string>& args);
    /// Sends every command, then reads every reply: one round trip. Throws on an error reply.
    void pipeline(const std::vector<std::vector<std::string>>& commands);
    /// SET key value NX; true when set.
    bool set_nx(const std::string& key);
    /// @p keys.size() SET NX pipelined; returns how many were set.
    std::size_t set_nx_pipelined(const std::vector<std::string>& keys);
    /// Round trips so far: one a call of any of the above.
    [[nodiscard]] std::uint64_t round_trips() const noexcept { return round_trips_; }
    [[nodiscard]] redisContext* context() const noexcept { return ctx_; }

  private:
    redisContext* ctx_ = nullptr;
    std::uint64_t round_trips_ = 0;
};

// ---------------------------------------------------------------------------------------------
// The cases

void run_memory_cases();
void run_observer_cases();  ///< memory_observed: PrometheusObserver overhead
void run_sqlite_cases();
void run_postgres_cases();
void run_mysql_cases();
void run_redis_cases();
void run_redis_cluster_cases();  ///< redis_cluster_single, redis_cluster_batch
void run_e2e_cases();
#ifdef IDEM_BENCH_WITH_RABBITMQ
void run_rabbitmq_cases();  ///< e2e_rabbitmq_sqlite (bench/e2e_rabbitmq.cpp)
#endif
void run_e2e_nats_cases();     ///< e2e_nats.cpp (IDEM_BENCH_WITH_NATS)
void prepare_kafka_cluster();  ///< e2e_kafka.cpp: the mock cluster, forked before any thread
void run_e2e_kafka_cases();    ///< e2e_kafka_sqlite, e2e_kafka_postgres (IDEM_BENCH_WITH_KAFKA)
void run_rss_case();
/// The opt-in scale cases (bench/scale_cases.cpp): <store>_retained_1m / _10m,
/// <store>_purge_under_load, <store>_workers, rss_flat_<store>.
void run_scale_cases();

/// --profile NAME: the idem side of one case, N messages, in a function callgrind can isolate
/// (valgrind --tool=callgrind --toggle-collect='*profiled_loop*').
int run_profile(const std::string& name, std::size_t messages);
/// --profile of redis_cluster_single, redis_cluster_batch and their raw twins
/// (store_cases.cpp: a 3-master cluster of the profile's own).
int run_cluster_profile(const std::string& name, std::size_t messages);
/// A replica of @p server (AOF always, as the master), in sync when this returns: the
/// replicas_to_ack case's and its profile's.
std::unique_ptr<idem::testing::RedisServer> synced_replica(idem::testing::RedisServer& server);

}  // namespace idem_bench
