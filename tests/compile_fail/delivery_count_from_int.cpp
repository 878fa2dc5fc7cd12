// expect: deleted (function|constructor)
// A signed count converts silently: -1 would become 4294967295 (a poison dead letter).
// idem::DeliveryCount refuses an int at compile time; DeliveryCount::from() checks at run time.
#include <cstdint>

#include "idem/delivery.hpp"

int main(int argc, char**) {
    const int count = argc - 2;  // -1 when run without arguments
#ifdef IDEM_COMPILE_FAIL
    const idem::DeliveryCount delivery_count{count};
#else
    const idem::DeliveryCount delivery_count = idem::DeliveryCount::from(count + 2);
#endif
    return delivery_count.value() == 0 ? 1 : 0;
}
