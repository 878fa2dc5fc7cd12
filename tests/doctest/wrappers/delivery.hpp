// Doc-test wrapper `delivery`: the block is the body of a function that has a delivery (its
// second one) of a message.
#include <idem/idem.hpp>

inline void doctest_run() {
    const idem::Delivery delivery{"m-1", 2u};
    // @block
}
