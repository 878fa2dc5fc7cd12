// The chaos run over NATS JetStream: the run's own nats-server (NatsServer, JetStream file store
// in its temp dir), a stream CHAOS capturing chaos.payments, a durable pull consumer shared by
// the workers (AckWait = --visibility, MaxDeliver unlimited), idem::JetStreamConsumer in every
// worker, dead letters published to chaos.dead (stream CHAOS_DEAD) and then terminated.

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "broker.hpp"
#include "idem/broker/nats_jetstream.hpp"
#include "idem/nats/admin.hpp"
#include "idem/nats/connection.hpp"
#include "idem/senders/nats_jetstream.hpp"
#include "idem/testing/nats_server.hpp"

namespace chaos {
namespace {

namespace nats = idem::nats;

constexpr const char* stream_name = "CHAOS";
constexpr const char* subject = "chaos.payments";
constexpr const char* dead_stream_name = "CHAOS_DEAD";
constexpr const char* dead_subject = "chaos.dead";

class NatsRun final : public BrokerRun {
  public:
    explicit NatsRun(const Options& options) : server_(start_server()) {
        connection_.emplace(nats::Endpoint{server_->url()});
        nats::ensure_stream(*connection_, {stream_name, {subject}});
        nats::ensure_stream(*connection_, {dead_stream_name, {dead_subject}});
        nats::ConsumerSpec spec;
        spec.stream = stream_name;
        spec.durable = group_name;
        spec.ack_wait = options.visibility;
        spec.max_deliver = -1;  // idem's policy dead-letters
        nats::ensure_pull_consumer(*connection_, spec);
    }

    std::string worker_address() const override { return server_->url(); }

    void publish(long messages) override {
        messages_ = messages;
        for (long order = 1; order <= messages; ++order) {
            const nats::PubAck ack = connection_->publish(
                subject,
                Message::encode_fields({{"order_id", std::to_string(order)},
                                        {"amount", std::to_string(amount_of(order))}}),
                {}, message_id_of(order));
            order_of_sequence_[ack.sequence] = order;
        }
    }

    bool drained() override {
        const nats::ConsumerState state = consumer();
        return state.num_pending == 0 && state.num_ack_pending == 0;
    }

    std::string progress() override {
        const nats::ConsumerState state = consumer();
        return fmt::format("acked through {}/{}, ack pending {}, undelivered {}",
                           state.ack_floor_stream, messages_, state.num_ack_pending,
                           state.num_pending);
    }

    /// JetStream lists no pending sequences: every order past the ack floor counts as
    /// unsettled unless nothing is pending at all (an over-estimate only for a run that did not
    /// drain).
    std::set<long> unsettled_orders() override {
        if (expecting()) return unsettled_when_expecting();
        std::set<long> out;
        const nats::ConsumerState state = consumer();
        if (state.num_pending == 0 && state.num_ack_pending == 0) return out;
        for (const auto& [sequence, order] : order_of_sequence_) {
            if (sequence > state.ack_floor_stream) out.insert(order);
        }
        return out;
    }

    /// Each dead letter keeps the original's Nats-Msg-Id as idem-original-header-Nats-Msg-Id.
    std::map<long, std::string> dead_letters() override {
        std::map<long, std::string> out;
        const nats::StreamState dead = nats::stream_state(*connection_, dead_stream_name);
        for (std::uint64_t sequence = dead.first_sequence;
             dead.messages != 0 && sequence <= dead.last_sequence; ++sequence) {
            const auto letter = nats::stream_message(*connection_, dead_stream_name, sequence);
            if (!letter) continue;
            const auto id = letter->header("idem-original-header-Nats-Msg-Id");
            const auto reason = letter->header("idem-reason");
            out[id ? order_of_message_id(*id).value_or(0) : 0] =
                reason ? std::string(*reason) : std::string();
        }
        return out;
    }

    std::optional<long> order_of(const std::string& message_id) const override {
        return order_of_message_id(message_id);
    }
    std::string message_id_of_order(long order) const override { return message_id_of(order); }

  private:
    static std::unique_ptr<idem::testing::NatsServer> start_server() {
        std::string why;
        if (!idem::testing::NatsServer::available(&why)) throw server_missing("nats-server", why);
        return std::make_unique<idem::testing::NatsServer>();
    }

    nats::ConsumerState consumer() {
        return nats::consumer_state(*connection_, stream_name, group_name);
    }

    std::unique_ptr<idem::testing::NatsServer> server_;
    std::optional<nats::Connection> connection_;  ///< after server_: closed before it stops
    long messages_ = 0;
    std::map<std::uint64_t, long> order_of_sequence_;
};

class NatsWorker final : public BrokerWorker {
  public:
    NatsWorker(const Options& options, const WorkerSettings& settings)
        : options_(options), settings_(settings) {}

    void run(const Deliver& deliver) override {
        idem::nats::Endpoint endpoint{options_.broker_address};
        endpoint.name = settings_.consumer_name;
        idem::JetStreamConsumer consumer{
            endpoint, nats_consumer_options(options_, settings_),
            [&](const idem::Delivery& delivery, const idem::JetStreamMessage& message) {
                return deliver(
                    delivery, Message{fmt::format("{}:{}", message.stream, message.stream_sequence),
                                      Message::decode_fields(message.data)});
            }};
        running_.store(&consumer);
        if (stop_.load()) consumer.request_stop();
        consumer.run();
        running_.store(nullptr);
    }

    void request_stop() noexcept override {
        stop_.store(true);
        if (idem::JetStreamConsumer* consumer = running_.load()) consumer->request_stop();
    }

  private:
    const Options& options_;
    WorkerSettings settings_;
    std::atomic<bool> stop_{false};
    std::atomic<idem::JetStreamConsumer*> running_{nullptr};
};

}  // namespace

ChainSender nats_sender(const std::string& address) {
    auto sender = std::make_shared<idem::JetStreamSender>(nats::Endpoint{address});
    return {subject, [sender](const idem::OutboxRow& row) { (*sender)(row); }};
}

std::unique_ptr<BrokerRun> start_nats(const Options& options, const std::filesystem::path&) {
    return std::make_unique<NatsRun>(options);
}

idem::JetStreamConsumerOptions nats_consumer_options(const Options& options,
                                                     const WorkerSettings& settings) {
    idem::JetStreamConsumerOptions consumer_options;
    consumer_options.stream = stream_name;
    consumer_options.durable = group_name;
    consumer_options.declare = false;  // the driver's, as configured there
    consumer_options.dead_letter = dead_subject;
    // One message at a time: a killed worker's unhandled batch would otherwise be redelivered
    // with raised delivery counts although it never reached the handler. --batch: a batch
    // fetched and handled together.
    consumer_options.batch_size = options.batch ? batch_size_in_batches : 1;
    consumer_options.handle_in_batches = options.batch;
    consumer_options.poll_wait = std::chrono::milliseconds(100);
    consumer_options.visibility_timeout = settings.visibility;
    consumer_options.redelivery_backoff = settings.backoff;
    consumer_options.on_error = settings.on_error;
    consumer_options.store_probe = settings.store_probe;
    return consumer_options;
}

std::unique_ptr<BrokerWorker> nats_worker(const Options& options, const WorkerSettings& settings) {
    return std::make_unique<NatsWorker>(options, settings);
}

}  // namespace chaos
