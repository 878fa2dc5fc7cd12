#pragma once
/// @file
/// @brief idem::PostgresStore: the scale-out store on PostgreSQL (libpq). Claims are
/// `INSERT … ON CONFLICT DO NOTHING` in the user's transaction on the same `PGconn*`; a
/// concurrent claim of one id waits on the unique index, bounded by `lock_timeout`. The SQL
/// store written once (idem/sql/store.hpp) over idem::postgres::Driver (idem/postgres/: with
/// this header the only ones that include <libpq-fe.h>).
///
/// @code
/// idem::PostgresStore store{"host=db dbname=shop user=consumer"};   // or the consumer's PGconn*
/// auto tx = store.begin();                        // sends nothing yet (see "Round trips")
/// if (tx.claim("capture-payment", msg_id).status == idem::ClaimStatus::claimed) {
///     tx.execute("INSERT INTO captures(order_id, ref) VALUES ($1, $2)", order_id, ref);
///     tx.record_outcome("capture-payment", msg_id, idem::Disposition::processed, {});
///     tx.commit();                                // claim and rows become visible together
/// }                                               // otherwise ~Transaction rolls back
/// @endcode
///
/// Schema (created and versioned by the store in `idem_schema`, in PostgresOptions::schema;
/// every time is unix ms from the store's clock):
/// - `idem_claims(scope BYTEA, message_id BYTEA, claimed_at BIGINT, outcome TEXT, reason TEXT,
///   fingerprint BYTEA, PRIMARY KEY(scope, message_id))`, indexed on claimed_at;
/// - `idem_dead_letters(id BIGSERIAL, scope, message_id, delivery_count, reason, payload BYTEA,
///   created_at)`;
/// - `idem_locks(lock_key BYTEA PRIMARY KEY, owner BYTEA, expires_at BIGINT)`: hold_lock();
/// - `idem_outbox(id BIGSERIAL PRIMARY KEY, destination TEXT, idempotency_key BYTEA UNIQUE,
///   payload BYTEA, created_at, sent_at NULL, attempts INT, last_error TEXT, next_attempt_at,
///   lease_until NULL, parked BOOLEAN)`, with a partial index on the unsent rows.
/// The tables are created under `pg_advisory_xact_lock`, so processes starting at once on an
/// empty database do not race; a database holding a newer schema version is refused.
///
/// Round trips: commands whose answer is not needed at once (BEGIN, `SET LOCAL lock_timeout`,
/// SAVEPOINT, RELEASE, record_outcome(), dead_letter()) are queued and sent in one libpq
/// pipeline with the next command that needs an answer. A handled message costs one round trip
/// for BEGIN + claim, one per statement of the effect, and one for RELEASE + outcome + COMMIT:
/// the same count as the effect's own transaction without idem; a duplicate costs the claim, the
/// read of its stored outcome and a ROLLBACK. A batch (handle_batch) claims all its ids in one
/// round trip (claim_many), plus one reading the stored outcomes when some were there already.
/// Errors of a queued command surface at that next call. Statements are prepared once per session
/// (named `idem_<n>_<m>`; switch off with PostgresOptions::prepare_statements for poolers that
/// cannot keep them).
///
/// Binding: every value reaches SQL as a bound parameter (`$1`, `$2`, …). Integers, floating
/// point, bool and strings go as text and take the type the SQL gives them; `idem::Blob{bytes}`
/// goes as binary BYTEA. Scopes, ids, keys and payloads are stored as BYTEA: bind them as
/// `idem::Blob{id}` when querying the idem tables by hand. Reasons and last errors are stored as
/// TEXT in valid UTF-8 (invalid bytes and NULs become U+FFFD); the database should be UTF8.
///
/// Failures: a claim that waits past lock_timeout → ClaimStatus::in_progress (PostgreSQL has
/// aborted the transaction; the handler drops it; claim_many() recovers through a savepoint and
/// answers in_progress for the held ids only). Other lock / statement timeouts,
/// serialization failures and deadlocks → idem::store_timeout; a refused COMMIT (a deferred
/// constraint, an earlier failed statement) → idem::commit_failed, everything rolled back; a
/// lost connection → idem::store_unavailable (during COMMIT the outcome is unknown: the
/// redelivery finds the claim if it committed), and the next begin() reconnects (PQreset, also
/// for a borrowed connection: the pointer stays valid, the session is new). Errors of the
/// effect's SQL → idem::store_error with the server's message and the SQL. The handler turns
/// each into `failed`. Set TCP keepalives / `tcp_user_timeout` in the conninfo so a silent
/// network partition becomes an error instead of a hang.
///
/// Notices (NOTICE, WARNING, INFO … from the server, `RAISE NOTICE` in the effect's SQL) never go
/// to stderr from a connection the store opened: they reach PostgresOptions::on_notice, or are
/// dropped. A borrowed connection keeps its own notice handling unless on_notice is set; then the
/// store routes notices to it while it lives — still passing them to a notice processor the
/// consumer installed — and puts libpq's receiver back in its destructor (see on_notice).
///
/// Thread safety: one PostgresStore may be shared by threads. Every operation (begin() up to the
/// end of its Transaction, purge(), find_claim(), ...) holds the store's mutex; a Transaction must
/// end on the thread that began it. For parallelism use one store (one connection) per thread:
/// concurrent claims of one id then wait on PostgreSQL's unique index. The overlap lock assumes
/// READ COMMITTED (PostgreSQL's default isolation).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "idem/config.hpp"
#include "idem/contract/store.hpp"
#include "idem/postgres/driver.hpp"
#include "idem/postgres/options.hpp"
#include "idem/sql/store.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The scale-out store: claims, outcomes, dead letters, locks and outbox intents in
/// PostgreSQL tables, written in the same transaction (the same `PGconn*`) as the effect's rows.
///
/// Its Transaction (sql::basic_transaction<postgres::Driver>) adds `conn()` (which first sends
/// the queued commands) to the members every SQL store has; `execute()` returns the affected
/// rows as std::int64_t and binds to `$1`, `$2`, …: integers, floating point, bool and strings
/// as text, idem::Blob as BYTEA, `nullptr` / `std::nullopt` as NULL, std::optional.
///
/// @throws store_unavailable when the server cannot be reached or the tables cannot be set up,
/// store_timeout on lock / statement timeouts, store_error when the database holds a newer idem
/// schema than this code understands, usage_error for misuse (see each member).
class PostgresStore : public sql::basic_store<postgres::Driver> {
  public:
    /// Effect statements (SQL and parameter kinds) kept prepared; further ones are not.
    static constexpr std::size_t max_cached_statements = postgres::Driver::max_cached_statements;
    /// The oldest server this store runs on (ON CONFLICT, SKIP LOCKED, to_regclass(text)).
    static constexpr int min_server_version = postgres::Driver::min_server_version;

    /// @brief Connects with @p conninfo (a libpq connection string or URI) and owns the
    /// connection. client_encoding defaults to UTF8 and application_name to "idem" unless the
    /// string sets them. The conninfo is never repeated in messages (it may hold a password).
    /// @throws store_unavailable when the connection or the schema setup fails.
    explicit PostgresStore(const std::string& conninfo, PostgresOptions options = {})
        : basic_store(options.clock, conninfo, options) {}
    /// @brief Uses the consumer's own connection, which it never closes. After the connection
    /// broke, begin() resets it (PQreset): the pointer stays valid, the session is new.
    /// @throws usage_error when @p conn is null, inside a transaction, in pipeline mode or
    /// non-blocking.
    explicit PostgresStore(PGconn* conn, PostgresOptions options = {})
        : basic_store(options.clock, conn, options) {}

    /// @brief The connection (owned or borrowed). Use it only while no other thread uses the
    /// store; inside a transaction prefer Transaction::conn().
    [[nodiscard]] PGconn* conn() const noexcept { return driver().conn(); }
    /// @brief The schema holding the idem tables.
    [[nodiscard]] const std::string& schema() const noexcept { return driver().schema(); }
    /// @brief Round trips to the server so far (pipelines, ROLLBACKs); for tests and budgets.
    [[nodiscard]] std::uint64_t round_trips() const noexcept { return driver().round_trips(); }

    /// @brief Runs one statement outside any idem transaction (autocommit; setup, tests) with
    /// bound @p args. @return the affected rows. @throws store_error with the server's message.
    template <class... Args>
    std::int64_t execute(std::string_view sql, const Args&... args) {
        Lock lock(*this, "PostgresStore::execute()");
        return driver().execute(sql::context::alone, sql, args...);
    }
    /// @brief First column of the first row as an integer; empty when no row or NULL.
    template <class... Args>
    std::optional<std::int64_t> query_int(std::string_view sql, const Args&... args) {
        Lock lock(*this, "PostgresStore::query_int()");
        return driver().query_int(sql::context::alone, sql, args...);
    }
    /// @brief First column of the first row as bytes (BYTEA decoded); empty when no row or NULL.
    template <class... Args>
    std::optional<std::string> query_text(std::string_view sql, const Args&... args) {
        Lock lock(*this, "PostgresStore::query_text()");
        return driver().query_text(sql::context::alone, sql, args...);
    }
};

static_assert(check_store<PostgresStore>());

IDEM_END_NAMESPACE
