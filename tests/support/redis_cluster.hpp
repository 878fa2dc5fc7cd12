#pragma once
// Forwarder: RedisCluster (link idem::redis) lives in the installed test kit,
// include/idem/testing/redis_cluster.hpp (namespace idem::testing); idem's own tests call it
// idem_test::... through this header.

#include "idem/testing/redis_cluster.hpp"

namespace idem_test {
using namespace ::idem::testing;
}  // namespace idem_test
