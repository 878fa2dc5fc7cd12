// Doc-test wrapper `logging_handler`: the block is the body of a function that has a store, a
// policy and an effect (`capture_effect`), and the logging observer's header.
#include <idem/idem.hpp>
#include <idem/observers/logging.hpp>
#include <idem/store/memory.hpp>

#include <string>

inline void doctest_run() {
    idem::MemoryStore store;
    const idem::Policy policy{"capture"};
    auto capture_effect = [](auto& tx, const std::string& order) {
        tx.put("captures", order, "1");
    };
    // @block
}
