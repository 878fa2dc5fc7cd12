#pragma once
/// @file
/// @brief idem::RedisStreamSender: an idem::Relay sender that XADDs each outbox intent to the
/// Redis Stream named by its destination, with the idempotency key in an id field, so an
/// idem::RedisStreamConsumer whose `id_field` is that field claims the key as the message id. Link
/// idem::redis. See docs/chain.md.
///
/// @code
/// idem::RedisStreamConsumerOptions downstream{"payments", "settle", "worker-1"};
/// downstream.id_field = idem::RedisStreamSenderOptions{}.id_field;  // "message_id"
///
/// idem::Relay relay(store, idem::RedisStreamSender{idem::RedisEndpoint{"127.0.0.1", 6379}});
/// @endcode

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/records.hpp"
#include "idem/error.hpp"
#include "idem/outbox.hpp"
#include "idem/redis/connection.hpp"
#include "idem/redis/endpoint.hpp"
#include "idem/redis/reply.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The fields a RedisStreamSender writes, and the stream's trimming.
struct RedisStreamSenderOptions {
    /// The field carrying the idempotency key: set the downstream
    /// RedisStreamConsumerOptions::id_field to it, so the key is the message id its handler claims.
    std::string id_field = "message_id";
    /// The field carrying the intent's payload.
    std::string payload_field = "payload";
    /// `MAXLEN ~ n` on each XADD (the stream keeps about the last n entries); unset: no trimming.
    /// Trim only what every consumer group has read: a trimmed entry is gone, never delivered.
    std::optional<std::size_t> max_length{};
};

/// @brief Ships an outbox intent as `XADD <destination> [MAXLEN ~ n] * <id_field> <key>
/// <payload_field> <payload>` on one connection (reconnected after a failure), and returns once
/// Redis has answered with the entry id.
///
/// Failures: the server unreachable, the connection lost, a timeout (the entry may have been
/// added: the resend is a duplicate the consumer's claim drops) or any error reply but the one
/// below → the exception propagates and the Relay retries later. WRONGTYPE (the destination key
/// holds something other than a stream: no resend can succeed) → idem::send_refused, which
/// parks the intent at once. The reason is in the exception's text.
///
/// One thread at a time (one connection); movable, so a Relay can own it.
class RedisStreamSender {
  public:
    /// @throws usage_error when a field name is empty or both are the same, or max_length is 0.
    explicit RedisStreamSender(RedisEndpoint endpoint, RedisStreamSenderOptions options = {})
        : options_(std::move(options)),
          connection_(std::make_unique<redis::Connection>(std::move(endpoint))) {
        if (options_.id_field.empty() || options_.payload_field.empty()) {
            throw usage_error("idem::RedisStreamSender: id_field and payload_field must be named");
        }
        if (options_.id_field == options_.payload_field) {
            throw usage_error(fmt::format(
                "idem::RedisStreamSender: id_field and payload_field are both \"{}\"; a consumer "
                "would read the payload as the message id",
                options_.id_field));
        }
        if (options_.max_length && *options_.max_length == 0) {
            throw usage_error("idem::RedisStreamSender: max_length 0 would trim every entry");
        }
    }

    /// @brief XADDs @p row; returns once Redis stored it.
    /// @throws idem::send_refused (park: WRONGTYPE), store_unavailable / store_timeout (the
    /// connection's, or a server that cannot serve now: LOADING, MASTERDOWN, CLUSTERDOWN,
    /// TRYAGAIN; retry later) or broker_error (another error reply; retry later).
    void operator()(const OutboxRow& row) {
        std::vector<std::string> command{"XADD", row.destination};
        if (options_.max_length) {
            command.insert(command.end(), {"MAXLEN", "~", std::to_string(*options_.max_length)});
        }
        command.insert(command.end(), {"*", options_.id_field, row.idempotency_key,
                                       options_.payload_field, row.payload});
        const redis::Reply reply = connection_->command(command);
        if (!reply.is_error()) return;
        const std::string why =
            fmt::format("idem::RedisStreamSender: XADD to \"{}\" on {} refused: {}",
                        row.destination, connection_->endpoint().describe(), reply.str);
        if (reply.str.rfind("WRONGTYPE", 0) == 0) throw send_refused(why);
        if (redis::is_unavailable_error(reply)) throw store_unavailable(why);  // LOADING, ...
        throw broker_error(why);
    }

    /// @brief The options in use.
    [[nodiscard]] const RedisStreamSenderOptions& options() const noexcept { return options_; }
    /// @brief The Redis server it appends to.
    [[nodiscard]] const RedisEndpoint& endpoint() const noexcept { return connection_->endpoint(); }

  private:
    RedisStreamSenderOptions options_;
    std::unique_ptr<redis::Connection> connection_;
};

IDEM_END_NAMESPACE
