#pragma once
// Shared by the sqlite_*_test files: SqliteStoreTest (a fresh temp dir per test, a clock the
// test moves), RawDb (the test's own connection to the file) and claim_and_commit().

#include "idem/store/sqlite.hpp"

#include <gtest/gtest.h>
#include <sqlite3.h>
#include <stdlib.h>  // mkdtemp

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace idem_test::sqlite_store {

using namespace std::chrono_literals;
using idem::ClaimStatus;
using idem::Disposition;
using idem::OutboxIntent;
using idem::OutboxRow;
using idem::SqliteOptions;
using idem::SqliteStore;
using time_point = std::chrono::system_clock::time_point;

static_assert(idem::is_store_v<SqliteStore>);
static_assert(!std::is_copy_constructible_v<SqliteStore::Transaction>);
static_assert(std::is_nothrow_move_constructible_v<SqliteStore::Transaction>);
#if IDEM_HAS_CONCEPTS
static_assert(idem::IdempotencyStore<SqliteStore>);
#endif

// A millisecond-aligned instant: the store keeps unix milliseconds.
inline const time_point t0 = time_point(std::chrono::milliseconds(1'700'000'000'123));

/// A plain connection of the test's own, for looking at the file behind the store's back.
class RawDb {
  public:
    explicit RawDb(const std::string& path) {
        if (sqlite3_open(path.c_str(), &db_) != SQLITE_OK) {
            ADD_FAILURE() << "cannot open " << path << ": " << sqlite3_errmsg(db_);
        }
    }
    RawDb(const RawDb&) = delete;
    RawDb& operator=(const RawDb&) = delete;
    ~RawDb() {
        if (db_ != nullptr) {
            EXPECT_EQ(sqlite3_close(db_), SQLITE_OK) << sqlite3_errmsg(db_);
        }
    }
    sqlite3* get() const { return db_; }
    void exec(const std::string& sql) {
        char* message = nullptr;
        const int rc = sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &message);
        EXPECT_EQ(rc, SQLITE_OK) << sql << ": " << (message ? message : "");
        sqlite3_free(message);
    }
    long long count(const std::string& sql) {
        sqlite3_stmt* stmt = nullptr;
        EXPECT_EQ(sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt, nullptr), SQLITE_OK)
            << sqlite3_errmsg(db_);
        long long value = -1;
        if (sqlite3_step(stmt) == SQLITE_ROW) value = sqlite3_column_int64(stmt, 0);
        sqlite3_finalize(stmt);
        return value;
    }

  private:
    sqlite3* db_ = nullptr;
};

class SqliteStoreTest : public ::testing::Test {
  protected:
    void SetUp() override {
        std::string pattern = "/tmp/idem-sqlite-XXXXXX";
        ASSERT_NE(mkdtemp(pattern.data()), nullptr);
        dir_ = pattern;
    }
    void TearDown() override {
        std::error_code ignored;
        std::filesystem::remove_all(dir_, ignored);
    }
    std::string file(const std::string& name = "idem.db") const { return dir_ + "/" + name; }

    /// Options whose clock the test moves by hand.
    SqliteOptions manual_clock() {
        SqliteOptions options;
        options.clock = [this] { return now_; };
        return options;
    }

    std::string dir_;
    time_point now_ = t0;
};

inline void claim_and_commit(SqliteStore& store, std::string_view scope, std::string_view id,
                             Disposition outcome = Disposition::processed,
                             std::string_view reason = {}) {
    auto tx = store.begin();
    ASSERT_EQ(tx.claim(scope, id).status, ClaimStatus::claimed);
    tx.record_outcome(scope, id, outcome, reason);
    tx.commit();
}

}  // namespace idem_test::sqlite_store
