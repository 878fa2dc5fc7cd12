// idem_chaos --worker: one worker process. A RedisStreamConsumer reads the payments stream; each
// entry goes to the handler under test (an IdempotentHandler whose effect charges the gateway with
// key("capture", order) and records the capture in the claim's transaction), and the worker kills
// itself with SIGKILL, with a seeded probability, at each named crash window. In a chained run
// (--chain A:B) a worker is service A (--role a: AcceptEffect, the order's row and its outbox
// intent), the relay (--role relay) or service B (--relayed: the capture, read from the relay's
// messages).
//
// To put your own handler through the same run, replace CaptureEffect (and record_capture) below
// and the verification in driver.cpp (captures_by_order); everything else stays.

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "broker.hpp"
#include "chaos.hpp"
#include "gateway.hpp"
#include "idem/broker/redis_streams.hpp"
#include "idem/idem.hpp"
#include "idem/outbox.hpp"
#include "idem/store/mysql.hpp"
#include "idem/store/postgres.hpp"
#include "idem/store/redis.hpp"
#include "idem/store/sqlite.hpp"
#ifdef IDEM_CHAOS_WITH_KAFKA
#include "idem/broker/kafka.hpp"
#include "idem/contract/stored_offset.hpp"
#endif
#ifdef IDEM_CHAOS_WITH_RABBITMQ
#include "idem/broker/rabbitmq.hpp"
#endif
#ifdef IDEM_CHAOS_WITH_NATS
#include "idem/broker/nats_jetstream.hpp"
#endif

namespace chaos {
namespace {

std::atomic<BrokerWorker*> running_worker{nullptr};
volatile sig_atomic_t stopping = 0;

std::atomic<idem::RedisStreamConsumer*> running_consumer{nullptr};  ///< --pipelined, --batch
#ifdef IDEM_CHAOS_WITH_KAFKA
std::atomic<idem::KafkaConsumer*> running_kafka{nullptr};  ///< --offsets store, --batch
#endif
#ifdef IDEM_CHAOS_WITH_RABBITMQ
std::atomic<idem::RabbitMqConsumer*> running_rabbit{nullptr};  ///< --batch
#endif
#ifdef IDEM_CHAOS_WITH_NATS
std::atomic<idem::JetStreamConsumer*> running_nats{nullptr};  ///< --batch
#endif

extern "C" void on_sigterm(int) {
    stopping = 1;
    if (BrokerWorker* worker = running_worker.load()) worker->request_stop();
    if (idem::RedisStreamConsumer* consumer = running_consumer.load()) consumer->request_stop();
#ifdef IDEM_CHAOS_WITH_KAFKA
    if (idem::KafkaConsumer* consumer = running_kafka.load()) consumer->request_stop();
#endif
#ifdef IDEM_CHAOS_WITH_RABBITMQ
    if (idem::RabbitMqConsumer* consumer = running_rabbit.load()) consumer->request_stop();
#endif
#ifdef IDEM_CHAOS_WITH_NATS
    if (idem::JetStreamConsumer* consumer = running_nats.load()) consumer->request_stop();
#endif
}

/// Runs @p consumer until SIGTERM (published in @p running for the signal handler).
template <class Consumer>
int run_until_stopped(Consumer& consumer, std::atomic<Consumer*>& running) {
    running.store(&consumer);
    if (stopping != 0) consumer.request_stop();
    consumer.run();
    running.store(nullptr);
    return 0;
}

/// Kills this process at a crash window with the run's probability; counts the kill first (in
/// Redis, so the driver can say where the workers died).
class CrashWindows {
  public:
    CrashWindows(double rate, std::mt19937_64& random, idem::redis::Connection& redis)
        : rate_(rate), random_(random), redis_(redis) {}

    void maybe_die(Window window) {
        if (stopping != 0 || rate_ <= 0.0) return;
        if (std::uniform_real_distribution<double>(0.0, 1.0)(random_) >= rate_) return;
        try {
            redis_.command({"HINCRBY", self_kills_key, window_names[window], "1"});
        } catch (...) {  // dying matters more than counting
        }
        ::raise(SIGKILL);
    }

  private:
    double rate_;
    std::mt19937_64& random_;
    idem::redis::Connection& redis_;
};

/// The history lines of one delivery (chaos.hpp's history_key).
std::int64_t unix_ms() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
}
std::vector<std::string> history_start(const idem::Delivery& delivery, const std::string& worker) {
    return {"RPUSH", history_key(delivery.message_id),
            fmt::format("{} d{} {} start", unix_ms(), delivery.delivery_count.value(), worker)};
}
std::vector<std::string> history_outcome(const idem::Delivery& delivery, const std::string& worker,
                                         const idem::Outcome& outcome) {
    return {"RPUSH", history_key(delivery.message_id),
            fmt::format("{} d{} {} {}{}{}", unix_ms(), delivery.delivery_count.value(), worker,
                        idem::to_string(outcome.disposition), outcome.reason.empty() ? "" : ": ",
                        outcome.reason)};
}

struct Capture {
    long order_id = 0;
    long amount = 0;
};

long number_field(const Message& message, const char* name) {
    const auto value = message.field(name);
    if (!value || value->empty()) {
        throw idem::malformed_message(fmt::format("message {} has no {}", message.broker_id, name));
    }
    long n = 0;
    for (char c : *value) {
        if (c < '0' || c > '9') {
            throw idem::malformed_message(
                fmt::format("message {}: {} is not a number", message.broker_id, name));
        }
        n = n * 10 + (c - '0');
    }
    return n;
}

Capture parse_capture(const Message& message) {
    return Capture{number_field(message, "order_id"), number_field(message, "amount")};
}

// The capture row, written through the claim's transaction. A plain table or list: no unique
// constraint, so the verification SEES a second capture instead of a constraint hiding it.
void record_capture(idem::SqliteStore::Transaction& tx, long order, const std::string& reference) {
    tx.execute("INSERT INTO captures(order_id, gateway_reference) VALUES (?, ?)", order, reference);
}
void record_capture(idem::PostgresStore::Transaction& tx, long order,
                    const std::string& reference) {
    tx.execute("INSERT INTO captures(order_id, gateway_reference) VALUES ($1, $2)", order,
               reference);
}
void record_capture(idem::MysqlStore::Transaction& tx, long order, const std::string& reference) {
    tx.execute("INSERT INTO captures(order_id, gateway_reference) VALUES (?, ?)", order, reference);
}
void record_capture(idem::RedisStore::Transaction& tx, long order, const std::string& reference) {
    // Applied by the commit script; on a Cluster in the claim's slot (its hash tag), atomically.
    const std::string tag = tx.store().is_cluster() ? tx.claim_tag() : std::string();
    tx.write("RPUSH", redis_captures_key(order) + tag, reference);
}

/// --redrive: the handler's bug. A poisoned order (chaos.hpp) fails until the driver sets
/// fixed_key; each of its deliveries asks the run's Redis.
class PoisonSwitch {
  public:
    PoisonSwitch(idem::redis::Connection& redis, bool enabled) : redis_(redis), enabled_(enabled) {}

    void check(long order) const {
        if (!enabled_ || !poisoned(order)) return;
        if (redis_.checked({"GET", fixed_key}, "GET").str == "1") return;
        throw std::runtime_error(
            fmt::format("poison: order {} fails until the handler is fixed", order));
    }

  private:
    idem::redis::Connection& redis_;
    bool enabled_;
};

// ---------------------------------------------------------------------------------------------
// The handler under test: the field note's capture, as a user writes it with idem.
struct CaptureEffect {
    GatewayClient* gateway;
    CrashWindows* windows;
    const PoisonSwitch* poison;

    template <class Tx>
    void operator()(Tx& tx, const Message& entry) const {
        const Capture capture = parse_capture(entry);
        poison->check(capture.order_id);
        windows->maybe_die(after_claim);
        const std::string reference = gateway->capture(idem::key("capture", capture.order_id),
                                                       capture.order_id, capture.amount);
        windows->maybe_die(after_external_call);
        record_capture(tx, capture.order_id, reference);
        windows->maybe_die(before_commit);
    }
};

// The negative control (--naive): the handler as first written. No claim, a fresh gateway key on
// every attempt ("the original bug with an extra API parameter"), the capture committed on its own.
template <class Store>
idem::Outcome naive_capture(Store& store, idem::redis::Connection& redis, GatewayClient& gateway,
                            CrashWindows& windows, std::mt19937_64& random, const Message& entry) {
    const Capture capture = parse_capture(entry);
    windows.maybe_die(after_claim);
    const std::string fresh_key = fmt::format("capture-{}-{:016x}", capture.order_id, random());
    const std::string reference = gateway.capture(fresh_key, capture.order_id, capture.amount);
    windows.maybe_die(after_external_call);
    windows.maybe_die(before_commit);
    if constexpr (std::is_same_v<Store, idem::SqliteStore> ||
                  std::is_same_v<Store, idem::MysqlStore>) {
        store.execute("INSERT INTO captures(order_id, gateway_reference) VALUES (?, ?)",
                      capture.order_id, reference);
    } else if constexpr (std::is_same_v<Store, idem::PostgresStore>) {
        store.execute("INSERT INTO captures(order_id, gateway_reference) VALUES ($1, $2)",
                      capture.order_id, reference);
    } else {
        redis.checked({"RPUSH", redis_captures_key(capture.order_id), reference}, "RPUSH");
    }
    return {idem::Disposition::processed, {}};
}

// ---------------------------------------------------------------------------------------------

/// A store constructor may meet a database busy with a killed worker's recovery: retry a while.
template <class Make>
auto with_retries(const char* what, Make make) -> decltype(make()) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    for (;;) {
        try {
            return make();
        } catch (const idem::store_error& e) {
            if (std::chrono::steady_clock::now() >= deadline) {
                throw std::runtime_error(fmt::format("{}: {}", what, e.what()));
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
    }
}

/// --pipelined: what the plain form's wrapper counts (deliveries, their counts, outcomes). A
/// delivery whose effect runs is counted as it starts (count(), from the effect: a worker killed
/// in it still counts it); the others, and every outcome, as the handler settles them — with the
/// PipelinedLoop that is once the commit's reply came, while the next entry's fresh lease is
/// held: the after_commit_before_ack window then also kills a worker holding that lease.
class SettleCounter final : public idem::Observer {
  public:
    SettleCounter(idem::redis::Connection& redis, CrashWindows& windows, std::string worker)
        : redis_(redis), windows_(windows), worker_(std::move(worker)) {}

    void count(const idem::Delivery& delivery) {
        try {
            redis_.pipeline(
                {{"INCR", delivered_key},
                 {"HINCRBY", counts_key, std::to_string(delivery.delivery_count.value()), "1"},
                 history_start(delivery, worker_)});
        } catch (const idem::error&) {  // a lost count must not turn a commit into a failure
        }
    }
    void on_outcome(std::string_view, const idem::Delivery&, const idem::Outcome&) override {}
    void on_detailed_outcome(std::string_view, const idem::Delivery& delivery,
                             const idem::Outcome& outcome,
                             const idem::OutcomeDetails& details) override {
        if (!details.effect_ran) count(delivery);
        try {
            redis_.pipeline(
                {{"HINCRBY", outcomes_key, std::string(idem::to_string(outcome.disposition)), "1"},
                 history_outcome(delivery, worker_, outcome)});
        } catch (const idem::error&) {
        }
        if (idem::should_ack(outcome)) windows_.maybe_die(after_commit_before_ack);
    }

  private:
    idem::redis::Connection& redis_;
    CrashWindows& windows_;
    std::string worker_;
};

/// --pipelined: the RedisStreamConsumer given the IdempotentHandler itself (its effect reads the
/// entry as a Message), several entries per poll, so on a RedisStore each commit goes with the
/// next claim.
template <class Store>
int consume_pipelined(Store& store, const Options& options, idem::redis::Connection& redis,
                      GatewayClient& gateway, CrashWindows& windows, const PoisonSwitch& poison,
                      const idem::PolicyOptions& policy_options, const WorkerSettings& settings) {
    SettleCounter counter{redis, windows, settings.consumer_name};
    const CaptureEffect capture{&gateway, &windows, &poison};
    auto handler = idem::make_handler(
        store, idem::Policy{scope_name, policy_options},
        [capture, &counter](auto& tx, const idem::StreamEntry& entry,
                            const idem::Delivery& delivery) {
            counter.count(delivery);
            capture(tx, Message{entry.id, entry.fields});
        },
        &counter);
    idem::RedisStreamConsumerOptions consumer_options;
    consumer_options.stream = stream_key;
    consumer_options.group = group_name;
    consumer_options.consumer = settings.consumer_name;
    consumer_options.dead_letter = dead_letter_stream_key;
    consumer_options.batch_size = 4;  // a killed worker's unhandled entries come back counted
    consumer_options.poll_wait = std::chrono::milliseconds(100);
    consumer_options.visibility_timeout = settings.visibility;
    consumer_options.redelivery_backoff = settings.backoff;
    consumer_options.on_error = settings.on_error;
    idem::RedisEndpoint broker;
    broker.host = "127.0.0.1";
    broker.port = std::stoi(options.broker_address);
    idem::RedisStreamConsumer consumer{broker, consumer_options, handler};
    running_consumer.store(&consumer);
    if (stopping != 0) consumer.request_stop();
    consumer.run();
    running_consumer.store(nullptr);
    return 0;
}

#ifdef IDEM_CHAOS_WITH_KAFKA
/// --offsets store: the KafkaConsumer given the IdempotentHandler itself, so each record's next
/// offset commits in the claim's transaction; counted as --pipelined is (SettleCounter).
template <class Store>
int consume_kafka_offsets_in_store(Store& store, const Options& options,
                                   idem::redis::Connection& redis, GatewayClient& gateway,
                                   CrashWindows& windows, const PoisonSwitch& poison,
                                   const idem::PolicyOptions& policy_options,
                                   const WorkerSettings& settings) {
    if constexpr (!idem::has_stored_offsets<Store>::value) {
        throw std::invalid_argument("--offsets store needs a store that keeps offsets");
    } else {
        SettleCounter counter{redis, windows, settings.consumer_name};
        const CaptureEffect capture{&gateway, &windows, &poison};
        auto handler = idem::make_handler(
            store, idem::Policy{scope_name, policy_options},
            [capture, &counter](auto& tx, const idem::KafkaMessage& record,
                                const idem::Delivery& delivery) {
                counter.count(delivery);
                capture(tx, Message{fmt::format("{}/{}/{}", record.topic, record.partition,
                                                record.offset),
                                    Message::decode_fields(record.value)});
            },
            &counter);
        idem::KafkaConsumerOptions consumer_options{{"chaos.payments"}, group_name};
        consumer_options.offsets = idem::KafkaOffsets::in_store;
        consumer_options.id_field = "idem-message-id";
        consumer_options.dead_letter = "chaos.payments.DLT";
        consumer_options.batch_size = 1;
        consumer_options.poll_wait = std::chrono::milliseconds(100);
        consumer_options.redelivery_backoff = settings.backoff;
        consumer_options.on_error = settings.on_error;
        idem::KafkaConsumer consumer{kafka_worker_config(options, settings), consumer_options,
                                     handler};
        running_kafka.store(&consumer);
        if (stopping != 0) consumer.request_stop();
        consumer.run();
        running_kafka.store(nullptr);
        consumer.close();
        return 0;
    }
}
#endif

// --batch: each broker's message as the capture effect reads it (the plain workers' Message).
inline Message message_of(const idem::StreamEntry& entry) {
    return stream_message_of(entry);
}
#ifdef IDEM_CHAOS_WITH_RABBITMQ
inline Message message_of(const idem::RabbitMessage& message) {
    return Message{message.properties.message_id.value_or(""),
                   Message::decode_fields(message.body)};
}
#endif
#ifdef IDEM_CHAOS_WITH_NATS
inline Message message_of(const idem::JetStreamMessage& message) {
    return Message{fmt::format("{}:{}", message.stream, message.stream_sequence),
                   Message::decode_fields(message.data)};
}
#endif
#ifdef IDEM_CHAOS_WITH_KAFKA
inline Message message_of(const idem::KafkaMessage& record) {
    return Message{fmt::format("{}/{}/{}", record.topic, record.partition, record.offset),
                   Message::decode_fields(record.value)};
}
#endif

/// --batch: the broker's consumer given the IdempotentHandler itself, with handle_in_batches
/// (each broker's *_consumer_options): each poll's deliveries in one handle_batch()
/// transaction; counted as --pipelined is (SettleCounter), the after_commit_before_ack window
/// once the batch's commit came back. A Redis stream on a RedisStore of the stream's server
/// acks in the commit.
template <class Store>
int consume_batches(Store& store, const Options& options, idem::redis::Connection& redis,
                    GatewayClient& gateway, CrashWindows& windows, const PoisonSwitch& poison,
                    const idem::PolicyOptions& policy_options, const WorkerSettings& settings) {
    SettleCounter counter{redis, windows, settings.consumer_name};
    const CaptureEffect capture{&gateway, &windows, &poison};
    auto handler = idem::make_handler(
        store, idem::Policy{scope_name, policy_options},
        [capture, &counter](auto& tx, const auto& body, const idem::Delivery& delivery) {
            counter.count(delivery);
            capture(tx, message_of(body));
        },
        &counter);
    switch (options.broker) {
        case BrokerKind::redis_streams: {
            idem::RedisEndpoint broker;
            broker.host = "127.0.0.1";
            broker.port = std::stoi(options.broker_address);
            idem::RedisStreamConsumer consumer{
                broker, redis_streams_consumer_options(options, settings), handler};
            return run_until_stopped(consumer, running_consumer);
        }
        case BrokerKind::rabbitmq: {
#ifdef IDEM_CHAOS_WITH_RABBITMQ
            idem::RabbitEndpoint broker;
            broker.host = "127.0.0.1";
            broker.port = std::stoi(options.broker_address);
            idem::RabbitMqConsumer consumer{broker, rabbitmq_consumer_options(options, settings),
                                            handler};
            return run_until_stopped(consumer, running_rabbit);
#else
            break;
#endif
        }
        case BrokerKind::nats: {
#ifdef IDEM_CHAOS_WITH_NATS
            idem::nats::Endpoint broker{options.broker_address};
            broker.name = settings.consumer_name;
            idem::JetStreamConsumer consumer{broker, nats_consumer_options(options, settings),
                                             handler};
            return run_until_stopped(consumer, running_nats);
#else
            break;
#endif
        }
        case BrokerKind::kafka: {
#ifdef IDEM_CHAOS_WITH_KAFKA
            idem::KafkaConsumer consumer{kafka_worker_config(options, settings),
                                         kafka_consumer_options(options, settings), handler};
            const int status = run_until_stopped(consumer, running_kafka);
            consumer.close();
            return status;
#else
            break;
#endif
        }
    }
    throw std::invalid_argument(std::string("idem_chaos was built without the ") +
                                to_string(options.broker) + " adapter");
}

// ---------------------------------------------------------------------------------------------
// The chained run (--chain A:B, chain.cpp).

/// Service A's effect: the order's row and, in the same transaction, the outbox intent for
/// service B keyed idem::key("order", id) (the harness's message id of the order). --naive: a
/// plain publish to broker B inside the effect instead, before the commit.
struct AcceptEffect {
    const ChainSender* sender;
    CrashWindows* windows;
    bool naive;

    void operator()(idem::SqliteStore::Transaction& tx, const Message& entry) const {
        const Capture order = parse_capture(entry);
        windows->maybe_die(after_claim);
        tx.execute("INSERT INTO accepted(order_id) VALUES (?)", order.order_id);
        const std::string key = idem::key("order", order.order_id);
        const std::string payload =
            Message::encode_fields({{"order_id", std::to_string(order.order_id)},
                                    {"amount", std::to_string(order.amount)}});
        if (naive) {
            idem::OutboxRow row;
            row.destination = sender->destination;
            row.idempotency_key = key;
            row.payload = payload;
            sender->send(row);
        } else {
            idem::outbox(tx, sender->destination, key, payload);
        }
        windows->maybe_die(after_external_call);
        windows->maybe_die(before_commit);
    }
};

/// --redrive --naive: what an operator without idem's redrive does: re-publishes each dead
/// letter's payload under its message id, its claim left as it is (still dead_lettered).
template <class Store>
void naive_redrive(Store& store, const ChainSender& sender, idem::redis::Connection& redis,
                   CrashWindows& windows) {
    idem::DeadLetterSelection selection;
    selection.scope = scope_name;
    for (const idem::DeadLetter& letter : store.dead_letters(selection)) {
        if (redis.checked({"SISMEMBER", naive_redriven_key, letter.message_id}, "SISMEMBER")
                .integer != 0) {
            continue;
        }
        idem::OutboxRow row;
        row.destination = sender.destination;
        row.idempotency_key = letter.message_id;
        row.payload = letter.payload;
        sender.send(row);
        windows.maybe_die(after_send_before_mark);
        redis.checked({"SADD", naive_redriven_key, letter.message_id}, "SADD");
    }
}

/// The relay: ships the store's outbox to the broker of --broker (the chain's service A's to
/// broker B), killing itself after a send and before the mark with the run's probability (and
/// SIGKILLed by the driver at any moment). As --role redriver it first brings the store's dead
/// letters back once the handler is fixed, in each round: Store::redrive() of the run's scope
/// (a killed redrive wrote nothing of the entry it was in; the next round finds the rest).
template <class Store>
int run_relay(Store& store, const Options& options, idem::redis::Connection& redis,
              CrashWindows& windows) {
    const ChainSender sender = make_sender(options.broker, options.broker_address);
    idem::RelayOptions relay_options;
    relay_options.batch = 10;
    relay_options.lease = std::chrono::milliseconds(2000);  // a killed relay's batch comes back
    relay_options.backoff_base = std::chrono::milliseconds(50);
    relay_options.backoff_max = std::chrono::milliseconds(500);
    relay_options.max_attempts = 1000;
    idem::Relay relay(
        store,
        [&](const idem::OutboxRow& row) {
            sender.send(row);
            try {
                redis.command({"INCR", relay_sends_key});
            } catch (const idem::error&) {
            }
            windows.maybe_die(after_send_before_mark);
        },
        relay_options);
    idem::DeadLetterSelection selection;
    selection.scope = scope_name;
    idem::RedriveOptions redrive;
    redrive.destination = sender.destination;
    auto round = [&] {
        if (options.role == Role::redriver && redis.checked({"GET", fixed_key}, "GET").str == "1") {
            if (options.naive) {
                naive_redrive(store, sender, redis, windows);
            } else {
                for (const idem::RedriveEntry& entry : store.redrive(selection, redrive).entries) {
                    if (entry.status == idem::RedriveStatus::failed ||
                        entry.status == idem::RedriveStatus::processed_meanwhile ||
                        entry.status == idem::RedriveStatus::no_claim) {
                        std::fprintf(stderr, "idem_chaos redriver: %s: %s %s\n",
                                     entry.letter.message_id.c_str(),
                                     std::string(idem::to_string(entry.status)).c_str(),
                                     entry.error.c_str());
                    }
                }
                windows.maybe_die(after_commit_before_ack);
            }
        }
        const idem::RelayResult result = relay.run_once();
        if (result.sent + result.failed + result.parked == 0)
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
    };
    int errors_reported = 0;
    while (stopping == 0) {
        // A store down (--store-outage-ms) fails a round, never the process: the next one
        // finds what is left.
        try {
            round();
        } catch (const idem::error& e) {
            if (++errors_reported <= 3) std::fprintf(stderr, "idem_chaos relay: %s\n", e.what());
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------

/// Runs the broker's consumer until SIGTERM; each delivery goes to @p handle, counted in the
/// run's Redis, with the after_commit_before_ack window after an acking outcome.
int serve(const Options& options, idem::redis::Connection& redis, CrashWindows& windows,
          const WorkerSettings& settings, const BrokerWorker::Deliver& handle) {
    std::unique_ptr<BrokerWorker> worker = make_worker(options, settings);
    // The plain std::function form, wrapping the handler, so the worker can die between the
    // handler's commit and the broker's ack (with the handler form and a RedisStore, the ack of
    // a Redis stream would be part of the commit and that window would not exist).
    running_worker.store(worker.get());
    if (stopping != 0) worker->request_stop();
    worker->run([&](const idem::Delivery& delivery, const Message& entry) {
        for (const idem::redis::Reply& reply : redis.pipeline(
                 {{"INCR", delivered_key},
                  {"HINCRBY", counts_key, std::to_string(delivery.delivery_count.value()), "1"},
                  history_start(delivery, settings.consumer_name)})) {
            if (reply.is_error()) throw std::runtime_error("counting: " + reply.str);
        }
        const idem::Outcome outcome = handle(delivery, entry);
        try {
            redis.pipeline(
                {{"HINCRBY", outcomes_key, std::string(idem::to_string(outcome.disposition)), "1"},
                 history_outcome(delivery, settings.consumer_name, outcome)});
        } catch (const idem::error&) {  // a lost count must not turn a commit into a failure
        }
        if (idem::should_ack(outcome)) windows.maybe_die(after_commit_before_ack);
        return outcome;
    });
    running_worker.store(nullptr);
    return 0;
}

template <class Store>
int consume(Store& store, const Options& options, const idem::RedisEndpoint& endpoint,
            std::mt19937_64& random) {
    idem::redis::Connection redis{endpoint};  // the gateway and the harness's counters
    GatewayClient gateway{redis, options.latency, options.inflight, random};
    CrashWindows windows{options.kill_rate, random, redis};
    const PoisonSwitch poison{redis, options.redrive};

    idem::PolicyOptions policy_options;
    policy_options.max_deliveries = options.max_deliveries;
    policy_options.visibility_timeout = options.visibility;
    if constexpr (std::is_same_v<Store, idem::RedisStore>) {
        policy_options.lease = options.visibility;  // the lease equals the visibility timeout
    }

    WorkerSettings settings;
    static constexpr const char* role_names[] = {"worker", "a-worker", "relay", "redriver"};
    settings.consumer_name = fmt::format("{}-{}-{}", role_names[static_cast<int>(options.role)],
                                         options.slot, ::getpid());
    settings.visibility = options.visibility;
    settings.relayed = options.relayed;
    if (options.backoff_initial.count() >= 0) settings.backoff.initial = options.backoff_initial;
    if (options.backoff_max.count() >= 0) settings.backoff.max = options.backoff_max;
    int errors_reported = 0;
    settings.on_error = [&](const std::exception& e) {
        if (++errors_reported <= 3) std::fprintf(stderr, "idem_chaos worker: %s\n", e.what());
    };
    // --store-outage-ms: the plain handler's store probed while its consumer's circuit breaker
    // is open, so it reads again only once the store answers (without a probe: one pause of
    // the breaker's initial backoff per failure). The IdempotentHandler given to a consumer
    // (--pipelined, --offsets store, --batch) brings its own probe.
    if (options.store_outage.count() > 0) {
        settings.store_probe = [&store] { idem::probe_store(store); };
    }
    if (options.role == Role::relay || options.role == Role::redriver) {
        return run_relay(store, options, redis, windows);
    }
    if constexpr (std::is_same_v<Store, idem::SqliteStore>) {
        if (options.role == Role::service_a) {
            const ChainSender sender = make_sender(options.chain_to, options.to_address);
            auto accept = idem::make_handler(store, idem::Policy{"accept-order", policy_options},
                                             AcceptEffect{&sender, &windows, options.naive});
            return serve(options, redis, windows, settings,
                         [&](const idem::Delivery& delivery, const Message& entry) {
                             return accept.handle(delivery, entry);
                         });
        }
    }
    if (options.pipelined) {
        return consume_pipelined(store, options, redis, gateway, windows, poison, policy_options,
                                 settings);
    }
    if (options.batch) {
        return consume_batches(store, options, redis, gateway, windows, poison, policy_options,
                               settings);
    }
#ifdef IDEM_CHAOS_WITH_KAFKA
    if (options.offsets_in_store) {
        return consume_kafka_offsets_in_store(store, options, redis, gateway, windows, poison,
                                              policy_options, settings);
    }
#endif
    auto handler = idem::make_handler(store, idem::Policy{scope_name, policy_options},
                                      CaptureEffect{&gateway, &windows, &poison});
    return serve(options, redis, windows, settings,
                 [&](const idem::Delivery& delivery, const Message& entry) {
                     return options.naive && !options.redrive
                                ? naive_capture(store, redis, gateway, windows, random, entry)
                                : handler.handle(delivery, entry);
                 });
}

}  // namespace

int run_worker(const Options& options) {
    // Die with the driver (a ctest timeout kills it with SIGKILL): no orphan keeps polling.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != options.parent) return 3;

    struct sigaction action {};
    action.sa_handler = on_sigterm;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGTERM, &action, nullptr);

    std::seed_seq seed{
        static_cast<std::uint32_t>(options.seed), static_cast<std::uint32_t>(options.seed >> 32),
        static_cast<std::uint32_t>(options.slot), static_cast<std::uint32_t>(options.incarnation)};
    std::mt19937_64 random(seed);

    idem::RedisEndpoint endpoint;
    endpoint.host = "127.0.0.1";
    endpoint.port = options.redis_port;

    try {
        switch (options.store) {
            case StoreKind::sqlite: {
                // --store-outage-ms: the driver holds the database's write lock for that long.
                // Under the default busy timeout (5 s) a shorter hold is only a stall that no
                // call reports; with a busy timeout of a quarter of it, every write in it fails
                // with store_timeout, which opens the consumer's circuit breaker: an outage as
                // a user whose lock outlasts the busy timeout sees it.
                idem::SqliteOptions sqlite_options;
                if (options.store_outage.count() > 0) {
                    sqlite_options.busy_timeout =
                        std::min(sqlite_options.busy_timeout,
                                 std::max(std::chrono::milliseconds(50), options.store_outage / 4));
                }
                auto store = with_retries("SqliteStore", [&] {
                    return std::make_unique<idem::SqliteStore>(options.db, sqlite_options);
                });
                return consume(*store, options, endpoint, random);
            }
            case StoreKind::postgres: {
                auto store = with_retries("PostgresStore", [&] {
                    return std::make_unique<idem::PostgresStore>(options.db,
                                                                 options.postgres_options());
                });
                return consume(*store, options, endpoint, random);
            }
            case StoreKind::redis: {
                // --store-outage-ms: the store has a redis-server of its own (--db is its port),
                // so that stopping it leaves the gateway, the counters and the stream alone.
                idem::RedisEndpoint store_endpoint = endpoint;
                if (!options.db.empty()) store_endpoint.port = std::stoi(options.db);
                idem::RedisStore store{store_endpoint};
                return consume(store, options, endpoint, random);
            }
            case StoreKind::redis_cluster: {
                // A master is killed mid-run: commits wait for a replica (WAIT 1).
                idem::RedisOptions redis_options;
                redis_options.replicas_to_ack = 1;
                redis_options.replicas_timeout = std::chrono::milliseconds(200);
                idem::RedisStore store{redis_cluster_seeds_of(options.db), redis_options};
                return consume(store, options, endpoint, random);
            }
            case StoreKind::mysql: {
                auto store = with_retries("MysqlStore", [&] {
                    return std::make_unique<idem::MysqlStore>(
                        mysql_endpoint_of(options.db), options.store_options<idem::MysqlOptions>());
                });
                return consume(*store, options, endpoint, random);
            }
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "idem_chaos worker %d: %s\n", options.slot, e.what());
        return 2;
    }
    return 2;
}

}  // namespace chaos
