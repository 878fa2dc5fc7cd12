// The MariaDB test fixture itself: a real mariadbd per process (shared_mariadb()), independent
// servers beside it, SIGKILL + InnoDB crash recovery on the same port, clean stop/start, cleanup
// of the temp dir and of the process (also when the test process dies without running
// destructors), loopback-only binding, real root authentication, and the test client.

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/testing/mariadb_server.hpp"
#include "idem/testing/process.hpp"
#include "support/require_mariadb.hpp"

namespace {

using idem::testing::eventually;
using idem::testing::MariadbClient;
using idem::testing::MariadbServer;
using idem::testing::shared_mariadb;

bool answers(int port) {
    try {
        MariadbClient c{"127.0.0.1", port, "", "root", std::chrono::seconds(1)};
        return c.value("SELECT 1") == "1";
    } catch (const std::exception&) {
        return false;
    }
}

/// The local addresses (hex "ADDR:PORT" as in /proc/net/tcp{,6}) of every listening TCP socket
/// on @p port.
std::vector<std::string> listening_on(int port) {
    std::vector<std::string> out;
    char port_hex[8];
    std::snprintf(port_hex, sizeof port_hex, "%04X", static_cast<unsigned>(port));
    for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
        std::ifstream in(table);
        std::string line;
        std::getline(in, line);  // header
        while (std::getline(in, line)) {
            std::istringstream fields(line);
            std::string slot, local, remote, state;
            fields >> slot >> local >> remote >> state;
            const auto colon = local.rfind(':');
            if (state == "0A" && colon != std::string::npos &&
                local.substr(colon + 1) == port_hex) {
                out.push_back(local);
            }
        }
    }
    return out;
}

TEST(MariadbServer, SharedServerAnswersVersionOnLoopbackOnly) {
    IDEM_REQUIRE_MARIADB();
    auto& db = shared_mariadb();
    EXPECT_EQ(&db, &shared_mariadb());
    EXPECT_TRUE(db.running());
    EXPECT_GT(db.pid(), 0);
    ASSERT_GT(db.port(), 0);
    ASSERT_LT(db.port(), 65536);
    EXPECT_EQ(db.host(), "127.0.0.1");

    auto c = db.client();
    const auto version = c.value("SELECT VERSION()");
    ASSERT_TRUE(version);
    EXPECT_EQ(version->rfind("10.11.", 0), 0U) << *version;
    EXPECT_NE(version->find("MariaDB"), std::string::npos) << *version;
    EXPECT_EQ(c.value("SELECT DATABASE()"), "idem_test");
    EXPECT_EQ(c.value("SELECT CURRENT_USER()"), "root@127.0.0.1");
    EXPECT_EQ(c.value("SELECT @@bind_address"), "127.0.0.1");
    EXPECT_EQ(c.value("SELECT @@port"), std::to_string(db.port()));
    EXPECT_EQ(c.value("SELECT @@skip_networking"), "0");
    EXPECT_EQ(c.value("SELECT @@socket"), db.socket_path().string());
    EXPECT_EQ(c.value("SELECT @@log_bin"), "0");
    EXPECT_EQ(c.value("SELECT @@innodb_flush_log_at_trx_commit"), "1");
    EXPECT_EQ(c.value("SELECT @@character_set_server"), "utf8mb4");
    const auto datadir = c.value("SELECT @@datadir");
    ASSERT_TRUE(datadir);
    EXPECT_TRUE(std::filesystem::equivalent(*datadir, db.data_dir())) << *datadir;
    EXPECT_EQ(db.dir().filename().string().rfind("idem-mariadb-", 0), 0U) << db.dir();
    EXPECT_TRUE(std::filesystem::exists(db.socket_path())) << db.socket_path();
    EXPECT_NE(db.log_tail().find("ready for connections"), std::string::npos) << db.log_tail();

    // The kernel's view: every listening socket on the port is 127.0.0.1 (0100007F), none on
    // 0.0.0.0 or ::.
    const auto sockets = listening_on(db.port());
    ASSERT_FALSE(sockets.empty());
    for (const auto& s : sockets)
        EXPECT_EQ(s, "0100007F:" + s.substr(s.rfind(':') + 1)) << s;
}

TEST(MariadbServer, InnodbIsTheDefaultEngine) {
    IDEM_REQUIRE_MARIADB();
    auto c = shared_mariadb().client();
    EXPECT_EQ(c.value("SELECT @@default_storage_engine"), "InnoDB");
    c.exec("DROP TABLE IF EXISTS engine_probe; CREATE TABLE engine_probe(id INT PRIMARY KEY)");
    EXPECT_EQ(c.value("SELECT ENGINE FROM information_schema.TABLES "
                      "WHERE TABLE_SCHEMA = 'idem_test' AND TABLE_NAME = 'engine_probe'"),
              "InnoDB");
    EXPECT_EQ(c.value("SELECT SUPPORT FROM information_schema.ENGINES WHERE ENGINE = 'InnoDB'"),
              "DEFAULT");
    // Transactional: a rolled back insert is gone.
    c.exec("START TRANSACTION; INSERT INTO engine_probe VALUES (1); ROLLBACK");
    EXPECT_EQ(c.value("SELECT COUNT(*) FROM engine_probe"), "0");
}

// Root is a real account (grant tables on, an empty password, native authentication): a wrong
// password or an unknown user is refused.
TEST(MariadbServer, AuthenticationIsReal) {
    IDEM_REQUIRE_MARIADB();
    auto& db = shared_mariadb();
    auto c = db.client();
    EXPECT_EQ(c.value("SELECT authentication_string FROM mysql.user "
                      "WHERE user = 'root' AND host = '127.0.0.1'"),
              "");
    const auto grants = c.query("SHOW GRANTS");
    ASSERT_FALSE(grants.empty());
    EXPECT_EQ(grants.front().front(),
              "GRANT ALL PRIVILEGES ON *.* TO `root`@`127.0.0.1` WITH GRANT OPTION");
    EXPECT_EQ(c.value("SELECT @@skip_grant_tables"), "0");

    auto refused = [&](const std::string& user, const char* password) -> std::string {
        idem::testing::detail::library_init();
        MYSQL* m = mysql_init(nullptr);
        const unsigned int protocol = MYSQL_PROTOCOL_TCP;
        mysql_options(m, MYSQL_OPT_PROTOCOL, &protocol);
        std::string error;
        if (mysql_real_connect(m, "127.0.0.1", user.c_str(), password, nullptr,
                               static_cast<unsigned int>(db.port()), nullptr, 0) == nullptr) {
            error = std::to_string(mysql_errno(m)) + " " + mysql_error(m);
        }
        mysql_close(m);
        return error;
    };
    EXPECT_EQ(refused("root", ""), "");  // root's password is empty
    EXPECT_EQ(refused("root", "wrong").substr(0, 4), "1045") << refused("root", "wrong");
    EXPECT_EQ(refused("nobody", "").substr(0, 4), "1045") << refused("nobody", "");
}

TEST(MariadbServer, IsolationIsRepeatableReadAndASessionCanSetReadCommitted) {
    IDEM_REQUIRE_MARIADB();
    auto& db = shared_mariadb();
    auto writer = db.client();
    auto reader = db.client();
    writer.exec("DROP TABLE IF EXISTS iso; CREATE TABLE iso(id INT PRIMARY KEY)");

    // MariaDB 10.11 spells it tx_isolation (transaction_isolation is MySQL 8 / MariaDB 11.1+).
    EXPECT_EQ(reader.value("SELECT @@GLOBAL.tx_isolation"), "REPEATABLE-READ");
    EXPECT_EQ(reader.value("SELECT @@tx_isolation"), "REPEATABLE-READ");

    // REPEATABLE READ: the snapshot taken by the first read does not see a later commit.
    reader.exec("START TRANSACTION");
    EXPECT_EQ(reader.value("SELECT COUNT(*) FROM iso"), "0");
    writer.exec("INSERT INTO iso VALUES (1)");
    EXPECT_EQ(reader.value("SELECT COUNT(*) FROM iso"), "0");
    reader.exec("COMMIT");
    EXPECT_EQ(reader.value("SELECT COUNT(*) FROM iso"), "1");

    // READ COMMITTED for this session: every read sees what was committed before it.
    reader.exec("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED");
    EXPECT_EQ(reader.value("SELECT @@tx_isolation"), "READ-COMMITTED");
    EXPECT_EQ(writer.value("SELECT @@tx_isolation"), "REPEATABLE-READ");  // other sessions: not
    reader.exec("START TRANSACTION");
    EXPECT_EQ(reader.value("SELECT COUNT(*) FROM iso"), "1");
    writer.exec("INSERT INTO iso VALUES (2)");
    EXPECT_EQ(reader.value("SELECT COUNT(*) FROM iso"), "2");
    reader.exec("COMMIT");
}

TEST(MariadbServer, ClientRowsNullsBytesAndErrors) {
    IDEM_REQUIRE_MARIADB();
    auto c = shared_mariadb().client();
    const auto rows = c.query("SELECT 1, NULL, 'x' UNION ALL SELECT 2, 'y', NULL");
    ASSERT_EQ(rows.size(), 2U);
    EXPECT_EQ(rows[0], (MariadbClient::Row{"1", std::nullopt, "x"}));
    EXPECT_EQ(rows[1], (MariadbClient::Row{"2", "y", std::nullopt}));
    EXPECT_TRUE(c.query("SELECT 1 FROM DUAL WHERE 1 = 0").empty());
    EXPECT_EQ(c.value("SELECT NULL"), std::nullopt);
    EXPECT_THROW((void)c.value("SELECT 1 FROM DUAL WHERE 1 = 0"), std::runtime_error);

    // Binary-safe: a value with NUL and 0xFF bytes comes back whole.
    const std::string bytes("a\0b\xff", 4);
    EXPECT_EQ(c.value("SELECT X'610062FF'"), bytes);
    c.exec("DROP TABLE IF EXISTS blobs; CREATE TABLE blobs(k VARBINARY(16) PRIMARY KEY)");
    c.exec("INSERT INTO blobs VALUES (X'6100'), (X'61')");
    EXPECT_EQ(c.value("SELECT COUNT(*) FROM blobs"), "2");

    // Several statements: the rows of the last one that has any.
    EXPECT_EQ(c.value("SET @a = 41; SELECT @a + 1"), "42");

    try {
        c.exec("SELEC 1");
        ADD_FAILURE() << "invalid SQL did not throw";
    } catch (const std::runtime_error& e) {
        EXPECT_NE(std::string(e.what()).find("(1064)"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("SELEC 1"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(c.connected());  // a server error leaves the connection usable
    EXPECT_EQ(c.value("SELECT 1"), "1");
    EXPECT_THROW(shared_mariadb().client("no_such_db").exec("SELECT 1"), std::runtime_error);

    // Nothing listens on a just-probed port: connecting fails at once, with the address.
    const int closed = idem::testing::probe_free_port();
    MariadbClient nowhere{"127.0.0.1", closed, "", "root", std::chrono::seconds(1)};
    try {
        nowhere.exec("SELECT 1");
        ADD_FAILURE() << "a closed port answered";
    } catch (const std::runtime_error& e) {
        EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(closed)),
                  std::string::npos)
            << e.what();
    }
    EXPECT_FALSE(nowhere.connected());
}

TEST(MariadbServer, Kill9ThenStartRecoversCommittedRowsOnly) {
    IDEM_REQUIRE_MARIADB();
    MariadbServer db;
    const int port = db.port();
    const pid_t first = db.pid();
    auto c = db.client();
    c.exec("CREATE TABLE ledger(id INT PRIMARY KEY, note VARCHAR(64))");
    for (int i = 1; i <= 100; ++i)
        c.exec("INSERT INTO ledger VALUES (" + std::to_string(i) + ", 'committed')");
    c.exec("UPDATE ledger SET note = 'last commit before the crash' WHERE id = 100");

    // An open transaction with an uncommitted row and an uncommitted update: lost in the crash.
    auto in_flight = db.client();
    in_flight.exec(
        "START TRANSACTION; INSERT INTO ledger VALUES (5000, 'uncommitted'); "
        "UPDATE ledger SET note = 'uncommitted' WHERE id = 1");
    EXPECT_EQ(in_flight.value("SELECT COUNT(*) FROM ledger"), "101");

    db.kill9();
    EXPECT_FALSE(db.running());
    EXPECT_TRUE(idem::testing::process_gone(first));
    EXPECT_THROW(in_flight.exec("COMMIT"), std::runtime_error);
    EXPECT_FALSE(in_flight.connected());
    EXPECT_FALSE(answers(port));

    db.start();
    EXPECT_TRUE(db.running());
    EXPECT_EQ(db.port(), port);
    EXPECT_NE(db.pid(), first);
    // The same clients connect again by themselves.
    EXPECT_EQ(c.value("SELECT COUNT(*) FROM ledger"), "100");
    EXPECT_EQ(c.value("SELECT COUNT(*) FROM ledger WHERE id = 5000"), "0");
    EXPECT_EQ(c.value("SELECT note FROM ledger WHERE id = 1"), "committed");
    EXPECT_EQ(c.value("SELECT note FROM ledger WHERE id = 100"), "last commit before the crash");
    EXPECT_EQ(in_flight.value("SELECT COUNT(*) FROM ledger"), "100");
    EXPECT_NE(db.log_tail(20000).find("crash recovery"), std::string::npos) << db.log_tail();

    // A second crash right after the recovery works too.
    c.exec("INSERT INTO ledger VALUES (101, 'after recovery')");
    db.kill9();
    db.start();
    EXPECT_EQ(c.value("SELECT MAX(id) FROM ledger WHERE id < 5000"), "101");
}

TEST(MariadbServer, StopThenStartKeepsDataAndPort) {
    IDEM_REQUIRE_MARIADB();
    MariadbServer db;
    const int port = db.port();
    auto c = db.client();
    c.exec(
        "CREATE TABLE kept(id INT PRIMARY KEY, note VARCHAR(32)); "
        "INSERT INTO kept VALUES (1, 'before stop')");

    db.stop();
    EXPECT_FALSE(db.running());
    EXPECT_NO_THROW(db.stop());  // no-op when stopped
    EXPECT_FALSE(answers(port));
    EXPECT_NE(db.log_tail().find("Shutdown complete"), std::string::npos) << db.log_tail();

    // Someone else holds the port for a while: start() retries until it is free again.
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
    // Held until the server has tried the port and logged the refusal (a fixed sleep lost the
    // race on a loaded machine: mariadbd got to its bind after the port was free), 60 s at most.
    const std::filesystem::path log = db.dir() / "mariadbd.log";
    std::thread release([squatter, log] {
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (std::chrono::steady_clock::now() < until) {
            std::ifstream in(log);
            const std::string text{std::istreambuf_iterator<char>(in), {}};
            if (text.find("Address already in use") != std::string::npos) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        ::close(squatter);
    });
    EXPECT_NO_THROW(db.start());
    release.join();
    EXPECT_TRUE(db.running());
    EXPECT_EQ(db.port(), port);
    EXPECT_NE(db.log_tail(20000).find("Address already in use"), std::string::npos)
        << db.log_tail();
    EXPECT_EQ(c.value("SELECT note FROM kept WHERE id = 1"), "before stop");
    c.exec("INSERT INTO kept VALUES (2, 'after start')");
    EXPECT_EQ(c.value("SELECT COUNT(*) FROM kept"), "2");
}

TEST(MariadbServer, SecondServerInTheSameBinaryGetsAnotherPortAndDir) {
    IDEM_REQUIRE_MARIADB();
    auto& shared = shared_mariadb();
    MariadbServer other;
    EXPECT_NE(other.port(), shared.port());
    EXPECT_NE(other.dir(), shared.dir());
    EXPECT_NE(other.socket_path(), shared.socket_path());

    auto a = shared.client();
    auto b = other.client();
    a.exec(
        "DROP TABLE IF EXISTS owner; CREATE TABLE owner(name VARCHAR(8)); "
        "INSERT INTO owner VALUES ('shared')");
    b.exec("CREATE TABLE owner(name VARCHAR(8)); INSERT INTO owner VALUES ('other')");
    EXPECT_EQ(a.value("SELECT name FROM owner"), "shared");
    EXPECT_EQ(b.value("SELECT name FROM owner"), "other");
    EXPECT_EQ(a.value("SELECT @@port"), std::to_string(shared.port()));
    EXPECT_EQ(b.value("SELECT @@port"), std::to_string(other.port()));
}

TEST(MariadbServer, DestructorStopsTheServerAndRemovesTheDir) {
    IDEM_REQUIRE_MARIADB();
    std::filesystem::path dir;
    pid_t pid = -1;
    int port = 0;
    {
        MariadbServer db;
        dir = db.dir();
        pid = db.pid();
        port = db.port();
        db.client().exec("CREATE TABLE t(id INT)");
        EXPECT_TRUE(std::filesystem::exists(db.data_dir() / "idem_test" / "t.ibd")) << dir;
        EXPECT_TRUE(std::filesystem::exists(db.data_dir() / "ibdata1")) << dir;
    }
    EXPECT_FALSE(std::filesystem::exists(dir)) << dir;
    EXPECT_TRUE(idem::testing::process_gone(pid));
    EXPECT_FALSE(answers(port));
}

TEST(MariadbServer, DestructorAfterKill9StillCleansUp) {
    IDEM_REQUIRE_MARIADB();
    std::filesystem::path dir;
    {
        MariadbServer db;
        dir = db.dir();
        db.kill9();
    }
    EXPECT_FALSE(std::filesystem::exists(dir)) << dir;
}

// The owning process dies without destructors (SIGKILL): the watchdog stops mariadbd and removes
// the dir. The owner here is a fork()ed child of this test.
TEST(MariadbServer, WatchdogCleansUpWhenTheOwnerIsKilled) {
    IDEM_REQUIRE_MARIADB();
    const auto orphan = idem::testing::orphan_server<MariadbServer>();
    ASSERT_TRUE(WIFSIGNALED(orphan.status) && WTERMSIG(orphan.status) == SIGKILL) << orphan.report;
    ASSERT_TRUE(orphan.reported) << orphan.report;
    EXPECT_TRUE(eventually([&] {
        return idem::testing::process_gone(orphan.pid) && !std::filesystem::exists(orphan.dir) &&
               !answers(orphan.port);
    })) << "mariadbd "
        << orphan.pid << " or " << orphan.dir.string() << " survived its owner";
}

TEST(MariadbServer, AvailableSaysWhereItLooked) {
    IDEM_REQUIRE_MARIADB();
    const char* previous = std::getenv("IDEM_TEST_MARIADBD");
    const std::string saved = previous != nullptr ? previous : "";
    ::setenv("IDEM_TEST_MARIADBD", "/nonexistent/mariadbd", 1);
    std::string why;
    EXPECT_FALSE(MariadbServer::available(&why));
    EXPECT_NE(why.find("/nonexistent/mariadbd"), std::string::npos) << why;
    EXPECT_THROW(MariadbServer{}, std::runtime_error);
    if (previous != nullptr) {
        ::setenv("IDEM_TEST_MARIADBD", saved.c_str(), 1);
    } else {
        ::unsetenv("IDEM_TEST_MARIADBD");
    }
    why.clear();
    EXPECT_TRUE(MariadbServer::available(&why)) << why;
}

TEST(MariadbServer, StartupTime) {
    IDEM_REQUIRE_MARIADB();
    const auto t0 = std::chrono::steady_clock::now();
    auto db = std::make_unique<MariadbServer>();
    const auto t1 = std::chrono::steady_clock::now();
    db->stop();
    const auto t2 = std::chrono::steady_clock::now();
    db->start();
    const auto t3 = std::chrono::steady_clock::now();
    db->kill9();
    db->start();
    const auto t4 = std::chrono::steady_clock::now();
    db.reset();
    const auto t5 = std::chrono::steady_clock::now();
    auto ms = [](auto d) {
        return static_cast<long long>(
            std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
    };
    std::printf(
        "[ timing   ] new server (install-db+start+createdb) %lld ms, stop %lld ms, start %lld ms, "
        "kill9+start (recovery) %lld ms, destroy %lld ms\n",
        ms(t1 - t0), ms(t2 - t1), ms(t3 - t2), ms(t4 - t3), ms(t5 - t4));
    EXPECT_LT(ms(t1 - t0), 30000);
}

}  // namespace
