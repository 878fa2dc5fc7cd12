// Doc-test wrapper `http_server`: the block is the body of a function that has the user's own
// cpp-httplib server and the PrometheusObserver. Compiled only.
#include <httplib.h>

#include <idem/observers/prometheus.hpp>

inline void doctest_run() {
    httplib::Server server;
    idem::PrometheusObserver metrics;
    // @block
}
