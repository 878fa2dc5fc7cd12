#pragma once
/// @file
/// @brief JetStreamConsumer: pulls from a durable NATS JetStream consumer and hands each message
/// to a handler as an idem::Delivery with the broker's delivery count (NumDelivered), settling
/// it only as the outcome says: AckSync after the commit, NakWithDelay for a deferred message,
/// and for a dead letter a publish (reason and original headers) to a dead-letter subject,
/// confirmed by its stream, then Term. Link idem::nats.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "idem/broker/circuit_breaker.hpp"
#include "idem/broker/consumer.hpp"
#include "idem/broker/consumer_health.hpp"
#include "idem/broker/redelivery_backoff.hpp"
#include "idem/config.hpp"
#include "idem/contract/dead_letter_envelope.hpp"
#include "idem/delivery.hpp"
#include "idem/error.hpp"
#include "idem/handler.hpp"
#include "idem/nats/admin.hpp"
#include "idem/nats/connection.hpp"
#include "idem/nats/consumer_options.hpp"
#include "idem/nats/error.hpp"
#include "idem/nats/message.hpp"
#include "idem/nats/pull_subscription.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief Pulls from a durable JetStream consumer and hands each message to a handler as an
/// idem::Delivery, so the handler's claim, poison limit and outcome decide the settlement.
///
/// The delivery count is the message's NumDelivered (1, 2, 3 ...), the message id its
/// id_field (Nats-Msg-Id by default) or its stream sequence. After the handler: an acking
/// outcome is acked with AckSync, which waits for the server to confirm; a dead letter (or a
/// duplicate of one) is first published to the dead-letter subject with the dead-letter
/// envelope's headers (contract/dead_letter_envelope.hpp: idem-reason, idem-scope,
/// idem-message-id, idem-delivery-count, idem-original-stream, idem-original-sequence,
/// idem-original-subject) plus the original headers (JetStream's own Nats-* ones kept as
/// idem-original-header-Nats-*),
/// deduplicated by a Nats-Msg-Id of its own, and terminated only once its stream confirmed it.
/// An outcome with a retry_after (deferred, or in_progress with the holder's remaining lease)
/// is nacked with that delay; a failed one (or deferred without its own delay) with the
/// redelivery backoff of its next delivery (JetStreamConsumerOptions::redelivery_backoff);
/// in_progress without a delay is left unsettled and comes back after AckWait. A handler that
/// throws counts as failed. Nothing is acked whose outcome is unknown; nothing is acked before the
/// handler's commit returned.
///
/// @code
/// idem::SqliteStore store{"orders.db"};
/// auto handler = idem::make_handler(store, idem::Policy{"capture"},
///     [&](auto& tx, const idem::JetStreamMessage& m) { /* ... */ });
/// idem::nats::Endpoint endpoint;
/// endpoint.url = "nats://127.0.0.1:4222";
/// idem::JetStreamConsumer consumer{endpoint, {"ORDERS", "capture"}, handler};
/// std::thread worker([&] { consumer.run(); });   // ... consumer.request_stop(); worker.join();
/// @endcode
///
/// Written on broker::ConsumerBase, which owns the loop; poll_once() and run() belong to one thread
/// at a time.
class JetStreamConsumer final
    : public broker::ConsumerBase<JetStreamConsumer, JetStreamConsumerOptions,
                                  detail::JetStreamItem, JetStreamMessage> {
    using Base = broker::ConsumerBase<JetStreamConsumer, JetStreamConsumerOptions,
                                      detail::JetStreamItem, JetStreamMessage>;
    friend Base;

  public:
    /// The handler of the plain form: the outcome decides the settlement.
    using Handler = std::function<Outcome(const Delivery&, const JetStreamMessage&)>;

    /// @brief A consumer calling @p handler for each message. Connects on the first poll.
    /// @throws usage_error for an invalid option (the message says which and why).
    JetStreamConsumer(nats::Endpoint endpoint, JetStreamConsumerOptions options, Handler handler)
        : JetStreamConsumer(Private{}, std::move(endpoint), std::move(options),
                            broker::Dispatch<JetStreamMessage>::plain(std::move(handler),
                                                                      "idem::JetStreamConsumer"),
                            std::nullopt) {}

    /// @brief A consumer calling @p handler.handle(delivery, message) — or, with
    /// handle_in_batches, handler.handle_batch() once per fetch. @p handler must outlive the
    /// consumer. On a lease store the lease must not be longer than the visibility timeout
    /// (AckWait); the consumer's MaxDeliver must be above the handler's max_deliveries (checked
    /// at start).
    /// @throws usage_error for an invalid option or a lease longer than the visibility timeout.
    template <class Store, class Effect>
    JetStreamConsumer(nats::Endpoint endpoint, JetStreamConsumerOptions options,
                      IdempotentHandler<Store, Effect>& handler)
        : JetStreamConsumer(Private{}, std::move(endpoint), std::move(options),
                            broker::Dispatch<JetStreamMessage>::idempotent(handler),
                            handler.policy().max_deliveries()) {
        broker::check_lease_fits(handler, options_.visibility_timeout,
                                 "visibility_timeout (AckWait)",
                                 fmt::format("idem::JetStreamConsumer(\"{}\")", name_));
    }

    ~JetStreamConsumer() { heartbeat_.stop(); }

    /// @brief Deferred messages given back with NakWithDelay (of stats().not_acked).
    [[nodiscard]] std::size_t nacked_with_delay() const noexcept {
        return nacked_with_delay_.load(std::memory_order_relaxed);
    }
    /// @brief +WPI sent for messages of slow handlers (in_progress_heartbeat).
    [[nodiscard]] std::size_t in_progress_sent() const noexcept { return heartbeat_.sent(); }

    /// @brief The NATS server (or cluster) this consumer reads from.
    [[nodiscard]] const nats::Endpoint& endpoint() const noexcept { return endpoint_; }
    /// @brief "<stream>/<durable>": how health reports and errors name this consumer.
    [[nodiscard]] const std::string& name() const noexcept { return name_; }

  private:
    struct Private {};

    /// Sends +WPI for the messages in hand every half AckWait while the handler runs (opt-in).
    /// One thread per consumer, started on first use; the mutex orders its +WPI before the
    /// consumer's own settlement of the same message (cnats' natsMsg is not thread-safe).
    class Heartbeat {
      public:
        Heartbeat() = default;
        Heartbeat(const Heartbeat&) = delete;
        Heartbeat& operator=(const Heartbeat&) = delete;
        ~Heartbeat() { stop(); }

        void stop() noexcept {
            {
                std::lock_guard<std::mutex> lock(mutex_);
                quit_ = true;
                messages_.clear();
            }
            wake_.notify_all();
            if (thread_.joinable()) thread_.join();
        }

        /// Covers @p messages (until end()) with a +WPI every @p period.
        void begin(std::vector<nats::Message*> messages, std::chrono::milliseconds period) {
            if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
            {
                std::lock_guard<std::mutex> lock(mutex_);
                messages_ = std::move(messages);
                period_ = period;
                due_ = std::chrono::steady_clock::now() + period;
            }
            wake_.notify_all();
        }
        /// No more +WPI for them; returns once none is being sent.
        void end() {
            std::lock_guard<std::mutex> lock(mutex_);
            messages_.clear();
        }
        [[nodiscard]] std::size_t sent() const noexcept {
            return sent_.load(std::memory_order_relaxed);
        }

      private:
        void loop() {
            std::unique_lock<std::mutex> lock(mutex_);
            while (!quit_) {
                if (messages_.empty()) {
                    wake_.wait(lock);
                    continue;
                }
                if (wake_.wait_until(lock, due_) != std::cv_status::timeout) continue;
                if (quit_ || messages_.empty() || std::chrono::steady_clock::now() < due_) {
                    continue;
                }
                for (nats::Message* message : messages_) {
                    try {
                        message->in_progress();
                        sent_.fetch_add(1, std::memory_order_relaxed);
                    } catch (...) {  // the server away: it may come back; nothing is lost
                    }
                }
                due_ = std::chrono::steady_clock::now() + period_;
            }
        }

        std::mutex mutex_;
        std::condition_variable wake_;
        std::thread thread_;
        bool quit_ = false;
        std::vector<nats::Message*> messages_;
        std::chrono::milliseconds period_{0};
        std::chrono::steady_clock::time_point due_{};
        std::atomic<std::size_t> sent_{0};
    };

    JetStreamConsumer(Private, nats::Endpoint endpoint, JetStreamConsumerOptions options,
                      broker::Dispatch<JetStreamMessage> dispatch,
                      std::optional<std::uint32_t> max_deliveries)
        : Base(validated(std::move(options)), std::move(dispatch)),
          endpoint_(std::move(endpoint)),
          name_(options_.stream + "/" + options_.durable),
          max_deliveries_(max_deliveries) {}

    static JetStreamConsumerOptions validated(JetStreamConsumerOptions options) {
        const std::string who =
            fmt::format("idem::JetStreamConsumer(\"{}/{}\")", options.stream, options.durable);
        auto refuse = [&](std::string_view why) {
            throw usage_error(fmt::format("{}: {}", who, why));
        };
        if (options.stream.empty()) refuse("options.stream is empty; name the stream to read");
        if (options.durable.empty()) {
            refuse(
                "options.durable is empty; name the durable pull consumer (one per kind of "
                "handler, shared by its workers)");
        }
        if (options.durable.find('.') != std::string::npos) {
            refuse("options.durable contains '.', which JetStream refuses in a consumer name");
        }
        broker::validate_consumer_options(options, who);
        if (options.dead_letter.empty()) {
            options.dead_letter = "idem.dead-letters." + options.stream + "." + options.durable;
        }
        return options;
    }

    // -----------------------------------------------------------------------------------------
    // Connection, checks at start

    void ensure_connected() {
        if (connection_ && connection_->closed()) {  // closed for good: start over
            subscription_.reset();
            connection_.reset();
        }
        if (!connection_) connection_ = std::make_unique<nats::Connection>(endpoint_);
        if (subscription_) return;
        nats::ConsumerState state;
        try {
            state = nats::consumer_state(*connection_, options_.stream, options_.durable);
        } catch (const nats::not_found& e) {
            if (!options_.declare || e.js_code() == JSStreamNotFoundErr) throw;
            nats::ConsumerSpec spec;
            spec.stream = options_.stream;
            spec.durable = options_.durable;
            spec.filter_subject = options_.filter_subject;
            spec.ack_wait = options_.visibility_timeout;
            spec.backoff = jetstream_backoff(options_);
            // Unlimited: idem's policy dead-letters. With a BackOff the server wants a number
            // (above the BackOff's length): one no policy reaches.
            spec.max_deliver = spec.backoff.empty() ? -1 : unlimited_deliveries;
            state = nats::ensure_pull_consumer(*connection_, spec);
        }
        check_consumer(state);
        check_dead_letter_subject(state);
        subscription_ = std::make_unique<nats::PullSubscription>(*connection_, options_.stream,
                                                                 options_.durable);
    }

    void check_consumer(const nats::ConsumerState& state) const {
        auto refuse = [&](const std::string& why) {
            throw usage_error(fmt::format("idem::JetStreamConsumer(\"{}\"): {}", name_, why));
        };
        if (!state.pull) refuse("the consumer is a push consumer; make it a pull consumer");
        if (!state.explicit_ack) {
            refuse(
                "the consumer's AckPolicy is not explicit; with none or all, acks would settle "
                "messages whose outcome is unknown. Create it with AckPolicy explicit");
        }
        // With a BackOff the server takes its first entry as the AckWait.
        const bool backoff_first = !state.backoff.empty() && state.ack_wait == state.backoff[0];
        if (state.ack_wait != options_.visibility_timeout && !backoff_first) {
            refuse(fmt::format(
                "the consumer's AckWait is {} ms but visibility_timeout is {} ms; the lease check "
                "and the +WPI period rely on it. Make them equal",
                state.ack_wait.count(), options_.visibility_timeout.count()));
        }
        if (!state.backoff.empty() && state.backoff != jetstream_backoff(options_)) {
            refuse(fmt::format(
                "the consumer's BackOff ({} ms) is not what visibility_timeout and "
                "redelivery_backoff ask for ({} ms): a delivery nobody settled would come back "
                "on another schedule than a failed one. Create it with "
                "idem::jetstream_backoff(options)",
                fmt::join(millis(state.backoff), ", "),
                fmt::join(millis(jetstream_backoff(options_)), ", ")));
        }
        if (max_deliveries_ && state.max_deliver > 0 &&
            static_cast<std::uint64_t>(state.max_deliver) <= *max_deliveries_) {
            refuse(fmt::format(
                "the consumer's MaxDeliver ({}) is not above the handler's max_deliveries ({}): "
                "the server would stop delivering a poison message before idem dead-letters it, "
                "leaving it neither handled nor parked. Set MaxDeliver to -1 (unlimited)",
                state.max_deliver, *max_deliveries_));
        }
    }

    /// MaxDeliver "unlimited" where the server needs a number.
    static constexpr std::int64_t unlimited_deliveries = 2'000'000'000;

    static std::vector<std::int64_t> millis(const std::vector<std::chrono::milliseconds>& waits) {
        std::vector<std::int64_t> out;
        for (const std::chrono::milliseconds wait : waits)
            out.push_back(wait.count());
        return out;
    }

    /// The dead-letter subject must not be read back by this consumer.
    void check_dead_letter_subject(const nats::ConsumerState& state) {
        const nats::StreamState stream = nats::stream_state(*connection_, options_.stream);
        const std::string& subject = options_.dead_letter;
        const bool filtered_out =
            !state.filter_subject.empty() && !nats::subject_matches(state.filter_subject, subject);
        for (const std::string& captured : stream.subjects) {
            if (nats::subject_matches(captured, subject) && !filtered_out) {
                throw usage_error(fmt::format(
                    "idem::JetStreamConsumer(\"{}\"): the dead-letter subject \"{}\" is captured "
                    "by the stream itself (subject \"{}\"): dead letters would be delivered "
                    "again. Choose a subject another stream captures",
                    name_, subject, captured));
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // One poll

    // -----------------------------------------------------------------------------------------
    // The adapter's hooks (broker::ConsumerBase); a message read but not handled is left
    // unsettled: redelivered after AckWait.

    std::vector<detail::JetStreamItem> read() {
        ensure_connected();
        std::vector<nats::Message> fetched;
        try {
            fetched = subscription_->fetch(options_.batch_size, options_.poll_wait);
        } catch (const nats::not_found&) {  // the consumer was deleted: bind (create) again
            subscription_.reset();
            throw;
        }
        std::vector<detail::JetStreamItem> batch;
        batch.reserve(fetched.size());
        for (nats::Message& message : fetched) {
            JetStreamMessage body = body_of(message);
            batch.push_back(detail::JetStreamItem{std::move(message), std::move(body)});
        }
        return batch;
    }

    static const JetStreamMessage& message_of(const detail::JetStreamItem& item) noexcept {
        return item.body;
    }
    static JetStreamMessage message_of(detail::JetStreamItem&& item) noexcept {
        return std::move(item.body);
    }

    Delivery delivery_of(const detail::JetStreamItem& item) const {
        const nats::Message& message = item.message;
        // A JetStreamSender's message names its id in a header of its own: its Nats-Msg-Id
        // differs when the stream held another message under that id (a redriven dead letter).
        std::optional<std::string_view> id;
        if (!options_.id_field.empty()) {
            id = message.header(nats::message_id_header);
            if (!id) id = message.header(options_.id_field);
        }
        Delivery delivery = detail::jetstream_delivery(message.metadata(), id, options_.id_field,
                                                       options_.sequence_when_no_id_field);
        delivery.origin = message.subject();
        return delivery;
    }

    static JetStreamMessage body_of(const nats::Message& message) {
        JetStreamMessage body;
        body.stream = message.metadata().stream;
        body.subject = message.subject();
        body.data = message.data();
        body.headers = message.headers();
        body.stream_sequence = message.metadata().stream_sequence;
        return body;
    }

    /// The +WPI heartbeat (in_progress_heartbeat) covers the messages in the handler's hands.
    void handling(detail::JetStreamItem* first, std::size_t count) {
        if (!options_.in_progress_heartbeat) return;
        std::vector<nats::Message*> messages;
        messages.reserve(count);
        for (std::size_t i = 0; i < count; ++i)
            messages.push_back(&first[i].message);
        heartbeat_.begin(std::move(messages),
                         std::max(std::chrono::milliseconds(1), options_.visibility_timeout / 2));
    }
    void handled() {
        if (options_.in_progress_heartbeat) heartbeat_.end();
    }

    // -----------------------------------------------------------------------------------------
    // Settlement (broker::settlement_of: the consumer settles; JetStream has no commit hook)

    broker::Settlement::Kind settle(detail::JetStreamItem& item, const JetStreamMessage& body,
                                    const Delivery& delivery, const Outcome& outcome,
                                    const broker::Settlement& settlement) {
        switch (settlement.kind) {
            case broker::Settlement::Kind::redeliver:
                if (settlement.delay) {
                    item.message.nak_with_delay(*settlement.delay);
                    nacked_with_delay_.fetch_add(1, std::memory_order_relaxed);
                }  // else unsettled: AckWait brings it back
                break;
            case broker::Settlement::Kind::dead_letter_then_ack:
                publish_dead_letter(delivery, body, outcome);
                item.message.term();
                break;
            case broker::Settlement::Kind::ack:
                item.message.ack_sync();
                break;
        }
        return settlement.kind;
    }

    /// Publishes the copy and waits for its stream's pub ack; throws (and the original is not
    /// terminated) when no stream confirms it. Its own Nats-Msg-Id makes a second publish of
    /// the same dead letter (a crash before the Term) a no-op within the duplicate window.
    void publish_dead_letter(const Delivery& delivery, const JetStreamMessage& body,
                             const Outcome& outcome) {
        // The body (data and every original header value) through the policy's redactor
        // (PolicyOptions::redact_payload), when it has one; a redactor that throws
        // (redaction_failed) leaves the message unsettled. The reason is the handler's, which
        // redacts the texts it puts there.
        nats::Headers headers = envelope::fields_of(outcome, delivery, dispatch().scope());
        headers.emplace_back(envelope::original_stream, body.stream);
        headers.emplace_back(envelope::original_sequence, std::to_string(body.stream_sequence));
        headers.emplace_back(envelope::original_subject, body.subject);
        for (const auto& [name, value] : body.headers) {
            // JetStream acts on its own headers (Nats-Expected-Stream would refuse the publish,
            // Nats-Msg-Id would dedupe it against unrelated messages): kept under another name.
            if (name.rfind("Nats-", 0) == 0) {
                headers.emplace_back(envelope::original_header_prefix + name,
                                     dispatch().redact(value));
            } else {
                headers.emplace_back(name, dispatch().redact(value));
            }
        }
        const std::string copy_id =
            fmt::format("idem-dead-letter:{}:{}:{}", name_, body.stream, body.stream_sequence);
        connection_->publish(options_.dead_letter, dispatch().redact(body.data), headers, copy_id);
    }

    /// NumAckPending from the consumer's info and the dead-letter stream's depth; what cannot
    /// be read this time is reported as unknown.
    ConsumerHealth health() {
        ConsumerHealth health;
        health.consumer = name_;
        health.dead_letter_destination = options_.dead_letter;
        try {
            if (connection_) {
                const nats::ConsumerState state =
                    nats::consumer_state(*connection_, options_.stream, options_.durable);
                health.pending =
                    static_cast<std::uint64_t>(std::max<std::int64_t>(0, state.num_ack_pending));
                if (!options_.dead_letter_stream.empty()) {
                    health.dead_letter_depth =
                        nats::stream_state(*connection_, options_.dead_letter_stream).messages;
                }
            }
        } catch (const std::exception& e) {
            report(e);
        }
        return health;
    }

    nats::Endpoint endpoint_;  ///< its url is the server
    std::string name_;
    std::optional<std::uint32_t> max_deliveries_;  ///< the handler's, checked against MaxDeliver
    std::unique_ptr<nats::Connection> connection_;
    std::unique_ptr<nats::PullSubscription> subscription_;  ///< after connection_: uses it
    Heartbeat heartbeat_;  ///< after the subscription: its +WPI go through it
    std::atomic<std::size_t> nacked_with_delay_{0};
};

IDEM_END_NAMESPACE
