#pragma once
/// @file
/// @brief idem::SqliteStore: the embedded store on SQLite (WAL, `BEGIN IMMEDIATE`, busy timeout,
/// `INSERT OR IGNORE` claims): the SQL store written once (idem/sql/store.hpp) over
/// idem::sqlite::Driver (idem/sqlite/driver.hpp, with this header the only ones that include
/// <sqlite3.h>).
///
/// @code
/// idem::SqliteStore store{"consumer.db"};            // or the consumer's own sqlite3*
/// auto tx = store.begin();                           // BEGIN IMMEDIATE
/// if (tx.claim("capture-payment", msg_id).status == idem::ClaimStatus::claimed) {
///     tx.execute("INSERT INTO captures(order_id, ref) VALUES (?, ?)", order_id, ref);
///     tx.record_outcome("capture-payment", msg_id, idem::Disposition::processed, {});
///     tx.commit();                                   // claim and rows become visible together
/// }                                                  // otherwise ~Transaction rolls back
/// @endcode
///
/// Schema (created and versioned by the store in `idem_schema`; PRAGMA user_version is left to
/// the application; every time is unix ms from the store's clock):
/// - `idem_claims(scope BLOB, message_id BLOB, claimed_at INTEGER, outcome TEXT, reason TEXT,
///   fingerprint BLOB, PRIMARY KEY(scope, message_id)) WITHOUT ROWID`, indexed on claimed_at;
/// - `idem_dead_letters(id, scope, message_id, delivery_count, reason, payload, created_at)`;
/// - `idem_locks(lock_key BLOB PRIMARY KEY, owner BLOB, expires_at INTEGER) WITHOUT ROWID`: the
///   locks taken with hold_lock();
/// - `idem_outbox(id INTEGER PRIMARY KEY AUTOINCREMENT, destination TEXT, idempotency_key BLOB
///   UNIQUE, payload BLOB, created_at, sent_at, attempts, last_error TEXT, next_attempt_at,
///   lease_until, parked)`, with a partial index on the unsent rows for lease_outbox().
///
/// Scopes, ids, keys and payloads are stored as BLOBs: compare them with a bound BLOB
/// (`idem::Blob{id}`) or `CAST(? AS BLOB)` when querying by hand. lease_outbox() needs SQLite
/// 3.35 or later (`UPDATE … RETURNING`).
///
/// Thread safety: one SqliteStore may be shared by threads. Every operation (begin() up to the
/// end of its Transaction, purge(), find_claim(), ...) holds the store's mutex, so they run one
/// at a time; a Transaction must be finished on the thread that began it. Several processes (or
/// several SqliteStore objects) on one file serialize their writers with `BEGIN IMMEDIATE` and
/// the busy timeout. The connection is opened without SQLite's own mutex: use db() only inside a
/// transaction of this store or while no other thread uses the store.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "idem/config.hpp"
#include "idem/contract/store.hpp"
#include "idem/sql/store.hpp"
#include "idem/sqlite/driver.hpp"
#include "idem/sqlite/options.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The embedded store: claims, outcomes and dead letters in SQLite tables, written in
/// the same transaction (the same `sqlite3*`) as the effect's own rows.
///
/// Its Transaction (sql::basic_transaction<sqlite::Driver>) adds `db()`, the connection, to the
/// members every SQL store has; `execute()` returns sqlite3_changes() as an int, and binds
/// integers (INTEGER), floating point (REAL), strings (TEXT), idem::Blob (BLOB),
/// `nullptr` / `std::nullopt` (NULL) and std::optional of those to `?` / `?N`; prepared statements
/// are cached per SQL string.
///
/// @throws store_unavailable when the database cannot be opened or set up, store_timeout when
/// another writer holds it past the busy timeout, store_error when the database holds a newer
/// idem schema than this code understands, usage_error for misuse (see each member).
class SqliteStore : public sql::basic_store<sqlite::Driver> {
  public:
    /// User SQL strings whose prepared statements are kept; further ones are prepared per call.
    static constexpr std::size_t max_cached_statements = sqlite::Driver::max_cached_statements;

    /// @brief Opens (creating if needed) the database file and owns the connection.
    explicit SqliteStore(const std::string& path, SqliteOptions options = {})
        : basic_store(options.clock, path, options) {}
    /// @brief Uses the consumer's own connection, which it never closes. The store sets the
    /// connection's busy timeout (and WAL, and synchronous when asked).
    /// @throws usage_error when @p db is null or inside a transaction.
    explicit SqliteStore(sqlite3* db, SqliteOptions options = {})
        : basic_store(options.clock, db, options) {}

    /// @brief The connection (owned or borrowed). See the thread-safety note above.
    [[nodiscard]] sqlite3* db() const noexcept { return driver().db(); }

    /// @brief Runs one SQL statement outside any idem transaction (setup, tests) with bound
    /// @p args. @return sqlite3_changes(). @throws store_error with SQLite's message and the SQL.
    template <class... Args>
    int execute(std::string_view sql, const Args&... args) {
        Lock lock(*this, "SqliteStore::execute()");
        return driver().execute(sql::context::alone, sql, args...);
    }
    /// @brief First column of the first row as an integer; empty when no row or NULL.
    template <class... Args>
    std::optional<std::int64_t> query_int(std::string_view sql, const Args&... args) {
        Lock lock(*this, "SqliteStore::query_int()");
        return driver().query_int(sql::context::alone, sql, args...);
    }
    /// @brief First column of the first row as bytes; empty when no row or NULL.
    template <class... Args>
    std::optional<std::string> query_text(std::string_view sql, const Args&... args) {
        Lock lock(*this, "SqliteStore::query_text()");
        return driver().query_text(sql::context::alone, sql, args...);
    }
};

static_assert(check_store<SqliteStore>());

IDEM_END_NAMESPACE
