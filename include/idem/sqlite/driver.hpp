#pragma once
/// @file
/// @brief idem::sqlite::Driver: SQLite under the SQL store written once (sql/store.hpp). It
/// opens or borrows a `sqlite3*`, binds, steps, keeps the prepared statements (idem's, the
/// effect's up to SqliteStore::max_cached_statements, and claim_many()'s multi-row INSERTs),
/// maps SQLite's errors to idem's exceptions (SQLITE_BUSY / SQLITE_LOCKED → store_timeout),
/// runs `BEGIN IMMEDIATE` and sets up WAL; its claims are sqlite/claims.hpp's. Only
/// idem/sqlite/'s headers and idem/store/sqlite.hpp include <sqlite3.h>.

#include <sqlite3.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/blob.hpp"
#include "idem/config.hpp"
#include "idem/contract/store.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"
#include "idem/sql/bind_traits.hpp"
#include "idem/sql/driver.hpp"
#include "idem/sql/own_claims.hpp"
#include "idem/sql/schema.hpp"
#include "idem/sql/statements.hpp"
#include "idem/sql/stored_outcome.hpp"
#include "idem/sqlite/claims.hpp"
#include "idem/sqlite/options.hpp"
#include "idem/sqlite/statement.hpp"

IDEM_BEGIN_NAMESPACE
namespace sqlite {

/// SqliteStore's transaction face: db().
template <class Tx>
class TransactionFace {
  public:
    /// @brief The connection, for the effect's own SQL inside this transaction.
    [[nodiscard]] sqlite3* db() const noexcept {
        const auto* driver = static_cast<const Tx&>(*this).driver_or_null();
        return driver != nullptr ? driver->db() : nullptr;
    }
};

/// The SQLite driver (the contract: sql/driver.hpp); its claims are sqlite::Claims'.
class Driver : public Claims<Driver> {
  public:
    /// Names the backend in messages ("idem sqlite: ...").
    static constexpr std::string_view name = "sqlite";
    /// Names the store class in messages.
    static constexpr std::string_view store_class = "SqliteStore";
    /// User SQL strings whose prepared statements are kept; further ones are prepared per call.
    static constexpr std::size_t max_cached_statements = 256;
    /// The transaction's SQLite members (db()), mixed into basic_transaction.
    template <class Tx>
    using transaction_face = TransactionFace<Tx>;
    /// A result row, as run() and query() pass it to their callback.
    using Row = sqlite::Row;

    /// Opens (creating if needed) the database file and owns the connection.
    Driver(const std::string& path, const SqliteOptions& options)
        : owned_(true), busy_timeout_(options.busy_timeout), path_(path), options_(options) {
        if (path.find('\0') != std::string::npos) {
            throw usage_error("idem sqlite: the database path contains a NUL byte");
        }
        open_owned();
    }

    /// Uses the consumer's own connection, which it never closes.
    Driver(sqlite3* db, const SqliteOptions& options)
        : db_(db), owned_(false), busy_timeout_(options.busy_timeout) {
        if (db_ == nullptr) {
            throw usage_error("idem sqlite: SqliteStore needs a connection, got null");
        }
        if (sqlite3_get_autocommit(db_) == 0) {
            db_ = nullptr;
            throw usage_error(
                "idem sqlite: the borrowed connection is inside a transaction; construct the "
                "SqliteStore outside any transaction (it may create its tables and switch to "
                "WAL)");
        }
        start(options);
    }

    Driver(const Driver&) = delete;
    Driver& operator=(const Driver&) = delete;
    /// Finalizes the statements; closes the connection only if the driver opened it.
    ~Driver() { close_noexcept(); }

    /// The connection (owned or borrowed); null once closed or forgotten.
    [[nodiscard]] sqlite3* db() const noexcept { return db_; }

    // -- fork() and ping (sql/driver.hpp) --------------------------------------------------

    /// True when the driver opened the database file itself (a path), false for a borrowed
    /// connection.
    [[nodiscard]] bool owns_connection() const noexcept { return owned_; }
    /// In a fork()ed child: drops the parent's connection (forget_inherited) and opens the
    /// file again, set up as the first time (busy timeout, WAL, synchronous).
    void reopen_after_fork() {
        forget_inherited();
        open_owned();
    }
    /// Drops a connection opened in another process without checkpointing or writing. Idle
    /// (the usual case) it is closed with SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE: no checkpoint, no
    /// WAL deletion, and the file's lock bookkeeping this process copied from the parent is
    /// released, so the new connection takes SQLite's locks for real (POSIX record locks belong
    /// to a process and are not inherited: closing touches none of the parent's). Inside a
    /// transaction (fork() while one was open) closing would roll it back into the parent's
    /// file: the connection and its statements are abandoned instead.
    void forget_inherited() noexcept {
        if (db_ == nullptr) return;
        if (owned_ && !tx_open_ && sqlite3_get_autocommit(db_) != 0) {
            sqlite3_db_config(db_, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1, nullptr);
            close_noexcept();
            return;
        }
        for (sqlite3_stmt*& stmt : own_)
            stmt = nullptr;
        for (auto& entry : cache_)
            entry.second->stmt = nullptr;
        cache_.clear();
        for (auto* slots : {&claim_rows_, &claim_rows_returning_}) {
            for (auto& statement : *slots) {
                if (statement) statement->stmt = nullptr;
                statement.reset();
            }
        }
        db_ = nullptr;
        end_transaction();
        rollback_pending_ = false;
    }
    /// After each purge batch (sql/purge.hpp), on the purge's own connection: a PASSIVE
    /// checkpoint, so the pages the batch wrote to the WAL go back to the database file at the
    /// purge's cost, not in the next consumer commit that crosses wal_autocheckpoint. It never
    /// waits for a lock; a checkpoint that cannot run now is left to the next.
    void after_purge_batch() noexcept {
        if (db_ != nullptr)
            (void)sqlite3_wal_checkpoint_v2(db_, nullptr, SQLITE_CHECKPOINT_PASSIVE, nullptr,
                                            nullptr);
    }
    /// BEGIN IMMEDIATE + ROLLBACK: the database is there and writable within the busy timeout.
    void ping(std::string_view what) {
        open_transaction(what);
        const bool ok = rollback_noexcept();
        end_transaction();
        if (!ok) {
            throw store_unavailable(
                fmt::format("idem sqlite: {}: ROLLBACK failed: {}", what, last_error()));
        }
    }

    /// TEXT values are bound as they are: SQLite stores any bytes.
    static std::string_view text(std::string_view value) noexcept { return value; }
    /// Every outbox intent fits SQLite's columns: nothing to refuse.
    static void check_outbox(const OutboxIntent&) noexcept {}

    // -- outside a transaction ------------------------------------------------------------

    /// One statement outside a transaction (sql/driver.hpp): a read as it is, a write in its own
    /// BEGIN IMMEDIATE ... COMMIT, so it waits for other writers with the busy timeout. @return the
    /// rows changed. @throws store_timeout past the busy timeout, store_unavailable for other
    /// SQLite errors, commit_failed when the COMMIT is refused.
    template <class OnRow, class... Args>
    std::int64_t run(sql::stmt which, std::string_view what, sql::access mode, OnRow&& on_row,
                     const Args&... args) {
        if (mode == sql::access::read) return step_rows(which, what, on_row, args...);
        // A write in its own BEGIN IMMEDIATE: it waits for other writers with the busy timeout
        // instead of failing on a stale WAL snapshot.
        open_transaction("begin()");
        std::int64_t changed = 0;
        try {
            changed = step_rows(which, what, on_row, args...);
            commit();
        } catch (...) {
            rollback_noexcept();
            end_transaction();
            throw;
        }
        end_transaction();
        return changed;
    }

    /// Takes, renews or takes over (when expired) the idem_locks row of @p key for @p owner until
    /// @p expires_ms, committed at once. @return whether @p owner holds it now.
    bool hold_lock(std::string_view key, std::string_view owner, std::int64_t expires_ms,
                   std::int64_t now_ms) {
        // Inserts a free lock; takes over an expired one or renews our own; leaves another
        // owner's live lock alone (the DO UPDATE's WHERE is false: no change).
        return run(sql::stmt::lock_hold, "hold_lock", sql::access::write, sql::no_rows{}, Blob{key},
                   Blob{owner}, expires_ms, now_ms) == 1;
    }

    // -- the transaction ------------------------------------------------------------------

    /// BEGIN IMMEDIATE: this connection becomes the database's one writer until the transaction
    /// ends. @throws as sql/driver.hpp's begin().
    void begin(std::string_view what) { open_transaction(what); }

    /// A write inside the transaction, run at once (SQLite has no pipeline).
    template <class... Args>
    void write(sql::stmt which, std::string_view what, const Args&... args) {
        step_own(which, what, args...);
    }

    /// One statement inside the transaction; @p on_row per result row. @return the rows changed.
    template <class OnRow, class... Args>
    std::int64_t query(sql::stmt which, std::string_view what, OnRow&& on_row,
                       const Args&... args) {
        return step_rows(which, what, on_row, args...);
    }

    /// Whether the transaction is still open: SQLite may have rolled it back after an error (lost,
    /// with the error as @p cause), or the effect ended it with its own COMMIT / ROLLBACK (ended).
    sql::tx_health health(bool after_user_sql, std::string& cause) const {
        if (after_user_sql || sqlite3_get_autocommit(db_) == 0) return sql::tx_health::ok;
        // The transaction ended without us: SQLite rolled it back after an error (disk full,
        // I/O error), or the effect ran COMMIT/ROLLBACK through the connection.
        if (tx_error_.empty()) return sql::tx_health::ended;
        cause = fmt::format(
            "SQLite rolled the transaction back after an earlier error ({}); nothing it wrote is "
            "stored",
            tx_error_);
        return sql::tx_health::lost;
    }

    /// The overlap lock: the transaction's write lock already excludes other transactions, so only
    /// an unexpired hold_lock() row of @p key refuses it.
    bool try_lock(std::string_view key, std::int64_t now_ms) {
        // Inside BEGIN IMMEDIATE this connection is the only writer until the transaction
        // ends, so the write lock is the overlap lock: only an unexpired hold_lock() refuses it.
        bool held = false;
        step_rows(
            sql::stmt::lock_live, "try_lock", [&](const Row&) { held = true; }, Blob{key}, now_ms);
        return !held;
    }

    /// SAVEPOINT idem_effect.
    void savepoint() { step_own(sql::stmt::savepoint, "savepoint"); }
    /// ROLLBACK TO idem_effect, then RELEASE it.
    void rollback_to_savepoint() {
        step_own(sql::stmt::rollback_to_savepoint, "rollback_to_savepoint");
        step_own(sql::stmt::release_savepoint, "rollback_to_savepoint (release)");
    }
    /// RELEASE idem_effect.
    void release_savepoint() { step_own(sql::stmt::release_savepoint, "release_savepoint"); }

    /// COMMIT. @throws commit_failed when SQLite refuses it (all rolled back).
    void commit() {
        sqlite3_stmt* stmt = prepared(sql::stmt::commit_tx);
        const int rc = sqlite3_step(stmt);
        if (rc == SQLITE_DONE) {
            sqlite3_reset(stmt);
            return;
        }
        std::string message =
            fmt::format("idem sqlite: commit failed: {}; rolled back", error_text(db_, rc));
        sqlite3_reset(stmt);
        if (!rollback_noexcept()) message += " (and the rollback failed too)";
        throw commit_failed(message);
    }

    /// ROLLBACK when a transaction is open. @return true when the connection is outside a
    /// transaction now.
    bool rollback_noexcept() noexcept {
        if (sqlite3_get_autocommit(db_) == 0) {
            sqlite3_stmt*& stmt = own_[index(sql::stmt::rollback_tx)];
            if (stmt == nullptr) {
                sqlite3_prepare_v3(db_, "ROLLBACK", -1, SQLITE_PREPARE_PERSISTENT, &stmt, nullptr);
            }
            if (stmt != nullptr) {
                sqlite3_step(stmt);
                sqlite3_reset(stmt);
            } else {
                sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
            }
        }
        rollback_pending_ = sqlite3_get_autocommit(db_) == 0;
        return !rollback_pending_;
    }

    /// SQLite's message for the connection's last failure.
    [[nodiscard]] std::string last_error() const { return sqlite3_errmsg(db_); }

    /// Forgets the transaction's state (open, its first error).
    void end_transaction() noexcept {
        tx_open_ = false;
        tx_error_.clear();
    }

    // -- the effect's own SQL -------------------------------------------------------------

    /// The effect's own statement on this connection (inside the transaction: SQLite has one
    /// connection per store, so sql::context is ignored). @return the rows changed. @throws
    /// store_timeout when busy, store_error naming the SQL, usage_error for a wrong parameter
    /// count.
    template <class... Args>
    int execute(sql::context, std::string_view sql, const Args&... args) {
        return execute_impl(Kind::user, true, sql, args...);
    }
    /// The first column of the first row of the effect's query, as an integer; nullopt without a
    /// row. @throws as execute().
    template <class... Args>
    std::optional<std::int64_t> query_int(sql::context, std::string_view sql, const Args&... args) {
        return first_value<std::int64_t>(
            Kind::user, true, sql, [](sqlite3_stmt* s) { return sqlite3_column_int64(s, 0); },
            args...);
    }
    /// The first column of the first row of the effect's query, as text; nullopt without a row.
    /// @throws as execute().
    template <class... Args>
    std::optional<std::string> query_text(sql::context, std::string_view sql, const Args&... args) {
        return first_value<std::string>(
            Kind::user, true, sql, [](sqlite3_stmt* s) { return column_string(s, 0); }, args...);
    }

    // -- the schema -----------------------------------------------------------------------

    /// The recorded schema version; nullopt when the idem_schema table does not exist.
    std::optional<std::int64_t> stored_schema_version() {
        const auto tables = first_value<std::int64_t>(
            Kind::idem, false,
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1",
            [](sqlite3_stmt* s) { return sqlite3_column_int64(s, 0); }, "idem_schema");
        if (tables.value_or(0) == 0) return std::nullopt;
        return read_schema_version();
    }
    /// BEGIN IMMEDIATE (two processes opening a fresh file serialize here) and the idem_schema
    /// table.
    void begin_schema_change() {
        // BEGIN IMMEDIATE: two processes opening a fresh file at once serialize here.
        open_transaction("creating the idem schema");
        execute_ddl("CREATE TABLE IF NOT EXISTS idem_schema(version INTEGER NOT NULL)");
    }
    /// One DDL statement of the migration.
    void execute_ddl(std::string_view sql) { execute_impl(Kind::idem, false, sql); }
    /// The version in idem_schema, inside begin_schema_change().
    std::optional<std::int64_t> read_schema_version() {
        return first_value<std::int64_t>(
            Kind::idem, false, "SELECT max(version) FROM idem_schema",
            [](sqlite3_stmt* s) { return sqlite3_column_int64(s, 0); });
    }
    /// Records @p version as the schema's.
    void write_schema_version(int version) {
        execute_impl(Kind::idem, false, "DELETE FROM idem_schema");
        execute_impl(Kind::idem, false, "INSERT INTO idem_schema(version) VALUES (?1)", version);
    }
    /// Commits the migration.
    void commit_schema_change() {
        step_own(sql::stmt::commit_tx, "committing the idem schema");
        end_transaction();
    }
    /// "the database '<file>'", for messages about the schema.
    [[nodiscard]] std::string schema_location() const {
        const char* file = sqlite3_db_filename(db_, "main");
        if (file == nullptr || *file == '\0') return "the database (in-memory database)";
        return fmt::format("the database '{}'", file);
    }
    /// Where else the tables could be, for messages: another database file.
    [[nodiscard]] std::string_view schema_elsewhere() const noexcept {
        return "another database file";
    }
    /// The DDL from @p from_version to the current one (sql/schema.hpp).
    [[nodiscard]] std::vector<std::string> schema_ddl(int from_version) const {
        return sql::sqlite_schema_ddl(from_version);
    }

  private:
    friend class Claims<Driver>;

    enum class Kind { idem, user };  // which exception a non-busy SQLite error becomes

    struct Cached {
        std::string sql;
        sqlite3_stmt* stmt = nullptr;
        Cached() = default;
        Cached(const Cached&) = delete;
        Cached& operator=(const Cached&) = delete;
        ~Cached() { sqlite3_finalize(stmt); }
    };

    struct Prepared {
        sqlite3_stmt* stmt = nullptr;
        bool one_off = false;
    };

    static constexpr std::size_t index(sql::stmt which) noexcept {
        return static_cast<std::size_t>(which);
    }

    void start(const SqliteOptions& options) {
        try {
            setup(options);
        } catch (...) {
            close_noexcept();
            throw;
        }
    }

    void setup(const SqliteOptions& options);
    void open_owned();
    void open_transaction(std::string_view what);
    void close_noexcept() noexcept;
    /// The owned connection's busy handler. SQLite's own (sqlite3_busy_timeout) sleeps 1, 2, 5,
    /// 10, 15, 20, 25 ms ... between tries, so a writer that meets a lock held for 3 ms waits 8:
    /// beside a paced purge or another worker the waiting, not the lock, cost most. This one
    /// sleeps 50 us, doubling to 1 ms, until the busy timeout has passed.
    static int on_busy(void* driver, int tries) noexcept;

    [[noreturn]] void fail(int rc, std::string_view what, Kind kind, std::string_view sql = {});
    sqlite3_stmt* prepared(sql::stmt which);
    Prepared prepare(std::string_view sql, bool cache, Kind kind);
    [[nodiscard]] bool has_more_statements(std::string_view rest) const;

    template <class... Args>
    void bind_all(sqlite3_stmt* stmt, std::string_view sql, Kind kind, const Args&... args);
    /// Steps an idem statement to the end; returns sqlite3_changes().
    template <class... Args>
    int step_own(sql::stmt which, std::string_view what, const Args&... args);
    /// Steps an idem statement, calling on_row(Row) per row; returns sqlite3_changes().
    template <class OnRow, class... Args>
    std::int64_t step_rows(sql::stmt which, std::string_view what, OnRow&& on_row,
                           const Args&... args);
    template <class... Args>
    int execute_impl(Kind kind, bool cache, std::string_view sql, const Args&... args);
    template <class T, class Read, class... Args>
    std::optional<T> first_value(Kind kind, bool cache, std::string_view sql, Read read,
                                 const Args&... args);

    sqlite3_stmt* claim_rows_statement(std::size_t rows, bool returning);

    sqlite3* db_ = nullptr;
    bool owned_ = false;
    std::chrono::milliseconds busy_timeout_;
    std::chrono::steady_clock::time_point busy_since_{};  // on_busy(): this wait's first try
    std::string path_;       // owned: what reopen_after_fork() opens again
    SqliteOptions options_;  // owned: and how it sets it up
    sql::statement_table statements_ = sql::sqlite_statements();
    std::array<sqlite3_stmt*, sql::statement_count> own_{};
    std::unordered_map<std::string_view, std::unique_ptr<Cached>> cache_;
    /// claim_many()'s multi-row INSERTs, one per row count (1..claim_rows_max): plain, and with
    /// RETURNING (which tells the inserted ids apart, at about a fifth more per row).
    static constexpr std::size_t claim_rows_max = 64;
    std::array<std::unique_ptr<Cached>, claim_rows_max + 1> claim_rows_{};
    std::array<std::unique_ptr<Cached>, claim_rows_max + 1> claim_rows_returning_{};
    bool tx_open_ = false;  // a transaction of this driver is running
    std::string tx_error_;  // first SQLite failure inside it (explains an automatic rollback)
    bool rollback_pending_ = false;  // our ROLLBACK failed: the connection is still in our tx
};

// ---------------------------------------------------------------------------------------------

inline int Driver::on_busy(void* driver, int tries) noexcept {
    auto& self = *static_cast<Driver*>(driver);
    const auto now = std::chrono::steady_clock::now();
    if (tries == 0) self.busy_since_ = now;
    if (now - self.busy_since_ >= self.busy_timeout_) return 0;
    const int doublings = tries < 5 ? tries : 5;
    std::this_thread::sleep_for(
        std::min(std::chrono::microseconds(50 << doublings), std::chrono::microseconds(1000)));
    return 1;
}
inline void Driver::close_noexcept() noexcept {
    if (db_ == nullptr) return;
    for (sqlite3_stmt*& stmt : own_) {
        sqlite3_finalize(stmt);
        stmt = nullptr;
    }
    cache_.clear();
    for (auto& statement : claim_rows_)
        statement.reset();
    for (auto& statement : claim_rows_returning_)
        statement.reset();
    if (owned_) sqlite3_close_v2(db_);
    db_ = nullptr;
}
inline void Driver::open_owned() {
    sqlite3* db = nullptr;
    const int rc =
        sqlite3_open_v2(path_.c_str(), &db,
                        SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
    if (rc != SQLITE_OK) {
        std::string message =
            fmt::format("idem sqlite: cannot open '{}': {}", path_, error_text(db, rc));
        sqlite3_close_v2(db);
        throw store_unavailable(message);
    }
    db_ = db;
    start(options_);
}

inline void Driver::setup(const SqliteOptions& options) {
    const auto ms = options.busy_timeout.count();
    if (owned_ && ms > 0) {
        sqlite3_busy_handler(db_, &Driver::on_busy, this);
    } else {
        // A borrowed connection keeps SQLite's own handler: it outlives this driver.
        sqlite3_busy_timeout(db_, ms <= 0 ? 0 : ms >= INT_MAX ? INT_MAX : static_cast<int>(ms));
    }
    if (options.wal) {
        // Switching to WAL needs an exclusive lock, and SQLite may answer SQLITE_BUSY at once
        // instead of calling the busy handler (another connection opening the same fresh file):
        // retry until the busy timeout has passed.
        const auto deadline = std::chrono::steady_clock::now() + options.busy_timeout;
        for (;;) {
            try {
                // Answers the resulting mode: 'wal', or 'memory' for an in-memory database.
                (void)first_value<std::string>(Kind::idem, false, "PRAGMA journal_mode=WAL",
                                               [](sqlite3_stmt* s) { return column_string(s, 0); });
                break;
            } catch (const store_timeout&) {
                if (std::chrono::steady_clock::now() >= deadline) throw;
                std::this_thread::sleep_for(std::chrono::milliseconds(2));
            }
        }
    }
    if (options.synchronous) {
        // A PRAGMA takes no parameters; the text comes from this fixed set, never from a value.
        const char* sql = "PRAGMA synchronous=FULL";
        switch (*options.synchronous) {
            case Synchronous::off:
                sql = "PRAGMA synchronous=OFF";
                break;
            case Synchronous::normal:
                sql = "PRAGMA synchronous=NORMAL";
                break;
            case Synchronous::full:
                sql = "PRAGMA synchronous=FULL";
                break;
            case Synchronous::extra:
                sql = "PRAGMA synchronous=EXTRA";
                break;
        }
        execute_impl(Kind::idem, false, sql);
    }
    if (options.mmap_size > 0) {
        // A number formatted here: a PRAGMA takes no parameters.
        execute_impl(Kind::idem, false, fmt::format("PRAGMA mmap_size={}", options.mmap_size));
    }
}

inline void Driver::open_transaction(std::string_view what) {
    if (sqlite3_get_autocommit(db_) == 0) {
        if (rollback_pending_) rollback_noexcept();
        if (sqlite3_get_autocommit(db_) == 0) {
            throw usage_error(fmt::format(
                "idem sqlite: {}: the connection is already inside a transaction. idem needs its "
                "own BEGIN IMMEDIATE so the claim and the effect commit together: commit or roll "
                "back your transaction first, and write the effect's rows through the idem "
                "transaction (Transaction::execute() or Transaction::db())",
                what));
        }
    }
    sqlite3_stmt* stmt = prepared(sql::stmt::begin_tx);
    int rc = sqlite3_step(stmt);
    if (rc != SQLITE_DONE) {
        std::string message = error_text(db_, rc);
        sqlite3_reset(stmt);
        if (is_busy(rc)) {
            throw store_timeout(
                fmt::format("idem sqlite: {}: BEGIN IMMEDIATE timed out after {} ms: {}. Another "
                            "connection holds the write lock; shorten its transactions or raise "
                            "SqliteOptions::busy_timeout",
                            what, busy_timeout_.count(), message));
        }
        throw store_unavailable(
            fmt::format("idem sqlite: {}: BEGIN IMMEDIATE failed: {}", what, message));
    }
    sqlite3_reset(stmt);
    tx_open_ = true;
    tx_error_.clear();
}

inline void Driver::fail(int rc, std::string_view what, Kind kind, std::string_view sql) {
    std::string message = fmt::format("idem sqlite: {} failed: {}", what, error_text(db_, rc));
    if (!sql.empty()) message += fmt::format("; SQL: {}", sql);
    if (tx_open_ && tx_error_.empty()) tx_error_ = message;
    if (is_busy(rc)) throw store_timeout(message);
    if (kind == Kind::user) throw store_error(message);
    throw store_unavailable(message);
}

inline sqlite3_stmt* Driver::prepared(sql::stmt which) {
    sqlite3_stmt*& stmt = own_[index(which)];
    if (stmt == nullptr) {
        const int rc = sqlite3_prepare_v3(db_, statements_[which].c_str(), -1,
                                          SQLITE_PREPARE_PERSISTENT, &stmt, nullptr);
        if (rc != SQLITE_OK) {
            sqlite3_finalize(stmt);
            stmt = nullptr;
            fail(rc, "preparing an idem statement", Kind::idem, statements_[which].c_str());
        }
    }
    return stmt;
}

inline bool Driver::has_more_statements(std::string_view rest) const {
    if (rest.find_first_not_of(" \t\r\n;") == std::string_view::npos) return false;
    sqlite3_stmt* stmt = nullptr;
    const int rc =
        sqlite3_prepare_v3(db_, rest.data(), static_cast<int>(rest.size()), 0, &stmt, nullptr);
    const bool more = rc != SQLITE_OK || stmt != nullptr;  // a comment alone prepares to null
    sqlite3_finalize(stmt);
    return more;
}

inline Driver::Prepared Driver::prepare(std::string_view sql, bool cache, Kind kind) {
    if (cache) {
        const auto found = cache_.find(sql);
        if (found != cache_.end()) return {found->second->stmt, false};
    }
    if (sql.size() > static_cast<std::size_t>(INT_MAX)) {
        throw usage_error("idem sqlite: SQL text longer than 2 GiB");
    }
    const bool keep = cache && cache_.size() < max_cached_statements;
    sqlite3_stmt* stmt = nullptr;
    const char* tail = nullptr;
    const int rc = sqlite3_prepare_v3(db_, sql.data(), static_cast<int>(sql.size()),
                                      keep ? SQLITE_PREPARE_PERSISTENT : 0, &stmt, &tail);
    if (rc != SQLITE_OK) {
        sqlite3_finalize(stmt);
        fail(rc, "preparing SQL", kind, sql);
    }
    if (stmt == nullptr) {
        throw usage_error(fmt::format("idem sqlite: no SQL statement in '{}'", sql));
    }
    const std::string_view rest(tail, static_cast<std::size_t>(sql.data() + sql.size() - tail));
    if (has_more_statements(rest)) {
        sqlite3_finalize(stmt);
        throw usage_error(fmt::format(
            "idem sqlite: execute()/query_*() run exactly one statement, but the SQL continues "
            "after the first one; split it into several calls. SQL: {}",
            sql));
    }
    if (!keep) return {stmt, true};
    auto entry = std::make_unique<Cached>();
    entry->stmt = stmt;  // finalized by ~Cached from here on, even if the copy below throws
    entry->sql.assign(sql.data(), sql.size());
    const std::string_view key = entry->sql;
    cache_.emplace(key, std::move(entry));
    return {stmt, false};
}

template <class... Args>
void Driver::bind_all(sqlite3_stmt* stmt, std::string_view sql, Kind kind, const Args&... args) {
    const int expected = sqlite3_bind_parameter_count(stmt);
    if (expected != static_cast<int>(sizeof...(Args))) {
        throw usage_error(fmt::format(
            "idem sqlite: the SQL has {} parameter(s) but {} value(s) were given; SQL: {}",
            expected, sizeof...(Args), sql));
    }
    [[maybe_unused]] int index = 0;
    [[maybe_unused]] int rc = SQLITE_OK;
    if (!(... && ((rc = bind_value(stmt, ++index, args)) == SQLITE_OK))) {
        fail(rc, fmt::format("binding parameter {}", index), kind, sql);
    }
}

template <class... Args>
int Driver::step_own(sql::stmt which, std::string_view what, const Args&... args) {
    sqlite3_stmt* stmt = prepared(which);
    StatementUse use(stmt, false);
    bind_all(stmt, statements_[which].c_str(), Kind::idem, args...);
    const int rc = sqlite3_step(stmt);
    if (rc != SQLITE_DONE && rc != SQLITE_ROW) fail(rc, what, Kind::idem);
    return sqlite3_changes(db_);
}

template <class OnRow, class... Args>
std::int64_t Driver::step_rows(sql::stmt which, std::string_view what, OnRow&& on_row,
                               const Args&... args) {
    sqlite3_stmt* stmt = prepared(which);
    StatementUse use(stmt, false);
    bind_all(stmt, statements_[which], Kind::idem, args...);
    int rc = SQLITE_ROW;
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW)
        on_row(Row(stmt));
    if (rc != SQLITE_DONE) fail(rc, what, Kind::idem);
    return sqlite3_changes(db_);
}

template <class... Args>
int Driver::execute_impl(Kind kind, bool cache, std::string_view sql, const Args&... args) {
    const Prepared prepared = prepare(sql, cache, kind);
    StatementUse use(prepared.stmt, prepared.one_off);
    bind_all(prepared.stmt, sql, kind, args...);
    int rc = SQLITE_ROW;
    while (rc == SQLITE_ROW)
        rc = sqlite3_step(prepared.stmt);
    if (rc != SQLITE_DONE) fail(rc, "execute", kind, sql);
    return sqlite3_changes(db_);
}

template <class T, class Read, class... Args>
std::optional<T> Driver::first_value(Kind kind, bool cache, std::string_view sql, Read read,
                                     const Args&... args) {
    const Prepared prepared = prepare(sql, cache, kind);
    StatementUse use(prepared.stmt, prepared.one_off);
    bind_all(prepared.stmt, sql, kind, args...);
    const int rc = sqlite3_step(prepared.stmt);
    if (rc == SQLITE_DONE) return std::nullopt;
    if (rc != SQLITE_ROW) fail(rc, "query", kind, sql);
    if (sqlite3_column_type(prepared.stmt, 0) == SQLITE_NULL) return std::nullopt;
    return read(prepared.stmt);
}

inline sqlite3_stmt* Driver::claim_rows_statement(std::size_t rows, bool returning) {
    auto& slot = (returning ? claim_rows_returning_ : claim_rows_).at(rows);
    if (slot) return slot->stmt;
    std::string sql =
        "INSERT OR IGNORE INTO idem_claims(scope, message_id, claimed_at, outcome, reason, "
        "fingerprint) VALUES ";
    for (std::size_t i = 0; i < rows; ++i) {
        sql += fmt::format("{}(?1, ?{}, ?2, 'processed', '', ?{})", i == 0 ? "" : ", ", 3 + 2 * i,
                           4 + 2 * i);
    }
    if (returning) sql += " RETURNING message_id";
    auto entry = std::make_unique<Cached>();
    entry->sql = std::move(sql);
    const int rc = sqlite3_prepare_v3(db_, entry->sql.c_str(), static_cast<int>(entry->sql.size()),
                                      SQLITE_PREPARE_PERSISTENT, &entry->stmt, nullptr);
    if (rc != SQLITE_OK) fail(rc, "preparing claim_many", Kind::idem);
    slot = std::move(entry);
    return slot->stmt;
}

}  // namespace sqlite
IDEM_END_NAMESPACE
