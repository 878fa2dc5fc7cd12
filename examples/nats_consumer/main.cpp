// nats_consumer: a capture worker on a real NATS JetStream stream, with the SQLite store for the
// work.
//
// idem::JetStreamConsumer pulls from a durable pull consumer (explicit acks) and hands each
// message to an IdempotentHandler with its true delivery count (NumDelivered). The handler claims
// the message's order id in the same SQLite transaction as the capture row; the consumer acks
// (AckSync, confirmed by the server) only after that commit, and a dead letter is first published
// to dead.<stream> (with its reason and the original headers, confirmed by the dead-letter
// stream) and then terminated.
//
// With --produce N it first creates the streams <stream> (subject <stream>.captures) and
// <stream>_DEAD (dead.<stream>) and publishes N capture messages (orders 1..N), each TWICE with
// the same Order-Id header, as a producer retrying after a lost reply would, plus one malformed
// message (its amount is not a number). The consumer takes its message id from the Order-Id
// header (JetStreamConsumerOptions::id_header), so the second copy of each order is a duplicate
// and the malformed one is parked on the dead-letter subject. Then it works until drained:
// nothing undelivered, nothing unacked. Without --produce it runs until SIGINT or SIGTERM.
//
//   nats-server -js -sd /tmp/js &
//   nats_consumer --url nats://127.0.0.1:4222 --produce 200   # processed 200, duplicates 200
//   nats_consumer --own-server --produce 200   # the same against its own throwaway nats-server
//
// The last line printed is one JSON object; the exit status is 1 if divergences != 0 (an order
// captured twice, or a gateway charge without its capture row), 2 on an error, 77 when
// --own-server finds no nats-server (a failure instead when CI=true).

#include <sqlite3.h>
#include <unistd.h>

#include <atomic>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "idem/broker/nats_jetstream.hpp"
#include "idem/idem.hpp"
#include "idem/nats/admin.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/nats_server.hpp"

namespace {

using namespace std::chrono_literals;

/// The durable consumer every worker of this example shares: one per kind of handler.
constexpr const char* durable = "capture-payment";

struct Options {
    std::string url = "nats://127.0.0.1:4222";
    bool own_server = false;
    std::string stream = "ORDERS";
    std::string db = "nats_consumer.db";
    long produce = 0;
};

[[noreturn]] void usage_and_exit(int status) {
    std::fputs(
        "usage: nats_consumer [--url URL | --own-server] [--stream NAME] [--db PATH] [--produce "
        "N]\n"
        "  --url URL       the NATS server, with JetStream (default nats://127.0.0.1:4222)\n"
        "  --own-server    start a throwaway nats-server on a free port instead (and stop it)\n"
        "  --stream NAME   the stream (default ORDERS; subject NAME.captures)\n"
        "  --db PATH       the SQLite database for the work (default nats_consumer.db)\n"
        "  --produce N     first create the streams and publish orders 1..N, each twice, and one\n"
        "                  malformed message; then stop once drained\n",
        status == 0 ? stdout : stderr);
    std::exit(status);
}

/// A whole decimal number, or nothing (no sign, no spaces, no trailing bytes).
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
        if (arg == "--url") {
            o.url = value();
        } else if (arg == "--own-server") {
            o.own_server = true;
        } else if (arg == "--stream") {
            o.stream = value();
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
    if (o.stream.empty()) throw std::invalid_argument("--stream must not be empty");
    return o;
}

/// A payment gateway that honours idempotency keys: a new key makes one charge, a repeated key
/// returns the first charge. Its references carry a random per-run tag, so this run's charges
/// are told apart from the capture rows earlier runs left in the database.
class Gateway {
  public:
    Gateway() : tag_(fmt::format("{:08x}", std::random_device{}())) {}

    std::string capture(long /*amount*/, const std::string& idempotency_key) {
        auto [it, inserted] = by_key_.try_emplace(idempotency_key);
        if (inserted) it->second = fmt::format("ch_{}_{:06}", tag_, by_key_.size());
        return it->second;
    }
    std::set<std::string> charges() const {
        std::set<std::string> out;
        for (const auto& entry : by_key_)
            out.insert(entry.second);
        return out;
    }

  private:
    std::string tag_;
    std::map<std::string, std::string> by_key_;
};

struct Capture {
    long order_id = 0;
    long amount = 0;  // cents
};

/// The body of a capture message: "<order_id> <amount>". A part that is missing or not a
/// positive whole number can never work, however often it is redelivered: malformed_message
/// dead-letters it at once.
Capture parse_capture(const idem::JetStreamMessage& message) {
    const std::string_view body = message.data;
    const std::size_t space = body.find(' ');
    const auto order = parse_long(body.substr(0, space));
    const auto amount =
        space == std::string_view::npos ? std::nullopt : parse_long(body.substr(space + 1));
    if (!order || *order <= 0 || !amount || *amount <= 0) {
        throw idem::malformed_message(
            fmt::format("\"{}\" is not \"<order_id> <amount>\" in positive whole numbers", body));
    }
    return Capture{*order, *amount};
}

/// Creates the streams and publishes orders 1..n, each twice (a producer retry: two messages,
/// one Order-Id), and one malformed message halfway through. Each publish waits for its pub ack.
long produce(idem::nats::Connection& nats, const std::string& stream, long n) {
    idem::nats::ensure_stream(nats, {stream, {stream + ".captures"}});
    idem::nats::ensure_stream(nats, {stream + "_DEAD", {"dead." + stream}});
    long added = 0;
    auto add = [&](long order, const std::string& amount) {
        nats.publish(stream + ".captures", fmt::format("{} {}", order, amount),
                     {{"Order-Id", std::to_string(order)}});
        ++added;
    };
    for (long order = 1; order <= n; ++order) {
        const std::string amount = std::to_string(1000 + order % 997);
        add(order, amount);
        add(order, amount);  // the producer's retry: same order, a second message
        if (order == (n + 1) / 2) add(n + 1, "twelve-euros");  // malformed
    }
    return added;
}

std::atomic<idem::JetStreamConsumer*> running_consumer{nullptr};

extern "C" void on_stop_signal(int) {
    if (auto* consumer = running_consumer.load()) consumer->request_stop();  // lock-free
}

std::string json_string(std::string_view text) {
    std::string out = "\"";
    for (const char ch : text) {
        const auto c = static_cast<unsigned char>(ch);
        if (c == '"' || c == '\\') {
            out += '\\';
            out += ch;
        } else if (c < 0x20) {
            out += fmt::format("\\u{:04x}", c);
        } else {
            out += ch;
        }
    }
    return out + '"';
}

void exec(sqlite3* db, const char* sql) {
    char* error = nullptr;
    if (sqlite3_exec(db, sql, nullptr, nullptr, &error) != SQLITE_OK) {
        std::string text = error ? error : "?";
        sqlite3_free(error);
        throw std::runtime_error(text);
    }
}

bool running_in_ci() {
    const char* ci = std::getenv("CI");
    return ci != nullptr && (std::string_view(ci) == "true" || std::string_view(ci) == "1");
}

}  // namespace

int main(int argc, char** argv) try {
    Options options = parse(argc, argv);

    std::unique_ptr<idem::testing::NatsServer> server;
    if (options.own_server) {
        std::string why;
        if (!idem::testing::NatsServer::available(&why)) {
            std::fprintf(stderr, "nats_consumer: %s\n", why.c_str());
            if (running_in_ci()) return 2;  // CI=true: a missing server is a failure
            std::fprintf(stderr, "nats_consumer: skipped (set CI=true to make this a failure)\n");
            return 77;
        }
        server = std::make_unique<idem::testing::NatsServer>();
        options.url = server->url();
    }

    // The consumer's own database; idem adds its claim and dead-letter tables to it.
    idem::SqliteStore store(options.db);
    exec(store.db(),
         "CREATE TABLE IF NOT EXISTS captures(order_id INTEGER NOT NULL, amount INTEGER NOT NULL, "
         "gateway_reference TEXT NOT NULL)");

    idem::nats::Connection nats{idem::nats::Endpoint{options.url}};  // producing, drain check
    const long produced = options.produce > 0 ? produce(nats, options.stream, options.produce) : 0;

    // The effect runs inside the claim's SQLite transaction: the gateway gets a key derived from
    // the order id (a retried charge is the same charge) and the capture row commits with the
    // claim, or neither does.
    Gateway gateway;
    auto capture = idem::make_handler(
        store, idem::Policy{"capture-payment"},
        [&](auto& tx, const idem::JetStreamMessage& message) {
            const Capture c = parse_capture(message);
            const std::string reference =
                gateway.capture(c.amount, idem::key("capture", c.order_id));
            tx.execute("INSERT INTO captures(order_id, amount, gateway_reference) VALUES (?, ?, ?)",
                       c.order_id, c.amount, reference);
        });

    idem::JetStreamConsumerOptions consumer_options;
    consumer_options.stream = options.stream;
    consumer_options.durable = durable;
    consumer_options.id_field = "Order-Id";  // the business id: a resent order is claimed once
    consumer_options.sequence_when_no_id_field = false;  // no Order-Id: malformed, parked
    consumer_options.dead_letter = "dead." + options.stream;
    consumer_options.dead_letter_stream = options.stream + "_DEAD";
    // A message left unacked (the handler failed, or a worker died holding it) is delivered
    // again after this long (the consumer's AckWait). Keep it above your handler's p99.
    consumer_options.visibility_timeout = 5s;
    consumer_options.on_error = [](const std::exception& e) {
        std::fprintf(stderr, "nats_consumer: %s (retrying)\n", e.what());
    };
    idem::JetStreamConsumer consumer(idem::nats::Endpoint{options.url}, consumer_options, capture);

    // SIGINT / SIGTERM ask the consumer to stop: it settles the message in hand and returns.
    running_consumer.store(&consumer);
    std::signal(SIGINT, on_stop_signal);
    std::signal(SIGTERM, on_stop_signal);
    std::signal(SIGPIPE, SIG_IGN);

    if (options.produce > 0) {
        // Poll until a poll that waited fetch_wait (1 s) found nothing, and the consumer has
        // nothing undelivered or unacked (an unacked message comes back after AckWait).
        while (!consumer.stop_requested()) {
            try {
                if (consumer.poll_once() != 0) continue;
                const auto state = idem::nats::consumer_state(nats, options.stream, durable);
                if (state.num_pending == 0 && state.num_ack_pending == 0) break;
            } catch (const idem::broker_error& e) {  // the server restarting: retry
                std::fprintf(stderr, "nats_consumer: %s (retrying)\n", e.what());
            }
        }
    } else {
        std::fprintf(stderr, "nats_consumer: %s on %s; Ctrl-C stops\n", consumer.name().c_str(),
                     options.url.c_str());
        consumer.run();  // until SIGINT / SIGTERM; the connection reconnects by itself
    }
    running_consumer.store(nullptr);

    // Verification over the whole table (earlier runs included): one capture row per order; and
    // for this run: every charge the gateway made has its capture row.
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
    long captures = 0;
    for (const auto& reference : charges)
        captures += static_cast<long>(references.count(reference));
    const long divergences = (total_rows - static_cast<long>(rows_by_order.size())) +
                             (static_cast<long>(charges.size()) - captures);

    const auto counters = capture.counters();
    const auto stats = consumer.stats();
    const auto dead_letters = idem::nats::stream_state(nats, options.stream + "_DEAD").messages;
    std::printf(
        "%s: produced %ld messages; read %zu, redelivered %zu, acked %zu (not acked %zu); "
        "%s holds %llu dead letters; %zu orders captured in %s\n",
        consumer.name().c_str(), produced, stats.read, stats.redelivered, stats.acked,
        stats.not_acked, consumer_options.dead_letter_stream.c_str(),
        static_cast<unsigned long long>(dead_letters), rows_by_order.size(), options.db.c_str());
    std::printf(
        "{\"stream\":%s,\"messages\":%zu,\"processed\":%llu,\"duplicates\":%llu,"
        "\"dead_lettered\":%llu,\"captures\":%ld,\"gateway_charges\":%zu,\"divergences\":%ld}\n",
        json_string(options.stream).c_str(), stats.read + stats.redelivered,
        static_cast<unsigned long long>(counters.processed),
        static_cast<unsigned long long>(counters.duplicates),
        static_cast<unsigned long long>(counters.dead_lettered), captures, charges.size(),
        divergences);
    return divergences == 0 ? 0 : 1;
} catch (const std::exception& e) {
    std::fprintf(stderr, "nats_consumer: %s\n", e.what());
    return 2;
}
