#pragma once
/// @file
/// @brief idem::postgres::Driver: PostgreSQL under the SQL store written once (sql/store.hpp).
/// Its session is a postgres::Connection (postgres/connection.hpp); the driver keeps idem's and
/// the effect's statements, the transaction (what it queues for the next round trip, its first
/// failure) and lock_timeout; the claims are postgres::Claims' (postgres/claims.hpp), their
/// partitions postgres::Partitions' (postgres/partitions.hpp), mixed in.
/// SQLSTATEs map to exceptions as postgres/libpq.hpp says.

#include <libpq-fe.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/blob.hpp"
#include "idem/config.hpp"
#include "idem/contract/store.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"
#include "idem/postgres/claims.hpp"
#include "idem/postgres/connection.hpp"
#include "idem/postgres/libpq.hpp"
#include "idem/postgres/options.hpp"
#include "idem/postgres/partitions.hpp"
#include "idem/sql/driver.hpp"
#include "idem/sql/own_claims.hpp"
#include "idem/sql/schema.hpp"
#include "idem/sql/statements.hpp"
#include "idem/sql/stored_outcome.hpp"

IDEM_BEGIN_NAMESPACE
namespace postgres {

/// PostgresStore's transaction face: conn().
template <class Tx>
class TransactionFace {
  public:
    /// @brief The connection, inside this transaction: sends the queued commands first (BEGIN,
    /// SAVEPOINT…), so what you run on it joins the transaction. Do not COMMIT or ROLLBACK on it.
    [[nodiscard]] PGconn* conn() {
        auto& driver = static_cast<Tx&>(*this).open("conn()");
        driver.flush();
        return driver.conn();
    }
};

/// The PostgreSQL driver (the contract: sql/driver.hpp); its claims are postgres::Claims'.
class Driver : public Claims<Driver>, public Partitions<Driver> {
  public:
    /// Names the backend in messages ("idem postgres: ...").
    static constexpr std::string_view name = "postgres";
    /// Names the store class in messages.
    static constexpr std::string_view store_class = "PostgresStore";
    /// Effect statements (SQL and parameter kinds) kept prepared; further ones are not.
    static constexpr std::size_t max_cached_statements = 256;
    /// The oldest server this store runs on (ON CONFLICT, SKIP LOCKED, to_regclass(text)).
    static constexpr int min_server_version = Connection::min_server_version;
    /// The transaction's PostgreSQL members (conn()), mixed into basic_transaction.
    template <class Tx>
    using transaction_face = TransactionFace<Tx>;
    /// A row of an idem statement's binary result, as run() and query() pass it to their callback.
    using Row = postgres::Row;

    /// Connects with @p conninfo and owns the connection. @throws usage_error for bad @p options or
    /// a conninfo with a NUL byte, store_unavailable when the server cannot be reached or is too
    /// old.
    Driver(const std::string& conninfo, const PostgresOptions& options);
    /// Uses the consumer's own connection, which it never closes. @throws usage_error for a null
    /// connection, bad @p options, or a connection in pipeline or non-blocking mode or inside a
    /// transaction; store_unavailable for a broken one or a server older than PostgreSQL 10.
    Driver(PGconn* conn, const PostgresOptions& options);
    Driver(const Driver&) = delete;
    Driver& operator=(const Driver&) = delete;
    ~Driver();

    /// The connection (owned or borrowed); null once forgotten.
    [[nodiscard]] PGconn* conn() const noexcept { return conn_.get(); }

    // -- fork() and ping (sql/driver.hpp) -----------------------------------------------------

    /// True when the driver opened the connection itself (a conninfo), false for a borrowed one.
    [[nodiscard]] bool owns_connection() const noexcept { return conn_.owned(); }
    /// In a fork()ed child: drops the parent's connection (forget_inherited) and connects anew
    /// with the same conninfo: a session of the child's own.
    void reopen_after_fork() {
        forget_inherited();
        conn_.connect_owned();
    }
    /// Drops a connection opened in another process without a byte to the server
    /// (Connection::forget_inherited(): no Terminate, no DEALLOCATE, no ROLLBACK) and the
    /// transaction's state.
    void forget_inherited() noexcept {
        conn_.forget_inherited();
        end_transaction();
    }
    /// One round trip (`SELECT 1`); a connection found dead is reconnected (PQreset) and asked
    /// again once. @throws store_unavailable while the server does not answer.
    void ping(std::string_view what);
    /// The schema the idem tables live in (PostgresOptions::schema).
    [[nodiscard]] const std::string& schema() const noexcept { return schema_; }
    /// Round trips to the server so far (Connection::round_trips()).
    [[nodiscard]] std::uint64_t round_trips() const noexcept { return conn_.round_trips(); }

    /// Reasons and last errors are TEXT: valid UTF-8 without NULs.
    static std::string text(std::string_view value) { return valid_utf8(value); }
    /// The destination is stored as TEXT. @throws usage_error unless it is valid UTF-8 without
    /// NULs.
    static void check_outbox(const OutboxIntent& intent) { check_text_destination(intent); }

    // -- outside a transaction: autocommit ----------------------------------------------------

    /// One statement outside a transaction, in autocommit (a write is committed on its own); @p
    /// on_row per result row. @return the rows changed. @throws store_timeout for a lock or
    /// statement timeout, store_unavailable for other errors.
    template <class OnRow, class... Args>
    std::int64_t run(sql::stmt which, std::string_view what, sql::access, OnRow&& on_row,
                     const Args&... args) {
        ready(what);
        Result result = run(own(which, what, args...));
        for (int row = 0; row < PQntuples(result.get()); ++row)
            on_row(Row(result.get(), row));
        return affected_rows(result.get());
    }

    /// Takes, renews or takes over (when expired) the idem_locks row of @p key for @p owner until
    /// @p expires_ms, under the key's advisory lock, committed at once. @return whether @p owner
    /// holds it now.
    bool hold_lock(std::string_view key, std::string_view owner, std::int64_t expires_ms,
                   std::int64_t now_ms) {
        ready("hold_lock()");
        Result result = run(own(sql::stmt::lock_hold, "hold_lock", Blob{key}, Blob{owner},
                                expires_ms, now_ms, advisory_key("idem lock", key)));
        return affected_rows(result.get()) == 1;
    }

    // -- the transaction ----------------------------------------------------------------------

    /// Queues BEGIN (and, on a borrowed session, SET LOCAL lock_timeout); nothing is sent until the
    /// first statement that needs an answer. @throws as sql/driver.hpp's begin().
    void begin(std::string_view what);

    /// Queues a write: it goes with the next statement that needs an answer, or the commit, in one
    /// pipeline; its failure surfaces there.
    template <class... Args>
    void write(sql::stmt which, std::string_view what, const Args&... args) {
        queued_.push_back(own(which, what, args...));
    }

    /// One statement answered now, sent with what is queued; @p on_row per result row. @return the
    /// rows changed. @throws store_timeout or store_unavailable when it (or a queued write) failed.
    template <class OnRow, class... Args>
    std::int64_t query(sql::stmt which, std::string_view what, OnRow&& on_row,
                       const Args&... args) {
        auto exchange = tx_exchange(vec(own(which, what, args...)));
        const PGresult* result = exchange.result(0);
        if (!succeeded(result)) fail(exchange.command(0), result, what);
        for (int row = 0; row < PQntuples(result); ++row)
            on_row(Row(result, row));
        return affected_rows(result);
    }

    /// Whether the transaction is still there: lost with the connection (@p cause says why), ended
    /// by the effect's own COMMIT or ROLLBACK, else ok.
    sql::tx_health health(bool /*after_user_sql*/, std::string& cause) const {
        if (PQstatus(conn()) != CONNECTION_OK) {
            cause = fmt::format(
                "the connection to PostgreSQL was lost{}{}; the transaction is gone and nothing "
                "it wrote is stored",
                tx_error_.empty() ? "" : ": ", tx_error_);
            return sql::tx_health::lost;
        }
        if (tx_begun_ && PQtransactionStatus(conn()) == PQTRANS_IDLE) {
            return sql::tx_health::ended;
        }
        return sql::tx_health::ok;
    }

    /// The overlap lock: the key's transaction-scoped advisory lock, without waiting, then the
    /// idem_locks check, in one round trip; false when another transaction or an unexpired
    /// hold_lock() row holds it.
    bool try_lock(std::string_view key, std::int64_t now);
    /// Queues SAVEPOINT idem_effect.
    void savepoint();
    /// Queues ROLLBACK TO and RELEASE of idem_effect; when nothing was queued since the savepoint,
    /// drops it instead.
    void rollback_to_savepoint();
    /// Queues RELEASE idem_effect; when nothing was queued since the savepoint, drops it instead.
    void release_savepoint();
    /// Sends what is queued and COMMIT in one round trip. @throws commit_failed when a statement or
    /// the COMMIT failed (all rolled back), store_unavailable when the connection is lost during it
    /// (the outcome is unknown).
    void commit();
    /// Drops what is queued and rolls back what is open. @return true when the connection is
    /// outside a transaction now.
    bool rollback_noexcept() noexcept;
    /// libpq's message for the connection's last failure.
    [[nodiscard]] std::string last_error() const { return conn_.error(); }
    /// Forgets the transaction's state (open, begun, its first error, the queue).
    void end_transaction() noexcept {
        tx_open_ = false;
        tx_begun_ = false;
        tx_error_.clear();
        queued_.clear();
    }
    /// Sends the queued commands now (before raw use of the connection).
    void flush();

    // -- the effect's own SQL -----------------------------------------------------------------

    /// The effect's own statement with `$N` placeholders, in the transaction (sent with what is
    /// queued) or alone in autocommit (sql::context). @return the rows changed. @throws
    /// store_timeout for a lock or statement timeout, store_unavailable for a lost connection,
    /// store_error naming the SQL for other errors, usage_error for a wrong parameter count.
    template <class... Args>
    std::int64_t execute(sql::context where, std::string_view sql, const Args&... args) {
        return affected_rows(user_result(where, "execute", sql, args...).get());
    }
    /// The first column of the first row of the effect's query, as an integer (integer types, bool,
    /// numerics without a fraction); nullopt without a row or for NULL. @throws usage_error when it
    /// is not such an integer, or as execute().
    template <class... Args>
    std::optional<std::int64_t> query_int(sql::context where, std::string_view sql,
                                          const Args&... args) {
        Result result = user_result(where, "query_int", sql, args...);
        if (no_value(result.get())) return std::nullopt;
        return text_int(result.get(), 0, 0, sql);
    }
    /// The first column of the first row of the effect's query, as bytes (BYTEA decoded); nullopt
    /// without a row or for NULL. @throws as execute().
    template <class... Args>
    std::optional<std::string> query_text(sql::context where, std::string_view sql,
                                          const Args&... args) {
        Result result = user_result(where, "query_text", sql, args...);
        if (no_value(result.get())) return std::nullopt;
        return text_column(result.get(), 0, 0);
    }

    // -- the schema ---------------------------------------------------------------------------

    /// The recorded schema version; nullopt when the idem_schema table does not exist (no lock, no
    /// CREATE privilege needed).
    std::optional<std::int64_t> stored_schema_version() {
        // An up-to-date schema needs no lock and no CREATE privilege.
        Result exists = run(adhoc("SELECT to_regclass($1) IS NOT NULL", "reading the idem schema",
                                  table_prefix_ + "idem_schema"));
        if (!binary_bool(exists.get(), 0, 0)) return std::nullopt;
        return read_schema_version();
    }
    /// BEGIN, the schema's advisory lock (processes starting at once serialize here), the schema
    /// and the idem_schema table when missing.
    void begin_schema_change() {
        const auto exec = [&](const std::string& sql) { execute_ddl(sql); };
        exec(begin_sql_);
        exec(set_timeout_sql_);
        exec("SET LOCAL client_min_messages = warning");  // no "already exists" notices
        run(adhoc("SELECT pg_advisory_xact_lock($1::bigint)", "locking the idem schema",
                  advisory_key("idem schema", schema_)));
        Result has_schema =
            run(adhoc("SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)",
                      "reading the idem schema", schema_));
        if (!binary_bool(has_schema.get(), 0, 0)) {
            exec("CREATE SCHEMA IF NOT EXISTS " + quote_identifier(schema_));
        }
        exec("CREATE TABLE IF NOT EXISTS " + table_prefix_ +
             "idem_schema(version INTEGER NOT NULL)");
    }
    /// One DDL statement of the migration, inside its transaction.
    void execute_ddl(std::string_view sql) {
        run(control(std::string(sql), "creating the idem schema"));
    }
    /// The version in idem_schema, inside begin_schema_change().
    std::optional<std::int64_t> read_schema_version() {
        Result version =
            run(adhoc("SELECT max(version)::bigint FROM " + table_prefix_ + "idem_schema",
                      "reading the idem schema version"));
        if (PQntuples(version.get()) < 1 || PQgetisnull(version.get(), 0, 0) != 0) {
            return std::nullopt;
        }
        return binary_int(version.get(), 0, 0);
    }
    /// Records @p version as the schema's.
    void write_schema_version(int version) {
        execute_ddl("DELETE FROM " + table_prefix_ + "idem_schema");
        run(adhoc("INSERT INTO " + table_prefix_ + "idem_schema(version) VALUES ($1)",
                  "creating the idem schema", version));
    }
    /// Commits the migration.
    void commit_schema_change() { execute_ddl(commit_sql_); }
    /// "schema \"<name>\"", for messages about the schema.
    [[nodiscard]] std::string schema_location() const {
        return "schema " + quote_identifier(schema_);
    }
    /// Where else the tables could be, for messages: another schema.
    [[nodiscard]] std::string_view schema_elsewhere() const noexcept {
        return "another schema (PostgresOptions::schema)";
    }
    /// The DDL from @p from_version to the current one, in the store's schema (sql/schema.hpp).
    [[nodiscard]] std::vector<std::string> schema_ddl(int from_version) const {
        return sql::postgres_schema_ddl(table_prefix_, from_version);
    }

  private:
    friend class Claims<Driver>;
    friend class Partitions<Driver>;

    /// The commands of one round trip and their results (null: skipped after an error).
    struct Exchange {
        std::vector<Command> commands;
        std::vector<Result> results;
        std::size_t first = 0;  // index of the first command the caller asked for
        [[nodiscard]] const Command& command(std::size_t k) const { return commands[first + k]; }
        [[nodiscard]] const PGresult* result(std::size_t k) const {
            return results[first + k].get();
        }
    };

    static std::vector<Command> vec(Command command) {
        std::vector<Command> commands;
        commands.push_back(std::move(command));
        return commands;
    }
    static bool no_value(const PGresult* result) {
        return PQntuples(result) < 1 || PQnfields(result) < 1 || PQgetisnull(result, 0, 0) != 0;
    }

    template <class... Args>
    Result user_result(sql::context where, std::string_view what, std::string_view sql,
                       const Args&... args) {
        if (where == sql::context::alone) {
            ready(fmt::format("PostgresStore::{}()", what));
            return run(user(sql, what, args...));
        }
        auto exchange = tx_exchange(vec(user(sql, what, args...)));
        if (!succeeded(exchange.result(0))) fail(exchange.command(0), exchange.result(0), what);
        return std::move(exchange.results[exchange.first]);
    }

    /// What the connection reports into the transaction: the first failure inside it.
    struct Recorder {
        Driver* driver;
        void operator()(const std::string& message) const {
            if (driver->tx_open_ && driver->tx_error_.empty()) driver->tx_error_ = message;
        }
    };
    [[nodiscard]] Recorder recorder() noexcept { return Recorder{this}; }

    void init(const PostgresOptions& options);
    void ready(std::string_view what) { conn_.ready(what, recorder()); }

    template <class... Args>
    Command own(sql::stmt which, std::string_view what, const Args&... args);
    /// idem's statement that is not prepared (setup, schema).
    template <class... Args>
    Command adhoc(std::string sql, std::string_view what, const Args&... args);
    Command control(const std::string& sql, std::string_view what, bool savepoint = false);
    template <class... Args>
    Command user(std::string_view sql, std::string_view what, const Args&... args);

    /// Sends @p commands as one pipeline; throws store_unavailable when the connection is lost.
    std::vector<Result> round_trip(std::vector<Command>& commands) {
        return conn_.round_trip(commands, recorder());
    }
    /// The queued commands + @p commands in one round trip; throws the first failure of a queued
    /// command when @p check_queued.
    Exchange tx_exchange(std::vector<Command> commands, bool check_queued = true);
    /// One command outside a transaction (the connection must be idle); throws on failure.
    Result run(Command command) { return conn_.run(std::move(command), recorder()); }

    [[noreturn]] void fail(const Command& command, const PGresult* result, std::string_view what) {
        postgres::fail(command, result, what, recorder());
    }

    std::chrono::milliseconds lock_timeout_{5000};
    std::string schema_;
    std::string table_prefix_;  // "schema".
    unsigned store_number_ = 0;
    std::string begin_sql_ = "BEGIN";
    std::string set_timeout_sql_;  ///< per transaction, on a borrowed connection
    std::string commit_sql_ = "COMMIT";
    std::string savepoint_sql_ = "SAVEPOINT idem_effect";
    std::string rollback_to_sql_ = "ROLLBACK TO SAVEPOINT idem_effect";
    std::string release_sql_ = "RELEASE SAVEPOINT idem_effect";
    std::array<Statement, sql::statement_count> own_{};
    std::unordered_map<std::string, std::unique_ptr<Statement>> cache_;
    // After the statements it tracks: closed (a borrowed one DEALLOCATEs them) before they go.
    Connection conn_;
    std::vector<Command> queued_;  // commands of the open transaction not sent yet
    bool tx_open_ = false;         // a transaction of this driver is running
    bool tx_begun_ = false;        // its BEGIN reached the server
    std::string tx_error_;         // first failure inside it
};

// ---------------------------------------------------------------------------------------------
// The connection

inline Driver::Driver(const std::string& conninfo, const PostgresOptions& options) {
    init(options);
    if (conninfo.find('\0') != std::string::npos) {
        throw usage_error("idem postgres: the connection string contains a NUL byte");
    }
    conn_.open(conninfo);
}

inline Driver::Driver(PGconn* conn, const PostgresOptions& options) {
    if (conn == nullptr) {
        throw usage_error("idem postgres: PostgresStore needs a connection, got null");
    }
    init(options);
    conn_.borrow(conn);
}

inline Driver::~Driver() {
    conn_.close_noexcept();
}

inline void Driver::ping(std::string_view what) {
    for (int attempt = 0;; ++attempt) {
        ready(what);
        try {
            run(control("SELECT 1", what));
            return;
        } catch (const store_unavailable&) {
            // A socket found dead by this round trip: one reconnect (ready()), then the answer.
            if (attempt > 0 || PQstatus(conn()) == CONNECTION_OK) throw;
        }
    }
}

inline void Driver::init(const PostgresOptions& options) {
    static std::atomic<unsigned> stores{0};
    store_number_ = ++stores;
    if (options.lock_timeout.count() < 0) {
        throw usage_error("idem postgres: lock_timeout must not be negative (0 waits forever)");
    }
    if (options.lock_timeout.count() > INT_MAX) {
        throw usage_error("idem postgres: lock_timeout is longer than PostgreSQL allows");
    }
    lock_timeout_ = options.lock_timeout;
    configure_partitions(options);
    if (options.schema.empty() || options.schema.find('\0') != std::string::npos) {
        throw usage_error("idem postgres: PostgresOptions::schema must be a non-empty name");
    }
    schema_ = options.schema;
    table_prefix_ = postgres::quote_identifier(schema_) + ".";
    // A fixed integer, never a value from outside.
    set_timeout_sql_ = fmt::format("SET LOCAL lock_timeout = {}", lock_timeout_.count());
    const sql::statement_table texts = sql::postgres_statements(table_prefix_);
    for (std::size_t i = 0; i < own_.size(); ++i) {
        own_[i].sql = texts.text[i];
        own_[i].name = fmt::format("idem_{}_{}", store_number_, i);
        conn_.track(own_[i]);
    }
    conn_.configure(options.on_notice, options.prepare_statements,
                    fmt::format("idem_{}_", store_number_));
}

inline bool Driver::rollback_noexcept() noexcept {
    queued_.clear();
    return conn_.rollback_noexcept();
}

template <class... Args>
Command Driver::own(sql::stmt which, std::string_view what, const Args&... args) {
    Command command;
    command.statement = &own_[static_cast<std::size_t>(which)];
    command.what = what;
    postgres::add_params(command, args...);
    return command;
}

template <class... Args>
Command Driver::adhoc(std::string sql, std::string_view what, const Args&... args) {
    Command command;
    command.sql = std::move(sql);
    command.what = what;
    postgres::add_params(command, args...);
    return command;
}

inline Command Driver::control(const std::string& sql, std::string_view what, bool savepoint) {
    Command command;
    command.sql = sql;
    command.what = what;
    command.control = true;
    command.savepoint = savepoint;
    return command;
}

template <class... Args>
Command Driver::user(std::string_view sql, std::string_view what, const Args&... args) {
    if (sql.find('\0') != std::string_view::npos) {
        throw usage_error("idem postgres: the SQL text contains a NUL byte");
    }
    Command command;
    command.user = true;
    command.what = what;
    command.result_format = 0;  // text: the effect's columns may be of any type
    command.sql.assign(sql.data(), sql.size());
    postgres::add_params(command, args...);
    if (!conn_.prepares()) return command;
    // Cached per SQL text and parameter kinds (a BYTEA parameter is typed at PREPARE).
    std::string key;
    key.reserve(command.types.size() + 1 + sql.size());
    for (Oid type : command.types)
        key.push_back(type == postgres::bytea_oid ? 'b' : 't');
    key.push_back('\n');
    key.append(sql.data(), sql.size());
    auto found = cache_.find(key);
    if (found == cache_.end()) {
        if (cache_.size() >= max_cached_statements) return command;
        auto statement = std::make_unique<Statement>();
        statement->sql = command.sql;
        statement->name = fmt::format("idem_{}_u{}", store_number_, cache_.size());
        found = cache_.emplace(std::move(key), std::move(statement)).first;
        conn_.track(*found->second);
    }
    command.statement = found->second.get();
    command.sql.clear();
    return command;
}

inline Driver::Exchange Driver::tx_exchange(std::vector<Command> commands, bool check_queued) {
    Exchange exchange;
    exchange.commands = std::move(queued_);
    queued_.clear();
    exchange.first = exchange.commands.size();
    for (Command& command : commands)
        exchange.commands.push_back(std::move(command));
    exchange.results = round_trip(exchange.commands);
    const PGTransactionStatusType status = PQtransactionStatus(conn());
    if (status == PQTRANS_INTRANS || status == PQTRANS_INERROR) tx_begun_ = true;
    if (check_queued) {
        for (std::size_t i = 0; i < exchange.first; ++i) {
            if (postgres::failed(exchange.results[i].get())) {
                fail(exchange.commands[i], exchange.results[i].get(), exchange.commands[i].what);
            }
        }
    }
    return exchange;
}

inline void Driver::flush() {
    if (queued_.empty()) return;
    tx_exchange({});
}

inline void Driver::begin(std::string_view what) {
    ready(what);
    queued_.clear();
    if (conn_.owned()) {
        // Our own session: set the lock timeout once per session (a reconnect is a new one),
        // not in every transaction.
        conn_.set_session_lock_timeout(lock_timeout_, recorder());
        queued_.push_back(control(begin_sql_, "begin"));
    } else {
        // A borrowed session keeps its own setting outside our transactions.
        queued_.push_back(control(begin_sql_, "begin"));
        queued_.push_back(control(set_timeout_sql_, "begin (SET LOCAL lock_timeout)"));
    }
    tx_open_ = true;
    tx_begun_ = false;
    tx_error_.clear();
}

// ---------------------------------------------------------------------------------------------
// The transaction

inline void Driver::savepoint() {
    queued_.push_back(control(savepoint_sql_, "savepoint", true));
}

inline void Driver::rollback_to_savepoint() {
    if (!queued_.empty() && queued_.back().savepoint) {
        queued_.pop_back();  // nothing happened since the savepoint: nothing to undo
    } else {
        queued_.push_back(control(rollback_to_sql_, "rollback_to_savepoint"));
        queued_.push_back(control(release_sql_, "rollback_to_savepoint"));
    }
}

inline void Driver::release_savepoint() {
    if (!queued_.empty() && queued_.back().savepoint) {
        queued_.pop_back();
    } else {
        queued_.push_back(control(release_sql_, "release_savepoint"));
    }
}

inline bool Driver::try_lock(std::string_view key, std::int64_t now) {
    // Two statements in one round trip: the lock check runs after the advisory lock is taken
    // (a new READ COMMITTED snapshot), so a hold_lock() that committed before is seen, and one
    // that comes later cannot take the advisory lock.
    std::vector<Command> commands;
    commands.push_back(
        own(sql::stmt::lock_advisory, "try_lock", postgres::advisory_key("idem lock", key)));
    commands.push_back(own(sql::stmt::lock_live, "try_lock", Blob{key}, now));
    auto exchange = tx_exchange(std::move(commands));
    for (std::size_t k = 0; k < 2; ++k) {
        if (!postgres::succeeded(exchange.result(k))) {
            fail(exchange.command(k), exchange.result(k), "try_lock");
        }
    }
    const bool locked = postgres::binary_bool(exchange.result(0), 0, 0);
    const bool held = postgres::binary_bool(exchange.result(1), 0, 0);
    return locked && !held;
}

inline void Driver::commit() {
    const bool writes = std::any_of(queued_.begin(), queued_.end(),
                                    [](const Command& command) { return !command.control; });
    if (!tx_begun_ && !writes) {
        // Nothing reached the server, nothing to write: an empty transaction.
        const std::string cause = tx_error_;
        if (!cause.empty()) {
            throw commit_failed(
                fmt::format("idem postgres: commit failed: an earlier statement failed ({}); "
                            "rolled back",
                            cause));
        }
        return;
    }
    std::vector<Command> commands;
    commands.push_back(control(commit_sql_, "commit"));
    Exchange exchange;
    try {
        exchange = tx_exchange(std::move(commands), false);
    } catch (const store_unavailable& e) {
        throw store_unavailable(fmt::format(
            "idem postgres: commit: the outcome is unknown: {} (a redelivery finds the claim if "
            "the commit went through)",
            e.what()));
    }
    std::string failure;
    for (std::size_t i = 0; i < exchange.commands.size() && failure.empty(); ++i) {
        if (postgres::failed(exchange.results[i].get())) {
            failure = fmt::format("{}: {}", exchange.commands[i].what,
                                  postgres::server_message(exchange.results[i].get()));
            if (exchange.commands[i].user) {
                failure += fmt::format("; SQL: {}", exchange.commands[i].text());
            }
        }
    }
    const PGresult* committed = exchange.result(0);
    if (failure.empty() && committed != nullptr &&
        std::string_view(PQcmdStatus(const_cast<PGresult*>(committed))) == "ROLLBACK") {
        // COMMIT of a transaction an earlier statement had aborted: PostgreSQL rolls it back.
        failure = tx_error_.empty() ? std::string("an earlier statement failed") : tx_error_;
        failure = fmt::format("the transaction had failed earlier ({})", failure);
    }
    if (failure.empty()) return;
    const bool rolled_back = rollback_noexcept();
    throw commit_failed(fmt::format("idem postgres: commit failed: {}; rolled back{}", failure,
                                    rolled_back ? "" : " (and the rollback failed too)"));
}

}  // namespace postgres
IDEM_END_NAMESPACE
