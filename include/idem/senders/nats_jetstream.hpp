#pragma once
/// @file
/// @brief idem::JetStreamSender: an idem::Relay sender that publishes each outbox intent to
/// NATS JetStream with `Nats-Msg-Id` = the idempotency key (the id an idem::JetStreamConsumer
/// claims by default) and waits for the stream's PubAck. Link idem::nats. See docs/chain.md.
///
/// @code
/// idem::Relay relay(store, idem::JetStreamSender{idem::nats::Endpoint{"nats://127.0.0.1:4222"}});
/// @endcode

#include <memory>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/records.hpp"
#include "idem/contract/time.hpp"
#include "idem/error.hpp"
#include "idem/nats/admin.hpp"
#include "idem/nats/connection.hpp"
#include "idem/nats/error.hpp"
#include "idem/outbox.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief Publishes an outbox intent to the subject named by its destination, with the header
/// `Nats-Msg-Id: <idempotency key>`, and returns once a stream acknowledged it (a PubAck, also
/// when the stream says it is a duplicate: it has the message already).
///
/// **A second message under one id.** Each message also carries its key in `idem-message-id`
/// (taken first by an idem::JetStreamConsumer) and the intent's row id and time in
/// `idem-outbox-mark`. When the stream answers "duplicate" for a message whose stored twin has
/// another mark (the original of a redriven dead letter, published minutes ago under the same
/// id), the sender publishes it again under `Nats-Msg-Id: <key>@<mark>`: a redrive is not
/// swallowed by the duplicate window, and the consumer still claims it by its key.
///
/// **The duplicate window.** A stream drops a second publish with the same Nats-Msg-Id only
/// within its duplicate window (`duplicate_window`, 2 minutes by default). The relay resends an
/// intent when it died between the send and the mark (after RelayOptions::lease) and after each
/// failure (its backoff, up to backoff_max, max_attempts times); a resend later than the window
/// is stored again by the stream. It is still one effect at an idem consumer: its claim on the
/// key is kept for the policy's retention (days), far longer than the window. So the window
/// only saves the stream a copy; the claim is what makes the chain exactly once, and a receiver
/// without one sees every resend that falls outside the window.
///
/// Failures (the reason is in the exception's text): no server, the connection lost, no
/// responders (no stream captures the subject, or JetStream is restarting), a PubAck timeout
/// (the message may be stored: the resend is a duplicate) and any other refusal → retry later.
/// A message larger than the server's max_payload or the stream's max_msg_size →
/// idem::send_refused: parked at once.
///
/// Connects on the first send (cnats then reconnects by itself; a connection closed for good
/// is replaced on the next send). One Relay thread at a time; movable.
class JetStreamSender {
  public:
    /// @brief A sender to the JetStream server(s) of @p endpoint; connects on the first send.
    explicit JetStreamSender(nats::Endpoint endpoint) : endpoint_(std::move(endpoint)) {}

    /// @brief Publishes @p row and waits for the PubAck.
    /// @return the PubAck (stream, sequence, duplicate).
    /// @throws idem::send_refused (park), nats::unavailable / nats::timeout / nats::error (retry).
    nats::PubAck operator()(const OutboxRow& row) {
        try {
            if (!connection_ || connection_->closed()) {
                connection_ = std::make_unique<nats::Connection>(endpoint_);
            }
            const std::string mark = fmt::format("{}:{}", row.id, to_unix_ms(row.created_at));
            const nats::Headers headers{{nats::message_id_header, row.idempotency_key},
                                        {nats::outbox_mark_header, mark}};
            nats::PubAck ack =
                connection_->publish(row.destination, row.payload, headers, row.idempotency_key);
            if (!ack.duplicate) return ack;
            // The stream holds a message under this Nats-Msg-Id from its duplicate window: this
            // intent's own earlier send (done), or another message with the same id, such as
            // the original of a redriven dead letter, which must not swallow this one.
            const auto stored = nats::stream_message(*connection_, ack.stream, ack.sequence);
            if (stored && stored->header(nats::outbox_mark_header) == std::string_view(mark)) {
                return ack;
            }
            return connection_->publish(row.destination, row.payload, headers,
                                        row.idempotency_key + "@" + mark);
        } catch (const nats::error& e) {
            if (too_large(e)) {
                throw send_refused(fmt::format(
                    "idem::JetStreamSender: the publish of '{}' to '{}' is refused for good: {}",
                    row.idempotency_key, row.destination, e.what()));
            }
            throw;
        }
    }

    /// @brief The NATS server (or cluster) it publishes to.
    [[nodiscard]] const nats::Endpoint& endpoint() const noexcept { return endpoint_; }

  private:
    static bool too_large(const nats::Failure& e) noexcept {
        constexpr int stream_message_exceeds_maximum = 10054;  // JSStreamMessageExceedsMaximumErr
        return e.status() == NATS_MAX_PAYLOAD || e.js_code() == stream_message_exceeds_maximum;
    }

    nats::Endpoint endpoint_;
    std::unique_ptr<nats::Connection> connection_;
};

IDEM_END_NAMESPACE
