// Doc-test types (`// @use stream_parse`, no block of its own): the user's capture types and
// parse(), the user's reading of a stream entry into a CapturePayment. Needs
// idem/broker/redis_streams.hpp (idem::StreamEntry) included before it.
#include <string>

// @use capture_types

inline CapturePayment parse(const idem::StreamEntry& entry) {
    auto order_id = entry.field("order_id");
    auto amount = entry.field("amount");
    if (!order_id || !amount) throw idem::malformed_message("no order_id or amount");
    return CapturePayment{std::string(*order_id), std::string(entry.field("token").value_or("")),
                          std::stol(std::string(*amount))};
}
