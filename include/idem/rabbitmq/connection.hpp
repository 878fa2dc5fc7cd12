#pragma once
/// @file
/// @brief idem::rabbitmq::Connection: one AMQP 0-9-1 connection to RabbitMQ through rabbitmq-c
/// (the only idem header that includes it), with numbered channels, the queue and exchange
/// methods a consumer needs, manual acks, and publishes that wait for the publisher confirm.
/// Link idem::rabbitmq.
///
/// Failures are typed (idem/error.hpp): the connection lost or refused, or no answer within
/// rpc_timeout → broker_unavailable (the connection is dropped, a timed-out method's effect is
/// unknown; connect() again), the broker closing one channel (a missing queue,
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

#if __has_include(<rabbitmq-c/amqp.h>)
#include <rabbitmq-c/amqp.h>  // rabbitmq-c 0.12 and later
#include <rabbitmq-c/tcp.h>
#else
#include <amqp.h>  // rabbitmq-c 0.11 (Debian 12's librabbitmq-dev)
#include <amqp_tcp_socket.h>
#endif
#include <sys/time.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/rabbitmq/endpoint.hpp"
#include "idem/rabbitmq/message.hpp"

IDEM_BEGIN_NAMESPACE
namespace rabbitmq {

/// AMQP reply codes idem tells apart.
inline constexpr std::uint16_t reply_not_found = 404;
inline constexpr std::uint16_t reply_resource_locked = 405;
inline constexpr std::uint16_t reply_precondition_failed = 406;

/// @brief The broker closed a channel (channel.close): the channel is gone, the connection is
/// not. reply_code is the AMQP code (404 NOT_FOUND, 406 PRECONDITION_FAILED, ...), 0 for a
/// consumer the broker cancelled (basic.cancel: its queue was deleted).
class channel_error : public broker_error {
  public:
    channel_error(std::uint16_t reply_code, const std::string& what)
        : broker_error(what), reply_code_(reply_code) {}
    [[nodiscard]] std::uint16_t reply_code() const noexcept { return reply_code_; }

  private:
    std::uint16_t reply_code_;
};

/// @brief How a queue is declared (queue.declare).
struct QueueDeclare {
    bool passive = false;  ///< only check that it exists (arguments are then ignored by the broker)
    bool durable = true;
    bool exclusive = false;
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
    std::string routing_key{};
    Properties properties{};
    /// Headers in AMQP wire encoding (Message::encoded_headers), sent first...
    std::string encoded_headers{};
    /// ...then these, replacing entries of the same name.
    Table headers{};
    /// Ask the broker to return a message no queue takes (then the confirm fails).
    bool mandatory = true;
};

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

/// Owns an amqp_pool_t (the memory decoded tables live in).
class Pool {
  public:
    Pool() { init_amqp_pool(&pool_, 4096); }
    ~Pool() { empty_amqp_pool(&pool_); }
    Pool(const Pool&) = delete;
    Pool& operator=(const Pool&) = delete;
    amqp_pool_t* get() noexcept { return &pool_; }

  private:
    amqp_pool_t pool_{};
};

inline FieldValue field_value_of(const amqp_field_value_t& v) {
    switch (v.kind) {
        case AMQP_FIELD_KIND_BOOLEAN:
            return v.value.boolean != 0;
        case AMQP_FIELD_KIND_I8:
            return std::int64_t{v.value.i8};
        case AMQP_FIELD_KIND_U8:
            return std::int64_t{v.value.u8};
        case AMQP_FIELD_KIND_I16:
            return std::int64_t{v.value.i16};
        case AMQP_FIELD_KIND_U16:
            return std::int64_t{v.value.u16};
        case AMQP_FIELD_KIND_I32:
            return std::int64_t{v.value.i32};
        case AMQP_FIELD_KIND_U32:
            return std::int64_t{v.value.u32};
        case AMQP_FIELD_KIND_I64:
            return std::int64_t{v.value.i64};
        case AMQP_FIELD_KIND_U64:
        case AMQP_FIELD_KIND_TIMESTAMP:
            return static_cast<std::int64_t>(v.value.u64);
        case AMQP_FIELD_KIND_F32:
            return static_cast<double>(v.value.f32);
        case AMQP_FIELD_KIND_F64:
            return v.value.f64;
        case AMQP_FIELD_KIND_UTF8:
        case AMQP_FIELD_KIND_BYTES:
            return string_of(v.value.bytes);
        default:
            return std::monostate{};
    }
}

inline Table table_of(const amqp_table_t& t) {
    Table out;
    out.reserve(static_cast<std::size_t>(t.num_entries));
    for (int i = 0; i < t.num_entries; ++i) {
        out.emplace_back(string_of(t.entries[i].key), field_value_of(t.entries[i].value));
    }
    return out;
}

/// An amqp_table_t pointing into @p table's strings (valid while @p table and @p entries live).
inline amqp_table_t to_amqp(const Table& table, std::vector<amqp_table_entry_t>& entries) {
    entries.clear();
    entries.reserve(table.size());
    for (const auto& [key, value] : table) {
        amqp_table_entry_t e{};
        e.key = bytes_of(key);
        if (std::holds_alternative<bool>(value)) {
            e.value.kind = AMQP_FIELD_KIND_BOOLEAN;
            e.value.value.boolean = std::get<bool>(value) ? 1 : 0;
        } else if (std::holds_alternative<std::int64_t>(value)) {
            e.value.kind = AMQP_FIELD_KIND_I64;
            e.value.value.i64 = std::get<std::int64_t>(value);
        } else if (std::holds_alternative<double>(value)) {
            e.value.kind = AMQP_FIELD_KIND_F64;
            e.value.value.f64 = std::get<double>(value);
        } else if (std::holds_alternative<std::string>(value)) {
            e.value.kind = AMQP_FIELD_KIND_UTF8;
            e.value.value.bytes = bytes_of(std::get<std::string>(value));
        } else {
            e.value.kind = AMQP_FIELD_KIND_VOID;
        }
        entries.push_back(e);
    }
    amqp_table_t t;
    t.num_entries = static_cast<int>(entries.size());
    t.entries = entries.empty() ? nullptr : entries.data();
    return t;
}

/// @p table in AMQP wire encoding (what Message::encoded_headers holds).
inline std::string encode(amqp_table_t table) {
    std::string buffer(4096, '\0');
    for (;;) {
        std::size_t offset = 0;
        const int status = amqp_encode_table(bytes_of(buffer), &table, &offset);
        if (status == AMQP_STATUS_OK) {
            buffer.resize(offset);
            return buffer;
        }
        if (status != AMQP_STATUS_TABLE_TOO_BIG || buffer.size() > (64u << 20)) {
            throw broker_error(fmt::format("idem::rabbitmq: encoding a header table failed: {}",
                                           amqp_error_string2(status)));
        }
        buffer.assign(buffer.size() * 2, '\0');
    }
}

inline Properties properties_of(const amqp_basic_properties_t& p) {
    Properties out;
    auto text = [&](amqp_flags_t flag, amqp_bytes_t bytes, std::optional<std::string>& into) {
        if ((p._flags & flag) != 0) into = string_of(bytes);
    };
    text(AMQP_BASIC_CONTENT_TYPE_FLAG, p.content_type, out.content_type);
    text(AMQP_BASIC_CONTENT_ENCODING_FLAG, p.content_encoding, out.content_encoding);
    text(AMQP_BASIC_MESSAGE_ID_FLAG, p.message_id, out.message_id);
    text(AMQP_BASIC_CORRELATION_ID_FLAG, p.correlation_id, out.correlation_id);
    text(AMQP_BASIC_TYPE_FLAG, p.type, out.type);
    text(AMQP_BASIC_APP_ID_FLAG, p.app_id, out.app_id);
    text(AMQP_BASIC_EXPIRATION_FLAG, p.expiration, out.expiration);
    if ((p._flags & AMQP_BASIC_TIMESTAMP_FLAG) != 0) out.timestamp = p.timestamp;
    if ((p._flags & AMQP_BASIC_DELIVERY_MODE_FLAG) != 0) out.delivery_mode = p.delivery_mode;
    if ((p._flags & AMQP_BASIC_PRIORITY_FLAG) != 0) out.priority = p.priority;
    return out;
}

}  // namespace detail

/// @brief One AMQP connection (see the file comment). Connects on connect(); the destructor
/// closes it politely and never throws.
class Connection {
  public:
    explicit Connection(Endpoint endpoint) : endpoint_(std::move(endpoint)) {}
    ~Connection() { close(); }
    Connection(const Connection&) = delete;
    Connection& operator=(const Connection&) = delete;

    [[nodiscard]] const Endpoint& endpoint() const noexcept { return endpoint_; }
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
            const std::string why = describe_reply(login);
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
        fill_properties(what, pool, props, entries);
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
    /// @throws broker_error when the broker nacks it or no queue takes it (returned),
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
            ChannelState& c = found->second;
            if (c.confirmed >= tag) {
                const bool nacked = c.nacked_from != 0 && c.nacked_from <= tag;
                const bool returned = c.returned;
                c.returned = false;
                c.nacked_from = 0;
                if (nacked) {
                    throw broker_error(fmt::format(
                        "idem::rabbitmq: the broker refused (nacked) a publish to exchange '{}' "
                        "routing key '{}'",
                        what.exchange, what.routing_key));
                }
                if (returned) {
                    throw broker_error(fmt::format(
                        "idem::rabbitmq: no queue is bound to exchange '{}' for routing key '{}': "
                        "the message was returned (bind a queue to it)",
                        what.exchange, what.routing_key));
                }
                return;
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
    struct ChannelState {
        std::uint64_t epoch = 0;
        bool confirms = false;
        std::uint64_t published = 0;    ///< publishes since confirm.select (their sequence)
        std::uint64_t confirmed = 0;    ///< every publish up to this one is acked or nacked
        std::uint64_t nacked_from = 0;  ///< the first nacked one not yet reported
        bool returned = false;          ///< a basic.return since the last reported confirm
    };

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

    static std::string describe_reply(const amqp_rpc_reply_t& r) {
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
                                       detail::string_of(m->reply_text));
                }
                if (r.reply.id == AMQP_CHANNEL_CLOSE_METHOD) {
                    const auto* m = static_cast<const amqp_channel_close_t*>(r.reply.decoded);
                    return fmt::format("channel closed by the broker: {} {}", m->reply_code,
                                       detail::string_of(m->reply_text));
                }
                return fmt::format("unexpected method 0x{:08x}", r.reply.id);
        }
        return "unknown reply";
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
            const std::string why = describe_reply(r);
            amqp_connection_close_ok_t ok{};
            (void)amqp_send_method(state_, 0, AMQP_CONNECTION_CLOSE_OK_METHOD, &ok);
            drop();
            throw broker_unavailable(
                fmt::format("idem::rabbitmq: {} on {}: {}", what, endpoint_.describe(), why));
        }
        const bool timeout = r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
                             r.library_error == AMQP_STATUS_TIMEOUT;
        const std::string why = describe_reply(r);
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
                if (found == channels_.end()) return true;
                ChannelState& c = found->second;
                if (!ack && c.nacked_from == 0) c.nacked_from = multiple ? c.confirmed + 1 : tag;
                // Confirms arrive in order on a channel; one for tag N (not multiple) with
                // earlier ones outstanding only happens for out-of-order confirms, which a
                // single outstanding publish (publish_confirmed()) never has.
                if (tag > c.confirmed) c.confirmed = tag;
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
            const std::string why = describe_reply(r);
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

    /// The properties of a publish (their strings point into @p what, the tables into @p pool
    /// and @p entries).
    static void fill_properties(const Publish& what, detail::Pool& pool,
                                amqp_basic_properties_t& props,
                                std::vector<amqp_table_entry_t>& entries) {
        const Properties& p = what.properties;
        props._flags = 0;
        auto text = [&](amqp_flags_t flag, const std::optional<std::string>& value,
                        amqp_bytes_t& into) {
            if (!value) return;
            props._flags |= flag;
            into = detail::bytes_of(*value);
        };
        text(AMQP_BASIC_CONTENT_TYPE_FLAG, p.content_type, props.content_type);
        text(AMQP_BASIC_CONTENT_ENCODING_FLAG, p.content_encoding, props.content_encoding);
        text(AMQP_BASIC_MESSAGE_ID_FLAG, p.message_id, props.message_id);
        text(AMQP_BASIC_CORRELATION_ID_FLAG, p.correlation_id, props.correlation_id);
        text(AMQP_BASIC_TYPE_FLAG, p.type, props.type);
        text(AMQP_BASIC_APP_ID_FLAG, p.app_id, props.app_id);
        text(AMQP_BASIC_EXPIRATION_FLAG, p.expiration, props.expiration);
        if (p.timestamp) {
            props._flags |= AMQP_BASIC_TIMESTAMP_FLAG;
            props.timestamp = *p.timestamp;
        }
        if (p.delivery_mode) {
            props._flags |= AMQP_BASIC_DELIVERY_MODE_FLAG;
            props.delivery_mode = *p.delivery_mode;
        }
        if (p.priority) {
            props._flags |= AMQP_BASIC_PRIORITY_FLAG;
            props.priority = *p.priority;
        }
        // Headers: the original encoded table, then ours (replacing entries of the same name).
        amqp_table_t original{};
        if (!what.encoded_headers.empty()) {
            std::size_t offset = 0;
            const int status = amqp_decode_table(detail::bytes_of(what.encoded_headers), pool.get(),
                                                 &original, &offset);
            if (status != AMQP_STATUS_OK) {
                throw broker_error(
                    fmt::format("idem::rabbitmq: the encoded headers do not decode: {}",
                                amqp_error_string2(status)));
            }
        }
        std::vector<amqp_table_entry_t> extra;
        const amqp_table_t ours = detail::to_amqp(what.headers, extra);
        if (original.num_entries == 0 && ours.num_entries == 0) return;
        entries.clear();
        for (int i = 0; i < original.num_entries; ++i) {
            const std::string key = detail::string_of(original.entries[i].key);
            if (find_field(what.headers, key) == nullptr) entries.push_back(original.entries[i]);
        }
        entries.insert(entries.end(), extra.begin(), extra.end());
        props._flags |= AMQP_BASIC_HEADERS_FLAG;
        props.headers.num_entries = static_cast<int>(entries.size());
        props.headers.entries = entries.data();
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
