// journal::JournalStore under idem's installed conformance suite (the tests every idem store
// passes), and what a file store owes beyond it: claims survive a reopen, a torn commit is cut
// off, two stores on one file (two processes' worth of open files) see each other's commits.
// Built by tests/consumer against an install prefix (ctest install.find_package_consumer) and,
// in idem's own tree, as the test example.journal_store.

#include "journal_store.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>

#include <idem/handler.hpp>
#include <idem/policy.hpp>
#include <idem/testing/conformance.hpp>
#include <idem/testing/temp_dir.hpp>

namespace {

using idem::testing::TempDir;

constexpr std::uintmax_t quota = 4u << 20;  // 4 MiB: the suite writes far less

struct JournalEnv {
    using Store = journal::JournalStore;
    static constexpr const char* name = "journal";

    TempDir dir;
    std::chrono::system_clock::time_point now = idem::testing::conformance_epoch();
    std::unique_ptr<Store> store;

    JournalEnv() { open(); }
    /// Closes the journal and opens it again (the durability suite): its state is replayed.
    void reopen() {
        store.reset();
        open();
    }
    void open() {
        journal::JournalOptions options;
        options.clock = [this] { return now; };
        options.max_bytes = quota;
        options.lock_wait = std::chrono::milliseconds(100);
        store = std::make_unique<Store>(dir.file("journal"), options);
    }
    JournalEnv(const JournalEnv&) = delete;
    JournalEnv& operator=(const JournalEnv&) = delete;
    ~JournalEnv() {
        if (locker_ >= 0) ::close(locker_);
    }

    template <class Tx>
    static void write_effect(Tx& tx, const std::string& key) {
        tx.put("effects", key, "applied");
    }
    /// A row larger than the journal may grow: the commit is refused by the store itself.
    template <class Tx>
    void make_commit_fail(Tx& tx) {
        tx.put("ballast", "quota", std::string(quota, 'x'));
    }
    std::size_t effect_rows() { return store->count("effects"); }
    bool has_effect(const std::string& key) { return store->get("effects", key).has_value(); }
    /// The probe test's outage: another process's worth of open file holds the journal's lock
    /// (a writer hung mid-transaction), so ping() times out; start_server() lets it go.
    void stop_server() {
        locker_ = ::open(dir.file("journal").c_str(), O_RDWR | O_CLOEXEC);
        if (locker_ < 0 || ::flock(locker_, LOCK_EX) != 0) {
            throw std::runtime_error("JournalEnv: cannot lock the journal");
        }
    }
    void start_server() {
        ::flock(locker_, LOCK_UN);
        ::close(locker_);
        locker_ = -1;
    }

  private:
    int locker_ = -1;
};

}  // namespace

INSTANTIATE_TYPED_TEST_SUITE_P(Journal, IdemStoreConformance, ::testing::Types<JournalEnv>,
                               idem::testing::ConformanceNames);
INSTANTIATE_TYPED_TEST_SUITE_P(Journal, IdemDurableStoreConformance, ::testing::Types<JournalEnv>,
                               idem::testing::ConformanceNames);

namespace {

auto writer(journal::JournalStore& store) {
    return idem::make_handler(
        store, idem::Policy{"capture"},
        [](auto& tx, const std::string& body) { tx.put("effects", body, "applied"); });
}

TEST(JournalStore, ClaimsDeadLettersAndRowsSurviveAReopen) {
    TempDir dir;
    {
        journal::JournalStore store(dir.file("journal"));
        auto handler = writer(store);
        ASSERT_EQ(handler.handle(idem::Delivery{"m-1", 1u}, std::string("row-1")).disposition,
                  idem::Disposition::processed);
        ASSERT_EQ(handler.handle(idem::Delivery{"m-2", 9u}, std::string("row-2")).disposition,
                  idem::Disposition::dead_lettered);
        ASSERT_TRUE(store.hold_lock("invoice-1", "batch", std::chrono::minutes(5)));
    }
    journal::JournalStore reopened(dir.file("journal"));
    auto handler = writer(reopened);
    EXPECT_EQ(handler.handle(idem::Delivery{"m-1", 2u}, std::string("row-1")).disposition,
              idem::Disposition::duplicate);
    EXPECT_EQ(handler.handle(idem::Delivery{"m-2", 10u}, std::string("row-2")).disposition,
              idem::Disposition::duplicate);
    EXPECT_EQ(reopened.count("effects"), 1u);
    ASSERT_EQ(reopened.dead_letters().size(), 1u);
    EXPECT_EQ(reopened.dead_letters()[0].payload, "row-2");
    EXPECT_FALSE(reopened.hold_lock("invoice-1", "other", std::chrono::minutes(5)));
}

TEST(JournalStore, ATornCommitIsCutOffAndTheEarlierOnesStay) {
    TempDir dir;
    const std::string path = dir.file("journal");
    {
        journal::JournalStore store(path);
        auto handler = writer(store);
        ASSERT_EQ(handler.handle(idem::Delivery{"m-1", 1u}, std::string("row-1")).disposition,
                  idem::Disposition::processed);
    }
    const auto whole = std::filesystem::file_size(path);
    {
        // A writer that died mid-commit: a header announcing more bytes than follow.
        std::ofstream out(path, std::ios::binary | std::ios::app);
        const char torn[] = {'\x40', 0, 0, 0, '\x11', '\x22', '\x33', '\x44', 'c', 'l'};
        out.write(torn, sizeof torn);
    }
    journal::JournalStore reopened(path);
    EXPECT_EQ(std::filesystem::file_size(path), whole);
    auto handler = writer(reopened);
    EXPECT_EQ(handler.handle(idem::Delivery{"m-1", 2u}, std::string("row-1")).disposition,
              idem::Disposition::duplicate);
    EXPECT_EQ(handler.handle(idem::Delivery{"m-3", 1u}, std::string("row-3")).disposition,
              idem::Disposition::processed);
    EXPECT_EQ(reopened.count("effects"), 2u);
}

TEST(JournalStore, TwoStoresOnOneFileSeeEachOthersCommits) {
    TempDir dir;
    journal::JournalStore a(dir.file("journal"));
    journal::JournalStore b(dir.file("journal"));  // its own open file, as another process's
    auto on_a = writer(a);
    auto on_b = writer(b);
    EXPECT_EQ(on_a.handle(idem::Delivery{"m-1", 1u}, std::string("row")).disposition,
              idem::Disposition::processed);
    EXPECT_EQ(on_b.handle(idem::Delivery{"m-1", 2u}, std::string("row")).disposition,
              idem::Disposition::duplicate);
    EXPECT_EQ(on_b.handle(idem::Delivery{"m-2", 1u}, std::string("row-2")).disposition,
              idem::Disposition::processed);
    EXPECT_TRUE(a.find_claim("capture", "m-2").has_value());
    EXPECT_EQ(a.count("effects"), 2u);
}

TEST(JournalStore, ACommitPastTheQuotaWritesNothing) {
    TempDir dir;
    journal::JournalOptions options;
    options.max_bytes = 1024;
    journal::JournalStore store(dir.file("journal"), options);
    const auto before = std::filesystem::file_size(dir.file("journal"));
    {
        auto tx = store.begin();
        ASSERT_EQ(tx.claim("s", "m-1").status, idem::ClaimStatus::claimed);
        tx.put("effects", "k", std::string(2048, 'x'));
        EXPECT_THROW(tx.commit(), idem::commit_failed);
    }  // rolled back
    EXPECT_EQ(std::filesystem::file_size(dir.file("journal")), before);
    EXPECT_FALSE(store.find_claim("s", "m-1").has_value());
}

}  // namespace
