#pragma once
// Forwarder: RabbitmqServer (link idem::rabbitmq) lives in the installed test kit,
// include/idem/testing/rabbitmq_server.hpp (namespace idem::testing); idem's own tests keep
// calling it idem_test::... through this header.

#include "idem/testing/rabbitmq_server.hpp"

namespace idem_test {
using namespace ::idem::testing;
}  // namespace idem_test
