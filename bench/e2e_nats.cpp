// The end-to-end case over NATS JetStream (built when the nats component is):
//   e2e_nats_sqlite   JetStreamConsumer + IdempotentHandler on SQLite draining N messages of a
//                     JetStream stream (one handle() and one AckSync per message)  vs
//                     the same pull subscription, fetch size and the same INSERTs by hand in one
//                     transaction per message, then the same AckSync: the consumer loop acking
//                     without idem.
// Each sample drains a fresh stream filled beforehand (untimed), against the run's own
// nats-server (JetStream file store in a temp dir); idem and raw alternate (ABBA).

#include <charconv>
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
#include "idem/broker/nats_jetstream.hpp"
#include "idem/idem.hpp"
#include "idem/nats/admin.hpp"
#include "idem/nats/connection.hpp"
#include "idem/nats/pull_subscription.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/nats_server.hpp"

namespace idem_bench {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr int fetch_count = 100;
constexpr auto drain_deadline = 300s;

idem::testing::NatsServer& nats_server() {
    return idem::testing::shared_server<idem::testing::NatsServer>("NATS");
}

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

std::int64_t parse_amount(std::string_view text) {
    std::int64_t value = 0;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (error != std::errc{} || end != text.data() + text.size()) {
        throw std::runtime_error("bad amount '" + std::string(text) + "'");
    }
    return value;
}

/// A fresh stream <name> (subject <name>.orders) with N messages {Nats-Msg-Id <prefix><k>,
/// data <k>} and the durable pull consumer "bench", untimed.
void fill(idem::nats::Connection& nats, const std::string& name, const std::string& prefix,
          std::size_t n) {
    idem::nats::delete_stream(nats, name);
    idem::nats::ensure_stream(nats, {name, {name + ".orders"}});
    for (std::size_t k = 1; k <= n; ++k)
        nats.publish(name + ".orders", std::to_string(k), {}, prefix + std::to_string(k));
    idem::nats::ConsumerSpec spec;
    spec.stream = name;
    spec.durable = "bench";
    spec.ack_wait = 30s;
    idem::nats::ensure_pull_consumer(nats, spec);
}

/// The raw twin: fetch, write by hand in one transaction per message, AckSync each.
double drain_raw(RawSqlite& raw, idem::nats::Connection& nats, const std::string& stream,
                 std::size_t n) {
    idem::nats::PullSubscription subscription{nats, stream, "bench"};
    const auto start = Clock::now();
    std::size_t done = 0;
    while (done < n) {
        auto batch = subscription.fetch(fetch_count, 1000ms);
        if (batch.empty()) throw std::runtime_error("raw: the stream ran dry early");
        for (auto& message : batch) {
            const auto id = message.header("Nats-Msg-Id");
            if (!id) throw std::runtime_error("raw: a message without Nats-Msg-Id");
            raw.begin();
            raw.insert_claim(scope, *id);
            raw.insert_effect(*id, parse_amount(message.data()));
            raw.commit();
            message.ack_sync();
        }
        done += batch.size();
        if (Clock::now() - start > drain_deadline) throw std::runtime_error("raw: too slow");
    }
    return static_cast<double>(n) / seconds_since(start);
}

/// JetStreamConsumer + the idem handler draining the stream.
template <class Handler>
double drain_idem(Handler& handler, const std::string& url, const std::string& stream,
                  std::size_t n) {
    idem::JetStreamConsumerOptions options;
    options.stream = stream;
    options.durable = "bench";
    options.declare = false;
    options.batch_size = fetch_count;
    options.poll_wait = 1000ms;
    options.visibility_timeout = 30s;
    options.dead_letter = "bench.dead";  // never used: nothing is dead-lettered
    idem::JetStreamConsumer consumer{idem::nats::Endpoint{url}, options, handler};
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

void run_e2e_nats_cases() {
    if (!selected("e2e_nats_sqlite")) return;
    note("e2e_nats_sqlite");
    try {
        auto& server = nats_server();
        idem::nats::Connection nats{idem::nats::Endpoint{server.url()}};
        idem::SqliteOptions sqlite_options;
        sqlite_options.synchronous = idem::Synchronous::normal;
        idem::SqliteStore store{(config().sqlite_dir / "e2e_nats_idem.db").string(),
                                sqlite_options};
        create_sqlite_effects(store.db(), "effects");
        RawSqlite raw{config().sqlite_dir / "e2e_nats_raw.db"};
        auto handler = idem::make_handler(
            store, idem::Policy{scope},
            [](auto& tx, const idem::JetStreamMessage& message, const idem::Delivery& delivery) {
                tx.execute("INSERT INTO effects(order_id, amount) VALUES (?1, ?2)",
                           delivery.message_id, parse_amount(message.data));
            });
        const std::size_t n = config().e2e_pg_messages;  // half the Redis stream case's count
        std::vector<double> idem_rates;
        std::vector<double> raw_rates;
        int streams = 0;
        for (int round = 0; round < config().rounds; ++round) {
            const bool idem_first = round % 2 == 0;
            for (int k = 0; k < 2; ++k) {
                const bool is_idem = (k == 0) == idem_first;
                const std::string stream = fmt::format("E2E_{}", ++streams);
                fill(nats, stream, fmt::format("{}-{}-", is_idem ? "i" : "r", streams), n);
                if (is_idem) {
                    idem_rates.push_back(drain_idem(handler, server.url(), stream, n));
                } else {
                    raw_rates.push_back(drain_raw(raw, nats, stream, n));
                }
                idem::nats::delete_stream(nats, stream);
            }
        }
        Json line;
        line.str("bench", "e2e_nats_sqlite")
            .str("store", "sqlite")
            .str("broker", "nats")
            .integer("batch", 1);
        add_rates(line, idem_rates, raw_rates)
            .integer("rounds", config().rounds)
            .integer("messages", static_cast<long long>(n))
            .str("mode",
                 "per_message: fetch 100, then handle() + AckSync per message (raw: BEGIN, "
                 "2 INSERTs, COMMIT + AckSync per message)")
            .integer("fetch_count", fetch_count);
        emit(line);
    } catch (const std::exception& e) {
        emit(Json().str("bench", "e2e_nats_sqlite").str("store", "sqlite").str("error", e.what()));
    }
}

}  // namespace idem_bench
