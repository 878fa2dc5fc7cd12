// rabbitmq_consumer: a capture worker on a RabbitMQ quorum queue, with the SQLite store for the
// work.
//
// idem::RabbitMqConsumer consumes the queue with manual acks and hands each delivery to an
// IdempotentHandler with its delivery count (x-delivery-count + 1). The handler claims the
// message_id in the same SQLite transaction as the capture row; the consumer acks only after
// that commit, and publishes dead letters (confirmed) to "<queue>.dead-letters" before it acks
// them.
//
// With --produce N it first publishes N capture messages (orders 1..N), each TWICE with the same
// message_id, as a producer retrying after a lost confirm would, plus one message without a
// message_id (malformed: dead-lettered with the reason). Then it works until every one of them
// is settled.
//
//   rabbitmq_consumer --amqp 127.0.0.1:5672 --produce 100    # a broker of your own (guest/guest)
//   rabbitmq_consumer --own-broker --produce 100             # starts a throwaway broker first
//
// The last line printed is one JSON object; the exit status is 1 if divergences != 0 (an order
// captured twice, or a message not settled), 2 on an error, 77 when --own-broker finds no
// rabbitmq-server (and CI is not true: then it is 2).

#include <sqlite3.h>

#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "idem/broker/rabbitmq.hpp"
#include "idem/idem.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/rabbitmq_server.hpp"

namespace {

using namespace std::chrono_literals;

struct Options {
    idem::RabbitEndpoint amqp;  // 127.0.0.1:5672, guest/guest
    bool own_broker = false;
    std::string queue = "idem-demo.captures";
    std::string db = "rabbitmq_consumer.db";
    long produce = 0;
};

[[noreturn]] void usage_and_exit(int status) {
    std::fputs(
        "usage: rabbitmq_consumer [--amqp HOST:PORT | --own-broker] [--queue NAME] [--db PATH]\n"
        "                         [--produce N]\n"
        "  --amqp HOST:PORT  the broker (default 127.0.0.1:5672, user guest)\n"
        "  --own-broker      start a throwaway rabbitmq-server first (Debian's package)\n"
        "  --queue NAME      the quorum queue (default idem-demo.captures; declared if missing)\n"
        "  --db PATH         the SQLite database for the work (default rabbitmq_consumer.db)\n"
        "  --produce N       first publish orders 1..N, each twice, and one without an id\n",
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
        if (arg == "--amqp") {
            const std::string where = value();
            const std::size_t colon = where.rfind(':');
            const auto port =
                colon == std::string::npos ? std::nullopt : parse_long(where.substr(colon + 1));
            if (colon == 0 || !port || *port <= 0 || *port > 65535) {
                throw std::invalid_argument("--amqp wants HOST:PORT, got \"" + where + "\"");
            }
            o.amqp.host = where.substr(0, colon);
            o.amqp.port = static_cast<int>(*port);
        } else if (arg == "--own-broker") {
            o.own_broker = true;
        } else if (arg == "--queue") {
            o.queue = value();
        } else if (arg == "--db") {
            o.db = value();
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
    if (o.queue.empty()) throw std::invalid_argument("--queue must not be empty");
    return o;
}

/// Publishes orders 1..n twice each (same message_id), then one message without an id.
void produce(const idem::RabbitEndpoint& endpoint, const std::string& queue, long n) {
    idem::rabbitmq::Connection c{endpoint};
    c.connect();
    c.open_channel(1);
    idem::rabbitmq::QueueDeclare how;
    how.arguments = {{"x-queue-type", std::string("quorum")}};
    c.declare_queue(1, queue, how);
    for (long order = 1; order <= n; ++order) {
        idem::rabbitmq::Publish p;
        p.routing_key = queue;
        p.properties.message_id = fmt::format("capture-{}", order);
        p.properties.content_type = "text/plain";
        p.properties.delivery_mode = 2;
        const std::string body = fmt::format("order={} amount={}", order, 100 + order);
        c.publish_confirmed(1, p, body);
        c.publish_confirmed(1, p, body);  // the producer's retry: same message_id
    }
    idem::rabbitmq::Publish anonymous;
    anonymous.routing_key = queue;
    c.publish_confirmed(1, anonymous, "order=? amount=?");
}

long long scalar(sqlite3* db, const char* sql) {
    sqlite3_stmt* stmt = nullptr;
    long long value = -1;
    if (sqlite3_prepare_v2(db, sql, -1, &stmt, nullptr) == SQLITE_OK &&
        sqlite3_step(stmt) == SQLITE_ROW) {
        value = sqlite3_column_int64(stmt, 0);
    }
    sqlite3_finalize(stmt);
    return value;
}

int run(const Options& o) {
    std::unique_ptr<idem::testing::RabbitmqServer> broker;
    idem::RabbitEndpoint endpoint = o.amqp;
    if (o.own_broker) {
        std::string why;
        if (!idem::testing::RabbitmqServer::available(&why)) {
            std::fprintf(stderr, "rabbitmq_consumer: --own-broker: %s\n", why.c_str());
            if (idem::testing::running_in_ci()) return 2;  // CI=true: a missing broker fails
            std::fprintf(stderr, "rabbitmq_consumer: skipping (set CI=true to make it fail)\n");
            return 77;
        }
        broker = std::make_unique<idem::testing::RabbitmqServer>();
        endpoint = broker->endpoint();
    }

    idem::SqliteStore store{o.db};
    if (sqlite3_exec(store.db(),
                     "CREATE TABLE IF NOT EXISTS captures("
                     "  message_id TEXT NOT NULL, body TEXT NOT NULL)",
                     nullptr, nullptr, nullptr) != SQLITE_OK) {
        throw std::runtime_error(std::string("create table: ") + sqlite3_errmsg(store.db()));
    }
    const long long before = scalar(store.db(), "SELECT count(*) FROM captures");
    auto capture = idem::make_handler(
        store, idem::Policy{"capture-payment"}, [](auto& tx, const idem::RabbitMessage& m) {
            // Runs inside the claim's transaction: the row and the claim commit together.
            tx.execute("INSERT INTO captures(message_id, body) VALUES (?, ?)",
                       *m.properties.message_id, m.body);
        });

    if (o.produce > 0) produce(endpoint, o.queue, o.produce);

    idem::RabbitMqConsumerOptions options;
    options.queue = o.queue;
    options.poll_wait = 200ms;
    idem::RabbitMqConsumer consumer{endpoint, options, capture};
    const std::size_t expected = static_cast<std::size_t>(2 * o.produce + (o.produce > 0 ? 1 : 0));
    const auto deadline = std::chrono::steady_clock::now() + 120s;
    while (consumer.stats().acked < expected && std::chrono::steady_clock::now() < deadline) {
        try {
            consumer.poll_once();
        } catch (const idem::broker_error& e) {
            std::fprintf(stderr, "rabbitmq_consumer: %s (reconnecting)\n", e.what());
        }
    }

    const auto stats = consumer.stats();
    const auto counts = capture.counters();
    const long long rows = scalar(store.db(), "SELECT count(*) FROM captures") - before;
    const long long twice = scalar(store.db(),
                                   "SELECT count(*) FROM (SELECT message_id FROM captures "
                                   "GROUP BY message_id HAVING count(*) > 1)");
    const long long unsettled =
        stats.acked >= expected ? 0 : static_cast<long long>(expected - stats.acked);
    const long long divergences = twice + unsettled;
    std::printf(
        "{\"queue\":\"%s\",\"published\":%zu,\"acked\":%zu,\"processed\":%llu,"
        "\"duplicates\":%llu,\"dead_lettered\":%zu,\"capture_rows\":%lld,\"divergences\":%lld}\n",
        o.queue.c_str(), expected, stats.acked, static_cast<unsigned long long>(counts.processed),
        static_cast<unsigned long long>(counts.duplicates), stats.dead_lettered, rows, divergences);
    return divergences == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        return run(parse(argc, argv));
    } catch (const std::exception& e) {
        std::fprintf(stderr, "rabbitmq_consumer: %s\n", e.what());
        return 2;
    }
}
