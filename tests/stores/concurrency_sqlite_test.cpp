// 5. Concurrency: 8 threads, and separately 2 processes, deliver the same 1,000 ids at once on
// one SQLite file; exactly 1,000 effects. The effect table has no unique constraint, so a
// second run of any effect would show as an extra row.

#include <gtest/gtest.h>

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/temp_dir.hpp"
#include "support/store_envs.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;

constexpr int kIds = 1000;

idem::Policy patient_policy() {
    // Contention may time a delivery out (failed, redelivered): give the test room to retry
    // without reaching the poison limit.
    idem::PolicyOptions options;
    options.max_deliveries = 1000;
    return idem::Policy{"capture", options};
}

struct Tally {
    long processed = 0;
    long duplicates = 0;
    long failed_then_retried = 0;
};

/// Delivers every id once, in a shuffled order, redelivering (count + 1) until the outcome acks.
template <class Handler>
Tally deliver_all(Handler& handler, unsigned seed) {
    std::vector<int> order(kIds);
    for (int i = 0; i < kIds; ++i)
        order[i] = i;
    std::shuffle(order.begin(), order.end(), std::mt19937(seed));
    Tally tally;
    for (int i : order) {
        const std::string id = "msg-" + std::to_string(i);
        for (std::uint32_t count = 1;; ++count) {
            auto outcome = handler.handle(Delivery{id, count}, id);
            if (outcome.disposition == Disposition::processed) ++tally.processed;
            if (outcome.disposition == Disposition::duplicate) ++tally.duplicates;
            if (idem::should_ack(outcome)) break;
            ++tally.failed_then_retried;
        }
    }
    return tally;
}

auto effect() {
    return [](auto& tx, const std::string& id) {
        tx.execute("INSERT INTO effects(message_id) VALUES (?)", id);
    };
}

class SqliteConcurrency : public ::testing::Test {
  protected:
    idem::testing::TempDir dir;
    std::string path = dir.file("shared.db");

    void SetUp() override {
        idem::SqliteStore store(path);
        idem_test::sqlite_exec(store.db(), "CREATE TABLE effects(message_id TEXT NOT NULL);");
    }
    void expect_exactly_once() {
        idem::SqliteStore store(path);
        EXPECT_EQ(idem_test::sqlite_count(store.db(), "SELECT count(*) FROM effects"), kIds);
        EXPECT_EQ(
            idem_test::sqlite_count(store.db(), "SELECT count(DISTINCT message_id) FROM effects"),
            kIds);
        EXPECT_EQ(idem_test::sqlite_count(store.db(), "SELECT count(*) FROM idem_claims"), kIds);
    }
};

TEST_F(SqliteConcurrency, EightThreadsEachWithItsOwnConnection) {
    constexpr int kThreads = 8;
    std::vector<Tally> tallies(kThreads);
    std::mutex mutex;
    std::condition_variable start;
    bool go = false;
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            idem::SqliteStore store(path);
            auto handler = idem::make_handler(store, patient_policy(), effect());
            {
                std::unique_lock<std::mutex> lock(mutex);
                start.wait(lock, [&] { return go; });
            }
            tallies[t] = deliver_all(handler, static_cast<unsigned>(t));
        });
    }
    {
        std::lock_guard<std::mutex> lock(mutex);
        go = true;
    }
    start.notify_all();
    for (auto& thread : threads)
        thread.join();

    long processed = 0, duplicates = 0;
    for (const auto& t : tallies) {
        processed += t.processed;
        duplicates += t.duplicates;
    }
    EXPECT_EQ(processed, kIds);
    EXPECT_EQ(duplicates, kIds * (kThreads - 1));
    expect_exactly_once();
}

TEST_F(SqliteConcurrency, EightThreadsSharingOneStore) {
    idem::SqliteStore store(path);
    auto handler = idem::make_handler(store, patient_policy(), effect());
    constexpr int kThreads = 8;
    std::atomic<long> processed{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            processed += deliver_all(handler, static_cast<unsigned>(100 + t)).processed;
        });
    }
    for (auto& thread : threads)
        thread.join();
    EXPECT_EQ(processed.load(), kIds);
    EXPECT_EQ(handler.counters().processed, static_cast<std::uint64_t>(kIds));
    expect_exactly_once();
}

TEST_F(SqliteConcurrency, TwoProcessesOnOneFile) {
    int start_pipe[2];
    ASSERT_EQ(pipe(start_pipe), 0);
    std::vector<pid_t> workers;
    for (int w = 0; w < 2; ++w) {
        const pid_t pid = fork();
        ASSERT_GE(pid, 0);
        if (pid == 0) {
            close(start_pipe[1]);
            char byte = 0;
            if (read(start_pipe[0], &byte, 1) != 0) _exit(4);  // wait for the start (EOF)
            idem::SqliteStore store(path);
            auto handler = idem::make_handler(store, patient_policy(), effect());
            Tally tally = deliver_all(handler, static_cast<unsigned>(w));
            // The exit status reports how many effects this process applied (0..1000 → bytes).
            _exit(tally.processed == 0 ? 0 : (tally.processed == kIds ? 201 : 100));
        }
        workers.push_back(pid);
    }
    close(start_pipe[0]);
    close(start_pipe[1]);  // both workers start now
    for (pid_t pid : workers) {
        int status = 0;
        ASSERT_EQ(waitpid(pid, &status, 0), pid);
        ASSERT_TRUE(WIFEXITED(status)) << "worker crashed";
        EXPECT_NE(WEXITSTATUS(status), 4);
    }
    expect_exactly_once();
}

}  // namespace
