#pragma once
/// @file
/// @brief idem::MysqlStore: the store on MySQL / MariaDB (libmariadb). Claims are
/// `INSERT … ON DUPLICATE KEY UPDATE` on a unique key in the user's transaction on the same
/// `MYSQL*` (InnoDB); a concurrent claim of one id waits on the row lock, bounded by
/// `innodb_lock_wait_timeout`. The SQL store written once (idem/sql/store.hpp) over
/// idem::mysql::Driver (idem/mysql/: with this header the only ones that include <mysql.h>).
///
/// @code
/// idem::MysqlStore store{idem::MysqlEndpoint{"db", 3306, "consumer", secret, "shop"}};
/// auto tx = store.begin();                         // START TRANSACTION
/// if (tx.claim("capture-payment", msg_id).status == idem::ClaimStatus::claimed) {
///     tx.execute("INSERT INTO captures(order_id, ref) VALUES (?, ?)", order_id, ref);
///     tx.record_outcome("capture-payment", msg_id, idem::Disposition::processed, {});
///     tx.commit();                                 // claim and rows become visible together
/// }                                                // otherwise ~Transaction rolls back
/// @endcode
///
/// Schema (InnoDB, created and versioned by the store in `idem_schema` under a GET_LOCK):
/// `idem_claims`, `idem_dead_letters`, `idem_locks`, `idem_outbox`. Scopes, ids, keys, payloads,
/// reasons are BLOBs; the unique keys are SHA-256 hashes in stored generated columns
/// (`claim_key` of the scope's length, the scope and the id), so any id fits InnoDB's index limit.
/// Query them by hand with `idem::Blob{id}`.
///
/// Values reach the SQL as literals rendered by the driver: idem::Blob as `X'…'`, text through
/// mysql_real_escape_string, numbers in decimal, `?` placeholders (outside quotes and comments)
/// counted against the arguments. No server-side prepared statements (one round trip per
/// statement; works behind ProxySQL).
///
/// Failures: a claim that waits past lock_wait_timeout (1205) → ClaimStatus::in_progress (the
/// statement is undone, the transaction stays usable). A deadlock (1213) rolls the whole
/// transaction back: the driver notices (`@@in_transaction`), refuses every later statement of
/// it (never autocommit) and commit() throws commit_failed. Other lock / statement timeouts →
/// store_timeout; a lost connection (2006, 2013, …) → store_unavailable (during COMMIT the
/// outcome is unknown), and the next begin() reconnects (an owned connection is opened again; a
/// borrowed one is reconnected in place with mariadb_reconnect()). Errors of the effect's SQL →
/// store_error with the server's message and the SQL. DDL in the effect commits implicitly: the
/// store then reports a usage_error (the transaction ended).
///
/// Thread safety: one MysqlStore may be shared by threads (its mutex); a Transaction must end on
/// the thread that began it. For parallelism use one store (one connection) per thread.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "idem/config.hpp"
#include "idem/contract/store.hpp"
#include "idem/mysql/driver.hpp"
#include "idem/mysql/options.hpp"
#include "idem/sql/store.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief Claims, outcomes, dead letters, locks and outbox intents in MySQL / MariaDB (InnoDB)
/// tables, written in the same transaction (the same `MYSQL*`) as the effect's rows.
///
/// Its Transaction (sql::basic_transaction<mysql::Driver>) adds `conn()`; `execute()` returns
/// the affected rows (a SELECT: the rows) as std::int64_t and binds to `?`: integers, floating
/// point, bool (1 / 0), strings as text, idem::Blob as binary, `nullptr` / `std::nullopt` as NULL,
/// std::optional.
class MysqlStore : public sql::basic_store<mysql::Driver> {
  public:
    /// @brief Connects to @p endpoint and owns the connection (utf8mb4, no auto-reconnect).
    /// @throws store_unavailable when the connection or the schema setup fails.
    explicit MysqlStore(const MysqlEndpoint& endpoint, MysqlOptions options = {})
        : basic_store(options.clock, endpoint, options) {}
    /// @brief Uses the consumer's own connection (with a database selected), which it never
    /// closes; sets its session's innodb_lock_wait_timeout (and isolation, when asked).
    /// @throws usage_error when @p conn is null, inside a transaction or opened with
    /// CLIENT_FOUND_ROWS.
    explicit MysqlStore(MYSQL* conn, MysqlOptions options = {})
        : basic_store(options.clock, conn, options) {}

    /// @brief The connection (owned: a new one after a reconnect). Use it only while no other
    /// thread uses the store; inside a transaction prefer Transaction::conn().
    [[nodiscard]] MYSQL* conn() const noexcept { return driver().conn(); }
    /// @brief Sessions the store has set up (1 + reconnects); for tests.
    [[nodiscard]] unsigned sessions() const noexcept { return driver().sessions(); }

    /// @brief Runs one statement outside any idem transaction (autocommit) with bound @p args.
    template <class... Args>
    std::int64_t execute(std::string_view sql, const Args&... args) {
        Lock lock(*this, "MysqlStore::execute()");
        return driver().execute(sql::context::alone, sql, args...);
    }
    /// @brief First column of the first row as an integer; empty when no row or NULL.
    template <class... Args>
    std::optional<std::int64_t> query_int(std::string_view sql, const Args&... args) {
        Lock lock(*this, "MysqlStore::query_int()");
        return driver().query_int(sql::context::alone, sql, args...);
    }
    /// @brief First column of the first row as bytes; empty when no row or NULL.
    template <class... Args>
    std::optional<std::string> query_text(std::string_view sql, const Args&... args) {
        Lock lock(*this, "MysqlStore::query_text()");
        return driver().query_text(sql::context::alone, sql, args...);
    }
};

static_assert(check_store<MysqlStore>());

IDEM_END_NAMESPACE
