// expect: never derive a key from the delivery count
// A key built from the retry counter changes on every redelivery, so the gateway sees a new
// request each time: idem::key() refuses idem::DeliveryCount at compile time.
#include <string>

#include "idem/delivery.hpp"
#include "idem/key.hpp"

int main() {
    idem::Delivery delivery{"1700000000000-0", 3u};
#ifdef IDEM_COMPILE_FAIL
    const std::string k = idem::key("capture", delivery.delivery_count);
#else
    const std::string k = idem::key("capture", 8814);
#endif
    return k.empty() && delivery.message_id.empty() ? 1 : 0;
}
