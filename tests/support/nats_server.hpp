#pragma once
// Forwarder: NatsServer lives in the installed test kit, include/idem/testing/nats_server.hpp
// (namespace idem::testing); idem's own tests keep calling it idem_test::... through this header.

#include "idem/testing/nats_server.hpp"

namespace idem_test {
using namespace ::idem::testing;
}  // namespace idem_test
