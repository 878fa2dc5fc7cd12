// The public crash-window kit (idem/testing/crash.hpp): run_and_kill_at() reports a child killed
// at its window, one that never got there, the nth pass, a timeout, an exception, another signal;
// crash_point() is a no-op unless armed. Then the intended use, end to end: a handler over a
// SqliteStore whose effect calls a gateway outside the worker (its own SQLite file, honouring
// idempotency keys), killed at each of the four windows and redelivered in the parent — one
// capture row and one charge every time; and the negative control (a key per attempt) that the
// kit must catch charging twice.

#include <gtest/gtest.h>

#include <signal.h>
#include <sqlite3.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>

#include "idem/idem.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/crash.hpp"
#include "idem/testing/process.hpp"
#include "idem/testing/temp_dir.hpp"

namespace {

namespace kit = idem::testing;
using kit::Window;

std::string read_file(const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void append_file(const std::string& path, const std::string& text) {
    std::ofstream(path, std::ios::app) << text;
}

// ---------------------------------------------------------------------------------------------
// The kit itself

TEST(CrashKit, WindowNames) {
    std::set<std::string_view> names;
    for (Window window : kit::all_windows)
        names.insert(kit::to_string(window));
    EXPECT_EQ(names.size(), 4u);
    EXPECT_EQ(kit::to_string(Window::after_claim), "after_claim");
    EXPECT_EQ(kit::to_string(Window::after_external_call), "after_external_call");
    EXPECT_EQ(kit::to_string(Window::before_commit), "before_commit");
    EXPECT_EQ(kit::to_string(Window::after_commit_before_ack), "after_commit_before_ack");
    static_assert(kit::to_string(Window::after_claim) == "after_claim");
}

TEST(CrashKit, UnarmedCrashPointIsANoOp) {
    for (int i = 0; i < 1000; ++i) {
        kit::crash_point("after_claim");
        kit::crash_point(Window::before_commit);
        kit::crash_point("a window of my own");
    }
    SUCCEED();  // still alive
}

TEST(CrashKit, ReachedWindowKillsTheChildThere) {
    idem::testing::TempDir dir;
    const std::string before = dir.file("before");
    const std::string after = dir.file("after");
    const auto result = kit::run_and_kill_at("my_window", [&] {
        append_file(before, "x");
        kit::crash_point("another_window");  // not armed for this one
        kit::crash_point("my_window");
        append_file(after, "x");  // never runs
    });
    EXPECT_TRUE(result.killed_at_window) << result.message;
    EXPECT_TRUE(static_cast<bool>(result));
    EXPECT_TRUE(result.reached);
    EXPECT_EQ(result.hits, 1u);
    EXPECT_EQ(result.signal, SIGKILL);
    EXPECT_FALSE(result.exit_code.has_value());
    EXPECT_FALSE(result.timed_out);
    EXPECT_FALSE(result.exception.has_value());
    EXPECT_EQ(result.message, "killed by SIGKILL at window 'my_window' (pass 1)");
    EXPECT_EQ(read_file(before), "x");
    EXPECT_FALSE(std::filesystem::exists(after));
}

TEST(CrashKit, NamedWindowAndItsStringAreTheSamePoint) {
    auto by_enum =
        kit::run_and_kill_at(Window::before_commit, [] { kit::crash_point("before_commit"); });
    EXPECT_TRUE(by_enum.killed_at_window) << by_enum.message;
    auto by_name = kit::run_and_kill_at("after_external_call",
                                        [] { kit::crash_point(Window::after_external_call); });
    EXPECT_TRUE(by_name.killed_at_window) << by_name.message;
}

TEST(CrashKit, WindowNotReachedReportsTheExitStatus) {
    const auto result = kit::run_and_kill_at(Window::after_claim, [] {
        kit::crash_point(Window::before_commit);  // another window: does nothing
    });
    EXPECT_FALSE(result.killed_at_window);
    EXPECT_FALSE(static_cast<bool>(result));
    EXPECT_FALSE(result.reached);
    EXPECT_EQ(result.hits, 0u);
    EXPECT_EQ(result.exit_code, 0);
    EXPECT_FALSE(result.signal.has_value());
    EXPECT_FALSE(result.timed_out);
    EXPECT_EQ(result.message,
              "the child exited with status 0 without reaching window 'after_claim' (passed 0 "
              "time(s), armed for pass 1)");
}

TEST(CrashKit, TheChildNeverReturnsIntoTheTest) {
    const pid_t parent = ::getpid();
    const auto result = kit::run_and_kill_at("never", [] {});
    // Were run_and_kill_at() to return in the child, the child would get here and say so.
    if (::getpid() != parent) ::_exit(42);
    EXPECT_EQ(result.exit_code, 0) << result.message;
}

TEST(CrashKit, NthHit) {
    idem::testing::TempDir dir;
    const std::string progress = dir.file("progress");
    auto loop = [&] {
        for (int i = 1; i <= 5; ++i) {
            append_file(progress, std::to_string(i));
            kit::crash_point("in_the_loop");
        }
    };
    kit::CrashOptions third;
    third.hit = 3;
    const auto killed = kit::run_and_kill_at("in_the_loop", loop, third);
    EXPECT_TRUE(killed.killed_at_window) << killed.message;
    EXPECT_EQ(killed.hits, 3u);
    EXPECT_EQ(read_file(progress), "123");
    EXPECT_EQ(killed.message, "killed by SIGKILL at window 'in_the_loop' (pass 3)");

    std::filesystem::remove(progress);
    kit::CrashOptions sixth;
    sixth.hit = 6;
    const auto passed = kit::run_and_kill_at("in_the_loop", loop, sixth);
    EXPECT_FALSE(passed.reached);
    EXPECT_EQ(passed.exit_code, 0);
    EXPECT_EQ(passed.hits, 5u);
    EXPECT_EQ(read_file(progress), "12345");
    EXPECT_NE(passed.message.find("passed 5 time(s), armed for pass 6"), std::string::npos)
        << passed.message;
}

TEST(CrashKit, TimeoutKillsAStuckChild) {
    kit::CrashOptions options;
    options.timeout = std::chrono::milliseconds(200);
    const auto start = std::chrono::steady_clock::now();
    const auto result = kit::run_and_kill_at(
        Window::after_claim, [] { std::this_thread::sleep_for(std::chrono::seconds(60)); },
        options);
    const auto waited = std::chrono::steady_clock::now() - start;
    EXPECT_TRUE(result.timed_out);
    EXPECT_FALSE(result.killed_at_window);
    EXPECT_FALSE(result.reached);
    EXPECT_EQ(result.signal, SIGKILL);
    EXPECT_GE(waited, std::chrono::milliseconds(200));
    EXPECT_LT(waited, std::chrono::seconds(20));
    EXPECT_NE(result.message.find("timed out after 200 ms without reaching window 'after_claim'"),
              std::string::npos)
        << result.message;
}

TEST(CrashKit, ZeroTimeoutWaitsWithoutALimit) {
    kit::CrashOptions unlimited;
    unlimited.timeout = std::chrono::milliseconds::zero();
    const auto result = kit::run_and_kill_at(
        "w", [] { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }, unlimited);
    EXPECT_FALSE(result.timed_out);
    EXPECT_EQ(result.exit_code, 0) << result.message;

    unlimited.timeout = std::chrono::milliseconds::max();  // no overflow of the deadline
    const auto killed = kit::run_and_kill_at(
        "w", [] { kit::crash_point("w"); }, unlimited);
    EXPECT_TRUE(killed.killed_at_window) << killed.message;
}

TEST(CrashKit, ThreadsStartedInTheChildCanHitTheWindow) {
    // The fork rule is about threads of the parent; the body may start its own.
    const auto result = kit::run_and_kill_at(Window::after_external_call, [] {
        std::thread worker([] { kit::crash_point(Window::after_external_call); });
        worker.join();
    });
    EXPECT_TRUE(result.killed_at_window) << result.message;
}

TEST(CrashKit, BodyThatThrowsIsReportedWithItsMessage) {
    const auto result = kit::run_and_kill_at(
        Window::after_claim, [] { throw std::runtime_error("no such table: captures"); });
    EXPECT_FALSE(result.killed_at_window);
    EXPECT_FALSE(result.reached);
    EXPECT_EQ(result.exit_code, 1);
    EXPECT_EQ(result.exception, "no such table: captures");
    EXPECT_NE(result.message.find("the body threw before reaching window 'after_claim'"),
              std::string::npos)
        << result.message;
    EXPECT_NE(result.message.find("no such table: captures"), std::string::npos);
}

TEST(CrashKit, AnotherSignalIsNotTheWindow) {
    const auto terminated = kit::run_and_kill_at("w", [] { ::raise(SIGTERM); });
    EXPECT_FALSE(terminated.killed_at_window);
    EXPECT_EQ(terminated.signal, SIGTERM);
    EXPECT_NE(terminated.message.find("killed by SIGTERM before reaching window 'w'"),
              std::string::npos)
        << terminated.message;

    // A SIGKILL from elsewhere (the OOM killer, the body itself) is not a kill at the window.
    const auto killed = kit::run_and_kill_at("w", [] { ::raise(SIGKILL); });
    EXPECT_FALSE(killed.killed_at_window);
    EXPECT_FALSE(killed.reached);
    EXPECT_EQ(killed.signal, SIGKILL);
}

TEST(CrashKit, TheParentsMemoryIsNotTheChilds) {
    // Why a MemoryStore (or any in-memory fake) cannot observe the child: it changes its copy.
    int calls = 0;
    const auto result = kit::run_and_kill_at("w", [&] {
        ++calls;
        kit::crash_point("w");
    });
    EXPECT_TRUE(result.killed_at_window) << result.message;
    EXPECT_EQ(calls, 0);
}

TEST(CrashKit, Misuse) {
    EXPECT_THROW(kit::run_and_kill_at("", [] {}), idem::usage_error);
    kit::CrashOptions zero;
    zero.hit = 0;
    EXPECT_THROW(kit::run_and_kill_at(
                     "w", [] {}, zero),
                 idem::usage_error);
    EXPECT_THROW(kit::run_and_kill_at("w", std::function<void()>()), idem::usage_error);
}

// ---------------------------------------------------------------------------------------------
// End to end: the intended use

/// A payment gateway outside the worker: its own SQLite file (autocommit), so what a killed
/// worker sent it survives the worker, and none of it is in the handler's transaction. It
/// honours idempotency keys: a new key makes one charge; the same key returns that charge's
/// reference. It counts every request.
class FileGateway {
  public:
    explicit FileGateway(const std::string& path) {
        if (sqlite3_open(path.c_str(), &db_) != SQLITE_OK) fail("open");
        sqlite3_busy_timeout(db_, 5000);
        if (sqlite3_exec(db_,
                         "CREATE TABLE IF NOT EXISTS requests(key TEXT NOT NULL);"
                         "CREATE TABLE IF NOT EXISTS charges(key TEXT PRIMARY KEY, "
                         "  reference TEXT NOT NULL, amount INTEGER NOT NULL);",
                         nullptr, nullptr, nullptr) != SQLITE_OK) {
            fail("create");
        }
    }
    FileGateway(const FileGateway&) = delete;
    FileGateway& operator=(const FileGateway&) = delete;
    ~FileGateway() { sqlite3_close(db_); }

    /// Captures @p amount under @p key; returns the charge's reference.
    std::string capture(const std::string& key, long amount) {
        run("INSERT INTO requests(key) VALUES (?1)", key);
        run("INSERT OR IGNORE INTO charges(key, reference, amount) "
            "VALUES (?1, 'ch_' || (SELECT count(*) + 1 FROM charges), ?2)",
            key, amount);
        return text("SELECT reference FROM charges WHERE key = ?1", key);
    }
    long long requests() { return std::stoll(text("SELECT count(*) FROM requests")); }
    long long charges() { return std::stoll(text("SELECT count(*) FROM charges")); }
    std::string reference_of(const std::string& key) {
        return text("SELECT reference FROM charges WHERE key = ?1", key);
    }

  private:
    [[noreturn]] void fail(const char* what) {
        throw std::runtime_error(std::string("gateway ") + what + ": " + sqlite3_errmsg(db_));
    }
    sqlite3_stmt* prepare(const char* sql, const std::string& key = {}, long amount = 0) {
        sqlite3_stmt* stmt = nullptr;
        if (sqlite3_prepare_v2(db_, sql, -1, &stmt, nullptr) != SQLITE_OK) fail("prepare");
        if (sqlite3_bind_parameter_count(stmt) >= 1) {
            sqlite3_bind_text(stmt, 1, key.c_str(), -1, SQLITE_TRANSIENT);
        }
        if (sqlite3_bind_parameter_count(stmt) >= 2) sqlite3_bind_int64(stmt, 2, amount);
        return stmt;
    }
    void run(const char* sql, const std::string& key, long amount = 0) {
        sqlite3_stmt* stmt = prepare(sql, key, amount);
        const int rc = sqlite3_step(stmt);
        sqlite3_finalize(stmt);
        if (rc != SQLITE_DONE) fail("step");
    }
    std::string text(const char* sql, const std::string& key = {}) {
        sqlite3_stmt* stmt = prepare(sql, key);
        std::string value;
        if (sqlite3_step(stmt) == SQLITE_ROW) {
            const unsigned char* data = sqlite3_column_text(stmt, 0);
            if (data != nullptr) value = reinterpret_cast<const char*>(data);
        }
        sqlite3_finalize(stmt);
        return value;
    }

    sqlite3* db_ = nullptr;
};

struct CapturePayment {
    std::string order_id;
    long amount = 0;
};
// What a dead letter keeps of a capture (found by ADL).
std::string idem_payload(const CapturePayment& m) {
    return m.order_id + ":" + std::to_string(m.amount);
}

enum class Keys { per_order, per_attempt };

/// The code under test, as a user has it: one step of the worker's consumer loop (handle, then
/// ack), with crash_point() at the four windows; outside a run_and_kill_at() child they do
/// nothing. It opens its own connections, so it runs the same in the child and in the parent.
/// Returns whether it acked.
bool consume_one(const std::string& store_path, const std::string& gateway_path,
                 const idem::Delivery& delivery, const CapturePayment& message,
                 Keys keys = Keys::per_order) {
    idem::SqliteStore store(store_path);
    FileGateway gateway(gateway_path);
    auto handler = idem::make_handler(
        store, idem::Policy{"capture-payment"}, [&](auto& tx, const CapturePayment& m) {
            kit::crash_point(Window::after_claim);
            const std::string key = keys == Keys::per_order ? idem::key("capture", m.order_id)
                                                            : idem::new_attempt_key();
            const std::string reference = gateway.capture(key, m.amount);
            kit::crash_point(Window::after_external_call);
            tx.execute("INSERT INTO captures(order_id, reference) VALUES (?, ?)", m.order_id,
                       reference);
            kit::crash_point(Window::before_commit);
        });
    const idem::Outcome outcome = handler.handle(delivery, message);
    if (!idem::should_ack(outcome)) return false;
    kit::crash_point(Window::after_commit_before_ack);
    return true;  // broker.ack(delivery) in the real loop
}

class EveryWindow : public ::testing::TestWithParam<Window> {
  protected:
    idem::testing::TempDir dir;
    const std::string store_path = dir.file("worker.db");
    const std::string gateway_path = dir.file("gateway.db");
    const CapturePayment message{"8814", 1250};

    void SetUp() override {
        idem::SqliteStore store(store_path);  // closed again before any fork
        store.execute("CREATE TABLE captures(order_id TEXT NOT NULL, reference TEXT NOT NULL)");
    }

    long long captures() {
        idem::SqliteStore store(store_path);
        return store.query_int("SELECT count(*) FROM captures").value_or(-1);
    }
    std::string captured_reference() {
        idem::SqliteStore store(store_path);
        return store.query_text("SELECT reference FROM captures").value_or("");
    }
};

TEST_P(EveryWindow, KilledThereThenRedeliveredCapturesAndChargesOnce) {
    const Window window = GetParam();

    // A worker takes delivery 1 and is killed at the window: no ack, so the broker redelivers.
    const auto crash = kit::run_and_kill_at(window, [&] {
        consume_one(store_path, gateway_path, idem::Delivery{"msg-1", 1u}, message);
    });
    ASSERT_TRUE(crash.killed_at_window) << crash.message;

    // The restarted worker (this process, fresh connections) gets delivery 2.
    EXPECT_TRUE(consume_one(store_path, gateway_path, idem::Delivery{"msg-1", 2u}, message));
    EXPECT_EQ(captures(), 1);
    FileGateway gateway(gateway_path);
    EXPECT_EQ(gateway.charges(), 1);
    EXPECT_EQ(captured_reference(), gateway.reference_of(idem::key("capture", "8814")));
    // The gateway was asked again only when the first request may have been sent and nothing
    // committed; the key made that second request return the first charge.
    const bool asked_twice =
        window == Window::after_external_call || window == Window::before_commit;
    EXPECT_EQ(gateway.requests(), asked_twice ? 2 : 1);

    // Any further redelivery is a duplicate: nothing new anywhere.
    EXPECT_TRUE(consume_one(store_path, gateway_path, idem::Delivery{"msg-1", 3u}, message));
    EXPECT_EQ(captures(), 1);
    EXPECT_EQ(gateway.charges(), 1);
    EXPECT_EQ(gateway.requests(), asked_twice ? 2 : 1);
}

INSTANTIATE_TEST_SUITE_P(Sqlite, EveryWindow, ::testing::ValuesIn(kit::all_windows),
                         [](const ::testing::TestParamInfo<Window>& info) {
                             return std::string(kit::to_string(info.param));
                         });

// The negative control: the same run with a new gateway key per attempt charges twice, and the
// kit shows it. A test that cannot fail proves nothing.
TEST(CrashKitNegativeControl, KeyPerAttemptChargesTwiceAfterAKillAfterTheCall) {
    idem::testing::TempDir dir;
    const std::string store_path = dir.file("worker.db");
    const std::string gateway_path = dir.file("gateway.db");
    {
        idem::SqliteStore store(store_path);
        store.execute("CREATE TABLE captures(order_id TEXT NOT NULL, reference TEXT NOT NULL)");
    }
    const CapturePayment message{"8814", 1250};
    const auto crash = kit::run_and_kill_at(Window::after_external_call, [&] {
        consume_one(store_path, gateway_path, idem::Delivery{"msg-1", 1u}, message,
                    Keys::per_attempt);
    });
    ASSERT_TRUE(crash.killed_at_window) << crash.message;
    EXPECT_TRUE(consume_one(store_path, gateway_path, idem::Delivery{"msg-1", 2u}, message,
                            Keys::per_attempt));

    idem::SqliteStore store(store_path);
    EXPECT_EQ(store.query_int("SELECT count(*) FROM captures").value_or(-1), 1);  // idem's part
    EXPECT_EQ(FileGateway(gateway_path).charges(), 2);  // the customer is charged twice
}

}  // namespace

// A signal sent to a child right after spawn() (a harness stopping a worker it has just
// restarted) must reach it. Before signals were blocked across the fork, the child still ran the
// parent's handler until it reset its own: the signal was consumed there, the child exec'd and
// never saw it (every one of 300 in a row, here).
namespace {
volatile sig_atomic_t parent_handler_ran = 0;
extern "C" void note_sigterm(int) {
    parent_handler_ran = 1;
}
}  // namespace

TEST(Spawn, ASignalSentRightAfterSpawnReachesTheChild) {
    struct sigaction handler {};
    handler.sa_handler = note_sigterm;
    sigemptyset(&handler.sa_mask);
    struct sigaction previous {};
    ASSERT_EQ(::sigaction(SIGTERM, &handler, &previous), 0);
    for (int i = 0; i < 20; ++i) {
        idem::testing::Spawn s;
        s.argv = {"/bin/sleep", "30"};
        const pid_t pid = idem::testing::spawn(s);
        ASSERT_EQ(::kill(pid, SIGTERM), 0);
        const auto status = idem::testing::wait_for(pid, std::chrono::seconds(10));
        if (!status) {
            ::kill(pid, SIGKILL);
            idem::testing::wait_for(pid, std::chrono::seconds(5));
            FAIL() << "spawn " << i << ": the child did not get the SIGTERM";
        }
        EXPECT_TRUE(WIFSIGNALED(*status) && WTERMSIG(*status) == SIGTERM) << *status;
    }
    EXPECT_EQ(parent_handler_ran, 0);  // the signals were the children's, none came here
    ::sigaction(SIGTERM, &previous, nullptr);
}
