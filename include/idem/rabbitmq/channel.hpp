#pragma once
/// @file
/// @brief What goes on one AMQP channel: the arguments of the methods a consumer sends on it
/// (QueueDeclare, Publish) and their answers (QueueState), and the bookkeeping of a channel's
/// incarnation (its epoch) and of its publisher confirms. Plain values: no rabbitmq-c header
/// here. Link idem::rabbitmq.

#include <cstdint>
#include <string>

#include "idem/config.hpp"
#include "idem/rabbitmq/message.hpp"

IDEM_BEGIN_NAMESPACE
namespace rabbitmq {

/// @brief How a queue is declared (queue.declare).
struct QueueDeclare {
    bool passive = false;  ///< only check that it exists (arguments are then ignored by the broker)
    /// Survives a broker restart (a quorum queue must be durable).
    bool durable = true;
    /// This connection's only; deleted when it closes.
    bool exclusive = false;
    /// Deleted once its last consumer is gone.
    bool auto_delete = false;
    Table arguments{};  ///< x-queue-type, x-dead-letter-exchange, x-message-ttl, ...
};

/// @brief What queue.declare-ok says.
struct QueueState {
    std::uint32_t messages = 0;   ///< ready messages (not those delivered and unacked)
    std::uint32_t consumers = 0;  ///< active consumers
};

/// @brief What a publish carries besides its body.
struct Publish {
    std::string exchange{};  ///< "" is the default exchange (routing key = queue name)
    /// With the default exchange: the queue's name.
    std::string routing_key{};
    /// The basic properties sent with it.
    Properties properties{};
    /// Headers in AMQP wire encoding (Message::encoded_headers), sent first...
    std::string encoded_headers{};
    /// ...then these, replacing entries of the same name.
    Table headers{};
    /// Ask the broker to return a message no queue takes (then the confirm fails).
    bool mandatory = true;
};

namespace detail {

/// One open channel, as the connection keeps it.
struct ChannelState {
    std::uint64_t epoch = 0;  ///< which incarnation of the channel (Message::channel_epoch)
    bool confirms = false;
    std::uint64_t published = 0;    ///< publishes since confirm.select (their sequence)
    std::uint64_t confirmed = 0;    ///< every publish up to this one is acked or nacked
    std::uint64_t nacked_from = 0;  ///< the first nacked one not yet reported
    bool returned = false;          ///< a basic.return since the last reported confirm

    /// A basic.ack (@p ack) or basic.nack from the broker for publish @p tag, and for every
    /// one before it when @p multiple.
    void record_confirm(bool ack, std::uint64_t tag, bool multiple) noexcept {
        if (!ack && nacked_from == 0) nacked_from = multiple ? confirmed + 1 : tag;
        // Confirms arrive in order on a channel; one for tag N (not multiple) with earlier ones
        // outstanding only happens for out-of-order confirms, which a single outstanding
        // publish (Connection::publish_confirmed()) never has.
        if (tag > confirmed) confirmed = tag;
    }

    enum class Confirm { pending, confirmed, nacked, returned };

    /// What became of publish @p tag. Once it is answered, a nack or a return since the last
    /// answer is reported (and forgotten).
    Confirm confirm_of(std::uint64_t tag) noexcept {
        if (confirmed < tag) return Confirm::pending;
        const bool nacked = nacked_from != 0 && nacked_from <= tag;
        const bool was_returned = returned;
        returned = false;
        nacked_from = 0;
        if (nacked) return Confirm::nacked;
        if (was_returned) return Confirm::returned;
        return Confirm::confirmed;
    }
};

}  // namespace detail
}  // namespace rabbitmq
IDEM_END_NAMESPACE
