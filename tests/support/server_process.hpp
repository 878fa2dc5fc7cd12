#pragma once
// Forwarder: ServerProcess, the base of the server fixtures live in the installed test kit,
// include/idem/testing/server_process.hpp (namespace idem::testing); idem's own tests keep calling
// them idem_test::... through this header.

#include "idem/testing/server_process.hpp"

namespace idem_test {
using namespace ::idem::testing;
}  // namespace idem_test
