// The scale cases, opt-in (they run only when --filter names them; a run without --filter leaves
// them out, so the default run keeps its length):
//   <store>_retained_1m, <store>_retained_10m   claim + commit (no effect) with 1M / 10M claims
//                    already in the store, filled outside the timing in the store's own format
//                    (one INSERT ... SELECT, Redis: a Lua loop of SETs), against the same store
//                    empty: throughput, p50/p99, bytes per retained claim. 10M: --retained-10m
//                    (or a filter naming _10m)
//   <store>_purge_under_load   one consumer at full speed while store.purge() (default
//                    PurgeOptions) deletes 1M expired claims on its own connection, against the
//                    same consumer without a purge
//   <store>_workers  1, 2 and 4 worker processes (fork) on one server, ids unique and ids
//                    contended; every effect counted at the end
//   rss_flat_<store> the rss_flat run (handle_batch of 100, RSS sampled) on every store
// Stores: sqlite, postgres, mysql, redis (rss_flat_memory too).

#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bench.hpp"
#include "idem/idem.hpp"
#include "idem/store/memory.hpp"
#include "idem/store/mysql.hpp"
#include "idem/store/postgres.hpp"
#include "idem/store/redis.hpp"
#include "idem/store/redis/keys.hpp"
#include "idem/store/sqlite.hpp"

namespace idem_bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

/// Message ids spread over the whole key range, like UUIDs (not m1, m2, ... which land side by
/// side in a B-tree): "k" and 16 hex digits of a 64-bit mix of @p n.
std::string spread_id(std::uint64_t n) {
    std::uint64_t x = n + 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return fmt::format("k{:016x}", x ^ (x >> 31));
}

constexpr auto no_effect = [](auto&, const Order&) {};
constexpr std::size_t million = 1'000'000;
constexpr std::int64_t day_ms = 86'400'000;

// ---------------------------------------------------------------------------------------------
// Timed runs of claim + commit

struct Timing {
    double msgs_per_s = 0;
    double p50_us = 0;
    double p99_us = 0;
    double max_us = 0;
};

double percentile(const std::vector<double>& sorted, double p) {
    if (sorted.empty()) return 0;
    const auto at = static_cast<std::size_t>(p * static_cast<double>(sorted.size() - 1));
    return sorted[at];
}

/// @p n handler.handle calls, each timed; every outcome must be processed.
template <class Handler>
Timing timed(Handler& handler, std::uint64_t& seq, std::size_t n) {
    std::vector<double> us;
    us.reserve(n);
    const auto start = Clock::now();
    for (std::size_t i = 0; i < n; ++i) {
        const auto t0 = Clock::now();
        std::string id = spread_id(++seq);
        const Order order{id, static_cast<std::int64_t>(seq)};
        require_processed(handler.handle(idem::Delivery{std::move(id), 1u}, order), "timed");
        us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    Timing t;
    t.msgs_per_s = static_cast<double>(n) / seconds_since(start);
    std::sort(us.begin(), us.end());
    t.p50_us = percentile(us, 0.50);
    t.p99_us = percentile(us, 0.99);
    t.max_us = us.empty() ? 0 : us.back();
    return t;
}

constexpr int timing_rounds = 3;

// ---------------------------------------------------------------------------------------------
// Filling claims in each store's own format, outside the timing

/// The SQL stores: @p count claims of scope "bench", ids "k" + 15 hex digits + @p suffix, evenly
/// spread over the range the live ids (spread_id) fall in and generated in key order (the
/// insert appends), claimed at @p claimed_at.
/// The SQL for the key number of the @p i-th row filled: @p i itself (rows in key order, all at
/// one time) or, when the rows are @p spread_ms apart in time, a permutation of 0..count-1 (7919
/// is a prime that divides no count used here), so the rows go in in time order with keys in no
/// order, as a consumer's claims do (PostgreSQL's heap is then in time order, as in production).
std::string key_index(const char* i, std::size_t count, std::int64_t spread_ms) {
    if (spread_ms == 0) return i;
    return fmt::format("(({} * 7919) % {})", i, count);
}

std::string sqlite_fill_sql(std::size_t count, char suffix, std::int64_t claimed_at,
                            std::int64_t spread_ms = 0) {
    const std::uint64_t step = (1ULL << 60) / count;
    return fmt::format(
        "WITH RECURSIVE c(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM c WHERE i < {}) "
        "INSERT INTO idem_claims(scope, message_id, claimed_at, outcome, reason, fingerprint) "
        "SELECT CAST('{}' AS BLOB), CAST(printf('k%015x{}', {} * {}) AS BLOB), {} + i * {}, "
        "'processed', '', x'' FROM c",
        count - 1, scope, suffix, key_index("i", count, spread_ms), step, claimed_at, spread_ms);
}

std::string postgres_fill_sql(std::size_t count, char suffix, std::int64_t claimed_at,
                              std::int64_t spread_ms = 0) {
    const std::uint64_t step = (1ULL << 60) / count;
    return fmt::format(
        "INSERT INTO idem_claims(scope, message_id, claimed_at, outcome, reason, fingerprint) "
        "SELECT convert_to('{}', 'UTF8'), convert_to('k' || lpad(to_hex({} * {}::bigint), 15, "
        "'0') || '{}', 'UTF8'), {} + i * {}, 'processed', '', ''::bytea FROM "
        "generate_series(0, {}) i",
        scope, key_index("i::bigint", count, spread_ms), step, suffix, claimed_at, spread_ms,
        count - 1);
}

std::string mysql_fill_sql(std::size_t count, char suffix, std::int64_t claimed_at,
                           std::int64_t spread_ms = 0) {
    const std::uint64_t step = (1ULL << 60) / count;
    return fmt::format(
        "INSERT INTO idem_claims(scope, message_id, claimed_at, outcome, reason, fingerprint) "
        "SELECT '{}', CONCAT('k', LPAD(LOWER(HEX({} * {})), 15, '0'), '{}'), {} + seq * {}, "
        "'processed', '', '' FROM seq_0_to_{}",
        scope, key_index("seq", count, spread_ms), step, suffix, claimed_at, spread_ms, count - 1);
}

/// The same claims for partitioned claims, whose claim_key the insert writes (the table checks
/// it: mysql/partitions.hpp).
std::string mysql_partitioned_fill_sql(std::size_t count, char suffix, std::int64_t claimed_at,
                                       std::int64_t spread_ms = 0) {
    const std::uint64_t step = (1ULL << 60) / count;
    return fmt::format(
        "INSERT INTO idem_claims(scope, message_id, claim_key, claimed_at, outcome, reason, "
        "fingerprint) SELECT s, i, {}, t, 'processed', '', '' FROM (SELECT '{}' AS s, "
        "CONCAT('k', LPAD(LOWER(HEX({} * {})), 15, '0'), '{}') AS i, {} + seq * {} AS t "
        "FROM seq_0_to_{}) AS c",
        idem::sql::mysql_claim_key("s", "i"), scope, key_index("seq", count, spread_ms), step,
        suffix, claimed_at, spread_ms, count - 1);
}

long long sqlite_bytes(idem::SqliteStore& store) {
    const auto pages = store.query_int("PRAGMA page_count").value_or(0);
    const auto free_pages = store.query_int("PRAGMA freelist_count").value_or(0);
    return (pages - free_pages) * store.query_int("PRAGMA page_size").value_or(0);
}

long long postgres_bytes(idem::PostgresStore& store) {
    return store.query_int("SELECT pg_total_relation_size('idem_claims')").value_or(0);
}

long long mysql_bytes(idem::testing::MariadbClient& client) {
    client.query("ANALYZE TABLE idem_claims");
    const auto rows = client.query(
        "SELECT data_length + index_length FROM information_schema.tables WHERE "
        "table_schema = 'idem_test' AND table_name = 'idem_claims'");
    return rows.empty() ? 0 : std::stoll(rows[0][0].value_or("0"));
}

long long redis_used_memory(RawRedis& redis) {
    auto reply = redis.command({"INFO", "memory"});
    const std::string text(reply->str, reply->len);
    const auto at = text.find("used_memory:");
    return at == std::string::npos ? 0 : std::stoll(text.substr(at + 12));
}

/// A record a real claim + commit of @p id left on a store with the key prefix "idem:", as the
/// copies redis_fill() writes start from.
struct RedisTemplate {
    std::string key_prefix;  ///< the claim key before the id and its closing brace
    std::string head;        ///< the record before the id (lengths, `~<retention>` times)
    long long ttl_ms = 0;    ///< the record's expiry, from now (PTTL)
};

/// The record of @p id (claimed and committed already), read with GET and PTTL.
RedisTemplate redis_template(RawRedis& redis, const std::string& id) {
    const std::string key = idem::redis::KeyLayout{"idem:"}.claim(scope, id);
    auto value = redis.command({"GET", key});
    auto ttl = redis.command({"PTTL", key});
    if (value->type != REDIS_REPLY_STRING) throw std::runtime_error("no template record");
    const std::string record(value->str, value->len);
    if (record.size() < id.size() || record.compare(record.size() - id.size(), id.size(), id) != 0)
        throw std::runtime_error("redis_template: the record does not end with its id");
    return RedisTemplate{key.substr(0, key.size() - id.size() - 1),
                         record.substr(0, record.size() - id.size()), ttl->integer};
}

/// Redis: SET of @p count copies of @p templ (the same header, the id swapped for "r" + 16
/// digits, from @p from), each expiring in @p ttl ms. A Lua loop, 50,000 SETs per EVAL.
void redis_fill(RawRedis& redis, const RedisTemplate& templ, std::size_t from, std::size_t count,
                long long ttl) {
    const char* script =
        "local n = 0 "
        "for i = tonumber(ARGV[2]), tonumber(ARGV[3]) do "
        "  local id = string.format('r%016d', i) "
        "  redis.call('SET', ARGV[4] .. id .. '}', ARGV[1] .. id, 'PX', ARGV[5]) "
        "  n = n + 1 "
        "end return n";
    constexpr std::size_t chunk = 50'000;
    for (std::size_t at = from; at < from + count; at += chunk) {
        const std::size_t last = std::min(at + chunk, from + count) - 1;
        redis.command({"EVAL", script, "0", templ.head, std::to_string(at), std::to_string(last),
                       templ.key_prefix, std::to_string(ttl)});
    }
}

// ---------------------------------------------------------------------------------------------
// <store>_retained_*

/// Fills claims: (pass 0: the first million, pass 1: the next nine), returns nothing.
using Filler = std::function<void(int pass, std::size_t count)>;

/// The median of each figure over rounds, and the median of the per-round ratios.
struct Paired {
    Timing full;
    Timing empty;
    double ratio = 0;      ///< median of full/empty throughput, round by round
    double p99_ratio = 0;  ///< the same for p99
};

/// A warm-up of a fifth of config().scale_messages on each side, then timing_rounds rounds of
/// config().scale_messages on the full store and on the empty one, alternating (empty first in
/// even rounds): a neighbour's load that comes and goes moves both sides of a round.
template <class FullHandler, class EmptyHandler>
Paired alternated(FullHandler& full, std::uint64_t& full_seq, EmptyHandler& empty,
                  std::uint64_t& empty_seq) {
    const std::size_t n = config().scale_messages;
    timed(full, full_seq, std::max<std::size_t>(n / 5, 1));
    timed(empty, empty_seq, std::max<std::size_t>(n / 5, 1));
    std::vector<Timing> f, e;
    std::vector<double> ratios, p99_ratios;
    for (int r = 0; r < timing_rounds; ++r) {
        if (r % 2 == 0) e.push_back(timed(empty, empty_seq, n));
        f.push_back(timed(full, full_seq, n));
        if (r % 2 == 1) e.push_back(timed(empty, empty_seq, n));
        ratios.push_back(f.back().msgs_per_s / e.back().msgs_per_s);
        p99_ratios.push_back(f.back().p99_us / e.back().p99_us);
    }
    auto med = [](const std::vector<Timing>& t) {
        std::vector<double> rate, p50, p99, max;
        for (const auto& x : t) {
            rate.push_back(x.msgs_per_s);
            p50.push_back(x.p50_us);
            p99.push_back(x.p99_us);
            max.push_back(x.max_us);
        }
        return Timing{median(rate), median(p50), median(p99), median(max)};
    };
    return Paired{med(f), med(e), median(ratios), median(p99_ratios)};
}

/// @p store gets the retained claims, @p empty (the same kind, its own file / database /
/// server) stays empty: the two are timed alternately at each level.
template <class Store>
void run_retained(const std::string& store_name, Store& store, Store& empty_store,
                  const Filler& fill, const std::function<long long()>& footprint,
                  const std::string& setup, const std::string& footprint_is) {
    const std::string one = store_name + "_retained_1m";
    const std::string ten = store_name + "_retained_10m";
    const bool with_ten = opted_in(ten) && (config().retained_10m ||
                                            config().filter_text.find("10m") != std::string::npos);
    auto handler = idem::make_handler(store, idem::Policy{scope}, no_effect);
    auto empty = idem::make_handler(empty_store, idem::Policy{scope}, no_effect);
    std::uint64_t seq = 0;
    std::uint64_t empty_seq = 0;
    timed(handler, seq, 1);  // the first claim (Redis: the record the fill copies)
    long long bytes_before = footprint();
    std::size_t retained = 0;
    auto level = [&](const std::string& name, int pass, std::size_t add) {
        note(fmt::format("{}: filling {} claims", name, add));
        const auto fill_start = Clock::now();
        fill(pass, add);
        const double fill_s = seconds_since(fill_start);
        retained += add;
        const long long bytes = footprint();
        note(fmt::format("{}: filled in {:.1f} s; timing", name, fill_s));
        const Paired p = alternated(handler, seq, empty, empty_seq);
        Json line;
        line.str("bench", name)
            .str("store", store_name)
            .integer("retained_claims", static_cast<long long>(retained))
            .num("msgs_per_s", p.full.msgs_per_s)
            .num("p50_us", p.full.p50_us)
            .num("p99_us", p.full.p99_us)
            .num("max_us", p.full.max_us)
            .num("empty_msgs_per_s", p.empty.msgs_per_s)
            .num("empty_p50_us", p.empty.p50_us)
            .num("empty_p99_us", p.empty.p99_us)
            .num("ratio_vs_empty", p.ratio, 3)
            .num("p99_vs_empty", p.p99_ratio, 3)
            .num("bytes_per_retained_claim",
                 static_cast<double>(bytes - bytes_before) / static_cast<double>(add), 1)
            .integer("footprint_bytes", bytes)
            .str("footprint_is", footprint_is)
            .num("fill_s", fill_s)
            .integer("messages_per_round", static_cast<long long>(config().scale_messages))
            .integer("rounds", timing_rounds)
            .str("empty",
                 "the same store kind, its own file / database / server, timed alternately "
                 "with the full one; ratios are the median of the per-round ratios")
            .str("effect", "none: claim + commit (handler.handle), ids spread like UUIDs")
            .str("setup", setup)
            .str("target", "ratio_vs_empty >= 0.80 and p99_vs_empty <= 1.50")
            .boolean("met", p.ratio >= 0.80 && p.p99_ratio <= 1.50);
        emit(line);
        bytes_before = bytes;
    };
    level(one, 0, million);
    if (with_ten) level(ten, 1, 9 * million);
}

bool retained_wanted(const std::string& store_name) {
    return opted_in(store_name + "_retained_1m") || opted_in(store_name + "_retained_10m");
}

idem::MysqlEndpoint mysql_endpoint() {
    auto& server = mariadb_server();
    idem::MysqlEndpoint endpoint;
    endpoint.host = server.host();
    endpoint.port = static_cast<unsigned>(server.port());
    endpoint.user = server.user();
    endpoint.database = "idem_test";
    return endpoint;
}

idem::testing::MariadbClient long_mysql_client() {
    auto& server = mariadb_server();
    return idem::testing::MariadbClient{server.host(), server.port(), "idem_test", server.user(),
                                        std::chrono::seconds(3600)};
}

idem::SqliteStore open_sqlite(const std::string& file) {
    idem::SqliteOptions options;
    options.wal = true;
    options.synchronous = idem::Synchronous::normal;
    return idem::SqliteStore{(config().sqlite_dir / file).string(), options};
}

/// @p store with the --sqlite-pragma knobs run on it.
idem::SqliteStore& with_knobs(idem::SqliteStore& store) {
    for (const auto& pragma : config().sqlite_pragmas)
        store.execute("PRAGMA " + pragma);
    return store;
}

/// The SQLite cases' setup, with the --sqlite-pragma knobs.
std::string sqlite_setup() {
    std::string setup = "WAL, synchronous=NORMAL, file on /tmp (ext4), cache_size -2000";
    for (const auto& pragma : config().sqlite_pragmas)
        setup += ", then PRAGMA " + pragma;
    return setup;
}
const char* const postgres_setup =
    "fixture: shared_buffers=16MB, fsync=off, cluster on /dev/shm; VACUUM ANALYZE after the fill";
const char* const mysql_setup =
    "fixture: MariaDB, innodb_buffer_pool_size=16M, innodb_flush_log_at_trx_commit=1";
const char* const redis_setup =
    "its own redis-server: appendonly yes, appendfsync always, AOF rewrite off, data on tmpfs";

void retained_sqlite() {
    if (!retained_wanted("sqlite")) return;
    std::filesystem::remove(config().sqlite_dir / "retained.db");
    std::filesystem::remove(config().sqlite_dir / "retained_empty.db");
    auto store = open_sqlite("retained.db");
    auto empty = open_sqlite("retained_empty.db");
    with_knobs(store);
    with_knobs(empty);
    run_retained(
        "sqlite", store, empty,
        [&](int pass, std::size_t count) {
            store.execute(sqlite_fill_sql(count, pass == 0 ? '0' : '8', now_ms()));
            store.execute("PRAGMA wal_checkpoint(TRUNCATE)");
        },
        [&] { return sqlite_bytes(store); }, sqlite_setup(),
        "(page_count - freelist_count) * page_size: the database, claims table and indexes");
}

void retained_postgres() {
    if (!retained_wanted("postgres")) return;
    auto& server = postgres_server();
    PinScope pin;
    idem::PostgresStore store{server.conninfo()};
    server.exec("TRUNCATE idem_claims");
    server.exec("DROP DATABASE IF EXISTS idem_empty", "postgres");
    server.exec("CREATE DATABASE idem_empty", "postgres");
    idem::PostgresStore empty{server.conninfo("idem_empty")};
    run_retained(
        "postgres", store, empty,
        [&](int pass, std::size_t count) {
            server.exec(postgres_fill_sql(count, pass == 0 ? '0' : '8', now_ms()));
            server.exec("VACUUM ANALYZE idem_claims");
        },
        [&] { return postgres_bytes(store); }, postgres_setup,
        "pg_total_relation_size('idem_claims'): heap, TOAST, primary key and claimed_at index");
    server.exec("TRUNCATE idem_claims");
}

void retained_mysql() {
    if (!retained_wanted("mysql")) return;
    PinScope pin;
    idem::MysqlStore store{mysql_endpoint()};
    auto client = long_mysql_client();
    client.query("TRUNCATE TABLE idem_claims");
    client.query("DROP DATABASE IF EXISTS idem_empty");
    client.query("CREATE DATABASE idem_empty");
    idem::MysqlEndpoint empty_endpoint = mysql_endpoint();
    empty_endpoint.database = "idem_empty";
    idem::MysqlStore empty{empty_endpoint};
    run_retained(
        "mysql", store, empty,
        [&](int pass, std::size_t count) {
            client.query(mysql_fill_sql(count, pass == 0 ? '0' : '8', now_ms()));
        },
        [&] { return mysql_bytes(client); }, mysql_setup,
        "information_schema.tables data_length + index_length after ANALYZE TABLE (InnoDB's "
        "estimate, in pages)");
    client.query("TRUNCATE TABLE idem_claims");
}

/// A redis-server of the case's own (stopped with it), as the bench's: AOF always, no rewrite.
std::unique_ptr<idem::testing::RedisServer> own_redis() {
    auto server =
        std::make_unique<idem::testing::RedisServer>(idem::testing::RedisServer::aof_always);
    server->client().exec({"CONFIG", "SET", "auto-aof-rewrite-percentage", "0"});
    return server;
}

idem::RedisEndpoint endpoint_of(const idem::testing::RedisServer& server) {
    idem::RedisEndpoint endpoint;
    endpoint.host = server.host();
    endpoint.port = server.port();
    return endpoint;
}

void retained_redis() {
    if (!retained_wanted("redis")) return;
    PinScope pin;
    auto server = own_redis();
    auto empty_server = own_redis();
    idem::RedisStore store{endpoint_of(*server)};
    idem::RedisStore empty{endpoint_of(*empty_server)};
    RawRedis raw{server->host(), server->port()};
    run_retained(
        "redis", store, empty,
        [&](int pass, std::size_t count) {
            const auto templ = redis_template(raw, spread_id(1));  // claimed and committed first
            redis_fill(raw, templ, pass == 0 ? 0 : million, count, templ.ttl_ms);
        },
        [&] { return redis_used_memory(raw); }, redis_setup,
        "INFO memory used_memory (the whole server; delta per claim)");
}

// ---------------------------------------------------------------------------------------------
// <store>_purge_under_load

/// The first expired claim's time: 1M claims a millisecond apart (in an order unrelated to their
/// ids, as a consumer's claims are), the last of them two days old.
std::int64_t expired_from() {
    return now_ms() - 2 * day_ms - static_cast<std::int64_t>(million);
}

/// Samples pg_stat_activity and pg_locks on its own connection every 5 ms while alive.
class PgLockSampler {
  public:
    explicit PgLockSampler(const std::string& conninfo) : conn_(PQconnectdb(conninfo.c_str())) {
        if (PQstatus(conn_) != CONNECTION_OK) throw std::runtime_error("PgLockSampler: connect");
        thread_ = std::thread([this] { loop(); });
    }
    ~PgLockSampler() {
        stop();
        PQfinish(conn_);
    }
    PgLockSampler(const PgLockSampler&) = delete;
    PgLockSampler& operator=(const PgLockSampler&) = delete;
    void stop() {
        done_ = true;
        if (thread_.joinable()) thread_.join();
    }
    /// Stops, then adds the samples to the bench row @p line.
    void add_figures(Json& line) {
        stop();
        line.integer("lock_samples", samples)
            .integer("samples_with_lock_wait", samples_with_lock_wait)
            .integer("samples_with_ungranted_lock", samples_with_ungranted)
            .integer("max_backends_waiting_on_lock", max_lock_waiters)
            .integer("samples_with_active_wait_event", samples_with_any_wait)
            .str("lock_sampling",
                 "pg_stat_activity (wait_event_type = 'Lock') and pg_locks (NOT granted), "
                 "every 5 ms during the purge, own connection");
    }
    long long samples = 0;
    long long samples_with_lock_wait = 0;  ///< a client backend waiting on a heavyweight lock
    long long samples_with_ungranted = 0;  ///< pg_locks had a row not granted
    long long max_lock_waiters = 0;
    long long samples_with_any_wait = 0;  ///< an active backend in any wait event (IO, LWLock...)

  private:
    void loop() {
        const char* sql =
            "SELECT count(*) FILTER (WHERE wait_event_type = 'Lock'), "
            "count(*) FILTER (WHERE state = 'active' AND wait_event_type IS NOT NULL "
            "AND wait_event_type <> 'Client'), "
            "(SELECT count(*) FROM pg_locks WHERE NOT granted) "
            "FROM pg_stat_activity WHERE backend_type = 'client backend' "
            "AND pid <> pg_backend_pid()";
        while (!done_) {
            PGresult* res = PQexec(conn_, sql);
            if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1) {
                const long long lock = std::atoll(PQgetvalue(res, 0, 0));
                ++samples;
                if (lock > 0) ++samples_with_lock_wait;
                if (std::atoll(PQgetvalue(res, 0, 1)) > 0) ++samples_with_any_wait;
                if (std::atoll(PQgetvalue(res, 0, 2)) > 0) ++samples_with_ungranted;
                max_lock_waiters = std::max(max_lock_waiters, lock);
            }
            PQclear(res);
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
    }
    PGconn* conn_;
    std::atomic<bool> done_{false};
    std::thread thread_;
};

/// The consumer while @p busy is set, in runs of 500 messages (at least @p min_messages).
template <class Handler>
Timing consume_while(Handler& handler, std::uint64_t& seq, const std::atomic<bool>& busy,
                     std::size_t min_messages) {
    std::vector<double> us;
    const auto start = Clock::now();
    while (busy || us.size() < min_messages) {
        for (int i = 0; i < 500; ++i) {
            const auto t0 = Clock::now();
            std::string id = spread_id(++seq);
            const Order order{id, static_cast<std::int64_t>(seq)};
            require_processed(handler.handle(idem::Delivery{std::move(id), 1u}, order),
                              "purge_under_load");
            us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        }
    }
    Timing t;
    t.msgs_per_s = static_cast<double>(us.size()) / seconds_since(start);
    std::sort(us.begin(), us.end());
    t.p50_us = percentile(us, 0.50);
    t.p99_us = percentile(us, 0.99);
    t.max_us = us.back();
    return t;
}

/// One consumer on @p consumer_store; @p fill_expired fills 1M claims 2 days old; then the
/// consumer alone, the consumer while @p purger.purge(24 h) runs on its own connection, the
/// consumer alone again. @p extra adds the store's own figures (lock waits).
template <class Store>
void run_purge(const std::string& store_name, Store& consumer_store, Store& purger,
               const std::function<void()>& fill_expired, const std::function<void()>& start_watch,
               const std::function<void(Json&)>& extra, const std::string& setup) {
    const std::string name = store_name + "_purge_under_load";
    // The defaults, as a consumer's Purger runs them, but for a time budget: the rates and the
    // consumer's ratio are those of the first 60 s (a paced purge of 1M rows takes minutes).
    idem::PurgeOptions options;
    options.time_budget = std::chrono::seconds(60);
    auto handler = idem::make_handler(consumer_store, idem::Policy{scope}, no_effect);
    std::uint64_t seq = 0;
    note(name + ": filling 1,000,000 expired claims");
    fill_expired();
    const std::size_t n = config().scale_messages;
    timed(handler, seq, n / 5);  // warm-up
    std::atomic<bool> busy{false};
    note(name + ": consumer alone");
    const Timing before = timed(handler, seq, n);
    note(name + ": consumer with the purge");
    busy = true;
    idem::PurgeResult purged;
    double purge_s = 0;
    std::string purge_error;
    start_watch();
    std::thread purge_thread([&] {
        const auto start = Clock::now();
        try {
            purged = purger.purge(std::chrono::hours(24), options);
        } catch (const std::exception& e) {
            purge_error = e.what();
        }
        purge_s = seconds_since(start);
        busy = false;
    });
    const Timing during = consume_while(handler, seq, busy, 1000);
    purge_thread.join();
    note(name + ": consumer alone, after");
    const Timing after = timed(handler, seq, n);
    const double alone = (before.msgs_per_s + after.msgs_per_s) / 2;
    const double ratio = during.msgs_per_s / alone;
    const double purge_rate = static_cast<double>(purged.claims) / purge_s;
    const double purge_vs_ingest = purge_rate / during.msgs_per_s;
    Json line;
    line.str("bench", name)
        .str("store", store_name)
        .integer("expired_claims_purged", static_cast<long long>(purged.claims))
        .num("purge_s", purge_s, 2)
        .num("purge_claims_per_s", purge_rate)
        .integer("purge_batch_rows", static_cast<long long>(options.batch_rows))
        .num("purge_duty_cycle", options.duty_cycle, 2)
        .integer("purge_batches", static_cast<long long>(purged.batches))
        .integer("purge_partitions_dropped", static_cast<long long>(purged.partitions_dropped))
        .num("purge_time_budget_s", std::chrono::duration<double>(options.time_budget).count(), 0)
        .boolean("purge_complete", purged.complete)
        .num("consumer_msgs_per_s_alone", alone)
        .num("consumer_msgs_per_s_before", before.msgs_per_s)
        .num("consumer_msgs_per_s_after", after.msgs_per_s)
        .num("consumer_msgs_per_s_during_purge", during.msgs_per_s)
        .num("ratio_during_vs_alone", ratio, 3)
        .num("purge_vs_ingest", purge_vs_ingest, 1)
        .num("p99_us_alone", before.p99_us)
        .num("p99_us_during_purge", during.p99_us)
        .num("max_commit_us_alone", std::max(before.max_us, after.max_us))
        .num("max_commit_us_during_purge", during.max_us)
        .str("setup", setup)
        .str("target", "ratio_during_vs_alone >= 0.80 and purge_vs_ingest >= 10")
        .boolean("met", ratio >= 0.80 && purge_vs_ingest >= 10);
    if (!purge_error.empty()) line.str("error", purge_error);
    extra(line);
    emit(line);
}

void purge_sqlite() {
    if (!opted_in("sqlite_purge_under_load")) return;
    std::filesystem::remove(config().sqlite_dir / "purge.db");
    auto consumer = open_sqlite("purge.db");
    auto purger = open_sqlite("purge.db");
    with_knobs(consumer);
    with_knobs(purger);
    run_purge(
        "sqlite", consumer, purger,
        [&] {
            consumer.execute(sqlite_fill_sql(million, '0', expired_from(), 1));
            consumer.execute("PRAGMA wal_checkpoint(TRUNCATE)");
        },
        [] {}, [](Json&) {},
        sqlite_setup() +
            "; two connections to one file (the consumer's and the purge's), one writer at a "
            "time: max_commit_us_during_purge is the writer starvation");
}

void purge_postgres() {
    if (!opted_in("postgres_purge_under_load")) return;
    auto& server = postgres_server();
    PinScope pin;
    idem::PostgresStore consumer{server.conninfo()};
    idem::PostgresStore purger{server.conninfo()};
    server.exec("TRUNCATE idem_claims");
    std::unique_ptr<PgLockSampler> sampler;
    run_purge(
        "postgres", consumer, purger,
        [&] {
            server.exec(postgres_fill_sql(million, '0', expired_from(), 1));
            server.exec("VACUUM ANALYZE idem_claims");
        },
        [&] { sampler = std::make_unique<PgLockSampler>(server.conninfo()); },
        [&](Json& line) { sampler->add_figures(line); }, postgres_setup);
    server.exec("TRUNCATE idem_claims");
}

void purge_postgres_partitioned() {
    if (!opted_in("postgres_partitioned_purge_under_load")) return;
    auto& server = postgres_server();
    PinScope pin;
    const std::string db = "idem_bench_partitioned";
    server.exec("DROP DATABASE IF EXISTS " + db + " WITH (FORCE)", "postgres");
    server.exec("CREATE DATABASE " + db, "postgres");
    idem::PostgresOptions daily;
    daily.claim_partition_span = std::chrono::hours(24);
    {
        // A store opened three days ago made the partitions of the days the expired claims
        // were made in (and of the days since).
        idem::PostgresOptions back = daily;
        back.clock = [] { return std::chrono::system_clock::now() - std::chrono::hours(72); };
        idem::PostgresStore opener{server.conninfo(db), back};
    }
    {
        idem::PostgresStore consumer{server.conninfo(db), daily};
        idem::PostgresStore purger{server.conninfo(db), daily};
        std::unique_ptr<PgLockSampler> sampler;
        run_purge(
            "postgres_partitioned", consumer, purger,
            [&] {
                server.exec(postgres_fill_sql(million, '0', expired_from(), 1), db);
                server.exec("VACUUM ANALYZE idem_claims", db);
            },
            [&] { sampler = std::make_unique<PgLockSampler>(server.conninfo(db)); },
            [&](Json& line) { sampler->add_figures(line); },
            std::string(postgres_setup) +
                "; claims in a partition per day (PostgresOptions::claim_partition_span 24 h): "
                "the purge drops the days that have expired");
    }
    server.exec("DROP DATABASE IF EXISTS " + db + " WITH (FORCE)", "postgres");
}

void purge_mysql_partitioned() {
    if (!opted_in("mysql_partitioned_purge_under_load")) return;
    PinScope pin;
    const std::string db = "idem_bench_partitioned";
    auto admin = long_mysql_client();
    admin.query("DROP DATABASE IF EXISTS " + db);
    admin.query("CREATE DATABASE " + db);
    idem::MysqlEndpoint endpoint = mysql_endpoint();
    endpoint.database = db;
    idem::MysqlOptions daily;
    daily.claim_partition_span = std::chrono::hours(24);
    {
        // A store opened three days ago made the partitions of the days the expired claims
        // were made in (and of the days since).
        idem::MysqlOptions back = daily;
        back.clock = [] { return std::chrono::system_clock::now() - std::chrono::hours(72); };
        idem::MysqlStore opener{endpoint, back};
    }
    {
        idem::MysqlStore consumer{endpoint, daily};
        idem::MysqlStore purger{endpoint, daily};
        auto& server = mariadb_server();
        idem::testing::MariadbClient client{server.host(), server.port(), db, server.user(),
                                            std::chrono::seconds(3600)};
        run_purge(
            "mysql_partitioned", consumer, purger,
            [&] {
                client.query(mysql_partitioned_fill_sql(million, '0', expired_from(), 1));
                client.query("ANALYZE TABLE idem_claims");
            },
            [] {}, [](Json&) {},
            std::string(mysql_setup) +
                "; claims in a partition per day (MysqlOptions::claim_partition_span 24 h): the "
                "purge drops the days that have expired");
    }
    admin.query("DROP DATABASE IF EXISTS " + db);
}

void purge_mysql() {
    if (!opted_in("mysql_purge_under_load")) return;
    PinScope pin;
    idem::MysqlStore consumer{mysql_endpoint()};
    idem::MysqlStore purger{mysql_endpoint()};
    auto client = long_mysql_client();
    client.query("TRUNCATE TABLE idem_claims");
    run_purge(
        "mysql", consumer, purger,
        [&] { client.query(mysql_fill_sql(million, '0', expired_from(), 1)); }, [] {}, [](Json&) {},
        mysql_setup);
    client.query("TRUNCATE TABLE idem_claims");
}

void purge_redis() {
    if (!opted_in("redis_purge_under_load")) return;
    PinScope pin;
    auto server = own_redis();
    idem::RedisStore consumer{endpoint_of(*server)};
    idem::RedisStore purger{endpoint_of(*server)};
    RawRedis raw{server->host(), server->port()};
    run_purge(
        "redis", consumer, purger,
        [&] {
            // The template: a claim + commit now, its times "~<retention>" before its expiry;
            // copies expiring two days sooner were claimed two days ago.
            const std::string id = spread_id(~std::uint64_t{0});
            auto handler = idem::make_handler(consumer, idem::Policy{scope}, no_effect);
            require_processed(handler.handle(idem::Delivery{id, 1u}, Order{id, 0}), "template");
            const auto templ = redis_template(raw, id);
            redis_fill(raw, templ, 0, million, templ.ttl_ms - 2 * day_ms);
        },
        [] {}, [](Json&) {},
        std::string(redis_setup) +
            "; 1M claims claimed 2 days ago (their keys' expiry still 12 days away), the "
            "consumer and the purge on two connections");
}

/// redis_expiry_under_load: Redis's own retention. The consumer alone; 1M claims filled (copies
/// of a real record) all expiring at one moment; the consumer from that moment until the server's
/// active expiry has deleted 99 % of them (INFO stats expired_keys, polled every 20 ms on its own
/// connection); alone again.
void expiry_redis() {
    if (!opted_in("redis_expiry_under_load")) return;
    const std::string name = "redis_expiry_under_load";
    PinScope pin;
    auto server = own_redis();
    idem::RedisStore consumer{endpoint_of(*server)};
    RawRedis raw{server->host(), server->port()};
    RawRedis watch{server->host(), server->port()};
    auto handler = idem::make_handler(consumer, idem::Policy{scope}, no_effect);
    std::uint64_t seq = 0;
    const std::size_t n = config().scale_messages;
    timed(handler, seq, n / 5);  // warm-up, and the template below
    note(name + ": consumer alone");
    const Timing before = timed(handler, seq, n);
    const auto templ = redis_template(raw, spread_id(1));
    constexpr long long expire_in_ms = 40'000;
    note(name + ": filling 1,000,000 claims that expire together in 40 s");
    const auto fill_start = Clock::now();
    const long long fill_at = now_ms();
    redis_fill(raw, templ, 0, million, expire_in_ms);
    const double fill_s = seconds_since(fill_start);
    // INFO stats' expired_keys counts the keys the server deleted by expiry (the consumer's
    // own claims expire in 14 days: none of them).
    const auto expired_keys = [&] {
        auto reply = watch.command({"INFO", "stats"});
        const std::string text(reply->str, reply->len);
        const auto at = text.find("expired_keys:");
        return at == std::string::npos ? 0LL : std::stoll(text.substr(at + 13));
    };
    const long long expired_before = expired_keys();
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::max(0LL, fill_at + expire_in_ms - now_ms())));
    note(name + ": consumer while they expire");
    std::atomic<bool> busy{true};
    double expiry_s = 0;
    std::thread watcher([&] {
        const auto start = Clock::now();
        while (expired_keys() - expired_before < static_cast<long long>(million / 100 * 99) &&
               seconds_since(start) < 600)
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        expiry_s = seconds_since(start);
        busy = false;
    });
    const Timing during = consume_while(handler, seq, busy, 1000);
    watcher.join();
    note(name + ": consumer alone, after");
    const Timing after = timed(handler, seq, n);
    const double alone = (before.msgs_per_s + after.msgs_per_s) / 2;
    const double ratio = during.msgs_per_s / alone;
    const double expiry_rate = 0.99 * static_cast<double>(million) / expiry_s;
    Json line;
    line.str("bench", name)
        .str("store", "redis")
        .integer("claims_expired", static_cast<long long>(million))
        .num("fill_s", fill_s)
        .num("expiry_s", expiry_s, 2)
        .num("expired_claims_per_s", expiry_rate)
        .num("consumer_msgs_per_s_alone", alone)
        .num("consumer_msgs_per_s_before", before.msgs_per_s)
        .num("consumer_msgs_per_s_after", after.msgs_per_s)
        .num("consumer_msgs_per_s_during_expiry", during.msgs_per_s)
        .num("ratio_during_vs_alone", ratio, 3)
        .num("expiry_vs_ingest", expiry_rate / during.msgs_per_s, 1)
        .num("p99_us_alone", before.p99_us)
        .num("p99_us_during_expiry", during.p99_us)
        .num("max_commit_us_alone", std::max(before.max_us, after.max_us))
        .num("max_commit_us_during_expiry", during.max_us)
        .str("expiry_is", "from the moment they expire until 99 % are gone (INFO expired_keys)")
        .str("setup", std::string(redis_setup) + "; default active expiry (hz 10, effort 1)")
        .str("target", "ratio_during_vs_alone >= 0.80 and expiry_vs_ingest >= 10")
        .boolean("met", ratio >= 0.80 && expiry_rate / during.msgs_per_s >= 10);
    emit(line);
}

// ---------------------------------------------------------------------------------------------
// <store>_workers

struct WorkerCounts {
    std::uint64_t processed = 0;
    std::uint64_t duplicates = 0;
    std::uint64_t in_progress_retries = 0;  ///< another worker held the claim: tried again
    std::uint64_t timeouts = 0;             ///< failed, store_timeout: tried again
    std::uint64_t failed = 0;               ///< failed otherwise (a deadlock would be here)
    std::uint64_t gave_up = 0;              ///< 1000 tries without an answer
    bool error = false;
};

/// Worker @p w of a run: its own store (opened after fork), @p per_worker messages; unique ids
/// (w's own) or contended (every worker the same ids, in the same order).
template <class Store>
WorkerCounts work(Store& store, int w, std::size_t per_worker, bool contended,
                  const std::function<void(typename Store::Transaction&, const Order&)>& effect) {
    auto handler = idem::make_handler(store, idem::Policy{scope}, effect);
    WorkerCounts c;
    for (std::size_t i = 0; i < per_worker; ++i) {
        const std::string id = contended ? fmt::format("c{}", i) : fmt::format("w{}-{}", w, i);
        const Order order{id, 1};
        for (int tries = 0;; ++tries) {
            if (tries == 1000) {
                ++c.gave_up;
                break;
            }
            const idem::Outcome outcome = handler.handle(idem::Delivery{id, 1u}, order);
            if (outcome.disposition == idem::Disposition::processed) {
                ++c.processed;
                break;
            }
            if (outcome.disposition == idem::Disposition::duplicate) {
                ++c.duplicates;
                break;
            }
            if (outcome.disposition == idem::Disposition::in_progress) {
                ++c.in_progress_retries;
            } else if (outcome.cause == idem::FailureCause::store_timeout) {
                ++c.timeouts;
            } else {
                ++c.failed;
            }
            std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
    }
    return c;
}

/// Forks @p n workers; each runs @p prepare (opens its store) and reports ready; once all are,
/// they are released together. Returns their counts and the wall time from the release to the
/// last worker's result.
using WorkerRun = std::function<WorkerCounts()>;
std::vector<WorkerCounts> fork_workers(int n, const std::function<WorkerRun(int)>& prepare,
                                       double& wall_s) {
    int go[2];
    int ready[2];
    if (::pipe(go) != 0 || ::pipe(ready) != 0) throw std::runtime_error("pipe");
    std::vector<pid_t> pids;
    std::vector<int> outs;
    std::fflush(stdout);
    std::fflush(stderr);
    for (int w = 0; w < n; ++w) {
        int out[2];
        if (::pipe(out) != 0) throw std::runtime_error("pipe");
        const pid_t pid = ::fork();
        if (pid < 0) throw std::runtime_error("fork");
        if (pid == 0) {
            ::close(go[1]);
            ::close(ready[0]);
            ::close(out[0]);
            WorkerCounts counts;
            try {
                WorkerRun run = prepare(w);
                const char one = 1;
                if (::write(ready[1], &one, 1) != 1) ::_exit(2);
                char c;
                while (::read(go[0], &c, 1) > 0) {
                }
                counts = run();
            } catch (const std::exception& e) {
                std::fprintf(stderr, "idem_bench: worker %d: %s\n", w, e.what());
                counts.error = true;
                const char one = 1;
                if (::write(ready[1], &one, 1) != 1) ::_exit(2);
            }
            if (::write(out[1], &counts, sizeof counts) != sizeof counts) ::_exit(2);
            ::_exit(0);
        }
        ::close(out[1]);
        pids.push_back(pid);
        outs.push_back(out[0]);
    }
    ::close(go[0]);
    ::close(ready[1]);
    for (int w = 0; w < n; ++w) {
        char c;
        if (::read(ready[0], &c, 1) != 1) break;
    }
    ::close(ready[0]);
    const auto start = Clock::now();
    ::close(go[1]);  // EOF: every worker starts
    std::vector<WorkerCounts> all;
    for (int w = 0; w < n; ++w) {
        WorkerCounts counts;
        if (::read(outs[static_cast<std::size_t>(w)], &counts, sizeof counts) != sizeof counts)
            counts.error = true;
        ::close(outs[static_cast<std::size_t>(w)]);
        all.push_back(counts);
    }
    wall_s = seconds_since(start);
    for (pid_t pid : pids) {
        int status = 0;
        ::waitpid(pid, &status, 0);
    }
    return all;
}

/// The workers rows of one store: @p reset empties claims and effects, @p make_and_work runs a
/// worker (in the child), @p effects returns {effects applied, distinct ids with an effect}.
template <class Worker>
void run_workers(const std::string& store_name, const std::function<void()>& reset,
                 const Worker& worker,
                 const std::function<std::pair<long long, long long>()>& effects,
                 const std::string& setup) {
    const std::string name = store_name + "_workers";
    const std::size_t per_worker = std::max<std::size_t>(config().scale_messages / 10, 100);
    for (const bool contended : {false, true}) {
        std::vector<double> rates;
        std::vector<long long> applied, distinct, expected, retries, timeouts, failed;
        bool exact = true;
        bool clean = true;
        for (const int n : {1, 2, 4}) {
            reset();
            note(fmt::format("{}: {} worker(s), ids {}", name, n,
                             contended ? "contended" : "unique"));
            double wall = 0;
            const auto counts = fork_workers(
                n, [&](int w) -> WorkerRun { return worker(w, per_worker, contended); }, wall);
            WorkerCounts sum;
            for (const auto& c : counts) {
                sum.processed += c.processed;
                sum.duplicates += c.duplicates;
                sum.in_progress_retries += c.in_progress_retries;
                sum.timeouts += c.timeouts;
                sum.failed += c.failed;
                sum.gave_up += c.gave_up;
                sum.error = sum.error || c.error;
            }
            const auto [fx, fx_distinct] = effects();
            const auto want = static_cast<long long>(contended ? per_worker : per_worker * n);
            const double handled = static_cast<double>(sum.processed + sum.duplicates);
            rates.push_back(handled / wall);
            applied.push_back(fx);
            distinct.push_back(fx_distinct);
            expected.push_back(want);
            retries.push_back(static_cast<long long>(sum.in_progress_retries));
            timeouts.push_back(static_cast<long long>(sum.timeouts));
            failed.push_back(static_cast<long long>(sum.failed));
            exact = exact && fx == want && fx_distinct == want &&
                    static_cast<long long>(sum.processed) == want;
            clean = clean && !sum.error && sum.gave_up == 0;
        }
        Json line;
        line.str("bench", name)
            .str("store", store_name)
            .str("ids", contended ? "contended: every worker the same ids, same order"
                                  : "unique: each worker its own")
            .ints("workers", {1, 2, 4})
            .integer("messages_per_worker", static_cast<long long>(per_worker))
            .nums("deliveries_per_s", rates)
            .nums("x_one_worker", {1.0, rates[1] / rates[0], rates[2] / rates[0]}, 2)
            .ints("effects", applied)
            .ints("distinct_effects", distinct)
            .ints("expected_effects", expected)
            .ints("in_progress_retries", retries)
            .ints("timeouts", timeouts)
            .ints("failed_other", failed)
            .boolean("exact_effects", exact)
            .boolean("no_error_no_give_up", clean)
            .str("effect", "one INSERT of the order id (Redis: INCR + SADD), counted at the end")
            .str("setup", setup + "; processes unpinned, 2 CPUs shared with the server");
        emit(line);
    }
}

/// A worker of a SQL store: opens it (after fork), then runs work() with the effect @p insert
/// (one INSERT of the order id).
template <class Store, class Where>
WorkerRun sql_worker(const Where& where, const std::string& insert, int w, std::size_t per,
                     bool contended) {
    auto store = std::make_shared<Store>(where);
    (void)store->find_claim(scope, "warm-up");
    return [=] {
        return work(*store, w, per, contended,
                    [insert](typename Store::Transaction& tx, const Order& o) {
                        tx.execute(insert, o.order_id);
                    });
    };
}

void workers_postgres() {
    if (!opted_in("postgres_workers")) return;
    auto& server = postgres_server();
    const std::string conninfo = server.conninfo();
    { idem::PostgresStore schema{conninfo}; }  // creates the idem tables
    server.exec("CREATE TABLE IF NOT EXISTS scale_effects(order_id TEXT NOT NULL)");
    run_workers(
        "postgres", [&] { server.exec("TRUNCATE idem_claims, scale_effects"); },
        [conninfo](int w, std::size_t per, bool contended) {
            return sql_worker<idem::PostgresStore>(
                conninfo, "INSERT INTO scale_effects(order_id) VALUES ($1)", w, per, contended);
        },
        [&] {
            idem::PostgresStore store{conninfo};
            return std::pair<long long, long long>{
                store.query_int("SELECT count(*) FROM scale_effects").value_or(-1),
                store.query_int("SELECT count(DISTINCT order_id) FROM scale_effects").value_or(-1)};
        },
        postgres_setup);
}

void workers_mysql() {
    if (!opted_in("mysql_workers")) return;
    const idem::MysqlEndpoint endpoint = mysql_endpoint();
    { idem::MysqlStore schema{endpoint}; }  // creates the idem tables
    auto client = long_mysql_client();
    client.query(
        "CREATE TABLE IF NOT EXISTS scale_effects(id BIGINT AUTO_INCREMENT PRIMARY KEY, "
        "order_id VARCHAR(64) NOT NULL) ENGINE=InnoDB");
    run_workers(
        "mysql",
        [&] {
            client.query("TRUNCATE TABLE idem_claims");
            client.query("TRUNCATE TABLE scale_effects");
        },
        [endpoint](int w, std::size_t per, bool contended) {
            return sql_worker<idem::MysqlStore>(
                endpoint, "INSERT INTO scale_effects(order_id) VALUES (?)", w, per, contended);
        },
        [&] {
            const auto rows =
                client.query("SELECT count(*), count(DISTINCT order_id) FROM scale_effects");
            return std::pair<long long, long long>{std::stoll(rows[0][0].value_or("0")),
                                                   std::stoll(rows[0][1].value_or("0"))};
        },
        mysql_setup);
}

void workers_redis() {
    if (!opted_in("redis_workers")) return;
    auto server = own_redis();
    const idem::RedisEndpoint endpoint = endpoint_of(*server);
    RawRedis raw{server->host(), server->port()};
    run_workers(
        "redis", [&] { raw.command({"FLUSHALL"}); },
        [endpoint](int w, std::size_t per, bool contended) -> WorkerRun {
            auto store = std::make_shared<idem::RedisStore>(endpoint);
            (void)store->find_claim(scope, "warm-up");
            return [=] {
                return work(*store, w, per, contended,
                            [](idem::RedisStore::Transaction& tx, const Order& o) {
                                tx.write("INCR", "fx:n");
                                tx.write("SADD", "fx:ids", o.order_id);
                            });
            };
        },
        [&] {
            auto n = raw.command({"GET", "fx:n"});
            auto ids = raw.command({"SCARD", "fx:ids"});
            return std::pair<long long, long long>{
                n->type == REDIS_REPLY_STRING ? std::stoll(std::string(n->str, n->len)) : 0,
                ids->integer};
        },
        redis_setup);
}

// ---------------------------------------------------------------------------------------------
// rss_flat_<store>

/// config().rss_messages through handle_batch (batch_size), RSS and malloc's bytes in use
/// sampled every config().rss_every; @p between runs after each sample (the memory store's
/// purge).
template <class Store>
void rss_run(const std::string& store_name, Store& store, const std::function<void()>& between,
             const std::string& setup) {
    const std::string name = "rss_flat_" + store_name;
    note(fmt::format("{} ({} messages)", name, config().rss_messages));
    auto handler = idem::make_handler(store, idem::Policy{scope}, no_effect);
    std::vector<idem::Delivery> deliveries;
    std::vector<Order> bodies;
    std::vector<long long> rss;
    std::vector<long long> heap;
    std::uint64_t seq = 0;
    const long long rss_before = rss_kb();
    const auto start = Clock::now();
    while (seq < config().rss_messages) {
        next_batch(seq, deliveries, bodies);
        for (const auto& outcome : handler.handle_batch(deliveries, bodies))
            require_processed(outcome, name.c_str());
        if (seq % config().rss_every == 0) {
            rss.push_back(rss_kb());
            const struct mallinfo2 info = mallinfo2();
            heap.push_back(static_cast<long long>((info.uordblks + info.hblkhd) / 1024));
            between();
        }
    }
    const double elapsed = seconds_since(start);
    Json line;
    line.str("bench", name)
        .str("store", store_name)
        .integer("batch", batch_size)
        .integer("messages", static_cast<long long>(config().rss_messages))
        .integer("sample_every", static_cast<long long>(config().rss_every))
        .integer("rss_before_kb", rss_before)
        .integer("rss_start_kb", rss.empty() ? 0 : rss.front())
        .integer("rss_end_kb", rss.empty() ? 0 : rss.back())
        .integer("growth_kb", rss.empty() ? 0 : rss.back() - rss.front())
        .ints("rss_kb", rss)
        .ints("malloc_in_use_kb", heap)
        .integer("malloc_growth_kb", heap.empty() ? 0 : heap.back() - heap.front())
        .num("idem_msgs_per_s", static_cast<double>(config().rss_messages) / elapsed)
        .str("effect", "none (claims and outcomes only)")
        .str("setup", setup)
        .str("growth_is",
             "last sample minus the first (taken after the first 'sample_every' messages, the "
             "warm-up); the client process only")
        .str("target", "growth_kb < 1024")
        .boolean("met", !rss.empty() && rss.back() - rss.front() < 1024);
    emit(line);
}

void rss_cases() {
    if (opted_in("rss_flat_memory")) {
        idem::MemoryStore store;
        rss_run(
            "memory", store, [&] { store.purge(std::chrono::seconds(0)); },
            "MemoryStore; purge(0 s) after each sample (its claims ARE its memory: without a "
            "purge they grow by design)");
    }
    if (opted_in("rss_flat_sqlite")) {
        std::filesystem::remove(config().sqlite_dir / "rss_all.db");
        auto store = open_sqlite("rss_all.db");
        with_knobs(store);
        rss_run(
            "sqlite", store, [] {}, sqlite_setup());
    }
    if (opted_in("rss_flat_postgres")) {
        auto& server = postgres_server();
        PinScope pin;
        idem::PostgresStore store{server.conninfo()};
        server.exec("TRUNCATE idem_claims");
        rss_run(
            "postgres", store, [] {}, postgres_setup);
        server.exec("TRUNCATE idem_claims");
    }
    if (opted_in("rss_flat_mysql")) {
        PinScope pin;
        idem::MysqlStore store{mysql_endpoint()};
        store.execute("TRUNCATE TABLE idem_claims");
        rss_run(
            "mysql", store, [] {}, mysql_setup);
        store.execute("TRUNCATE TABLE idem_claims");
    }
    if (opted_in("rss_flat_redis")) {
        PinScope pin;
        auto server = own_redis();
        idem::RedisStore store{endpoint_of(*server)};
        rss_run(
            "redis", store, [] {}, redis_setup);
    }
}

}  // namespace

void run_scale_cases() {
    auto guard = [](const char* group, const std::function<void()>& run) {
        try {
            run();
        } catch (const std::exception& e) {
            emit(Json().str("bench", group).str("error", e.what()));
        }
    };
    guard("rss_flat_stores", rss_cases);
    guard("sqlite_retained", retained_sqlite);
    guard("postgres_retained", retained_postgres);
    guard("mysql_retained", retained_mysql);
    guard("redis_retained", retained_redis);
    guard("sqlite_purge_under_load", purge_sqlite);
    guard("postgres_purge_under_load", purge_postgres);
    guard("postgres_partitioned_purge_under_load", purge_postgres_partitioned);
    guard("mysql_purge_under_load", purge_mysql);
    guard("mysql_partitioned_purge_under_load", purge_mysql_partitioned);
    guard("redis_purge_under_load", purge_redis);
    guard("redis_expiry_under_load", expiry_redis);
    guard("postgres_workers", workers_postgres);
    guard("mysql_workers", workers_mysql);
    guard("redis_workers", workers_redis);
}

}  // namespace idem_bench
