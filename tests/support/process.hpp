#pragma once
// Forwarder: the process, port and temp-dir helpers live in the installed test kit,
// include/idem/testing/process.hpp (namespace idem::testing); idem's own tests keep calling them
// idem_test::... through this header.

#include "idem/testing/process.hpp"

namespace idem_test {
using namespace ::idem::testing;
}  // namespace idem_test
