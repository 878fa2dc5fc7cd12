// The chaos run over Kafka: librdkafka's mock cluster (idem::testing::KafkaCluster, hosted in a
// forked process of the driver; the Kafka protocol on loopback, not Apache Kafka), a topic
// chaos.payments with 4 partitions read by one consumer group, idem::KafkaConsumer in every
// worker, dead letters produced to chaos.payments.DLT. Each record carries its order's message
// id in the header idem-message-id. Settled means: the group's committed offset of every
// partition reached its end (with --offsets store the workers also commit to Kafka, after the
// store).

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "broker.hpp"
#include "idem/broker/kafka.hpp"
#include "idem/kafka/consumer.hpp"
#include "idem/kafka/producer.hpp"
#include "idem/senders/kafka.hpp"
#include "idem/testing/kafka_cluster.hpp"

namespace chaos {
namespace {

namespace kafka = idem::kafka;

constexpr const char* topic = "chaos.payments";
constexpr const char* dead_topic = "chaos.payments.DLT";
constexpr const char* id_header = "idem-message-id";
constexpr int partitions = 4;

kafka::Config consumer_config(const std::string& servers) {
    return kafka::Config{}
        .bootstrap_servers(servers)
        .auto_offset_reset("earliest")
        .session_timeout(std::chrono::milliseconds(3000))
        .set("heartbeat.interval.ms", "300");
}

class KafkaRun final : public BrokerRun {
  public:
    explicit KafkaRun(bool small_batches) : cluster_(1), small_batches_(small_batches) {
        cluster_.create_topic(topic, partitions);
        cluster_.create_topic(dead_topic, 1);
    }

    std::string worker_address() const override { return cluster_.bootstrap_servers(); }

    void publish(long messages) override {
        messages_ = messages;
        kafka::Config config = kafka::Config{}.bootstrap_servers(cluster_.bootstrap_servers());
        // --batch: record batches of 4 records (the mock cluster's fetch answers one record
        // batch per partition), so a worker's fetch brings a few records of each of its
        // partitions and one poll mixes partitions, as on a busy topic.
        if (small_batches_) config.set("batch.num.messages", "4");
        kafka::Producer producer{config.idempotent()};
        std::vector<std::pair<long, kafka::Pending>> pending;
        for (long order = 1; order <= messages; ++order) {
            const std::string id = message_id_of(order);
            pending.emplace_back(
                order, producer.produce(
                           topic, id,
                           Message::encode_fields({{"order_id", std::to_string(order)},
                                                   {"amount", std::to_string(amount_of(order))}}),
                           {{id_header, id}}));
        }
        for (auto& [order, report] : pending) {
            const kafka::Delivered where = report.wait();
            position_of_order_[order] = {where.partition, where.offset};
            end_[where.partition] = std::max(end_[where.partition], where.offset + 1);
        }
    }

    bool drained() override {
        if (expecting() && !read_to_the_end()) return false;
        const auto committed = committed_offsets();
        for (const auto& [partition, end] : end_) {
            const auto it = committed.find(partition);
            if (it == committed.end() || it->second < end) return false;
        }
        return true;
    }

    std::string progress() override {
        const auto committed = committed_offsets();
        std::int64_t done = 0;
        for (const auto& [partition, offset] : committed)
            done += std::max<std::int64_t>(0, offset);
        return fmt::format("committed {}/{}", done, messages_);
    }

    std::set<long> unsettled_orders() override {
        if (expecting()) return unsettled_when_expecting();
        const auto committed = committed_offsets();
        std::set<long> out;
        for (const auto& [order, where] : position_of_order_) {
            const auto it = committed.find(where.first);
            if (it == committed.end() || it->second <= where.second) out.insert(order);
        }
        return out;
    }

    std::map<long, std::string> dead_letters() override {
        std::map<long, std::string> out;
        kafka::Consumer reader{
            consumer_config(cluster_.bootstrap_servers()).group_id("chaos-dead-letter-reader")};
        reader.subscribe({dead_topic});
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(8);
        while (std::chrono::steady_clock::now() < deadline) {
            auto letter = reader.poll(std::chrono::milliseconds(200));
            if (!letter) continue;
            const auto id = letter->header("idem-message-id");
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
    /// expect(): a reader of its own group reads what the relay produced; end_ becomes the end
    /// of each partition as the last fetch saw it (its high watermark). True once every
    /// partition's end is known and the reader has nothing more to read.
    bool read_to_the_end() {
        if (!end_reader_) {
            end_reader_.emplace(
                consumer_config(cluster_.bootstrap_servers()).group_id("chaos-end-reader"));
            end_reader_->subscribe({topic});
        }
        try {
            for (int i = 0; i < 1000; ++i) {
                auto record = end_reader_->poll(std::chrono::milliseconds(i == 0 ? 20 : 0));
                if (!record) break;
                auto& end = end_[record->partition()];
                end = std::max(end, record->offset() + 1);
            }
            bool known = true;
            for (std::int32_t p = 0; p < partitions; ++p) {
                const auto marks = end_reader_->watermarks({topic, p});
                if (!marks) {
                    known = false;
                    continue;
                }
                end_[p] = std::max(end_[p], marks->second);
                // Not read to the end yet (an empty partition has nothing to read).
                if (marks->second > 0 &&
                    end_reader_->position({{topic, p}}).at(0).offset < marks->second)
                    known = false;
            }
            return known;
        } catch (const idem::broker_error&) {
            return false;
        }
    }

    /// The group's committed offsets, asked of the coordinator by a client that does not join.
    std::map<std::int32_t, std::int64_t> committed_offsets() {
        if (!reader_) {
            reader_.emplace(consumer_config(cluster_.bootstrap_servers()).group_id(group_name));
        }
        kafka::TopicPartitions asked;
        for (std::int32_t p = 0; p < partitions; ++p)
            asked.push_back({topic, p});
        std::map<std::int32_t, std::int64_t> out;
        try {
            for (const kafka::TopicPartition& p : reader_->committed(asked))
                out[p.partition] = p.offset;
        } catch (const idem::broker_error&) {  // the coordinator busy: not drained this time
        }
        return out;
    }

    idem::testing::KafkaCluster cluster_;
    bool small_batches_;
    std::optional<kafka::Consumer> reader_;  ///< after cluster_: closed before it stops
    std::optional<kafka::Consumer> end_reader_;
    long messages_ = 0;
    std::map<long, std::pair<std::int32_t, std::int64_t>> position_of_order_;
    std::map<std::int32_t, std::int64_t> end_;
};

class KafkaWorker final : public BrokerWorker {
  public:
    KafkaWorker(const Options& options, const WorkerSettings& settings)
        : options_(options), settings_(settings) {}

    void run(const Deliver& deliver) override {
        idem::KafkaConsumer consumer{
            consumer_config(options_.broker_address).client_id(settings_.consumer_name),
            kafka_consumer_options(options_, settings_),
            [&](const idem::Delivery& delivery, const idem::KafkaMessage& m) {
                return deliver(delivery,
                               Message{fmt::format("{}/{}/{}", m.topic, m.partition, m.offset),
                                       Message::decode_fields(m.value)});
            }};
        running_.store(&consumer);
        if (stop_.load()) consumer.request_stop();
        consumer.run();
        running_.store(nullptr);
        consumer.close();
    }

    void request_stop() noexcept override {
        stop_.store(true);
        if (idem::KafkaConsumer* consumer = running_.load()) consumer->request_stop();
    }

  private:
    const Options& options_;
    WorkerSettings settings_;
    std::atomic<bool> stop_{false};
    std::atomic<idem::KafkaConsumer*> running_{nullptr};
};

}  // namespace

ChainSender kafka_sender(const std::string& address) {
    idem::KafkaSenderOptions options;
    options.delivery_timeout = std::chrono::seconds(10);
    auto sender =
        std::make_shared<idem::KafkaSender>(kafka::Config{}.bootstrap_servers(address), options);
    return {topic, [sender](const idem::OutboxRow& row) { (*sender)(row); }};
}

std::unique_ptr<BrokerRun> start_kafka(const Options& options) {
    return std::make_unique<KafkaRun>(options.batch);
}

std::unique_ptr<BrokerWorker> kafka_worker(const Options& options, const WorkerSettings& settings) {
    return std::make_unique<KafkaWorker>(options, settings);
}

idem::KafkaConsumerOptions kafka_consumer_options(const Options& options,
                                                  const WorkerSettings& settings) {
    idem::KafkaConsumerOptions consumer_options{{topic}, group_name};
    consumer_options.id_field = id_header;
    consumer_options.dead_letter = dead_topic;
    // One record at a time (--poll records per poll, 1 unless given: a killed worker then leaves
    // at most the record in hand). --batch: up to batch_size_in_batches records of one partition
    // per poll, in one handle_batch().
    consumer_options.batch_size = options.batch ? batch_size_in_batches : options.poll;
    consumer_options.handle_in_batches = options.batch;
    consumer_options.poll_wait = std::chrono::milliseconds(100);
    consumer_options.redelivery_backoff = settings.backoff;
    consumer_options.on_error = settings.on_error;
    consumer_options.store_probe = settings.store_probe;
    if (options.relayed || options.role == Role::service_a) {
        // A chain's services: max.poll.interval.ms (the visibility timeout) past any run, so
        // that a client never re-sends, under a member id the mock may have given another member
        // since, a JoinGroup the mock dropped (it would after max.poll.interval.ms + 3 s);
        // docs/chain.md, "Kafka's mock cluster".
        consumer_options.visibility_timeout = std::chrono::hours(1);
    }
    return consumer_options;
}

kafka::Config kafka_worker_config(const Options& options, const WorkerSettings& settings) {
    return consumer_config(options.broker_address).client_id(settings.consumer_name);
}

}  // namespace chaos
