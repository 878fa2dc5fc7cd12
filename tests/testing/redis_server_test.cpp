// The Redis test fixture itself: a real redis-server per process (shared_redis()), independent
// servers beside it, SIGKILL + AOF replay on the same port, graceful stop/start, cleanup of the
// data dir and of the process (also when the test process dies without running destructors),
// and a binary-safe test client.

#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "idem/testing/process.hpp"
#include "idem/testing/redis_server.hpp"
#include "support/require_redis.hpp"

namespace {

using idem::testing::eventually;
using idem::testing::RedisClient;
using idem::testing::RedisServer;
using idem::testing::shared_redis;

/// CONFIG GET name -> its value ("?" when the reply is not a name/value pair).
std::string config(RedisClient& c, const std::string& name) {
    const auto reply = c.array({"CONFIG", "GET", name});
    return reply.size() == 2 && reply[1] ? *reply[1] : std::string("?");
}

bool answers_ping(const std::string& host, int port) {
    try {
        return RedisClient(host, port, std::chrono::milliseconds(500)).str({"PING"}) == "PONG";
    } catch (const std::exception&) {
        return false;
    }
}

TEST(RedisServer, SharedServerAnswersPingOnLoopbackOnly) {
    IDEM_REQUIRE_REDIS();
    auto& redis = shared_redis();
    EXPECT_EQ(&redis, &shared_redis());
    EXPECT_TRUE(redis.running());
    EXPECT_GT(redis.pid(), 0);
    EXPECT_EQ(redis.host(), "127.0.0.1");
    ASSERT_GT(redis.port(), 0);
    ASSERT_LT(redis.port(), 65536);

    auto c = redis.client();
    EXPECT_EQ(c.str({"PING"}), "PONG");
    EXPECT_EQ(config(c, "bind"), "127.0.0.1");
    EXPECT_EQ(config(c, "port"), std::to_string(redis.port()));
    EXPECT_EQ(config(c, "protected-mode"), "no");
    EXPECT_EQ(config(c, "appendonly"), "yes");
    EXPECT_EQ(config(c, "appendfsync"), "always");
    EXPECT_EQ(config(c, "save"), "");
    EXPECT_EQ(config(c, "daemonize"), "no");
    EXPECT_EQ(config(c, "logfile"), redis.log_file().string());
    EXPECT_TRUE(std::filesystem::equivalent(config(c, "dir"), redis.dir()));
    EXPECT_EQ(redis.dir().filename().string().rfind("idem-redis-", 0), 0U) << redis.dir();
    EXPECT_NE(redis.log_tail().find("Ready to accept connections"), std::string::npos)
        << redis.log_tail();
}

TEST(RedisServer, WritesBeforeKill9AreThereAfterStartOnTheSamePort) {
    IDEM_REQUIRE_REDIS();
    RedisServer redis;
    const int port = redis.port();
    const pid_t first = redis.pid();
    auto c = redis.client();
    for (int i = 0; i < 500; ++i)
        c.exec({"INCR", "counter"});
    c.exec({"SET", "last", "written just before the crash"});

    redis.kill9();
    EXPECT_FALSE(redis.running());
    EXPECT_TRUE(idem::testing::process_gone(first));
    EXPECT_THROW(c.exec({"PING"}), std::runtime_error);
    EXPECT_FALSE(answers_ping(redis.host(), port));

    redis.start();
    EXPECT_TRUE(redis.running());
    EXPECT_EQ(redis.port(), port);
    EXPECT_NE(redis.pid(), first);
    // The same client reconnects by itself.
    EXPECT_EQ(c.integer({"GET", "counter"}), 500);
    EXPECT_EQ(c.str({"GET", "last"}), "written just before the crash");
    EXPECT_NE(redis.log_tail().find("append only file"), std::string::npos) << redis.log_tail();

    // A second crash right after the replay works too.
    c.exec({"INCR", "counter"});
    redis.kill9();
    redis.start();
    EXPECT_EQ(c.integer({"GET", "counter"}), 501);
}

TEST(RedisServer, StopThenStartKeepsTheData) {
    IDEM_REQUIRE_REDIS();
    RedisServer redis;
    const int port = redis.port();
    auto c = redis.client();
    c.exec({"SET", "k", "v"});
    redis.stop();
    EXPECT_FALSE(redis.running());
    EXPECT_NO_THROW(redis.stop());  // no-op when stopped
    EXPECT_FALSE(answers_ping(redis.host(), port));
    redis.start();
    EXPECT_EQ(redis.port(), port);
    EXPECT_EQ(c.str({"GET", "k"}), "v");
}

TEST(RedisServer, TwoServersGetDifferentPortsAndDirs) {
    IDEM_REQUIRE_REDIS();
    RedisServer a;
    RedisServer b;
    EXPECT_NE(a.port(), b.port());
    EXPECT_NE(a.dir(), b.dir());
    auto ca = a.client();
    auto cb = b.client();
    ca.exec({"SET", "owner", "a"});
    cb.exec({"SET", "owner", "b"});
    EXPECT_EQ(ca.str({"GET", "owner"}), "a");
    EXPECT_EQ(cb.str({"GET", "owner"}), "b");
}

TEST(RedisServer, DestructorStopsTheServerAndRemovesTheDataDir) {
    IDEM_REQUIRE_REDIS();
    std::filesystem::path dir;
    pid_t pid = -1;
    int port = 0;
    {
        RedisServer redis;
        dir = redis.dir();
        pid = redis.pid();
        port = redis.port();
        redis.client().exec({"SET", "k", "v"});
        EXPECT_TRUE(std::filesystem::exists(dir / "appendonlydir")) << dir;
    }
    EXPECT_FALSE(std::filesystem::exists(dir)) << dir;
    EXPECT_TRUE(idem::testing::process_gone(pid));
    EXPECT_FALSE(answers_ping("127.0.0.1", port));
}

TEST(RedisServer, DestructorAfterKill9StillCleansUp) {
    IDEM_REQUIRE_REDIS();
    std::filesystem::path dir;
    {
        RedisServer redis;
        dir = redis.dir();
        redis.kill9();
    }
    EXPECT_FALSE(std::filesystem::exists(dir)) << dir;
}

// The owning process dies without destructors (SIGKILL): the watchdog stops redis-server and
// removes the data dir. The owner here is a fork()ed child of this test.
TEST(RedisServer, WatchdogCleansUpWhenTheOwnerIsKilled) {
    IDEM_REQUIRE_REDIS();
    const auto orphan = idem::testing::orphan_server<RedisServer>();
    ASSERT_TRUE(WIFSIGNALED(orphan.status) && WTERMSIG(orphan.status) == SIGKILL) << orphan.report;
    ASSERT_TRUE(orphan.reported) << orphan.report;
    EXPECT_TRUE(eventually([&] {
        return idem::testing::process_gone(orphan.pid) && !std::filesystem::exists(orphan.dir) &&
               !answers_ping("127.0.0.1", orphan.port);
    })) << "redis-server "
        << orphan.pid << " or " << orphan.dir.string() << " survived its owner";
}

TEST(RedisServer, BinarySafeRoundTrip) {
    IDEM_REQUIRE_REDIS();
    auto& redis = shared_redis();
    redis.flushall();
    auto c = redis.client();

    std::string key = "idem:{bin} \"double\" 'single' ";
    key.push_back('\0');
    key += "after-nul";
    key.push_back('\xff');
    std::string value = "v a l\r\n{\"json\": 'x'}";
    value.push_back('\0');
    value.push_back('\xff');
    value.push_back('\0');

    c.exec({"SET", key, value});
    EXPECT_EQ(c.str({"GET", key}), value);
    EXPECT_EQ(c.integer({"STRLEN", key}), static_cast<long long>(value.size()));
    EXPECT_EQ(c.integer({"EXISTS", key}), 1);
    // The key cut at its NUL is another key.
    EXPECT_EQ(c.integer({"EXISTS", key.substr(0, key.find('\0'))}), 0);

    const std::string missing = key + "-missing";
    const std::vector<std::optional<std::string>> both = c.array({"MGET", key, missing});
    ASSERT_EQ(both.size(), 2U);
    EXPECT_EQ(both[0], value);
    EXPECT_EQ(both[1], std::nullopt);

    c.exec({"HSET", "h", key, value});
    const auto fields = c.array({"HGETALL", "h"});
    ASSERT_EQ(fields.size(), 2U);
    EXPECT_EQ(fields[0], key);
    EXPECT_EQ(fields[1], value);
}

TEST(RedisServer, FlushallRemovesEveryKey) {
    IDEM_REQUIRE_REDIS();
    auto& redis = shared_redis();
    auto c = redis.client();
    c.exec({"SET", "a", "1"});
    c.exec({"SET", "b", "2"});
    EXPECT_GE(c.integer({"DBSIZE"}), 2);
    redis.flushall();
    EXPECT_EQ(c.integer({"DBSIZE"}), 0);
}

TEST(RedisServer, ClientRepliesNilsAndErrors) {
    IDEM_REQUIRE_REDIS();
    auto& redis = shared_redis();
    auto c = redis.client();
    c.exec({"DEL", "client:missing", "client:text"});
    EXPECT_EQ(c.str({"GET", "client:missing"}), std::nullopt);
    EXPECT_EQ(c.integer({"GET", "client:missing"}), std::nullopt);
    EXPECT_TRUE(c.array({"LRANGE", "client:missing", "0", "-1"}).empty());
    EXPECT_EQ(c.str({"SET", "client:text", "abc"}), "OK");
    EXPECT_EQ(c.str({"INCRBY", "client:n", "7"}), "7");  // an integer reply as text
    c.exec({"DEL", "client:n"});

    EXPECT_THROW(c.integer({"GET", "client:text"}), std::runtime_error);  // not an integer
    EXPECT_THROW(c.exec({"INCR", "client:text"}), std::runtime_error);    // error reply
    try {
        c.exec({"NO-SUCH-COMMAND"});
        ADD_FAILURE() << "an unknown command did not throw";
    } catch (const std::runtime_error& e) {
        EXPECT_NE(std::string(e.what()).find("unknown command"), std::string::npos) << e.what();
    }
    EXPECT_EQ(c.str({"PING"}), "PONG");  // an error reply leaves the connection usable

    // Nothing listens on a just-probed port: connecting fails at once, with the address.
    const int closed = idem::testing::probe_free_port();
    RedisClient nowhere{"127.0.0.1", closed, std::chrono::milliseconds(500)};
    try {
        nowhere.exec({"PING"});
        ADD_FAILURE() << "PING to a closed port succeeded";
    } catch (const std::runtime_error& e) {
        EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(closed)),
                  std::string::npos)
            << e.what();
    }
    EXPECT_FALSE(nowhere.connected());
}

TEST(RedisServer, AvailableSaysWhereItLooked) {
    IDEM_REQUIRE_REDIS();
    const char* previous = std::getenv("IDEM_TEST_REDIS_SERVER");
    const std::string saved = previous != nullptr ? previous : "";
    ::setenv("IDEM_TEST_REDIS_SERVER", "/nonexistent/redis-server", 1);
    std::string why;
    EXPECT_FALSE(RedisServer::available(&why));
    EXPECT_NE(why.find("/nonexistent/redis-server"), std::string::npos) << why;
    if (previous != nullptr) {
        ::setenv("IDEM_TEST_REDIS_SERVER", saved.c_str(), 1);
    } else {
        ::unsetenv("IDEM_TEST_REDIS_SERVER");
    }
    why.clear();
    EXPECT_TRUE(RedisServer::available(&why)) << why;
}

}  // namespace
