// Doc-test wrapper `capture_body`: the block is the body of a function that has the user's
// gateway and a database password (`secret`); CapturePayment has its idem_payload. Every store
// header is included (the block names the store it shows). Compiled only: a server store
// connects when it is made.
#include <idem/idem.hpp>
#include <idem/store/mysql.hpp>
#include <idem/store/postgres.hpp>
#include <idem/store/redis.hpp>
#include <idem/store/sqlite.hpp>

#include <string>

// @use capture_types

inline std::string idem_payload(const CapturePayment& m) {
    return m.to_json();
}

inline void doctest_run() {
    Gateway gateway;
    const std::string secret = "not-a-password";
    // @block
}
