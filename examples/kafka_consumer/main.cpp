// kafka_consumer: a capture worker on a Kafka topic, with the SQLite store for the work.
//
// idem::KafkaConsumer reads the topic as a member of a consumer group and hands each record to an
// IdempotentHandler. Kafka keeps no delivery count, so the handler counts each attempt in the
// store before it runs (a record that kills every worker is still parked after max_deliveries).
// The claim on the order id commits in the same SQLite transaction as the capture row; the
// record's offset moves only after that commit (committed to Kafka after it, or with --offsets
// store written in the same transaction), a failed record is retried in place, and a dead letter
// is produced to <topic>.DLT and confirmed before the offset moves past it.
//
// With --produce N it first creates the topic (4 partitions, with --own-cluster) and produces N
// capture records (orders 1..N), each TWICE with the same order-id header, as a producer retrying
// after a lost acknowledgement would, plus one malformed record (its amount is not a number). The
// consumer takes its message id from the order-id header (KafkaConsumerOptions::id_field), so
// the second copy of each order is a duplicate and the malformed one is parked in <topic>.DLT.
// Then it works until every partition's position reached its end. Without --produce it runs
// until SIGINT or SIGTERM.
//
//   kafka_consumer --brokers 127.0.0.1:9092 --produce 200   # processed 200, duplicates 200
//   kafka_consumer --own-cluster --produce 200   # the same against librdkafka's mock cluster
//
// --own-cluster hosts librdkafka's mock cluster (idem::testing::KafkaCluster), not Apache Kafka.
// The last line printed is one JSON object; the exit status is 1 if divergences != 0 (an order
// captured twice, or a gateway charge without its capture row), 2 on an error.

#include <sqlite3.h>

#include <atomic>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "idem/broker/kafka.hpp"
#include "idem/idem.hpp"
#include "idem/kafka/producer.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/kafka_cluster.hpp"

namespace {

using namespace std::chrono_literals;

struct Options {
    std::string brokers = "127.0.0.1:9092";
    bool own_cluster = false;
    std::string topic = "payments";
    std::string db = "kafka_consumer.db";
    long produce = 0;
    idem::KafkaOffsets offsets = idem::KafkaOffsets::commit_after_store;
};

[[noreturn]] void usage_and_exit(int status) {
    std::fputs(
        "usage: kafka_consumer [--brokers HOST:PORT | --own-cluster] [--topic NAME] [--db PATH]\n"
        "                      [--offsets kafka|store] [--produce N]\n"
        "  --brokers LIST   the bootstrap servers (default 127.0.0.1:9092)\n"
        "  --own-cluster    host librdkafka's mock cluster instead (not Apache Kafka)\n"
        "  --topic NAME     the topic (default payments; dead letters to NAME.DLT)\n"
        "  --db PATH        the SQLite database for the work (default kafka_consumer.db)\n"
        "  --offsets MODE   kafka: committed after the store's commit (default); store: in the\n"
        "                   store's transaction\n"
        "  --produce N      first produce orders 1..N, each twice, and one malformed record;\n"
        "                   then stop once drained\n",
        status == 0 ? stdout : stderr);
    std::exit(status);
}

std::optional<long> parse_long(std::string_view text) {
    long value = 0;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (text.empty() || error != std::errc() || end != text.data() + text.size()) {
        return std::nullopt;
    }
    return value;
}

Options parse(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
            return argv[++i];
        };
        if (arg == "--brokers") {
            o.brokers = value();
        } else if (arg == "--own-cluster") {
            o.own_cluster = true;
        } else if (arg == "--topic") {
            o.topic = value();
        } else if (arg == "--db") {
            o.db = value();
        } else if (arg == "--offsets") {
            const std::string mode = value();
            if (mode != "kafka" && mode != "store") {
                throw std::invalid_argument("--offsets wants kafka or store");
            }
            o.offsets = mode == "store" ? idem::KafkaOffsets::in_store
                                        : idem::KafkaOffsets::commit_after_store;
        } else if (arg == "--produce") {
            const auto n = parse_long(value());
            if (!n || *n < 0) throw std::invalid_argument("--produce wants a count >= 0");
            o.produce = *n;
        } else if (arg == "--help" || arg == "-h") {
            usage_and_exit(0);
        } else {
            throw std::invalid_argument("unknown option " + arg + " (try --help)");
        }
    }
    if (o.topic.empty()) throw std::invalid_argument("--topic must not be empty");
    return o;
}

/// A payment gateway that honours idempotency keys: a repeated key returns the first charge.
class Gateway {
  public:
    std::string capture(const std::string& idempotency_key) {
        auto [it, inserted] = by_key_.try_emplace(idempotency_key);
        if (inserted) it->second = fmt::format("ch_{:06}", by_key_.size());
        return it->second;
    }
    std::set<std::string> charges() const {
        std::set<std::string> out;
        for (const auto& entry : by_key_)
            out.insert(entry.second);
        return out;
    }

  private:
    std::map<std::string, std::string> by_key_;
};

/// "<order_id> <amount>" in positive whole numbers, or malformed (dead-lettered at once).
std::pair<long, long> parse_capture(const idem::KafkaMessage& record) {
    const std::string_view body = record.value;
    const std::size_t space = body.find(' ');
    const auto order = parse_long(body.substr(0, space));
    const auto amount =
        space == std::string_view::npos ? std::nullopt : parse_long(body.substr(space + 1));
    if (!order || *order <= 0 || !amount || *amount <= 0) {
        throw idem::malformed_message(
            fmt::format("\"{}\" is not \"<order_id> <amount>\" in positive whole numbers", body));
    }
    return {*order, *amount};
}

/// Orders 1..n, each twice (a producer retry: two records, one order-id), and one malformed
/// record halfway; each confirmed by its delivery report. Keyed by order: one partition each.
long produce(const std::string& brokers, const std::string& topic, long n) {
    idem::kafka::Producer producer{idem::kafka::Config{}.bootstrap_servers(brokers).idempotent()};
    long added = 0;
    auto add = [&](long order, const std::string& amount) {
        const std::string id = std::to_string(order);
        producer.produce(topic, id, fmt::format("{} {}", order, amount), {{"order-id", id}});
        ++added;
    };
    for (long order = 1; order <= n; ++order) {
        const std::string amount = std::to_string(1000 + order % 997);
        add(order, amount);
        add(order, amount);
        if (order == (n + 1) / 2) add(n + 1, "twelve-euros");  // malformed
    }
    producer.flush();
    return added;
}

std::atomic<idem::KafkaConsumer*> running_consumer{nullptr};

extern "C" void on_stop_signal(int) {
    if (auto* consumer = running_consumer.load()) consumer->request_stop();  // lock-free
}

void exec(sqlite3* db, const char* sql) {
    char* error = nullptr;
    if (sqlite3_exec(db, sql, nullptr, nullptr, &error) != SQLITE_OK) {
        std::string text = error ? error : "?";
        sqlite3_free(error);
        throw std::runtime_error(text);
    }
}

}  // namespace

int main(int argc, char** argv) try {
    Options options = parse(argc, argv);

    // The mock cluster's host is forked: first, while this process has one thread.
    std::unique_ptr<idem::testing::KafkaCluster> cluster;
    if (options.own_cluster) {
        cluster = std::make_unique<idem::testing::KafkaCluster>(1);
        cluster->create_topic(options.topic, 4);
        cluster->create_topic(options.topic + ".DLT", 1);
        options.brokers = cluster->bootstrap_servers();
    }

    idem::SqliteStore store(options.db);
    exec(store.db(),
         "CREATE TABLE IF NOT EXISTS captures(order_id INTEGER NOT NULL, amount INTEGER NOT NULL, "
         "gateway_reference TEXT NOT NULL)");
    const long produced =
        options.produce > 0 ? produce(options.brokers, options.topic, options.produce) : 0;

    Gateway gateway;
    auto capture = idem::make_handler(
        store, idem::Policy{"capture-payment"}, [&](auto& tx, const idem::KafkaMessage& record) {
            const auto [order, amount] = parse_capture(record);
            const std::string reference = gateway.capture(idem::key("capture", order));
            tx.execute("INSERT INTO captures(order_id, amount, gateway_reference) VALUES (?, ?, ?)",
                       order, amount, reference);
        });

    idem::KafkaConsumerOptions consumer_options{{options.topic}, "capture-payment"};
    consumer_options.id_field = "order-id";  // the business id: a resent order is claimed once
    consumer_options.offsets = options.offsets;
    consumer_options.poll_wait = 200ms;
    consumer_options.on_error = [](const std::exception& e) {
        std::fprintf(stderr, "kafka_consumer: %s (retrying)\n", e.what());
    };
    idem::KafkaConsumer consumer(
        idem::kafka::Config{}.bootstrap_servers(options.brokers).auto_offset_reset("earliest"),
        consumer_options, capture);

    running_consumer.store(&consumer);
    std::signal(SIGINT, on_stop_signal);
    std::signal(SIGTERM, on_stop_signal);

    if (options.produce > 0) {
        // Until every record produced was settled (each counted once, acked or dead-lettered).
        const auto deadline = std::chrono::steady_clock::now() + 120s;
        while (!consumer.stop_requested() &&
               consumer.stats().acked < static_cast<std::size_t>(produced) &&
               std::chrono::steady_clock::now() < deadline) {
            try {
                consumer.poll_once();
            } catch (const idem::broker_error& e) {
                std::fprintf(stderr, "kafka_consumer: %s (retrying)\n", e.what());
            }
        }
    } else {
        std::fprintf(stderr, "kafka_consumer: group %s on %s; Ctrl-C stops\n",
                     consumer.name().c_str(), options.brokers.c_str());
        consumer.run();
    }
    running_consumer.store(nullptr);
    consumer.close();

    std::map<long, long> rows_by_order;
    std::set<std::string> references;
    long total_rows = 0;
    {
        sqlite3_stmt* stmt = nullptr;
        if (sqlite3_prepare_v2(store.db(), "SELECT order_id, gateway_reference FROM captures", -1,
                               &stmt, nullptr) != SQLITE_OK) {
            throw std::runtime_error(sqlite3_errmsg(store.db()));
        }
        while (sqlite3_step(stmt) == SQLITE_ROW) {
            ++rows_by_order[sqlite3_column_int64(stmt, 0)];
            references.insert(reinterpret_cast<const char*>(sqlite3_column_text(stmt, 1)));
            ++total_rows;
        }
        sqlite3_finalize(stmt);
    }
    const auto charges = gateway.charges();
    long captured = 0;
    for (const auto& reference : charges)
        captured += static_cast<long>(references.count(reference));
    long divergences = (total_rows - static_cast<long>(rows_by_order.size())) +
                       (static_cast<long>(charges.size()) - captured);
    const auto counters = capture.counters();
    const auto stats = consumer.stats();
    // With --produce on a fresh database every order is captured once and the malformed record
    // parked: anything else is a divergence too.
    if (options.produce > 0 && total_rows == static_cast<long>(counters.processed) &&
        static_cast<long>(rows_by_order.size()) != options.produce) {
        divergences += options.produce - static_cast<long>(rows_by_order.size());
    }
    std::printf(
        "group %s: produced %ld records; acked %zu, dead-lettered %zu, retried %zu; %zu "
        "orders captured in %s\n",
        consumer.name().c_str(), produced, stats.acked, stats.dead_lettered,
        consumer.retried_in_place(), rows_by_order.size(), options.db.c_str());
    std::printf(
        "{\"topic\":\"%s\",\"records\":%ld,\"processed\":%llu,\"duplicates\":%llu,"
        "\"dead_lettered\":%llu,\"captures\":%ld,\"gateway_charges\":%zu,\"divergences\":%ld}\n",
        options.topic.c_str(), produced, static_cast<unsigned long long>(counters.processed),
        static_cast<unsigned long long>(counters.duplicates),
        static_cast<unsigned long long>(counters.dead_lettered), captured, charges.size(),
        divergences);
    return divergences == 0 ? 0 : 1;
} catch (const std::exception& e) {
    std::fprintf(stderr, "kafka_consumer: %s\n", e.what());
    return 2;
}
