#pragma once
// IDEM_REQUIRE_REDIS(): first statement of a TEST body, SetUp() or SetUpTestSuite() (anything
// returning void). Without a redis-server binary it skips the test with the reason, except in CI
// (environment CI=true or CI=1), where a missing server is a failure, never a skip.

#include <gtest/gtest.h>

#include <string>

#include "process.hpp"  // running_in_ci()
#include "redis_server.hpp"

#define IDEM_REQUIRE_REDIS()                                                                      \
    do {                                                                                          \
        std::string idem_require_redis_why_;                                                      \
        if (!::idem_test::RedisServer::available(&idem_require_redis_why_)) {                     \
            if (::idem_test::running_in_ci()) {                                                   \
                GTEST_FAIL() << "Redis is required in CI (CI=true): " << idem_require_redis_why_; \
            }                                                                                     \
            GTEST_SKIP() << "Redis not available (set CI=true to make this a failure): "          \
                         << idem_require_redis_why_;                                              \
        }                                                                                         \
    } while (0)
