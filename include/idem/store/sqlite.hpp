#pragma once
/// @file
/// @brief idem::SqliteStore: the embedded store on SQLite (WAL, `BEGIN IMMEDIATE`, busy timeout,
/// `INSERT OR IGNORE` claims). The only idem header that includes <sqlite3.h>.
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

#include <sqlite3.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
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
#include "idem/detail/own_claims.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"
#include "idem/store.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief Values of `PRAGMA synchronous`.
enum class Synchronous { off, normal, full, extra };

/// @brief How SqliteStore sets up its connection.
struct SqliteOptions {
    /// How long a writer waits for another one (BEGIN IMMEDIATE) before store_timeout.
    std::chrono::milliseconds busy_timeout{5000};
    /// Switch the database to `journal_mode=WAL` (readers never block the writer).
    bool wal = true;
    /// `PRAGMA synchronous`; SQLite's default is left alone unless set.
    std::optional<Synchronous> synchronous{};
    /// Time source for claimed_at / created_at / purge(); empty = system_clock::now.
    Clock clock{};
};

namespace detail {
namespace sqlite_store {

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

template <class>
inline constexpr bool always_false = false;

template <class T>
inline constexpr bool is_char_v = std::is_same_v<T, char> || std::is_same_v<T, wchar_t> ||
                                  std::is_same_v<T, char16_t> || std::is_same_v<T, char32_t>
#if defined(__cpp_char8_t)
                                  || std::is_same_v<T, char8_t>
#endif
    ;

inline bool is_busy(int rc) noexcept {
    const int primary = rc & 0xff;
    return primary == SQLITE_BUSY || primary == SQLITE_LOCKED;
}

/// SQLite's message for the last failure on @p db, with its (extended) result code.
inline std::string error_text(sqlite3* db, int rc) {
    if (db == nullptr) return fmt::format("{} (SQLite error {})", sqlite3_errstr(rc), rc);
    return fmt::format("{} (SQLite error {})", sqlite3_errmsg(db), sqlite3_extended_errcode(db));
}

using detail::from_unix_ms;  // store.hpp: one conversion for every store
using detail::to_unix_ms;

inline int bind_text(sqlite3_stmt* stmt, int index, std::string_view text) noexcept {
    // SQLITE_STATIC: the caller's value outlives the statement's use (bindings are cleared
    // before execute() returns), so nothing is copied.
    return sqlite3_bind_text64(stmt, index, text.empty() ? "" : text.data(),
                               static_cast<sqlite3_uint64>(text.size()), SQLITE_STATIC,
                               SQLITE_UTF8);
}

inline int bind_blob(sqlite3_stmt* stmt, int index, std::string_view bytes) noexcept {
    // A null pointer would bind NULL; an empty id is a zero-length BLOB, not NULL.
    if (bytes.empty()) return sqlite3_bind_zeroblob(stmt, index, 0);
    return sqlite3_bind_blob64(stmt, index, bytes.data(), static_cast<sqlite3_uint64>(bytes.size()),
                               SQLITE_STATIC);
}

/// Binds one value; returns SQLite's result code.
template <class T>
int bind_value(sqlite3_stmt* stmt, int index, const T& value) {
    if constexpr (std::is_same_v<T, Blob>) {
        return bind_blob(stmt, index, value.bytes);
    } else if constexpr (std::is_same_v<T, std::nullptr_t> || std::is_same_v<T, std::nullopt_t>) {
        return sqlite3_bind_null(stmt, index);
    } else if constexpr (is_optional<T>::value) {
        if (value) return bind_value(stmt, index, *value);
        return sqlite3_bind_null(stmt, index);
    } else if constexpr (std::is_same_v<T, bool>) {
        return sqlite3_bind_int64(stmt, index, value ? 1 : 0);
    } else if constexpr (is_char_v<T>) {
        static_assert(always_false<T>,
                      "idem: a single character would be bound as its code point; pass a "
                      "std::string_view for TEXT or cast to an integer type");
        return SQLITE_MISUSE;
    } else if constexpr (std::is_integral_v<T>) {
        if constexpr (std::is_unsigned_v<T> && sizeof(T) >= sizeof(std::int64_t)) {
            if (value > static_cast<T>(std::numeric_limits<std::int64_t>::max())) {
                throw usage_error(fmt::format(
                    "idem sqlite: parameter {} is {}, above SQLite's largest integer (2^63-1)",
                    index, value));
            }
        }
        return sqlite3_bind_int64(stmt, index, static_cast<sqlite3_int64>(value));
    } else if constexpr (std::is_floating_point_v<T>) {
        return sqlite3_bind_double(stmt, index, static_cast<double>(value));
    } else if constexpr (std::is_array_v<T>) {
        static_assert(std::is_same_v<std::remove_cv_t<std::remove_extent_t<T>>, char>,
                      "idem: only char arrays (string literals) can be bound as TEXT");
        const void* nul = std::memchr(value, 0, std::extent_v<T>);
        const std::size_t size =
            nul != nullptr ? static_cast<std::size_t>(static_cast<const char*>(nul) - value)
                           : std::extent_v<T>;
        return bind_text(stmt, index, std::string_view(value, size));
    } else if constexpr (std::is_same_v<T, const char*> || std::is_same_v<T, char*>) {
        if (value == nullptr) return sqlite3_bind_null(stmt, index);
        return bind_text(stmt, index, std::string_view(value));
    } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
        return bind_text(stmt, index, std::string_view(value));
    } else {
        static_assert(always_false<T>,
                      "idem: execute()/query_*() bind integers (INTEGER), floating point (REAL), "
                      "std::string / std::string_view / const char* (TEXT), idem::Blob{bytes} "
                      "(BLOB), nullptr / std::nullopt (NULL) and std::optional of those");
        return SQLITE_MISUSE;
    }
}

/// The bytes of one column, binary-safe (BLOB or TEXT with NULs / invalid UTF-8).
inline std::string column_string(sqlite3_stmt* stmt, int column) {
    if (sqlite3_column_type(stmt, column) == SQLITE_BLOB) {
        const void* data = sqlite3_column_blob(stmt, column);
        const int size = sqlite3_column_bytes(stmt, column);
        if (data == nullptr || size <= 0) return {};
        return std::string(static_cast<const char*>(data), static_cast<std::size_t>(size));
    }
    const unsigned char* data = sqlite3_column_text(stmt, column);
    const int size = sqlite3_column_bytes(stmt, column);
    if (data == nullptr || size <= 0) return {};
    return std::string(reinterpret_cast<const char*>(data), static_cast<std::size_t>(size));
}

/// Resets and clears a cached statement (or finalizes a one-off one) when a use ends.
class StatementUse {
  public:
    StatementUse(sqlite3_stmt* stmt, bool one_off) noexcept : stmt_(stmt), one_off_(one_off) {}
    StatementUse(const StatementUse&) = delete;
    StatementUse& operator=(const StatementUse&) = delete;
    ~StatementUse() {
        if (one_off_) {
            sqlite3_finalize(stmt_);
        } else {
            sqlite3_reset(stmt_);
            sqlite3_clear_bindings(stmt_);
        }
    }

  private:
    sqlite3_stmt* stmt_;
    bool one_off_;
};

}  // namespace sqlite_store
}  // namespace detail

/// @brief The embedded store: claims, outcomes and dead letters in SQLite tables, written in
/// the same transaction (the same `sqlite3*`) as the effect's own rows.
///
/// @throws store_unavailable when the database cannot be opened or set up, store_timeout when
/// another writer holds it past the busy timeout, store_error when the database holds a newer
/// idem schema than this code understands, usage_error for misuse (see each member).
class SqliteStore {
  public:
    class Transaction;

    /// Version of the idem tables this code writes; a database with a newer one is refused.
    static constexpr int schema_version = 1;
    /// User SQL strings whose prepared statements are kept; further ones are prepared per call.
    static constexpr std::size_t max_cached_statements = 256;

    /// @brief Opens (creating if needed) the database file and owns the connection.
    explicit SqliteStore(const std::string& path, SqliteOptions options = {});
    /// @brief Uses the consumer's own connection, which it never closes. The store sets the
    /// connection's busy timeout (and WAL, and synchronous when asked).
    /// @throws usage_error when @p db is null or inside a transaction.
    explicit SqliteStore(sqlite3* db, SqliteOptions options = {});
    /// Finalizes the store's statements; closes the connection only if the store opened it.
    ~SqliteStore();

    SqliteStore(const SqliteStore&) = delete;
    SqliteStore& operator=(const SqliteStore&) = delete;
    SqliteStore(SqliteStore&&) = delete;
    SqliteStore& operator=(SqliteStore&&) = delete;

    /// @brief Takes the store's mutex and runs `BEGIN IMMEDIATE`.
    /// @throws store_timeout when another writer holds the database past the busy timeout,
    /// store_unavailable on other SQLite errors, usage_error when the connection is already in
    /// a transaction or this thread already holds a transaction of this store.
    [[nodiscard]] Transaction begin();

    /// @brief Deletes claims whose claimed_at is older than clock() - @p older_than, outbox
    /// intents sent before that cutoff, and locks held with hold_lock() that have expired
    /// (expires_at before clock()), in short batches (each its own transaction) so handlers are
    /// not held up. Dead letters, unsent and parked intents are kept.
    /// @return how many claims, sent intents and expired locks were deleted.
    /// @throws usage_error when @p older_than is negative.
    PurgeResult purge(std::chrono::system_clock::duration older_than);

    /// @brief The committed claim of (scope, id), if any.
    [[nodiscard]] std::optional<ClaimRecord> find_claim(std::string_view scope,
                                                        std::string_view id);

    /// @brief Every dead letter, oldest first.
    [[nodiscard]] std::vector<DeadLetter> dead_letters();

    /// @brief Takes (or renews) the lock on @p key for @p owner until clock() + @p expire_after
    /// or release_lock(), in its own short transaction; a lock held in idem_locks refuses
    /// Transaction::try_lock() of every handler on this file.
    /// @return false when another owner holds the lock and it has not expired.
    bool hold_lock(std::string_view key, std::string_view owner,
                   std::chrono::milliseconds expire_after);
    /// @brief Releases a lock taken with hold_lock(); false when @p owner does not hold it.
    bool release_lock(std::string_view key, std::string_view owner);

    /// @brief Leases up to @p limit unsent, unparked intents that are due (next_attempt_at <=
    /// clock()) and not leased, oldest (lowest id) first, until clock() + @p lease: one
    /// `BEGIN IMMEDIATE` transaction, so relays in other threads or processes never get a row
    /// while its lease is live.
    std::vector<OutboxRow> lease_outbox(std::size_t limit, std::chrono::milliseconds lease);
    /// @brief Marks an intent sent (sent_at = clock()) and ends its lease.
    /// @throws usage_error when no intent has this id.
    void mark_outbox_sent(std::int64_t id);
    /// @brief Records a failed send: attempts + 1, last_error, next_attempt_at = @p retry_at,
    /// parked = @p park; ends its lease. @throws usage_error when no intent has this id.
    void mark_outbox_failed(std::int64_t id, std::string_view error,
                            std::chrono::system_clock::time_point retry_at, bool park);
    /// @brief Every committed outbox intent, oldest first.
    [[nodiscard]] std::vector<OutboxRow> outbox_rows();

    /// @brief The connection (owned or borrowed). See the thread-safety note above.
    [[nodiscard]] sqlite3* db() const noexcept { return db_; }

    /// @brief Runs one SQL statement outside any idem transaction (setup, tests) with bound
    /// @p args. @return sqlite3_changes(). @throws store_error with SQLite's message and the SQL.
    template <class... Args>
    int execute(std::string_view sql, const Args&... args);
    /// @brief First column of the first row as an integer; empty when no row or NULL.
    template <class... Args>
    std::optional<std::int64_t> query_int(std::string_view sql, const Args&... args);
    /// @brief First column of the first row as bytes; empty when no row or NULL.
    template <class... Args>
    std::optional<std::string> query_text(std::string_view sql, const Args&... args);

  private:
    enum class Kind { idem, user };  // which exception a non-busy SQLite error becomes

    enum Own : std::size_t {
        begin_immediate,
        commit_tx,
        rollback_tx,
        savepoint_effect,
        rollback_to_effect,
        release_effect,
        claim_insert,
        claim_outcome,
        record_update,
        claim_delete,
        dead_letter_insert,
        purge_batch,
        purge_outbox_batch,
        purge_locks_batch,
        find_one_claim,
        all_dead_letters,
        lock_live,
        lock_hold,
        lock_release,
        outbox_insert,
        outbox_lease,
        outbox_sent,
        outbox_failed,
        outbox_all,
        own_count,
    };

    static constexpr std::array<const char*, own_count> own_sql{{
        "BEGIN IMMEDIATE",
        "COMMIT",
        "ROLLBACK",
        "SAVEPOINT idem_effect",
        "ROLLBACK TO idem_effect",
        "RELEASE idem_effect",
        "INSERT OR IGNORE INTO idem_claims(scope, message_id, claimed_at, outcome, reason, "
        "fingerprint) VALUES (?1, ?2, ?3, 'processed', '', ?4)",
        "SELECT outcome, fingerprint FROM idem_claims WHERE scope = ?1 AND message_id = ?2",
        "UPDATE idem_claims SET outcome = ?3, reason = ?4 WHERE scope = ?1 AND message_id = ?2",
        "DELETE FROM idem_claims WHERE scope = ?1 AND message_id = ?2",
        "INSERT INTO idem_dead_letters(scope, message_id, delivery_count, reason, payload, "
        "created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        "DELETE FROM idem_claims WHERE (scope, message_id) IN (SELECT scope, message_id FROM "
        "idem_claims WHERE claimed_at < ?1 LIMIT ?2)",
        "DELETE FROM idem_outbox WHERE id IN (SELECT id FROM idem_outbox "
        "WHERE sent_at < ?1 AND parked = 0 LIMIT ?2)",
        "DELETE FROM idem_locks WHERE lock_key IN (SELECT lock_key FROM idem_locks "
        "WHERE expires_at < ?1 LIMIT ?2)",
        "SELECT scope, message_id, claimed_at, outcome, reason, fingerprint FROM idem_claims "
        "WHERE scope = ?1 AND message_id = ?2",
        "SELECT scope, message_id, delivery_count, reason, payload, created_at "
        "FROM idem_dead_letters ORDER BY id",
        "SELECT 1 FROM idem_locks WHERE lock_key = ?1 AND expires_at > ?2",
        "INSERT INTO idem_locks(lock_key, owner, expires_at) VALUES (?1, ?2, ?3) "
        "ON CONFLICT(lock_key) DO UPDATE SET owner = excluded.owner, "
        "expires_at = excluded.expires_at "
        "WHERE idem_locks.owner = excluded.owner OR idem_locks.expires_at <= ?4",
        "DELETE FROM idem_locks WHERE lock_key = ?1 AND owner = ?2",
        "INSERT INTO idem_outbox(destination, idempotency_key, payload, created_at, "
        "next_attempt_at) VALUES (?1, ?2, ?3, ?4, ?4) ON CONFLICT(idempotency_key) DO NOTHING",
        "UPDATE idem_outbox SET lease_until = ?1 WHERE id IN (SELECT id FROM idem_outbox "
        "WHERE sent_at IS NULL AND parked = 0 AND next_attempt_at <= ?2 "
        "AND (lease_until IS NULL OR lease_until <= ?2) ORDER BY id LIMIT ?3) "
        "RETURNING id, destination, idempotency_key, payload, created_at, sent_at, attempts, "
        "last_error, next_attempt_at, parked",
        "UPDATE idem_outbox SET sent_at = ?2, lease_until = NULL WHERE id = ?1",
        "UPDATE idem_outbox SET attempts = attempts + 1, last_error = ?2, next_attempt_at = ?3, "
        "parked = ?4, lease_until = NULL WHERE id = ?1",
        "SELECT id, destination, idempotency_key, payload, created_at, sent_at, attempts, "
        "last_error, next_attempt_at, parked FROM idem_outbox ORDER BY id",
    }};

    static constexpr std::int64_t purge_batch_rows = 5000;

    /// The store's mutex, held by a Transaction until it ends; refuses re-entry from the
    /// thread that holds it (which would otherwise deadlock).
    class Lock {
      public:
        Lock() noexcept = default;
        Lock(SqliteStore& store, std::string_view what) : store_(&store) { store.lock(what); }
        Lock(Lock&& other) noexcept : store_(std::exchange(other.store_, nullptr)) {}
        Lock& operator=(Lock&& other) noexcept {
            if (this != &other) {
                unlock();
                store_ = std::exchange(other.store_, nullptr);
            }
            return *this;
        }
        Lock(const Lock&) = delete;
        Lock& operator=(const Lock&) = delete;
        ~Lock() { unlock(); }
        void unlock() noexcept {
            if (store_ != nullptr) std::exchange(store_, nullptr)->unlock();
        }

      private:
        SqliteStore* store_ = nullptr;
    };

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

    void lock(std::string_view what);
    void unlock() noexcept;
    void setup(const SqliteOptions& options);
    void ensure_schema();
    [[nodiscard]] std::optional<std::int64_t> stored_schema_version();
    void check_not_newer(std::int64_t version) const;
    [[nodiscard]] std::string describe() const;
    void open_transaction(std::string_view what);
    bool rollback_noexcept() noexcept;
    void close_noexcept() noexcept;
    [[nodiscard]] std::chrono::system_clock::time_point now() const {
        return clock_ ? clock_() : std::chrono::system_clock::now();
    }

    /// Reads the columns of the outbox statements (id ... parked) from the current row.
    [[nodiscard]] static OutboxRow read_outbox_row(sqlite3_stmt* stmt);

    /// Runs a purge statement (?1 = the bound, ?2 = the batch size) in batches, each its own
    /// transaction, until a batch deletes fewer rows than the batch size; returns the total.
    std::size_t purge_in_batches(Own which, std::string_view what, std::int64_t before);

    [[noreturn]] void fail(int rc, std::string_view what, Kind kind, std::string_view sql = {});
    sqlite3_stmt* own(Own which);
    Prepared prepare(std::string_view sql, bool cache, Kind kind);
    [[nodiscard]] bool has_more_statements(std::string_view rest) const;

    template <class... Args>
    void bind_all(sqlite3_stmt* stmt, std::string_view sql, Kind kind, const Args&... args);
    /// Steps an idem statement to the end; returns sqlite3_changes().
    template <class... Args>
    int step_own(Own which, std::string_view what, const Args&... args);
    template <class... Args>
    int execute_impl(Kind kind, bool cache, std::string_view sql, const Args&... args);
    template <class T, class Read, class... Args>
    std::optional<T> first_value(Kind kind, bool cache, std::string_view sql, Read read,
                                 const Args&... args);

    sqlite3* db_ = nullptr;
    bool owned_ = false;
    Clock clock_;
    std::chrono::milliseconds busy_timeout_;
    std::mutex mutex_;
    std::atomic<std::thread::id> owner_{};
    std::array<sqlite3_stmt*, own_count> own_{};
    std::unordered_map<std::string_view, std::unique_ptr<Cached>> cache_;
    /// claim_many()'s multi-row INSERTs, one per row count (1..claim_rows_max): plain, and with
    /// RETURNING (which tells the inserted ids apart, at about a fifth more per row).
    static constexpr std::size_t claim_rows_max = 64;
    std::array<std::unique_ptr<Cached>, claim_rows_max + 1> claim_rows_{};
    std::array<std::unique_ptr<Cached>, claim_rows_max + 1> claim_rows_returning_{};
    sqlite3_stmt* claim_rows_statement(std::size_t rows, bool returning);
    bool tx_open_ = false;  // a Transaction of this store is running
    std::string tx_error_;  // first SQLite failure inside it (explains an automatic rollback)
    bool rollback_pending_ = false;  // our ROLLBACK failed: the connection is still in our tx
};

/// @brief One `BEGIN IMMEDIATE` … `COMMIT` on the store's connection, holding the store's mutex.
///
/// Move-only RAII: rolls back in its destructor unless committed, and never throws from it. The
/// effect's own SQL runs through execute() / query_*() or db() and commits or rolls back with
/// the claim. Every member throws usage_error once the transaction has ended (a second commit()
/// included). It must not outlive its store, and must end on the thread that began it.
class SqliteStore::Transaction {
  public:
    /// Each savepoint is a statement: the handler avoids them on its common path.
    static constexpr bool cheap_savepoints = false;

    Transaction(Transaction&& other) noexcept
        : store_(std::exchange(other.store_, nullptr)),
          lock_(std::move(other.lock_)),
          state_(std::exchange(other.state_, State::rolled_back)),
          savepoints_(std::exchange(other.savepoints_, 0)),
          own_claims_(std::move(other.own_claims_)) {}
    Transaction& operator=(Transaction&& other) noexcept {
        if (this != &other) {
            end_noexcept();
            store_ = std::exchange(other.store_, nullptr);
            lock_ = std::move(other.lock_);
            state_ = std::exchange(other.state_, State::rolled_back);
            savepoints_ = std::exchange(other.savepoints_, 0);
            own_claims_ = std::move(other.own_claims_);
        }
        return *this;
    }
    Transaction(const Transaction&) = delete;
    Transaction& operator=(const Transaction&) = delete;
    /// Rolls back unless committed; never throws.
    ~Transaction() { end_noexcept(); }

    /// @brief `INSERT OR IGNORE` the claim (outcome 'claimed', visible to others only after
    /// commit) with its payload @p fingerprint. @return claimed, or duplicate with the outcome a
    /// finished run recorded (`recorded` is in_progress when this same transaction claimed the
    /// id before) and the fingerprint stored with the first claim.
    ClaimResult claim(std::string_view scope, std::string_view id,
                      std::string_view fingerprint = {});
    /// @brief Claims many ids of one scope with multi-row `INSERT OR IGNORE … RETURNING` (64
    /// rows a statement); results in order, as claim() would give them one by one. Used by
    /// IdempotentHandler::handle_batch. @p fingerprints is empty or one per id.
    std::vector<ClaimResult> claim_many(std::string_view scope,
                                        const std::vector<std::string_view>& ids,
                                        const std::vector<std::string>& fingerprints = {});
    /// @brief Deletes a claim this transaction made (a batch message that failed: its savepoint
    /// came after the claim).
    void unclaim(std::string_view scope, std::string_view id);
    /// @brief Stores the outcome and reason on the claim; does nothing if there is no claim row.
    void record_outcome(std::string_view scope, std::string_view id, Disposition disposition,
                        std::string_view reason);
    /// @brief Inserts a dead letter (created_at from the store's clock when left default).
    void dead_letter(const DeadLetter& letter);
    /// @brief `SAVEPOINT idem_effect` (may nest).
    void savepoint();
    /// @brief Undoes everything since the latest savepoint() and removes it.
    void rollback_to_savepoint();
    /// @brief Keeps everything since the latest savepoint() and removes it.
    void release_savepoint();
    /// @brief Overlap lock on @p key for the rest of this transaction. Inside `BEGIN IMMEDIATE`
    /// this connection is the only writer until the transaction ends, so the write lock is the
    /// overlap lock: only an unexpired lock taken with SqliteStore::hold_lock() (a transaction
    /// never owns one) refuses it. @p expire_after is not needed: the lock ends with the
    /// transaction, also when its process dies.
    bool try_lock(std::string_view key, std::chrono::milliseconds expire_after);
    /// @brief Adds an outbox intent (created_at = next_attempt_at = clock()) that commits or rolls
    /// back with this transaction. @return false when its idempotency key is already there.
    bool add_outbox(const OutboxIntent& intent);
    /// @brief `COMMIT`. @throws commit_failed (with SQLite's message) after rolling back when
    /// SQLite refuses the commit: nothing the transaction wrote is visible. usage_error when
    /// called twice.
    void commit();
    /// @brief Rolls back now (the destructor does the same).
    void rollback();
    /// @brief True until commit() or rollback().
    [[nodiscard]] bool active() const noexcept {
        return store_ != nullptr && state_ == State::active;
    }

    /// @brief The connection, for the effect's own SQL inside this transaction.
    [[nodiscard]] sqlite3* db() const noexcept { return store_ != nullptr ? store_->db_ : nullptr; }

    /// @brief Runs one statement with bound @p args (integers, floating point, strings as TEXT,
    /// idem::Blob as BLOB, nullptr/std::nullopt as NULL, std::optional). Prepared statements are
    /// cached per SQL string. @return sqlite3_changes(). @throws store_error with SQLite's
    /// message and the SQL; usage_error when the argument count does not match the SQL.
    template <class... Args>
    int execute(std::string_view sql, const Args&... args) {
        return open("execute()").execute_impl(Kind::user, true, sql, args...);
    }
    /// @brief First column of the first row as an integer; empty when no row or NULL.
    template <class... Args>
    std::optional<std::int64_t> query_int(std::string_view sql, const Args&... args) {
        return open("query_int()")
            .template first_value<std::int64_t>(
                Kind::user, true, sql, [](sqlite3_stmt* s) { return sqlite3_column_int64(s, 0); },
                args...);
    }
    /// @brief First column of the first row as bytes (TEXT or BLOB); empty when no row or NULL.
    template <class... Args>
    std::optional<std::string> query_text(std::string_view sql, const Args&... args) {
        return open("query_text()")
            .template first_value<std::string>(
                Kind::user, true, sql,
                [](sqlite3_stmt* s) { return detail::sqlite_store::column_string(s, 0); }, args...);
    }

  private:
    friend class SqliteStore;
    enum class State { active, committed, rolled_back };

    Transaction(SqliteStore& store, Lock lock) noexcept
        : store_(&store), lock_(std::move(lock)), state_(State::active) {}

    SqliteStore& open(std::string_view what, bool committing = false);
    void finish(State state) noexcept;
    void end_noexcept() noexcept;

    SqliteStore* store_ = nullptr;
    Lock lock_;
    State state_ = State::rolled_back;
    int savepoints_ = 0;
    detail::OwnClaims own_claims_;  ///< inserted as 'processed': see own_claims.hpp
};

// ---------------------------------------------------------------------------------------------
// SqliteStore

inline SqliteStore::SqliteStore(const std::string& path, SqliteOptions options)
    : owned_(true), clock_(std::move(options.clock)), busy_timeout_(options.busy_timeout) {
    if (path.find('\0') != std::string::npos) {
        throw usage_error("idem sqlite: the database path contains a NUL byte");
    }
    sqlite3* db = nullptr;
    const int rc =
        sqlite3_open_v2(path.c_str(), &db,
                        SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
    if (rc != SQLITE_OK) {
        std::string message = fmt::format("idem sqlite: cannot open '{}': {}", path,
                                          detail::sqlite_store::error_text(db, rc));
        sqlite3_close_v2(db);
        throw store_unavailable(message);
    }
    db_ = db;
    try {
        setup(options);
    } catch (...) {
        close_noexcept();
        throw;
    }
}

inline SqliteStore::SqliteStore(sqlite3* db, SqliteOptions options)
    : db_(db),
      owned_(false),
      clock_(std::move(options.clock)),
      busy_timeout_(options.busy_timeout) {
    if (db_ == nullptr) throw usage_error("idem sqlite: SqliteStore needs a connection, got null");
    if (sqlite3_get_autocommit(db_) == 0) {
        db_ = nullptr;
        throw usage_error(
            "idem sqlite: the borrowed connection is inside a transaction; construct the "
            "SqliteStore outside any transaction (it may create its tables and switch to WAL)");
    }
    try {
        setup(options);
    } catch (...) {
        close_noexcept();
        throw;
    }
}

inline SqliteStore::~SqliteStore() {
    close_noexcept();
}

inline void SqliteStore::close_noexcept() noexcept {
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

inline void SqliteStore::lock(std::string_view what) {
    if (owner_.load(std::memory_order_relaxed) == std::this_thread::get_id()) {
        throw usage_error(fmt::format(
            "idem sqlite: {} called on a thread that holds an open transaction of this "
            "SqliteStore (it would deadlock); use that transaction, or commit / roll it back "
            "first",
            what));
    }
    mutex_.lock();
    owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
}

inline void SqliteStore::unlock() noexcept {
    owner_.store(std::thread::id{}, std::memory_order_relaxed);
    mutex_.unlock();
}

inline std::string SqliteStore::describe() const {
    const char* file = sqlite3_db_filename(db_, "main");
    if (file == nullptr || *file == '\0') return "(in-memory database)";
    return fmt::format("'{}'", file);
}

inline void SqliteStore::setup(const SqliteOptions& options) {
    const auto ms = options.busy_timeout.count();
    sqlite3_busy_timeout(db_, ms <= 0 ? 0 : ms >= INT_MAX ? INT_MAX : static_cast<int>(ms));
    if (options.wal) {
        // Switching to WAL needs an exclusive lock, and SQLite may answer SQLITE_BUSY at once
        // instead of calling the busy handler (another connection opening the same fresh file):
        // retry until the busy timeout has passed.
        const auto deadline = std::chrono::steady_clock::now() + options.busy_timeout;
        for (;;) {
            try {
                // Answers the resulting mode: 'wal', or 'memory' for an in-memory database.
                (void)first_value<std::string>(
                    Kind::idem, false, "PRAGMA journal_mode=WAL",
                    [](sqlite3_stmt* s) { return detail::sqlite_store::column_string(s, 0); });
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
    ensure_schema();
}

inline std::optional<std::int64_t> SqliteStore::stored_schema_version() {
    const auto tables = first_value<std::int64_t>(
        Kind::idem, false, "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1",
        [](sqlite3_stmt* s) { return sqlite3_column_int64(s, 0); }, "idem_schema");
    if (tables.value_or(0) == 0) return std::nullopt;
    return first_value<std::int64_t>(Kind::idem, false, "SELECT max(version) FROM idem_schema",
                                     [](sqlite3_stmt* s) { return sqlite3_column_int64(s, 0); });
}

inline void SqliteStore::check_not_newer(std::int64_t version) const {
    if (version > schema_version) {
        throw store_error(fmt::format(
            "idem sqlite: the database {} holds idem schema version {}, newer than the version "
            "this build of idem understands ({}); it was written by a newer idem. Upgrade idem in "
            "this program, or point it at another database file",
            describe(), version, schema_version));
    }
}

inline void SqliteStore::ensure_schema() {
    // Fast path without the write lock: an up-to-date database opens even while another
    // process is writing.
    if (const auto version = stored_schema_version()) {
        check_not_newer(*version);
        if (*version == schema_version) return;
    }
    // Create (or migrate) under BEGIN IMMEDIATE, so two processes opening a fresh file at once
    // serialize here and the second one finds the finished schema.
    open_transaction("creating the idem schema");
    try {
        execute_impl(Kind::idem, false,
                     "CREATE TABLE IF NOT EXISTS idem_schema(version INTEGER NOT NULL)");
        const auto version =
            first_value<std::int64_t>(Kind::idem, false, "SELECT max(version) FROM idem_schema",
                                      [](sqlite3_stmt* s) { return sqlite3_column_int64(s, 0); });
        if (version) check_not_newer(*version);
        if (!version || *version < schema_version) {
            // Version 1 is the first schema; later versions add their migrations here.
            execute_impl(Kind::idem, false,
                         "CREATE TABLE IF NOT EXISTS idem_claims("
                         "scope BLOB NOT NULL, message_id BLOB NOT NULL, "
                         "claimed_at INTEGER NOT NULL, outcome TEXT NOT NULL, "
                         "reason TEXT NOT NULL DEFAULT '', "
                         "fingerprint BLOB NOT NULL DEFAULT x'', "
                         "PRIMARY KEY(scope, message_id)) WITHOUT ROWID");
            execute_impl(Kind::idem, false,
                         "CREATE INDEX IF NOT EXISTS idem_claims_claimed_at "
                         "ON idem_claims(claimed_at)");
            execute_impl(Kind::idem, false,
                         "CREATE TABLE IF NOT EXISTS idem_dead_letters("
                         "id INTEGER PRIMARY KEY, scope BLOB NOT NULL, message_id BLOB NOT NULL, "
                         "delivery_count INTEGER NOT NULL, reason TEXT NOT NULL, "
                         "payload BLOB NOT NULL, created_at INTEGER NOT NULL)");
            execute_impl(Kind::idem, false,
                         "CREATE TABLE IF NOT EXISTS idem_locks("
                         "lock_key BLOB PRIMARY KEY, owner BLOB NOT NULL, "
                         "expires_at INTEGER NOT NULL) WITHOUT ROWID");
            execute_impl(Kind::idem, false,
                         "CREATE TABLE IF NOT EXISTS idem_outbox("
                         "id INTEGER PRIMARY KEY AUTOINCREMENT, destination TEXT NOT NULL, "
                         "idempotency_key BLOB NOT NULL UNIQUE, payload BLOB NOT NULL, "
                         "created_at INTEGER NOT NULL, sent_at INTEGER, "
                         "attempts INTEGER NOT NULL DEFAULT 0, "
                         "last_error TEXT NOT NULL DEFAULT '', "
                         "next_attempt_at INTEGER NOT NULL, lease_until INTEGER, "
                         "parked INTEGER NOT NULL DEFAULT 0)");
            // The relay's query: unsent, unparked, due, in id order.
            execute_impl(Kind::idem, false,
                         "CREATE INDEX IF NOT EXISTS idem_outbox_due "
                         "ON idem_outbox(parked, next_attempt_at, id) WHERE sent_at IS NULL");
            // purge(): sent intents by age, held locks by expiry.
            execute_impl(Kind::idem, false,
                         "CREATE INDEX IF NOT EXISTS idem_outbox_sent "
                         "ON idem_outbox(sent_at) WHERE sent_at IS NOT NULL");
            execute_impl(Kind::idem, false,
                         "CREATE INDEX IF NOT EXISTS idem_locks_expires_at "
                         "ON idem_locks(expires_at)");
            execute_impl(Kind::idem, false, "DELETE FROM idem_schema");
            execute_impl(Kind::idem, false, "INSERT INTO idem_schema(version) VALUES (?1)",
                         schema_version);
        }
        step_own(commit_tx, "committing the idem schema");
        tx_open_ = false;
    } catch (...) {
        rollback_noexcept();
        tx_open_ = false;
        throw;
    }
}

inline void SqliteStore::open_transaction(std::string_view what) {
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
    sqlite3_stmt* stmt = own(begin_immediate);
    int rc = sqlite3_step(stmt);
    if (rc != SQLITE_DONE) {
        std::string message = detail::sqlite_store::error_text(db_, rc);
        sqlite3_reset(stmt);
        if (detail::sqlite_store::is_busy(rc)) {
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

inline bool SqliteStore::rollback_noexcept() noexcept {
    if (sqlite3_get_autocommit(db_) == 0) {
        sqlite3_stmt*& stmt = own_[rollback_tx];
        if (stmt == nullptr) {
            sqlite3_prepare_v3(db_, own_sql[rollback_tx], -1, SQLITE_PREPARE_PERSISTENT, &stmt,
                               nullptr);
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

inline void SqliteStore::fail(int rc, std::string_view what, Kind kind, std::string_view sql) {
    std::string message =
        fmt::format("idem sqlite: {} failed: {}", what, detail::sqlite_store::error_text(db_, rc));
    if (!sql.empty()) message += fmt::format("; SQL: {}", sql);
    if (tx_open_ && tx_error_.empty()) tx_error_ = message;
    if (detail::sqlite_store::is_busy(rc)) throw store_timeout(message);
    if (kind == Kind::user) throw store_error(message);
    throw store_unavailable(message);
}

inline sqlite3_stmt* SqliteStore::own(Own which) {
    sqlite3_stmt*& stmt = own_[which];
    if (stmt == nullptr) {
        const int rc =
            sqlite3_prepare_v3(db_, own_sql[which], -1, SQLITE_PREPARE_PERSISTENT, &stmt, nullptr);
        if (rc != SQLITE_OK) {
            sqlite3_finalize(stmt);
            stmt = nullptr;
            fail(rc, "preparing an idem statement", Kind::idem, own_sql[which]);
        }
    }
    return stmt;
}

inline bool SqliteStore::has_more_statements(std::string_view rest) const {
    if (rest.find_first_not_of(" \t\r\n;") == std::string_view::npos) return false;
    sqlite3_stmt* stmt = nullptr;
    const int rc =
        sqlite3_prepare_v3(db_, rest.data(), static_cast<int>(rest.size()), 0, &stmt, nullptr);
    const bool more = rc != SQLITE_OK || stmt != nullptr;  // a comment alone prepares to null
    sqlite3_finalize(stmt);
    return more;
}

inline SqliteStore::Prepared SqliteStore::prepare(std::string_view sql, bool cache, Kind kind) {
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
void SqliteStore::bind_all(sqlite3_stmt* stmt, std::string_view sql, Kind kind,
                           const Args&... args) {
    const int expected = sqlite3_bind_parameter_count(stmt);
    if (expected != static_cast<int>(sizeof...(Args))) {
        throw usage_error(fmt::format(
            "idem sqlite: the SQL has {} parameter(s) but {} value(s) were given; SQL: {}",
            expected, sizeof...(Args), sql));
    }
    [[maybe_unused]] int index = 0;
    [[maybe_unused]] int rc = SQLITE_OK;
    if (!(... && ((rc = detail::sqlite_store::bind_value(stmt, ++index, args)) == SQLITE_OK))) {
        fail(rc, fmt::format("binding parameter {}", index), kind, sql);
    }
}

template <class... Args>
int SqliteStore::step_own(Own which, std::string_view what, const Args&... args) {
    sqlite3_stmt* stmt = own(which);
    detail::sqlite_store::StatementUse use(stmt, false);
    bind_all(stmt, own_sql[which], Kind::idem, args...);
    const int rc = sqlite3_step(stmt);
    if (rc != SQLITE_DONE && rc != SQLITE_ROW) fail(rc, what, Kind::idem);
    return sqlite3_changes(db_);
}

template <class... Args>
int SqliteStore::execute_impl(Kind kind, bool cache, std::string_view sql, const Args&... args) {
    const Prepared prepared = prepare(sql, cache, kind);
    detail::sqlite_store::StatementUse use(prepared.stmt, prepared.one_off);
    bind_all(prepared.stmt, sql, kind, args...);
    int rc = SQLITE_ROW;
    while (rc == SQLITE_ROW)
        rc = sqlite3_step(prepared.stmt);
    if (rc != SQLITE_DONE) fail(rc, "execute", kind, sql);
    return sqlite3_changes(db_);
}

template <class T, class Read, class... Args>
std::optional<T> SqliteStore::first_value(Kind kind, bool cache, std::string_view sql, Read read,
                                          const Args&... args) {
    const Prepared prepared = prepare(sql, cache, kind);
    detail::sqlite_store::StatementUse use(prepared.stmt, prepared.one_off);
    bind_all(prepared.stmt, sql, kind, args...);
    const int rc = sqlite3_step(prepared.stmt);
    if (rc == SQLITE_DONE) return std::nullopt;
    if (rc != SQLITE_ROW) fail(rc, "query", kind, sql);
    if (sqlite3_column_type(prepared.stmt, 0) == SQLITE_NULL) return std::nullopt;
    return read(prepared.stmt);
}

template <class... Args>
int SqliteStore::execute(std::string_view sql, const Args&... args) {
    Lock lock(*this, "SqliteStore::execute()");
    return execute_impl(Kind::user, true, sql, args...);
}

template <class... Args>
std::optional<std::int64_t> SqliteStore::query_int(std::string_view sql, const Args&... args) {
    Lock lock(*this, "SqliteStore::query_int()");
    return first_value<std::int64_t>(
        Kind::user, true, sql, [](sqlite3_stmt* s) { return sqlite3_column_int64(s, 0); }, args...);
}

template <class... Args>
std::optional<std::string> SqliteStore::query_text(std::string_view sql, const Args&... args) {
    Lock lock(*this, "SqliteStore::query_text()");
    return first_value<std::string>(
        Kind::user, true, sql,
        [](sqlite3_stmt* s) { return detail::sqlite_store::column_string(s, 0); }, args...);
}

inline SqliteStore::Transaction SqliteStore::begin() {
    Lock lock(*this, "begin()");
    open_transaction("begin()");
    return Transaction(*this, std::move(lock));
}

inline PurgeResult SqliteStore::purge(std::chrono::system_clock::duration older_than) {
    if (older_than.count() < 0) {
        throw usage_error("idem sqlite: purge() needs a non-negative age");
    }
    const std::int64_t at = detail::sqlite_store::to_unix_ms(now());
    const std::int64_t cutoff =
        at - std::chrono::duration_cast<std::chrono::milliseconds>(older_than).count();
    PurgeResult result;
    result.claims = purge_in_batches(purge_batch, "purge (claims)", cutoff);
    result.sent_intents =
        purge_in_batches(purge_outbox_batch, "purge (sent outbox intents)", cutoff);
    result.expired_locks = purge_in_batches(purge_locks_batch, "purge (expired locks)", at);
    return result;
}

inline std::size_t SqliteStore::purge_in_batches(Own which, std::string_view what,
                                                 std::int64_t before) {
    std::size_t total = 0;
    for (;;) {
        Transaction tx = begin();
        const int deleted = step_own(which, what, before, purge_batch_rows);
        tx.commit();
        total += static_cast<std::size_t>(deleted);
        if (deleted < purge_batch_rows) return total;
    }
}

inline std::optional<ClaimRecord> SqliteStore::find_claim(std::string_view scope,
                                                          std::string_view id) {
    using detail::sqlite_store::column_string;
    Lock lock(*this, "find_claim()");
    sqlite3_stmt* stmt = own(find_one_claim);
    detail::sqlite_store::StatementUse use(stmt, false);
    bind_all(stmt, own_sql[find_one_claim], Kind::idem, Blob{scope}, Blob{id});
    const int rc = sqlite3_step(stmt);
    if (rc == SQLITE_DONE) return std::nullopt;
    if (rc != SQLITE_ROW) fail(rc, "find_claim", Kind::idem);
    ClaimRecord found;
    found.scope = column_string(stmt, 0);
    found.message_id = column_string(stmt, 1);
    found.claimed_at = detail::sqlite_store::from_unix_ms(sqlite3_column_int64(stmt, 2));
    const std::string outcome = column_string(stmt, 3);
    found.reason = column_string(stmt, 4);
    found.fingerprint = column_string(stmt, 5);
    if (outcome == "claimed") {
        found.disposition = Disposition::in_progress;  // claimed, no outcome recorded yet
    } else if (!from_string(outcome, found.disposition)) {
        throw store_error(
            fmt::format("idem sqlite: unknown outcome '{}' stored in idem_claims", outcome));
    }
    return found;
}

inline std::vector<DeadLetter> SqliteStore::dead_letters() {
    using detail::sqlite_store::column_string;
    Lock lock(*this, "dead_letters()");
    sqlite3_stmt* stmt = own(all_dead_letters);
    detail::sqlite_store::StatementUse use(stmt, false);
    std::vector<DeadLetter> letters;
    int rc = SQLITE_ROW;
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
        DeadLetter letter;
        letter.scope = column_string(stmt, 0);
        letter.message_id = column_string(stmt, 1);
        const std::int64_t count = sqlite3_column_int64(stmt, 2);
        letter.delivery_count = count < 0 ? 0
                                : count > std::numeric_limits<std::uint32_t>::max()
                                    ? std::numeric_limits<std::uint32_t>::max()
                                    : static_cast<std::uint32_t>(count);
        letter.reason = column_string(stmt, 3);
        letter.payload = column_string(stmt, 4);
        letter.created_at = detail::sqlite_store::from_unix_ms(sqlite3_column_int64(stmt, 5));
        letters.push_back(std::move(letter));
    }
    if (rc != SQLITE_DONE) fail(rc, "dead_letters", Kind::idem);
    return letters;
}

inline bool SqliteStore::hold_lock(std::string_view key, std::string_view owner,
                                   std::chrono::milliseconds expire_after) {
    if (owner.empty()) throw usage_error("idem sqlite: hold_lock(): the owner must not be empty");
    Transaction tx = begin();
    const std::int64_t at = detail::sqlite_store::to_unix_ms(now());
    const std::int64_t expires = at + expire_after.count();
    // Inserts a free lock; takes over an expired one or renews our own; leaves another owner's
    // live lock alone (the DO UPDATE's WHERE is false: no change).
    const bool taken = step_own(lock_hold, "hold_lock", Blob{key}, Blob{owner}, expires, at) == 1;
    tx.commit();
    return taken;
}

inline bool SqliteStore::release_lock(std::string_view key, std::string_view owner) {
    Transaction tx = begin();
    const bool released = step_own(lock_release, "release_lock", Blob{key}, Blob{owner}) == 1;
    tx.commit();
    return released;
}

inline OutboxRow SqliteStore::read_outbox_row(sqlite3_stmt* stmt) {
    using detail::sqlite_store::column_string;
    using detail::sqlite_store::from_unix_ms;
    OutboxRow row;
    row.id = sqlite3_column_int64(stmt, 0);
    row.destination = column_string(stmt, 1);
    row.idempotency_key = column_string(stmt, 2);
    row.payload = column_string(stmt, 3);
    row.created_at = from_unix_ms(sqlite3_column_int64(stmt, 4));
    if (sqlite3_column_type(stmt, 5) != SQLITE_NULL) {
        row.sent_at = from_unix_ms(sqlite3_column_int64(stmt, 5));
    }
    const std::int64_t attempts = sqlite3_column_int64(stmt, 6);
    row.attempts = attempts < 0 ? 0
                   : attempts > std::numeric_limits<std::uint32_t>::max()
                       ? std::numeric_limits<std::uint32_t>::max()
                       : static_cast<std::uint32_t>(attempts);
    row.last_error = column_string(stmt, 7);
    row.next_attempt_at = from_unix_ms(sqlite3_column_int64(stmt, 8));
    row.parked = sqlite3_column_int64(stmt, 9) != 0;
    return row;
}

inline std::vector<OutboxRow> SqliteStore::lease_outbox(std::size_t limit,
                                                        std::chrono::milliseconds lease) {
    std::vector<OutboxRow> rows;
    if (limit == 0) return rows;
    const auto max_rows = static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max());
    const auto rows_wanted = static_cast<std::int64_t>(limit < max_rows ? limit : max_rows);
    Transaction tx = begin();
    const std::int64_t at = detail::sqlite_store::to_unix_ms(now());
    {
        sqlite3_stmt* stmt = own(outbox_lease);
        detail::sqlite_store::StatementUse use(stmt, false);
        bind_all(stmt, own_sql[outbox_lease], Kind::idem, at + lease.count(), at, rows_wanted);
        int rc = SQLITE_ROW;
        while ((rc = sqlite3_step(stmt)) == SQLITE_ROW)
            rows.push_back(read_outbox_row(stmt));
        if (rc != SQLITE_DONE) fail(rc, "lease_outbox", Kind::idem);
    }  // reset before COMMIT
    tx.commit();
    // The order of RETURNING rows is unspecified.
    std::sort(rows.begin(), rows.end(),
              [](const OutboxRow& a, const OutboxRow& b) { return a.id < b.id; });
    return rows;
}

inline void SqliteStore::mark_outbox_sent(std::int64_t id) {
    Transaction tx = begin();
    const std::int64_t at = detail::sqlite_store::to_unix_ms(now());
    if (step_own(outbox_sent, "mark_outbox_sent", id, at) != 1) {
        throw usage_error(fmt::format("idem sqlite: no outbox intent with id {}", id));
    }
    tx.commit();
}

inline void SqliteStore::mark_outbox_failed(std::int64_t id, std::string_view error,
                                            std::chrono::system_clock::time_point retry_at,
                                            bool park) {
    Transaction tx = begin();
    if (step_own(outbox_failed, "mark_outbox_failed", id, error,
                 detail::sqlite_store::to_unix_ms(retry_at), park) != 1) {
        throw usage_error(fmt::format("idem sqlite: no outbox intent with id {}", id));
    }
    tx.commit();
}

inline std::vector<OutboxRow> SqliteStore::outbox_rows() {
    Lock lock(*this, "outbox_rows()");
    sqlite3_stmt* stmt = own(outbox_all);
    detail::sqlite_store::StatementUse use(stmt, false);
    std::vector<OutboxRow> rows;
    int rc = SQLITE_ROW;
    while ((rc = sqlite3_step(stmt)) == SQLITE_ROW)
        rows.push_back(read_outbox_row(stmt));
    if (rc != SQLITE_DONE) fail(rc, "outbox_rows", Kind::idem);
    return rows;
}

// ---------------------------------------------------------------------------------------------
// SqliteStore::Transaction

inline SqliteStore& SqliteStore::Transaction::open(std::string_view what, bool committing) {
    if (store_ == nullptr) {
        throw usage_error(fmt::format("idem sqlite: {} on a moved-from transaction", what));
    }
    if (state_ != State::active) {
        throw usage_error(fmt::format(
            "idem sqlite: {} on a transaction that was already {}{}", what,
            state_ == State::committed ? "committed" : "rolled back",
            committing && state_ == State::committed ? " (a second commit() is an error)" : ""));
    }
    SqliteStore& store = *store_;
    if (sqlite3_get_autocommit(store.db_) != 0) {
        // The transaction ended without us: SQLite rolled it back after an error (disk full,
        // I/O error), or the effect ran COMMIT/ROLLBACK through the connection.
        const std::string cause = store.tx_error_;
        finish(State::rolled_back);
        if (!cause.empty()) {
            const std::string message = fmt::format(
                "idem sqlite: {} failed: SQLite rolled the transaction back after an earlier "
                "error ({}); nothing it wrote is stored",
                what, cause);
            if (committing) throw commit_failed(message);
            throw store_unavailable(message);
        }
        throw usage_error(fmt::format(
            "idem sqlite: {} failed: the transaction was ended by a statement run through the "
            "connection (COMMIT, ROLLBACK or END inside the effect?); idem ends its own "
            "transaction",
            what));
    }
    return store;
}

inline void SqliteStore::Transaction::finish(State state) noexcept {
    state_ = state;
    savepoints_ = 0;
    own_claims_.clear();
    if (store_ != nullptr) {
        store_->tx_open_ = false;
        store_->tx_error_.clear();
    }
    lock_.unlock();
}

inline void SqliteStore::Transaction::end_noexcept() noexcept {
    if (active()) {
        store_->rollback_noexcept();
        finish(State::rolled_back);
    }
}

inline ClaimResult SqliteStore::Transaction::claim(std::string_view scope, std::string_view id,
                                                   std::string_view fingerprint) {
    SqliteStore& store = open("claim()");
    if (const auto* own = own_claims_.find(scope, id)) return detail::OwnClaims::duplicate_of(*own);
    const std::int64_t now = detail::sqlite_store::to_unix_ms(store.now());
    ClaimResult result;
    if (store.step_own(claim_insert, "claim", Blob{scope}, Blob{id}, now, Blob{fingerprint}) == 1) {
        own_claims_.add(scope, id, fingerprint);
        result.status = ClaimStatus::claimed;
        return result;
    }
    // The row exists and was committed by another transaction.
    sqlite3_stmt* stmt = store.own(claim_outcome);
    detail::sqlite_store::StatementUse use(stmt, false);
    store.bind_all(stmt, own_sql[claim_outcome], Kind::idem, Blob{scope}, Blob{id});
    const int rc = sqlite3_step(stmt);
    if (rc == SQLITE_DONE) {
        throw store_unavailable(
            "idem sqlite: claim: INSERT OR IGNORE inserted no row, yet no claim exists for this "
            "id (a trigger or constraint on idem_claims?)");
    }
    if (rc != SQLITE_ROW) store.fail(rc, "claim (reading the recorded outcome)", Kind::idem);
    return detail::stored_duplicate(detail::sqlite_store::column_string(stmt, 0),
                                    detail::sqlite_store::column_string(stmt, 1), "sqlite");
}

inline sqlite3_stmt* SqliteStore::claim_rows_statement(std::size_t rows, bool returning) {
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

inline std::vector<ClaimResult> SqliteStore::Transaction::claim_many(
    std::string_view scope, const std::vector<std::string_view>& ids,
    const std::vector<std::string>& fingerprints) {
    namespace sq = detail::sqlite_store;
    SqliteStore& store = open("claim_many()");
    if (!fingerprints.empty() && fingerprints.size() != ids.size()) {
        throw usage_error("idem sqlite: claim_many() needs one fingerprint per id");
    }
    auto fingerprint = [&](std::size_t i) {
        return fingerprints.empty() ? std::string_view() : std::string_view(fingerprints[i]);
    };
    const std::int64_t now = sq::to_unix_ms(store.now());
    std::vector<ClaimResult> results(ids.size());
    std::vector<bool> decided(ids.size(), false);
    const std::size_t claimed_before_call = own_claims_.size();
    auto run = [&](std::size_t start, std::size_t rows, bool returning, auto&& on_row) {
        sqlite3_stmt* stmt = store.claim_rows_statement(rows, returning);
        sq::StatementUse use(stmt, false);
        int rc = sq::bind_value(stmt, 1, Blob{scope});
        if (rc == SQLITE_OK) rc = sq::bind_value(stmt, 2, now);
        for (std::size_t i = 0; i < rows && rc == SQLITE_OK; ++i) {
            rc = sq::bind_value(stmt, static_cast<int>(3 + 2 * i), Blob{ids[start + i]});
            if (rc == SQLITE_OK)
                rc =
                    sq::bind_value(stmt, static_cast<int>(4 + 2 * i), Blob{fingerprint(start + i)});
        }
        if (rc != SQLITE_OK) store.fail(rc, "claim_many (binding)", Kind::idem);
        while ((rc = sqlite3_step(stmt)) == SQLITE_ROW)
            on_row(stmt);
        if (rc != SQLITE_DONE) store.fail(rc, "claim_many", Kind::idem);
        return static_cast<std::size_t>(sqlite3_changes(store.db_));
    };
    auto claimed = [&](std::size_t i) {
        own_claims_.add(scope, ids[i], fingerprint(i));
        results[i].status = ClaimStatus::claimed;
        decided[i] = true;
    };
    for (std::size_t start = 0; start < ids.size(); start += claim_rows_max) {
        const std::size_t rows = std::min(claim_rows_max, ids.size() - start);
        // The common chunk, all of it new: a plain INSERT, and every row went in. Otherwise it
        // is undone and the RETURNING form says which rows did (this transaction holds the write
        // lock, so nothing else inserts in between).
        if (claimed_before_call == 0) {
            store.step_own(savepoint_effect, "claim_many (savepoint)");
            const std::size_t inserted = run(start, rows, false, [](sqlite3_stmt*) {});
            if (inserted == rows) {
                store.step_own(release_effect, "claim_many (release)");
                for (std::size_t i = start; i < start + rows; ++i)
                    claimed(i);
                continue;
            }
            store.step_own(rollback_to_effect, "claim_many (rollback to savepoint)");
            store.step_own(release_effect, "claim_many (release)");
        }
        // Each inserted id is claimed by its first copy in this chunk; later copies, and ids
        // claimed earlier in this transaction, are its own duplicates (RETURNING's row order is
        // not promised, so each row is matched with the first undecided copy of its id).
        run(start, rows, true, [&](sqlite3_stmt* stmt) {
            const auto* bytes = static_cast<const char*>(sqlite3_column_blob(stmt, 0));
            const std::string_view id(bytes == nullptr ? "" : bytes,
                                      static_cast<std::size_t>(sqlite3_column_bytes(stmt, 0)));
            for (std::size_t i = start; i < start + rows; ++i) {
                if (!decided[i] && ids[i] == id) {
                    claimed(i);
                    return;
                }
            }
        });
        for (std::size_t i = start; i < start + rows; ++i) {
            if (decided[i]) continue;
            if (const auto* own = own_claims_.find(scope, ids[i])) {
                results[i] = detail::OwnClaims::duplicate_of(*own);
                decided[i] = true;
            }
        }
    }
    // The rest were committed before: read their outcome like claim() does.
    for (std::size_t i = 0; i < ids.size(); ++i) {
        if (!decided[i]) results[i] = claim(scope, ids[i], fingerprint(i));
    }
    return results;
}

inline void SqliteStore::Transaction::unclaim(std::string_view scope, std::string_view id) {
    SqliteStore& store = open("unclaim()");
    if (own_claims_.remove(scope, id)) {
        store.step_own(claim_delete, "unclaim", Blob{scope}, Blob{id});
    }
}

inline void SqliteStore::Transaction::record_outcome(std::string_view scope, std::string_view id,
                                                     Disposition disposition,
                                                     std::string_view reason) {
    SqliteStore& store = open("record_outcome()");
    // Our own row already says 'processed' (and no reason): nothing to write.
    if (own_claims_.record(scope, id, disposition, reason, savepoints_)) return;
    store.step_own(record_update, "record_outcome", Blob{scope}, Blob{id}, to_string(disposition),
                   reason);
}

inline void SqliteStore::Transaction::dead_letter(const DeadLetter& letter) {
    SqliteStore& store = open("dead_letter()");
    const auto created = letter.created_at == std::chrono::system_clock::time_point{}
                             ? store.now()
                             : letter.created_at;
    store.step_own(dead_letter_insert, "dead_letter", Blob{letter.scope}, Blob{letter.message_id},
                   static_cast<std::int64_t>(letter.delivery_count), letter.reason,
                   Blob{letter.payload}, detail::sqlite_store::to_unix_ms(created));
}

inline bool SqliteStore::Transaction::try_lock(std::string_view key,
                                               std::chrono::milliseconds /*expire_after*/) {
    SqliteStore& store = open("try_lock()");
    const std::int64_t at = detail::sqlite_store::to_unix_ms(store.now());
    sqlite3_stmt* stmt = store.own(lock_live);
    detail::sqlite_store::StatementUse use(stmt, false);
    store.bind_all(stmt, own_sql[lock_live], Kind::idem, Blob{key}, at);
    const int rc = sqlite3_step(stmt);
    if (rc == SQLITE_ROW) return false;  // held with hold_lock() and not expired
    if (rc != SQLITE_DONE) store.fail(rc, "try_lock", Kind::idem);
    return true;
}

inline bool SqliteStore::Transaction::add_outbox(const OutboxIntent& intent) {
    SqliteStore& store = open("add_outbox()");
    const std::int64_t at = detail::sqlite_store::to_unix_ms(store.now());
    return store.step_own(outbox_insert, "add_outbox", intent.destination,
                          Blob{intent.idempotency_key}, Blob{intent.payload}, at) == 1;
}

inline void SqliteStore::Transaction::savepoint() {
    open("savepoint()").step_own(savepoint_effect, "savepoint");
    own_claims_.savepoint();
    ++savepoints_;
}

inline void SqliteStore::Transaction::rollback_to_savepoint() {
    SqliteStore& store = open("rollback_to_savepoint()");
    if (savepoints_ == 0) {
        throw usage_error("idem sqlite: rollback_to_savepoint() without an open savepoint()");
    }
    store.step_own(rollback_to_effect, "rollback_to_savepoint");
    store.step_own(release_effect, "rollback_to_savepoint (release)");
    own_claims_.rollback_to_savepoint(savepoints_);
    --savepoints_;
}

inline void SqliteStore::Transaction::release_savepoint() {
    SqliteStore& store = open("release_savepoint()");
    if (savepoints_ == 0) {
        throw usage_error("idem sqlite: release_savepoint() without an open savepoint()");
    }
    store.step_own(release_effect, "release_savepoint");
    own_claims_.release_savepoint(savepoints_);
    --savepoints_;
}

inline void SqliteStore::Transaction::commit() {
    SqliteStore& store = open("commit()", true);
    // A claim nobody recorded an outcome for is stored as claimed, not as the provisional
    // 'processed' its row was inserted with.
    for (const auto& claim : own_claims_.claims()) {
        if (claim.recorded_depth < 0) {
            store.step_own(record_update, "commit", Blob{claim.scope}, Blob{claim.id}, "claimed",
                           "");
        }
    }
    sqlite3_stmt* stmt = store.own(commit_tx);
    const int rc = sqlite3_step(stmt);
    if (rc == SQLITE_DONE) {
        sqlite3_reset(stmt);
        finish(State::committed);
        return;
    }
    std::string message = fmt::format("idem sqlite: commit failed: {}; rolled back",
                                      detail::sqlite_store::error_text(store.db_, rc));
    sqlite3_reset(stmt);
    if (!store.rollback_noexcept()) message += " (and the rollback failed too)";
    finish(State::rolled_back);
    throw commit_failed(message);
}

inline void SqliteStore::Transaction::rollback() {
    if (store_ == nullptr) throw usage_error("idem sqlite: rollback() on a moved-from transaction");
    if (state_ == State::committed) {
        throw usage_error("idem sqlite: rollback() on a transaction that was already committed");
    }
    if (state_ == State::rolled_back) return;
    const bool ok = store_->rollback_noexcept();
    const std::string error = ok ? std::string() : std::string(sqlite3_errmsg(store_->db_));
    finish(State::rolled_back);
    if (!ok) throw store_unavailable(fmt::format("idem sqlite: rollback failed: {}", error));
}

static_assert(detail::check_store<SqliteStore>());

IDEM_END_NAMESPACE
