#pragma once
// IDEM_REQUIRE_REDIS(): first statement of a TEST body, SetUp() or SetUpTestSuite() (anything
// returning void). Without a redis-server binary it skips the test with the reason, except in CI
// (environment CI=true or CI=1), where a missing server is a failure, never a skip.

#include "idem/testing/redis_server.hpp"
#include "require_server.hpp"

#define IDEM_REQUIRE_REDIS() IDEM_REQUIRE_SERVER(idem::testing::RedisServer, "Redis")
