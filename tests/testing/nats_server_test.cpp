// idem::testing::NatsServer, the fixture itself: a restart on the same port and store dir keeps
// JetStream's streams (after a clean stop and after a kill -9), the destructor removes the dir,
// the watchdog cleans up after an owner killed by SIGKILL, and available() says where it looked.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

#include "idem/nats/admin.hpp"
#include "idem/nats/connection.hpp"
#include "idem/testing/nats_server.hpp"
#include "support/require_nats.hpp"

namespace {

using namespace std::chrono_literals;
namespace nats = idem::nats;

std::uint64_t messages_in(const idem::testing::NatsServer& server, const std::string& stream) {
    nats::Connection connection{nats::Endpoint{server.url()}};
    return nats::stream_state(connection, stream).messages;
}

TEST(NatsServer, StreamsSurviveStopAndKill9ThenStartOnTheSamePort) {
    IDEM_REQUIRE_NATS();
    idem::testing::NatsServer server;
    const int port = server.port();
    {
        nats::Connection connection{nats::Endpoint{server.url()}};
        nats::ensure_stream(connection, {"KEEP", {"keep.>"}});
        for (int i = 0; i < 3; ++i)
            connection.publish("keep.x", std::to_string(i));
    }
    server.stop();
    EXPECT_FALSE(server.running());
    server.start();
    EXPECT_EQ(server.port(), port);
    EXPECT_EQ(messages_in(server, "KEEP"), 3u);

    const pid_t before = server.pid();
    server.kill9();
    EXPECT_TRUE(idem::testing::process_gone(before));
    server.start();
    EXPECT_EQ(server.port(), port);
    EXPECT_EQ(messages_in(server, "KEEP"), 3u);  // written before the stop: on disk
    EXPECT_TRUE(std::filesystem::exists(server.store_dir())) << server.store_dir();
}

TEST(NatsServer, DestructorStopsTheServerAndRemovesItsDir) {
    IDEM_REQUIRE_NATS();
    std::filesystem::path dir;
    pid_t pid = -1;
    {
        idem::testing::NatsServer server;
        dir = server.dir();
        pid = server.pid();
        EXPECT_EQ(server.url(), "nats://127.0.0.1:" + std::to_string(server.port()));
        EXPECT_NE(server.name().find("idem-"), std::string::npos);
    }
    EXPECT_FALSE(std::filesystem::exists(dir)) << dir;
    EXPECT_TRUE(idem::testing::process_gone(pid));
}

TEST(NatsServer, WatchdogCleansUpWhenTheOwnerIsKilled) {
    IDEM_REQUIRE_NATS();
    const auto orphan = idem::testing::orphan_server<idem::testing::NatsServer>();
    ASSERT_TRUE(WIFSIGNALED(orphan.status) && WTERMSIG(orphan.status) == SIGKILL) << orphan.report;
    ASSERT_TRUE(orphan.reported) << orphan.report;
    EXPECT_TRUE(idem::testing::eventually([&] {
        return idem::testing::process_gone(orphan.pid) && !std::filesystem::exists(orphan.dir);
    })) << orphan.pid
        << " or " << orphan.dir.string() << " survived its owner";
}

TEST(NatsServer, AvailableSaysWhereItLooked) {
    const char* previous = std::getenv("IDEM_TEST_NATS_SERVER");
    const std::optional<std::string> saved =
        previous != nullptr ? std::optional<std::string>(previous) : std::nullopt;
    ::setenv("IDEM_TEST_NATS_SERVER", "/nonexistent/nats-server", 1);
    std::string why;
    EXPECT_FALSE(idem::testing::NatsServer::available(&why));
    EXPECT_NE(why.find("IDEM_TEST_NATS_SERVER=/nonexistent/nats-server"), std::string::npos) << why;
    if (saved) {
        ::setenv("IDEM_TEST_NATS_SERVER", saved->c_str(), 1);
    } else {
        ::unsetenv("IDEM_TEST_NATS_SERVER");
    }
}

}  // namespace
