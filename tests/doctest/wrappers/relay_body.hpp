// Doc-test wrapper `relay_body`: the block is the body of a function that has a store (SQLite,
// in memory) and the user's payment rail. Compiled only: Relay::run() runs until stopped.
#include <idem/idem.hpp>
#include <idem/outbox.hpp>
#include <idem/store/sqlite.hpp>

#include <atomic>
#include <chrono>
#include <string>

struct Rail {
    void send_wire(const std::string& /*payload*/, const std::string& /*idempotency_key*/) {}
};

inline void doctest_run() {
    idem::SqliteStore store{":memory:"};
    Rail rail;
    // @block
}
