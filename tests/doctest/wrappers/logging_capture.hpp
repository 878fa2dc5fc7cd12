// Doc-test wrapper `logging_capture`: the block is the body of a function that has an SQLite
// store (in memory, with the captures table) and the user's gateway; CapturePayment has its
// idem_payload. What the block prints to std::cout is compared with the doc's output block.
#include <idem/idem.hpp>
#include <idem/observers/logging.hpp>
#include <idem/store/sqlite.hpp>

#include <iostream>
#include <string>

// @use capture_types

inline std::string idem_payload(const CapturePayment& m) {
    return m.to_json();
}

inline void doctest_run() {
    idem::SqliteStore store{":memory:"};
    store.execute("CREATE TABLE captures(order_id TEXT, reference TEXT)");
    Gateway gateway;
    // @block
}
