// redis_stream_consumer: a capture worker on a real Redis stream, with the SQLite store for the
// work.
//
// idem::RedisStreamConsumer reads the stream through a consumer group and hands each entry to an
// IdempotentHandler with its true delivery count (XREADGROUP: 1; an entry taken over after the
// visibility timeout: its count from XPENDING). The handler claims the entry's order id in the
// same SQLite transaction as the capture row; the consumer acks only what the outcome says to ack
// and moves dead letters to "<stream>.dead-letters" atomically with their ack.
//
// With --produce N it first adds N capture messages (orders 1..N), each sent TWICE with the same
// order_id, as a producer retrying after a lost reply would, plus one malformed entry (its amount
// is not a number). The consumer takes its message id from the order_id field
// (RedisStreamConsumerOptions::id_field), so the second copy of each order is a duplicate and the
// malformed one is parked in the dead-letter stream. Then it works until the stream is drained:
// nothing pending and nothing new for about a second. Without --produce (or --until-drained) it
// runs until SIGINT or SIGTERM.
//
//   redis-server --port 6399 --save "" --appendonly no &
//   redis_stream_consumer --redis 127.0.0.1:6399 --produce 200   # processed 200, duplicates 200
//   redis_stream_consumer --redis 127.0.0.1:6399 --produce 200   # same db: duplicates only
//
// The last line printed is one JSON object; the exit status is 1 if divergences != 0 (an order
// captured twice, or a gateway charge without its capture row), 2 on an error.

#include <sqlite3.h>
#include <unistd.h>

#include <atomic>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "idem/broker/redis_streams.hpp"
#include "idem/idem.hpp"
#include "idem/redis/connection.hpp"
#include "idem/store/sqlite.hpp"

namespace {

using namespace std::chrono_literals;

/// The group every worker of this example joins: one group per kind of handler.
constexpr const char* consumer_group = "capture-payment";

struct Options {
    idem::RedisEndpoint redis;  // 127.0.0.1:6379
    std::string stream = "idem-demo:captures";
    std::string db = "redis_stream_consumer.db";
    long produce = 0;
    std::string consumer;  // empty: worker-<pid>
    bool until_drained = false;
};

[[noreturn]] void usage_and_exit(int status) {
    std::fputs(
        "usage: redis_stream_consumer [--redis HOST:PORT] [--stream NAME] [--db PATH]\n"
        "                             [--produce N] [--consumer NAME] [--until-drained]\n"
        "  --redis HOST:PORT  the Redis server (default 127.0.0.1:6379)\n"
        "  --stream NAME      the stream to read (default idem-demo:captures)\n"
        "  --db PATH          the SQLite database for the work (default redis_stream_consumer.db)\n"
        "  --produce N        first add orders 1..N, each twice, and one malformed entry\n"
        "  --consumer NAME    this worker's name in the group (default worker-<pid>)\n"
        "  --until-drained    stop when nothing is pending and nothing new arrives for ~1 s\n"
        "                     (the default with --produce; otherwise run until SIGINT/SIGTERM)\n",
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
        if (arg == "--redis") {
            const std::string where = value();
            const std::size_t colon = where.rfind(':');
            const auto port =
                colon == std::string::npos ? std::nullopt : parse_long(where.substr(colon + 1));
            if (colon == 0 || !port || *port <= 0 || *port > 65535) {
                throw std::invalid_argument("--redis wants HOST:PORT, got \"" + where + "\"");
            }
            o.redis.host = where.substr(0, colon);
            o.redis.port = static_cast<int>(*port);
        } else if (arg == "--stream") {
            o.stream = value();
        } else if (arg == "--db") {
            o.db = value();
        } else if (arg == "--produce") {
            const auto n = parse_long(value());
            if (!n || *n < 0) throw std::invalid_argument("--produce wants a count >= 0");
            o.produce = *n;
        } else if (arg == "--consumer") {
            o.consumer = value();
        } else if (arg == "--until-drained") {
            o.until_drained = true;
        } else if (arg == "--help" || arg == "-h") {
            usage_and_exit(0);
        } else {
            throw std::invalid_argument("unknown option " + arg + " (try --help)");
        }
    }
    if (o.stream.empty()) throw std::invalid_argument("--stream must not be empty");
    if (o.consumer.empty()) o.consumer = fmt::format("worker-{}", ::getpid());
    if (o.produce > 0) o.until_drained = true;
    return o;
}

/// A payment gateway that honours idempotency keys: a new key makes one charge, a repeated key
/// returns the first charge. It lives in this process, so its memory lasts one run; its
/// references carry a random per-run tag, so this run's charges are told apart from the capture
/// rows earlier runs left in the database.
class Gateway {
  public:
    Gateway() : tag_(fmt::format("{:08x}", std::random_device{}())) {}

    std::string capture(long /*amount*/, const std::string& idempotency_key) {
        auto [it, inserted] = by_key_.try_emplace(idempotency_key);
        if (inserted) it->second = fmt::format("ch_{}_{:06}", tag_, by_key_.size());
        return it->second;
    }
    /// Every charge made, by reference.
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

/// The body of a capture entry. A field that is missing or not a positive whole number can never
/// work, however often it is redelivered: malformed_message dead-letters it at once.
Capture parse_capture(const idem::StreamEntry& entry) {
    auto number = [&](std::string_view name) {
        const auto text = entry.field(name);
        if (!text) throw idem::malformed_message(fmt::format("no {} field", name));
        const auto value = parse_long(*text);
        if (!value || *value <= 0) {
            throw idem::malformed_message(
                fmt::format("{} \"{}\" is not a positive whole number", name, *text));
        }
        return *value;
    };
    return Capture{number("order_id"), number("amount")};
}

/// Adds orders 1..n, each twice (a producer retry: two entries, one order_id), and one malformed
/// entry halfway through. One pipelined round trip per 500 entries.
long produce(idem::redis::Connection& redis, const std::string& stream, long n) {
    std::vector<std::vector<std::string>> batch;
    long added = 0;
    auto flush = [&] {
        for (const auto& reply : redis.pipeline(batch)) {
            if (reply.is_error()) throw std::runtime_error("XADD " + stream + ": " + reply.str);
        }
        added += static_cast<long>(batch.size());
        batch.clear();
    };
    auto add = [&](std::string order_id, std::string amount) {
        batch.push_back(
            {"XADD", stream, "*", "order_id", std::move(order_id), "amount", std::move(amount)});
        if (batch.size() >= 500) flush();
    };
    for (long order = 1; order <= n; ++order) {
        const std::string amount = std::to_string(1000 + order % 997);
        add(std::to_string(order), amount);
        add(std::to_string(order), amount);  // the producer's retry: same order, new entry
        if (order == (n + 1) / 2) add(std::to_string(n + 1), "twelve euros");  // malformed
    }
    flush();
    return added;
}

/// Entries of the group still pending (delivered, not acked), for every consumer.
long long pending(idem::redis::Connection& redis, const std::string& stream) {
    const auto reply = redis.command({"XPENDING", stream, consumer_group});
    if (reply.is_error()) {
        if (reply.str.rfind("NOGROUP", 0) == 0) return 0;  // no group yet: nothing delivered
        throw idem::store_error("XPENDING " + stream + ": " + reply.str);
    }
    return reply.is_array() && !reply.elements.empty() ? reply.elements[0].integer : 0;
}

std::atomic<idem::RedisStreamConsumer*> running_consumer{nullptr};

extern "C" void on_stop_signal(int) {
    if (auto* consumer = running_consumer.load()) consumer->request_stop();  // lock-free
}

/// @p text as a JSON string (the stream name is the user's: quotes and control bytes escaped).
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

}  // namespace

int main(int argc, char** argv) try {
    const Options options = parse(argc, argv);

    // The consumer's own database; idem adds its claim and dead-letter tables to it.
    idem::SqliteStore store(options.db);
    exec(store.db(),
         "CREATE TABLE IF NOT EXISTS captures(order_id INTEGER NOT NULL, amount INTEGER NOT NULL, "
         "gateway_reference TEXT NOT NULL)");

    idem::redis::Connection redis(options.redis);  // for producing and the drain check
    const long produced = options.produce > 0 ? produce(redis, options.stream, options.produce) : 0;

    // The effect runs inside the claim's SQLite transaction: the gateway gets a key derived from
    // the order id (a retried charge is the same charge) and the capture row commits with the
    // claim, or neither does.
    Gateway gateway;
    auto capture = idem::make_handler(
        store, idem::Policy{"capture-payment"}, [&](auto& tx, const idem::StreamEntry& entry) {
            const Capture c = parse_capture(entry);
            const std::string reference =
                gateway.capture(c.amount, idem::key("capture", c.order_id));
            tx.execute("INSERT INTO captures(order_id, amount, gateway_reference) VALUES (?, ?, ?)",
                       c.order_id, c.amount, reference);
        });

    idem::RedisStreamConsumerOptions stream_options;
    stream_options.stream = options.stream;
    stream_options.group = consumer_group;
    stream_options.consumer = options.consumer;
    stream_options.id_field = "order_id";  // the business id: a resent order is claimed once
    // An entry left unacked (the handler failed, or a worker died holding it) is taken over after
    // this long. The effect here takes microseconds; keep it above your handler's p99.
    stream_options.visibility_timeout = 5s;
    stream_options.on_error = [](const std::exception& e) {
        std::fprintf(stderr, "redis_stream_consumer: %s (retrying)\n", e.what());
    };
    idem::RedisStreamConsumer consumer(options.redis, stream_options, capture);

    // SIGINT / SIGTERM ask the consumer to stop: it finishes the entry in hand and returns.
    // SIGPIPE is ignored, so a write to a connection the server closed fails (and is retried
    // after a reconnect) instead of killing the worker.
    running_consumer.store(&consumer);
    std::signal(SIGINT, on_stop_signal);
    std::signal(SIGTERM, on_stop_signal);
    std::signal(SIGPIPE, SIG_IGN);

    if (options.until_drained) {
        // Poll until a poll that waited `poll_wait` (1 s) for new entries found none and nothing of
        // the group is pending (an unacked entry comes back after the visibility timeout).
        std::chrono::milliseconds backoff = 50ms;
        while (!consumer.stop_requested()) {
            try {
                if (consumer.poll_once() == 0 && pending(redis, options.stream) == 0) break;
                backoff = 50ms;
            } catch (const idem::store_error& e) {  // Redis restarting: back off and retry
                std::fprintf(stderr, "redis_stream_consumer: %s (retrying)\n", e.what());
                std::this_thread::sleep_for(backoff);
                backoff = std::min<std::chrono::milliseconds>(backoff * 2, 1s);
            }
        }
    } else {
        std::fprintf(stderr, "redis_stream_consumer: %s reading %s on %s; Ctrl-C stops\n",
                     options.consumer.c_str(), options.stream.c_str(),
                     options.redis.describe().c_str());
        consumer.run();  // until SIGINT / SIGTERM; reconnects with a backoff
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
    long captures = 0;  // rows this run wrote: those carrying one of this run's charges
    for (const auto& reference : charges)
        captures += static_cast<long>(references.count(reference));
    const long divergences = (total_rows - static_cast<long>(rows_by_order.size())) +
                             (static_cast<long>(charges.size()) - captures);

    const auto counters = capture.counters();
    const auto stats = consumer.stats();
    const auto dead_letter_entries =
        redis.checked({"XLEN", consumer.options().dead_letter}, "XLEN").integer;
    std::printf(
        "%s: produced %ld entries; read %zu, taken over %zu, acked %zu (not acked %zu); "
        "XLEN %s = %lld; %zu orders captured in %s\n",
        options.consumer.c_str(), produced, stats.read, stats.redelivered, stats.acked,
        stats.not_acked, consumer.options().dead_letter.c_str(), dead_letter_entries,
        rows_by_order.size(), options.db.c_str());
    std::printf(
        "{\"stream\":%s,\"entries\":%zu,\"processed\":%llu,\"duplicates\":%llu,"
        "\"dead_lettered\":%llu,\"captures\":%ld,\"gateway_charges\":%zu,\"divergences\":%ld}\n",
        json_string(options.stream).c_str(), stats.read + stats.redelivered,
        static_cast<unsigned long long>(counters.processed),
        static_cast<unsigned long long>(counters.duplicates),
        static_cast<unsigned long long>(counters.dead_lettered), captures, charges.size(),
        divergences);
    return divergences == 0 ? 0 : 1;
} catch (const std::exception& e) {
    std::fprintf(stderr, "redis_stream_consumer: %s\n", e.what());
    return 2;
}
