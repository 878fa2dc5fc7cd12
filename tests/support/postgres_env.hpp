#pragma once
// The PostgreSQL environment of the typed conformance suite (see store_envs.hpp for the others):
// a fresh database per environment on the process's shared test server, the store on a
// controllable clock, an effects table written through the claim's transaction, and a commit
// that really fails (a deferred foreign-key violation PostgreSQL refuses only at COMMIT).
//
// Without PostgreSQL server binaries the constructor starts nothing and leaves `store` null
// (`needs_postgres` tells the fixture to call IDEM_REQUIRE_POSTGRES() in SetUp(), which skips
// the test, or fails it under CI=true).

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "idem/blob.hpp"
#include "idem/store/postgres.hpp"
#include "idem/testing/postgres_server.hpp"
#include "store_envs.hpp"

namespace idem_test {

/// The claims in one table (PostgreSQL's default).
struct PostgresOneTable {
    static constexpr const char* name = "postgres";
    static constexpr std::chrono::minutes span{0};
};
/// The claims in partitions of a day (PostgresOptions::claim_partition_span).
struct PostgresPartitioned {
    static constexpr const char* name = "postgres_partitioned";
    static constexpr std::chrono::minutes span{24 * 60};
};

template <class Config>
struct BasicPostgresEnv {
    using Store = idem::PostgresStore;
    static constexpr const char* name = Config::name;
    static constexpr bool needs_postgres = true;
    /// Claims go a partition at a time (the conformance suite's purge test).
    static constexpr std::chrono::milliseconds purge_granularity{Config::span};

    /// The conformance suite skips (or, in CI, fails) without the server.
    static bool available(std::string* why) {
        return idem::testing::PostgresServer::available(why);
    }

    std::string database;
    time_point now = test_epoch();
    std::unique_ptr<Store> store;

    BasicPostgresEnv() {
        if (!idem::testing::PostgresServer::available()) return;
        auto& server = idem::testing::shared_postgres();
        database = server.fresh_database();
        server.exec(
            "CREATE TABLE effects(k BYTEA NOT NULL);"
            "CREATE TABLE parents(id INTEGER PRIMARY KEY);"
            "CREATE TABLE children(parent_id INTEGER REFERENCES parents(id) "
            "  DEFERRABLE INITIALLY DEFERRED);",
            database);
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
        idem::PostgresOptions options;
        options.clock = [this] { return now; };
        options.claim_partition_span = Config::span;
        return std::make_unique<Store>(idem::testing::shared_postgres().conninfo(database),
                                       options);
    }
    /// The redrive suite: a trigger refuses the redrive's outbox intent, its transaction's last
    /// write, until accept_redrives().
    void refuse_redrives() {
        idem::testing::shared_postgres().exec(
            "CREATE FUNCTION refuse_intents() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'intents refused by the test'; END $$;"
            "CREATE TRIGGER refuse_intents BEFORE INSERT ON idem_outbox "
            "FOR EACH ROW EXECUTE PROCEDURE refuse_intents();",
            database);
    }
    void accept_redrives() {
        idem::testing::shared_postgres().exec(
            "DROP TRIGGER refuse_intents ON idem_outbox; DROP FUNCTION refuse_intents();",
            database);
    }
    BasicPostgresEnv(const BasicPostgresEnv&) = delete;
    BasicPostgresEnv& operator=(const BasicPostgresEnv&) = delete;
    ~BasicPostgresEnv() {
        store.reset();  // closes its connection before the database goes
        if (database.empty()) return;
        try {
            idem::testing::shared_postgres().exec(
                "DROP DATABASE IF EXISTS " + database + " WITH (FORCE)", "postgres");
        } catch (...) {  // a leftover database dies with the test server
        }
    }

    template <class Tx>
    static void write_effect(Tx& tx, const std::string& key) {
        tx.execute("INSERT INTO effects(k) VALUES ($1)", idem::Blob{key});
    }
    /// A deferred foreign-key violation: PostgreSQL only refuses it at COMMIT.
    template <class Tx>
    void make_commit_fail(Tx& tx) {
        tx.execute("INSERT INTO children(parent_id) VALUES ($1)", 424242);
    }
    std::size_t effect_rows() {
        return static_cast<std::size_t>(
            store->query_int("SELECT count(*) FROM effects").value_or(-1));
    }
    bool has_effect(const std::string& key) {
        return store->query_int("SELECT count(*) FROM effects WHERE k = $1", idem::Blob{key})
                   .value_or(0) > 0;
    }
    /// The probe's outage: the process's server SIGKILLed, then started again (crash recovery).
    void stop_server() { idem::testing::shared_postgres().kill9(); }
    void start_server() { idem::testing::shared_postgres().start(); }
};

using PostgresEnv = BasicPostgresEnv<PostgresOneTable>;
using PostgresPartitionedEnv = BasicPostgresEnv<PostgresPartitioned>;

}  // namespace idem_test
