#pragma once
/// @file
/// @brief idem::nats stream and consumer management for tests, examples and set-up code:
/// create (or find) a stream and a durable pull consumer with explicit acks, read a consumer's
/// state (AckWait, MaxDeliver, NumAckPending) and a stream's (messages, subjects), delete a
/// stream. Link idem::nats.

#include <nats/nats.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/nats/connection.hpp"
#include "idem/nats/error.hpp"

IDEM_BEGIN_NAMESPACE
namespace nats {

/// @brief A stream to create: its name, the subjects it captures, where it keeps messages.
struct StreamSpec {
    /// The stream's name.
    std::string name;
    std::vector<std::string> subjects;  ///< empty: the name is the only subject
    bool memory_storage = false;        ///< false: the file store (survives a server restart)
    /// How long the stream remembers Nats-Msg-Ids to drop a second publish; 0: the server's
    /// default (2 minutes).
    std::chrono::milliseconds duplicate_window{0};
};

/// @brief A durable pull consumer to create, with explicit acks.
struct ConsumerSpec {
    /// The stream it reads.
    std::string stream;
    /// Its durable name.
    std::string durable;
    std::string filter_subject{};  ///< empty: every subject of the stream
    /// The visibility timeout: a delivery not acked (nor +WPI'd) within it is redelivered.
    std::chrono::milliseconds ack_wait{30000};
    /// Deliveries before the server gives up on a message by itself; -1: never. Keep it -1 (or
    /// above the handler's max_deliveries) with idem: the handler dead-letters at its limit, and
    /// a message the server stopped delivering is stuck, neither handled nor parked.
    std::int64_t max_deliver = -1;
    /// Deliveries handed out and not yet acked, at most; -1: the server's default (1000).
    std::int64_t max_ack_pending = -1;
    /// BackOff: how long delivery n waits for its ack before the server delivers it again is
    /// backoff[n − 1] (the last entry for every later one), instead of ack_wait. Empty: ack_wait
    /// for every delivery. The server (2.9) then requires a max_deliver above its length, not −1.
    std::vector<std::chrono::milliseconds> backoff{};
};

/// @brief A consumer's configuration and state, as the server reports it.
struct ConsumerState {
    /// The stream it reads.
    std::string stream;
    /// Its (durable) name.
    std::string name;
    bool pull = false;          ///< a pull consumer (no deliver subject)
    bool explicit_ack = false;  ///< AckPolicy explicit
    /// Its AckWait: the visibility timeout.
    std::chrono::milliseconds ack_wait{0};
    /// Its MaxDeliver; -1: unlimited.
    std::int64_t max_deliver = -1;
    /// Its BackOff (ConsumerSpec::backoff); empty: AckWait for every delivery.
    std::vector<std::chrono::milliseconds> backoff;
    /// Empty: every subject of the stream.
    std::string filter_subject;
    std::int64_t num_ack_pending = 0;    ///< delivered, not yet acked or terminated
    std::int64_t num_redelivered = 0;    ///< of those, delivered more than once
    std::uint64_t num_pending = 0;       ///< not yet delivered
    std::uint64_t ack_floor_stream = 0;  ///< every stream sequence up to it is acked
};

/// @brief A stream's subjects and message count.
struct StreamState {
    /// The stream's name.
    std::string name;
    /// The subjects it captures.
    std::vector<std::string> subjects;
    /// Messages it holds now.
    std::uint64_t messages = 0;
    /// The sequence of its oldest message.
    std::uint64_t first_sequence = 0;
    /// The sequence of its newest message.
    std::uint64_t last_sequence = 0;
};

namespace detail {

struct StreamInfoFree {
    void operator()(jsStreamInfo* p) const noexcept { jsStreamInfo_Destroy(p); }
};
struct ConsumerInfoFree {
    void operator()(jsConsumerInfo* p) const noexcept { jsConsumerInfo_Destroy(p); }
};

inline jsOptions request_options(const Connection& connection) {
    jsOptions options;
    check(jsOptions_Init(&options), "JetStream options");
    options.Wait = connection.endpoint().request_timeout.count();
    return options;
}

inline StreamState stream_state_of(const jsStreamInfo& info) {
    StreamState out;
    if (info.Config != nullptr) {
        if (info.Config->Name != nullptr) out.name = info.Config->Name;
        for (int i = 0; i < info.Config->SubjectsLen; ++i)
            out.subjects.emplace_back(info.Config->Subjects[i]);
    }
    out.messages = info.State.Msgs;
    out.first_sequence = info.State.FirstSeq;
    out.last_sequence = info.State.LastSeq;
    return out;
}

inline ConsumerState consumer_state_of(const jsConsumerInfo& info) {
    ConsumerState out;
    if (info.Stream != nullptr) out.stream = info.Stream;
    if (info.Name != nullptr) out.name = info.Name;
    if (info.Config != nullptr) {
        const jsConsumerConfig& c = *info.Config;
        out.pull = c.DeliverSubject == nullptr || *c.DeliverSubject == '\0';
        out.explicit_ack = c.AckPolicy == js_AckExplicit;
        out.ack_wait = std::chrono::duration_cast<std::chrono::milliseconds>(
            std::chrono::nanoseconds(c.AckWait));
        out.max_deliver = c.MaxDeliver;
        for (int i = 0; c.BackOff != nullptr && i < c.BackOffLen; ++i) {
            out.backoff.push_back(std::chrono::duration_cast<std::chrono::milliseconds>(
                std::chrono::nanoseconds(c.BackOff[i])));
        }
        if (c.FilterSubject != nullptr) out.filter_subject = c.FilterSubject;
    }
    out.num_ack_pending = info.NumAckPending;
    out.num_redelivered = info.NumRedelivered;
    out.num_pending = info.NumPending;
    out.ack_floor_stream = info.AckFloor.Stream;
    return out;
}

}  // namespace detail

/// @brief Creates the stream, or finds it when one of that name exists with the same
/// configuration. @throws nats::error when it exists with another configuration.
inline StreamState ensure_stream(Connection& connection, const StreamSpec& spec) {
    jsStreamConfig config;
    detail::check(jsStreamConfig_Init(&config), "stream config");
    config.Name = spec.name.c_str();
    std::vector<const char*> subjects;
    for (const auto& subject : spec.subjects)
        subjects.push_back(subject.c_str());
    config.Subjects = subjects.empty() ? nullptr : subjects.data();
    config.SubjectsLen = static_cast<int>(subjects.size());
    config.Storage = spec.memory_storage ? js_MemoryStorage : js_FileStorage;
    if (spec.duplicate_window.count() > 0) {
        config.Duplicates =
            std::chrono::duration_cast<std::chrono::nanoseconds>(spec.duplicate_window).count();
    }
    jsOptions options = detail::request_options(connection);
    jsStreamInfo* raw = nullptr;
    jsErrCode js_code = static_cast<jsErrCode>(0);
    const natsStatus status =
        js_AddStream(&raw, connection.jetstream(), &config, &options, &js_code);
    std::unique_ptr<jsStreamInfo, detail::StreamInfoFree> info{raw};
    detail::check(status, fmt::format("add stream {}", spec.name), static_cast<int>(js_code));
    return info ? detail::stream_state_of(*info) : StreamState{spec.name, spec.subjects};
}

/// @brief Creates the durable pull consumer (explicit acks, deliver all), or finds it when one
/// of that name exists with the same configuration. @throws nats::error when it exists with
/// another configuration, nats::not_found when the stream does not exist.
inline ConsumerState ensure_pull_consumer(Connection& connection, const ConsumerSpec& spec) {
    jsConsumerConfig config;
    detail::check(jsConsumerConfig_Init(&config), "consumer config");
    config.Durable = spec.durable.c_str();
    config.AckPolicy = js_AckExplicit;
    config.DeliverPolicy = js_DeliverAll;
    config.AckWait = std::chrono::duration_cast<std::chrono::nanoseconds>(spec.ack_wait).count();
    config.MaxDeliver = spec.max_deliver;
    if (spec.max_ack_pending > 0) config.MaxAckPending = spec.max_ack_pending;
    if (!spec.filter_subject.empty()) config.FilterSubject = spec.filter_subject.c_str();
    std::vector<int64_t> backoff;
    for (const std::chrono::milliseconds wait : spec.backoff)
        backoff.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(wait).count());
    config.BackOff = backoff.empty() ? nullptr : backoff.data();
    config.BackOffLen = static_cast<int>(backoff.size());
    jsOptions options = detail::request_options(connection);
    jsConsumerInfo* raw = nullptr;
    jsErrCode js_code = static_cast<jsErrCode>(0);
    const natsStatus status = js_AddConsumer(&raw, connection.jetstream(), spec.stream.c_str(),
                                             &config, &options, &js_code);
    std::unique_ptr<jsConsumerInfo, detail::ConsumerInfoFree> info{raw};
    detail::check(status, fmt::format("add consumer {} to stream {}", spec.durable, spec.stream),
                  static_cast<int>(js_code));
    return detail::consumer_state_of(*info);
}

/// @brief The consumer's configuration and state. @throws nats::not_found, nats::unavailable.
inline ConsumerState consumer_state(Connection& connection, const std::string& stream,
                                    const std::string& durable) {
    jsOptions options = detail::request_options(connection);
    jsConsumerInfo* raw = nullptr;
    jsErrCode js_code = static_cast<jsErrCode>(0);
    const natsStatus status = js_GetConsumerInfo(&raw, connection.jetstream(), stream.c_str(),
                                                 durable.c_str(), &options, &js_code);
    std::unique_ptr<jsConsumerInfo, detail::ConsumerInfoFree> info{raw};
    detail::check(status, fmt::format("consumer info of {} on stream {}", durable, stream),
                  static_cast<int>(js_code));
    return detail::consumer_state_of(*info);
}

/// @brief The stream's subjects and message count. @throws nats::not_found, unavailable.
inline StreamState stream_state(Connection& connection, const std::string& stream) {
    jsOptions options = detail::request_options(connection);
    jsStreamInfo* raw = nullptr;
    jsErrCode js_code = static_cast<jsErrCode>(0);
    const natsStatus status =
        js_GetStreamInfo(&raw, connection.jetstream(), stream.c_str(), &options, &js_code);
    std::unique_ptr<jsStreamInfo, detail::StreamInfoFree> info{raw};
    detail::check(status, fmt::format("stream info of {}", stream), static_cast<int>(js_code));
    return detail::stream_state_of(*info);
}

/// @brief A message as the stream stores it (read by sequence, not delivered: no ack).
struct StoredMessage {
    /// The subject it was published on.
    std::string subject;
    /// Its payload.
    std::string data;
    /// Its headers, in order (a name may repeat).
    Headers headers;

    /// The first value of header @p name (case-sensitive), if any.
    [[nodiscard]] std::optional<std::string_view> header(std::string_view name) const {
        for (const auto& [key, value] : headers) {
            if (key == name) return std::string_view(value);
        }
        return std::nullopt;
    }
};

/// @brief The message at @p sequence of @p stream (js_GetMsg); nothing when there is none
/// (deleted, or past the end). @throws nats::unavailable, nats::error.
inline std::optional<StoredMessage> stream_message(Connection& connection,
                                                   const std::string& stream,
                                                   std::uint64_t sequence) {
    jsOptions options = detail::request_options(connection);
    natsMsg* raw = nullptr;
    jsErrCode js_code = static_cast<jsErrCode>(0);
    const natsStatus status =
        js_GetMsg(&raw, connection.jetstream(), stream.c_str(), sequence, &options, &js_code);
    detail::MsgPtr msg{raw};
    if (status == NATS_NOT_FOUND || js_code == JSNoMessageFoundErr) return std::nullopt;
    detail::check(status, fmt::format("get message {} of stream {}", sequence, stream),
                  static_cast<int>(js_code));
    StoredMessage out;
    if (const char* subject = natsMsg_GetSubject(msg.get())) out.subject = subject;
    const char* data = natsMsg_GetData(msg.get());
    const int size = natsMsg_GetDataLength(msg.get());
    if (data != nullptr && size > 0) out.data.assign(data, static_cast<std::size_t>(size));
    out.headers = detail::headers_of(msg.get());
    return out;
}

/// @brief Deletes the stream (and its consumers); false when there was none.
inline bool delete_stream(Connection& connection, const std::string& stream) {
    jsOptions options = detail::request_options(connection);
    jsErrCode js_code = static_cast<jsErrCode>(0);
    const natsStatus status =
        js_DeleteStream(connection.jetstream(), stream.c_str(), &options, &js_code);
    if (status == NATS_NOT_FOUND || js_code == JSStreamNotFoundErr) return false;
    detail::check(status, fmt::format("delete stream {}", stream), static_cast<int>(js_code));
    return true;
}

/// @brief Whether NATS subject @p pattern (tokens separated by '.', '*' one token, '>' the
/// rest) matches @p subject.
[[nodiscard]] inline bool subject_matches(std::string_view pattern, std::string_view subject) {
    auto next = [](std::string_view& s) {
        const std::size_t dot = s.find('.');
        std::string_view token = s.substr(0, dot);
        s = dot == std::string_view::npos ? std::string_view() : s.substr(dot + 1);
        return token;
    };
    bool more_pattern = !pattern.empty();
    bool more_subject = !subject.empty();
    while (more_pattern && more_subject) {
        const bool pattern_last = pattern.find('.') == std::string_view::npos;
        const bool subject_last = subject.find('.') == std::string_view::npos;
        const std::string_view p = next(pattern);
        const std::string_view s = next(subject);
        if (p == ">") return true;
        if (p != "*" && p != s) return false;
        more_pattern = !pattern_last;
        more_subject = !subject_last;
    }
    return more_pattern == more_subject;
}

}  // namespace nats
IDEM_END_NAMESPACE
