#pragma once
/// @file
/// @brief The rabbitmq-c headers, whichever layout is installed (0.11 puts amqp.h straight in
/// the include path, 0.12 and later in rabbitmq-c/), and the conversions between rabbitmq-c's
/// byte and time values and ours. The idem::rabbitmq headers include rabbitmq-c only through
/// this one. Link idem::rabbitmq.

#if __has_include(<rabbitmq-c/amqp.h>)
#include <rabbitmq-c/amqp.h>  // rabbitmq-c 0.12 and later
#include <rabbitmq-c/tcp.h>
#else
#include <amqp.h>  // rabbitmq-c 0.11 (Debian 12's librabbitmq-dev)
#include <amqp_tcp_socket.h>
#endif
#include <sys/time.h>

#include <chrono>
#include <string>
#include <string_view>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace rabbitmq {
namespace detail {

inline timeval to_timeval(std::chrono::milliseconds d) {
    timeval tv{};
    if (d.count() < 0) d = std::chrono::milliseconds(0);
    tv.tv_sec = static_cast<time_t>(d.count() / 1000);
    tv.tv_usec = static_cast<suseconds_t>((d.count() % 1000) * 1000);
    return tv;
}

inline amqp_bytes_t bytes_of(std::string_view s) {
    amqp_bytes_t b;
    b.len = s.size();
    b.bytes = const_cast<char*>(s.data());
    return b;
}

inline std::string string_of(amqp_bytes_t b) {
    if (b.len == 0 || b.bytes == nullptr) return {};
    return std::string(static_cast<const char*>(b.bytes), b.len);
}

}  // namespace detail
}  // namespace rabbitmq
IDEM_END_NAMESPACE
