// Doc-test wrapper `function`: the block is the body of a function, with idem's core headers and
// nothing of the user's; its assert()s are its checks.
#include <idem/idem.hpp>

#include <cassert>
#include <string>

inline void doctest_run() {
    // @block
}
