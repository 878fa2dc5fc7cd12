#pragma once
// Shared by the redis_store_*_test files: RedisStoreTest, a RedisEnv (support/redis_env.hpp)
// per test on the process's shared redis-server, and a second worker on the same clock.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/store/redis.hpp"
#include "idem/testing/redis_server.hpp"
#include "redis_env.hpp"
#include "refusing_proxy.hpp"
#include "require_redis.hpp"

namespace idem_test::redis_store {

using idem::ClaimStatus;
using idem::Delivery;
using idem::Disposition;
using namespace std::chrono_literals;

class RedisStoreTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_REDIS();
        env_ = std::make_unique<idem_test::RedisEnv>();
    }
    idem::RedisStore& store() { return *env_->store; }
    idem::testing::RedisClient& client() { return *env_->client; }
    idem_test::time_point& now() { return env_->now; }
    /// A second store on the same server and clock: another worker process.
    std::unique_ptr<idem::RedisStore> other_worker() {
        idem::RedisOptions options;
        options.clock = [this] { return env_->now; };
        return std::make_unique<idem::RedisStore>(store().endpoint(), options);
    }

    std::unique_ptr<idem_test::RedisEnv> env_;
};

}  // namespace idem_test::redis_store
