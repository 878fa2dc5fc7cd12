#pragma once
// IDEM_FUZZ_CHECK(condition, what): a broken contract in a fuzz target. Prints what broke and
// aborts, so libFuzzer keeps the input as a crash (and the fuzz.* test fails).

#include <cstdio>
#include <cstdlib>

#define IDEM_FUZZ_CHECK(condition, what)                                                         \
    do {                                                                                         \
        if (!(condition)) {                                                                      \
            std::fprintf(stderr, "fuzz contract broken at %s:%d: %s (%s)\n", __FILE__, __LINE__, \
                         what, #condition);                                                      \
            std::abort();                                                                        \
        }                                                                                        \
    } while (false)
