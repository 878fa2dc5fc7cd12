// expect: deleted (function|constructor)
// A 64-bit count converts silently: 2^32 + 1 would become 1 (a first delivery).
// idem::Delivery refuses a std::uint64_t count at compile time; DeliveryCount::from() checks.
#include <cstdint>
#include <string>

#include "idem/delivery.hpp"

int main(int argc, char**) {
    const std::uint64_t count = (std::uint64_t{1} << 32) + static_cast<std::uint64_t>(argc);
#ifdef IDEM_COMPILE_FAIL
    const idem::Delivery delivery{"1700000000000-0", count};
#else
    const idem::Delivery delivery{"1700000000000-0",
                                  idem::DeliveryCount::from(count - (std::uint64_t{1} << 32))};
#endif
    return delivery.delivery_count.value() == 0 ? 1 : 0;
}
