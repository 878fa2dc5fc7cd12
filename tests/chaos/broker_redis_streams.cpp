// The chaos run's default broker: a Redis stream (chaos:payments) read through a consumer group
// by idem::RedisStreamConsumer, in the run's own redis-server (the one the gateway uses).

#include <atomic>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "broker.hpp"
#include "idem/broker/redis_streams.hpp"
#include "idem/redis/connection.hpp"
#include "idem/senders/redis_streams.hpp"

namespace chaos {
namespace {

idem::RedisEndpoint endpoint_on(int port) {
    idem::RedisEndpoint endpoint;
    endpoint.host = "127.0.0.1";
    endpoint.port = port;
    return endpoint;
}

/// The field a relayed message carries its key in (the sender's default, the consumer's id_field).
std::string relayed_id_field() {
    return idem::RedisStreamSenderOptions{}.id_field;
}

/// Where a worker reads: "<port>" (the run's stream chaos:payments) or "<port>/<stream>" (the
/// chain's second service, on a stream of its own so that a chain redis:redis has two); the
/// stream's dead letters go to "<stream>.dead-letters".
struct Place {
    int port = 0;
    std::string stream = stream_key;
    [[nodiscard]] std::string dead_letters() const { return stream + ".dead-letters"; }

    static Place of(const std::string& address) {
        Place place;
        const auto slash = address.find('/');
        place.port = std::stoi(address.substr(0, slash));
        if (slash != std::string::npos) place.stream = address.substr(slash + 1);
        return place;
    }
};

constexpr const char* relayed_stream = "chaos:settlements";

struct GroupState {
    long long pending = 0;
    std::string last_delivered_id;
    long long entries_read = -1;  // -1: the server does not say (Redis < 7)
};

class RedisStreamsRun final : public BrokerRun {
  public:
    /// @p redrive: each entry also carries its message id (message_id_of) in the relayed id
    /// field, the field a redriven copy carries it in, and expect() keeps the stream.
    RedisStreamsRun(int port, bool redrive) : redis_(endpoint_on(port)), redrive_(redrive) {
        place_.port = port;
        create_group();
    }

    std::string worker_address() const override {
        return expecting() ? fmt::format("{}/{}", place_.port, place_.stream)
                           : std::to_string(place_.port);
    }

    void expect(long messages) override {
        BrokerRun::expect(messages);
        if (redrive_) return;  // the redriven copies come to the same stream
        place_.stream = relayed_stream;
        create_group();
    }

    void publish(long messages) override {
        messages_ = messages;
        for (long first = 1; first <= messages; first += 500) {
            std::vector<std::vector<std::string>> commands;
            for (long order = first; order < first + 500 && order <= messages; ++order) {
                commands.push_back({"XADD", place_.stream, "*", "order_id", std::to_string(order),
                                    "amount", std::to_string(amount_of(order))});
                if (redrive_) {
                    commands.back().insert(commands.back().end(),
                                           {relayed_id_field(), message_id_of(order)});
                }
            }
            const auto replies = redis_.pipeline(commands);
            for (std::size_t i = 0; i < replies.size(); ++i) {
                if (replies[i].is_error()) throw std::runtime_error("XADD: " + replies[i].str);
                last_id_ = replies[i].str;
                order_of_entry_[last_id_] = first + static_cast<long>(i);
                entry_of_order_[first + static_cast<long>(i)] = last_id_;
            }
        }
    }

    bool drained() override {
        const GroupState state = group_state();
        return state.pending == 0 && state.last_delivered_id == last_entry_id();
    }

    std::string progress() override {
        const GroupState state = group_state();
        return fmt::format(
            "read {}/{}, pending {}",
            state.entries_read >= 0 ? std::to_string(state.entries_read) : std::string("?"),
            messages_, state.pending);
    }

    std::set<long> unsettled_orders() override {
        if (expecting()) return unsettled_when_expecting();
        std::set<long> out;
        for (const auto& row : redis_
                                   .checked({"XPENDING", place_.stream, group_name, "-", "+",
                                             std::to_string(messages_ + 1)},
                                            "XPENDING")
                                   .elements) {
            if (row.elements.empty()) continue;
            if (auto order = order_of(row.elements[0].str)) out.insert(*order);
        }
        return out;
    }

    std::map<long, std::string> dead_letters() override {
        // Each dead-letter stream entry names the original entry id and the reason.
        std::map<long, std::string> out;
        for (const auto& entry :
             redis_.checked({"XRANGE", place_.dead_letters(), "-", "+"}, "XRANGE").elements) {
            if (entry.elements.size() < 2) continue;
            const auto& fields = entry.elements[1].elements;
            long order = 0;
            std::string reason;
            for (std::size_t i = 0; i + 1 < fields.size(); i += 2) {
                if (fields[i].str ==
                    (expecting() || redrive_ ? relayed_id_field() : "idem-original-entry-id"))
                    order = order_of(fields[i + 1].str).value_or(0);
                if (fields[i].str == "idem-reason") reason = fields[i + 1].str;
            }
            out[order] = reason;
        }
        return out;
    }

    std::optional<long> order_of(const std::string& message_id) const override {
        if (expecting() || redrive_) {
            if (auto order = order_of_message_id(message_id)) return order;
        }
        const auto found = order_of_entry_.find(message_id);  // an entry id (XPENDING's)
        if (found == order_of_entry_.end()) return std::nullopt;
        return found->second;
    }
    std::string message_id_of_order(long order) const override {
        if (expecting() || redrive_) return message_id_of(order);
        const auto found = entry_of_order_.find(order);
        return found == entry_of_order_.end() ? std::string() : found->second;
    }

  private:
    /// The group on place_.stream (made once: a chain redis:redis has two runs in one server).
    void create_group() {
        const idem::redis::Reply reply =
            redis_.command({"XGROUP", "CREATE", place_.stream, group_name, "0", "MKSTREAM"});
        if (reply.is_error() && reply.str.rfind("BUSYGROUP", 0) != 0)
            throw std::runtime_error("XGROUP CREATE: " + reply.str);
    }

    /// The last entry published (expect(): the stream's last-generated-id, whoever added it).
    std::string last_entry_id() {
        if (!expecting()) return last_id_;
        const idem::redis::Reply reply =
            redis_.checked({"XINFO", "STREAM", place_.stream}, "XINFO STREAM");
        for (std::size_t i = 0; i + 1 < reply.elements.size(); i += 2) {
            if (reply.elements[i].str == "last-generated-id") return reply.elements[i + 1].str;
        }
        throw std::runtime_error("XINFO STREAM: no last-generated-id");
    }

    GroupState group_state() {
        const idem::redis::Reply reply =
            redis_.checked({"XINFO", "GROUPS", place_.stream}, "XINFO GROUPS");
        for (const idem::redis::Reply& group : reply.elements) {
            GroupState state;
            bool ours = false;
            for (std::size_t i = 0; i + 1 < group.elements.size(); i += 2) {
                const std::string& name = group.elements[i].str;
                const idem::redis::Reply& value = group.elements[i + 1];
                if (name == "name") ours = value.str == group_name;
                if (name == "pending") state.pending = value.integer;
                if (name == "last-delivered-id") state.last_delivered_id = value.str;
                if (name == "entries-read") state.entries_read = value.integer;  // nil: none yet
            }
            if (ours) return state;
        }
        throw std::runtime_error("the consumer group is gone");
    }

    Place place_;
    idem::redis::Connection redis_;
    bool redrive_;
    long messages_ = 0;
    std::string last_id_;
    std::map<std::string, long> order_of_entry_;
    std::map<long, std::string> entry_of_order_;
};

class RedisStreamsWorker final : public BrokerWorker {
  public:
    RedisStreamsWorker(const Options& options, const WorkerSettings& settings)
        : options_(options), settings_(settings) {}

    void run(const Deliver& deliver) override {
        const Place place = Place::of(options_.broker_address);
        const idem::RedisStreamConsumerOptions consumer_options =
            redis_streams_consumer_options(options_, settings_);
        idem::RedisStreamConsumer consumer{
            endpoint_on(place.port), consumer_options,
            [&](const idem::Delivery& delivery, const idem::StreamEntry& entry) {
                return deliver(delivery, stream_message_of(entry));
            }};
        running_.store(&consumer);
        if (stop_.load()) consumer.request_stop();
        consumer.run();
        running_.store(nullptr);
    }

    void request_stop() noexcept override {
        stop_.store(true);
        if (idem::RedisStreamConsumer* consumer = running_.load()) consumer->request_stop();
    }

  private:
    const Options& options_;
    WorkerSettings settings_;
    std::atomic<bool> stop_{false};
    std::atomic<idem::RedisStreamConsumer*> running_{nullptr};
};

}  // namespace

ChainSender redis_streams_sender(const std::string& address) {
    const Place place = Place::of(address);
    auto sender = std::make_shared<idem::RedisStreamSender>(endpoint_on(place.port));
    return {place.stream, [sender](const idem::OutboxRow& row) { (*sender)(row); }};
}

std::unique_ptr<BrokerRun> start_redis_streams(const Options& options, int redis_port) {
    return std::make_unique<RedisStreamsRun>(redis_port, options.redrive);
}

Message stream_message_of(const idem::StreamEntry& entry) {
    if (const auto payload = entry.field(idem::RedisStreamSenderOptions{}.payload_field))
        return Message{entry.id, Message::decode_fields(*payload)};
    return Message{entry.id, entry.fields};
}

idem::RedisStreamConsumerOptions redis_streams_consumer_options(const Options& options,
                                                                const WorkerSettings& settings) {
    idem::RedisStreamConsumerOptions consumer_options;
    const Place place = Place::of(options.broker_address);
    consumer_options.stream = place.stream;
    consumer_options.group = group_name;
    consumer_options.consumer = settings.consumer_name;
    consumer_options.dead_letter = place.dead_letters();
    // One entry at a time: a killed worker's unhandled batch would otherwise be redelivered
    // with raised delivery counts although it never reached the handler. --batch: a batch
    // read and handled together.
    consumer_options.batch_size = options.batch ? batch_size_in_batches : 1;
    consumer_options.handle_in_batches = options.batch;
    consumer_options.poll_wait = std::chrono::milliseconds(100);
    consumer_options.visibility_timeout = settings.visibility;
    consumer_options.redelivery_backoff = settings.backoff;
    consumer_options.on_error = settings.on_error;
    consumer_options.store_probe = settings.store_probe;
    if (settings.relayed || options.redrive) consumer_options.id_field = relayed_id_field();
    return consumer_options;
}

std::unique_ptr<BrokerWorker> redis_streams_worker(const Options& options,
                                                   const WorkerSettings& settings) {
    return std::make_unique<RedisStreamsWorker>(options, settings);
}

}  // namespace chaos
