#pragma once
// Forwarder: PostgresServer (link idem::postgres) live in the installed test kit,
// include/idem/testing/postgres_server.hpp (namespace idem::testing); idem's own tests keep calling
// them idem_test::... through this header.

#include "idem/testing/postgres_server.hpp"

namespace idem_test {
using namespace ::idem::testing;
}  // namespace idem_test
