// Doc-test wrapper `exposition`: the block is the body of a function with idem's core and the
// Prometheus observer; what it prints is compared with the doc's exposition.
#include <idem/idem.hpp>
#include <idem/observers/prometheus.hpp>
#include <idem/store/memory.hpp>

#include <iostream>
#include <string>

inline void doctest_run() {
    // @block
}
