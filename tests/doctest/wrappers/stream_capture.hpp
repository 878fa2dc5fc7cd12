// Doc-test wrapper `stream_capture`: the block is the body of a function that has a store
// (SQLite, in memory), the gateway and parse(), the user's reading of a stream entry. The block
// includes idem/broker/redis_streams.hpp itself.
#include <idem/store/sqlite.hpp>

// @use stream_parse

inline void doctest_run() {
    idem::SqliteStore store{":memory:"};
    Gateway gateway;
    // @block
}
