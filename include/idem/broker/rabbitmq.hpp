#pragma once
/// @file
/// @brief RabbitMqConsumer: consumes a RabbitMQ quorum queue with manual acks and hands each
/// delivery to a handler as an idem::Delivery with the broker's delivery count, settling it as
/// the outcome says (broker/consumer.hpp's Settlement). Link idem::rabbitmq.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/broker/consumer.hpp"
#include "idem/broker/consumer_health.hpp"
#include "idem/broker/redelivery_backoff.hpp"
#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/error.hpp"
#include "idem/handler.hpp"
#include "idem/outcome.hpp"
#include "idem/rabbitmq/connection.hpp"
#include "idem/rabbitmq/consumer_options.hpp"
#include "idem/rabbitmq/endpoint.hpp"
#include "idem/rabbitmq/message.hpp"

IDEM_BEGIN_NAMESPACE
/// @brief Consumes a RabbitMQ quorum queue (basic.consume, manual acks, basic.qos prefetch) and
/// hands each delivery to a handler as an idem::Delivery, so the handler's claim, poison limit
/// and outcome decide its settlement.
///
/// - Count: x-delivery-count + 1 (absent on a first delivery); the quorum queue raises it each
///   time a delivery comes back (a nack with requeue, a closed channel or connection, a consumer
///   timeout).
/// - ack (basic.ack) only after the handler returned an acking outcome, i.e. after its commit.
/// - Not acked (failed, deferred, in_progress): after a delay — a deferred effect's retry_after,
///   else in_progress_delay (in_progress) or the redelivery backoff of its next delivery (failed,
///   and deferred without one) — the message is republished, confirmed, to a retry queue with
///   that TTL and the original acked; the retry queue dead-letters it back to the queue when it
///   expires, with its count carried in x-idem-prior-deliveries. A delay of 0
///   (RedeliveryBackoff::none(), in_progress_delay 0): basic.nack with requeue.
/// - Dead letters (and duplicates of dead-lettered messages): published to the dead-letter
///   exchange with the dead-letter envelope (idem-reason, scope, message id, delivery count, queue)
///   and the original properties and headers, the body through the policy's redactor if it has one,
///   waiting for the publisher confirm, and only then acked.
/// - With RabbitMqConsumerOptions::handle_in_batches, each poll's deliveries go to an
///   IdempotentHandler's handle_batch() in one call, then each is settled as above, in order.
/// - Reconnects after a lost connection or a closed channel and consumes again; a delivery of a
///   channel that is gone is never acked (its tag means nothing on the new channel): the broker
///   has requeued it, and its redelivery finds the claim (a duplicate, acked).
///
/// @code
/// idem::SqliteStore store{"orders.db"};
/// auto handler = idem::make_handler(store, idem::Policy{"capture"},
///     [&](auto& tx, const idem::RabbitMessage& m) { tx.execute("INSERT ...", m.body); });
/// idem::RabbitMqConsumer consumer{endpoint, {"orders"}, handler};
/// std::thread worker([&] { consumer.run(); });   // ... consumer.request_stop(); worker.join();
/// @endcode
///
/// Written on broker::ConsumerBase, which owns the loop; poll_once() and run() belong to one thread
/// at a time.
class RabbitMqConsumer final
    : public broker::ConsumerBase<RabbitMqConsumer, RabbitMqConsumerOptions, RabbitMessage,
                                  RabbitMessage> {
    using Base = broker::ConsumerBase<RabbitMqConsumer, RabbitMqConsumerOptions, RabbitMessage,
                                      RabbitMessage>;
    friend Base;

  public:
    /// The handler of the plain form: the outcome decides the settlement.
    using Handler = std::function<Outcome(const Delivery&, const RabbitMessage&)>;

    /// @brief A consumer calling @p handler for each delivery.
    /// @throws usage_error for an invalid option (the message says which and why).
    RabbitMqConsumer(RabbitEndpoint endpoint, RabbitMqConsumerOptions options, Handler handler)
        : RabbitMqConsumer(Private{}, std::move(endpoint), std::move(options),
                           broker::Dispatch<RabbitMessage>::plain(std::move(handler),
                                                                  "idem::RabbitMqConsumer")) {}

    /// @brief A consumer calling @p handler.handle(delivery, message) — or, with
    /// handle_in_batches, handler.handle_batch() once per poll; its effect takes
    /// `const idem::RabbitMessage&` as the body. @p handler must outlive the consumer.
    /// @throws usage_error for an invalid option, or a lease store's lease longer than
    /// consumer_timeout.
    template <class Store, class Effect>
    RabbitMqConsumer(RabbitEndpoint endpoint, RabbitMqConsumerOptions options,
                     IdempotentHandler<Store, Effect>& handler)
        : RabbitMqConsumer(Private{}, std::move(endpoint), std::move(options),
                           broker::Dispatch<RabbitMessage>::idempotent(handler)) {
        // What brings back a delivery whose holder is alive but slow: the consumer timeout
        // (the broker closes the channel), or — sooner, with rabbitmq-c, which answers
        // heartbeats only between handler calls — the broker dropping the connection after two
        // missed heartbeats.
        const auto heartbeats = std::chrono::duration_cast<std::chrono::milliseconds>(
            2 * connection_.endpoint().heartbeat);
        if (heartbeats.count() > 0 && heartbeats < options_.visibility_timeout) {
            broker::check_lease_fits(handler, heartbeats, "twice the endpoint's heartbeat",
                                     fmt::format("idem::RabbitMqConsumer(\"{}\")", options_.queue));
        } else {
            broker::check_lease_fits(handler, options_.visibility_timeout,
                                     "visibility_timeout (the broker's consumer_timeout)",
                                     fmt::format("idem::RabbitMqConsumer(\"{}\")", options_.queue));
        }
    }

    /// Closes the connection: deliveries not yet settled go back to the queue.
    ~RabbitMqConsumer() = default;

    /// @brief Connects, checks (and with `declare`, creates) the queues and starts consuming;
    /// poll_once() does it when needed. No-op when already consuming.
    /// @throws usage_error when the queue is not a quorum queue, or exists with other arguments
    /// than queue_arguments; broker_unavailable / broker_error when the broker is unreachable or
    /// refuses.
    void start() {
        if (consuming()) return;
        if (!connection_.connected()) connection_.connect();
        if (!connection_.channel_open(control_channel)) connection_.open_channel(control_channel);
        if (checked_on_ != connection_.connection_epoch()) {
            check_queues();
            checked_on_ = connection_.connection_epoch();
        }
        if (!connection_.channel_open(publish_channel)) {
            connection_.open_channel(publish_channel);
            connection_.confirm_select(publish_channel);
        }
        connection_.open_channel(consume_channel);
        connection_.qos(consume_channel, options_.prefetch);
        consumer_tag_ = connection_.consume(consume_channel, options_.queue, options_.consumer_tag);
        consuming_epoch_ = connection_.channel_epoch(consume_channel);
    }

    /// @brief The RabbitMQ server this consumer reads from.
    [[nodiscard]] const RabbitEndpoint& endpoint() const noexcept { return connection_.endpoint(); }
    /// @brief The consumer tag the broker knows this consumer by (once consuming).
    [[nodiscard]] const std::string& consumer_tag() const noexcept { return consumer_tag_; }

  private:
    struct Private {};
    static constexpr std::uint16_t consume_channel = 1;
    static constexpr std::uint16_t publish_channel = 2;  ///< confirm mode: dead letters, retries
    static constexpr std::uint16_t control_channel = 3;  ///< declares; a refusal closes it only

    RabbitMqConsumer(Private, RabbitEndpoint endpoint, RabbitMqConsumerOptions options,
                     broker::Dispatch<RabbitMessage> dispatch)
        : Base(validated(std::move(options)), std::move(dispatch)),
          connection_(std::move(endpoint)) {}

    static RabbitMqConsumerOptions validated(RabbitMqConsumerOptions options) {
        const std::string who = fmt::format("idem::RabbitMqConsumer(\"{}\")", options.queue);
        auto refuse = [&](std::string_view why) {
            throw usage_error(fmt::format("{}: {}", who, why));
        };
        if (options.queue.empty()) refuse("options.queue is empty; name the quorum queue to read");
        if (options.prefetch == 0) {
            refuse(
                "prefetch is 0, which RabbitMQ reads as no limit; give the number of unacked "
                "deliveries this consumer may hold (e.g. 16)");
        }
        if (options.handle_in_batches && options.prefetch < options.batch_size) {
            refuse(fmt::format(
                "handle_in_batches with prefetch ({}) below batch_size ({}): the broker sends at "
                "most prefetch unacked deliveries, so a batch could never fill. Raise prefetch to "
                "at least batch_size, or lower batch_size",
                options.prefetch, options.batch_size));
        }
        broker::validate_consumer_options(options, who);
        if (options.in_progress_delay.count() < 0) refuse("in_progress_delay is negative");
        if (options.dead_letter.empty()) options.dead_letter = options.queue + ".dead-letters";
        if (options.dead_letter_routing_key.empty())
            options.dead_letter_routing_key = options.queue;
        if (options.retry_queue.empty()) options.retry_queue = options.queue + ".retry";
        if (options.retry_queue == options.queue) {
            refuse("retry_queue is the queue itself; name another queue for delayed retries");
        }
        for (const auto& [name, value] : options.queue_arguments) {
            if (name == "x-queue-type") {
                refuse(
                    "queue_arguments names x-queue-type; the queue is a quorum queue, which the "
                    "consumer declares itself");
            }
        }
        return options;
    }

    bool consuming() const noexcept {
        return connection_.channel_open(consume_channel) &&
               connection_.channel_epoch(consume_channel) == consuming_epoch_;
    }

    rabbitmq::Table quorum_arguments() const {
        rabbitmq::Table args{{"x-queue-type", std::string("quorum")}};
        args.insert(args.end(), options_.queue_arguments.begin(), options_.queue_arguments.end());
        return args;
    }

    /// Runs @p declare on the control channel, reopening it when a refusal closed it. Returns
    /// the channel_error the broker answered with, if any.
    template <class Declare>
    std::optional<rabbitmq::channel_error> on_control(Declare&& declare) {
        if (!connection_.channel_open(control_channel)) connection_.open_channel(control_channel);
        try {
            declare();
            return std::nullopt;
        } catch (const rabbitmq::channel_error& e) {
            if (connection_.connected()) connection_.open_channel(control_channel);
            return e;
        }
    }

    /// The start check. A passive queue.declare says only that the queue exists (its arguments
    /// are not in the reply), so the type is asked for by redeclaring the queue with
    /// x-queue-type=quorum: RabbitMQ answers PRECONDITION_FAILED naming x-queue-type for a
    /// classic or stream queue, and accepts it (changing nothing) for a quorum queue with the
    /// same arguments.
    void check_queues() {
        const std::string who = fmt::format("idem::RabbitMqConsumer(\"{}\")", options_.queue);
        rabbitmq::QueueDeclare passive;
        passive.passive = true;
        auto missing = on_control(
            [&] { connection_.declare_queue(control_channel, options_.queue, passive); });
        if (missing && (missing->reply_code() != rabbitmq::reply_not_found || !options_.declare)) {
            if (missing->reply_code() == rabbitmq::reply_not_found) {
                throw usage_error(
                    fmt::format("{}: the queue does not exist on {}: declare it as a quorum queue "
                                "(x-queue-type=quorum), or set RabbitMqConsumerOptions::declare",
                                who, connection_.endpoint().describe()));
            }
            throw *missing;
        }
        rabbitmq::QueueDeclare quorum;
        quorum.arguments = quorum_arguments();
        auto refused =
            on_control([&] { connection_.declare_queue(control_channel, options_.queue, quorum); });
        if (refused) {
            if (refused->reply_code() != rabbitmq::reply_precondition_failed) throw *refused;
            const std::string text = refused->what();
            if (text.find("x-queue-type") != std::string::npos) {
                throw usage_error(fmt::format(
                    "{}: the queue is not a quorum queue ({}). A classic queue gives no delivery "
                    "count, only a `redelivered` flag, so poison messages could not be bounded: "
                    "use a quorum queue (x-queue-type=quorum), or count attempts in the store "
                    "(the store-counted fallback, docs/brokers.md) with your own consumer loop",
                    who, text));
            }
            throw usage_error(fmt::format(
                "{}: the queue exists with other arguments than RabbitMqConsumerOptions::"
                "queue_arguments ({}); give it the queue's arguments",
                who, text));
        }
        if (!options_.declare) return;
        connection_.declare_exchange(control_channel, options_.dead_letter, "fanout");
        rabbitmq::QueueDeclare dead;
        dead.arguments = {{"x-queue-type", std::string("quorum")}};
        connection_.declare_queue(control_channel, options_.dead_letter, dead);
        connection_.bind_queue(control_channel, options_.dead_letter, options_.dead_letter, "");
        retry_queues_declared_.clear();  // declared again on this connection when first used
        dead_letter_queue_known_ = true;
    }

    /// The retry queue for @p delay (see RabbitMqConsumerOptions::retry_queue), declared on this
    /// connection the first time it is used: nobody consumes it; an expired message is
    /// dead-lettered to the default exchange with the queue's name as routing key, i.e. back
    /// to the queue. A quorum queue with at-least-once dead-lettering, so a broker crash cannot
    /// drop it on the way.
    const std::string& retry_queue_for(std::chrono::milliseconds delay) {
        if (!options_.declare) return options_.retry_queue;
        std::uint64_t tier = 1;
        while (tier < static_cast<std::uint64_t>(delay.count()) && tier < (1ull << 62))
            tier <<= 1;
        auto found = retry_queues_declared_.find(tier);
        if (found != retry_queues_declared_.end()) return found->second;
        const std::string name = options_.retry_queue + "." + std::to_string(tier);
        rabbitmq::QueueDeclare retry;
        retry.arguments = {{"x-queue-type", std::string("quorum")},
                           {"x-dead-letter-exchange", std::string("")},
                           {"x-dead-letter-routing-key", options_.queue},
                           {"x-dead-letter-strategy", std::string("at-least-once")},
                           {"x-overflow", std::string("reject-publish")}};
        connection_.declare_queue(control_channel, name, retry);
        return retry_queues_declared_.emplace(tier, name).first->second;
    }

    // -----------------------------------------------------------------------------------------
    // The adapter's hooks (broker::ConsumerBase)

    std::vector<RabbitMessage> read() {
        start();
        std::vector<RabbitMessage> batch;
        for (RabbitMessage& held : held_) {  // read earlier, left unhandled: first
            if (current(held)) batch.push_back(std::move(held));
        }
        held_.clear();
        if (batch.empty()) {
            if (auto first = connection_.next_delivery(options_.poll_wait)) {
                batch.push_back(std::move(*first));
            }
        }
        if (!batch.empty()) {
            while (batch.size() < options_.batch_size) {
                auto more = connection_.next_delivery(std::chrono::milliseconds(0));
                if (!more) break;
                batch.push_back(std::move(*more));
            }
        }
        return batch;
    }

    /// Deliveries read but not handled (a stop or an open breaker) are kept for the next poll,
    /// still unacked on this channel: nacking them would raise their delivery counts. They go
    /// back to the queue when the consumer closes.
    void unhandled(std::vector<RabbitMessage>& batch, std::size_t from) {
        held_.insert(held_.begin(),
                     std::make_move_iterator(batch.begin() + static_cast<std::ptrdiff_t>(from)),
                     std::make_move_iterator(batch.end()));
    }

    static const RabbitMessage& message_of(const RabbitMessage& message) noexcept {
        return message;
    }

    std::optional<std::chrono::milliseconds> in_progress_delay() const noexcept {
        return options_.in_progress_delay;
    }

    Delivery delivery_of(const RabbitMessage& message) const {
        Delivery delivery;
        if (options_.id_field.empty()) {
            if (message.properties.message_id) delivery.message_id = *message.properties.message_id;
        } else if (auto value = message.header_string(options_.id_field)) {
            delivery.message_id = std::string(*value);
        }  // else empty: the handler dead-letters it as malformed
        delivery.delivery_count = rabbitmq::delivery_count_of(message);
        if (message.properties.timestamp) {
            delivery.enqueued_at = std::chrono::system_clock::time_point{} +
                                   std::chrono::seconds(*message.properties.timestamp);
        }
        delivery.origin = options_.queue;  // the default exchange routes to it by its name
        return delivery;
    }

    /// Settles @p message as the settlement says (see the class comment). When the settling
    /// itself fails (a dead letter or retry not confirmed, the connection lost) the connection
    /// is dropped: the broker then requeues every delivery this consumer held, rather than
    /// leaving one unacked on a live channel where nobody would ever settle it. Then the error
    /// goes up to run()'s backoff.
    broker::Settlement::Kind settle(RabbitMessage& message, const RabbitMessage&,
                                    const Delivery& delivery, const Outcome& outcome,
                                    const broker::Settlement& settlement) {
        try {
            return settle_now(message, delivery, outcome, settlement);
        } catch (...) {
            connection_.drop();
            held_.clear();
            throw;
        }
    }

    broker::Settlement::Kind settle_now(const RabbitMessage& message, const Delivery& delivery,
                                        const Outcome& outcome,
                                        const broker::Settlement& settlement) {
        using Kind = broker::Settlement::Kind;
        switch (settlement.kind) {
            case Kind::ack:
                return acked(connection_.ack(message), Kind::ack);
            case Kind::dead_letter_then_ack:
                publish_dead_letter(message, delivery, outcome);
                return acked(connection_.ack(message), Kind::dead_letter_then_ack);
            case Kind::redeliver:
                break;
        }
        if (settlement.delay && settlement.delay->count() > 0) {
            if (!current(message)) return Kind::redeliver;
            publish_retry(message, delivery, *settlement.delay, outcome.reason);
            (void)connection_.ack(message);
        } else {
            (void)connection_.nack(message, /*requeue=*/true);
        }
        return Kind::redeliver;
    }

    bool current(const RabbitMessage& message) const noexcept {
        return connection_.channel_open(message.channel) &&
               connection_.channel_epoch(message.channel) == message.channel_epoch;
    }

    /// An ack that went out counts as @p kind; one refused for a stale channel (the delivery
    /// is back in the queue: its redelivery will find the claim) as not acked.
    static broker::Settlement::Kind acked(bool sent, broker::Settlement::Kind kind) noexcept {
        return sent ? kind : broker::Settlement::Kind::redeliver;
    }

    rabbitmq::Publish republish_of(const RabbitMessage& message, const Delivery& delivery,
                                   const std::string& reason) const {
        rabbitmq::Publish p;
        p.properties = message.properties;
        p.properties.expiration.reset();
        p.properties.delivery_mode = 2;  // persistent
        p.encoded_headers = message.encoded_headers;
        p.headers = {{rabbitmq::header_reason, reason},
                     {rabbitmq::header_scope, dispatch().scope()},
                     {rabbitmq::header_message_id, delivery.message_id},
                     {rabbitmq::header_delivery_count,
                      static_cast<std::int64_t>(delivery.delivery_count.value())},
                     {rabbitmq::header_queue, options_.queue}};
        return p;
    }

    /// To the dead-letter exchange, confirmed: only then may the original be acked.
    void publish_dead_letter(const RabbitMessage& message, const Delivery& delivery,
                             const Outcome& outcome) {
        rabbitmq::Publish p = republish_of(message, delivery, outcome.reason);
        if (const auto& noted = outcome.noted_failure) {  // times as longs, like the count
            p.headers.emplace_back(envelope::failure, noted->text);
            p.headers.emplace_back(envelope::first_failed_at, to_unix_ms(noted->first));
            p.headers.emplace_back(envelope::last_failed_at, to_unix_ms(noted->last));
        }
        p.exchange = options_.dead_letter;
        p.routing_key = options_.dead_letter_routing_key;
        // The body through the policy's redactor (PolicyOptions::redact_payload), when it has
        // one; a redactor that throws leaves the delivery unacked (redaction_failed).
        connection_.publish_confirmed(publish_channel, p, dispatch().redact(message.body));
    }

    /// To the retry queue with a per-message TTL of @p delay, confirmed; it comes back to the
    /// queue when the TTL expires, its deliveries so far in x-idem-prior-deliveries.
    void publish_retry(const RabbitMessage& message, const Delivery& delivery,
                       std::chrono::milliseconds delay, const std::string& reason) {
        rabbitmq::Publish p = republish_of(message, delivery, reason);
        p.routing_key = retry_queue_for(delay);  // the default exchange
        p.properties.expiration = std::to_string(delay.count());
        p.headers.emplace_back(rabbitmq::header_prior_deliveries,
                               static_cast<std::int64_t>(delivery.delivery_count.value()));
        // The copy is a new message to the queue, returned 0 times so far; the original's
        // x-delivery-count (copied with its headers) would be counted twice.
        p.headers.emplace_back("x-delivery-count", std::int64_t{0});
        connection_.publish_confirmed(publish_channel, p, message.body);
    }

    ConsumerHealth health() {
        ConsumerHealth health;
        health.consumer = options_.queue;
        health.dead_letter_destination = options_.dead_letter;
        if (dead_letter_queue_known_ && connection_.connected()) {
            try {
                rabbitmq::QueueDeclare passive;
                passive.passive = true;
                std::optional<rabbitmq::QueueState> state;
                auto refused = on_control([&] {
                    state =
                        connection_.declare_queue(control_channel, options_.dead_letter, passive);
                });
                if (!refused && state) health.dead_letter_depth = state->messages;
            } catch (const std::exception& e) {
                report(e);
            }
        }
        return health;
    }

    rabbitmq::Connection connection_;
    std::string consumer_tag_;
    std::uint64_t consuming_epoch_ = 0;
    std::uint64_t checked_on_ = 0;  ///< the connection epoch the queues were checked on
    bool dead_letter_queue_known_ = false;
    /// Retry queues declared on this connection, by their longest delay (ms).
    std::map<std::uint64_t, std::string> retry_queues_declared_;
    std::vector<RabbitMessage> held_;  ///< read, not yet handled (breaker open or stop)
};

IDEM_END_NAMESPACE
