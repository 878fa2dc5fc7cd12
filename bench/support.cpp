// Options, JSON lines, pinning, servers, the alternating Google Benchmark runner and the raw
// twins (see bench.hpp).

#include <benchmark/benchmark.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "bench.hpp"

namespace idem_bench {

Config& config() {
    static Config value;
    return value;
}

bool selected(const std::string& name) {
    const auto& filter = config().filter;
    return !filter || std::regex_search(name, *filter);
}

bool opted_in(const std::string& name) {
    const auto& filter = config().filter;
    return filter && std::regex_search(name, *filter);
}

// ---------------------------------------------------------------------------------------------
// Json

void Json::key(std::string_view k) {
    if (!body_.empty()) body_ += ',';
    body_ += '"';
    body_.append(k.data(), k.size());
    body_ += "\":";
}

Json& Json::str(std::string_view k, std::string_view value) {
    key(k);
    body_ += '"';
    for (char ch : value) {
        const auto c = static_cast<unsigned char>(ch);
        if (c == '"' || c == '\\') {
            body_ += '\\';
            body_ += ch;
        } else if (c == '\n') {
            body_ += "\\n";
        } else if (c < 0x20) {
            body_ += fmt::format("\\u{:04x}", c);
        } else {
            body_ += ch;
        }
    }
    body_ += '"';
    return *this;
}

namespace {
std::string number(double value, int decimals) {
    if (!std::isfinite(value)) return "null";
    std::string text = fmt::format("{:.{}f}", value, decimals);
    return text == "-0" ? "0" : text;
}
}  // namespace

Json& Json::num(std::string_view k, double value, int decimals) {
    key(k);
    body_ += number(value, decimals);
    return *this;
}

Json& Json::integer(std::string_view k, long long value) {
    key(k);
    body_ += std::to_string(value);
    return *this;
}

Json& Json::boolean(std::string_view k, bool value) {
    key(k);
    body_ += value ? "true" : "false";
    return *this;
}

Json& Json::null(std::string_view k) {
    key(k);
    body_ += "null";
    return *this;
}

Json& Json::nums(std::string_view k, const std::vector<double>& values, int decimals) {
    key(k);
    body_ += '[';
    for (std::size_t i = 0; i < values.size(); ++i) {
        if (i != 0) body_ += ',';
        body_ += number(values[i], decimals);
    }
    body_ += ']';
    return *this;
}

Json& Json::ints(std::string_view k, const std::vector<long long>& values) {
    key(k);
    body_ += '[';
    for (std::size_t i = 0; i < values.size(); ++i) {
        if (i != 0) body_ += ',';
        body_ += std::to_string(values[i]);
    }
    body_ += ']';
    return *this;
}

Json& Json::maybe(std::string_view k, std::optional<bool> value) {
    return value ? boolean(k, *value) : null(k);
}

void emit(const Json& line) {
    std::fputs((line.text() + "\n").c_str(), stdout);
    std::fflush(stdout);
}

void note(const std::string& text) {
    std::fputs(("idem_bench: " + text + "\n").c_str(), stderr);
    std::fflush(stderr);
}

double paired_ratio(const std::vector<double>& idem, const std::vector<double>& raw) {
    std::vector<double> ratios;
    for (std::size_t i = 0; i < idem.size() && i < raw.size(); ++i)
        ratios.push_back(idem[i] / raw[i]);
    return median(ratios);
}

Json& add_rates(Json& line, const std::vector<double>& idem_rates,
                const std::vector<double>& raw_rates) {
    const double idem_rate = median(idem_rates);
    const double raw_rate = median(raw_rates);
    return line.num("idem_msgs_per_s", idem_rate)
        .num("raw_msgs_per_s", raw_rate)
        .num("ratio", idem_rate / raw_rate, 3)
        .num("paired_ratio", paired_ratio(idem_rates, raw_rates), 3)
        .num("paired_ratio_spread", paired_spread(idem_rates, raw_rates), 3)
        .num("idem_ns_per_msg", 1e9 / idem_rate)
        .num("raw_ns_per_msg", 1e9 / raw_rate)
        .nums("idem_samples", idem_rates, 0)
        .nums("raw_samples", raw_rates, 0);
}

double paired_spread(const std::vector<double>& idem, const std::vector<double>& raw) {
    std::vector<double> ratios;
    for (std::size_t i = 0; i < idem.size() && i < raw.size(); ++i)
        ratios.push_back(idem[i] / raw[i]);
    if (ratios.size() < 4) return std::nan("");
    std::sort(ratios.begin(), ratios.end());
    const std::size_t n = ratios.size();
    const double q1 = ratios[n / 4];
    const double q3 = ratios[(3 * n) / 4 - (n % 4 == 0 ? 1 : 0)];
    return (q3 - q1) / median(ratios);
}

double median(std::vector<double> values) {
    if (values.empty()) return std::nan("");
    std::sort(values.begin(), values.end());
    const std::size_t n = values.size();
    return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

// ---------------------------------------------------------------------------------------------
// Pinning

PinScope::PinScope(bool wanted) {
    if (!wanted || !config().pin) return;
    if (sched_getaffinity(0, sizeof previous_, &previous_) != 0) {
        throw std::runtime_error("sched_getaffinity failed");
    }
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(config().cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) {
        throw std::runtime_error(
            fmt::format("cannot pin to CPU {} (sched_setaffinity)", config().cpu));
    }
    active_ = true;
}

PinScope::~PinScope() {
    if (active_) sched_setaffinity(0, sizeof previous_, &previous_);
}

namespace {
std::string cpus_from_status(const std::filesystem::path& status) {
    std::ifstream in(status);
    for (std::string line; std::getline(in, line);) {
        if (line.rfind("Cpus_allowed_list:", 0) == 0) {
            const auto start = line.find_first_not_of(" \t", 18);
            return start == std::string::npos ? std::string() : line.substr(start);
        }
    }
    return "?";
}
}  // namespace

std::string cpus_allowed(pid_t pid) {
    return cpus_from_status(std::filesystem::path("/proc") / std::to_string(pid) / "status");
}

std::string process_cpus(pid_t pid) {
    std::set<std::string> distinct;
    std::error_code ec;
    const auto tasks = std::filesystem::path("/proc") / std::to_string(pid) / "task";
    for (const auto& task : std::filesystem::directory_iterator(tasks, ec))
        distinct.insert(cpus_from_status(task.path() / "status"));
    std::string out;
    for (const auto& cpus : distinct)
        out += (out.empty() ? "" : " ") + cpus;
    return out.empty() ? "?" : out;
}

std::string own_cpus() {
    return cpus_from_status("/proc/thread-self/status");
}

void add_pinning(Json& line, bool pinned, pid_t server_pid) {
    if (pinned) {
        line.integer("pinned_cpu", config().cpu);
    } else {
        line.null("pinned_cpu");
    }
    line.str("client_cpus", own_cpus());
    if (server_pid > 0) line.str("server_cpus", process_cpus(server_pid));
}

// ---------------------------------------------------------------------------------------------
// Servers

namespace {
template <class Server>
Server& started(std::unique_ptr<Server>& slot, const char* what) {
    if (!slot) {
        note(fmt::format("starting {}{}", what,
                         config().pin ? fmt::format(" pinned to CPU {}", config().cpu) : ""));
        PinScope pin;  // the server inherits the mask, as under `taskset -c <cpu>`
        slot = std::make_unique<Server>();
    }
    return *slot;
}

std::unique_ptr<idem::testing::RedisServer>& redis_slot() {
    static std::unique_ptr<idem::testing::RedisServer> slot;
    return slot;
}
std::unique_ptr<idem::testing::PostgresServer>& postgres_slot() {
    static std::unique_ptr<idem::testing::PostgresServer> slot;
    return slot;
}
std::unique_ptr<idem::testing::MariadbServer>& mariadb_slot() {
    static std::unique_ptr<idem::testing::MariadbServer> slot;
    return slot;
}
}  // namespace

idem::testing::RedisServer& redis_server() {
    const bool first = !redis_slot();
    auto& server = started(redis_slot(), "redis-server");
    if (first) {
        // The automatic AOF rewrite forks a child that lands on the pinned CPU in the middle of
        // a sample; idem writes several times raw's AOF bytes, so it is hit more often. Off for
        // both sides; the JSON says so (in production that rewrite cost is real: see
        // docs/performance.md).
        server.client().exec({"CONFIG", "SET", "auto-aof-rewrite-percentage", "0"});
    }
    return server;
}

idem::RedisEndpoint redis_endpoint() {
    idem::RedisEndpoint endpoint;
    endpoint.host = redis_server().host();
    endpoint.port = redis_server().port();
    return endpoint;
}

idem::testing::PostgresServer& postgres_server() {
    return started(postgres_slot(), "PostgreSQL");
}

idem::testing::MariadbServer& mariadb_server() {
    return started(mariadb_slot(), "MariaDB");
}

long long rss_kb() {
    std::ifstream in("/proc/self/statm");
    long long size = 0;
    long long resident = 0;
    in >> size >> resident;
    return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

std::uint64_t task_cpu_ns(pid_t pid) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/schedstat");
    std::uint64_t ns = 0;
    in >> ns;
    return ns;
}

std::uint64_t thread_cpu_ns() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000ULL +
           static_cast<std::uint64_t>(ts.tv_nsec);
}

// ---------------------------------------------------------------------------------------------
// Google Benchmark runs

namespace {

class Capture : public benchmark::BenchmarkReporter {
  public:
    bool ReportContext(const Context&) override { return true; }
    void ReportRuns(const std::vector<Run>& runs) override {
        for (const auto& run : runs) {
            if (run.run_type == Run::RT_Iteration) runs_.push_back(run);
        }
    }
    std::vector<Run> runs_;
};

Sample run_one(const std::string& name) {
    Capture capture;
    const std::size_t matched = benchmark::RunSpecifiedBenchmarks(&capture, "^" + name + "(/|$)");
    Sample sample;
    if (matched == 0 || capture.runs_.empty()) {
        sample.error = "no benchmark named " + name;
        return sample;
    }
    const auto& run = capture.runs_.back();
    if (run.error_occurred) {
        sample.error = run.error_message.empty() ? "failed" : run.error_message;
        return sample;
    }
    const auto msgs = run.counters.find("msgs");
    const double messages = msgs == run.counters.end() ? 0 : msgs->second.value;
    const double seconds = run.real_accumulated_time;
    if (messages <= 0 || seconds <= 0) {
        sample.error = name + ": no messages counted";
        return sample;
    }
    sample.msgs_per_s = messages / seconds;
    sample.ns_per_msg = seconds * 1e9 / messages;
    const auto trips = run.counters.find("round_trips");
    if (trips != run.counters.end()) sample.round_trips_per_msg = trips->second.value / messages;
    sample.client_cpu_ns_per_msg = run.cpu_accumulated_time * 1e9 / messages;
    const auto server = run.counters.find("server_cpu_ns");
    if (server != run.counters.end())
        sample.server_cpu_ns_per_msg = server->second.value / messages;
    return sample;
}

std::vector<double> rates(const std::vector<Sample>& samples) {
    std::vector<double> out;
    for (const auto& s : samples)
        out.push_back(s.msgs_per_s);
    return out;
}
std::vector<double> nanos(const std::vector<Sample>& samples) {
    std::vector<double> out;
    for (const auto& s : samples)
        out.push_back(s.ns_per_msg);
    return out;
}
double median_of(const std::vector<Sample>& samples, double Sample::*field) {
    std::vector<double> out;
    for (const auto& s : samples)
        out.push_back(s.*field);
    return median(out);
}

}  // namespace

double Alternated::idem_rate() const {
    return median(rates(idem));
}
double Alternated::raw_rate() const {
    return median(rates(raw));
}
double Alternated::idem_ns() const {
    return median(nanos(idem));
}
double Alternated::raw_ns() const {
    return median(nanos(raw));
}
std::vector<double> Alternated::idem_rates() const {
    return rates(idem);
}
std::vector<double> Alternated::raw_rates() const {
    return rates(raw);
}

Alternated alternate(const std::string& idem_name, const std::string& raw_name) {
    Alternated result;
    for (int round = 0; round < config().rounds; ++round) {
        const bool idem_first = round % 2 == 0;
        for (int k = 0; k < 2; ++k) {
            const bool is_idem = (k == 0) == idem_first;
            Sample sample = run_one(is_idem ? idem_name : raw_name);
            if (!sample.error.empty()) {
                result.error = (is_idem ? idem_name : raw_name) + ": " + sample.error;
                return result;
            }
            (is_idem ? result.idem : result.raw).push_back(sample);
        }
    }
    return result;
}

void add_rates(Json& line, const std::string& bench, const std::string& store, int batch,
               const Alternated& result) {
    line.str("bench", bench).str("store", store).integer("batch", batch);
    if (!result.error.empty()) {
        line.str("error", result.error);
        return;
    }
    line.num("idem_msgs_per_s", result.idem_rate())
        .num("raw_msgs_per_s", result.raw_rate())
        .num("ratio", result.idem_rate() / result.raw_rate(), 3)
        .num("paired_ratio", paired_ratio(result.idem_rates(), result.raw_rates()), 3)
        .num("paired_ratio_spread", paired_spread(result.idem_rates(), result.raw_rates()), 3)
        .num("idem_ns_per_msg", result.idem_ns())
        .num("raw_ns_per_msg", result.raw_ns())
        .nums("idem_samples", result.idem_rates(), 0)
        .nums("raw_samples", result.raw_rates(), 0)
        .integer("rounds", static_cast<long long>(result.idem.size()));
    // Where the time goes: this thread's CPU, the server's CPU (round-trip cases), per message;
    // cpu_ratio is the ratio the rates would have if that CPU time were all there is (it is
    // steadier than the wall-clock ratio on a busy machine).
    const double idem_client = median_of(result.idem, &Sample::client_cpu_ns_per_msg);
    const double raw_client = median_of(result.raw, &Sample::client_cpu_ns_per_msg);
    double idem_cpu = idem_client;
    double raw_cpu = raw_client;
    line.num("idem_client_cpu_us_per_msg", idem_client / 1000, 2)
        .num("raw_client_cpu_us_per_msg", raw_client / 1000, 2);
    if (!result.idem.empty() && result.idem.front().server_cpu_ns_per_msg >= 0) {
        const double idem_server = median_of(result.idem, &Sample::server_cpu_ns_per_msg);
        const double raw_server = median_of(result.raw, &Sample::server_cpu_ns_per_msg);
        idem_cpu += idem_server;
        raw_cpu += raw_server;
        line.num("idem_server_cpu_us_per_msg", idem_server / 1000, 2)
            .num("raw_server_cpu_us_per_msg", raw_server / 1000, 2);
    }
    line.num("cpu_ratio", raw_cpu / idem_cpu, 3);
    if (!result.idem.empty() && result.idem.front().round_trips_per_msg >= 0) {
        line.num("idem_round_trips_per_msg", result.idem.back().round_trips_per_msg, 3);
    }
    if (!result.raw.empty() && result.raw.front().round_trips_per_msg >= 0) {
        line.num("raw_round_trips_per_msg", result.raw.back().round_trips_per_msg, 3);
    }
}

// ---------------------------------------------------------------------------------------------
// Raw SQLite

std::int64_t now_ms() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
}

namespace {
void sqlite_exec(sqlite3* db, const char* sql) {
    char* error = nullptr;
    if (sqlite3_exec(db, sql, nullptr, nullptr, &error) != SQLITE_OK) {
        std::string message = error != nullptr ? error : "?";
        sqlite3_free(error);
        throw std::runtime_error(fmt::format("sqlite: {}: {}", sql, message));
    }
}

sqlite3_stmt* sqlite_prepare(sqlite3* db, const char* sql) {
    sqlite3_stmt* stmt = nullptr;
    if (sqlite3_prepare_v3(db, sql, -1, SQLITE_PREPARE_PERSISTENT, &stmt, nullptr) != SQLITE_OK) {
        throw std::runtime_error(fmt::format("sqlite: prepare {}: {}", sql, sqlite3_errmsg(db)));
    }
    return stmt;
}
}  // namespace

void create_sqlite_effects(sqlite3* db, const char* table) {
    sqlite_exec(db, fmt::format("CREATE TABLE IF NOT EXISTS {}(id INTEGER PRIMARY KEY, "
                                "order_id TEXT NOT NULL, amount INTEGER NOT NULL)",
                                table)
                        .c_str());
}

RawSqlite::RawSqlite(const std::filesystem::path& file) {
    if (sqlite3_open_v2(file.c_str(), &db_,
                        SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX,
                        nullptr) != SQLITE_OK) {
        const std::string message = sqlite3_errmsg(db_);
        sqlite3_close_v2(db_);
        throw std::runtime_error("sqlite: open " + file.string() + ": " + message);
    }
    sqlite3_busy_timeout(db_, 5000);
    sqlite_exec(db_, "PRAGMA journal_mode=WAL");
    sqlite_exec(db_, "PRAGMA synchronous=NORMAL");
    // The same shape as idem's idem_claims (sqlite.hpp), its index included.
    sqlite_exec(db_,
                "CREATE TABLE IF NOT EXISTS raw_claims(scope BLOB NOT NULL, message_id BLOB NOT "
                "NULL, claimed_at INTEGER NOT NULL, outcome TEXT NOT NULL, reason TEXT NOT NULL "
                "DEFAULT '', fingerprint BLOB NOT NULL DEFAULT x'', PRIMARY KEY(scope, "
                "message_id)) WITHOUT ROWID");
    sqlite_exec(db_, "CREATE INDEX IF NOT EXISTS raw_claims_claimed_at ON raw_claims(claimed_at)");
    create_sqlite_effects(db_, "effects");
    begin_ = sqlite_prepare(db_, "BEGIN IMMEDIATE");
    commit_ = sqlite_prepare(db_, "COMMIT");
    claim_ = sqlite_prepare(db_,
                            "INSERT INTO raw_claims(scope, message_id, claimed_at, outcome, "
                            "reason, fingerprint) VALUES (?1, ?2, ?3, 'processed', '', x'')");
    effect_ = sqlite_prepare(db_, "INSERT INTO effects(order_id, amount) VALUES (?1, ?2)");
}

RawSqlite::~RawSqlite() {
    for (sqlite3_stmt* stmt : {begin_, commit_, claim_, effect_})
        sqlite3_finalize(stmt);
    sqlite3_close_v2(db_);
}

void RawSqlite::step(sqlite3_stmt* stmt, const char* what) {
    const int rc = sqlite3_step(stmt);
    sqlite3_reset(stmt);
    if (rc != SQLITE_DONE) {
        throw std::runtime_error(fmt::format("sqlite: {}: {}", what, sqlite3_errmsg(db_)));
    }
}

void RawSqlite::begin() {
    step(begin_, "BEGIN IMMEDIATE");
}

void RawSqlite::commit() {
    step(commit_, "COMMIT");
}

void RawSqlite::insert_claim(std::string_view scope, std::string_view id) {
    sqlite3_bind_blob64(claim_, 1, scope.data(), scope.size(), SQLITE_STATIC);
    sqlite3_bind_blob64(claim_, 2, id.data(), id.size(), SQLITE_STATIC);
    sqlite3_bind_int64(claim_, 3, now_ms());
    step(claim_, "INSERT claim");
}

void RawSqlite::insert_effect(std::string_view order_id, std::int64_t amount) {
    sqlite3_bind_text64(effect_, 1, order_id.data(), order_id.size(), SQLITE_STATIC, SQLITE_UTF8);
    sqlite3_bind_int64(effect_, 2, amount);
    step(effect_, "INSERT effect");
}

long long RawSqlite::count(const char* table) {
    sqlite3_stmt* stmt = sqlite_prepare(db_, fmt::format("SELECT count(*) FROM {}", table).c_str());
    long long n = -1;
    if (sqlite3_step(stmt) == SQLITE_ROW) n = sqlite3_column_int64(stmt, 0);
    sqlite3_finalize(stmt);
    return n;
}

// ---------------------------------------------------------------------------------------------
// Raw PostgreSQL

namespace {
void pg_check(PGconn* conn, PGresult* result, const char* what) {
    const auto status = PQresultStatus(result);
    if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK) {
        std::string message = PQerrorMessage(conn);
        PQclear(result);
        throw std::runtime_error(fmt::format("postgres: {}: {}", what, message));
    }
    PQclear(result);
}

PGconn* pg_connect(const std::string& conninfo) {
    PGconn* conn = PQconnectdb(conninfo.c_str());
    if (PQstatus(conn) != CONNECTION_OK) {
        std::string message = PQerrorMessage(conn);
        PQfinish(conn);
        throw std::runtime_error("postgres: connect: " + message);
    }
    PQsetNoticeProcessor(
        conn, [](void*, const char*) {}, nullptr);
    return conn;
}

/// The effects table of either side, as the idem side's statements and RawPostgres expect it.
std::string postgres_effects_table(const std::string& table) {
    return fmt::format(
        "CREATE TABLE IF NOT EXISTS {}(id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL, amount "
        "BIGINT NOT NULL)",
        table);
}
}  // namespace

void pg_exec(const std::string& conninfo, const std::string& sql) {
    PGconn* conn = pg_connect(conninfo);
    PGresult* result = PQexec(conn, sql.c_str());
    try {
        pg_check(conn, result, sql.c_str());
    } catch (...) {
        PQfinish(conn);
        throw;
    }
    PQfinish(conn);
}

void create_postgres_effects(const std::string& conninfo, const std::string& table) {
    pg_exec(conninfo, postgres_effects_table(table));
}

RawPostgres::RawPostgres(const std::string& conninfo, const std::string& effects_table) {
    conn_ = pg_connect(conninfo);
    // The same shape as idem's idem_claims (postgres.hpp), its index included.
    simple(
        "CREATE TABLE IF NOT EXISTS raw_claims(scope BYTEA NOT NULL, message_id BYTEA NOT NULL, "
        "claimed_at BIGINT NOT NULL, outcome TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '', "
        "fingerprint BYTEA NOT NULL DEFAULT ''::bytea, PRIMARY KEY (scope, message_id))");
    simple("CREATE INDEX IF NOT EXISTS raw_claims_claimed_at ON raw_claims(claimed_at)");
    simple(postgres_effects_table(effects_table).c_str());
    pg_check(conn_,
             PQprepare(conn_, "raw_claim",
                       "INSERT INTO raw_claims(scope, message_id, claimed_at, outcome, reason, "
                       "fingerprint) VALUES ($1, $2, $3, 'processed', '', ''::bytea) "
                       "ON CONFLICT (scope, message_id) DO NOTHING",
                       3, nullptr),
             "prepare raw_claim");
    pg_check(
        conn_,
        PQprepare(
            conn_, "raw_effect",
            fmt::format("INSERT INTO {}(order_id, amount) VALUES ($1, $2)", effects_table).c_str(),
            2, nullptr),
        "prepare raw_effect");
    // For postgres_statement_costs: idem's claim statement (postgres.hpp, claim_insert) and its
    // outcome UPDATE, on the raw table.
    pg_check(conn_,
             PQprepare(conn_, "raw_claim_cte",
                       "WITH ins AS (INSERT INTO raw_claims AS c(scope, message_id, claimed_at, "
                       "outcome, reason, fingerprint) VALUES ($1, $2, $3, 'claimed', '', $4) "
                       "ON CONFLICT (scope, message_id) DO NOTHING RETURNING 1) "
                       "SELECT true, NULL::text, NULL::bytea FROM ins UNION ALL "
                       "SELECT false, c.outcome, c.fingerprint FROM raw_claims c WHERE c.scope = "
                       "$1 AND c.message_id = $2 AND NOT EXISTS (SELECT 1 FROM ins)",
                       4, nullptr),
             "prepare raw_claim_cte");
    pg_check(conn_,
             PQprepare(conn_, "raw_claim_claimed",
                       "INSERT INTO raw_claims(scope, message_id, claimed_at, outcome, reason, "
                       "fingerprint) VALUES ($1, $2, $3, 'claimed', '', ''::bytea) "
                       "ON CONFLICT (scope, message_id) DO NOTHING",
                       3, nullptr),
             "prepare raw_claim_claimed");
    pg_check(conn_,
             PQprepare(conn_, "raw_update",
                       "UPDATE raw_claims SET outcome = $3, reason = $4 WHERE scope = $1 AND "
                       "message_id = $2",
                       4, nullptr),
             "prepare raw_update");
    round_trips_ = 0;
}

void RawPostgres::message(const Extras& extras, std::string_view scope, std::string_view id,
                          std::int64_t amount) {
    begin();
    if (extras.set_local) simple("SET LOCAL lock_timeout = 5000");
    const std::string at = std::to_string(now_ms());
    if (extras.claim_cte) {
        const char* values[4] = {scope.data(), id.data(), at.c_str(), ""};
        const int lengths[4] = {static_cast<int>(scope.size()), static_cast<int>(id.size()), 0, 0};
        const int formats[4] = {1, 1, 0, 1};
        prepared("raw_claim_cte", 4, values, lengths, formats);
    } else if (extras.update) {
        const char* values[3] = {scope.data(), id.data(), at.c_str()};
        const int lengths[3] = {static_cast<int>(scope.size()), static_cast<int>(id.size()), 0};
        const int formats[3] = {1, 1, 0};
        prepared("raw_claim_claimed", 3, values, lengths, formats);
    } else {
        insert_claim(scope, id);
    }
    if (extras.savepoint) simple("SAVEPOINT idem_effect");
    insert_effect(id, amount);
    if (extras.savepoint) simple("RELEASE SAVEPOINT idem_effect");
    if (extras.update) {
        const char* values[4] = {scope.data(), id.data(), "processed", ""};
        const int lengths[4] = {static_cast<int>(scope.size()), static_cast<int>(id.size()), 0, 0};
        const int formats[4] = {1, 1, 0, 0};
        prepared("raw_update", 4, values, lengths, formats);
    }
    commit();
}

RawPostgres::~RawPostgres() {
    PQfinish(conn_);
}

void RawPostgres::simple(const char* sql) {
    ++round_trips_;
    pg_check(conn_, PQexec(conn_, sql), sql);
}

void RawPostgres::prepared(const char* name, int count, const char* const* values,
                           const int* lengths, const int* formats) {
    ++round_trips_;
    pg_check(conn_, PQexecPrepared(conn_, name, count, values, lengths, formats, 0), name);
}

void RawPostgres::begin() {
    simple("BEGIN");
}

void RawPostgres::commit() {
    simple("COMMIT");
}

void RawPostgres::insert_claim(std::string_view scope, std::string_view id) {
    const std::string at = std::to_string(now_ms());
    const char* values[3] = {scope.data(), id.data(), at.c_str()};
    const int lengths[3] = {static_cast<int>(scope.size()), static_cast<int>(id.size()), 0};
    const int formats[3] = {1, 1, 0};  // scope and id as binary BYTEA, as idem sends them
    prepared("raw_claim", 3, values, lengths, formats);
}

void RawPostgres::insert_effect(std::string_view order_id, std::int64_t amount) {
    const std::string order(order_id);
    const std::string value = std::to_string(amount);
    const char* values[2] = {order.c_str(), value.c_str()};
    prepared("raw_effect", 2, values, nullptr, nullptr);
}

// ---------------------------------------------------------------------------------------------
// Raw Redis

RawRedis::RawRedis(const std::string& host, int port) {
    timeval timeout{5, 0};
    ctx_ = redisConnectWithTimeout(host.c_str(), port, timeout);
    if (ctx_ == nullptr || ctx_->err != 0) {
        const std::string message = ctx_ != nullptr ? ctx_->errstr : "out of memory";
        if (ctx_ != nullptr) redisFree(ctx_);
        throw std::runtime_error("redis: connect: " + message);
    }
    redisSetTimeout(ctx_, timeout);
}

RawRedis::~RawRedis() {
    redisFree(ctx_);
}

namespace {
void check_reply(redisContext* ctx, const redisReply* reply, const std::string& what) {
    if (reply == nullptr) {
        throw std::runtime_error(fmt::format("redis: {}: {}", what, ctx->errstr));
    }
    if (reply->type == REDIS_REPLY_ERROR) {
        throw std::runtime_error(
            fmt::format("redis: {}: {}", what, std::string(reply->str, reply->len)));
    }
}

void append(redisContext* ctx, const std::vector<std::string>& args) {
    std::vector<const char*> argv;
    std::vector<std::size_t> lengths;
    argv.reserve(args.size());
    lengths.reserve(args.size());
    for (const auto& a : args) {
        argv.push_back(a.data());
        lengths.push_back(a.size());
    }
    redisAppendCommandArgv(ctx, static_cast<int>(argv.size()), argv.data(), lengths.data());
}

redisReply* next_reply(redisContext* ctx) {
    void* reply = nullptr;
    if (redisGetReply(ctx, &reply) != REDIS_OK) return nullptr;
    return static_cast<redisReply*>(reply);
}
}  // namespace

std::unique_ptr<redisReply, void (*)(void*)> RawRedis::command(
    const std::vector<std::string>& args) {
    ++round_trips_;
    append(ctx_, args);
    std::unique_ptr<redisReply, void (*)(void*)> reply(next_reply(ctx_), freeReplyObject);
    check_reply(ctx_, reply.get(), args.front());
    return reply;
}

void RawRedis::pipeline(const std::vector<std::vector<std::string>>& commands) {
    ++round_trips_;
    for (const auto& command : commands)
        append(ctx_, command);
    std::string error;
    for (const auto& command : commands) {
        redisReply* reply = next_reply(ctx_);
        if (reply == nullptr)
            throw std::runtime_error("redis: pipeline: " + std::string(ctx_->errstr));
        if (reply->type == REDIS_REPLY_ERROR && error.empty()) {
            error = command.front() + ": " + std::string(reply->str, reply->len);
        }
        freeReplyObject(reply);
    }
    if (!error.empty()) throw std::runtime_error("redis: " + error);
}

bool RawRedis::set_nx(const std::string& key) {
    ++round_trips_;
    const char* argv[4] = {"SET", key.data(), "1", "NX"};
    const std::size_t lengths[4] = {3, key.size(), 1, 2};
    std::unique_ptr<redisReply, void (*)(void*)> reply(
        static_cast<redisReply*>(redisCommandArgv(ctx_, 4, argv, lengths)), freeReplyObject);
    check_reply(ctx_, reply.get(), "SET NX");
    return reply->type == REDIS_REPLY_STATUS;
}

std::size_t RawRedis::set_nx_pipelined(const std::vector<std::string>& keys) {
    ++round_trips_;
    for (const auto& key : keys) {
        const char* argv[4] = {"SET", key.data(), "1", "NX"};
        const std::size_t lengths[4] = {3, key.size(), 1, 2};
        redisAppendCommandArgv(ctx_, 4, argv, lengths);
    }
    std::size_t set = 0;
    for (std::size_t i = 0; i < keys.size(); ++i) {
        std::unique_ptr<redisReply, void (*)(void*)> reply(next_reply(ctx_), freeReplyObject);
        check_reply(ctx_, reply.get(), "SET NX (pipelined)");
        if (reply->type == REDIS_REPLY_STATUS) ++set;
    }
    return set;
}

// ---------------------------------------------------------------------------------------------
// RawMysql

namespace {
std::string hex_literal(std::string_view bytes) {
    std::string out = "X'";
    for (const char c : bytes)
        out += fmt::format("{:02X}", static_cast<unsigned char>(c));
    return out + "'";
}
}  // namespace

RawMysql::RawMysql(idem::testing::MariadbServer& server, const std::string& effects_table)
    : effects_(effects_table) {
    idem::testing::detail::library_init();
    conn_ = mysql_init(nullptr);
    if (conn_ == nullptr ||
        mysql_real_connect(conn_, server.host().c_str(), server.user().c_str(), "", "idem_test",
                           static_cast<unsigned>(server.port()), nullptr, 0) == nullptr) {
        throw std::runtime_error(std::string("RawMysql: connect: ") + mysql_error(conn_));
    }
    simple("SET SESSION innodb_lock_wait_timeout = 5");  // as MysqlStore's session
    // The same shape as idem's idem_claims (sql/schema.hpp, mysql_schema_ddl).
    simple(
        "CREATE TABLE IF NOT EXISTS raw_claims(scope BLOB NOT NULL, message_id BLOB NOT NULL, "
        "claim_key BINARY(32) AS (UNHEX(SHA2(CONCAT(LPAD(LENGTH(scope), 10, '0'), scope, "
        "message_id), 256))) STORED, claimed_at BIGINT NOT NULL, outcome VARBINARY(32) NOT NULL, "
        "reason BLOB NOT NULL, fingerprint BLOB NOT NULL, UNIQUE KEY(claim_key), "
        "KEY(claimed_at)) ENGINE=InnoDB");
    simple(
        fmt::format("CREATE TABLE IF NOT EXISTS {}(id BIGINT AUTO_INCREMENT PRIMARY KEY, "
                    "order_id VARCHAR(64) NOT NULL, amount BIGINT NOT NULL) ENGINE=InnoDB",
                    effects_table));
}

RawMysql::~RawMysql() {
    if (conn_ != nullptr) mysql_close(conn_);
}

void RawMysql::simple(const std::string& sql) {
    if (mysql_real_query(conn_, sql.data(), static_cast<unsigned long>(sql.size())) != 0) {
        throw std::runtime_error(fmt::format("RawMysql: {}: {}", sql, mysql_error(conn_)));
    }
}

void RawMysql::begin() {
    simple("START TRANSACTION");
}
void RawMysql::commit() {
    simple("COMMIT");
}
void RawMysql::insert_claim(std::string_view scope, std::string_view id) {
    simple(
        fmt::format("INSERT INTO raw_claims(scope, message_id, claimed_at, outcome, reason, "
                    "fingerprint) VALUES ({}, {}, {}, 'processed', X'', X'') ON DUPLICATE KEY "
                    "UPDATE claimed_at = claimed_at",
                    hex_literal(scope), hex_literal(id), now_ms()));
}
void RawMysql::insert_effect(std::string_view order_id, std::int64_t amount) {
    simple(fmt::format("INSERT INTO {}(order_id, amount) VALUES ('{}', {})", effects_, order_id,
                       amount));
}

}  // namespace idem_bench
