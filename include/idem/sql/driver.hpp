#pragma once
/// @file
/// @brief What a SQL driver provides to the SQL store written once (idem::sql::basic_store and
/// basic_transaction in sql/store.hpp). A new SQL backend (MySQL / MariaDB next) is one driver
/// class in `include/idem/<backend>/driver.hpp`, its statement texts in sql/statements.hpp and
/// its DDL in sql/schema.hpp, and a thin face in `include/idem/store/<backend>.hpp`.
///
/// A driver is constructed by the face with its own arguments (a path or a connection, the
/// options) and connects in its constructor; its destructor closes what it opened. The core then
/// runs sql::ensure_schema() on it.
///
/// The driver is a template parameter (static dispatch: no virtual call, no std::function per
/// statement); the core calls the members below and nothing else. The core owns the mutex (and
/// the owner thread that refuses re-entry), the clock, the transaction's state (open / finish /
/// commit / rollback RAII, the destructor never throws), the savepoint depth, the claims the
/// transaction made (sql::OwnClaims), the decoding of rows into ClaimRecord / DeadLetter /
/// OutboxRow, purge in batches, the versioned schema (sql/schema.hpp) and every usage check. The
/// driver owns the connection and runs statements. Every call into the driver is made with the
/// store's mutex held, so the driver needs no locking of its own.
///
/// @code
/// class Driver {
///   public:
///     // -- names, for messages: "idem <name>: ..." and "... of this <store_class> ..."
///     static constexpr std::string_view name = "mysql";
///     static constexpr std::string_view store_class = "MysqlStore";
///     // The transaction's backend-specific members (the connection accessor: SQLite's db(),
///     // PostgreSQL's conn()), mixed in as a base of basic_transaction<Driver> (CRTP). It may
///     // call the transaction's private open(what) (→ Driver&, after the usual checks) and
///     // driver_or_null() (null when moved-from): it is the transaction's friend.
///     template <class Tx> using transaction_face = MysqlTransactionFace<Tx>;
///
///     // -- rows. A Row is a cheap view of the current result row, valid inside the callback:
///     //    std::string bytes(int col) const;   // BLOB / BYTEA / TEXT, binary-safe; NULL → ""
///     //    std::int64_t int64(int col) const;  // integer columns (and booleans as 0 / 1)
///     //    bool boolean(int col) const;
///     //    bool is_null(int col) const;
///     using Row = ...;
///
///     // -- values. What a stored TEXT value (a reason, a last error) is bound as: the view
///     //    itself, or a copy made valid for the column (PostgreSQL: valid UTF-8).
///     static auto text(std::string_view value);
///     // add_outbox(): refuse (usage_error) what the column cannot store; may do nothing.
///     static void check_outbox(const OutboxIntent& intent);
///
///     // -- statements of sql/statements.hpp, by sql::stmt; parameters are bound in the order
///     //    statements.hpp documents. Bound types: std::string_view / std::string (TEXT),
///     //    idem::Blob (binary), std::int64_t, bool.
///     //
///     // Outside any transaction (the core's store-level operations). access::read: one
///     // statement as it is. access::write: one statement committed on its own, atomically
///     // (SQLite: BEGIN IMMEDIATE ... COMMIT; PostgreSQL, MySQL: autocommit). Calls on_row(Row)
///     // for each result row. @return the affected rows (writes; RETURNING rows count too).
///     template <class OnRow, class... Args>
///     std::int64_t run(sql::stmt which, std::string_view what, sql::access mode, OnRow&& on_row,
///                      const Args&... args);
///
///     // -- the transaction
///     // Starts one (may defer sending BEGIN until the first statement). @throws usage_error when
///     // the connection is already inside a transaction the store did not start,
///     // store_timeout when another writer holds the database past the busy timeout,
///     // store_unavailable when the server is gone (and reconnecting failed).
///     void begin(std::string_view what);
///     // Inside: a write whose answer is not needed now. May be queued and sent with the next
///     // statement or the commit (PostgreSQL pipelines it); its failure then surfaces there.
///     template <class... Args> void write(sql::stmt which, std::string_view what, const Args&...);
///     // Inside: one statement answered now; on_row per result row; @return the affected rows.
///     template <class OnRow, class... Args>
///     std::int64_t query(sql::stmt which, std::string_view what, OnRow&& on_row, const Args&...);
///     // Before each transaction member: is the transaction still there? (Set `cause` to the
///     // first failure when the server rolled it back.) after_user_sql: the check after the
///     // effect's own execute() / query_*() (a driver that cannot tell cheaply answers ok).
///     // The core then throws "idem <name>: <what> failed: <cause>" (store_unavailable, or
///     // commit_failed from commit()), or usage_error for `ended`.
///     sql::tx_health health(bool after_user_sql, std::string& cause) const;
///     // The claim of an id this transaction does not hold yet (the core asked OwnClaims first):
///     // insert it (sql::stmt::claim_insert: 'processed', '' — see own_claims.hpp); when the
///     // row went in, own.add(scope, id, fingerprint) and return ClaimStatus::claimed. When it was
///     // there, read it (claim_outcome) and return sql::stored_duplicate(outcome, fingerprint,
///     // name). A wait on another transaction's row past the lock timeout (PostgreSQL 55P03,
///     // MySQL 1205 ER_LOCK_WAIT_TIMEOUT) is ClaimStatus::in_progress, not an exception; the
///     // transaction may be left unusable (the driver then makes commit() fail).
///     ClaimResult claim(sql::OwnClaims& own, std::string_view scope, std::string_view id,
///                       std::string_view fingerprint, std::int64_t now_ms);
///     // The same for many ids, results in order as claim() one by one would give them: the
///     // first copy of a repeated id is claimed, later ones are own duplicates. The core checked
///     // that fingerprints is empty or one per id. sql::claim_each(driver, ...) is a correct
///     // (one statement per id) implementation to start with.
///     std::vector<ClaimResult> claim_many(sql::OwnClaims& own, std::string_view scope,
///                                         const std::vector<std::string_view>& ids,
///                                         const std::vector<std::string>& fingerprints,
///                                         std::int64_t now_ms);
///     // Overlap lock inside the transaction: false when another transaction or an unexpired
///     // hold_lock() row holds key (sql::stmt::lock_live).
///     bool try_lock(std::string_view key, std::int64_t now_ms);
///     // Outside a transaction: take / renew / take over the idem_locks row (lock_hold),
///     // committed at once. @return whether it is now ours.
///     bool hold_lock(std::string_view key, std::string_view owner, std::int64_t expires_ms,
///                    std::int64_t now_ms);
///     void savepoint();                 // SAVEPOINT idem_effect (nests)
///     void rollback_to_savepoint();     // ROLLBACK TO idem_effect + RELEASE idem_effect
///     void release_savepoint();         // RELEASE idem_effect
///     // Sends what is queued and COMMIT. On refusal: rolls back, throws commit_failed. Lost
///     // connection during COMMIT: throws store_unavailable (the outcome is unknown). The core
///     // ends its transaction object either way.
///     void commit();
///     // Rolls back whatever is open; true when the connection is outside a transaction now.
///     bool rollback_noexcept() noexcept;
///     [[nodiscard]] std::string last_error() const;  // for "rollback failed: <...>"
///     // The transaction object ended (committed or rolled back): forget per-transaction state.
///     void end_transaction() noexcept;
///
///     // -- probe and fork (optional: without them the core falls back to begin + rollback for
///     //    ping(), and refuses any use of the store in a fork()ed child with usage_error)
///     // One cheap check that the database answers now (PostgreSQL: SELECT 1, reconnecting a
///     // dead connection once; SQLite: BEGIN IMMEDIATE + ROLLBACK). Throws like begin().
///     void ping(std::string_view what);
///     // Whether the driver opened its connection (a path, a conninfo) rather than borrowed it.
///     bool owns_connection() const noexcept;
///     // In a fork()ed child, owned only: forget_inherited(), then open a new connection set up
///     // as the first. @throws store_unavailable when that fails (the next use tries again).
///     void reopen_after_fork();
///     // Drop a connection opened by another process without a byte to the server or the file
///     // (no Terminate, no checkpoint, no ROLLBACK, no DEALLOCATE): the parent still uses it.
///     // A borrowed connection is only forgotten. Called by the core, also from ~basic_store.
///     void forget_inherited() noexcept;
///
///     // -- the effect's own SQL, with the backend's placeholders: in the transaction
///     //    (sql::context::transaction) or alone (sql::context::alone, autocommit).
///     //    Errors → store_error with the server's message and the SQL; lock and busy timeouts →
///     //    store_timeout; a wrong parameter count → usage_error.
///     template <class... Args> auto execute(sql::context, std::string_view sql, const Args&...);
///     template <class... Args>
///     std::optional<std::int64_t> query_int(sql::context, std::string_view sql, const Args&...);
///     template <class... Args>
///     std::optional<std::string> query_text(sql::context, std::string_view sql, const Args&...);
///
///     // -- the schema (sql/schema.hpp drives it)
///     std::optional<std::int64_t> stored_schema_version();   // no lock; nullopt: no tables
///     void begin_schema_change();                 // exclusive against other processes
///     void execute_ddl(std::string_view sql);
///     std::optional<std::int64_t> read_schema_version();     // inside begin_schema_change()
///     void write_schema_version(int version);
///     void commit_schema_change();  // on any failure the core calls rollback_noexcept() and
///                                   // end_transaction()
///     [[nodiscard]] std::string schema_location() const;     // "the database 'x.db'"
///     [[nodiscard]] std::string_view schema_elsewhere() const;  // "another database file"
///     [[nodiscard]] std::vector<std::string> schema_ddl(int from_version) const;  // schema.hpp
/// };
/// @endcode
///
/// Errors every driver maps, the same way on every backend (the handler turns each into
/// `failed`): a busy database or a lock wait past the timeout (SQLITE_BUSY / SQLITE_LOCKED,
/// PostgreSQL 55P03 / 57014 / 40001 / 40P01, MySQL 1205 / 1213) → store_timeout, except the
/// claim's own wait, which is ClaimStatus::in_progress; a lost or unreachable server →
/// store_unavailable (the next begin() reconnects if it can); errors of idem's own statements →
/// store_unavailable; errors of the effect's SQL → store_error naming the SQL; a refused COMMIT →
/// commit_failed, everything rolled back. The first failure inside a transaction is kept by the
/// driver and explains a later commit_failed.
///
/// Affected rows: `run` and `query` return what the server counts as changed (sqlite3_changes,
/// PQcmdTuples, mysql_affected_rows). For MySQL, where an upsert that changes a row counts 2
/// and one that leaves it as it was counts 0, hold_lock() is the driver's own for that reason.

#include <string>
#include <string_view>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace sql {

/// How a statement outside a transaction runs: as it is (a read), or committed on its own.
enum class access { read, write };

/// Where the effect's own SQL runs.
enum class context { transaction, alone };

/// Driver::health(): the transaction is usable, was rolled back by the server (a failure, a
/// lost connection: `cause` says which), or was ended by a COMMIT / ROLLBACK of the effect.
enum class tx_health { ok, lost, ended };

}  // namespace sql
IDEM_END_NAMESPACE
