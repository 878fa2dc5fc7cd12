#pragma once
// Shared by the postgres_*_test files: PostgresStoreTest, a fresh database per test on the
// process's shared PostgreSQL server (idem/testing/postgres_server.hpp), the store on a clock the
// test moves, and an effects table written through the claim's transaction.

#include <gtest/gtest.h>
#include <libpq-fe.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/store/postgres.hpp"
#include "idem/testing/postgres_server.hpp"
#include "require_postgres.hpp"

namespace idem_test::postgres_store {

using idem::ClaimStatus;
using idem::Delivery;
using idem::Disposition;
using idem::PostgresStore;
using idem::testing::PgConnection;
using namespace std::chrono_literals;

using time_point = std::chrono::system_clock::time_point;

class PostgresStoreTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_POSTGRES();
        server_ = &idem::testing::shared_postgres();
        database_ = server_->fresh_database();
        exec(
            "CREATE TABLE effects(message_id BYTEA NOT NULL);"
            "CREATE TABLE parents(id INTEGER PRIMARY KEY);"
            "CREATE TABLE children(parent_id INTEGER REFERENCES parents(id) "
            "  DEFERRABLE INITIALLY DEFERRED);");
    }
    void TearDown() override {
        if (server_ == nullptr) return;
        try {
            server_->exec("DROP DATABASE IF EXISTS " + database_ + " WITH (FORCE)", "postgres");
        } catch (...) {
        }
    }

    [[nodiscard]] std::string conninfo() const { return server_->conninfo(database_); }
    void exec(const std::string& sql) const { server_->exec(sql, database_); }
    [[nodiscard]] long long count(const std::string& sql) const {
        return std::stoll(server_->query_value(sql, database_).value_or("-1"));
    }
    [[nodiscard]] PGconn* connect() const { return server_->connect(database_); }
    /// After @p threads stores raced over @p ids ids: each processed once, by exactly one.
    void expect_each_effect_once(long long ids, long threads, const std::atomic<long>& processed,
                                 const std::atomic<long>& duplicates,
                                 const std::atomic<long>& retried, const char* run) const {
        EXPECT_EQ(processed.load(), ids);
        EXPECT_EQ(duplicates.load(), ids * (threads - 1));
        EXPECT_EQ(count("SELECT count(*) FROM effects"), ids);
        EXPECT_EQ(count("SELECT count(DISTINCT message_id) FROM effects"), ids);
        EXPECT_EQ(count("SELECT count(*) FROM idem_claims WHERE outcome = 'processed'"), ids);
        std::printf("%s: %ld processed, %ld duplicates, %ld retried\n", run, processed.load(),
                    duplicates.load(), retried.load());
    }

    /// Options on the test's clock.
    idem::PostgresOptions clocked() {
        idem::PostgresOptions options;
        options.clock = [this] { return time_point(std::chrono::milliseconds(now_ms_.load())); };
        return options;
    }
    std::unique_ptr<PostgresStore> store(idem::PostgresOptions options = {}) {
        return std::make_unique<PostgresStore>(conninfo(), std::move(options));
    }
    void advance(std::chrono::milliseconds by) { now_ms_ += by.count(); }
    [[nodiscard]] time_point now() const {
        return time_point(std::chrono::milliseconds(now_ms_.load()));
    }

    /// Ends @p pid's session from another connection and waits until it is gone.
    void terminate(int pid) const {
        exec("SELECT pg_terminate_backend(" + std::to_string(pid) + ", 10000)");
    }

    idem::testing::PostgresServer* server_ = nullptr;
    std::string database_;
    std::atomic<long long> now_ms_{1'700'000'000'000LL};
};

inline auto writer() {
    return [](auto& tx, const std::string& body) {
        tx.execute("INSERT INTO effects(message_id) VALUES ($1)", idem::Blob{body});
    };
}

}  // namespace idem_test::postgres_store
