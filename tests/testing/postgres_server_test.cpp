// The PostgreSQL test fixture itself: a real server per process (shared_postgres()), independent
// servers beside it, clean stop/start, SIGKILL + crash recovery, cleanup of the temp dir and of
// every process, also when the test process dies without running destructors.

#include <gtest/gtest.h>
#include <libpq-fe.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "idem/testing/postgres_server.hpp"
#include "idem/testing/process.hpp"
#include "support/require_postgres.hpp"

namespace {

using idem::testing::eventually;
using idem::testing::PgConnection;
using idem::testing::PostgresServer;
using idem::testing::shared_postgres;

std::string value_of(PGconn* conn, const char* sql) {
    PGresult* res = PQexec(conn, sql);
    std::string out = PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1
                          ? PQgetvalue(res, 0, 0)
                          : std::string("error: ") + PQerrorMessage(conn);
    PQclear(res);
    return out;
}

bool accepts_connections(const std::string& conninfo) {
    return PQping((conninfo + " connect_timeout=2").c_str()) == PQPING_OK;
}

TEST(PostgresServer, SharedServerAcceptsConnections) {
    IDEM_REQUIRE_POSTGRES();
    auto& pg = shared_postgres();
    EXPECT_EQ(&pg, &shared_postgres());
    PgConnection conn{pg.connect()};
    EXPECT_EQ(value_of(conn.get(), "SELECT current_database()"), "idem_test");
    EXPECT_EQ(value_of(conn.get(), "SELECT current_user"), "idem");
    EXPECT_EQ(value_of(conn.get(), "SHOW listen_addresses"), "127.0.0.1");
    EXPECT_EQ(value_of(conn.get(), "SHOW port"), std::to_string(pg.port()));
    EXPECT_EQ(value_of(conn.get(), "SELECT inet_server_addr()::text"), "127.0.0.1/32");
    EXPECT_EQ(value_of(conn.get(), "SHOW unix_socket_directories"), "");

    pg.exec("CREATE TABLE IF NOT EXISTS fixture_probe(id int PRIMARY KEY)");
    pg.exec("INSERT INTO fixture_probe VALUES (1) ON CONFLICT DO NOTHING");
    EXPECT_EQ(pg.query_value("SELECT count(*) FROM fixture_probe WHERE id = 1"), "1");
}

TEST(PostgresServer, ConninfoUsesLoopbackTcp) {
    IDEM_REQUIRE_POSTGRES();
    auto& pg = shared_postgres();
    ASSERT_GT(pg.port(), 0);
    ASSERT_LT(pg.port(), 65536);
    const std::string port = std::to_string(pg.port());
    EXPECT_EQ(pg.conninfo(), "host=127.0.0.1 port=" + port + " user=idem dbname=idem_test");
    EXPECT_EQ(pg.conninfo("postgres"),
              "host=127.0.0.1 port=" + port + " user=idem dbname=postgres");
    EXPECT_TRUE(accepts_connections(pg.conninfo("postgres")));
}

TEST(PostgresServer, ExecThrowsWithTheServerMessage) {
    IDEM_REQUIRE_POSTGRES();
    auto& pg = shared_postgres();
    try {
        pg.exec("SELEC 1");
        FAIL() << "exec accepted invalid SQL";
    } catch (const std::runtime_error& e) {
        EXPECT_NE(std::string(e.what()).find("syntax error"), std::string::npos) << e.what();
    }
    EXPECT_THROW(pg.exec("SELECT 1", "no_such_database"), std::runtime_error);
    EXPECT_THROW((void)pg.query_value("SELECT 1 WHERE false"), std::runtime_error);
    EXPECT_EQ(pg.query_value("SELECT NULL"), std::nullopt);
}

TEST(PostgresServer, ManyConcurrentConnections) {
    IDEM_REQUIRE_POSTGRES();
    auto& pg = shared_postgres();
    const std::string db = pg.fresh_database();
    pg.exec("CREATE TABLE hits(worker int, n int)", db);
    std::vector<std::thread> workers;
    std::vector<std::string> errors(8);
    for (int w = 0; w < 8; ++w) {
        workers.emplace_back([&, w] {
            try {
                PgConnection conn{pg.connect(db)};
                for (int n = 0; n < 25; ++n) {
                    const std::string sql = "INSERT INTO hits VALUES (" + std::to_string(w) + ", " +
                                            std::to_string(n) + ")";
                    PGresult* res = PQexec(conn.get(), sql.c_str());
                    if (PQresultStatus(res) != PGRES_COMMAND_OK)
                        errors[w] = PQerrorMessage(conn.get());
                    PQclear(res);
                }
            } catch (const std::exception& e) {
                errors[w] = e.what();
            }
        });
    }
    for (auto& t : workers)
        t.join();
    for (const auto& e : errors)
        EXPECT_EQ(e, "");
    EXPECT_EQ(pg.query_value("SELECT count(*) FROM hits", db), "200");
}

TEST(PostgresServer, SecondIndependentServerRunsAlongside) {
    IDEM_REQUIRE_POSTGRES();
    auto& shared = shared_postgres();
    PostgresServer other;
    EXPECT_NE(other.port(), shared.port());
    EXPECT_NE(other.data_dir(), shared.data_dir());

    other.exec("CREATE TABLE only_in_other(x int)");
    other.exec("INSERT INTO only_in_other VALUES (7)");
    EXPECT_EQ(other.query_value("SELECT sum(x) FROM only_in_other"), "7");
    EXPECT_EQ(shared.query_value("SELECT to_regclass('only_in_other') IS NULL"), "t");

    PgConnection a{shared.connect()};
    PgConnection b{other.connect()};
    EXPECT_EQ(value_of(a.get(), "SHOW port"), std::to_string(shared.port()));
    EXPECT_EQ(value_of(b.get(), "SHOW port"), std::to_string(other.port()));
}

TEST(PostgresServer, StopThenStartKeepsDataAndPort) {
    IDEM_REQUIRE_POSTGRES();
    PostgresServer pg;
    const int port = pg.port();
    pg.exec("CREATE TABLE kept(id int PRIMARY KEY, note text)");
    pg.exec("INSERT INTO kept VALUES (1, 'before stop')");

    pg.stop();
    EXPECT_FALSE(pg.running());
    EXPECT_FALSE(accepts_connections(pg.conninfo()));
    EXPECT_THROW(PgConnection{pg.connect()}, std::runtime_error);
    pg.stop();  // idempotent

    pg.start();
    EXPECT_TRUE(pg.running());
    EXPECT_EQ(pg.port(), port);
    EXPECT_EQ(pg.query_value("SELECT note FROM kept WHERE id = 1"), "before stop");
    pg.exec("INSERT INTO kept VALUES (2, 'after start')");
    EXPECT_EQ(pg.query_value("SELECT count(*) FROM kept"), "2");
}

// Someone else grabs the port while the server is down: start() retries (the postmaster's bind
// fails and it exits) until the port is free again.
TEST(PostgresServer, StartRetriesWhileItsPortIsTaken) {
    IDEM_REQUIRE_POSTGRES();
    PostgresServer pg;
    const int port = pg.port();
    pg.stop();

    const int squatter = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(squatter, 0);
    const int one = 1;  // the stopped server's connections may linger in TIME_WAIT on the port
    ASSERT_EQ(::setsockopt(squatter, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one), 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    ASSERT_EQ(::bind(squatter, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0)
        << std::strerror(errno);
    ASSERT_EQ(::listen(squatter, 1), 0);
    std::thread release([squatter] {
        std::this_thread::sleep_for(std::chrono::milliseconds(700));
        ::close(squatter);
    });
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_NO_THROW(pg.start());
    release.join();
    EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(600));
    EXPECT_EQ(pg.port(), port);
    EXPECT_EQ(pg.query_value("SELECT 1"), "1");
    EXPECT_NE(pg.log_tail().find("could not bind"), std::string::npos) << pg.log_tail();
}

TEST(PostgresServer, Kill9ThenStartRecoversCommittedDataOnly) {
    IDEM_REQUIRE_POSTGRES();
    PostgresServer pg;
    const int port = pg.port();
    pg.exec("CREATE TABLE ledger(id int PRIMARY KEY)");
    pg.exec("INSERT INTO ledger SELECT generate_series(1, 1000)");

    // An open transaction with an uncommitted row, and an idle session: both die with the server.
    PgConnection in_flight{pg.connect()};
    PGresult* res = PQexec(in_flight.get(), "BEGIN; INSERT INTO ledger VALUES (5000)");
    ASSERT_EQ(PQresultStatus(res), PGRES_COMMAND_OK) << PQerrorMessage(in_flight.get());
    PQclear(res);
    const pid_t backend = static_cast<pid_t>(PQbackendPID(in_flight.get()));
    const pid_t postmaster = pg.postmaster_pid();

    pg.kill9();
    EXPECT_FALSE(pg.running());
    EXPECT_TRUE(idem::testing::process_gone(postmaster));
    EXPECT_TRUE(idem::testing::process_gone(backend));
    res = PQexec(in_flight.get(), "COMMIT");
    EXPECT_NE(PQresultStatus(res), PGRES_COMMAND_OK);
    PQclear(res);
    EXPECT_FALSE(accepts_connections(pg.conninfo()));

    pg.start();
    EXPECT_EQ(pg.port(), port);
    EXPECT_EQ(pg.query_value("SELECT count(*) FROM ledger"), "1000");
    EXPECT_EQ(pg.query_value("SELECT count(*) FROM ledger WHERE id = 5000"), "0");
    EXPECT_NE(pg.log_tail().find("not properly shut down"), std::string::npos) << pg.log_tail();

    // And a second crash right after recovery works too.
    pg.exec("INSERT INTO ledger VALUES (1001)");
    pg.kill9();
    pg.start();
    EXPECT_EQ(pg.query_value("SELECT max(id) FROM ledger"), "1001");
}

TEST(PostgresServer, DestructorStopsServerAndRemovesTempDir) {
    IDEM_REQUIRE_POSTGRES();
    std::filesystem::path dir;
    std::string conninfo;
    pid_t postmaster = -1;
    {
        PostgresServer pg;
        dir = pg.dir();
        conninfo = pg.conninfo();
        postmaster = pg.postmaster_pid();
        EXPECT_TRUE(std::filesystem::exists(pg.data_dir() / "PG_VERSION"));
        EXPECT_EQ(dir.filename().string().rfind("idem-pg-", 0), 0U) << dir;
    }
    EXPECT_FALSE(std::filesystem::exists(dir)) << dir;
    EXPECT_TRUE(idem::testing::process_gone(postmaster));
    EXPECT_FALSE(accepts_connections(conninfo));
}

TEST(PostgresServer, DestructorAfterKill9StillCleansUp) {
    IDEM_REQUIRE_POSTGRES();
    std::filesystem::path dir;
    {
        PostgresServer pg;
        dir = pg.dir();
        pg.kill9();
    }
    EXPECT_FALSE(std::filesystem::exists(dir)) << dir;
}

// The owning process dies without destructors (SIGKILL): the watchdog stops the postmaster and
// removes the temp dir. The owner here is a fork()ed child of this test.
TEST(PostgresServer, WatchdogCleansUpWhenTheOwnerIsKilled) {
    IDEM_REQUIRE_POSTGRES();
    const auto orphan = idem::testing::orphan_server<PostgresServer>();
    ASSERT_TRUE(WIFSIGNALED(orphan.status) && WTERMSIG(orphan.status) == SIGKILL) << orphan.report;
    ASSERT_TRUE(orphan.reported) << orphan.report;
    const std::string conninfo =
        "host=127.0.0.1 port=" + std::to_string(orphan.port) + " user=idem dbname=idem_test";
    EXPECT_TRUE(eventually([&] {
        return idem::testing::process_gone(orphan.pid) && !std::filesystem::exists(orphan.dir) &&
               !accepts_connections(conninfo);
    })) << "postmaster "
        << orphan.pid << " or " << orphan.dir.string() << " survived its owner";
}

TEST(PostgresServer, StartupTime) {
    IDEM_REQUIRE_POSTGRES();
    const auto t0 = std::chrono::steady_clock::now();
    auto pg = std::make_unique<PostgresServer>();
    const auto t1 = std::chrono::steady_clock::now();
    pg->stop();
    const auto t2 = std::chrono::steady_clock::now();
    pg->start();
    const auto t3 = std::chrono::steady_clock::now();
    pg.reset();
    const auto t4 = std::chrono::steady_clock::now();
    auto ms = [](auto d) {
        return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
    };
    std::printf(
        "[ timing   ] new server (initdb+start+createdb) %lld ms, stop %lld ms, "
        "start %lld ms, destroy %lld ms\n",
        static_cast<long long>(ms(t1 - t0)), static_cast<long long>(ms(t2 - t1)),
        static_cast<long long>(ms(t3 - t2)), static_cast<long long>(ms(t4 - t3)));
    EXPECT_LT(ms(t1 - t0), 30000);
}

}  // namespace
