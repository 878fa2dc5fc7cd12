// Doc-test wrapper `conformance_env`: the block is an environment of the installed conformance
// suite and its instantiation, at namespace scope (compiled; GoogleTest runs it only in a test
// binary of its own: examples/journal_store/ and tests/stores/conformance_test.cpp do).
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

// @block
