#pragma once
/// @file
/// @brief idem::RabbitMqSender: an idem::Relay sender that publishes each outbox intent to
/// RabbitMQ, persistent and mandatory, with the idempotency key as the message_id property (the
/// id an idem::RabbitMqConsumer claims by default), and waits for the publisher confirm. Link
/// idem::rabbitmq. See docs/chain.md.
///
/// @code
/// idem::Relay relay(store, idem::RabbitMqSender{idem::RabbitEndpoint{}});  // routing key = queue
/// @endcode

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/records.hpp"
#include "idem/error.hpp"
#include "idem/outbox.hpp"
#include "idem/rabbitmq/channel.hpp"
#include "idem/rabbitmq/connection.hpp"
#include "idem/rabbitmq/endpoint.hpp"
#include "idem/rabbitmq/error.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief Where a RabbitMqSender publishes and what the messages carry.
struct RabbitMqSenderOptions {
    /// The exchange; "" (the default exchange) routes by queue name, so an intent's destination
    /// is the queue. With a named exchange the destination is the routing key.
    std::string exchange{};
    /// The content_type property; unset: none.
    std::optional<std::string> content_type{};
    /// The channel number the sender opens on its connection.
    std::uint16_t channel = 1;
};

/// @brief Publishes an outbox intent (`basic.publish` to options.exchange with the destination
/// as routing key, delivery_mode 2, message_id = the idempotency key, mandatory) on a confirm
/// channel and returns once the broker confirmed it: routed and, for durable queues, written.
///
/// Failures and what the Relay does with them (the reason is in the exception's text):
/// - connection refused or lost, no confirm within the endpoint's rpc_timeout (the message may be
///   there: the resend is a duplicate the consumer's claim drops), a nack → retry later; the
///   next send reconnects and reopens the channel;
/// - unroutable (no queue bound for the routing key: the broker returned the mandatory message)
///   → retry later (rabbitmq::unroutable). The queue may not be declared YET (its consumer not
///   started), and a binding added later takes the resend; RelayOptions::max_attempts parks it
///   if it never comes;
/// - the exchange does not exist (channel closed 404) or the broker refuses the message itself
///   (406 PRECONDITION_FAILED: larger than its max_message_size) → idem::send_refused: parked at
///   once. Other channel closes → retry later.
///
/// One thread at a time (one connection); movable, so a Relay can own it.
class RabbitMqSender {
  public:
    /// @brief A sender to the broker at @p endpoint, publishing as @p options says; connects on the
    /// first send.
    /// @throws usage_error when options.channel is 0 (the connection's own).
    explicit RabbitMqSender(RabbitEndpoint endpoint, RabbitMqSenderOptions options = {})
        : options_(std::move(options)),
          connection_(std::make_unique<rabbitmq::Connection>(std::move(endpoint))) {
        if (options_.channel == 0) {
            throw usage_error("idem::RabbitMqSender: channel 0 is the connection's own");
        }
    }

    /// @brief Publishes @p row and waits for its confirm.
    /// @throws idem::send_refused (park), or broker_error / broker_unavailable (retry later).
    void operator()(const OutboxRow& row) {
        rabbitmq::Publish publish;
        publish.exchange = options_.exchange;
        publish.routing_key = row.destination;
        publish.properties.message_id = row.idempotency_key;
        publish.properties.delivery_mode = 2;  // persistent
        publish.properties.content_type = options_.content_type;
        publish.mandatory = true;
        try {
            connection_->connect();  // no-op when connected
            const std::uint16_t channel = options_.channel;
            if (connection_->channel_epoch(channel) == 0) {
                connection_->open_channel(channel);
                connection_->confirm_select(channel);
            }
            connection_->publish_confirmed(channel, publish, row.payload);
        } catch (const rabbitmq::channel_error& e) {
            const auto code = e.reply_code();
            if (code == rabbitmq::reply_not_found || code == rabbitmq::reply_precondition_failed) {
                throw send_refused(fmt::format("idem::RabbitMqSender: {} refused for good ({}): {}",
                                               describe(row), code, e.what()));
            }
            throw;
        }
    }

    /// @brief The options in use.
    [[nodiscard]] const RabbitMqSenderOptions& options() const noexcept { return options_; }

  private:
    std::string describe(const OutboxRow& row) const {
        return fmt::format("the publish of '{}' to exchange '{}' routing key '{}'",
                           row.idempotency_key, options_.exchange, row.destination);
    }

    RabbitMqSenderOptions options_;
    std::unique_ptr<rabbitmq::Connection> connection_;
};

IDEM_END_NAMESPACE
