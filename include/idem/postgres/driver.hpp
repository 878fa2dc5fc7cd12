#pragma once
/// @file
/// @brief idem::postgres::Driver: PostgreSQL (libpq) under the SQL store written once
/// (sql/store.hpp). It owns or borrows the `PGconn*`: connects, reconnects (PQreset), keeps
/// idem's and the effect's statements prepared per session (and resyncs them when the session
/// lost some), sends what a transaction does not need answered at once in one libpq pipeline
/// with the next statement, routes notices, sets lock_timeout per session (owned) or per
/// transaction (borrowed), and maps SQLSTATEs to idem's exceptions (postgres/connection.hpp).

#include <fcntl.h>
#include <libpq-fe.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <functional>
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
#include "idem/error.hpp"
#include "idem/outcome.hpp"
#include "idem/postgres/connection.hpp"
#include "idem/postgres/options.hpp"
#include "idem/sql/driver.hpp"
#include "idem/sql/own_claims.hpp"
#include "idem/sql/schema.hpp"
#include "idem/sql/statements.hpp"
#include "idem/sql/stored_outcome.hpp"
#include "idem/store.hpp"

IDEM_BEGIN_NAMESPACE
namespace postgres {

/// One row of an idem statement's (binary) result (sql/driver.hpp's Row).
class Row {
  public:
    Row(const PGresult* result, int row) noexcept : result_(result), row_(row) {}
    [[nodiscard]] std::string bytes(int column) const { return bytes_of(result_, row_, column); }
    [[nodiscard]] std::int64_t int64(int column) const { return binary_int(result_, row_, column); }
    [[nodiscard]] bool boolean(int column) const { return binary_bool(result_, row_, column); }
    [[nodiscard]] bool is_null(int column) const noexcept {
        return PQgetisnull(result_, row_, column) != 0;
    }

  private:
    const PGresult* result_;
    int row_;
};

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

/// The PostgreSQL driver (the contract: sql/driver.hpp).
class Driver {
  public:
    static constexpr std::string_view name = "postgres";
    static constexpr std::string_view store_class = "PostgresStore";
    /// Effect statements (SQL and parameter kinds) kept prepared; further ones are not.
    static constexpr std::size_t max_cached_statements = 256;
    /// The oldest server this store runs on (ON CONFLICT, SKIP LOCKED, to_regclass(text)).
    static constexpr int min_server_version = 100000;
    template <class Tx>
    using transaction_face = TransactionFace<Tx>;
    using Row = postgres::Row;

    Driver(const std::string& conninfo, const PostgresOptions& options);
    Driver(PGconn* conn, const PostgresOptions& options);
    Driver(const Driver&) = delete;
    Driver& operator=(const Driver&) = delete;
    ~Driver();

    [[nodiscard]] PGconn* conn() const noexcept { return conn_; }

    // -- fork() and ping (sql/driver.hpp) -----------------------------------------------------

    [[nodiscard]] bool owns_connection() const noexcept { return owned_; }
    /// In a fork()ed child: drops the parent's connection (forget_inherited) and connects anew
    /// with the same conninfo: a session of the child's own.
    void reopen_after_fork() {
        forget_inherited();
        connect_owned();
    }
    /// Drops a connection opened in another process without a byte to the server: PQfinish (and
    /// PQreset) would send Terminate on the socket the parent still uses, ending the parent's
    /// session. The socket's descriptor is first replaced by /dev/null (dup2), so PQfinish only
    /// frees memory and closes this process's descriptor; a borrowed connection is left as it is
    /// (the consumer's). Nothing else is sent: no DEALLOCATE, no ROLLBACK.
    void forget_inherited() noexcept;
    /// One round trip (`SELECT 1`); a connection found dead is reconnected (PQreset) and asked
    /// again once. @throws store_unavailable while the server does not answer.
    void ping(std::string_view what);
    [[nodiscard]] const std::string& schema() const noexcept { return schema_; }
    [[nodiscard]] std::uint64_t round_trips() const noexcept {
        return round_trips_.load(std::memory_order_relaxed);
    }

    /// Reasons and last errors are TEXT: valid UTF-8 without NULs.
    static std::string text(std::string_view value) { return valid_utf8(value); }
    static void check_outbox(const OutboxIntent& intent) {
        if (valid_utf8(intent.destination) != intent.destination) {
            throw usage_error(
                "idem postgres: add_outbox(): the destination is not valid UTF-8 or holds a NUL "
                "byte; it is stored as TEXT");
        }
    }

    // -- outside a transaction: autocommit ----------------------------------------------------

    template <class OnRow, class... Args>
    std::int64_t run(sql::stmt which, std::string_view what, sql::access, OnRow&& on_row,
                     const Args&... args) {
        ready(what);
        Result result = run(own(which, what, args...));
        for (int row = 0; row < PQntuples(result.get()); ++row)
            on_row(Row(result.get(), row));
        return affected_rows(result.get());
    }

    bool hold_lock(std::string_view key, std::string_view owner, std::int64_t expires_ms,
                   std::int64_t now_ms) {
        ready("hold_lock()");
        Result result = run(own(sql::stmt::lock_hold, "hold_lock", Blob{key}, Blob{owner},
                                expires_ms, now_ms, advisory_key("idem lock", key)));
        return affected_rows(result.get()) == 1;
    }

    // -- the transaction ----------------------------------------------------------------------

    void begin(std::string_view what);

    template <class... Args>
    void write(sql::stmt which, std::string_view what, const Args&... args) {
        queued_.push_back(own(which, what, args...));
    }

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

    sql::tx_health health(bool /*after_user_sql*/, std::string& cause) const {
        if (PQstatus(conn_) != CONNECTION_OK) {
            cause = fmt::format(
                "the connection to PostgreSQL was lost{}{}; the transaction is gone and nothing "
                "it wrote is stored",
                tx_error_.empty() ? "" : ": ", tx_error_);
            return sql::tx_health::lost;
        }
        if (tx_begun_ && PQtransactionStatus(conn_) == PQTRANS_IDLE) return sql::tx_health::ended;
        return sql::tx_health::ok;
    }

    ClaimResult claim(sql::OwnClaims& claims, std::string_view scope, std::string_view id,
                      std::string_view fingerprint, std::int64_t now) {
        return insert_claim(claims, now, scope, id, fingerprint, false);
    }
    std::vector<ClaimResult> claim_many(sql::OwnClaims& claims, std::string_view scope,
                                        const std::vector<std::string_view>& ids,
                                        const std::vector<std::string>& fingerprints,
                                        std::int64_t now);
    bool try_lock(std::string_view key, std::int64_t now);
    void savepoint();
    void rollback_to_savepoint();
    void release_savepoint();
    void commit();
    bool rollback_noexcept() noexcept;
    [[nodiscard]] std::string last_error() const { return connection_error(); }
    void end_transaction() noexcept {
        tx_open_ = false;
        tx_begun_ = false;
        tx_error_.clear();
        queued_.clear();
    }
    /// Sends the queued commands now (before raw use of the connection).
    void flush();

    // -- the effect's own SQL -----------------------------------------------------------------

    template <class... Args>
    std::int64_t execute(sql::context where, std::string_view sql, const Args&... args) {
        return affected_rows(user_result(where, "execute", sql, args...).get());
    }
    template <class... Args>
    std::optional<std::int64_t> query_int(sql::context where, std::string_view sql,
                                          const Args&... args) {
        Result result = user_result(where, "query_int", sql, args...);
        if (no_value(result.get())) return std::nullopt;
        return text_int(result.get(), 0, 0, sql);
    }
    template <class... Args>
    std::optional<std::string> query_text(sql::context where, std::string_view sql,
                                          const Args&... args) {
        Result result = user_result(where, "query_text", sql, args...);
        if (no_value(result.get())) return std::nullopt;
        return text_column(result.get(), 0, 0);
    }

    // -- the schema ---------------------------------------------------------------------------

    std::optional<std::int64_t> stored_schema_version() {
        // An up-to-date schema needs no lock and no CREATE privilege.
        Result exists = run(adhoc("SELECT to_regclass($1) IS NOT NULL", "reading the idem schema",
                                  table_prefix_ + "idem_schema"));
        if (!binary_bool(exists.get(), 0, 0)) return std::nullopt;
        return read_schema_version();
    }
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
    void execute_ddl(std::string_view sql) {
        run(control(std::string(sql), "creating the idem schema"));
    }
    std::optional<std::int64_t> read_schema_version() {
        Result version =
            run(adhoc("SELECT max(version)::bigint FROM " + table_prefix_ + "idem_schema",
                      "reading the idem schema version"));
        if (PQntuples(version.get()) < 1 || PQgetisnull(version.get(), 0, 0) != 0) {
            return std::nullopt;
        }
        return binary_int(version.get(), 0, 0);
    }
    void write_schema_version(int version) {
        execute_ddl("DELETE FROM " + table_prefix_ + "idem_schema");
        run(adhoc("INSERT INTO " + table_prefix_ + "idem_schema(version) VALUES ($1)",
                  "creating the idem schema", version));
    }
    void commit_schema_change() { execute_ddl(commit_sql_); }
    [[nodiscard]] std::string schema_location() const {
        return "schema " + quote_identifier(schema_);
    }
    [[nodiscard]] std::string_view schema_elsewhere() const noexcept {
        return "another schema (PostgresOptions::schema)";
    }
    [[nodiscard]] std::vector<std::string> schema_ddl(int from_version) const {
        return sql::postgres_schema_ddl(table_prefix_, from_version);
    }

  private:
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

    void init(const PostgresOptions& options);
    void connect_owned();
    void setup();
    void ready(std::string_view what);
    void reconnect(std::string_view what);
    void forget_prepared() noexcept;
    void resync_prepared();
    void close_noexcept() noexcept;
    /// Installs notice_receiver on conn_ as PostgresOptions::on_notice describes.
    void route_notices();
    /// Puts libpq's receiver back on a borrowed connection if route_notices() replaced it.
    void restore_notices() noexcept;
    static void notice_receiver(void* driver, const PGresult* notice) noexcept;
    [[nodiscard]] std::string connection_error() const;

    template <class... Args>
    Command own(sql::stmt which, std::string_view what, const Args&... args);
    /// idem's statement that is not prepared (setup, schema).
    template <class... Args>
    Command adhoc(std::string sql, std::string_view what, const Args&... args);
    Command control(const std::string& sql, std::string_view what, bool savepoint = false);
    template <class... Args>
    Command user(std::string_view sql, std::string_view what, const Args&... args);

    /// Sends @p commands as one pipeline; throws store_unavailable when the connection is lost.
    std::vector<Result> round_trip(std::vector<Command>& commands);
    /// The queued commands + @p commands in one round trip; throws the first failure of a queued
    /// command when @p check_queued.
    Exchange tx_exchange(std::vector<Command> commands, bool check_queued = true);
    /// One command outside a transaction (the connection must be idle); throws on failure.
    Result run(Command command);

    [[noreturn]] void fail(const Command& command, const PGresult* result, std::string_view what);
    [[noreturn]] void connection_lost(std::string_view what);

    /// One id not claimed by this transaction before: insert, or read the stored claim. With
    /// @p guarded, inside its own savepoint, so a lock timeout leaves the transaction usable.
    ClaimResult insert_claim(sql::OwnClaims& claims, std::int64_t now, std::string_view scope,
                             std::string_view id, std::string_view fingerprint, bool guarded);
    /// A stored claim as a duplicate: outcome and fingerprint columns of @p row.
    static ClaimResult stored_claim(const PGresult* result, int row, int outcome_column,
                                    int fingerprint_column);

    PGconn* conn_ = nullptr;
    bool owned_ = false;
    std::string conninfo_;  ///< owned: what reopen_after_fork() connects with
    std::function<void(std::string_view)> on_notice_;
    bool notices_routed_ = false;   ///< notice_receiver is installed on conn_
    bool chain_processor_ = false;  ///< also pass notices to the consumer's notice processor
    std::chrono::milliseconds lock_timeout_{5000};
    std::string schema_;
    std::string table_prefix_;  // "schema".
    bool prepare_ = true;
    unsigned store_number_ = 0;
    std::string begin_sql_ = "BEGIN";
    std::string set_timeout_sql_;
    int session_timeout_pid_ = 0;  ///< backend whose session has our lock_timeout (owned only)
    std::string commit_sql_ = "COMMIT";
    std::string savepoint_sql_ = "SAVEPOINT idem_effect";
    std::string rollback_to_sql_ = "ROLLBACK TO SAVEPOINT idem_effect";
    std::string release_sql_ = "RELEASE SAVEPOINT idem_effect";
    // Around claims of a batch, so a lock timeout undoes only them (not the transaction).
    std::string claim_savepoint_sql_ = "SAVEPOINT idem_claims";
    std::string claim_rollback_to_sql_ = "ROLLBACK TO SAVEPOINT idem_claims";
    std::string claim_release_sql_ = "RELEASE SAVEPOINT idem_claims";
    std::array<Statement, sql::statement_count> own_{};
    std::unordered_map<std::string, std::unique_ptr<Statement>> cache_;
    std::atomic<std::uint64_t> round_trips_{0};
    int backend_pid_ = 0;
    std::vector<Command> queued_;    // commands of the open transaction not sent yet
    bool tx_open_ = false;           // a transaction of this driver is running
    bool tx_begun_ = false;          // its BEGIN reached the server
    std::string tx_error_;           // first failure inside it
    bool rollback_pending_ = false;  // our ROLLBACK failed: the connection is still in our tx
    bool resync_prepared_ = false;   // the session lost some of our prepared statements
};

// ---------------------------------------------------------------------------------------------
// The connection

inline Driver::Driver(const std::string& conninfo, const PostgresOptions& options)
    : owned_(true), conninfo_(conninfo) {
    init(options);
    if (conninfo.find('\0') != std::string::npos) {
        throw usage_error("idem postgres: the connection string contains a NUL byte");
    }
    connect_owned();
}

inline void Driver::connect_owned() {
    // client_encoding and application_name come first: the expanded conninfo overrides them.
    const char* const keys[] = {"client_encoding", "fallback_application_name", "dbname", nullptr};
    const char* const values[] = {"UTF8", "idem", conninfo_.c_str(), nullptr};
    conn_ = PQconnectdbParams(keys, values, 1);
    if (conn_ == nullptr) throw store_unavailable("idem postgres: cannot connect: out of memory");
    if (PQstatus(conn_) != CONNECTION_OK) {
        const std::string message =
            fmt::format("idem postgres: cannot connect: {}", connection_error());
        close_noexcept();
        throw store_unavailable(message);
    }
    try {
        route_notices();
        setup();
    } catch (...) {
        close_noexcept();
        throw;
    }
}

inline Driver::Driver(PGconn* conn, const PostgresOptions& options) : conn_(conn), owned_(false) {
    if (conn_ == nullptr) {
        throw usage_error("idem postgres: PostgresStore needs a connection, got null");
    }
    try {
        init(options);
        if (PQstatus(conn_) != CONNECTION_OK) {
            throw store_unavailable(fmt::format(
                "idem postgres: the borrowed connection is broken: {}", connection_error()));
        }
        if (PQpipelineStatus(conn_) != PQ_PIPELINE_OFF || PQisnonblocking(conn_) != 0) {
            throw usage_error(
                "idem postgres: the borrowed connection is in pipeline or non-blocking mode; "
                "PostgresStore needs a blocking connection outside pipeline mode");
        }
        if (PQtransactionStatus(conn_) != PQTRANS_IDLE) {
            throw usage_error(
                "idem postgres: the borrowed connection is inside a transaction (or busy); "
                "construct the PostgresStore outside any transaction (it may create its tables)");
        }
        route_notices();
        setup();
    } catch (...) {
        restore_notices();
        conn_ = nullptr;  // borrowed: never closed
        throw;
    }
}

inline Driver::~Driver() {
    close_noexcept();
}

inline void Driver::forget_inherited() noexcept {
    if (conn_ == nullptr) return;
    if (owned_) {
        const int fd = PQsocket(conn_);
        bool detached = fd < 0;
        if (!detached) {
            const int null = ::open("/dev/null", O_RDWR | O_CLOEXEC);
            if (null >= 0) {
                detached = ::dup2(null, fd) == fd;
                ::close(null);
            }
        }
        // Without /dev/null in its place the socket stays open and the PGconn is leaked: better
        // than a Terminate on the parent's session.
        if (detached) PQfinish(conn_);
    }
    conn_ = nullptr;
    notices_routed_ = false;
    forget_prepared();
    end_transaction();
    rollback_pending_ = false;
    session_timeout_pid_ = 0;
    backend_pid_ = 0;
}

inline void Driver::ping(std::string_view what) {
    for (int attempt = 0;; ++attempt) {
        ready(what);
        try {
            run(control("SELECT 1", what));
            return;
        } catch (const store_unavailable&) {
            // A socket found dead by this round trip: one reconnect (ready()), then the answer.
            if (attempt > 0 || PQstatus(conn_) == CONNECTION_OK) throw;
        }
    }
}

inline void Driver::init(const PostgresOptions& options) {
    static std::atomic<unsigned> stores{0};
    store_number_ = ++stores;
    on_notice_ = options.on_notice;
    prepare_ = options.prepare_statements;
    if (options.lock_timeout.count() < 0) {
        throw usage_error("idem postgres: lock_timeout must not be negative (0 waits forever)");
    }
    if (options.lock_timeout.count() > INT_MAX) {
        throw usage_error("idem postgres: lock_timeout is longer than PostgreSQL allows");
    }
    lock_timeout_ = options.lock_timeout;
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
    }
}

inline std::string Driver::connection_error() const {
    std::string message = postgres::trimmed(PQerrorMessage(conn_));
    return message.empty() ? std::string("unknown libpq error") : message;
}

inline void Driver::close_noexcept() noexcept {
    if (conn_ == nullptr) return;
    if (owned_) {
        PQfinish(conn_);
    } else if (PQstatus(conn_) == CONNECTION_OK && PQtransactionStatus(conn_) == PQTRANS_IDLE &&
               PQpipelineStatus(conn_) == PQ_PIPELINE_OFF) {
        // Leave the borrowed session as we found it: drop our prepared statements.
        try {
            std::string sql;
            for (const Statement& statement : own_) {
                if (statement.prepared) sql += fmt::format("DEALLOCATE {};", statement.name);
            }
            for (const auto& entry : cache_) {
                if (entry.second->prepared) {
                    sql += fmt::format("DEALLOCATE {};", entry.second->name);
                }
            }
            if (!sql.empty()) PQclear(PQexec(conn_, sql.c_str()));
        } catch (...) {
        }
    }
    if (!owned_) restore_notices();
    conn_ = nullptr;
}

inline void Driver::route_notices() {
    const auto& libpq = postgres::libpq_notice_hooks();
    if (owned_) {
        // Our own connection: nobody else listens, so nothing reaches stderr.
        PQsetNoticeReceiver(conn_, &Driver::notice_receiver, this);
        notices_routed_ = true;
        return;
    }
    if (!on_notice_ || libpq.receiver == nullptr) return;  // the consumer's connection as it is
    if (PQsetNoticeReceiver(conn_, nullptr, nullptr) != libpq.receiver) {
        return;  // the consumer's own receiver: neither chainable nor restorable, so kept
    }
    chain_processor_ = PQsetNoticeProcessor(conn_, nullptr, nullptr) != libpq.processor;
    PQsetNoticeReceiver(conn_, &Driver::notice_receiver, this);
    notices_routed_ = true;
}

inline void Driver::restore_notices() noexcept {
    if (!notices_routed_ || owned_ || conn_ == nullptr) return;
    // libpq's receiver ignores its argument (a new PGconn has it null).
    PQsetNoticeReceiver(conn_, postgres::libpq_notice_hooks().receiver, nullptr);
    notices_routed_ = false;
}

inline void Driver::notice_receiver(void* store, const PGresult* notice) noexcept {
    const auto* self = static_cast<const Driver*>(store);
    if (self->on_notice_) {
        std::string_view text = PQresultErrorMessage(notice);
        while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) {
            text.remove_suffix(1);
        }
        try {
            self->on_notice_(text);
        } catch (...) {
            // Never through libpq's C frames.
        }
    }
    if (self->chain_processor_) {
        // libpq's receiver hands the notice to the connection's processor (the consumer's).
        postgres::libpq_notice_hooks().receiver(nullptr, notice);
    }
}

inline void Driver::forget_prepared() noexcept {
    for (Statement& statement : own_)
        statement.prepared = false;
    for (auto& entry : cache_)
        entry.second->prepared = false;
    resync_prepared_ = false;
}

inline void Driver::resync_prepared() {
    forget_prepared();
    const std::string prefix = fmt::format("idem_{}_", store_number_);
    Result names =
        run(adhoc("SELECT name FROM pg_catalog.pg_prepared_statements "
                  "WHERE left(name, length($1)) = $1",
                  "reading the prepared statements", prefix));
    for (int row = 0; row < PQntuples(names.get()); ++row) {
        const std::string name = postgres::bytes_of(names.get(), row, 0);
        for (Statement& statement : own_)
            if (statement.name == name) statement.prepared = true;
        for (auto& entry : cache_)
            if (entry.second->name == name) entry.second->prepared = true;
    }
}

inline void Driver::setup() {
    if (PQserverVersion(conn_) < min_server_version) {
        throw store_unavailable(fmt::format(
            "idem postgres: the server is version {}; PostgresStore needs PostgreSQL 10 or later",
            PQserverVersion(conn_)));
    }
    backend_pid_ = PQbackendPID(conn_);
}

inline void Driver::reconnect(std::string_view what) {
    PQreset(conn_);
    forget_prepared();
    rollback_pending_ = false;
    if (PQstatus(conn_) != CONNECTION_OK) {
        throw store_unavailable(fmt::format(
            "idem postgres: {}: the connection to PostgreSQL broke and reconnecting failed: {}",
            what, connection_error()));
    }
    backend_pid_ = PQbackendPID(conn_);
}

inline void Driver::ready(std::string_view what) {
    if (PQstatus(conn_) != CONNECTION_OK) reconnect(what);
    if (PQbackendPID(conn_) != backend_pid_) {
        // Someone reset the (borrowed) connection: the session and its statements are new.
        forget_prepared();
        backend_pid_ = PQbackendPID(conn_);
    }
    if (PQpipelineStatus(conn_) != PQ_PIPELINE_OFF) {
        throw usage_error(fmt::format(
            "idem postgres: {}: the connection is in pipeline mode; leave it first", what));
    }
    if (PQisnonblocking(conn_) != 0) {
        throw usage_error(fmt::format(
            "idem postgres: {}: the connection is in non-blocking mode; PostgresStore needs a "
            "blocking connection (PQsetnonblocking(conn, 0))",
            what));
    }
    PGTransactionStatusType status = PQtransactionStatus(conn_);
    if (status != PQTRANS_IDLE && rollback_pending_) {
        rollback_noexcept();
        status = PQtransactionStatus(conn_);
    }
    if (status == PQTRANS_UNKNOWN) {
        reconnect(what);
        status = PQtransactionStatus(conn_);
    }
    if (status == PQTRANS_IDLE && resync_prepared_) resync_prepared();
    if (status != PQTRANS_IDLE) {
        throw usage_error(fmt::format(
            "idem postgres: {}: the connection is already inside a transaction (or busy with a "
            "query). idem needs its own BEGIN so the claim and the effect commit together: "
            "commit or roll back your transaction first, and write the effect's rows through the "
            "idem transaction (Transaction::execute() or Transaction::conn())",
            what));
    }
}

inline bool Driver::rollback_noexcept() noexcept {
    queued_.clear();
    if (conn_ == nullptr || PQstatus(conn_) != CONNECTION_OK) {
        rollback_pending_ = false;  // the server rolls back a transaction whose session died
        return true;
    }
    if (PQpipelineStatus(conn_) != PQ_PIPELINE_OFF) {
        for (int nulls = 0; nulls < 2;) {
            PGresult* result = PQgetResult(conn_);
            if (result == nullptr) {
                ++nulls;
            } else {
                nulls = 0;
                PQclear(result);
            }
            if (PQstatus(conn_) != CONNECTION_OK) break;
        }
        PQexitPipelineMode(conn_);
    }
    if (PQtransactionStatus(conn_) == PQTRANS_ACTIVE) {
        while (PGresult* result = PQgetResult(conn_))
            PQclear(result);
    }
    if (PQtransactionStatus(conn_) != PQTRANS_IDLE) {
        round_trips_.fetch_add(1, std::memory_order_relaxed);
        PQclear(PQexec(conn_, "ROLLBACK"));
    }
    rollback_pending_ =
        PQstatus(conn_) == CONNECTION_OK && PQtransactionStatus(conn_) != PQTRANS_IDLE;
    return !rollback_pending_;
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
    if (!prepare_) return command;
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
    }
    command.statement = found->second.get();
    command.sql.clear();
    return command;
}

inline std::vector<Result> Driver::round_trip(std::vector<Command>& commands) {
    using postgres::failed;
    std::vector<Result> results(commands.size());
    if (commands.empty()) return results;
    if (PQenterPipelineMode(conn_) != 1) {
        throw store_unavailable(
            fmt::format("idem postgres: cannot start a pipeline: {}", connection_error()));
    }
    round_trips_.fetch_add(1, std::memory_order_relaxed);

    struct Slot {
        std::size_t command;
        Statement* preparing;  // a Parse of this statement, or null: the command itself
    };
    std::vector<Slot> slots;
    slots.reserve(commands.size() * 2);
    std::string send_error;
    std::vector<const char*> values;
    std::vector<int> lengths;
    for (std::size_t i = 0; i < commands.size() && send_error.empty(); ++i) {
        const Command& command = commands[i];
        const int count = static_cast<int>(command.values.size());
        Statement* statement = prepare_ ? command.statement : nullptr;
        if (statement != nullptr && !statement->prepared) {
            const bool queued = std::any_of(slots.begin(), slots.end(), [&](const Slot& slot) {
                return slot.preparing == statement;
            });
            if (!queued) {
                if (statement->types.empty()) statement->types = command.types;
                if (PQsendPrepare(conn_, statement->name.c_str(), statement->sql.c_str(), count,
                                  statement->types.empty() ? nullptr : statement->types.data()) !=
                    1) {
                    send_error = connection_error();
                    break;
                }
                slots.push_back(Slot{i, statement});
            }
        }
        values.assign(command.values.size(), nullptr);
        lengths.assign(command.values.size(), 0);
        for (std::size_t k = 0; k < command.values.size(); ++k) {
            if (command.nulls[k] == 0) values[k] = command.values[k].c_str();
            lengths[k] = static_cast<int>(command.values[k].size());
        }
        const int sent =
            statement != nullptr
                ? PQsendQueryPrepared(conn_, statement->name.c_str(), count, values.data(),
                                      lengths.data(), command.formats.data(), command.result_format)
                : PQsendQueryParams(conn_, command.text().c_str(), count, command.types.data(),
                                    values.data(), lengths.data(), command.formats.data(),
                                    command.result_format);
        if (sent != 1) {
            send_error = connection_error();
            break;
        }
        slots.push_back(Slot{i, nullptr});
    }

    bool broken = PQpipelineSync(conn_) != 1;
    for (const Slot& slot : slots) {
        if (broken) break;
        Result first;
        while (PGresult* raw = PQgetResult(conn_)) {
            Result result(raw);
            if (!first || (!failed(first.get()) && failed(result.get()))) first = std::move(result);
        }
        if (slot.preparing != nullptr) {
            // 42P05: it survived a partial DEALLOCATE; the name is this store's, so it is ours.
            if (postgres::succeeded(first.get()) || postgres::sqlstate(first.get()) == "42P05") {
                slot.preparing->prepared = true;
            }
            if (failed(first.get())) {
                results[slot.command] = std::move(first);  // the command inherits the failure
            }
        } else if (!results[slot.command]) {
            results[slot.command] = std::move(first);
        }
        broken = PQstatus(conn_) != CONNECTION_OK;
    }
    // Up to the sync point; a lost connection ends the stream with an error and nulls.
    for (int nulls = 0; !broken && nulls < 2;) {
        PGresult* raw = PQgetResult(conn_);
        if (raw == nullptr) {
            ++nulls;
            continue;
        }
        const bool sync = PQresultStatus(raw) == PGRES_PIPELINE_SYNC;
        PQclear(raw);
        if (sync) break;
        nulls = 0;
        broken = PQstatus(conn_) != CONNECTION_OK;
    }
    if (PQexitPipelineMode(conn_) != 1 && PQstatus(conn_) == CONNECTION_OK) {
        while (PGresult* raw = PQgetResult(conn_))
            PQclear(raw);
        PQexitPipelineMode(conn_);
    }
    for (const auto& result : results) {
        // "prepared statement does not exist": the session lost statements (DEALLOCATE, DISCARD
        // ALL, a pooler); ready() asks the server which ones are left before the next use.
        if (postgres::sqlstate(result.get()) == "26000") resync_prepared_ = true;
    }
    if (PQstatus(conn_) != CONNECTION_OK) {
        // Keep the server's own reason (e.g. "terminating connection due to administrator
        // command") when it sent one.
        for (const auto& result : results) {
            if (failed(result.get())) {
                connection_lost(postgres::server_message(result.get()));
            }
        }
        connection_lost(connection_error());
    }
    if (!send_error.empty()) {
        throw store_unavailable(
            fmt::format("idem postgres: sending a statement failed: {}", send_error));
    }
    return results;
}

inline void Driver::connection_lost(std::string_view why) {
    std::string message = fmt::format(
        "idem postgres: the connection to PostgreSQL was lost ({}); the open transaction, if "
        "any, is gone, and the store reconnects on the next begin()",
        why);
    if (tx_open_ && tx_error_.empty()) tx_error_ = message;
    throw store_unavailable(message);
}

inline Driver::Exchange Driver::tx_exchange(std::vector<Command> commands, bool check_queued) {
    Exchange exchange;
    exchange.commands = std::move(queued_);
    queued_.clear();
    exchange.first = exchange.commands.size();
    for (Command& command : commands)
        exchange.commands.push_back(std::move(command));
    exchange.results = round_trip(exchange.commands);
    const PGTransactionStatusType status = PQtransactionStatus(conn_);
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

inline Result Driver::run(Command command) {
    std::vector<Command> commands;
    commands.push_back(std::move(command));
    std::vector<Result> results = round_trip(commands);
    if (!postgres::succeeded(results[0].get())) {
        fail(commands[0], results[0].get(), commands[0].what);
    }
    return std::move(results[0]);
}

inline void Driver::flush() {
    if (queued_.empty()) return;
    tx_exchange({});
}

inline void Driver::fail(const Command& command, const PGresult* result, std::string_view what) {
    namespace pg = postgres;
    const std::string_view state = pg::sqlstate(result);
    std::string message = fmt::format(
        "idem postgres: {} failed: {}", what,
        result != nullptr ? pg::server_message(result) : std::string("no answer from the server"));
    if (command.user) {
        message += fmt::format("; SQL: {}", command.text());
        if (state == "42601" && command.text().find('?') != std::string::npos) {
            message += " (PostgreSQL's placeholders are $1, $2, …, not ?)";
        }
    }
    if (tx_open_ && tx_error_.empty()) tx_error_ = message;
    if (pg::is_timeout(state)) throw store_timeout(message);
    if (command.user && state == "08P01") throw usage_error(message);  // wrong parameter count
    if (pg::is_unavailable(state) || !command.user) throw store_unavailable(message);
    throw store_error(message);
}

inline void Driver::begin(std::string_view what) {
    ready(what);
    queued_.clear();
    if (owned_) {
        // Our own session: set the lock timeout once per session (a reconnect is a new one),
        // not in every transaction.
        if (session_timeout_pid_ != PQbackendPID(conn_)) {
            run(control(fmt::format("SET lock_timeout = {}", lock_timeout_.count()),
                        "begin (SET lock_timeout)"));
            session_timeout_pid_ = PQbackendPID(conn_);
        }
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

inline ClaimResult Driver::stored_claim(const PGresult* result, int row, int outcome_column,
                                        int fingerprint_column) {
    namespace pg = postgres;
    return sql::stored_duplicate(pg::bytes_of(result, row, outcome_column),
                                 pg::bytes_of(result, row, fingerprint_column), "postgres");
}

inline ClaimResult Driver::insert_claim(sql::OwnClaims& claims, std::int64_t now,
                                        std::string_view scope, std::string_view id,
                                        std::string_view fingerprint, bool guarded) {
    namespace pg = postgres;
    const auto end_guard = [&] {
        if (guarded) queued_.push_back(control(claim_release_sql_, "claim"));
    };
    // Rarely more than one pass: only when the row we waited for vanished again (purge).
    for (int attempt = 0; attempt < 3; ++attempt) {
        if (guarded) queued_.push_back(control(claim_savepoint_sql_, "claim"));
        auto exchange = tx_exchange(vec(
            own(sql::stmt::claim_insert, "claim", Blob{scope}, Blob{id}, now, Blob{fingerprint})));
        const PGresult* inserted = exchange.result(0);
        if (!pg::succeeded(inserted)) {
            if (pg::sqlstate(inserted) == "55P03") {
                // Another live transaction holds this id past lock_timeout, and PostgreSQL
                // aborted ours: back to the savepoint, or the caller rolls it back.
                ClaimResult result;
                result.status = ClaimStatus::in_progress;
                if (guarded) {
                    queued_.push_back(control(claim_rollback_to_sql_, "claim (lock timeout)"));
                    end_guard();
                    return result;
                }
                tx_error_ = fmt::format(
                    "idem postgres: claim waited {} ms (lock_timeout) for another transaction "
                    "holding the same id",
                    lock_timeout_.count());
                return result;
            }
            fail(exchange.command(0), inserted, "claim");
        }
        if (pg::affected_rows(inserted) == 1) {
            claims.add(scope, id, fingerprint);
            end_guard();
            return ClaimResult{};  // claimed
        }
        // The row exists: committed before, or while we waited (a new statement sees it).
        auto again =
            tx_exchange(vec(own(sql::stmt::claim_outcome, "claim (reading the recorded outcome)",
                                Blob{scope}, Blob{id})));
        if (!pg::succeeded(again.result(0))) {
            fail(again.command(0), again.result(0), "claim (reading the outcome)");
        }
        end_guard();
        if (PQntuples(again.result(0)) > 0) return stored_claim(again.result(0), 0, 0, 1);
    }
    throw store_unavailable(
        "idem postgres: claim: the conflicting claim kept disappearing (purged while claiming?)");
}

inline std::vector<ClaimResult> Driver::claim_many(sql::OwnClaims& claims, std::string_view scope,
                                                   const std::vector<std::string_view>& ids,
                                                   const std::vector<std::string>& fingerprints,
                                                   std::int64_t now) {
    namespace pg = postgres;
    const auto fingerprint = [&](std::size_t i) {
        return fingerprints.empty() ? std::string_view() : std::string_view(fingerprints[i]);
    };
    std::vector<ClaimResult> results(ids.size());
    // The ids to insert: not claimed by this transaction before; each distinct id once, with
    // the index of its first copy (whose fingerprint goes with it), sorted by id.
    std::vector<std::size_t> pending;
    pending.reserve(ids.size());
    const bool had_claims = claims.size() > 0;
    for (std::size_t i = 0; i < ids.size(); ++i) {
        const auto* own = had_claims ? claims.find(scope, ids[i]) : nullptr;
        if (own != nullptr) {
            results[i] = sql::OwnClaims::duplicate_of(*own);
        } else {
            pending.push_back(i);
        }
    }
    if (pending.empty()) return results;
    std::vector<std::size_t> order = pending;
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return ids[a] < ids[b]; });
    std::vector<std::size_t> first(ids.size());  // index of the first copy of ids[i]'s id
    std::vector<std::string_view> distinct;
    std::vector<std::string_view> distinct_fingerprints;
    distinct.reserve(order.size());
    for (std::size_t k = 0; k < order.size(); ++k) {
        const std::size_t i = order[k];
        if (k > 0 && ids[order[k - 1]] == ids[i]) {
            first[i] = first[order[k - 1]];
            continue;
        }
        first[i] = i;
        distinct.push_back(ids[i]);
        if (!fingerprints.empty()) distinct_fingerprints.push_back(fingerprint(i));
    }

    // One round trip (with the queued BEGIN): the savepoint and the INSERT of every id.
    queued_.push_back(control(claim_savepoint_sql_, "claim_many"));
    Command insert = own(sql::stmt::claim_rows, "claim_many", Blob{scope}, now);
    pg::add_bytea_array(insert, distinct);
    pg::add_bytea_array(insert, distinct_fingerprints);
    auto exchange = tx_exchange(vec(std::move(insert)));
    const PGresult* inserted = exchange.result(0);
    if (!pg::succeeded(inserted)) {
        if (pg::sqlstate(inserted) != "55P03") fail(exchange.command(0), inserted, "claim_many");
        // It waited past lock_timeout for an id another transaction holds; which one, the
        // error does not say. Undo the INSERT, then claim one id at a time, each in its own
        // savepoint. A repeated copy of an id held elsewhere is not waited for twice.
        queued_.push_back(control(claim_rollback_to_sql_, "claim_many (lock timeout)"));
        queued_.push_back(control(claim_release_sql_, "claim_many"));
        for (std::size_t i : pending) {
            if (first[i] != i && results[first[i]].status == ClaimStatus::in_progress) {
                results[i] = results[first[i]];
            } else if (const auto* own = claims.find(scope, ids[i])) {
                results[i] = sql::OwnClaims::duplicate_of(*own);
            } else {
                results[i] = insert_claim(claims, now, scope, ids[i], fingerprint(i), true);
            }
        }
        return results;
    }
    queued_.push_back(control(claim_release_sql_, "claim_many"));

    // Claimed: the first copy of each inserted id (added in the batch's order, the order the
    // handler records outcomes in); later copies are this transaction's duplicates.
    std::unordered_set<std::string_view> fresh;
    const int rows = PQntuples(inserted);
    fresh.reserve(static_cast<std::size_t>(rows));
    for (int row = 0; row < rows; ++row) {
        fresh.emplace(PQgetvalue(inserted, row, 0),
                      static_cast<std::size_t>(PQgetlength(inserted, row, 0)));
    }
    std::vector<std::string_view> stored;  // distinct ids that were there already
    for (std::size_t i : pending) {
        if (fresh.count(ids[i]) == 0) {
            if (first[i] == i) stored.push_back(ids[i]);
        } else if (first[i] == i) {
            claims.add(scope, ids[i], fingerprint(i));
            results[i] = ClaimResult{};  // claimed
        } else {
            results[i] = sql::OwnClaims::duplicate_of(*claims.find(scope, ids[i]));
        }
    }
    if (static_cast<std::size_t>(rows) < distinct.size()) {
        // The rest exist: read their outcomes (a new statement: it also sees claims that
        // committed while the INSERT waited).
        Command read = own(sql::stmt::claim_rows_outcome,
                           "claim_many (reading the recorded outcomes)", Blob{scope});
        pg::add_bytea_array(read, stored);
        auto again = tx_exchange(vec(std::move(read)));
        const PGresult* found = again.result(0);
        if (!pg::succeeded(found)) {
            fail(again.command(0), found, "claim_many (reading the outcomes)");
        }
        std::unordered_map<std::string_view, ClaimResult> recorded;
        recorded.reserve(stored.size());
        for (int row = 0; row < PQntuples(found); ++row) {
            recorded.emplace(std::string_view(PQgetvalue(found, row, 0),
                                              static_cast<std::size_t>(PQgetlength(found, row, 0))),
                             stored_claim(found, row, 1, 2));
        }
        for (std::size_t i : pending) {
            if (fresh.count(ids[i]) != 0) continue;
            const auto it = recorded.find(ids[i]);
            if (it != recorded.end()) {
                results[i] = it->second;
            } else if (const auto* own = claims.find(scope, ids[i])) {
                results[i] = sql::OwnClaims::duplicate_of(*own);
            } else {
                // Gone again since the INSERT (purged): claim it like claim() would.
                results[i] = insert_claim(claims, now, scope, ids[i], fingerprint(i), true);
            }
        }
    }
    return results;
}

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
    namespace pg = postgres;
    // Two statements in one round trip: the lock check runs after the advisory lock is taken
    // (a new READ COMMITTED snapshot), so a hold_lock() that committed before is seen, and one
    // that comes later cannot take the advisory lock.
    std::vector<Command> commands;
    commands.push_back(
        own(sql::stmt::lock_advisory, "try_lock", pg::advisory_key("idem lock", key)));
    commands.push_back(own(sql::stmt::lock_live, "try_lock", Blob{key}, now));
    auto exchange = tx_exchange(std::move(commands));
    for (std::size_t k = 0; k < 2; ++k) {
        if (!pg::succeeded(exchange.result(k))) {
            fail(exchange.command(k), exchange.result(k), "try_lock");
        }
    }
    const bool locked = pg::binary_bool(exchange.result(0), 0, 0);
    const bool held = pg::binary_bool(exchange.result(1), 0, 0);
    return locked && !held;
}

inline void Driver::commit() {
    namespace pg = postgres;
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
        if (pg::failed(exchange.results[i].get())) {
            failure = fmt::format("{}: {}", exchange.commands[i].what,
                                  pg::server_message(exchange.results[i].get()));
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
