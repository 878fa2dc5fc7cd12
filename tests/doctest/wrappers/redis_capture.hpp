// Doc-test wrapper `redis_capture`: the block is the body of a function that has the user's
// gateway and parse(); idem's Redis store, stream consumer and SQLite store headers are included.
// Compiled only: it needs a server.
#include <unistd.h>

#include <idem/broker/redis_streams.hpp>
#include <idem/idem.hpp>
#include <idem/store/redis.hpp>
#include <idem/store/sqlite.hpp>

// @use stream_parse

inline void doctest_run() {
    Gateway gateway;
    // @block
}
