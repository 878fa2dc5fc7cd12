#pragma once
// IDEM_REQUIRE_REDIS_CLUSTER(): first statement of a TEST body, SetUp() or SetUpTestSuite().
// Without redis-server and redis-cli it skips the test with the reason, except in CI (CI=true or
// CI=1), where a missing binary is a failure, never a skip.

#include "idem/testing/redis_cluster.hpp"
#include "require_server.hpp"

#define IDEM_REQUIRE_REDIS_CLUSTER() \
    IDEM_REQUIRE_SERVER(idem::testing::RedisCluster, "Redis Cluster (redis-server, redis-cli)")
