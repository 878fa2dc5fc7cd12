#pragma once
// The chaos run's broker seam: what the driver and the workers need from the broker that carries
// the capture messages (--broker redis|rabbitmq|nats). The run's redis-server stays for the fake
// gateway and the harness's counters whatever the broker; only the messages move.
//
// One file per broker implements both sides (broker_redis_streams.cpp, broker_rabbitmq.cpp,
// broker_nats.cpp): the driver's BrokerRun (start the broker, publish, say when everything is
// settled, read back what is left and what was dead-lettered) and the worker's BrokerWorker (the
// broker's idem consumer adapter in its plain-handler form, so a worker can die between the
// handler's commit and the broker's ack).

#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "chaos.hpp"
#include "idem/broker/redelivery_backoff.hpp"
#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/outbox.hpp"
#include "idem/outcome.hpp"
#ifdef IDEM_CHAOS_WITH_KAFKA
#include "idem/kafka/config.hpp"
#endif

// The adapters' option types, declared only: their headers are included where they are used.
IDEM_BEGIN_NAMESPACE
struct RedisStreamConsumerOptions;
struct RabbitMqConsumerOptions;
struct JetStreamConsumerOptions;
struct KafkaConsumerOptions;
struct StreamEntry;
IDEM_END_NAMESPACE

namespace chaos {

/// A capture message as the handler under test sees it, whatever the broker: named fields
/// ("order_id", "amount"). The body type of the run's IdempotentHandler.
struct Message {
    std::string broker_id;  ///< the broker's own id of the message (for logs)
    std::vector<std::pair<std::string, std::string>> fields;

    [[nodiscard]] std::optional<std::string_view> field(std::string_view name) const {
        for (const auto& [key, value] : fields)
            if (key == name) return std::string_view(value);
        return std::nullopt;
    }

    /// "order_id=7&amount=1007": the body of a message on a broker without fields.
    static std::string encode_fields(const std::vector<std::pair<std::string, std::string>>& f) {
        std::string out;
        for (const auto& [key, value] : f) {
            if (!out.empty()) out += '&';
            out += key + "=" + value;
        }
        return out;
    }
    /// The inverse of encode_fields (a part without '=' becomes a field with an empty value).
    static std::vector<std::pair<std::string, std::string>> decode_fields(std::string_view body) {
        std::vector<std::pair<std::string, std::string>> out;
        while (!body.empty()) {
            const std::size_t amp = body.find('&');
            const std::string_view part = body.substr(0, amp);
            const std::size_t eq = part.find('=');
            out.emplace_back(
                std::string(part.substr(0, eq)),
                eq == std::string_view::npos ? std::string() : std::string(part.substr(eq + 1)));
            if (amp == std::string_view::npos) break;
            body.remove_prefix(amp + 1);
        }
        return out;
    }
};

/// What a dead letter keeps of a message (found by ADL).
inline std::string idem_payload(const Message& message) {
    return Message::encode_fields(message.fields);
}

/// The message id a producer gives order @p order on brokers whose messages carry one
/// (RabbitMQ message_id, NATS Nats-Msg-Id), and its inverse.
inline std::string message_id_of(long order) {
    return "order-" + std::to_string(order);
}
inline std::optional<long> order_of_message_id(std::string_view id) {
    if (id.rfind("order-", 0) != 0 || id.size() == 6) return std::nullopt;
    long n = 0;
    for (char c : id.substr(6)) {
        if (c < '0' || c > '9') return std::nullopt;
        n = n * 10 + (c - '0');
    }
    return n;
}

/// Thrown by a start_*() whose broker server is not installed here: the driver then fails in CI
/// (CI=true) and skips elsewhere, as for a missing database server.
struct server_missing : std::runtime_error {
    server_missing(std::string server, const std::string& why)
        : std::runtime_error(why), what_server(std::move(server)) {}
    std::string what_server;
};

/// The driver's side of the broker for one run.
class BrokerRun {
  public:
    virtual ~BrokerRun() = default;
    /// Where the workers find the broker: passed to them as --broker-address.
    [[nodiscard]] virtual std::string worker_address() const = 0;
    /// Publishes the capture messages of orders 1..messages (fields order_id, amount).
    virtual void publish(long messages) = 0;
    /// True once every published message was read and settled for good (acked or terminated).
    [[nodiscard]] virtual bool drained() = 0;
    /// One short line for the progress display ("read 120/500, pending 3").
    [[nodiscard]] virtual std::string progress() = 0;
    /// After the workers stopped: the orders whose messages are still unsettled at the broker.
    [[nodiscard]] virtual std::set<long> unsettled_orders() = 0;
    /// After the workers stopped: the orders in the broker's dead-letter destination, with the
    /// reason each dead letter carries.
    [[nodiscard]] virtual std::map<long, std::string> dead_letters() = 0;
    /// The order a store's dead letter names by its message id (nothing: not one of ours).
    [[nodiscard]] virtual std::optional<long> order_of(const std::string& message_id) const = 0;
    /// The message id the handler sees for @p order (empty: not published).
    [[nodiscard]] virtual std::string message_id_of_order(long order) const = 0;

    /// Instead of publish() (the chain's second broker, chain.cpp): the messages of orders
    /// 1..messages come from a relay, each under message_id_of(order), some more than once.
    /// drained() then says that nothing that arrived so far is unread or unsettled (the caller
    /// knows when everything was sent); unsettled_orders() says every order while not drained.
    virtual void expect(long messages) { expected_ = messages; }

  protected:
    [[nodiscard]] bool expecting() const noexcept { return expected_ > 0; }
    /// expect() mode's unsettled_orders(): nothing once drained, else every order.
    [[nodiscard]] std::set<long> unsettled_when_expecting() {
        std::set<long> out;
        if (drained()) return out;
        for (long order = 1; order <= expected_; ++order)
            out.insert(order);
        return out;
    }

  private:
    long expected_ = 0;
};

/// What the chain's relay ships to a broker: where, and how (an outbox sender: returns once the
/// broker confirmed, throws otherwise).
struct ChainSender {
    std::string destination;
    std::function<void(const idem::OutboxRow&)> send;
};

/// The worker's side: the broker's consumer adapter, plain-handler form.
class BrokerWorker {
  public:
    using Deliver = std::function<idem::Outcome(const idem::Delivery&, const Message&)>;
    virtual ~BrokerWorker() = default;
    /// Consumes until request_stop(); each delivery goes to @p deliver, whose outcome decides
    /// the ack. Errors it recovers from go to the on_error given at creation.
    virtual void run(const Deliver& deliver) = 0;
    /// Async-signal-safe (called from the worker's SIGTERM handler).
    virtual void request_stop() noexcept = 0;
};

/// What every worker-side adapter is configured with.
struct WorkerSettings {
    std::string consumer_name;  ///< unique per worker process
    std::chrono::milliseconds visibility{400};
    std::function<void(const std::exception&)> on_error;
    idem::RedeliveryBackoff backoff{};  ///< the consumer's redelivery_backoff
    /// The chain's second service: the messages are a relay's (the outbox key as the message
    /// id, the payload as the body), sent by make_sender()'s sender.
    bool relayed = false;
    /// The consumer's store_probe (a plain handler's store is probed only through it, while
    /// the circuit breaker is open); empty: none.
    std::function<void()> store_probe{};
};

/// Each worker's consumer options, whichever handler it is given (the plain form above, or with
/// --batch the IdempotentHandler itself, worker.cpp): one delivery per poll, or with
/// options.batch batch_size_in_batches handled together (handle_in_batches).
idem::RedisStreamConsumerOptions redis_streams_consumer_options(const Options& options,
                                                                const WorkerSettings& settings);
#ifdef IDEM_CHAOS_WITH_RABBITMQ
idem::RabbitMqConsumerOptions rabbitmq_consumer_options(const Options& options,
                                                        const WorkerSettings& settings);
#endif
#ifdef IDEM_CHAOS_WITH_NATS
idem::JetStreamConsumerOptions nats_consumer_options(const Options& options,
                                                     const WorkerSettings& settings);
#endif
#ifdef IDEM_CHAOS_WITH_KAFKA
idem::KafkaConsumerOptions kafka_consumer_options(const Options& options,
                                                  const WorkerSettings& settings);
#endif

std::unique_ptr<BrokerRun> start_redis_streams(const Options& options, int redis_port);
/// A stream entry as the handler reads it: a relayed or redriven copy's payload field decoded
/// (the RedisStreamSender's), else the entry's own fields.
Message stream_message_of(const idem::StreamEntry& entry);
std::unique_ptr<BrokerWorker> redis_streams_worker(const Options& options,
                                                   const WorkerSettings& settings);
/// The sender of each broker to its workers' destination, at @p address (worker_address()).
ChainSender redis_streams_sender(const std::string& address);
#ifdef IDEM_CHAOS_WITH_RABBITMQ
std::unique_ptr<BrokerRun> start_rabbitmq(const Options& options,
                                          const std::filesystem::path& run_dir);
std::unique_ptr<BrokerWorker> rabbitmq_worker(const Options& options,
                                              const WorkerSettings& settings);
ChainSender rabbitmq_sender(const std::string& address);
#endif
#ifdef IDEM_CHAOS_WITH_NATS
std::unique_ptr<BrokerRun> start_nats(const Options& options, const std::filesystem::path& run_dir);
std::unique_ptr<BrokerWorker> nats_worker(const Options& options, const WorkerSettings& settings);
ChainSender nats_sender(const std::string& address);
#endif
#ifdef IDEM_CHAOS_WITH_KAFKA
std::unique_ptr<BrokerRun> start_kafka(const Options& options);
std::unique_ptr<BrokerWorker> kafka_worker(const Options& options, const WorkerSettings& settings);
/// The client configuration of a worker's KafkaConsumer (--offsets store builds its own).
idem::kafka::Config kafka_worker_config(const Options& options, const WorkerSettings& settings);
ChainSender kafka_sender(const std::string& address);
#endif

}  // namespace chaos

namespace chaos {

/// The driver's broker for --broker.
inline std::unique_ptr<BrokerRun> start_broker(const Options& options, int redis_port,
                                               const std::filesystem::path& run_dir) {
    switch (options.broker) {
        case BrokerKind::redis_streams:
            return start_redis_streams(options, redis_port);
        case BrokerKind::rabbitmq:
#ifdef IDEM_CHAOS_WITH_RABBITMQ
            return start_rabbitmq(options, run_dir);
#else
            break;
#endif
        case BrokerKind::nats:
#ifdef IDEM_CHAOS_WITH_NATS
            return start_nats(options, run_dir);
#else
            break;
#endif
        case BrokerKind::kafka:
#ifdef IDEM_CHAOS_WITH_KAFKA
            return start_kafka(options);
#else
            break;
#endif
    }
    (void)run_dir;
    throw std::invalid_argument(std::string("idem_chaos was built without the ") +
                                to_string(options.broker) + " adapter");
}

/// The worker's consumer for --broker.
inline std::unique_ptr<BrokerWorker> make_worker(const Options& options,
                                                 const WorkerSettings& settings) {
    switch (options.broker) {
        case BrokerKind::redis_streams:
            return redis_streams_worker(options, settings);
        case BrokerKind::rabbitmq:
#ifdef IDEM_CHAOS_WITH_RABBITMQ
            return rabbitmq_worker(options, settings);
#else
            break;
#endif
        case BrokerKind::nats:
#ifdef IDEM_CHAOS_WITH_NATS
            return nats_worker(options, settings);
#else
            break;
#endif
        case BrokerKind::kafka:
#ifdef IDEM_CHAOS_WITH_KAFKA
            return kafka_worker(options, settings);
#else
            break;
#endif
    }
    throw std::invalid_argument(std::string("idem_chaos was built without the ") +
                                to_string(options.broker) + " adapter");
}

/// The sender to broker @p kind at @p address (the chain's relay, and its naive publish).
inline ChainSender make_sender(BrokerKind kind, const std::string& address) {
    switch (kind) {
        case BrokerKind::redis_streams:
            return redis_streams_sender(address);
        case BrokerKind::rabbitmq:
#ifdef IDEM_CHAOS_WITH_RABBITMQ
            return rabbitmq_sender(address);
#else
            break;
#endif
        case BrokerKind::nats:
#ifdef IDEM_CHAOS_WITH_NATS
            return nats_sender(address);
#else
            break;
#endif
        case BrokerKind::kafka:
#ifdef IDEM_CHAOS_WITH_KAFKA
            return kafka_sender(address);
#else
            break;
#endif
    }
    (void)address;
    throw std::invalid_argument(std::string("idem_chaos was built without the ") + to_string(kind) +
                                " adapter");
}

}  // namespace chaos
