#pragma once
/// @file
/// @brief idem::rabbitmq::Connection: one AMQP 0-9-1 connection to RabbitMQ through rabbitmq-c
/// (rabbitmq/amqp.hpp), with numbered channels (rabbitmq/channel.hpp), the queue and exchange
/// methods a consumer needs, manual acks, publishes that wait for the publisher confirm, and the
/// frame pump that reads what the broker sends meanwhile. Link idem::rabbitmq.
///
/// Failures are typed (idem/error.hpp, rabbitmq/error.hpp): the connection lost or refused, or no
/// answer within rpc_timeout → broker_unavailable (the connection is dropped, a timed-out method's
/// effect is unknown; connect() again), the broker closing one channel (a missing queue,
/// inequivalent arguments, an unknown delivery tag) → rabbitmq::channel_error with the AMQP reply
/// code; the connection stays usable and the channel must be opened again.
///
/// Delivery tags belong to a channel: every Message carries the epoch of the channel that
/// delivered it, and ack()/nack() send nothing (and return false) for a message whose channel has
/// been closed or reopened since — its delivery is back in the queue for someone else, and an
/// ack on the new channel would settle another delivery, or close the channel with
/// PRECONDITION_FAILED.
///
/// One thread at a time.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/rabbitmq/amqp.hpp"
#include "idem/rabbitmq/channel.hpp"
#include "idem/rabbitmq/endpoint.hpp"
#include "idem/rabbitmq/error.hpp"
#include "idem/rabbitmq/message.hpp"
#include "idem/rabbitmq/properties.hpp"
#include "idem/rabbitmq/table.hpp"

IDEM_BEGIN_NAMESPACE
namespace rabbitmq {

/// @brief One AMQP connection (see the file comment). Connects on connect(); the destructor
/// closes it politely and never throws.
class Connection {
  public:
    /// @brief A connection to the broker at @p endpoint, not yet made: connect() makes it (other
    /// calls need it made and throw until then).
    explicit Connection(Endpoint endpoint) : endpoint_(std::move(endpoint)) {}
    ~Connection() { close(); }
    Connection(const Connection&) = delete;
    Connection& operator=(const Connection&) = delete;

    /// @brief The broker and the settings it was made with.
    [[nodiscard]] const Endpoint& endpoint() const noexcept { return endpoint_; }
    /// @brief True while connected: false before connect(), and after an error dropped the
    /// connection.
    [[nodiscard]] bool connected() const noexcept { return state_ != nullptr; }

    /// @brief Opens the socket and logs in; no-op when connected.
    /// @throws broker_unavailable when the broker cannot be reached or refuses the login.
    void connect() {
        if (state_ != nullptr) return;
        amqp_connection_state_t state = amqp_new_connection();
        if (state == nullptr) throw broker_unavailable("idem::rabbitmq: out of memory");
        amqp_socket_t* socket = amqp_tcp_socket_new(state);
        if (socket == nullptr) {
            amqp_destroy_connection(state);
            throw broker_unavailable("idem::rabbitmq: cannot create a TCP socket");
        }
        timeval connect_tv = detail::to_timeval(endpoint_.connect_timeout);
        const int opened =
            amqp_socket_open_noblock(socket, endpoint_.host.c_str(), endpoint_.port, &connect_tv);
        if (opened != AMQP_STATUS_OK) {
            amqp_destroy_connection(state);
            throw broker_unavailable(fmt::format("idem::rabbitmq: connecting to {} failed: {}",
                                                 endpoint_.describe(), amqp_error_string2(opened)));
        }
        timeval rpc_tv = detail::to_timeval(endpoint_.rpc_timeout);
        amqp_set_handshake_timeout(state, &connect_tv);
        amqp_set_rpc_timeout(state, &rpc_tv);
        const amqp_rpc_reply_t login =
            amqp_login(state, endpoint_.vhost.c_str(), 0, 131072,
                       static_cast<int>(endpoint_.heartbeat.count()), AMQP_SASL_METHOD_PLAIN,
                       endpoint_.user.c_str(), endpoint_.password.c_str());
        if (login.reply_type != AMQP_RESPONSE_NORMAL) {
            const std::string why = detail::describe_reply(login);
            amqp_destroy_connection(state);
            throw broker_unavailable(
                fmt::format("idem::rabbitmq: logging in to {} as {} failed: {}",
                            endpoint_.describe(), endpoint_.user, why));
        }
        state_ = state;
        ++connection_epoch_;
    }

    /// @brief connection.close (politely, bounded by rpc_timeout), then the socket is gone.
    void close() noexcept {
        if (state_ == nullptr) return;
        (void)amqp_connection_close(state_, AMQP_REPLY_SUCCESS);
        drop();
    }

    /// @brief Drops the connection without a handshake (after an error). Every channel is gone.
    void drop() noexcept {
        if (state_ != nullptr) amqp_destroy_connection(state_);
        state_ = nullptr;
        channels_.clear();
        deliveries_.clear();
    }

    /// @brief A property the broker sent in connection.start (e.g. "cluster_name", "version"),
    /// when connected and it is there.
    [[nodiscard]] std::optional<FieldValue> server_property(std::string_view name) const {
        if (state_ == nullptr) return std::nullopt;
        const amqp_table_t* props = amqp_get_server_properties(state_);
        if (props == nullptr) return std::nullopt;
        for (int i = 0; i < props->num_entries; ++i) {
            if (detail::string_of(props->entries[i].key) == name) {
                return detail::field_value_of(props->entries[i].value);
            }
        }
        return std::nullopt;
    }

    /// @brief Increases with each successful connect().
    [[nodiscard]] std::uint64_t connection_epoch() const noexcept { return connection_epoch_; }

    /// @brief channel.open; the channel gets a new epoch.
    void open_channel(std::uint16_t channel) {
        require_connected("channel.open");
        if (channels_.count(channel) != 0) return;
        amqp_channel_open(state_, channel);
        check_rpc(channel, "channel.open");
        ChannelState s;
        s.epoch = ++channel_epochs_;
        channels_[channel] = s;
    }

    /// @brief channel.close; nothing when the channel is not open. Errors drop the connection.
    void close_channel(std::uint16_t channel) noexcept {
        if (state_ == nullptr || channels_.count(channel) == 0) return;
        channels_.erase(channel);
        forget_deliveries_of(channel);
        const amqp_rpc_reply_t r = amqp_channel_close(state_, channel, AMQP_REPLY_SUCCESS);
        if (r.reply_type != AMQP_RESPONSE_NORMAL) drop();
    }

    /// @brief True when @p channel is open on the current connection (a dropped connection closes
    /// all).
    [[nodiscard]] bool channel_open(std::uint16_t channel) const noexcept {
        return state_ != nullptr && channels_.count(channel) != 0;
    }
    /// @brief The channel's current epoch; 0 when it is not open.
    [[nodiscard]] std::uint64_t channel_epoch(std::uint16_t channel) const noexcept {
        auto found = channels_.find(channel);
        return found == channels_.end() ? 0 : found->second.epoch;
    }

    /// @brief queue.declare. @throws channel_error (404 for a passive declare of a missing
    /// queue, 406 for arguments that differ from the existing queue's: the channel is then gone).
    QueueState declare_queue(std::uint16_t channel, const std::string& queue,
                             const QueueDeclare& how) {
        require_channel(channel, "queue.declare");
        std::vector<amqp_table_entry_t> entries;
        const amqp_table_t args = detail::to_amqp(how.arguments, entries);
        amqp_queue_declare_ok_t* ok = amqp_queue_declare(
            state_, channel, detail::bytes_of(queue), how.passive ? 1 : 0, how.durable ? 1 : 0,
            how.exclusive ? 1 : 0, how.auto_delete ? 1 : 0, args);
        check_rpc(channel, "queue.declare " + queue);
        QueueState s;
        if (ok != nullptr) {
            s.messages = ok->message_count;
            s.consumers = ok->consumer_count;
        }
        return s;
    }

    /// @brief exchange.declare (durable, not auto-deleted).
    void declare_exchange(std::uint16_t channel, const std::string& exchange,
                          const std::string& type) {
        require_channel(channel, "exchange.declare");
        amqp_exchange_declare(state_, channel, detail::bytes_of(exchange), detail::bytes_of(type),
                              0, 1, 0, 0, amqp_empty_table);
        check_rpc(channel, "exchange.declare " + exchange);
    }

    /// @brief queue.bind.
    void bind_queue(std::uint16_t channel, const std::string& queue, const std::string& exchange,
                    const std::string& routing_key) {
        require_channel(channel, "queue.bind");
        amqp_queue_bind(state_, channel, detail::bytes_of(queue), detail::bytes_of(exchange),
                        detail::bytes_of(routing_key), amqp_empty_table);
        check_rpc(channel, "queue.bind " + queue);
    }

    /// @brief queue.purge: the ready messages are dropped; returns how many.
    std::uint32_t purge_queue(std::uint16_t channel, const std::string& queue) {
        require_channel(channel, "queue.purge");
        amqp_queue_purge_ok_t* ok = amqp_queue_purge(state_, channel, detail::bytes_of(queue));
        check_rpc(channel, "queue.purge " + queue);
        return ok != nullptr ? ok->message_count : 0;
    }

    /// @brief queue.delete (unconditionally).
    void delete_queue(std::uint16_t channel, const std::string& queue) {
        require_channel(channel, "queue.delete");
        amqp_queue_delete(state_, channel, detail::bytes_of(queue), 0, 0);
        check_rpc(channel, "queue.delete " + queue);
    }

    /// @brief basic.qos: at most @p prefetch unacked deliveries on this channel (0: no limit).
    void qos(std::uint16_t channel, std::uint16_t prefetch) {
        require_channel(channel, "basic.qos");
        amqp_basic_qos(state_, channel, 0, prefetch, 0);
        check_rpc(channel, "basic.qos");
    }

    /// @brief basic.consume with manual acks; returns the consumer tag.
    std::string consume(std::uint16_t channel, const std::string& queue,
                        const std::string& consumer_tag = {}, const Table& arguments = {}) {
        require_channel(channel, "basic.consume");
        std::vector<amqp_table_entry_t> entries;
        amqp_basic_consume_ok_t* ok = amqp_basic_consume(
            state_, channel, detail::bytes_of(queue), detail::bytes_of(consumer_tag), 0,
            /*no_ack=*/0, 0, detail::to_amqp(arguments, entries));
        check_rpc(channel, "basic.consume " + queue);
        return ok != nullptr ? detail::string_of(ok->consumer_tag) : consumer_tag;
    }

    /// @brief confirm.select: publishes on this channel are confirmed (publish_confirmed()).
    void confirm_select(std::uint16_t channel) {
        require_channel(channel, "confirm.select");
        auto& s = channels_.at(channel);
        if (s.confirms) return;
        amqp_confirm_select(state_, channel);
        check_rpc(channel, "confirm.select");
        auto& after = channels_.at(channel);
        after.confirms = true;
        after.published = 0;
    }

    /// @brief The next delivery of any consuming channel, waiting up to @p timeout; nothing
    /// when none came. A timeout of 0 (or one that has passed) still reads the frames that have
    /// already arrived, without waiting: a delivery among them is returned.
    /// @throws channel_error when the broker closed a channel (or cancelled its consumer)
    /// meanwhile, broker_unavailable when the connection is lost.
    std::optional<Message> next_delivery(std::chrono::milliseconds timeout) {
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        for (;;) {
            if (!deliveries_.empty()) {
                Message m = std::move(deliveries_.front());
                deliveries_.pop_front();
                return m;
            }
            require_connected("waiting for deliveries");
            const auto now = std::chrono::steady_clock::now();
            const auto left =
                now >= deadline
                    ? std::chrono::milliseconds(0)
                    : std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
            if (!pump(left)) return std::nullopt;  // nothing (more) arrived in time
        }
    }

    /// @brief basic.ack of @p message on the channel that delivered it. Returns false, sending
    /// nothing, when that channel was closed or reopened since (the delivery is the broker's
    /// again). @throws broker_unavailable when the connection breaks while sending.
    bool ack(const Message& message) {
        take_in_arrived();
        if (!current(message)) return false;
        const int status = amqp_basic_ack(state_, message.channel, message.delivery_tag, 0);
        if (status != AMQP_STATUS_OK) lost("basic.ack", status);
        return true;
    }

    /// @brief basic.nack (requeue or not) of @p message; false, sending nothing, for a message
    /// of a stale channel (see ack()).
    bool nack(const Message& message, bool requeue) {
        take_in_arrived();
        if (!current(message)) return false;
        const int status =
            amqp_basic_nack(state_, message.channel, message.delivery_tag, 0, requeue ? 1 : 0);
        if (status != AMQP_STATUS_OK) lost("basic.nack", status);
        return true;
    }

    /// @brief basic.publish without waiting for anything.
    void publish(std::uint16_t channel, const Publish& what, std::string_view body) {
        require_channel(channel, "basic.publish");
        detail::Pool pool;
        amqp_basic_properties_t props{};
        std::vector<amqp_table_entry_t> entries;
        detail::fill_properties(what, pool, props, entries);
        const int status = amqp_basic_publish(
            state_, channel, detail::bytes_of(what.exchange), detail::bytes_of(what.routing_key),
            what.mandatory ? 1 : 0, 0, &props, detail::bytes_of(body));
        if (status != AMQP_STATUS_OK) lost("basic.publish", status);
        auto found = channels_.find(channel);
        if (found != channels_.end() && found->second.confirms) ++found->second.published;
    }

    /// @brief basic.publish on a confirm channel (confirm_select()), then waits (rpc_timeout) for
    /// the broker's confirm. Returns once the broker has taken responsibility for the message:
    /// routed to at least one queue (mandatory) and, for durable queues, written.
    /// @throws broker_error when the broker nacks it, rabbitmq::unroutable when no queue takes it
    /// (returned),
    /// broker_unavailable when no confirm comes in time (the connection is dropped: the message
    /// may or may not be there).
    void publish_confirmed(std::uint16_t channel, const Publish& what, std::string_view body) {
        require_channel(channel, "basic.publish");
        if (!channels_.at(channel).confirms) confirm_select(channel);
        publish(channel, what, body);
        auto& s = channels_.at(channel);
        const std::uint64_t tag = s.published;
        const auto deadline = std::chrono::steady_clock::now() + endpoint_.rpc_timeout;
        for (;;) {
            auto found = channels_.find(channel);
            if (found == channels_.end()) {
                throw channel_error(0, fmt::format("idem::rabbitmq: channel {} closed before the "
                                                   "confirm of a publish to '{}'",
                                                   channel, what.exchange));
            }
            switch (found->second.confirm_of(tag)) {
                case ChannelState::Confirm::pending:
                    break;
                case ChannelState::Confirm::confirmed:
                    return;
                case ChannelState::Confirm::nacked:
                    throw broker_error(fmt::format(
                        "idem::rabbitmq: the broker refused (nacked) a publish to exchange '{}' "
                        "routing key '{}'",
                        what.exchange, what.routing_key));
                case ChannelState::Confirm::returned:
                    throw unroutable(fmt::format(
                        "idem::rabbitmq: no queue is bound to exchange '{}' for routing key '{}': "
                        "the message was returned (bind a queue to it)",
                        what.exchange, what.routing_key));
            }
            const auto now = std::chrono::steady_clock::now();
            if (now >= deadline) {
                drop();
                throw broker_unavailable(fmt::format(
                    "idem::rabbitmq: no publisher confirm from {} within {} ms (the message may "
                    "or may not be there)",
                    endpoint_.describe(), endpoint_.rpc_timeout.count()));
            }
            pump(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now));
        }
    }

  private:
    using ChannelState = detail::ChannelState;

    /// Handles the frames that have already arrived, without waiting: a channel.close the broker
    /// sent while the handler ran (a consumer timeout) must be seen before an ack goes out on
    /// that channel, or the ack would be sent on a channel the broker has closed.
    void take_in_arrived() {
        while (state_ != nullptr) {
            try {
                if (!pump(std::chrono::milliseconds(0))) return;
            } catch (const channel_error&) {  // that channel is forgotten; read on
            }
        }
    }

    bool current(const Message& m) const noexcept {
        if (state_ == nullptr) return false;
        auto found = channels_.find(m.channel);
        return found != channels_.end() && found->second.epoch == m.channel_epoch;
    }

    void forget_deliveries_of(std::uint16_t channel) {
        for (auto it = deliveries_.begin(); it != deliveries_.end();) {
            it = it->channel == channel ? deliveries_.erase(it) : std::next(it);
        }
    }

    void require_connected(std::string_view what) {
        if (state_ == nullptr) {
            throw broker_unavailable(
                fmt::format("idem::rabbitmq: {} on {}: not connected", what, endpoint_.describe()));
        }
    }
    void require_channel(std::uint16_t channel, std::string_view what) {
        require_connected(what);
        if (channels_.count(channel) == 0) {
            throw channel_error(0, fmt::format("idem::rabbitmq: {} on {}: channel {} is not open",
                                               what, endpoint_.describe(), channel));
        }
    }

    [[noreturn]] void lost(std::string_view what, int status) {
        const std::string text = amqp_error_string2(status);
        drop();
        if (status == AMQP_STATUS_TIMEOUT) {
            throw broker_unavailable(
                fmt::format("idem::rabbitmq: {} on {} timed out", what, endpoint_.describe()));
        }
        throw broker_unavailable(
            fmt::format("idem::rabbitmq: {} on {} failed: {} (connection "
                        "dropped)",
                        what, endpoint_.describe(), text));
    }

    /// After a synchronous method: throws the typed error for anything but a normal reply.
    void check_rpc(std::uint16_t channel, const std::string& what) {
        const amqp_rpc_reply_t r = amqp_get_rpc_reply(state_);
        if (r.reply_type == AMQP_RESPONSE_NORMAL) return;
        if (r.reply_type == AMQP_RESPONSE_SERVER_EXCEPTION &&
            r.reply.id == AMQP_CHANNEL_CLOSE_METHOD) {
            const auto* m = static_cast<const amqp_channel_close_t*>(r.reply.decoded);
            const std::uint16_t code = m->reply_code;
            const std::string text = detail::string_of(m->reply_text);
            closed_by_broker(channel);
            throw channel_error(code, fmt::format("idem::rabbitmq: {} on {}: {} {}", what,
                                                  endpoint_.describe(), code, text));
        }
        if (r.reply_type == AMQP_RESPONSE_SERVER_EXCEPTION &&
            r.reply.id == AMQP_CONNECTION_CLOSE_METHOD) {
            const std::string why = detail::describe_reply(r);
            amqp_connection_close_ok_t ok{};
            (void)amqp_send_method(state_, 0, AMQP_CONNECTION_CLOSE_OK_METHOD, &ok);
            drop();
            throw broker_unavailable(
                fmt::format("idem::rabbitmq: {} on {}: {}", what, endpoint_.describe(), why));
        }
        const bool timeout = r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
                             r.library_error == AMQP_STATUS_TIMEOUT;
        const std::string why = detail::describe_reply(r);
        drop();
        if (timeout) {
            throw broker_unavailable(fmt::format("idem::rabbitmq: {} on {}: no answer within {} ms",
                                                 what, endpoint_.describe(),
                                                 endpoint_.rpc_timeout.count()));
        }
        throw broker_unavailable(
            fmt::format("idem::rabbitmq: {} on {} failed: {} (connection "
                        "dropped)",
                        what, endpoint_.describe(), why));
    }

    /// The broker closed @p channel: answer close-ok, forget it and its buffered deliveries.
    void closed_by_broker(std::uint16_t channel) {
        amqp_channel_close_ok_t ok{};
        const int status = amqp_send_method(state_, channel, AMQP_CHANNEL_CLOSE_OK_METHOD, &ok);
        channels_.erase(channel);
        forget_deliveries_of(channel);
        if (status != AMQP_STATUS_OK) drop();
    }

    /// Reads and dispatches one frame (waiting up to @p timeout): a delivery is buffered, a
    /// confirm recorded, a channel or connection close handled (and thrown). false on timeout.
    bool pump(std::chrono::milliseconds timeout) {
        if (deliveries_.empty()) amqp_maybe_release_buffers(state_);
        amqp_frame_t frame{};
        timeval tv = detail::to_timeval(timeout);
        const int status = amqp_simple_wait_frame_noblock(state_, &frame, &tv);
        if (status == AMQP_STATUS_TIMEOUT) return false;
        if (status != AMQP_STATUS_OK) lost("reading a frame", status);
        if (frame.frame_type != AMQP_FRAME_METHOD) return true;  // stray content: ignore
        const std::uint16_t channel = frame.channel;
        switch (frame.payload.method.id) {
            case AMQP_BASIC_DELIVER_METHOD: {
                const auto* d =
                    static_cast<const amqp_basic_deliver_t*>(frame.payload.method.decoded);
                Message m;
                m.consumer_tag = detail::string_of(d->consumer_tag);
                m.delivery_tag = d->delivery_tag;
                m.redelivered = d->redelivered != 0;
                m.exchange = detail::string_of(d->exchange);
                m.routing_key = detail::string_of(d->routing_key);
                m.channel = channel;
                read_content(channel, &m);
                auto found = channels_.find(channel);
                if (found == channels_.end()) return true;  // a channel we closed meanwhile
                m.channel_epoch = found->second.epoch;
                deliveries_.push_back(std::move(m));
                return true;
            }
            case AMQP_BASIC_ACK_METHOD:
            case AMQP_BASIC_NACK_METHOD: {
                const bool ack = frame.payload.method.id == AMQP_BASIC_ACK_METHOD;
                std::uint64_t tag = 0;
                bool multiple = false;
                if (ack) {
                    const auto* a =
                        static_cast<const amqp_basic_ack_t*>(frame.payload.method.decoded);
                    tag = a->delivery_tag;
                    multiple = a->multiple != 0;
                } else {
                    const auto* n =
                        static_cast<const amqp_basic_nack_t*>(frame.payload.method.decoded);
                    tag = n->delivery_tag;
                    multiple = n->multiple != 0;
                }
                auto found = channels_.find(channel);
                if (found != channels_.end()) found->second.record_confirm(ack, tag, multiple);
                return true;
            }
            case AMQP_BASIC_RETURN_METHOD: {
                Message ignored;
                read_content(channel, &ignored);
                auto found = channels_.find(channel);
                if (found != channels_.end()) found->second.returned = true;
                return true;
            }
            case AMQP_BASIC_CANCEL_METHOD: {
                // The broker cancelled our consumer (its queue was deleted): the channel is
                // of no use to the consumer any more; close it and say so.
                close_channel(channel);
                throw channel_error(0, fmt::format("idem::rabbitmq: the broker cancelled the "
                                                   "consumer on channel {} of {}",
                                                   channel, endpoint_.describe()));
            }
            case AMQP_CHANNEL_CLOSE_METHOD: {
                // A channel we no longer have: the broker repeated its close (a consumer timeout
                // is re-sent every tick until the close-ok arrives) and we have answered once;
                // a second close-ok would be a connection error.
                if (channels_.count(channel) == 0) return true;
                const auto* m =
                    static_cast<const amqp_channel_close_t*>(frame.payload.method.decoded);
                const std::uint16_t code = m->reply_code;
                const std::string text = detail::string_of(m->reply_text);
                closed_by_broker(channel);
                throw channel_error(code, fmt::format("idem::rabbitmq: the broker closed channel "
                                                      "{} of {}: {} {}",
                                                      channel, endpoint_.describe(), code, text));
            }
            case AMQP_CONNECTION_CLOSE_METHOD: {
                const auto* m =
                    static_cast<const amqp_connection_close_t*>(frame.payload.method.decoded);
                const std::string why =
                    fmt::format("{} {}", m->reply_code, detail::string_of(m->reply_text));
                amqp_connection_close_ok_t ok{};
                (void)amqp_send_method(state_, 0, AMQP_CONNECTION_CLOSE_OK_METHOD, &ok);
                drop();
                throw broker_unavailable(
                    fmt::format("idem::rabbitmq: the broker closed the "
                                "connection to {}: {}",
                                endpoint_.describe(), why));
            }
            default:
                return true;
        }
    }

    /// The content (header and body frames) after a basic.deliver or basic.return.
    void read_content(std::uint16_t channel, Message* into) {
        amqp_message_t message{};
        const amqp_rpc_reply_t r = amqp_read_message(state_, channel, &message, 0);
        if (r.reply_type != AMQP_RESPONSE_NORMAL) {
            const std::string why = detail::describe_reply(r);
            drop();
            throw broker_unavailable(
                fmt::format("idem::rabbitmq: reading a message from {} "
                            "failed: {} (connection dropped)",
                            endpoint_.describe(), why));
        }
        into->body = detail::string_of(message.body);
        into->properties = detail::properties_of(message.properties);
        if ((message.properties._flags & AMQP_BASIC_HEADERS_FLAG) != 0) {
            into->headers = detail::table_of(message.properties.headers);
            try {
                into->encoded_headers = detail::encode(message.properties.headers);
            } catch (...) {
                amqp_destroy_message(&message);
                throw;
            }
        }
        amqp_destroy_message(&message);
    }

    Endpoint endpoint_;
    amqp_connection_state_t state_ = nullptr;
    std::uint64_t connection_epoch_ = 0;
    std::uint64_t channel_epochs_ = 0;  ///< never reused, across reconnects too
    std::map<std::uint16_t, ChannelState> channels_;
    std::deque<Message> deliveries_;  ///< read while waiting for something else
};

}  // namespace rabbitmq
IDEM_END_NAMESPACE
