// 3. A worker killed with SIGKILL inside a delivery. A real process, a real SQLite file: what
// the kernel leaves behind after kill -9 is what the next worker finds.

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "idem/idem.hpp"
#include "idem/store/sqlite.hpp"
#include "support/kill_at_window.hpp"
#include "support/store_envs.hpp"
#include "support/temp_dir.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;

enum class Window {
    effect_started,       // claimed, effect running, nothing written yet
    after_effect_writes,  // claim and effect rows written, not committed
    after_commit_no_ack,  // committed; killed before the consumer could ack
};

std::string window_name(const ::testing::TestParamInfo<Window>& info) {
    switch (info.param) {
        case Window::effect_started:
            return "EffectStarted";
        case Window::after_effect_writes:
            return "AfterEffectWrites";
        case Window::after_commit_no_ack:
            return "AfterCommitBeforeAck";
    }
    return "unknown";
}

class CrashWindow : public ::testing::TestWithParam<Window> {
  protected:
    idem_test::TempDir dir;
    std::string path = dir.file("worker.db");

    void SetUp() override {
        idem::SqliteStore store(path);
        idem_test::sqlite_exec(store.db(), "CREATE TABLE captures(order_id TEXT NOT NULL);");
    }

    long long captures(idem::SqliteStore& store) {
        return idem_test::sqlite_count(store.db(), "SELECT count(*) FROM captures");
    }

    /// A worker process handles one delivery and is killed with SIGKILL at `window`.
    void run_worker_and_kill_it(Window window) {
        ASSERT_TRUE(idem_test::kill_at_window([&](const std::function<void()>& reached) {
            idem::SqliteStore store(path);  // the worker's own connection
            auto handler = idem::make_handler(
                store, idem::Policy{"capture"}, [&](auto& tx, const std::string& order) {
                    if (window == Window::effect_started) reached();
                    tx.execute("INSERT INTO captures(order_id) VALUES (?)", order);
                    if (window == Window::after_effect_writes) reached();
                });
            auto outcome = handler.handle(Delivery{"msg-1", 1}, std::string("8814"));
            if (outcome.disposition == Disposition::processed) reached();
        }));
    }
};

TEST_P(CrashWindow, KillNineChangesNothingAndTheRedeliveryWorksOnce) {
    const Window window = GetParam();
    run_worker_and_kill_it(window);

    idem::SqliteStore store(path);  // a restarted worker
    const bool committed = window == Window::after_commit_no_ack;
    EXPECT_EQ(store.find_claim("capture", "msg-1").has_value(), committed);
    EXPECT_EQ(captures(store), committed ? 1 : 0);

    int runs = 0;
    auto handler =
        idem::make_handler(store, idem::Policy{"capture"}, [&](auto& tx, const std::string& order) {
            ++runs;
            tx.execute("INSERT INTO captures(order_id) VALUES (?)", order);
        });
    // The broker redelivers the unacked message.
    auto outcome = handler.handle(Delivery{"msg-1", 2}, std::string("8814"));
    EXPECT_EQ(outcome.disposition, committed ? Disposition::duplicate : Disposition::processed)
        << outcome.reason;
    EXPECT_TRUE(idem::should_ack(outcome));
    EXPECT_EQ(runs, committed ? 0 : 1);
    EXPECT_EQ(captures(store), 1);
    EXPECT_EQ(handler.handle(Delivery{"msg-1", 3}, std::string("8814")).disposition,
              Disposition::duplicate);
    EXPECT_EQ(captures(store), 1);
}

INSTANTIATE_TEST_SUITE_P(Sqlite, CrashWindow,
                         ::testing::Values(Window::effect_started, Window::after_effect_writes,
                                           Window::after_commit_no_ack),
                         window_name);

}  // namespace
