// Doc-test wrapper `redis_test`: the block is a GoogleTest test at namespace scope, after the
// user's own handler factory and message it names. Compiled only: registered, not run.
#include <idem/idem.hpp>
#include <idem/store/redis.hpp>

#include <string>

template <class Store>
auto make_capture_handler(Store& store) {
    return idem::make_handler(store, idem::Policy{"capture"},
                              [](auto& tx, const std::string&) { tx.write("INCR", "captures"); });
}
const std::string order = "order 42";

// @block
