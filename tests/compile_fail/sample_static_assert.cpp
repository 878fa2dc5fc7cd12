// expect: idem-sample: this must fail
// Proves the compile-fail harness: this file compiles as is, and fails with the message above when
// IDEM_COMPILE_FAIL is defined. Real compile-fail tests include idem headers and misuse them.
#include <type_traits>

template <typename T>
struct always_false : std::false_type {};

#ifdef IDEM_COMPILE_FAIL
static_assert(always_false<int>::value, "idem-sample: this must fail");
#endif

int main() {}
