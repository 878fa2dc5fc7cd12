// Doc-test wrapper `sqlite_db`: the block is the body of a function that has the consumer's own
// sqlite3* (`db`). Compiled only: the block opens a file.
#include <sqlite3.h>

#include <idem/store/sqlite.hpp>

inline void doctest_run() {
    sqlite3* db = nullptr;
    // @block
}
