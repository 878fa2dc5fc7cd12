#pragma once
// Forwarder: RedisSentinelGroup (link idem::redis) lives in the installed test kit,
// include/idem/testing/redis_sentinel.hpp (namespace idem::testing); idem's own tests call it
// idem_test::RedisSentinelGroup through this header.

#include "idem/testing/redis_sentinel.hpp"

namespace idem_test {
using namespace ::idem::testing;
}  // namespace idem_test
