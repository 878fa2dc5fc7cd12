#pragma once
/// @file
/// @brief idem::nats::Message: one JetStream message received through a pull subscription,
/// with its metadata (stream sequence, delivery count) and its acknowledgements: AckSync (the
/// double ack: the server confirms it), Nak, NakWithDelay, InProgress (+WPI) and Term.
/// Link idem::nats.

#include <nats/nats.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/nats/connection.hpp"
#include "idem/nats/error.hpp"

IDEM_BEGIN_NAMESPACE
namespace nats {

/// @brief What JetStream says about one delivery of a message (natsMsg_GetMetaData, parsed
/// from the message's ack subject).
struct Metadata {
    std::string stream;                 ///< the stream that holds it
    std::string consumer;               ///< the consumer that delivered it
    std::uint64_t stream_sequence = 0;  ///< its sequence in the stream: the same on every delivery
    std::uint64_t consumer_sequence = 0;  ///< this delivery's sequence in the consumer
    std::uint64_t num_delivered = 0;      ///< times delivered, this time included: 1, 2, 3 ...
    std::uint64_t num_pending = 0;        ///< messages left for the consumer after this one
    std::int64_t timestamp_ns = 0;        ///< when the stream stored it, ns since the epoch (UTC)
};

namespace detail {

/// The Metadata of cnats' parse of an ack subject (null strings read as empty).
inline Metadata metadata_of(const jsMsgMetaData& meta) {
    Metadata out;
    out.stream = meta.Stream != nullptr ? meta.Stream : "";
    out.consumer = meta.Consumer != nullptr ? meta.Consumer : "";
    out.stream_sequence = meta.Sequence.Stream;
    out.consumer_sequence = meta.Sequence.Consumer;
    out.num_delivered = meta.NumDelivered;
    out.num_pending = meta.NumPending;
    out.timestamp_ns = meta.Timestamp;
    return out;
}

/// The first value of header @p name of @p headers (case-sensitive), if any.
inline std::optional<std::string_view> first_header(const Headers& headers, std::string_view name) {
    for (const auto& [key, value] : headers) {
        if (key == name) return std::string_view(value);
    }
    return std::nullopt;
}

}  // namespace detail

/// @brief One received JetStream message. Move-only; owns the natsMsg. The subject, data,
/// headers and metadata are read once when it is made (cnats parses headers lazily and not
/// thread-safely); afterwards only the acknowledgements touch the natsMsg.
///
/// Every acknowledgement here is synchronous: it waits for the server's reply (up to the
/// Endpoint's request_timeout), so success means the server has it. A timeout is ambiguous (the
/// server may have it). Once acked, nacked or terminated, further acknowledgements are no-ops
/// (cnats remembers); in_progress() may repeat.
class Message {
  public:
    /// Takes @p msg (from a fetch). @throws nats::error when it is not a JetStream message,
    /// idem::usage_error when it is null.
    Message(natsMsg* msg, std::chrono::milliseconds request_timeout)
        : msg_(msg), request_timeout_(request_timeout) {
        if (msg_ == nullptr) throw idem::usage_error("idem::nats::Message: null natsMsg");
        const char* subject = natsMsg_GetSubject(msg_.get());
        subject_ = subject != nullptr ? subject : "";
        const char* data = natsMsg_GetData(msg_.get());
        const int size = natsMsg_GetDataLength(msg_.get());
        if (data != nullptr && size > 0) data_.assign(data, static_cast<std::size_t>(size));
        headers_ = detail::headers_of(msg_.get());
        jsMsgMetaData* raw = nullptr;
        detail::check(natsMsg_GetMetaData(&raw, msg_.get()),
                      fmt::format("metadata of a message on {}", subject_));
        std::unique_ptr<jsMsgMetaData, MetaFree> meta{raw};
        metadata_ = detail::metadata_of(*meta);
    }

    /// @brief Takes the other's natsMsg; the moved-from Message must not be acknowledged.
    Message(Message&&) noexcept = default;
    /// @brief Frees this natsMsg (if it was never acknowledged, the server delivers it again after
    /// AckWait) and takes the other's.
    Message& operator=(Message&&) noexcept = default;
    Message(const Message&) = delete;
    Message& operator=(const Message&) = delete;
    ~Message() = default;

    /// @brief The subject it was published on.
    [[nodiscard]] const std::string& subject() const noexcept { return subject_; }
    /// @brief Its payload.
    [[nodiscard]] const std::string& data() const noexcept { return data_; }
    /// @brief Its headers, in order (a name may repeat).
    [[nodiscard]] const Headers& headers() const noexcept { return headers_; }
    /// @brief Its JetStream metadata: stream, consumer, sequences, delivery count, timestamp.
    [[nodiscard]] const Metadata& metadata() const noexcept { return metadata_; }

    /// The first value of header @p name (case-sensitive, as cnats 3 is), if any.
    [[nodiscard]] std::optional<std::string_view> header(std::string_view name) const {
        return detail::first_header(headers_, name);
    }

    /// @brief +ACK, waiting for the server's confirmation (AckSync: the double ack).
    void ack_sync() {
        acknowledge("ack (AckSync)", [&](jsOptions* o, jsErrCode* code) {
            return natsMsg_AckSync(msg_.get(), o, code);
        });
    }
    /// @brief -NAK: redeliver now.
    void nak() {
        acknowledge("nak", [&](jsOptions* o, jsErrCode*) { return natsMsg_Nak(msg_.get(), o); });
    }
    /// @brief -NAK with a delay: redeliver after @p delay (at least 1 ms).
    void nak_with_delay(std::chrono::milliseconds delay) {
        const std::int64_t ms = std::max<std::int64_t>(1, delay.count());
        acknowledge("nak with delay", [&](jsOptions* o, jsErrCode*) {
            return natsMsg_NakWithDelay(msg_.get(), ms, o);
        });
    }
    /// @brief +WPI: still working on it; the server restarts the AckWait clock. May repeat.
    void in_progress() {
        acknowledge("in progress (+WPI)",
                    [&](jsOptions* o, jsErrCode*) { return natsMsg_InProgress(msg_.get(), o); });
    }
    /// @brief +TERM: never redeliver it, whatever MaxDeliver says.
    void term() {
        acknowledge("term", [&](jsOptions* o, jsErrCode*) { return natsMsg_Term(msg_.get(), o); });
    }

    /// The natsMsg, for what this class does not wrap.
    [[nodiscard]] natsMsg* native() const noexcept { return msg_.get(); }

  private:
    struct MetaFree {
        void operator()(jsMsgMetaData* m) const noexcept { jsMsgMetaData_Destroy(m); }
    };

    template <class Call>
    void acknowledge(const char* what, Call&& call) {
        jsOptions options;
        detail::check(jsOptions_Init(&options), "ack options");
        options.Wait = request_timeout_.count();  // > 0: cnats waits for the server's reply
        jsErrCode js_code = static_cast<jsErrCode>(0);
        const natsStatus status = call(&options, &js_code);
        detail::check(status,
                      fmt::format("{} of {} #{} (delivery {})", what, metadata_.stream,
                                  metadata_.stream_sequence, metadata_.num_delivered),
                      static_cast<int>(js_code));
    }

    detail::MsgPtr msg_;
    std::chrono::milliseconds request_timeout_;
    std::string subject_;
    std::string data_;
    Headers headers_;
    Metadata metadata_;
};

}  // namespace nats
IDEM_END_NAMESPACE
