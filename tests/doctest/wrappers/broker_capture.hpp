// Doc-test wrapper `broker_capture`: the block is the body of a function that has a store
// (SQLite, in memory), the user's gateway and parse(), the user's reading of a message body into
// a CapturePayment. The block includes its broker's header. Compiled only: it needs a broker.
#include <idem/idem.hpp>
#include <idem/store/sqlite.hpp>

#include <string>

// @use capture_types

inline CapturePayment parse(const std::string& data) {
    if (data.empty()) throw idem::malformed_message("an empty body");
    return CapturePayment{data, "tok", 1250};
}

inline void doctest_run() {
    idem::SqliteStore store{":memory:"};
    Gateway gateway;
    // @block
}
