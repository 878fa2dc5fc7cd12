#pragma once
// The MySQL / MariaDB environment of the typed conformance and outbox suites (see store_envs.hpp
// for the others): a fresh database per environment on the process's shared MariaDB server
// (mariadb_server.hpp, started once per test binary), the store on a controllable clock, an
// effects table written through the claim's transaction, and a commit that really fails.
//
// InnoDB refuses nothing at COMMIT (no deferred constraints), so make_commit_fail() makes the
// server roll the transaction back: a real deadlock with a heavier transaction on a second
// connection, which InnoDB resolves by rolling back the lighter one, the effect's. The effect
// swallows the store_timeout; nothing of the transaction may then be stored, and commit() must
// fail.
//
// Without MariaDB server binaries the constructor starts nothing and leaves `store` null; the
// fixture's SetUp() calls IDEM_REQUIRE_MARIADB() (a skip, or a failure under CI=true).

#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "idem/blob.hpp"
#include "idem/error.hpp"
#include "idem/store/mysql.hpp"
#include "idem/testing/mariadb_server.hpp"
#include "store_envs.hpp"

namespace idem_test {

/// A new database on the shared server; its name.
inline std::string fresh_mariadb_database() {
    static std::atomic<int> next{0};
    const std::string name = "idem_" + std::to_string(::getpid()) + "_" + std::to_string(++next);
    idem::testing::shared_mariadb().client("").exec("CREATE DATABASE " + name);
    return name;
}

inline idem::MysqlEndpoint mariadb_endpoint(const std::string& database) {
    auto& server = idem::testing::shared_mariadb();
    idem::MysqlEndpoint endpoint;
    endpoint.host = server.host();
    endpoint.port = static_cast<unsigned>(server.port());
    endpoint.user = server.user();
    endpoint.database = database;
    return endpoint;
}

template <class Traits>
struct BasicMysqlEnv {
    using Store = idem::MysqlStore;
    static constexpr const char* name = Traits::name;
    /// Claims go a partition at a time (the conformance suite's purge test).
    static constexpr std::chrono::milliseconds purge_granularity{Traits::span};

    /// The conformance suite skips (or, in CI, fails) without the server.
    static bool available(std::string* why) { return idem::testing::MariadbServer::available(why); }

    std::string database;
    time_point now = test_epoch();
    std::unique_ptr<Store> store;

    BasicMysqlEnv() {
        if (!idem::testing::MariadbServer::available()) return;
        database = fresh_mariadb_database();
        idem::testing::shared_mariadb().client(database).exec(
            "CREATE TABLE effects(k BLOB NOT NULL) ENGINE=InnoDB;"
            "CREATE TABLE deadlock_rows(id INT PRIMARY KEY) ENGINE=InnoDB;"
            "INSERT INTO deadlock_rows VALUES (1), (2);"
            "CREATE TABLE ballast(id INT) ENGINE=InnoDB");
        open();
    }
    /// Closes the store's connection and opens a new one on the same database (the
    /// durability suite).
    void reopen() {
        store.reset();
        open();
    }
    void open() { store = another_store(); }
    /// A second connection on the same database (the redrive suite's race).
    std::unique_ptr<Store> another_store() {
        idem::MysqlOptions options;
        options.clock = [this] { return now; };
        options.isolation = Traits::isolation;
        options.claim_partition_span = Traits::span;
        return std::make_unique<Store>(mariadb_endpoint(database), options);
    }
    /// The redrive suite: a trigger refuses the redrive's outbox intent, its transaction's last
    /// write, until accept_redrives().
    void refuse_redrives() {
        idem::testing::shared_mariadb().client(database).exec(
            "CREATE TRIGGER refuse_intents BEFORE INSERT ON idem_outbox FOR EACH ROW "
            "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'intents refused by the test'");
    }
    void accept_redrives() {
        idem::testing::shared_mariadb().client(database).exec("DROP TRIGGER refuse_intents");
    }
    BasicMysqlEnv(const BasicMysqlEnv&) = delete;
    BasicMysqlEnv& operator=(const BasicMysqlEnv&) = delete;
    ~BasicMysqlEnv() {
        store.reset();
        if (database.empty()) return;
        try {
            idem::testing::shared_mariadb().client("").exec("DROP DATABASE IF EXISTS " + database);
        } catch (...) {  // a leftover database dies with the test server
        }
    }

    template <class Tx>
    static void write_effect(Tx& tx, const std::string& key) {
        tx.execute("INSERT INTO effects(k) VALUES (?)", idem::Blob{key});
    }

    /// A deadlock the server resolves by rolling the effect's transaction back (see above).
    template <class Tx>
    void make_commit_fail(Tx& tx) {
        idem::testing::MariadbClient heavy = idem::testing::shared_mariadb().client(database);
        heavy.exec(
            "START TRANSACTION; INSERT INTO ballast SELECT seq FROM seq_1_to_500; "
            "SELECT id FROM deadlock_rows WHERE id = 1 FOR UPDATE");
        tx.execute("SELECT id FROM deadlock_rows WHERE id = 2 FOR UPDATE");
        std::thread waiter([&] {
            try {
                heavy.exec("SELECT id FROM deadlock_rows WHERE id = 2 FOR UPDATE");
            } catch (...) {
            }
        });
        idem::testing::MariadbClient watch = idem::testing::shared_mariadb().client(database);
        for (int i = 0; i < 500; ++i) {
            if (watch.value("SELECT COUNT(*) FROM information_schema.innodb_trx "
                            "WHERE trx_state = 'LOCK WAIT'") != std::optional<std::string>("0")) {
                break;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        try {
            tx.execute("SELECT id FROM deadlock_rows WHERE id = 1 FOR UPDATE");
        } catch (const idem::store_timeout&) {  // 1213: the effect's transaction is gone
        }
        waiter.join();
        heavy.exec("ROLLBACK");
    }

    std::size_t effect_rows() {
        return static_cast<std::size_t>(
            store->query_int("SELECT COUNT(*) FROM effects").value_or(-1));
    }
    bool has_effect(const std::string& key) {
        return store->query_int("SELECT COUNT(*) FROM effects WHERE k = ?", idem::Blob{key})
                   .value_or(0) > 0;
    }
    /// The probe's outage: the process's server SIGKILLed, then started again (InnoDB crash
    /// recovery).
    void stop_server() { idem::testing::shared_mariadb().kill9(); }
    void start_server() { idem::testing::shared_mariadb().start(); }
};

struct MysqlDefaults {
    static constexpr const char* name = "mysql";
    static constexpr std::optional<idem::MysqlIsolation> isolation{};  // InnoDB: REPEATABLE READ
    static constexpr std::chrono::minutes span{0};                     // one table
};
struct MysqlReadCommitted {
    static constexpr const char* name = "mysql_read_committed";
    static constexpr std::optional<idem::MysqlIsolation> isolation =
        idem::MysqlIsolation::read_committed;
    static constexpr std::chrono::minutes span{0};
};
/// The claims in partitions of a day (MysqlOptions::claim_partition_span), under both
/// isolation levels: the claim's read differs (mysql/partitions.hpp).
struct MysqlPartitioned {
    static constexpr const char* name = "mysql_partitioned";
    static constexpr std::optional<idem::MysqlIsolation> isolation{};
    static constexpr std::chrono::minutes span{24 * 60};
};
struct MysqlPartitionedReadCommitted {
    static constexpr const char* name = "mysql_partitioned_read_committed";
    static constexpr std::optional<idem::MysqlIsolation> isolation =
        idem::MysqlIsolation::read_committed;
    static constexpr std::chrono::minutes span{24 * 60};
};

using MysqlEnv = BasicMysqlEnv<MysqlDefaults>;
using MysqlReadCommittedEnv = BasicMysqlEnv<MysqlReadCommitted>;
using MysqlPartitionedEnv = BasicMysqlEnv<MysqlPartitioned>;
using MysqlPartitionedReadCommittedEnv = BasicMysqlEnv<MysqlPartitionedReadCommitted>;

}  // namespace idem_test
