#pragma once
// What the generated doc-test translation units (tests/doctest/doctest.py) share: the registry
// of their blocks, read by tests/doctest/main.cpp, and IDEM_DOCTEST_CHECK for the wrappers'
// checks of what a block shows.

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace idem_doctest {

/// One C++ block of a doc: compiled into the binary; run when `run` is set.
struct Block {
    int line;                     ///< the fence's line in the doc
    const char* wrapper;          ///< "" without one
    void (*run)();                ///< the wrapper's doctest_run(), for a block marked `run`
    const char* expected_output;  ///< what run() must print to std::cout (an `output` block)
    const char* vary;             ///< lines matching this regex: numbers may differ
};

struct Registered {
    const char* doc;
    std::vector<Block> blocks;
};

inline std::vector<Registered>& registry() {
    static std::vector<Registered> files;
    return files;
}

/// Each generated translation unit registers its doc's blocks at static initialisation.
struct File {
    File(const char* doc, std::vector<Block> blocks) {
        registry().push_back(Registered{doc, std::move(blocks)});
    }
};

inline int& failed_checks() {
    static int failed = 0;
    return failed;
}

inline void check(bool ok, const char* what, const char* file, int line) {
    if (ok) return;
    ++failed_checks();
    std::fprintf(stderr, "%s:%d: check failed: %s\n", file, line, what);
}

}  // namespace idem_doctest

/// A wrapper's check of what its block shows (a count, an outcome): reported with the
/// wrapper's file and line, and the block fails.
#define IDEM_DOCTEST_CHECK(...) \
    ::idem_doctest::check(static_cast<bool>(__VA_ARGS__), #__VA_ARGS__, __FILE__, __LINE__)
