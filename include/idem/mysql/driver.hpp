#pragma once
/// @file
/// @brief idem::mysql::Driver: MySQL / MariaDB (libmariadb, Connector/C) under the SQL store
/// written once (sql/store.hpp). It opens or borrows a `MYSQL*`, renders parameters as literals
/// (binary values as `X'…'` hex, text through mysql_real_escape_string), sets
/// innodb_lock_wait_timeout (and the isolation level, when asked) once per session, reconnects a
/// broken connection before the next transaction, notices when the server rolled a transaction
/// back (a deadlock) so nothing runs after it in autocommit, and maps the server's errors to
/// idem's exceptions. Its claims' error numbers are in mysql/errors.hpp, its result rows in
/// mysql/row.hpp. Only idem/mysql/'s headers and idem/store/mysql.hpp (and the test kit's
/// testing/mariadb_server.hpp) include <mysql.h>.

#include <mysql.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/blob.hpp"
#include "idem/config.hpp"
#include "idem/contract/store.hpp"
#include "idem/error.hpp"
#include "idem/mysql/errors.hpp"
#include "idem/mysql/literals.hpp"
#include "idem/mysql/options.hpp"
#include "idem/mysql/partitions.hpp"
#include "idem/mysql/row.hpp"
#include "idem/outcome.hpp"
#include "idem/sql/bind_traits.hpp"
#include "idem/sql/driver.hpp"
#include "idem/sql/own_claims.hpp"
#include "idem/sql/schema.hpp"
#include "idem/sql/statements.hpp"
#include "idem/sql/store.hpp"
#include "idem/sql/stored_outcome.hpp"

IDEM_BEGIN_NAMESPACE
namespace mysql {

/// MysqlStore's transaction face: conn().
template <class Tx>
class TransactionFace {
  public:
    /// @brief The connection, for the effect's own SQL inside this transaction (no COMMIT,
    /// ROLLBACK or DDL: DDL commits implicitly in MySQL).
    [[nodiscard]] MYSQL* conn() const noexcept {
        const auto* driver = static_cast<const Tx&>(*this).driver_or_null();
        return driver != nullptr ? driver->conn() : nullptr;
    }
};

/// The MySQL / MariaDB driver (the contract: sql/driver.hpp); claims in partitions are
/// mysql::Partitions' (mysql/partitions.hpp), mixed in.
class Driver : public Partitions<Driver> {
  public:
    /// Names the backend in messages ("idem mysql: ...").
    static constexpr std::string_view name = "mysql";
    /// Names the store class in messages.
    static constexpr std::string_view store_class = "MysqlStore";
    /// The transaction's MySQL members (conn()), mixed into basic_transaction.
    template <class Tx>
    using transaction_face = TransactionFace<Tx>;
    /// A result row, as run() and query() pass it to their callback.
    using Row = mysql::Row;

    /// Connects to @p endpoint and owns the connection. @throws usage_error for bad @p options or
    /// an endpoint without a database, store_unavailable when the server cannot be reached or
    /// refuses the login.
    Driver(const MysqlEndpoint& endpoint, const MysqlOptions& options) : owned_(true) {
        init(options);
        if (endpoint.database.empty()) {
            throw usage_error("idem mysql: MysqlEndpoint::database must name the database");
        }
        endpoint_ = endpoint;
        connect("connecting");
    }

    /// Uses the consumer's own connection, which it never closes, and sets its session up (lock
    /// wait timeout, isolation). @throws usage_error for a null connection, one opened with
    /// CLIENT_FOUND_ROWS, one inside a transaction, or bad @p options.
    Driver(MYSQL* conn, const MysqlOptions& options) : conn_(conn), owned_(false) {
        if (conn_ == nullptr)
            throw usage_error("idem mysql: MysqlStore needs a connection, got null");
        try {
            init(options);
            if ((conn_->client_flag & CLIENT_FOUND_ROWS) != 0) {
                throw usage_error(
                    "idem mysql: the borrowed connection was opened with CLIENT_FOUND_ROWS; idem "
                    "tells a new claim from an existing one by the rows an upsert changed, which "
                    "that flag hides. Open the connection without it");
            }
            if (in_transaction()) {
                throw usage_error(
                    "idem mysql: the borrowed connection is inside a transaction; construct the "
                    "MysqlStore outside any transaction (it may create its tables)");
            }
            setup_session("setting up the session");
        } catch (...) {
            conn_ = nullptr;  // borrowed: never closed
            throw;
        }
    }

    Driver(const Driver&) = delete;
    Driver& operator=(const Driver&) = delete;
    ~Driver() {
        if (owned_ && conn_ != nullptr) mysql_close(conn_);
    }

    /// The connection (owned or borrowed); null once forgotten.
    [[nodiscard]] MYSQL* conn() const noexcept { return conn_; }
    /// Sessions opened (1 + reconnects); for tests.
    [[nodiscard]] unsigned sessions() const noexcept { return sessions_; }

    /// Reasons and last errors are BLOBs: any bytes, sent as hex.
    static Blob text(std::string_view value) noexcept { return Blob{value}; }
    /// Every outbox intent fits the BLOB columns: nothing to refuse.
    static void check_outbox(const OutboxIntent&) noexcept {}

    // -- outside a transaction ----------------------------------------------------------------

    /// One statement outside a transaction (sql/driver.hpp), committed on its own; outbox_lease is
    /// the SELECT ... FOR UPDATE SKIP LOCKED and the UPDATE of the leased rows, in one transaction.
    /// @return the rows changed. @throws store_timeout for a lock wait or a deadlock,
    /// store_unavailable for other server errors and a lost connection.
    template <class OnRow, class... Args>
    std::int64_t run(sql::stmt which, std::string_view what, sql::access mode, OnRow&& on_row,
                     const Args&... args) {
        ready(what);
        const std::string sql = render_own(which, args...);
        if (mode == sql::access::read && autocommit()) return must(sql, Kind::idem, what, on_row);
        // One statement committed on its own; lease_outbox: SELECT … SKIP LOCKED, then UPDATE.
        std::int64_t changed = 0;
        alone(what, [&] {
            if (which == sql::stmt::outbox_lease) {
                std::vector<std::int64_t> ids;
                changed = must(sql, Kind::idem, what, [&](const Row& row) {
                    ids.push_back(row.int64(0));
                    on_row(row);
                });
                if (ids.empty()) return;
                std::string update =
                    fmt::format("UPDATE idem_outbox SET lease_until = {} WHERE id IN ({})",
                                literal(args...), fmt::join(ids, ", "));
                must(update, Kind::idem, what, sql::no_rows{});
                return;
            }
            changed = must(sql, Kind::idem, what, on_row);
            if (changed == 0 && which == sql::stmt::outbox_sent) {
                // Unchanged (sent again at the same millisecond) is not "no such intent".
                changed =
                    must(fmt::format("SELECT id FROM idem_outbox WHERE id = {}", literal(args...)),
                         Kind::idem, what, sql::no_rows{});
            }
        });
        return changed;
    }

    /// Takes, renews or takes over (when expired) the idem_locks row of @p key for @p owner until
    /// @p expires_ms, committed at once, without waiting for a transaction that holds it with
    /// try_lock() (then not ours). @return whether @p owner holds it now.
    bool hold_lock(std::string_view key, std::string_view owner, std::int64_t expires_ms,
                   std::int64_t now_ms) {
        ready("hold_lock()");
        bool ours = false;
        alone("hold_lock", [&] {
            // The row (inserted: ours), without waiting for a transaction holding try_lock().
            std::int64_t inserted = 0;
            const std::string take =
                "SET STATEMENT innodb_lock_wait_timeout = 0 FOR INSERT INTO idem_locks(lock_key, "
                "owner, expires_at) VALUES (" +
                render_list(Blob{key}, Blob{owner}, expires_ms) +
                ") ON DUPLICATE KEY UPDATE lock_key = lock_key";
            const unsigned code = exec(take, sql::no_rows{}, inserted);
            if (code == er_lock_wait_timeout) return;  // a transaction holds it: not ours
            if (code != 0) raise(code, Kind::idem, "hold_lock", take);
            if (inserted == 1) {
                ours = true;
                return;
            }
            must(render_own(sql::stmt::lock_hold, Blob{key}, Blob{owner}, expires_ms, now_ms),
                 Kind::idem, "hold_lock", sql::no_rows{});
            must("SELECT owner FROM idem_locks WHERE lock_hash = UNHEX(SHA2(" +
                     render_list(Blob{key}) + ", 256))",
                 Kind::idem, "hold_lock", [&](const Row& row) { ours = row.bytes(0) == owner; });
        });
        return ours;
    }

    // -- the transaction ----------------------------------------------------------------------

    /// START TRANSACTION, reconnecting once when the connection was lost (nothing was sent in it
    /// yet). @throws as sql/driver.hpp's begin().
    void begin(std::string_view what) {
        ready(what);
        std::int64_t n = 0;
        unsigned code = exec("START TRANSACTION", sql::no_rows{}, n);
        if (code != 0 && is_lost(code)) {
            // Nothing was sent in a transaction yet: reconnecting is safe.
            reconnect(what);
            code = exec("START TRANSACTION", sql::no_rows{}, n);
        }
        if (code != 0) raise(code, Kind::idem, what, "START TRANSACTION");
        tx_open_ = true;
        rolled_back_ = false;
        snapshot_taken_ = false;
        savepoint_depth_ = 0;
        tx_error_.clear();
    }

    /// A write inside the transaction, run at once; nothing once the server rolled the transaction
    /// back (commit() then fails).
    template <class... Args>
    void write(sql::stmt which, std::string_view what, const Args&... args) {
        if (rolled_back_) return;  // commit() fails; nothing may run in autocommit now
        must(render_own(which, args...), Kind::idem, what, sql::no_rows{});
    }

    /// One statement inside the transaction; @p on_row per result row. @return the rows changed.
    /// @throws store_unavailable once the server rolled the transaction back, or as run().
    template <class OnRow, class... Args>
    std::int64_t query(sql::stmt which, std::string_view what, OnRow&& on_row,
                       const Args&... args) {
        refuse_if_rolled_back(what);
        snapshot_taken_ = true;  // a read under REPEATABLE READ fixes the snapshot
        return must(render_own(which, args...), Kind::idem, what, on_row);
    }

    /// Whether the transaction is still there: lost with the connection (@p cause says why), ended
    /// by the effect's COMMIT, ROLLBACK or DDL (an implicit commit), else ok.
    sql::tx_health health(bool /*after_user_sql*/, std::string& cause) const {
        if (broken_) {
            cause = fmt::format(
                "the connection to MySQL was lost{}{}; the transaction is gone and nothing it "
                "wrote is stored",
                tx_error_.empty() ? "" : ": ", tx_error_);
            return sql::tx_health::lost;
        }
        if (rolled_back_) return sql::tx_health::ok;  // each member refuses; commit() fails
        // COMMIT / ROLLBACK or DDL (an implicit commit) through the connection.
        if (tx_open_ && (conn_->server_status & SERVER_STATUS_IN_TRANS) == 0) {
            return sql::tx_health::ended;
        }
        return sql::tx_health::ok;
    }

    /// INSERT ... ON DUPLICATE KEY UPDATE of the claim: claimed when the row went in (added to @p
    /// own), in_progress when another transaction holds the id past innodb_lock_wait_timeout, else
    /// the stored duplicate. @throws store_unavailable for a server error, or when the conflicting
    /// row keeps disappearing (purged while claiming).
    ClaimResult claim(sql::OwnClaims& own, std::string_view scope, std::string_view id,
                      std::string_view fingerprint, std::int64_t now_ms) {
        refuse_if_rolled_back("claim");
        if (claims_partitioned()) return claim_in_partitions(own, scope, id, fingerprint, now_ms);
        const std::string insert =
            render_own(sql::stmt::claim_insert, Blob{scope}, Blob{id}, now_ms, Blob{fingerprint});
        // Rarely more than one pass: only when the row we waited for vanished again (purge).
        for (int attempt = 0; attempt < 3; ++attempt) {
            std::int64_t inserted = 0;
            const unsigned code = exec(insert, sql::no_rows{}, inserted);
            if (code == er_lock_wait_timeout) {
                // Another live transaction holds this id past innodb_lock_wait_timeout. InnoDB
                // undid this statement only (unless innodb_rollback_on_timeout: then
                // rolled_back_ says so and commit() fails).
                ClaimResult result;
                result.status = ClaimStatus::in_progress;
                return result;
            }
            // The claims were made partitions since (the key is the claim's to write).
            if (code == er_no_default_for_field || code == er_constraint_failed)
                claims_table_changed();
            if (code != 0) raise(code, Kind::idem, "claim", {});
            if (inserted == 1) {
                own.add(scope, id, fingerprint);
                return ClaimResult{};  // claimed
            }
            std::optional<ClaimResult> stored;
            must(render_own(sql::stmt::claim_outcome, Blob{scope}, Blob{id}), Kind::idem,
                 "claim (reading the recorded outcome)", [&](const Row& row) {
                     stored = sql::stored_duplicate(row.bytes(0), row.bytes(1), name);
                 });
            if (stored) return *stored;
        }
        throw store_unavailable(
            "idem mysql: claim: the conflicting claim kept disappearing (purged while claiming?)");
    }

    /// The claims of @p ids in order, one statement each (sql::claim_each()).
    std::vector<ClaimResult> claim_many(sql::OwnClaims& own, std::string_view scope,
                                        const std::vector<std::string_view>& ids,
                                        const std::vector<std::string>& fingerprints,
                                        std::int64_t now_ms) {
        if (claims_partitioned())
            return claim_many_in_partitions(own, scope, ids, fingerprints, now_ms);
        return sql::claim_each(*this, own, scope, ids, fingerprints, now_ms);
    }

    /// The overlap lock: the idem_locks row of @p key locked until this transaction ends, without
    /// waiting; false when another transaction holds it or an unexpired hold_lock() row does.
    bool try_lock(std::string_view key, std::int64_t now_ms) {
        refuse_if_rolled_back("try_lock");
        // The idem_locks row locked until this transaction ends (a placeholder when new); a
        // transaction holding it already makes the INSERT time out at once (wait 0).
        const std::string take = render_own(sql::stmt::lock_advisory, Blob{key});
        std::int64_t n = 0;
        const unsigned code = exec(take, sql::no_rows{}, n);
        if (code == er_lock_wait_timeout) return false;
        if (code != 0) raise(code, Kind::idem, "try_lock", {});
        bool held = false;
        must(render_own(sql::stmt::lock_live, Blob{key}, now_ms), Kind::idem, "try_lock",
             [&](const Row&) { held = true; });
        return !held;
    }

    /// SAVEPOINT idem_effect_<depth>: a name per depth, since MySQL replaces a savepoint of the
    /// same name where PostgreSQL stacks them.
    void savepoint() {
        ++savepoint_depth_;
        if (rolled_back_) return;
        must(fmt::format("SAVEPOINT idem_effect_{}", savepoint_depth_), Kind::idem, "savepoint",
             sql::no_rows{});
    }
    /// ROLLBACK TO idem_effect_<depth>; the savepoint itself stays, as after a release.
    void rollback_to_savepoint() {
        const int depth = savepoint_depth_--;
        if (rolled_back_) return;
        must(fmt::format("ROLLBACK TO SAVEPOINT idem_effect_{}", depth), Kind::idem,
             "rollback_to_savepoint", sql::no_rows{});
    }
    /// Sends nothing: RELEASE only forgets the savepoint (nothing is written or undone), the same
    /// depth's next SAVEPOINT replaces it, and the transaction's end drops it. A round trip less
    /// per message of a batch.
    void release_savepoint() noexcept { --savepoint_depth_; }

    /// COMMIT. @throws commit_failed when the server refuses it or had rolled the transaction back
    /// (all rolled back), store_unavailable when the connection is lost during it (the outcome is
    /// unknown).
    void commit() {
        if (rolled_back_) {
            const bool clean = rollback_noexcept();
            throw commit_failed(fmt::format(
                "idem mysql: commit failed: the server had rolled the transaction back ({}); "
                "nothing it wrote is stored{}",
                tx_error_, clean ? "" : " (and the rollback failed)"));
        }
        std::int64_t n = 0;
        const unsigned code = exec("COMMIT", sql::no_rows{}, n);
        if (code == 0) return;
        const std::string message = error_message(code);
        if (is_lost(code)) {
            broken_ = true;
            throw store_unavailable(fmt::format(
                "idem mysql: commit: the outcome is unknown: {} (a redelivery finds the claim if "
                "the commit went through)",
                message));
        }
        const bool clean = rollback_noexcept();
        throw commit_failed(fmt::format("idem mysql: commit failed: {}; rolled back{}", message,
                                        clean ? "" : " (and the rollback failed too)"));
    }

    /// ROLLBACK (and the schema's named lock released). @return true when no transaction is left
    /// open (a lost session's ended with it).
    bool rollback_noexcept() noexcept {
        if (conn_ == nullptr || broken_) return true;  // the server ends a dead session's tx
        const bool ok = mysql_real_query(conn_, "ROLLBACK", 8) == 0;
        if (!ok && is_lost(mysql_errno(conn_))) broken_ = true;
        if (schema_locked_ && !broken_) {
            const char* release = "DO RELEASE_LOCK(CONCAT('idem_schema:', DATABASE()))";
            mysql_real_query(conn_, release, std::strlen(release));
        }
        schema_locked_ = false;
        return ok || broken_;
    }

    /// The client's message for the connection's last failure.
    [[nodiscard]] std::string last_error() const {
        return conn_ != nullptr ? mysql_error(conn_) : "no connection";
    }

    /// Forgets the transaction's state (open, rolled back by the server, its first error).
    void end_transaction() noexcept {
        tx_open_ = false;
        rolled_back_ = false;
        tx_error_.clear();
    }

    // -- the effect's own SQL: `?` placeholders ------------------------------------------------

    /// The effect's own statement with `?` placeholders, in the transaction or alone
    /// (sql::context). @return the rows changed. @throws store_timeout for a lock wait or a
    /// deadlock, store_unavailable for a lost connection, store_error naming the SQL for other
    /// errors, usage_error for a wrong parameter count.
    template <class... Args>
    std::int64_t execute(sql::context where, std::string_view sql, const Args&... args) {
        return user(where, "execute", sql, sql::no_rows{}, args...);
    }
    /// The first column of the first row of the effect's query, as an integer; nullopt without a
    /// row or for NULL. @throws store_error when it is not an integer, or as execute().
    template <class... Args>
    std::optional<std::int64_t> query_int(sql::context where, std::string_view sql,
                                          const Args&... args) {
        std::optional<std::string> text = query_text(where, sql, args...);
        if (!text) return std::nullopt;
        std::int64_t value = 0;
        const auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), value);
        if (ec != std::errc() || end != text->data() + text->size()) {
            throw store_error(fmt::format(
                "idem mysql: query_int: the first column is '{}', not an integer; SQL: {}", *text,
                sql));
        }
        return value;
    }
    /// The first column of the first row of the effect's query, as text; nullopt without a row or
    /// for NULL. @throws as execute().
    template <class... Args>
    std::optional<std::string> query_text(sql::context where, std::string_view sql,
                                          const Args&... args) {
        std::optional<std::string> value;
        bool first = true;
        user(
            where, "query", sql,
            [&](const Row& row) {
                if (first && !row.is_null(0)) value = row.bytes(0);
                first = false;
            },
            args...);
        return value;
    }

    // -- the schema -----------------------------------------------------------------------------

    /// The recorded schema version; nullopt when the idem_schema table does not exist in the
    /// database.
    std::optional<std::int64_t> stored_schema_version() {
        std::int64_t tables = 0;
        must(
            "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() "
            "AND table_name = 'idem_schema'",
            Kind::idem, "reading the idem schema", [&](const Row& row) { tables = row.int64(0); });
        if (tables == 0) return std::nullopt;
        return read_schema_version();
    }
    /// Takes the database's named lock `idem_schema:<db>` (DDL commits implicitly, so a lock
    /// instead of a transaction serializes processes starting at once), then creates idem_schema.
    /// @throws store_timeout after 60 s of waiting for the lock.
    void begin_schema_change() {
        // DDL commits implicitly in MySQL: a named lock (per database) serializes the
        // processes that start at once on an empty database instead of a transaction.
        std::int64_t got = 0;
        must("SELECT GET_LOCK(CONCAT('idem_schema:', DATABASE()), 60)", Kind::idem,
             "locking the idem schema", [&](const Row& row) { got = row.int64(0); });
        if (got != 1) {
            throw store_timeout(
                "idem mysql: waited 60 s for another process creating the idem "
                "schema (GET_LOCK)");
        }
        schema_locked_ = true;
        execute_ddl("CREATE TABLE IF NOT EXISTS idem_schema(version INT NOT NULL) ENGINE=InnoDB");
    }
    /// One DDL statement of the migration (committed at once by MySQL). A migration stopped
    /// after an ALTER and before its version was written runs again from its first statement:
    /// a column or key that ALTER added already is there, not an error (MySQL 8 has no
    /// ADD COLUMN IF NOT EXISTS).
    void execute_ddl(std::string_view sql) {
        const std::string text(sql);
        std::int64_t count = 0;
        const unsigned code = exec(text, sql::no_rows{}, count);
        if (code == 0 || code == er_dup_fieldname || code == er_dup_keyname) return;
        raise(code, Kind::idem, "creating the idem schema", text);
    }
    /// The version in idem_schema, inside begin_schema_change().
    std::optional<std::int64_t> read_schema_version() {
        std::optional<std::int64_t> version;
        must("SELECT MAX(version) FROM idem_schema", Kind::idem, "reading the idem schema version",
             [&](const Row& row) {
                 if (!row.is_null(0)) version = row.int64(0);
             });
        return version;
    }
    /// Records @p version as the schema's.
    void write_schema_version(int version) {
        execute_ddl("DELETE FROM idem_schema");
        execute_ddl(fmt::format("INSERT INTO idem_schema(version) VALUES ({})", version));
    }
    /// Releases the named lock: the migration is done.
    void commit_schema_change() {
        execute_ddl("DO RELEASE_LOCK(CONCAT('idem_schema:', DATABASE()))");
        schema_locked_ = false;
    }
    /// "the database '<name>'", for messages about the schema.
    [[nodiscard]] std::string schema_location() const {
        return conn_ != nullptr && conn_->db != nullptr
                   ? fmt::format("the database '{}'", conn_->db)
                   : std::string("the database");
    }
    /// Where else the tables could be, for messages: another database.
    [[nodiscard]] std::string_view schema_elsewhere() const noexcept {
        return "another database (MysqlEndpoint::database)";
    }
    /// The DDL from @p from_version to the current one (sql/schema.hpp).
    [[nodiscard]] std::vector<std::string> schema_ddl(int from_version) const {
        return sql::mysql_schema_ddl(from_version);
    }

  private:
    friend class Partitions<Driver>;
    enum class Kind { idem, user };  // which exception a server error becomes

    void init(const MysqlOptions& options) {
        static const bool library = mysql_library_init(0, nullptr, nullptr) == 0;
        if (!library) throw store_unavailable("idem mysql: mysql_library_init failed");
        if (options.lock_wait_timeout.count() < 1 ||
            options.lock_wait_timeout.count() > 1073741824) {
            throw usage_error(
                "idem mysql: lock_wait_timeout must be between 1 s and 1073741824 s "
                "(innodb_lock_wait_timeout)");
        }
        if (options.read_timeout.count() > 0 && options.read_timeout <= options.lock_wait_timeout) {
            throw usage_error(
                "idem mysql: read_timeout must be longer than lock_wait_timeout, or a claim "
                "waiting for a row lock would be cut off as a lost connection");
        }
        configure_partitions(options);
        options_ = options;
    }

    void connect(std::string_view what) {
        MYSQL* conn = mysql_init(nullptr);
        if (conn == nullptr) throw store_unavailable("idem mysql: mysql_init: out of memory");
        const auto seconds = [](std::chrono::seconds s) {
            return static_cast<unsigned>(s.count() < 0 ? 0 : s.count());
        };
        const unsigned connect_s = seconds(options_.connect_timeout);
        const unsigned read_s = seconds(options_.read_timeout);
        const unsigned write_s = seconds(options_.write_timeout);
        const my_bool no = 0;
        mysql_options(conn, MYSQL_OPT_CONNECT_TIMEOUT, &connect_s);
        mysql_options(conn, MYSQL_OPT_READ_TIMEOUT, &read_s);
        mysql_options(conn, MYSQL_OPT_WRITE_TIMEOUT, &write_s);
        mysql_options(conn, MYSQL_OPT_RECONNECT, &no);  // never behind idem's back
        mysql_options(conn, MYSQL_SET_CHARSET_NAME, "utf8mb4");
        const MysqlEndpoint& e = endpoint_;
        const char* socket = e.unix_socket.empty() ? nullptr : e.unix_socket.c_str();
        if (mysql_real_connect(conn, socket != nullptr ? "localhost" : e.host.c_str(),
                               e.user.c_str(), e.password.c_str(), e.database.c_str(), e.port,
                               socket, 0) == nullptr) {
            const std::string message = fmt::format(
                "idem mysql: {}: cannot connect to {}: {} ({})", what,
                socket != nullptr ? e.unix_socket : fmt::format("{}:{}", e.host, e.port),
                mysql_error(conn), mysql_errno(conn));
            mysql_close(conn);
            throw store_unavailable(message);
        }
        conn_ = conn;
        broken_ = false;
        try {
            setup_session(what);
        } catch (...) {
            mysql_close(conn_);
            conn_ = nullptr;
            throw;
        }
    }

    /// innodb_lock_wait_timeout and the isolation level, once per session.
    void setup_session(std::string_view what) {
        std::string set = fmt::format("SET SESSION innodb_lock_wait_timeout = {}",
                                      options_.lock_wait_timeout.count());
        must(set, Kind::idem, what, sql::no_rows{});
        if (options_.isolation) {
            must(*options_.isolation == MysqlIsolation::read_committed
                     ? "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"
                     : "SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ",
                 Kind::idem, what, sql::no_rows{});
        }
        session_ = mysql_thread_id(conn_);
        ++sessions_;
    }

    void reconnect(std::string_view what) {
        if (owned_) {
            MYSQL* old = std::exchange(conn_, nullptr);
            if (old != nullptr) mysql_close(old);
            connect(what);
            return;
        }
        // Borrowed: libmariadb reconnects the same handle with its own parameters.
        if (mariadb_reconnect(conn_) != 0) {
            broken_ = true;
            throw store_unavailable(fmt::format(
                "idem mysql: {}: the connection to MySQL broke and reconnecting failed: {}", what,
                mysql_error(conn_)));
        }
        broken_ = false;
        setup_session(what);
    }

    [[nodiscard]] bool autocommit() const noexcept {
        return (conn_->server_status & SERVER_STATUS_AUTOCOMMIT) != 0;
    }
    [[nodiscard]] bool in_transaction() const noexcept {
        return (conn_->server_status & SERVER_STATUS_IN_TRANS) != 0;
    }

    /// Before work outside an idem transaction and before begin().
    void ready(std::string_view what) {
        if (conn_ == nullptr || broken_) reconnect(what);
        if (mysql_thread_id(conn_) != session_) setup_session(what);  // reset by the consumer
        if (in_transaction()) {
            throw usage_error(fmt::format(
                "idem mysql: {}: the connection is already inside a transaction. idem needs its "
                "own START TRANSACTION so the claim and the effect commit together: commit or "
                "roll back your transaction first, and write the effect's rows through the idem "
                "transaction (Transaction::execute() or Transaction::conn())",
                what));
        }
    }

    /// A write outside any transaction, atomically (also on a session with autocommit off).
    template <class Body>
    void alone(std::string_view what, Body&& body) {
        must("START TRANSACTION", Kind::idem, what, sql::no_rows{});
        try {
            body();
            must("COMMIT", Kind::idem, what, sql::no_rows{});
        } catch (...) {
            rollback_noexcept();
            throw;
        }
    }

    void refuse_if_rolled_back(std::string_view what) const {
        if (!rolled_back_) return;
        throw store_unavailable(fmt::format(
            "idem mysql: {}: the server rolled the transaction back earlier ({}); nothing it "
            "wrote is stored",
            what, tx_error_));
    }

    [[nodiscard]] std::string error_message(unsigned code) const {
        return fmt::format("{} (MySQL error {})", mysql_error(conn_), code);
    }

    /// Runs one statement; on_row per result row. @return 0 or the error number (the error is
    /// also noted: a lost connection, a transaction the server rolled back).
    template <class OnRow>
    unsigned exec(const std::string& sql, OnRow&& on_row, std::int64_t& count) {
        count = 0;
        if (mysql_real_query(conn_, sql.data(), static_cast<unsigned long>(sql.size())) != 0) {
            return failed();
        }
        for (;;) {
            if (MYSQL_RES* result = mysql_store_result(conn_)) {
                std::int64_t rows = 0;
                while (MYSQL_ROW row = mysql_fetch_row(result)) {
                    ++rows;
                    try {
                        on_row(Row(row, mysql_fetch_lengths(result)));
                    } catch (...) {
                        mysql_free_result(result);
                        while (mysql_next_result(conn_) == 0)
                            mysql_free_result(mysql_store_result(conn_));
                        throw;
                    }
                }
                mysql_free_result(result);
                count = rows;
            } else if (mysql_field_count(conn_) != 0) {
                return failed();
            } else {
                count = static_cast<std::int64_t>(mysql_affected_rows(conn_));
            }
            const int next = mysql_next_result(conn_);
            if (next < 0) return 0;
            if (next > 0) return failed();
        }
    }

    unsigned failed() {
        const unsigned code = mysql_errno(conn_);
        last_message_ = error_message(code);
        if (is_lost(code)) {
            broken_ = true;
        } else if (tx_open_ && !rolled_back_) {
            // A deadlock (and with innodb_rollback_on_timeout a lock wait timeout) rolls the
            // whole transaction back: later statements would run in autocommit. Ask.
            bool inside = false;
            if (mysql_real_query(conn_, "SELECT @@in_transaction", 23) == 0) {
                if (MYSQL_RES* result = mysql_store_result(conn_)) {
                    MYSQL_ROW row = mysql_fetch_row(result);
                    inside = row != nullptr && row[0] != nullptr && row[0][0] == '1';
                    mysql_free_result(result);
                }
            } else if (is_lost(mysql_errno(conn_))) {
                broken_ = true;
            }
            if (!inside && !broken_) {
                rolled_back_ = true;
                rolled_back_timeout_ = is_timeout(code);
            }
        }
        if (tx_open_ && tx_error_.empty()) tx_error_ = last_message_;
        return code;
    }

    [[noreturn]] void raise(unsigned code, Kind kind, std::string_view what, std::string_view sql) {
        std::string message = fmt::format("idem mysql: {} failed: {}", what, last_message_);
        if (kind == Kind::user && !sql.empty()) message += fmt::format("; SQL: {}", sql);
        if (is_lost(code)) throw store_unavailable(message);
        if (is_timeout(code)) throw store_timeout(message);
        if (kind == Kind::user) throw store_error(message);
        throw store_unavailable(message);
    }

    /// exec() that throws on failure. @return rows read, or the affected rows.
    template <class OnRow>
    std::int64_t must(const std::string& sql, Kind kind, std::string_view what, OnRow&& on_row) {
        std::int64_t count = 0;
        const unsigned code = exec(sql, on_row, count);
        if (code != 0) raise(code, kind, what, sql);
        return count;
    }

    template <class OnRow, class... Args>
    std::int64_t user(sql::context where, std::string_view what, std::string_view sql,
                      OnRow&& on_row, const Args&... args) {
        const std::string text = render_user(sql, args...);
        if (where == sql::context::alone) {
            ready(fmt::format("MysqlStore::{}()", what));
        } else if (rolled_back_) {
            const std::string message = fmt::format(
                "idem mysql: {}: the server rolled the transaction back earlier ({}); SQL: {}",
                what, tx_error_, sql);
            if (rolled_back_timeout_) throw store_timeout(message);
            throw store_unavailable(message);
        }
        if (where != sql::context::alone) snapshot_taken_ = true;  // the effect's SQL may read
        return must(text, Kind::user, what, on_row);
    }

    // -- literals (mysql/literals.hpp) ---------------------------------------------------------

    /// The first argument's literal.
    [[nodiscard]] std::string literal() const { return {}; }
    template <class First, class... Rest>
    std::string literal(const First& first, const Rest&...) const {
        std::string out;
        append(conn_, out, first);
        return out;
    }
    template <class... Args>
    std::string render_list(const Args&... args) const {
        return fmt::format("{}", fmt::join(literals(conn_, args...), ", "));
    }
    template <class... Args>
    std::string render_own(sql::stmt which, const Args&... args) const {
        return render_numbered(statements_[which], literals(conn_, args...));
    }
    template <class... Args>
    std::string render_user(std::string_view sql, const Args&... args) const {
        return render_placeholders(sql, literals(conn_, args...));
    }

    MYSQL* conn_ = nullptr;
    bool owned_ = false;
    MysqlEndpoint endpoint_;
    MysqlOptions options_;
    sql::statement_table statements_ = sql::mysql_statements();
    unsigned long session_ = 0;  ///< thread id whose session has our settings
    unsigned sessions_ = 0;
    bool broken_ = false;       ///< the connection is lost; the next begin() reconnects
    bool tx_open_ = false;      ///< a transaction of this driver is running
    int savepoint_depth_ = 0;   ///< savepoints open (idem_effect_1 ... _<depth>)
    bool rolled_back_ = false;  ///< the server rolled it back (deadlock …): refuse, fail commit
    bool rolled_back_timeout_ = false;
    bool snapshot_taken_ = false;  ///< a read may have fixed a REPEATABLE READ snapshot
    bool schema_locked_ = false;   ///< GET_LOCK('idem_schema:<db>') held
    std::string tx_error_;         ///< first failure inside the transaction
    std::string last_message_;
};

}  // namespace mysql
IDEM_END_NAMESPACE
