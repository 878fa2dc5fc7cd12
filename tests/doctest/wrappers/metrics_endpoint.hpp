// Doc-test wrapper `metrics_endpoint`: the block is the body of a function, with idem's metrics
// headers. Compiled only: it binds a fixed port.
#include <idem/observers/http.hpp>
#include <idem/observers/prometheus.hpp>

inline void doctest_run() {
    // @block
}
