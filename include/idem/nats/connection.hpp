#pragma once
/// @file
/// @brief idem::nats::Connection: one cnats connection and its JetStream context (connect,
/// reconnects, timeouts), and JetStream publishing with headers that waits for the stream's pub
/// ack. Used by the JetStream consumer (broker/nats_jetstream.hpp), its tests and examples; users
/// may use it for their own publishing. Link idem::nats.

#include <nats/nats.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/dead_letter_envelope.hpp"
#include "idem/error.hpp"
#include "idem/nats/error.hpp"

IDEM_BEGIN_NAMESPACE
namespace nats {

/// @brief A header of a NATS message (a name may repeat).
using Header = std::pair<std::string, std::string>;
/// @brief A message's headers, in order.
using Headers = std::vector<Header>;

/// @brief Where a Connection goes and how patient it is.
struct Endpoint {
    /// One server URL or several, comma-separated ("nats://a:4222,nats://b:4222").
    std::string url = "nats://127.0.0.1:4222";
    /// The connection's name, as the server shows it (monitoring, logs); empty: none.
    std::string name{};
    /// How long connecting (and each reconnect attempt) may take.
    std::chrono::milliseconds connect_timeout{2000};
    /// How long a JetStream request may take: stream and consumer calls, the pub ack of a
    /// publish, a synchronous ack (AckSync) and its siblings.
    std::chrono::milliseconds request_timeout{5000};
    /// The pause between reconnect attempts after the connection was lost.
    std::chrono::milliseconds reconnect_wait{200};
    /// Reconnect attempts before the connection is closed for good; -1: forever (the default: a
    /// restarted server is picked up however long it was away).
    int max_reconnect = -1;

    /// For messages: the URL and, when set, the name.
    [[nodiscard]] std::string describe() const {
        return name.empty() ? url : fmt::format("{} ({})", url, name);
    }
};

/// The header a JetStreamSender gives every message its idempotency key in; a JetStreamConsumer
/// takes a message's id from it before its id_field. It is Nats-Msg-Id's value too, but for a
/// message the stream would drop as a duplicate of another (see JetStreamSender).
inline constexpr const char* message_id_header = envelope::message_id;
/// The header naming the outbox intent (row id and time) a JetStreamSender published a message
/// for: a duplicate PubAck whose stored message has another is not this intent's resend.
inline constexpr const char* outbox_mark_header = "idem-outbox-mark";

/// @brief What the stream answered to a publish.
struct PubAck {
    std::string stream;          ///< the stream that stored the message
    std::uint64_t sequence = 0;  ///< its sequence in that stream
    bool duplicate = false;      ///< the stream had it already (same Nats-Msg-Id in its window)
};

namespace detail {

struct OptionsFree {
    void operator()(natsOptions* o) const noexcept { natsOptions_Destroy(o); }
};
struct ConnectionFree {
    void operator()(natsConnection* c) const noexcept { natsConnection_Destroy(c); }
};
struct ContextFree {
    void operator()(jsCtx* js) const noexcept { jsCtx_Destroy(js); }
};
struct MsgFree {
    void operator()(natsMsg* m) const noexcept { natsMsg_Destroy(m); }
};
struct PubAckFree {
    void operator()(jsPubAck* p) const noexcept { jsPubAck_Destroy(p); }
};

using MsgPtr = std::unique_ptr<natsMsg, MsgFree>;

/// A header value as one line: CR and LF would end the header block (the protocol has no
/// escape for them), so they become spaces.
inline std::string header_line(std::string_view value) {
    std::string out(value);
    for (char& c : out) {
        if (c == '\r' || c == '\n') c = ' ';
    }
    return out;
}

/// A message to publish: @p subject, @p data and @p headers.
inline MsgPtr make_message(const std::string& subject, std::string_view data,
                           const Headers& headers) {
    natsMsg* raw = nullptr;
    check(
        natsMsg_Create(&raw, subject.c_str(), nullptr, data.data(), static_cast<int>(data.size())),
        fmt::format("create a message on {}", subject));
    MsgPtr msg{raw};
    for (const auto& [name, value] : headers) {
        check(natsMsgHeader_Add(msg.get(), name.c_str(), header_line(value).c_str()),
              fmt::format("header {} of a message on {}", name, subject));
    }
    return msg;
}

struct FreeArray {
    void operator()(const char** p) const noexcept {
        std::free(static_cast<void*>(const_cast<char**>(p)));
    }
};

/// Every header of @p msg, in order (a name with several values once per value). Not
/// thread-safe (cnats parses headers lazily): call it from the thread that owns the message.
inline Headers headers_of(natsMsg* msg) {
    Headers out;
    const char** keys = nullptr;
    int count = 0;
    const natsStatus status = natsMsgHeader_Keys(msg, &keys, &count);
    if (status == NATS_NOT_FOUND || keys == nullptr) return out;  // no headers
    std::unique_ptr<const char*, FreeArray> key_array{keys};
    check(status, "read the headers of a message");
    for (int i = 0; i < count; ++i) {
        const char** values = nullptr;
        int value_count = 0;
        if (natsMsgHeader_Values(msg, keys[i], &values, &value_count) != NATS_OK ||
            values == nullptr) {
            out.emplace_back(keys[i], std::string());
            continue;
        }
        std::unique_ptr<const char*, FreeArray> value_array{values};
        for (int k = 0; k < value_count; ++k)
            out.emplace_back(keys[i], values[k] != nullptr ? values[k] : "");
    }
    return out;
}

}  // namespace detail

/// @brief One connection to a NATS server (or cluster) with its JetStream context.
///
/// cnats reconnects by itself after a lost connection (Endpoint::reconnect_wait,
/// max_reconnect); while it is away, calls fail with nats::unavailable or nats::timeout and the
/// subscriptions come back with the connection. The connection is thread-safe (cnats').
class Connection {
  public:
    /// @brief Connects (once; reconnects are cnats').
    /// @throws nats::unavailable when no server answers, nats::error for a bad URL.
    explicit Connection(Endpoint endpoint) : endpoint_(std::move(endpoint)) {
        natsOptions* raw_options = nullptr;
        detail::check(natsOptions_Create(&raw_options), "create connection options");
        std::unique_ptr<natsOptions, detail::OptionsFree> options{raw_options};
        const std::string where = endpoint_.describe();
        detail::check(natsOptions_SetURL(options.get(), endpoint_.url.c_str()),
                      fmt::format("URL {}", endpoint_.url));
        if (!endpoint_.name.empty()) {
            detail::check(natsOptions_SetName(options.get(), endpoint_.name.c_str()), "name");
        }
        detail::check(natsOptions_SetTimeout(options.get(), endpoint_.connect_timeout.count()),
                      "connect timeout");
        detail::check(natsOptions_SetAllowReconnect(options.get(), true), "allow reconnect");
        detail::check(natsOptions_SetMaxReconnect(options.get(), endpoint_.max_reconnect),
                      "max reconnect");
        detail::check(natsOptions_SetReconnectWait(options.get(), endpoint_.reconnect_wait.count()),
                      "reconnect wait");
        natsConnection* raw_connection = nullptr;
        detail::check(natsConnection_Connect(&raw_connection, options.get()),
                      fmt::format("connect to {}", where));
        connection_.reset(raw_connection);
        jsOptions js_options;
        detail::check(jsOptions_Init(&js_options), "JetStream options");
        js_options.Wait = endpoint_.request_timeout.count();
        jsCtx* raw_js = nullptr;
        detail::check(natsConnection_JetStream(&raw_js, connection_.get(), &js_options),
                      fmt::format("JetStream context on {}", where));
        js_.reset(raw_js);
    }

    Connection(const Connection&) = delete;
    Connection& operator=(const Connection&) = delete;

    /// Closes the connection (pending acks in cnats' buffer are flushed first, best effort).
    ~Connection() {
        js_.reset();
        if (connection_) natsConnection_Close(connection_.get());
    }

    /// @brief The server(s) and settings it was made with.
    [[nodiscard]] const Endpoint& endpoint() const noexcept { return endpoint_; }
    /// @brief The cnats connection, for calls idem does not wrap; owned by this object.
    [[nodiscard]] natsConnection* native() const noexcept { return connection_.get(); }
    /// @brief The cnats JetStream context on this connection; owned by this object.
    [[nodiscard]] jsCtx* jetstream() const noexcept { return js_.get(); }

    /// True while connected (not while cnats is reconnecting, not once closed).
    [[nodiscard]] bool connected() const noexcept {
        return natsConnection_Status(connection_.get()) == NATS_CONN_STATUS_CONNECTED;
    }
    /// True once closed for good (max_reconnect attempts failed): make a new Connection.
    [[nodiscard]] bool closed() const noexcept {
        return natsConnection_IsClosed(connection_.get());
    }
    /// Times cnats reconnected after losing the connection (its statistics); 0 if unknown.
    [[nodiscard]] std::uint64_t reconnects() const noexcept {
        natsStatistics* raw = nullptr;
        if (natsStatistics_Create(&raw) != NATS_OK) return 0;
        std::uint64_t in_msgs = 0, in_bytes = 0, out_msgs = 0, out_bytes = 0, reconnects = 0;
        if (natsConnection_GetStats(connection_.get(), raw) != NATS_OK ||
            natsStatistics_GetCounts(raw, &in_msgs, &in_bytes, &out_msgs, &out_bytes,
                                     &reconnects) != NATS_OK) {
            reconnects = 0;
        }
        natsStatistics_Destroy(raw);
        return reconnects;
    }

    /// @brief Publishes to JetStream and waits for the stream's pub ack (Endpoint::
    /// request_timeout). @p msg_id: the Nats-Msg-Id (the stream drops a second publish with the
    /// same id within its duplicate window); empty: none.
    /// @throws nats::unavailable (no stream captures @p subject: no responders; or the server is
    /// away), nats::timeout (it may have been stored), nats::error (refused).
    PubAck publish(const std::string& subject, std::string_view data, const Headers& headers = {},
                   const std::string& msg_id = {}) {
        detail::MsgPtr msg = detail::make_message(subject, data, headers);
        jsPubOptions options;
        detail::check(jsPubOptions_Init(&options), "publish options");
        options.MaxWait = endpoint_.request_timeout.count();
        if (!msg_id.empty()) options.MsgId = msg_id.c_str();
        jsPubAck* raw_ack = nullptr;
        jsErrCode js_code = static_cast<jsErrCode>(0);
        const natsStatus status = js_PublishMsg(&raw_ack, js_.get(), msg.get(), &options, &js_code);
        std::unique_ptr<jsPubAck, detail::PubAckFree> ack{raw_ack};
        detail::check(status, fmt::format("publish to {} on {}", subject, endpoint_.describe()),
                      static_cast<int>(js_code));
        PubAck out;
        if (ack) {
            out.stream = ack->Stream != nullptr ? ack->Stream : "";
            out.sequence = ack->Sequence;
            out.duplicate = ack->Duplicate;
        }
        return out;
    }

  private:
    Endpoint endpoint_;
    std::unique_ptr<natsConnection, detail::ConnectionFree> connection_;
    std::unique_ptr<jsCtx, detail::ContextFree> js_;
};

}  // namespace nats
IDEM_END_NAMESPACE
