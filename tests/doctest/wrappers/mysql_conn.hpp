// Doc-test wrapper `mysql_conn`: the block is the body of a function that has the consumer's own
// MYSQL* (`conn`) and a password (`secret`). Compiled only: it needs a server.
#include <mysql.h>

#include <idem/store/mysql.hpp>

#include <string>

inline void doctest_run() {
    MYSQL* conn = nullptr;
    const std::string secret = "not-a-password";
    // @block
}
