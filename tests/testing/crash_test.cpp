// 3. A worker killed with SIGKILL inside a delivery. A real process, a real SQLite file: what
// the kernel leaves behind after kill -9 is what the next worker finds.

#include <gtest/gtest.h>

#include <string>

#include "idem/idem.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/crash.hpp"
#include "idem/testing/temp_dir.hpp"
#include "support/store_envs.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;
using idem::testing::Window;

class CrashWindow : public ::testing::TestWithParam<Window> {
  protected:
    idem::testing::TempDir dir;
    std::string path = dir.file("worker.db");

    void SetUp() override {
        idem::SqliteStore store(path);
        idem_test::sqlite_exec(store.db(), "CREATE TABLE captures(order_id TEXT NOT NULL);");
    }

    long long captures(idem::SqliteStore& store) {
        return idem_test::sqlite_count(store.db(), "SELECT count(*) FROM captures");
    }

    /// A worker process handles one delivery and is killed with SIGKILL at `window`:
    /// after_claim (claimed, effect running, nothing written yet), before_commit (claim and
    /// effect rows written, not committed), after_commit_before_ack (committed; killed before
    /// the consumer could ack).
    void run_worker_and_kill_it(Window window) {
        const auto crash = idem::testing::run_and_kill_at(window, [&] {
            idem::SqliteStore store(path);  // the worker's own connection
            auto handler = idem::make_handler(
                store, idem::Policy{"capture"}, [&](auto& tx, const std::string& order) {
                    idem::testing::crash_point(Window::after_claim);
                    tx.execute("INSERT INTO captures(order_id) VALUES (?)", order);
                    idem::testing::crash_point(Window::before_commit);
                });
            auto outcome = handler.handle(Delivery{"msg-1", 1u}, std::string("8814"));
            if (outcome.disposition == Disposition::processed) {
                idem::testing::crash_point(Window::after_commit_before_ack);
            }
        });
        ASSERT_TRUE(crash.killed_at_window) << crash.message;
    }
};

TEST_P(CrashWindow, KillNineChangesNothingAndTheRedeliveryWorksOnce) {
    const Window window = GetParam();
    run_worker_and_kill_it(window);

    idem::SqliteStore store(path);  // a restarted worker
    const bool committed = window == Window::after_commit_before_ack;
    EXPECT_EQ(store.find_claim("capture", "msg-1").has_value(), committed);
    EXPECT_EQ(captures(store), committed ? 1 : 0);

    int runs = 0;
    auto handler =
        idem::make_handler(store, idem::Policy{"capture"}, [&](auto& tx, const std::string& order) {
            ++runs;
            tx.execute("INSERT INTO captures(order_id) VALUES (?)", order);
        });
    // The broker redelivers the unacked message.
    auto outcome = handler.handle(Delivery{"msg-1", 2u}, std::string("8814"));
    EXPECT_EQ(outcome.disposition, committed ? Disposition::duplicate : Disposition::processed)
        << outcome.reason;
    EXPECT_TRUE(idem::should_ack(outcome));
    EXPECT_EQ(runs, committed ? 0 : 1);
    EXPECT_EQ(captures(store), 1);
    EXPECT_EQ(handler.handle(Delivery{"msg-1", 3u}, std::string("8814")).disposition,
              Disposition::duplicate);
    EXPECT_EQ(captures(store), 1);
}

INSTANTIATE_TEST_SUITE_P(Sqlite, CrashWindow,
                         ::testing::Values(Window::after_claim, Window::before_commit,
                                           Window::after_commit_before_ack),
                         [](const ::testing::TestParamInfo<Window>& info) {
                             return std::string(idem::testing::to_string(info.param));
                         });

}  // namespace
