#pragma once
// Forwarder: RedisServer and RedisClient (link idem::redis) live in the installed test kit,
// include/idem/testing/redis_server.hpp (namespace idem::testing); idem's own tests keep calling
// them idem_test::... through this header.

#include "idem/testing/redis_server.hpp"

namespace idem_test {
using namespace ::idem::testing;
}  // namespace idem_test
