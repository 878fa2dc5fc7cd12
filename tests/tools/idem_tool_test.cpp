// The `idem` command (tools/idem/main.cpp) run as a user runs it: the built binary, on a real
// store (an SQLite file, the test's own PostgreSQL, MariaDB and Redis servers), its output and
// exit status read back. Messages are parked by a real handler first.

#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/handler.hpp"
#include "idem/outbox.hpp"
#include "idem/testing/temp_dir.hpp"
#include "support/sql_store_envs.hpp"
#if IDEM_HAS_REDIS
#include "support/redis_env.hpp"
#include "support/require_redis.hpp"
#endif

namespace {

struct Ran {
    int status = -1;
    std::string out;  ///< stdout and stderr, interleaved
};

/// Runs the tool with @p arguments (each single-quoted for the shell).
Ran run_tool(const std::vector<std::string>& arguments, const std::string& env = "") {
    std::string command = env + " '" IDEM_TOOL_PATH "'";
    for (const std::string& argument : arguments) {
        std::string quoted;
        for (char c : argument)
            quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
        command += " '" + quoted + "'";
    }
    command += " 2>&1";
    FILE* pipe = ::popen(command.c_str(), "r");
    if (!pipe) throw std::runtime_error("popen failed");
    Ran ran;
    std::array<char, 4096> buffer{};
    std::size_t got = 0;
    while ((got = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0)
        ran.out.append(buffer.data(), got);
    const int status = ::pclose(pipe);
    ran.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return ran;
}

bool has(const std::string& text, const std::string& part) {
    return text.find(part) != std::string::npos;
}

std::size_t occurrences(const std::string& text, const std::string& part) {
    std::size_t n = 0;
    for (auto at = text.find(part); at != std::string::npos; at = text.find(part, at + 1))
        ++n;
    return n;
}

template <class Env>
std::string url_of(Env& env) {
    if constexpr (std::is_same_v<Env, idem_test::SqliteEnv>) {
        return "sqlite:" + env.dir.file("idem.db");
#if IDEM_HAS_POSTGRES
    } else if constexpr (std::is_same_v<Env, idem_test::PostgresEnv>) {
        return "postgresql://idem@127.0.0.1:" +
               std::to_string(idem::testing::shared_postgres().port()) + "/" + env.database;
#endif
#if IDEM_HAS_MYSQL
    } else if constexpr (std::is_same_v<Env, idem_test::MysqlEnv>) {
        auto& server = idem::testing::shared_mariadb();
        return "mysql://" + server.user() + "@" + server.host() + ":" +
               std::to_string(server.port()) + "/" + env.database;
#endif
#if IDEM_HAS_REDIS
    } else if constexpr (std::is_same_v<Env, idem_test::RedisEnv>) {
        auto& server = idem::testing::shared_redis();
        return "redis://" + server.host() + ":" + std::to_string(server.port());
#endif
    } else {
        static_assert(!sizeof(Env), "no URL for this store");
    }
}

using StoreEnvs = ::testing::Types<idem_test::SqliteEnv
#if IDEM_HAS_POSTGRES
                                   ,
                                   idem_test::PostgresEnv
#endif
#if IDEM_HAS_MYSQL
                                   ,
                                   idem_test::MysqlEnv
#endif
#if IDEM_HAS_REDIS
                                   ,
                                   idem_test::RedisEnv
#endif
                                   >;

template <class Env>
class IdemTool : public idem_test::StoreEnvTest<Env> {
  protected:
    bool fixed = false;

    void SetUp() override {
        idem_test::StoreEnvTest<Env>::SetUp();
#if IDEM_HAS_REDIS
        if constexpr (std::is_same_v<Env, idem_test::RedisEnv>) IDEM_REQUIRE_REDIS();
#endif
    }

    /// A handler whose effect fails ("gateway 503") until `fixed`.
    auto consumer() {
        return idem::make_handler(this->store(), idem::Policy{"orders"},
                                  [this](auto& tx, const std::string& body) {
                                      if (!fixed) throw std::runtime_error("gateway 503");
                                      Env::write_effect(tx, body);
                                  });
    }
    /// Parks @p id at the poison limit; a lease store (Redis) counts its own attempts, so the
    /// broker redelivers it until they reach the limit.
    /// @p origin, @p position: where the broker held it (none by default).
    template <class Handler>
    void park(Handler& handler, const std::string& id, const std::string& origin = {},
              const std::string& position = {}) {
        idem::Delivery delivery{id, 5u};
        delivery.origin = origin;
        delivery.origin_position = position;
        for (int attempt = 1; attempt <= 5; ++attempt) {
            const idem::Outcome outcome = handler.handle(delivery, std::string("body of " + id));
            if (outcome.disposition == idem::Disposition::dead_lettered) return;
            ASSERT_EQ(outcome.disposition, idem::Disposition::failed) << outcome.reason;
        }
        FAIL() << id << " was not parked";
    }
    Ran tool(std::vector<std::string> arguments) {
        arguments.insert(arguments.begin(), {"--store", url_of(this->env)});
        return run_tool(arguments);
    }
};
TYPED_TEST_SUITE(IdemTool, StoreEnvs, idem_test::EnvNames);

TYPED_TEST(IdemTool, ListsShowsRedrivesOnceAndPurgesDeadLetters) {
    // The tool's store runs on the real clock: the intents it writes are due from now on.
    this->env.now = std::chrono::system_clock::now();
    auto handler = this->consumer();
    for (const char* id : {"m-1", "m-2", "m-3"})
        this->park(handler, id);

    Ran listed = this->tool({"dead-letters", "list", "--json"});
    ASSERT_EQ(listed.status, 0) << listed.out;
    EXPECT_EQ(occurrences(listed.out, "\"message_id\":"), 3u) << listed.out;
    EXPECT_TRUE(has(listed.out, "\"message_id\":\"m-2\"")) << listed.out;
    EXPECT_TRUE(has(listed.out, "\"scope\":\"orders\"")) << listed.out;
    EXPECT_TRUE(has(listed.out, "\"redriven_at\":null")) << listed.out;

    listed = this->tool({"dead-letters", "list", "--id", "m-3"});
    ASSERT_EQ(listed.status, 0) << listed.out;
    EXPECT_TRUE(has(listed.out, "m-3")) << listed.out;
    EXPECT_FALSE(has(listed.out, "m-1")) << listed.out;
    EXPECT_TRUE(has(listed.out, "1 dead letter(s)")) << listed.out;

    const Ran shown = this->tool({"dead-letters", "show", "orders", "m-1", "--json"});
    ASSERT_EQ(shown.status, 0) << shown.out;
    EXPECT_TRUE(has(shown.out, "\"payload\":\"body of m-1\"")) << shown.out;
    EXPECT_TRUE(has(shown.out, "\"outcome\":\"dead_lettered\"")) << shown.out;

    // A dry run names m-1 and changes nothing.
    Ran redriven = this->tool(
        {"dead-letters", "redrive", "--destination", "orders-in", "--id", "m-1", "--dry-run"});
    ASSERT_EQ(redriven.status, 0) << redriven.out;
    EXPECT_TRUE(has(redriven.out, "dry run: 1 redriven")) << redriven.out;
    EXPECT_TRUE(this->store().outbox_rows().empty());

    redriven = this->tool({"dead-letters", "redrive", "--destination", "orders-in", "--id", "m-1",
                           "--id", "m-2", "--json"});
    ASSERT_EQ(redriven.status, 0) << redriven.out;
    EXPECT_EQ(occurrences(redriven.out, "\"status\":\"redriven\""), 2u) << redriven.out;
    // Run again: nothing left to redrive, no second intent.
    redriven = this->tool(
        {"dead-letters", "redrive", "--destination", "orders-in", "--id", "m-1", "--id", "m-2"});
    ASSERT_EQ(redriven.status, 0) << redriven.out;
    EXPECT_TRUE(has(redriven.out, "redrive: 0 redriven")) << redriven.out;
    ASSERT_EQ(this->store().outbox_rows().size(), 2u);

    // The relay delivers the intents; the fixed handler processes each once.
    this->fixed = true;
    this->env.now = std::chrono::system_clock::now() + std::chrono::minutes(1);
    std::vector<idem::Disposition> outcomes;
    idem::Relay relay{
        this->store(), [&](const idem::OutboxRow& row) {
            EXPECT_EQ(row.destination, "orders-in");
            outcomes.push_back(
                handler.handle(idem::Delivery{row.idempotency_key, 1u}, row.payload).disposition);
        }};
    relay.run_once();
    EXPECT_EQ(outcomes, (std::vector<idem::Disposition>{idem::Disposition::processed,
                                                        idem::Disposition::processed}));
    // Its whole story: processed now, the entry it was parked under (redriven), the failures
    // noted before (the redrive cleared the record: none since), and the redrive's intent, sent.
    const Ran claim = this->tool({"claims", "show", "orders", "m-1", "--json"});
    ASSERT_EQ(claim.status, 0) << claim.out;
    EXPECT_TRUE(has(claim.out, "\"outcome\":\"processed\"")) << claim.out;
    EXPECT_TRUE(has(claim.out, "\"failure\":null")) << claim.out;
    EXPECT_EQ(occurrences(claim.out, "\"entry\":"), 2u)
        << "one dead letter, one intent: " << claim.out;
    EXPECT_TRUE(has(claim.out, "\"redrive_count\":1")) << claim.out;
    EXPECT_TRUE(has(claim.out, "\"outbox\":[{")) << claim.out;
    EXPECT_TRUE(has(claim.out, "\"destination\":\"orders-in\",\"idempotency_key\":\"m-1\""))
        << claim.out;
    EXPECT_FALSE(has(claim.out, "\"sent_at\":null")) << "the relay sent it: " << claim.out;
    const Ran story = this->tool({"claims", "show", "orders", "m-1"});
    ASSERT_EQ(story.status, 0) << story.out;
    EXPECT_TRUE(has(story.out, "claim: processed")) << story.out;
    EXPECT_TRUE(has(story.out, "dead letter ")) << story.out;
    EXPECT_TRUE(has(story.out, "to orders-in  key m-1  sent ")) << story.out;

    // Parked now: only m-3; with --all the two redriven entries too.
    listed = this->tool({"dead-letters", "list", "--json"});
    EXPECT_EQ(occurrences(listed.out, "\"message_id\":"), 1u) << listed.out;
    listed = this->tool({"dead-letters", "list", "--all", "--json"});
    EXPECT_EQ(occurrences(listed.out, "\"message_id\":"), 3u) << listed.out;

    const Ran stats = this->tool({"stats", "--json"});
    ASSERT_EQ(stats.status, 0) << stats.out;
    EXPECT_TRUE(has(stats.out, "{\"scope\":\"orders\",\"parked\":1,\"redriven\":2}")) << stats.out;

    // Purging wants a selection; a dry run deletes nothing; then m-3's entry goes, paced.
    Ran purged = this->tool({"dead-letters", "purge"});
    EXPECT_EQ(purged.status, 2) << purged.out;
    EXPECT_TRUE(has(purged.out, "--everything")) << purged.out;
    purged = this->tool({"dead-letters", "purge", "--id", "m-3", "--dry-run"});
    ASSERT_EQ(purged.status, 0) << purged.out;
    EXPECT_TRUE(has(purged.out, "1 dead letter(s) would be purged")) << purged.out;
    EXPECT_EQ(this->store().dead_letters().size(), 3u);
    purged = this->tool({"dead-letters", "purge", "--id", "m-3", "--rate", "50", "--json"});
    ASSERT_EQ(purged.status, 0) << purged.out;
    EXPECT_EQ(occurrences(purged.out, "\"message_id\":\"m-3\""), 1u) << purged.out;
    EXPECT_EQ(this->store().dead_letters().size(), 2u);
    // Its claim stays: a re-published copy is still a duplicate.
    EXPECT_EQ(handler.handle(idem::Delivery{"m-3", 1u}, std::string("body of m-3")).disposition,
              idem::Disposition::duplicate);
}

TYPED_TEST(IdemTool, RedrivesEachMessageBackToItsOriginWithoutADestination) {
    this->env.now = std::chrono::system_clock::now();
    auto handler = this->consumer();
    // m-1 fails once (its effect throws) before it reaches the poison limit.
    ASSERT_EQ(handler.handle(idem::Delivery{"m-1", 1u}, std::string("body of m-1")).disposition,
              idem::Disposition::failed);
    this->park(handler, "m-1", "orders-in", "1700000000000-5");
    this->park(handler, "m-2");  // its delivery named no origin

    const Ran shown = this->tool({"dead-letters", "show", "orders", "m-1", "--json"});
    ASSERT_EQ(shown.status, 0) << shown.out;
    EXPECT_TRUE(has(shown.out, "\"failure\":\"effect threw: gateway 503\"")) << shown.out;
    EXPECT_TRUE(has(shown.out, "\"first_failed_at\":\"")) << shown.out;
    const Ran told = this->tool({"dead-letters", "show", "orders", "m-1"});
    EXPECT_TRUE(has(told.out, "last: effect threw: gateway 503")) << told.out;

    Ran listed = this->tool({"dead-letters", "list", "--json"});
    ASSERT_EQ(listed.status, 0) << listed.out;
    EXPECT_TRUE(has(listed.out, "\"origin\":\"orders-in\",\"origin_position\":\"1700000000000-5\""))
        << listed.out;
    EXPECT_TRUE(has(listed.out, "\"origin\":\"\",\"origin_position\":\"\"")) << listed.out;
    listed = this->tool({"dead-letters", "list", "--id", "m-1"});
    EXPECT_TRUE(has(listed.out, "from orders-in 1700000000000-5")) << listed.out;
    // Selected by how the effect failed.
    listed = this->tool({"dead-letters", "list", "--failure", "gateway 503", "--json"});
    ASSERT_EQ(listed.status, 0) << listed.out;
    EXPECT_TRUE(has(listed.out, "\"message_id\":\"m-1\"")) << listed.out;
    listed = this->tool({"dead-letters", "list", "--failure", "timed out"});
    EXPECT_TRUE(has(listed.out, "0 dead letter(s)")) << listed.out;

    // No --destination: m-1 back to its origin, m-2 left parked (exit 1: not all done).
    const Ran redriven = this->tool({"dead-letters", "redrive", "--json"});
    EXPECT_EQ(redriven.status, 1) << redriven.out;
    EXPECT_EQ(occurrences(redriven.out, "\"status\":\"redriven\""), 1u) << redriven.out;
    EXPECT_TRUE(has(redriven.out, "\"message_id\":\"m-2\",\"status\":\"no_destination\""))
        << redriven.out;
    const auto rows = this->store().outbox_rows();
    ASSERT_EQ(rows.size(), 1u);
    EXPECT_EQ(rows[0].idempotency_key, "m-1");
    EXPECT_EQ(rows[0].destination, "orders-in");
    EXPECT_EQ(this->store().find_claim("orders", "m-2")->disposition,
              idem::Disposition::dead_lettered);
}

TYPED_TEST(IdemTool, PurgesOldClaimsByAge) {
    auto handler = this->consumer();
    this->fixed = true;
    ASSERT_EQ(handler.handle(idem::Delivery{"old", 1u}, std::string("old")).disposition,
              idem::Disposition::processed);
    // The store's clock is the test's: the claim is from the test epoch, long ago.
    const Ran kept = this->tool({"purge", "--older-than", "36500d", "--json"});
    ASSERT_EQ(kept.status, 0) << kept.out;
    EXPECT_TRUE(has(kept.out, "\"claims\":0")) << kept.out;
    const Ran purged = this->tool({"purge", "--older-than", "1d", "--json"});
    ASSERT_EQ(purged.status, 0) << purged.out;
    EXPECT_TRUE(has(purged.out, "\"claims\":1")) << purged.out;
    EXPECT_FALSE(this->store().find_claim("orders", "old"));
}

// ---------------------------------------------------------------------------------------------
// Errors: a clear line, a documented status, nothing changed.

TEST(IdemToolErrors, HelpForEveryCommand) {
    Ran ran = run_tool({"--help"});
    EXPECT_EQ(ran.status, 0);
    EXPECT_TRUE(has(ran.out, "dead-letters redrive")) << ran.out;
    for (std::vector<std::string> verb : {std::vector<std::string>{"dead-letters", "list"},
                                          {"dead-letters", "show"},
                                          {"dead-letters", "redrive"},
                                          {"dead-letters", "purge"},
                                          {"claims", "show"},
                                          {"purge"},
                                          {"stats"}}) {
        verb.push_back("--help");
        ran = run_tool(verb);
        EXPECT_EQ(ran.status, 0) << ran.out;
        EXPECT_TRUE(has(ran.out, "usage: idem " + verb[0])) << ran.out;
    }
    ran = run_tool({});
    EXPECT_EQ(ran.status, 2);
    EXPECT_TRUE(has(ran.out, "usage: idem")) << ran.out;
}

TEST(IdemToolErrors, AnEmptySqliteFileListsNothingAsJson) {
    idem::testing::TempDir dir;
    const std::string path = (dir.path() / "empty.db").string();
    {
        std::FILE* file = std::fopen(path.c_str(), "w");
        ASSERT_TRUE(file);
        std::fclose(file);
    }
    const Ran ran = run_tool({"dead-letters", "list", "--store", "sqlite:" + path, "--json"});
    EXPECT_EQ(ran.status, 0) << ran.out;
    EXPECT_EQ(ran.out, "{\"dead_letters\":[]}\n");
    // The store comes from IDEM_STORE as well.
    const Ran from_env = run_tool({"stats", "--json"}, "IDEM_STORE='sqlite:" + path + "'");
    EXPECT_EQ(from_env.status, 0) << from_env.out;
    EXPECT_EQ(from_env.out, "{\"scopes\":[],\"reasons\":[]}\n");
}

TEST(IdemToolErrors, BadInputIsOneClearLineAndNothingIsCreated) {
    idem::testing::TempDir dir;
    const std::string missing = (dir.path() / "typo.db").string();
    Ran ran = run_tool({"dead-letters", "list", "--store", "sqlite:" + missing});
    EXPECT_EQ(ran.status, 3) << ran.out;
    EXPECT_EQ(ran.out, "idem: no such SQLite file: " + missing + "\n");
    EXPECT_FALSE(std::filesystem::exists(missing));

    ran = run_tool({"dead-letters", "list", "--store", "ftp://somewhere"});
    EXPECT_EQ(ran.status, 2) << ran.out;
    EXPECT_TRUE(has(ran.out, "unknown store URL 'ftp'")) << ran.out;
    ran = run_tool({"dead-letters", "list"}, "IDEM_STORE=");
    EXPECT_EQ(ran.status, 2) << ran.out;
    EXPECT_TRUE(has(ran.out, "no store")) << ran.out;
    ran = run_tool({"dead-letters", "frobnicate", "--store", "sqlite:" + missing});
    EXPECT_EQ(ran.status, 2) << ran.out;
    EXPECT_TRUE(has(ran.out, "unknown command 'dead-letters frobnicate'")) << ran.out;
    ran = run_tool({"dead-letters", "list", "--limit", "x", "--store", "sqlite:" + missing});
    EXPECT_EQ(ran.status, 2) << ran.out;
    EXPECT_TRUE(has(ran.out, "--limit wants a whole number, not 'x'")) << ran.out;
    ran = run_tool({"dead-letters", "redrive", "--rate", "-1", "--store", "sqlite:" + missing});
    EXPECT_EQ(ran.status, 2) << ran.out;
    EXPECT_TRUE(has(ran.out, "--rate")) << ran.out;
}

#if IDEM_HAS_REDIS
TEST(IdemToolErrors, ARedisUrlIsReadOrRefusedInOneLine) {
    Ran ran = run_tool({"stats", "--store", "redis://127.0.0.1:1"});
    EXPECT_EQ(ran.status, 3) << ran.out;
    EXPECT_TRUE(has(ran.out, "idem: no Redis seed answered")) << ran.out;
    EXPECT_EQ(occurrences(ran.out, "\n"), 1u) << ran.out;
    ran = run_tool({"stats", "--store", "redis-sentinel://127.0.0.1:1"});
    EXPECT_EQ(ran.status, 2) << ran.out;
    EXPECT_TRUE(has(ran.out, "names the master")) << ran.out;
    ran = run_tool({"stats", "--store", "rediss://127.0.0.1:1"});
    EXPECT_EQ(ran.status, 2) << ran.out;
    EXPECT_TRUE(has(ran.out, "no TLS")) << ran.out;
    ran = run_tool({"stats", "--store", "redis://127.0.0.1:6379/zero"});
    EXPECT_EQ(ran.status, 2) << ran.out;
    EXPECT_TRUE(has(ran.out, "the database of the store URL wants a whole number")) << ran.out;
}
#endif

#if IDEM_HAS_POSTGRES
TEST(IdemToolErrors, AnUnreachableServerIsExitThree) {
    // A port nothing listens on (the shared server's, once it is gone, is not ours to take):
    // port 1 on loopback refuses at once.
    const Ran ran =
        run_tool({"stats", "--store", "postgresql://idem@127.0.0.1:1/idem_test?connect_timeout=2"});
    EXPECT_EQ(ran.status, 3) << ran.out;
    EXPECT_TRUE(has(ran.out, "idem: ")) << ran.out;
    EXPECT_EQ(occurrences(ran.out, "\n"), 1u) << ran.out;
}
#endif

}  // namespace
