// The end-to-end cases over Kafka (built when the kafka component is), on librdkafka's mock
// cluster (idem::testing::KafkaCluster, hosted in a forked process; the Kafka protocol on
// loopback, not Apache Kafka):
//   e2e_kafka_sqlite    KafkaConsumer + IdempotentHandler on SQLite draining N records of a
//                       one-partition topic (16 per poll; the attempt counted in the store, the
//                       claim and effect in one transaction per record; one async offset commit
//                       per poll)  vs  the same group consumer, poll size and INSERTs by hand in
//                       one transaction per record, then the same async offset commit per poll.
//   e2e_kafka_postgres  the same on PostgreSQL.
// Each sample drains a fresh topic filled beforehand (untimed); idem and raw alternate (ABBA).
// Each row also carries the cost of the store-counted attempt (Kafka keeps no delivery count):
// handle() with DeliveryCounter::store against the same handle() with the broker's count, on the
// same store, without Kafka.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "bench.hpp"
#include "idem/broker/kafka.hpp"
#include "idem/idem.hpp"
#include "idem/kafka/consumer.hpp"
#include "idem/kafka/producer.hpp"
#include "idem/store/postgres.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/kafka_cluster.hpp"

namespace idem_bench {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr std::size_t poll_size = 16;
constexpr auto drain_deadline = 300s;

std::unique_ptr<idem::testing::KafkaCluster>& cluster() {
    static std::unique_ptr<idem::testing::KafkaCluster> instance;
    return instance;
}

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

idem::kafka::Config client_config(const std::string& group) {
    return idem::kafka::Config{}
        .bootstrap_servers(cluster()->bootstrap_servers())
        .group_id(group)
        .auto_offset_reset("earliest")
        .session_timeout(3000ms)
        .set("heartbeat.interval.ms", "300");
}

/// A fresh one-partition topic with N records {idem-message-id <prefix><k>, value <k>}, untimed.
void fill(const std::string& topic, const std::string& prefix, std::size_t n) {
    cluster()->create_topic(topic, 1);
    idem::kafka::Producer producer{
        idem::kafka::Config{}.bootstrap_servers(cluster()->bootstrap_servers())};
    for (std::size_t k = 1; k <= n; ++k) {
        const std::string id = prefix + std::to_string(k);
        producer.produce(topic, id, std::to_string(k), {{"idem-message-id", id}});
    }
    producer.flush();
}

/// The raw twin: poll up to 16 records, each written by hand in its own transaction, then one
/// async offset commit for the poll.
template <class Raw>
double drain_raw(Raw& raw, const std::string& topic, std::size_t n) {
    idem::kafka::Consumer consumer{client_config("raw-" + topic)};
    consumer.subscribe({topic});
    std::size_t done = 0;
    std::optional<Clock::time_point> start;
    while (done < n) {
        std::optional<idem::kafka::TopicPartition> position;
        for (std::size_t i = 0; i < poll_size && done < n; ++i) {
            auto record = consumer.poll(i == 0 ? 1000ms : 0ms);
            if (!record) break;
            if (!start) start = Clock::now();  // from the first record: the join is not timed
            const auto id = record->header("idem-message-id");
            if (!id) throw std::runtime_error("raw: a record without idem-message-id");
            raw.begin();
            raw.insert_claim(scope, *id);
            raw.insert_effect(*id, std::stoll(std::string(record->value())));
            raw.commit();
            position = record->next_position();
            ++done;
        }
        if (position) consumer.commit({*position}, idem::kafka::CommitMode::async);
        if (start && Clock::now() - *start > drain_deadline) {
            throw std::runtime_error("raw: too slow");
        }
    }
    const double rate = static_cast<double>(n) / seconds_since(*start);
    consumer.close();
    return rate;
}

template <class Handler>
double drain_idem(Handler& handler, const std::string& topic, std::size_t n) {
    idem::KafkaConsumerOptions options{{topic}, "idem-" + topic};
    options.id_field = "idem-message-id";
    options.batch_size = poll_size;
    options.poll_wait = 1000ms;
    idem::KafkaConsumer consumer{client_config(options.group), options, handler};
    std::optional<Clock::time_point> start;
    std::size_t handled = 0;
    std::size_t untimed = 0;  // the first poll's records: handled before the clock started
    while (handled < n) {
        const std::size_t now = consumer.poll_once();
        if (now != 0 && !start) {  // the join and the first fetch are not timed
            start = Clock::now();
            untimed = now;
        }
        handled += now;
        if (start && Clock::now() - *start > drain_deadline) {
            throw std::runtime_error("idem: too slow");
        }
    }
    const double rate = static_cast<double>(n - untimed) / seconds_since(*start);
    const auto stats = consumer.stats();
    if (stats.acked != n || stats.not_acked != 0 || stats.dead_lettered != 0) {
        throw std::runtime_error(fmt::format("idem: {} records, {} acked, {} not acked, {} dead", n,
                                             stats.acked, stats.not_acked, stats.dead_lettered));
    }
    consumer.close();
    return rate;
}

/// ns per handle() with the attempt counted in the store, and with the broker's count.
template <class Handler>
std::pair<double, double> count_cost(Handler& handler, std::size_t n, const std::string& prefix) {
    auto run = [&](idem::DeliveryCounter counter, const std::string& tag) {
        const auto start = Clock::now();
        for (std::size_t k = 1; k <= n; ++k) {
            idem::Delivery delivery{prefix + tag + std::to_string(k), 1u};
            delivery.counted_by = counter;
            idem::KafkaMessage record;
            record.value = std::to_string(k);
            require_processed(handler.handle(delivery, record), "count_cost");
        }
        return std::chrono::duration<double, std::nano>(Clock::now() - start).count() /
               static_cast<double>(n);
    };
    const double store_counted = run(idem::DeliveryCounter::store, "s");
    const double broker_counted = run(idem::DeliveryCounter::broker, "b");
    return {store_counted, broker_counted};
}

template <class MakeRaw, class Handler>
void run_case(const std::string& name, const std::string& store_name, MakeRaw make_raw,
              Handler& handler) {
    auto raw = make_raw();
    const std::size_t n = config().e2e_pg_messages;
    std::vector<double> idem_rates;
    std::vector<double> raw_rates;
    static int topics = 0;
    for (int round = 0; round < config().rounds; ++round) {
        const bool idem_first = round % 2 == 0;
        for (int k = 0; k < 2; ++k) {
            const bool is_idem = (k == 0) == idem_first;
            const std::string topic = fmt::format("{}.{}", name, ++topics);
            fill(topic, fmt::format("{}-{}-", is_idem ? "i" : "r", topics), n);
            if (is_idem) {
                idem_rates.push_back(drain_idem(handler, topic, n));
            } else {
                raw_rates.push_back(drain_raw(*raw, topic, n));
            }
        }
    }
    const auto [store_ns, broker_ns] = count_cost(handler, n, name + "-count-");
    Json line;
    line.str("bench", name)
        .str("store", store_name)
        .str("broker", "kafka (librdkafka mock cluster)")
        .integer("batch", 1);
    add_rates(line, idem_rates, raw_rates)
        .num("store_counted_ns_per_handle", store_ns, 0)
        .num("broker_counted_ns_per_handle", broker_ns, 0)
        .num("attempt_count_cost_ratio", store_ns / broker_ns, 3)
        .integer("rounds", config().rounds)
        .integer("messages", static_cast<long long>(n))
        .str("mode",
             "per_message: poll 16, then count + handle() per record, one async offset "
             "commit per poll (raw: BEGIN, 2 INSERTs, COMMIT per record, the same commit)");
    emit(line);
}

}  // namespace

void prepare_kafka_cluster() {
    if (!selected("e2e_kafka_sqlite") && !selected("e2e_kafka_postgres")) return;
    // Forked while this process has one thread: before any other case runs.
    cluster() = std::make_unique<idem::testing::KafkaCluster>(1);
}

void run_e2e_kafka_cases() {
    if (selected("e2e_kafka_sqlite")) {
        note("e2e_kafka_sqlite");
        try {
            if (!cluster()) throw std::runtime_error("the mock cluster was not started");
            idem::SqliteOptions sqlite_options;
            sqlite_options.synchronous = idem::Synchronous::normal;
            idem::SqliteStore store{(config().sqlite_dir / "e2e_kafka_idem.db").string(),
                                    sqlite_options};
            create_sqlite_effects(store.db(), "effects");
            auto handler = idem::make_handler(
                store, idem::Policy{scope},
                [](auto& tx, const idem::KafkaMessage& record, const idem::Delivery& delivery) {
                    tx.execute("INSERT INTO effects(order_id, amount) VALUES (?1, ?2)",
                               delivery.message_id, std::stoll(record.value));
                });
            run_case(
                "e2e_kafka_sqlite", "sqlite",
                [] {
                    return std::make_unique<RawSqlite>(config().sqlite_dir / "e2e_kafka_raw.db");
                },
                handler);
        } catch (const std::exception& e) {
            emit(Json()
                     .str("bench", "e2e_kafka_sqlite")
                     .str("store", "sqlite")
                     .str("error", e.what()));
        }
    }
    if (selected("e2e_kafka_postgres")) {
        note("e2e_kafka_postgres");
        try {
            if (!cluster()) throw std::runtime_error("the mock cluster was not started");
            auto& server = postgres_server();
            const std::string db = server.fresh_database();
            const std::string conninfo = server.conninfo(db);
            create_postgres_effects(conninfo, "kafka_idem_effects");
            idem::PostgresStore store{conninfo};
            auto handler = idem::make_handler(
                store, idem::Policy{scope},
                [](auto& tx, const idem::KafkaMessage& record, const idem::Delivery& delivery) {
                    tx.execute("INSERT INTO kafka_idem_effects(order_id, amount) VALUES ($1, $2)",
                               delivery.message_id, std::stoll(record.value));
                });
            run_case(
                "e2e_kafka_postgres", "postgres",
                [&] { return std::make_unique<RawPostgres>(conninfo, "kafka_raw_effects"); },
                handler);
        } catch (const std::exception& e) {
            emit(Json()
                     .str("bench", "e2e_kafka_postgres")
                     .str("store", "postgres")
                     .str("error", e.what()));
        }
    }
}

}  // namespace idem_bench
