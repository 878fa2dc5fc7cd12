// The chaos run over RabbitMQ (--broker rabbitmq): a throwaway broker (idem::testing::
// RabbitmqServer), a quorum queue chaos.payments read by idem::RabbitMqConsumer in each worker,
// dead letters on chaos.payments.dead-letters, delayed redeliveries in the retry queues
// chaos.payments.retry.<T>.
//
// drained(): AMQP says only how many messages are READY, not how many are delivered and unacked,
// so a queue whose ready count is 0 is then asked of the broker itself (rabbitmqctl list_queues;
// a quorum queue's figures there lag up to ~5 s, so the answer counts only once ready has stayed 0
// for longer than that). It is only when to stop: what is left is read exactly afterwards, once
// the workers are gone and the broker has requeued what they held (unsettled_orders()).

#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "broker.hpp"
#include "idem/broker/rabbitmq.hpp"
#include "idem/rabbitmq/connection.hpp"
#include "idem/senders/rabbitmq.hpp"
#include "idem/testing/rabbitmq_server.hpp"

namespace chaos {
namespace {

namespace rmq = idem::rabbitmq;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr const char* queue_name = "chaos.payments";
constexpr const char* dead_letter_name = "chaos.payments.dead-letters";
constexpr const char* retry_name = "chaos.payments.retry";
constexpr std::uint16_t ch = 1;

rmq::Endpoint endpoint_on(int port) {
    rmq::Endpoint e;
    e.host = "127.0.0.1";
    e.port = port;
    return e;
}

class RabbitmqRun final : public BrokerRun {
  public:
    RabbitmqRun() : connection_(endpoint_on(server_.port())) {
        connection_.connect();
        connection_.open_channel(ch);
        rmq::QueueDeclare quorum;
        quorum.arguments = {{"x-queue-type", std::string("quorum")}};
        connection_.declare_queue(ch, queue_name, quorum);
    }

    std::string worker_address() const override { return std::to_string(server_.port()); }

    void publish(long messages) override {
        messages_ = messages;
        for (long order = 1; order <= messages; ++order) {
            rmq::Publish p;
            p.routing_key = queue_name;
            p.properties.message_id = message_id_of(order);
            p.properties.delivery_mode = 2;
            connection_.publish_confirmed(
                ch, p,
                Message::encode_fields({{"order_id", std::to_string(order)},
                                        {"amount", std::to_string(amount_of(order))}}));
        }
        last_ready_ = Clock::now();
    }

    bool drained() override {
        if (ready(queue_name) > 0) {
            last_ready_ = Clock::now();
            return false;
        }
        // Ready 0 for longer than the broker's figures lag, then the broker's own count of
        // delivered-and-unacked ones and of the retry queues' waiting ones (at most every 2 s:
        // each rabbitmqctl call takes ~1.5 s).
        // Drained only when two such counts 6 s apart (past the figures' lag) both say 0 and the
        // queue's ready count stayed 0 between them: one count alone once said 0 while an order
        // was still in the queues (CI: "drained, yet 1 orders pending").
        const auto now = Clock::now();
        if (now - last_ready_ < 6s || now - last_ctl_ < 2s) return false;
        last_ctl_ = now;
        const auto counts = ctl_counts();
        if (counts.ready != 0 || counts.unacked != 0) {
            if (counts.ready != 0) last_ready_ = now;  // some wait out a delay in a retry queue
            first_zero_.reset();
            return false;
        }
        if (!first_zero_ || *first_zero_ < last_ready_) {
            first_zero_ = now;
            return false;
        }
        return now - *first_zero_ >= 6s;
    }

    std::string progress() override {
        return fmt::format("ready {}/{}, retrying {} (at the last count), dead letters {}",
                           ready(queue_name), messages_, retrying_, ready(dead_letter_name));
    }

    std::set<long> unsettled_orders() override {
        std::set<long> out;
        std::vector<std::string> queues = retry_queues();
        queues.insert(queues.begin(), queue_name);
        for (const std::string& q : queues) {
            for (const auto& [id, reason] : read_all(q)) {
                out.insert(order_of(id).value_or(0));
                std::fprintf(stderr, "idem_chaos: %s is still in %s\n", id.c_str(), q.c_str());
            }
        }
        return out;
    }

    std::map<long, std::string> dead_letters() override {
        std::map<long, std::string> out;
        for (const auto& [id, reason] : read_all(dead_letter_name))
            out[order_of(id).value_or(0)] = reason;
        return out;
    }

    std::optional<long> order_of(const std::string& message_id) const override {
        return order_of_message_id(message_id);
    }
    std::string message_id_of_order(long order) const override { return message_id_of(order); }

  private:
    struct Counts {
        long ready = -1;
        long unacked = -1;
    };

    /// Ready messages of @p queue (0 when it does not exist yet: the workers declare the retry
    /// and dead-letter queues).
    long ready(const std::string& queue) {
        rmq::QueueDeclare passive;
        passive.passive = true;
        for (int attempt = 1;; ++attempt) {
            try {
                if (!connection_.connected()) connection_.connect();
                if (!connection_.channel_open(ch)) connection_.open_channel(ch);
                return static_cast<long>(connection_.declare_queue(ch, queue, passive).messages);
            } catch (const rmq::channel_error&) {
                return 0;
            } catch (const idem::broker_unavailable&) {
                // The connection dropped (dropped already): idle past its heartbeat, as when a
                // chain's service A takes minutes and B's queue is not looked at meanwhile.
                // Once more on a new one.
                if (attempt == 2) throw;
            }
        }
    }

    /// A retry queue of the workers: chaos.payments.retry.<T>, one per range of delays.
    static bool is_retry_queue(const std::string& name) {
        return name.rfind(std::string(retry_name) + ".", 0) == 0;
    }

    /// rabbitmqctl list_queues: name, ready, unacked per queue. A failed call is tried twice more
    /// (CI once saw one fail with nothing printed on a loaded machine, and the whole run with it):
    /// the count is a question to the broker, not part of what is tested.
    std::vector<std::tuple<std::string, long, long>> ctl_queues() {
        std::string text;
        for (int attempt = 1;; ++attempt) {
            try {
                text = server_.ctl(
                    {"list_queues", "name", "messages_ready", "messages_unacknowledged"});
                break;
            } catch (const std::runtime_error& e) {
                std::fprintf(stderr, "idem_chaos: list_queues, attempt %d of 3: %s\n", attempt,
                             e.what());
                if (attempt == 3) throw;
                std::this_thread::sleep_for(1s);
            }
        }
        std::vector<std::tuple<std::string, long, long>> out;
        std::istringstream lines(text);
        for (std::string line; std::getline(lines, line);) {
            std::istringstream row(line);
            std::string name;
            long r = 0, u = 0;
            if (!(row >> name >> r >> u)) continue;  // the header line
            out.emplace_back(name, r, u);
        }
        return out;
    }

    std::vector<std::string> retry_queues() {
        std::vector<std::string> out;
        for (const auto& [name, r, u] : ctl_queues())
            if (is_retry_queue(name)) out.push_back(name);
        return out;
    }

    /// The broker's figures for chaos.payments and its retry queues, summed.
    Counts ctl_counts() {
        Counts c{0, 0};
        long retrying = 0;
        bool seen = false;
        for (const auto& [name, r, u] : ctl_queues()) {
            if (name == queue_name || is_retry_queue(name)) {
                c.ready += r;
                c.unacked += u;
                seen = true;
            }
            if (is_retry_queue(name)) retrying += r;
        }
        retrying_ = retrying;
        if (!seen) return Counts{};
        return c;
    }

    /// The message id and the idem reason header of everything ready in @p queue, consumed
    /// (after the run).
    std::vector<std::pair<std::string, std::string>> read_all(const std::string& queue) {
        std::vector<std::pair<std::string, std::string>> out;
        if (ready(queue) == 0) return out;
        rmq::Connection reader{endpoint_on(server_.port())};
        reader.connect();
        reader.open_channel(ch);
        reader.consume(ch, queue);
        while (auto m = reader.next_delivery(1s)) {
            out.emplace_back(m->properties.message_id.value_or(""),
                             std::string(m->header_string(rmq::header_reason).value_or("")));
            reader.ack(*m);
        }
        return out;
    }

    idem::testing::RabbitmqServer server_;
    rmq::Connection connection_;
    long messages_ = 0;
    Clock::time_point last_ready_ = Clock::now();
    Clock::time_point last_ctl_{};
    std::optional<Clock::time_point> first_zero_;  ///< the first count of 0 in a row
    long retrying_ = 0;
};

class RabbitmqWorker final : public BrokerWorker {
  public:
    RabbitmqWorker(const Options& options, const WorkerSettings& settings)
        : options_(options), settings_(settings) {}

    void run(const Deliver& deliver) override {
        idem::RabbitMqConsumer consumer{
            endpoint_on(std::stoi(options_.broker_address)),
            rabbitmq_consumer_options(options_, settings_),
            [&](const idem::Delivery& delivery, const idem::RabbitMessage& message) {
                return deliver(delivery, Message{message.properties.message_id.value_or(""),
                                                 Message::decode_fields(message.body)});
            }};
        running_.store(&consumer);
        if (stop_.load()) consumer.request_stop();
        consumer.run();
        running_.store(nullptr);
    }

    void request_stop() noexcept override {
        stop_.store(true);
        if (idem::RabbitMqConsumer* consumer = running_.load()) consumer->request_stop();
    }

  private:
    const Options& options_;
    WorkerSettings settings_;
    std::atomic<bool> stop_{false};
    std::atomic<idem::RabbitMqConsumer*> running_{nullptr};
};

}  // namespace

ChainSender rabbitmq_sender(const std::string& address) {
    auto sender = std::make_shared<idem::RabbitMqSender>(endpoint_on(std::stoi(address)));
    return {queue_name, [sender](const idem::OutboxRow& row) { (*sender)(row); }};
}

std::unique_ptr<BrokerRun> start_rabbitmq(const Options&, const std::filesystem::path&) {
    std::string why;
    if (!idem::testing::RabbitmqServer::available(&why))
        throw server_missing("rabbitmq-server", why);
    return std::make_unique<RabbitmqRun>();
}

idem::RabbitMqConsumerOptions rabbitmq_consumer_options(const Options& options,
                                                        const WorkerSettings& settings) {
    idem::RabbitMqConsumerOptions o;
    o.queue = queue_name;
    o.consumer_tag = settings.consumer_name;
    o.dead_letter = dead_letter_name;
    o.retry_queue = retry_name;
    // One delivery at a time: a killed worker's prefetched deliveries would otherwise come
    // back with raised counts although they never reached the handler. --batch: a batch's
    // worth prefetched and handled together (a killed worker's batch comes back counted).
    o.prefetch = options.batch ? static_cast<std::uint16_t>(batch_size_in_batches) : 1;
    o.batch_size = options.batch ? batch_size_in_batches : 1;
    o.handle_in_batches = options.batch;
    o.poll_wait = 100ms;
    o.in_progress_delay = settings.visibility;
    o.redelivery_backoff = settings.backoff;
    o.on_error = settings.on_error;
    o.store_probe = settings.store_probe;
    return o;
}

std::unique_ptr<BrokerWorker> rabbitmq_worker(const Options& options,
                                              const WorkerSettings& settings) {
    return std::make_unique<RabbitmqWorker>(options, settings);
}

}  // namespace chaos
