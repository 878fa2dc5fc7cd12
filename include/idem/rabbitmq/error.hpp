#pragma once
/// @file
/// @brief idem::rabbitmq's typed errors and the AMQP reply codes idem tells apart. The
/// connection lost or refused, or no answer in time, is an idem::broker_unavailable (the
/// connection is dropped); the broker closing one channel is a rabbitmq::channel_error with the
/// AMQP reply code (the connection stays usable, the channel must be opened again). Catch
/// idem::broker_error for any of them. Link idem::rabbitmq.

#include <cstdint>
#include <string>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/rabbitmq/amqp.hpp"

IDEM_BEGIN_NAMESPACE
namespace rabbitmq {

/// AMQP reply codes idem tells apart.
inline constexpr std::uint16_t reply_not_found = 404;
/// 405 RESOURCE_LOCKED: e.g. an exclusive queue another connection holds.
inline constexpr std::uint16_t reply_resource_locked = 405;
/// 406 PRECONDITION_FAILED: e.g. a declare whose arguments differ from the queue's, or a message
/// larger than max_message_size.
inline constexpr std::uint16_t reply_precondition_failed = 406;

/// @brief The broker closed a channel (channel.close): the channel is gone, the connection is
/// not. reply_code is the AMQP code (404 NOT_FOUND, 406 PRECONDITION_FAILED, ...), 0 when the
/// broker sent no close: a consumer it cancelled (basic.cancel: its queue was deleted), or a
/// channel the client found closed (before a publish's confirm, or before a call on it).
class channel_error : public broker_error {
  public:
    /// @brief A channel closed with AMQP @p reply_code, described by @p what; 0 when the broker
    /// sent no close (a consumer it cancelled, a channel found closed before a confirm or a call).
    channel_error(std::uint16_t reply_code, const std::string& what)
        : broker_error(what), reply_code_(reply_code) {}
    /// @brief The AMQP reply code of the close (compare with reply_not_found, ...); 0 when the
    /// broker sent none (see the constructor).
    [[nodiscard]] std::uint16_t reply_code() const noexcept { return reply_code_; }

  private:
    std::uint16_t reply_code_;
};

/// @brief A mandatory publish no queue took: the broker returned it (basic.return) before its
/// confirm. Nothing was stored; a queue bound later would take a resend.
class unroutable : public broker_error {
  public:
    using broker_error::broker_error;
};

namespace detail {

/// What a method's reply says, for an error's text.
inline std::string describe_reply(const amqp_rpc_reply_t& r) {
    switch (r.reply_type) {
        case AMQP_RESPONSE_NORMAL:
            return "ok";
        case AMQP_RESPONSE_NONE:
            return "no reply";
        case AMQP_RESPONSE_LIBRARY_EXCEPTION:
            return amqp_error_string2(r.library_error);
        case AMQP_RESPONSE_SERVER_EXCEPTION:
            if (r.reply.id == AMQP_CONNECTION_CLOSE_METHOD) {
                const auto* m = static_cast<const amqp_connection_close_t*>(r.reply.decoded);
                return fmt::format("connection closed by the broker: {} {}", m->reply_code,
                                   string_of(m->reply_text));
            }
            if (r.reply.id == AMQP_CHANNEL_CLOSE_METHOD) {
                const auto* m = static_cast<const amqp_channel_close_t*>(r.reply.decoded);
                return fmt::format("channel closed by the broker: {} {}", m->reply_code,
                                   string_of(m->reply_text));
            }
            return fmt::format("unexpected method 0x{:08x}", r.reply.id);
    }
    return "unknown reply";
}

}  // namespace detail
}  // namespace rabbitmq
IDEM_END_NAMESPACE
