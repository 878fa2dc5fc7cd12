// e2e_rabbitmq_sqlite: RabbitMqConsumer + IdempotentHandler on SQLite draining N messages of a
// quorum queue (one delivery at a time: handle(), commit, basic.ack)  vs  its raw twin, the same
// consumer loop by hand on the same broker connection kind (basic.consume with the same prefetch,
// the same INSERTs in one transaction per message, basic.ack after the commit) without idem.
// Both fill a fresh queue beforehand (untimed) and run alternately in the same run.

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "bench.hpp"
#include "idem/broker/rabbitmq.hpp"
#include "idem/idem.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/rabbitmq_server.hpp"

namespace idem_bench {
namespace {

namespace rmq = idem::rabbitmq;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr std::uint16_t prefetch = 100;
constexpr auto drain_deadline = 300s;

idem::testing::RabbitmqServer& rabbitmq_server() {
    static idem::testing::RabbitmqServer server;
    return server;
}

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

/// A fresh quorum queue with N messages (message_id <prefix><k>, body "<k>"), untimed.
void fill(rmq::Connection& c, const std::string& queue, const std::string& prefix, std::size_t n) {
    rmq::QueueDeclare quorum;
    quorum.arguments = {{"x-queue-type", std::string("quorum")}};
    c.declare_queue(1, queue, quorum);
    c.confirm_select(1);
    for (std::size_t k = 1; k <= n; ++k) {
        rmq::Publish p;
        p.routing_key = queue;
        p.properties.message_id = prefix + std::to_string(k);
        p.properties.delivery_mode = 2;
        if (k == n) {
            c.publish_confirmed(1, p, std::to_string(k));  // confirms every earlier one too
        } else {
            c.publish(1, p, std::to_string(k));
        }
    }
}

std::int64_t amount_of(const rmq::Message& m) {
    return static_cast<std::int64_t>(std::stoll(m.body));
}

/// The raw twin: consume, write by hand, ack after the commit. Messages per second.
double drain_raw(RawSqlite& raw, const std::string& queue, std::size_t n) {
    rmq::Connection c{rabbitmq_server().endpoint()};
    c.connect();
    c.open_channel(1);
    c.qos(1, prefetch);
    c.consume(1, queue);
    const auto start = Clock::now();
    for (std::size_t done = 0; done < n;) {
        auto m = c.next_delivery(1s);
        if (!m) throw std::runtime_error("raw: the queue ran dry early");
        raw.begin();
        raw.insert_claim(scope, *m->properties.message_id);
        raw.insert_effect(*m->properties.message_id, amount_of(*m));
        raw.commit();
        c.ack(*m);
        ++done;
        if (Clock::now() - start > drain_deadline) throw std::runtime_error("raw: too slow");
    }
    return static_cast<double>(n) / seconds_since(start);
}

/// RabbitMqConsumer + the idem handler. Messages per second.
template <class Handler>
double drain_idem(Handler& handler, const std::string& queue, std::size_t n) {
    idem::RabbitMqConsumerOptions options;
    options.queue = queue;
    options.prefetch = prefetch;
    options.batch_size = prefetch;
    options.poll_wait = 100ms;
    idem::RabbitMqConsumer consumer{rabbitmq_server().endpoint(), options, handler};
    consumer.start();  // untimed: the queue check and the dead-letter/retry declares
    const auto start = Clock::now();
    std::size_t handled = 0;
    while (handled < n) {
        handled += consumer.poll_once();
        if (Clock::now() - start > drain_deadline) throw std::runtime_error("idem: too slow");
    }
    const double rate = static_cast<double>(n) / seconds_since(start);
    const auto stats = consumer.stats();
    if (stats.acked != n || stats.not_acked != 0 || stats.dead_lettered != 0) {
        throw std::runtime_error(fmt::format("idem: {} messages, {} acked, {} not acked, {} dead",
                                             n, stats.acked, stats.not_acked, stats.dead_lettered));
    }
    return rate;
}

}  // namespace

void run_rabbitmq_cases() {
    if (!selected("e2e_rabbitmq_sqlite")) return;
    note("e2e_rabbitmq_sqlite");
    try {
        idem::SqliteOptions sqlite_options;
        sqlite_options.synchronous = idem::Synchronous::normal;
        idem::SqliteStore store{(config().sqlite_dir / "e2e_rabbit_idem.db").string(),
                                sqlite_options};
        create_sqlite_effects(store.db(), "effects");
        RawSqlite raw{config().sqlite_dir / "e2e_rabbit_raw.db"};
        auto handler = idem::make_handler(
            store, idem::Policy{scope}, [](auto& tx, const idem::RabbitMessage& m) {
                tx.execute("INSERT INTO effects(order_id, amount) VALUES (?1, ?2)",
                           *m.properties.message_id, amount_of(m));
            });
        auto& server = rabbitmq_server();
        rmq::Connection admin{server.endpoint()};
        admin.connect();
        admin.open_channel(1);
        const std::size_t n = config().e2e_pg_messages;
        std::vector<double> idem_rates;
        std::vector<double> raw_rates;
        int queues = 0;
        for (int round = 0; round < config().rounds; ++round) {
            const bool idem_first = round % 2 == 0;
            for (int k = 0; k < 2; ++k) {
                const bool is_idem = (k == 0) == idem_first;
                const std::string queue = fmt::format("e2e.rabbit.{}", ++queues);
                fill(admin, queue, fmt::format("{}-{}-", is_idem ? "i" : "r", queues), n);
                if (is_idem) {
                    idem_rates.push_back(drain_idem(handler, queue, n));
                } else {
                    raw_rates.push_back(drain_raw(raw, queue, n));
                }
                admin.delete_queue(1, queue);
                for (const char* suffix : {".retry", ".dead-letters"}) {
                    try {
                        admin.delete_queue(1, queue + suffix);
                    } catch (const rmq::channel_error&) {
                        admin.open_channel(1);
                    }
                }
            }
        }
        Json line;
        line.str("bench", "e2e_rabbitmq_sqlite")
            .str("store", "sqlite")
            .str("broker", "rabbitmq 3.10 quorum queue")
            .integer("batch", 1);
        add_rates(line, idem_rates, raw_rates)
            .integer("rounds", config().rounds)
            .integer("messages", static_cast<long long>(n))
            .integer("prefetch", prefetch)
            .str("mode", "per_delivery: handle(), commit, basic.ack per message");
        emit(line);
    } catch (const std::exception& e) {
        emit(Json()
                 .str("bench", "e2e_rabbitmq_sqlite")
                 .str("store", "sqlite")
                 .str("error", e.what()));
    }
}

}  // namespace idem_bench
