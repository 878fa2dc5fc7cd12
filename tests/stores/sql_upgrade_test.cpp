// Schema upgrades lose nothing: each SQL store (SQLite, PostgreSQL, MySQL/MariaDB) opens a
// database that an earlier idem left — every earlier schema version, built with the DDL that
// version ran (the schema's migrations only ever append), holding rows of every kind it kept:
// claims (processed and dead-lettered), a dead letter, outbox intents sent, unsent and parked,
// attempt counts — and every row survives and still works: a duplicate is still a duplicate, a
// parked message still answers as one, the count goes on, the relay ships the unsent intent and
// only it, offsets can be stored. A database from a newer idem is refused, naming both versions.
// One test per store, so each server starts once.
#include <gtest/gtest.h>
#include <sqlite3.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <idem/contract/redrive.hpp>
#include <idem/handler.hpp>
#include <idem/outbox.hpp>
#include <idem/sql/schema.hpp>
#include <idem/store/sqlite.hpp>
#include <idem/testing/temp_dir.hpp>

#include "support/backends.hpp"
#include "support/stored_offsets.hpp"
#if IDEM_HAS_POSTGRES
#include <idem/store/postgres.hpp>
#include <idem/testing/postgres_server.hpp>

#include "support/require_postgres.hpp"
#endif
#if IDEM_HAS_MYSQL
#include <idem/store/mysql.hpp>
#include <idem/testing/mariadb_server.hpp>

#include "support/mysql_env.hpp"
#include "support/require_mariadb.hpp"
#endif

namespace {

std::string hex(const std::string& bytes) {
    static const char* digits = "0123456789abcdef";
    std::string out;
    for (unsigned char c : bytes) {
        out += digits[c >> 4];
        out += digits[c & 15];
    }
    return out;
}

/// How one SQL dialect writes what an old idem left: its DDL, and literals for binary columns
/// (scope, ids, payloads, keys) and for text ones (outcome, reason, destination, last error).
struct Dialect {
    std::function<std::vector<std::string>(int from_version)> ddl;
    std::string schema_table;  ///< the version table, as the driver creates it
    std::function<std::string(const std::string&)> blob;
    std::string yes, no;  ///< boolean literals
};

std::string text(const std::string& s) {
    return "'" + s + "'";
}

/// The DDL schema version @p version ran, from nothing: the migrations only ever append, so it
/// is what migrating from 0 runs less what migrating from @p version runs.
std::vector<std::string> ddl_of_version(const Dialect& dialect, int version) {
    std::vector<std::string> all = dialect.ddl(0);
    const std::size_t later = dialect.ddl(version).size();
    all.resize(all.size() - later);
    return all;
}

/// Builds schema version @p version with @p exec and fills it with a row of every kind.
void build_old_database(const Dialect& d, int version,
                        const std::function<void(const std::string&)>& exec) {
    for (const std::string& statement : ddl_of_version(d, version))
        exec(statement);
    exec(d.schema_table);
    exec("INSERT INTO idem_schema(version) VALUES (" + std::to_string(version) + ")");
    const std::string scope = d.blob("capture");
    exec(
        "INSERT INTO idem_claims(scope, message_id, claimed_at, outcome, reason, fingerprint) "
        "VALUES (" +
        scope + ", " + d.blob("m-done") + ", 1000, 'processed', '', " + d.blob("") + ")");
    exec(
        "INSERT INTO idem_claims(scope, message_id, claimed_at, outcome, reason, fingerprint) "
        "VALUES (" +
        scope + ", " + d.blob("m-parked") + ", 1000, 'dead_lettered', 'poison', " + d.blob("") +
        ")");
    exec(
        "INSERT INTO idem_dead_letters(scope, message_id, delivery_count, reason, payload, "
        "created_at) VALUES (" +
        scope + ", " + d.blob("m-parked") + ", 5, 'poison', " +
        d.blob(std::string("bytes\0kept", 10)) + ", 1000)");
    auto intent = [&](const std::string& key, const std::string& sent_at, int attempts,
                      const std::string& error, const std::string& parked) {
        exec(
            "INSERT INTO idem_outbox(destination, idempotency_key, payload, created_at, sent_at, "
            "attempts, last_error, next_attempt_at, lease_until, parked) VALUES ('orders', " +
            d.blob(key) + ", " + d.blob("payload of " + key) + ", 1000, " + sent_at + ", " +
            std::to_string(attempts) + ", " + text(error) + ", 1000, NULL, " + parked + ")");
    };
    intent("k-sent", "2000", 0, "", d.no);
    intent("k-unsent", "NULL", 1, "timed out", d.no);
    intent("k-parked", "NULL", 9, "refused", d.yes);
    if (version >= 2) {
        exec("INSERT INTO idem_attempts(scope, message_id, attempts, counted_at) VALUES (" + scope +
             ", " + d.blob("m-counted") + ", 2, 1000)");
    }
}

/// Opens the old database with today's store and checks every row.
template <class Store>
void check_upgraded(Store& store, int version,
                    const std::function<std::int64_t()>& stored_version) {
    SCOPED_TRACE("from schema version " + std::to_string(version));
    EXPECT_EQ(stored_version(), idem::sql::schema_version);

    int effects = 0;
    auto handler = idem::make_handler(store, idem::Policy{"capture"},
                                      [&](auto&, const std::string&) { ++effects; });
    const auto done = handler.handle(idem::Delivery{"m-done", 1u}, std::string("again"));
    EXPECT_EQ(done.disposition, idem::Disposition::duplicate) << done.reason;
    const auto parked = handler.handle(idem::Delivery{"m-parked", 1u}, std::string("again"));
    EXPECT_EQ(parked.disposition, idem::Disposition::duplicate) << parked.reason;
    EXPECT_TRUE(parked.duplicate_of_dead_letter()) << parked.reason;
    const auto fresh = handler.handle(idem::Delivery{"m-new", 1u}, std::string("new"));
    EXPECT_EQ(fresh.disposition, idem::Disposition::processed) << fresh.reason;
    EXPECT_EQ(effects, 1) << "only the new message ran its effect";

    const auto letters = store.dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_EQ(letters[0].scope, "capture");
    EXPECT_EQ(letters[0].message_id, "m-parked");
    EXPECT_EQ(letters[0].delivery_count, 5u);
    EXPECT_EQ(letters[0].reason, "poison");
    EXPECT_EQ(letters[0].payload, std::string("bytes\0kept", 10));
    // Version 4's redrive columns: an entry of an older version was never redriven.
    EXPECT_GT(letters[0].id, 0);
    EXPECT_EQ(letters[0].redrive_count, 0u);
    EXPECT_FALSE(letters[0].redriven_at.has_value());
    // Version 5's origin: an older entry records none (a redrive needs a destination for it).
    EXPECT_EQ(letters[0].origin, "");
    EXPECT_EQ(letters[0].origin_position, "");

    // Version 1 counted no attempts: the count starts with the upgrade.
    EXPECT_EQ(store.count_attempt("capture", "m-counted"), version >= 2 ? 3u : 1u);

    std::vector<std::string> shipped;
    idem::Relay relay{store, [&](const idem::OutboxRow& row) {
                          shipped.push_back(row.idempotency_key + "=" + row.payload);
                      }};
    relay.run_once();
    relay.run_once();
    EXPECT_EQ(shipped, (std::vector<std::string>{"k-unsent=payload of k-unsent"}));
    const auto rows = store.outbox_rows();
    ASSERT_EQ(rows.size(), 3u);
    EXPECT_EQ(rows[0].idempotency_key, "k-sent");
    EXPECT_TRUE(rows[0].sent_at.has_value());
    EXPECT_EQ(rows[1].idempotency_key, "k-unsent");
    EXPECT_TRUE(rows[1].sent_at.has_value()) << "the relay shipped and marked it";
    EXPECT_EQ(rows[2].idempotency_key, "k-parked");
    EXPECT_TRUE(rows[2].parked);
    EXPECT_FALSE(rows[2].sent_at.has_value());
    EXPECT_EQ(rows[2].attempts, 9u);
    EXPECT_EQ(rows[2].last_error, "refused");
    EXPECT_EQ(rows[0].message_id, "") << "an intent older than version 6 names no writer";

    EXPECT_FALSE(store.stored_offset("g", "t", 0).has_value());
    EXPECT_TRUE(idem_test::commit_offset(store, "g", "t", 0, 12));
    EXPECT_EQ(store.stored_offset("g", "t", 0), std::optional<std::int64_t>(12));

    // The parked message of the old database can be brought back, once.
    idem::RedriveOptions options;
    options.destination = "orders";
    idem::DeadLetterSelection selection;
    selection.message_ids = {"m-parked"};
    const auto report = store.redrive(selection, options);
    ASSERT_EQ(report.entries.size(), 1u);
    EXPECT_EQ(report.entries[0].status, idem::RedriveStatus::redriven);
    EXPECT_EQ(store.redrive(selection, options).count(idem::RedriveStatus::already_redriven), 1u);
    shipped.clear();
    relay.run_once();
    EXPECT_EQ(shipped, (std::vector<std::string>{"m-parked=" + std::string("bytes\0kept", 10)}));
    // The relay's delivery reaches the handler: processed now, as new.
    const auto redriven = handler.handle(idem::Delivery{"m-parked", 1u}, std::string("again"));
    EXPECT_EQ(redriven.disposition, idem::Disposition::processed) << redriven.reason;
    EXPECT_EQ(effects, 2);
    EXPECT_EQ(store.dead_letters()[0].redrive_count, 1u);
    // The redrive's intent names the message it re-publishes (version 6).
    const auto intents = store.outbox_rows("capture", "m-parked");
    ASSERT_EQ(intents.size(), 1u);
    EXPECT_EQ(intents[0].idempotency_key, "m-parked");

    // A message parked after the upgrade keeps where the broker held it.
    idem::Delivery at_limit{"m-parked-now", 99u};
    at_limit.origin = "orders-in";
    at_limit.origin_position = "7-0";
    EXPECT_EQ(handler.handle(at_limit, std::string("late")).disposition,
              idem::Disposition::dead_lettered);
    idem::DeadLetterSelection parked_now;
    parked_now.message_ids = {"m-parked-now"};
    const auto now_letters = store.dead_letters(parked_now);
    ASSERT_EQ(now_letters.size(), 1u);
    EXPECT_EQ(now_letters[0].origin, "orders-in");
    EXPECT_EQ(now_letters[0].origin_position, "7-0");
    EXPECT_EQ(effects, 2) << "parked at the limit, its effect never ran";
}

/// A store opening a database from a newer idem refuses it, naming both versions, and leaves it
/// as it was.
template <class Open>
void check_newer_refused(Open open, const std::function<void(const std::string&)>& exec,
                         const std::function<std::int64_t()>& stored_version) {
    open();  // today's schema
    exec("UPDATE idem_schema SET version = 99");
    try {
        open();
        ADD_FAILURE() << "a database from a newer idem was accepted";
    } catch (const idem::store_error& e) {
        const std::string message = e.what();
        EXPECT_NE(message.find("version 99"), std::string::npos) << message;
        EXPECT_NE(message.find("(" + std::to_string(idem::sql::schema_version) + ")"),
                  std::string::npos)
            << message;
        EXPECT_NE(message.find("newer"), std::string::npos) << message;
    }
    EXPECT_EQ(stored_version(), 99);
}

// ---------------------------------------------------------------------------------------------

/// Runs the upgrade check from every earlier version, then the newer-version refusal, each on a
/// fresh database of @p fresh(), written with @p exec_in and read with @p version_in.
template <class Open>
void every_earlier_version(
    const Dialect& dialect, const std::function<std::string()>& fresh,
    const std::function<void(const std::string&, const std::string&)>& exec_in,
    const std::function<std::int64_t(const std::string&)>& version_in, Open open) {
    for (int version = 1; version < idem::sql::schema_version; ++version) {
        const std::string where = fresh();
        build_old_database(dialect, version, [&](const std::string& sql) { exec_in(where, sql); });
        auto store = open(where);
        check_upgraded(*store, version, [&] { return version_in(where); });
    }
    const std::string newer = fresh();
    check_newer_refused([&] { open(newer); }, [&](const std::string& sql) { exec_in(newer, sql); },
                        [&] { return version_in(newer); });
}

TEST(SqlUpgrade, SqliteKeepsEveryRowOfEveryEarlierVersion) {
    idem::testing::TempDir dir;
    Dialect d;
    d.ddl = [](int from) { return idem::sql::sqlite_schema_ddl(from); };
    d.schema_table = "CREATE TABLE IF NOT EXISTS idem_schema(version INTEGER NOT NULL)";
    d.blob = [](const std::string& s) { return "X'" + hex(s) + "'"; };
    d.yes = "1";
    d.no = "0";
    int files = 0;
    auto exec = [](const std::string& path, const std::string& sql) {
        sqlite3* db = nullptr;
        ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
        char* error = nullptr;
        const int rc = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &error);
        const std::string why = error != nullptr ? error : "";
        sqlite3_free(error);
        sqlite3_close(db);
        ASSERT_EQ(rc, SQLITE_OK) << why << "\n" << sql;
    };
    auto version = [](const std::string& path) {
        sqlite3* db = nullptr;
        sqlite3_open(path.c_str(), &db);
        sqlite3_stmt* stmt = nullptr;
        sqlite3_prepare_v2(db, "SELECT max(version) FROM idem_schema", -1, &stmt, nullptr);
        std::int64_t v = -1;
        if (sqlite3_step(stmt) == SQLITE_ROW) v = sqlite3_column_int64(stmt, 0);
        sqlite3_finalize(stmt);
        sqlite3_close(db);
        return v;
    };
    every_earlier_version(
        d, [&] { return dir.file("idem-" + std::to_string(++files) + ".db"); }, exec, version,
        [](const std::string& path) { return std::make_unique<idem::SqliteStore>(path); });
}

#if IDEM_HAS_POSTGRES
TEST(SqlUpgrade, PostgresKeepsEveryRowOfEveryEarlierVersion) {
    IDEM_REQUIRE_POSTGRES();
    auto& server = idem::testing::shared_postgres();
    Dialect d;
    d.ddl = [](int from) { return idem::sql::postgres_schema_ddl("\"public\".", from); };
    d.schema_table = "CREATE TABLE IF NOT EXISTS \"public\".idem_schema(version INTEGER NOT NULL)";
    d.blob = [](const std::string& s) { return "'\\x" + hex(s) + "'::bytea"; };
    d.yes = "true";
    d.no = "false";
    auto version = [&](const std::string& database) -> std::int64_t {
        idem::testing::PgConnection conn{PQconnectdb(server.conninfo(database).c_str())};
        PGresult* result = PQexec(conn.get(), "SELECT max(version) FROM idem_schema");
        std::int64_t v = -1;
        if (PQntuples(result) == 1 && PQgetisnull(result, 0, 0) == 0)
            v = std::stoll(PQgetvalue(result, 0, 0));
        PQclear(result);
        return v;
    };
    every_earlier_version(
        d, [&] { return server.fresh_database(); },
        [&](const std::string& database, const std::string& sql) { server.exec(sql, database); },
        version,
        [&](const std::string& database) {
            return std::make_unique<idem::PostgresStore>(server.conninfo(database));
        });
}
#endif

#if IDEM_HAS_MYSQL
TEST(SqlUpgrade, MysqlKeepsEveryRowOfEveryEarlierVersion) {
    IDEM_REQUIRE_MARIADB();
    Dialect d;
    d.ddl = [](int from) { return idem::sql::mysql_schema_ddl(from); };
    d.schema_table = "CREATE TABLE IF NOT EXISTS idem_schema(version INT NOT NULL) ENGINE=InnoDB";
    d.blob = [](const std::string& s) {
        return s.empty() ? std::string("X''") : "X'" + hex(s) + "'";
    };
    d.yes = "1";
    d.no = "0";
    auto& server = idem::testing::shared_mariadb();
    auto version = [&](const std::string& database) -> std::int64_t {
        const auto v = server.client(database).value("SELECT MAX(version) FROM idem_schema");
        return v ? std::stoll(*v) : -1;
    };
    every_earlier_version(
        d, [] { return idem_test::fresh_mariadb_database(); },
        [&](const std::string& database, const std::string& sql) {
            server.client(database).exec(sql);
        },
        version,
        [](const std::string& database) {
            return std::make_unique<idem::MysqlStore>(idem_test::mariadb_endpoint(database));
        });
}

// MySQL commits each DDL statement at once: a migration stopped after its ALTER and before it
// wrote the version left the columns of version 4 in a database that still says 3. The next
// store to open it runs the migration again and must not fail on what is already there.
TEST(SqlUpgrade, MysqlMigrationStoppedAfterItsAlterIsRunAgain) {
    IDEM_REQUIRE_MARIADB();
    auto& server = idem::testing::shared_mariadb();
    const std::string database = idem_test::fresh_mariadb_database();
    auto client = server.client(database);
    client.exec("CREATE TABLE IF NOT EXISTS idem_schema(version INT NOT NULL) ENGINE=InnoDB");
    for (const std::string& ddl : idem::sql::mysql_schema_ddl(0)) {
        if (ddl.rfind("INSERT INTO idem_schema", 0) == 0) continue;
        client.exec(ddl);  // every statement up to today's, the v4 ALTER included
    }
    client.exec("DELETE FROM idem_schema");
    client.exec("INSERT INTO idem_schema(version) VALUES (3)");  // the version not yet written
    auto store = std::make_unique<idem::MysqlStore>(idem_test::mariadb_endpoint(database));
    EXPECT_EQ(server.client(database).value("SELECT MAX(version) FROM idem_schema"),
              std::optional<std::string>(std::to_string(idem::sql::schema_version)));
    auto handler =
        idem::make_handler(*store, idem::Policy{"upgrade"}, [](auto&, const std::string&) {});
    EXPECT_EQ(handler.handle(idem::Delivery{"m-1", 1u}, std::string("m-1")).disposition,
              idem::Disposition::processed);
}
#endif

}  // namespace
