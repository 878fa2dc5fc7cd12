// idem_chaos --chain A:B (the driver of a chained run, docs/chain.md): service A's workers
// consume the orders on broker A and write, in one SQLite transaction, their row (accepted) and
// an outbox intent keyed idem::key("order", id); one relay process ships the intents to broker B
// with that broker's sender; service B's workers consume broker B, claim the key as the message
// id, charge the gateway and write their capture (another SQLite store). The driver SIGKILLs A's
// workers, the relay and B's workers at random moments; each kills itself at its crash windows.
// Every order must end with one accepted row, one sent intent, one capture and one charge.

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include <fmt/format.h>

#include "broker.hpp"
#include "chaos.hpp"
#include "gateway.hpp"
#include "harness.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/redis_server.hpp"

namespace chaos {
namespace {

using namespace harness;

/// One service's store: its table, its claims and dead letters.
struct Service {
    std::string db;
    std::string table;  ///< one row per applied order: accepted (A), captures (B)
};

/// order → rows of @p service's table.
std::map<long, long> rows_by_order(const Service& service) {
    idem::SqliteStore store{service.db};
    std::map<long, long> out;
    for (const auto& [order, rows] : sqlite_captures(store, service.table))
        out[order] = static_cast<long>(rows.size());
    return out;
}

}  // namespace

int run_chain_driver(const Options& o) {
    std::string why;
    if (!idem::testing::RedisServer::available(&why)) return missing_server("redis-server", why);
    install_interrupt_handlers();
    const bool progress = ::isatty(STDERR_FILENO) != 0;
    const std::string chain = fmt::format("{}:{}", to_string(o.broker), to_string(o.chain_to));

    Options a = o;  // service A: consumes broker A
    Options b = o;  // the relay and service B: broker B
    b.broker = o.chain_to;

    // The mock Kafka cluster forks its host: first, while this process has one thread.
    RunDir run_dir;
    idem::testing::RedisServer redis_server;
    idem::RedisEndpoint endpoint;
    endpoint.host = redis_server.host();
    endpoint.port = redis_server.port();
    std::unique_ptr<BrokerRun> broker_a;
    std::unique_ptr<BrokerRun> broker_b;
    try {
        if (b.broker == BrokerKind::kafka) {
            broker_b = start_broker(b, redis_server.port(), run_dir.path);
            broker_a = start_broker(a, redis_server.port(), run_dir.path);
        } else {
            broker_a = start_broker(a, redis_server.port(), run_dir.path);
            broker_b = start_broker(b, redis_server.port(), run_dir.path);
        }
    } catch (const server_missing& e) {
        return missing_server(e.what_server.c_str(), e.what());
    }
    if (a.broker == BrokerKind::kafka || b.broker == BrokerKind::kafka) {
        // The servers started above keep their priority; this driver and everything it starts
        // from here (A's workers, the relay, B's workers) run 10 nice levels below them, so
        // that the run's own processes do not make the mock Kafka cluster's session check
        // late: run late, it drops the members waiting in a round, and the answers it holds
        // for them (docs/chain.md, "Kafka's mock cluster").
        errno = 0;
        if (::nice(10) == -1 && errno != 0) std::perror("idem_chaos: nice");
    }
    idem::redis::Connection redis{endpoint};

    const Service service_a{(run_dir.path / "service-a.db").string(), "accepted"};
    const Service service_b{(run_dir.path / "service-b.db").string(), "captures"};
    idem::SqliteStore{service_a.db}.execute(
        "CREATE TABLE accepted(order_id INTEGER NOT NULL, gateway_reference TEXT NOT NULL "
        "DEFAULT '')");
    idem::SqliteStore{service_b.db}.execute(
        "CREATE TABLE captures(order_id INTEGER NOT NULL, gateway_reference TEXT NOT NULL)");

    const auto started = SteadyClock::now();
    broker_b->expect(o.messages);
    broker_a->publish(o.messages);

    auto args_a = worker_args(a, redis_server.port(), service_a.db, broker_a->worker_address());
    args_a.insert(args_a.end(), {"--role", "a", "--chain-to", to_string(b.broker), "--to-address",
                                 broker_b->worker_address()});
    auto args_relay = worker_args(b, redis_server.port(), service_a.db, broker_b->worker_address());
    args_relay.insert(args_relay.end(), {"--role", "relay"});
    auto args_b = worker_args(b, redis_server.port(), service_b.db, broker_b->worker_address());
    args_b.emplace_back("--relayed");
    Fleet fleet_a{o.workers, args_a};
    Fleet relay{o.naive ? 0 : 1, args_relay};
    Fleet fleet_b{o.workers, args_b};
    Fleet* fleets[] = {&fleet_a, &relay, &fleet_b};
    for (Fleet* fleet : fleets)
        fleet->start();

    // Everything shipped: every intent written and marked sent (the naive A has none).
    idem::SqliteStore outbox_of_a{service_a.db};
    auto all_sent = [&] {
        if (o.naive) return true;
        const auto sent = outbox_of_a.query_int(
            "SELECT count(*) FROM idem_outbox WHERE sent_at IS NOT NULL AND NOT parked");
        return sent.value_or(0) >= o.messages;
    };

    std::mt19937_64 random(o.seed);
    auto next_kill_after = [&]() -> SteadyClock::duration {
        const double factor = std::uniform_real_distribution<double>(0.5, 1.5)(random);
        return std::chrono::duration_cast<SteadyClock::duration>(o.kill_interval * factor);
    };
    const int processes = fleet_a.size() + relay.size() + fleet_b.size();
    const auto deadline = started + o.timeout;
    auto next_kill = SteadyClock::now() + next_kill_after();
    auto next_look = SteadyClock::now();
    bool drained = false;
    bool timed_out = false;
    while (!interrupted) {
        for (Fleet* fleet : fleets)
            fleet->reap();
        const auto now = SteadyClock::now();
        if (o.kill_interval.count() > 0 && now >= next_kill) {
            int victim = std::uniform_int_distribution<int>(0, processes - 1)(random);
            for (Fleet* fleet : fleets) {
                if (victim < fleet->size()) {
                    fleet->kill_random(random);
                    break;
                }
                victim -= fleet->size();
            }
            next_kill = SteadyClock::now() + next_kill_after();
        }
        if (now >= next_look) {
            next_look = now + 100ms;
            if (broker_a->drained() && all_sent() && broker_b->drained()) {
                drained = true;
                break;
            }
            if (progress) {
                std::fprintf(stderr, "\r\033[K[chaos] %s: A %s; B %s; delivered %lld",
                             chain.c_str(), broker_a->progress().c_str(),
                             broker_b->progress().c_str(), get_int(redis, delivered_key));
            }
        }
        if (now >= deadline) {
            timed_out = true;
            break;
        }
        std::size_t errors = 0;
        for (Fleet* fleet : fleets)
            errors += fleet->errors().size();
        if (errors > 20) break;
        std::this_thread::sleep_for(5ms);
    }
    for (Fleet* fleet : fleets)
        fleet->stop();
    if (progress) std::fprintf(stderr, "\r\033[K");

    // --- verification --------------------------------------------------------------------------
    const auto accepted = rows_by_order(service_a);
    const auto captured = rows_by_order(service_b);
    std::map<long, std::string> intents;  // order → what is wrong with its intent ("": sent)
    for (const auto& row : outbox_of_a.outbox_rows()) {
        const long order = order_of_message_id(row.idempotency_key).value_or(0);
        intents[order] = row.parked    ? "parked: " + row.last_error
                         : row.sent_at ? std::string()
                                       : "unsent";
    }
    std::set<long> unsettled = broker_a->unsettled_orders();
    for (long order : broker_b->unsettled_orders())
        unsettled.insert(order);
    std::map<long, std::string> letters = broker_a->dead_letters();
    for (const auto& [order, reason] : broker_b->dead_letters())
        letters[order] = reason;
    // The stores' dead letters, named by each broker's message ids (0: not an order's).
    for (const auto& [service, broker] :
         {std::pair{&service_a, broker_a.get()}, std::pair{&service_b, broker_b.get()}}) {
        for (const auto& letter : idem::SqliteStore{service->db}.dead_letters())
            letters[broker->order_of(letter.message_id).value_or(0)] = letter.reason;
    }
    std::vector<std::string> charged_keys;
    for (long order = 1; order <= o.messages; ++order)
        charged_keys.push_back(gw_charged_key(order));
    const auto charges = lists_of(redis, charged_keys);

    long divergences = 0;
    long captures = 0;
    std::vector<std::string> explained;
    auto count_of = [](const std::map<long, long>& rows, long order) {
        const auto found = rows.find(order);
        return found == rows.end() ? 0L : found->second;
    };
    for (long order = 1; order <= o.messages; ++order) {
        const long in_a = count_of(accepted, order);
        const long in_b = count_of(captured, order);
        const auto& charged = charges[static_cast<std::size_t>(order - 1)];
        captures += in_b;
        const auto intent = intents.find(order);
        const std::string intent_state =
            o.naive ? std::string()
                    : (intent == intents.end() ? std::string("no intent") : intent->second);
        const auto letter = letters.find(order);
        if (in_a == 1 && in_b == 1 && charged.size() == 1 && intent_state.empty() &&
            unsettled.count(order) == 0 && letter == letters.end()) {
            continue;
        }
        ++divergences;
        explained.push_back(fmt::format(
            "divergence: order {}: {} row(s) in A, {} capture(s) in B, charges [{}]{}{}{}", order,
            in_a, in_b, fmt::join(charged, " "),
            intent_state.empty() ? "" : ", intent " + intent_state,
            unsettled.count(order) != 0 ? ", unsettled at a broker" : "",
            letter != letters.end() ? ", dead letter: " + letter->second : ""));
    }
    if (const auto unknown = letters.find(0); unknown != letters.end()) {
        ++divergences;
        explained.push_back("divergence: a dead letter of no order: " + unknown->second);
    }
    const long delivered = static_cast<long>(get_int(redis, delivered_key));
    const long redeliveries = std::max(0L, delivered - 2 * o.messages);
    const long relay_sends = static_cast<long>(get_int(redis, relay_sends_key));
    const long gateway_requests = static_cast<long>(get_int(redis, gw_requests_key));
    const long gateway_calls = static_cast<long>(get_int(redis, gw_charges_key));
    long kills = 0, driver_kills = 0, starts = 0;
    for (Fleet* fleet : fleets) {
        kills += fleet->kills();
        driver_kills += fleet->driver_kills();
        starts += fleet->starts();
    }
    const auto self_kills = hash_of(redis, self_kills_key);
    std::string window_text;
    for (const char* window : window_names) {
        const auto found = self_kills.find(window);
        window_text +=
            fmt::format(", {} {}", found != self_kills.end() ? found->second : 0, window);
    }
    const double seconds = std::chrono::duration<double>(SteadyClock::now() - started).count();
    std::printf(
        "%s chain %s, %ld messages, %d workers a side and %s, seed %llu: %ld deliveries; %ld "
        "relay sends; kills: %ld by the driver%s (%ld in all, of A's workers %ld, the relay %ld, "
        "B's workers %ld); %ld process starts; gateway: %ld requests, %ld charges\n",
        o.naive ? "naive" : "idem", chain.c_str(), o.messages, o.workers,
        o.naive ? "no relay" : "one relay", static_cast<unsigned long long>(o.seed), delivered,
        relay_sends, driver_kills, window_text.c_str(), kills, fleet_a.kills(), relay.kills(),
        fleet_b.kills(), starts, gateway_requests, gateway_calls);

    int status = 0;
    if (interrupted) {
        std::printf("idem_chaos: interrupted\n");
        status = exit_harness;
    }
    if (timed_out) {
        std::printf("idem_chaos: the chain did not drain within %lld s\n",
                    static_cast<long long>(o.timeout.count()));
        status = std::max(status, exit_failed);
    }
    if (!drained && !timed_out && !interrupted) status = exit_harness;
    for (Fleet* fleet : fleets) {
        for (const auto& error : fleet->errors()) {
            std::printf("idem_chaos: %s\n", error.c_str());
            status = exit_harness;
        }
    }
    for (std::size_t i = 0; i < explained.size() && i < 50; ++i)
        std::printf("%s\n", explained[i].c_str());
    if (divergences > 0) {
        std::printf("idem_chaos: %ld of %ld orders diverge\n", divergences, o.messages);
        status = std::max(status, exit_failed);
    }
    if (kills == 0 || (!o.naive && relay.kills() == 0)) {
        std::printf("idem_chaos: no worker (or no relay) was killed: the run proved too little\n");
        status = std::max(status, exit_failed);
    }
    std::printf(
        "{\"store\":\"sqlite\",\"broker\":\"%s\",\"chain\":\"%s\",\"messages\":%ld,\"workers\":%d,"
        "\"kills\":%ld,\"relay_kills\":%ld,\"delivered\":%ld,\"redeliveries\":%ld,"
        "\"relay_sends\":%ld,\"captures\":%ld,\"gateway_requests\":%ld,\"gateway_calls\":%ld,"
        "\"divergences\":%ld,\"dead_lettered\":%zu,\"seconds\":%.1f}\n",
        to_string(o.broker), chain.c_str(), o.messages, o.workers, kills, relay.kills(), delivered,
        redeliveries, relay_sends, captures, gateway_requests, gateway_calls, divergences,
        letters.size(), seconds);
    std::fflush(stdout);
    return status;
}

}  // namespace chaos
