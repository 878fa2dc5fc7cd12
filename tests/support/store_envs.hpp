#pragma once
// One environment per store for the typed conformance suite (idem/testing/conformance.hpp says
// what an environment provides): how to build the store on a controllable clock, how an effect
// writes a row through the claim's transaction, how to count committed rows, and how to make the
// next commit really fail.

#include "backends.hpp"

#if IDEM_HAS_SQLITE
#include <sqlite3.h>
#endif

#include <chrono>
#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "idem/store/memory.hpp"
#include "idem/testing/temp_dir.hpp"
#if IDEM_HAS_SQLITE
#include "idem/store/sqlite.hpp"
#endif

namespace idem_test {

using time_point = std::chrono::system_clock::time_point;

inline time_point test_epoch() {
    return time_point{} + std::chrono::hours(24 * 365 * 50);
}

struct MemoryEnv {
    using Store = idem::MemoryStore;
    static constexpr const char* name = "memory";

    time_point now = test_epoch();
    std::unique_ptr<Store> store;

    MemoryEnv() {
        idem::MemoryStoreOptions options;
        options.clock = [this] { return now; };
        store = std::make_unique<Store>(options);
    }

    template <class Tx>
    static void write_effect(Tx& tx, const std::string& key) {
        tx.put("effects", key, "applied");
    }
    template <class Tx>
    void make_commit_fail(Tx&) {
        store->inject(idem::Fault::commit);
    }
    /// No server: every begin() fails as an unreachable store would (idem::injected_fault, a
    /// store_unavailable), and so does the probe (begin + rollback), until start_server().
    void stop_server() { store->inject(idem::Fault::begin, 1'000'000); }
    void start_server() { store->clear_faults(idem::Fault::begin); }
    /// The redrive suite: each redrive's transaction fails at its commit until accept_redrives().
    void refuse_redrives() { store->inject(idem::Fault::commit, 1'000'000); }
    void accept_redrives() { store->clear_faults(idem::Fault::commit); }
    std::size_t effect_rows() { return store->count("effects"); }
    bool has_effect(const std::string& key) { return store->get("effects", key).has_value(); }
};

#if IDEM_HAS_SQLITE
/// Runs one query returning a single integer on a connection (test-side reads only).
inline long long sqlite_count(sqlite3* db, const char* sql, const std::string* blob = nullptr) {
    sqlite3_stmt* stmt = nullptr;
    if (sqlite3_prepare_v2(db, sql, -1, &stmt, nullptr) != SQLITE_OK) {
        throw std::runtime_error(sqlite3_errmsg(db));
    }
    if (blob != nullptr) {
        sqlite3_bind_blob(stmt, 1, blob->data(), static_cast<int>(blob->size()), SQLITE_TRANSIENT);
    }
    long long value = -1;
    if (sqlite3_step(stmt) == SQLITE_ROW) value = sqlite3_column_int64(stmt, 0);
    sqlite3_finalize(stmt);
    return value;
}

inline void sqlite_exec(sqlite3* db, const char* sql) {
    char* message = nullptr;
    if (sqlite3_exec(db, sql, nullptr, nullptr, &message) != SQLITE_OK) {
        std::string text = message ? message : "unknown";
        sqlite3_free(message);
        throw std::runtime_error(text);
    }
}

struct SqliteEnv {
    using Store = idem::SqliteStore;
    static constexpr const char* name = "sqlite";

    idem::testing::TempDir dir;
    time_point now = test_epoch();
    std::unique_ptr<Store> store;

    SqliteEnv() {
        open();
        sqlite_exec(store->db(),
                    "CREATE TABLE effects(k BLOB NOT NULL);"
                    "CREATE TABLE parents(id INTEGER PRIMARY KEY);"
                    "CREATE TABLE children(parent_id INTEGER REFERENCES parents(id) "
                    "  DEFERRABLE INITIALLY DEFERRED);");
    }
    /// Closes the database file and opens it again (the conformance suite's reopen test).
    void reopen() {
        store.reset();
        open();
    }
    void open() {
        store = another_store();
        sqlite_exec(store->db(), "PRAGMA foreign_keys=ON");
    }
    /// A second connection on the same file (the redrive suite's race).
    std::unique_ptr<Store> another_store() {
        idem::SqliteOptions options;
        options.clock = [this] { return now; };
        return std::make_unique<Store>(dir.file("idem.db"), options);
    }
    /// The redrive suite: a trigger refuses the redrive's outbox intent, its transaction's last
    /// write, until accept_redrives().
    void refuse_redrives() {
        sqlite_exec(store->db(),
                    "CREATE TRIGGER refuse_intents BEFORE INSERT ON idem_outbox "
                    "BEGIN SELECT RAISE(ABORT, 'intents refused by the test'); END");
    }
    void accept_redrives() { sqlite_exec(store->db(), "DROP TRIGGER refuse_intents"); }

    template <class Tx>
    static void write_effect(Tx& tx, const std::string& key) {
        tx.execute("INSERT INTO effects(k) VALUES (?)", idem::Blob{key});
    }
    /// A deferred foreign-key violation: SQLite only refuses it at COMMIT, a real commit failure.
    template <class Tx>
    void make_commit_fail(Tx& tx) {
        tx.execute("INSERT INTO children(parent_id) VALUES (?)", 424242);
    }
    std::size_t effect_rows() {
        return static_cast<std::size_t>(sqlite_count(store->db(), "SELECT count(*) FROM effects"));
    }
    bool has_effect(const std::string& key) {
        return sqlite_count(store->db(), "SELECT count(*) FROM effects WHERE k = ?", &key) > 0;
    }
    /// No server: the database is "down" for the store while another connection holds its write
    /// lock (BEGIN EXCLUSIVE); the probe's BEGIN IMMEDIATE then times out (store_timeout) after
    /// the store's busy timeout, shortened meanwhile so the test does not wait 5 s a probe.
    void stop_server() {
        if (sqlite3_open(dir.file("idem.db").c_str(), &locker_) != SQLITE_OK) {
            throw std::runtime_error("SqliteEnv: cannot open a second connection");
        }
        sqlite_exec(locker_, "BEGIN EXCLUSIVE");
        sqlite3_busy_timeout(store->db(), 100);
    }
    void start_server() {
        sqlite_exec(locker_, "ROLLBACK");
        sqlite3_close(locker_);
        locker_ = nullptr;
        sqlite3_busy_timeout(store->db(), 5000);
    }
    SqliteEnv(const SqliteEnv&) = delete;
    SqliteEnv& operator=(const SqliteEnv&) = delete;
    ~SqliteEnv() {
        if (locker_ != nullptr) sqlite3_close(locker_);
    }

  private:
    sqlite3* locker_ = nullptr;
};
#endif  // IDEM_HAS_SQLITE

}  // namespace idem_test
