// idem_chaos (driver): starts redis-server (and PostgreSQL / MariaDB for --store postgres / mysql)
// on free loopback ports in temp dirs, produces the capture messages, runs K worker processes (this
// executable with --worker), kills random workers with SIGKILL at random moments and restarts them,
// waits until the stream is drained, stops the workers and verifies every order. Prints a summary
// and, as its last stdout line, one JSON object.

#include <libpq-fe.h>
#include <signal.h>
#include <sqlite3.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "broker.hpp"
#include "chaos.hpp"
#include "gateway.hpp"
#include "harness.hpp"
#include "idem/store/mysql.hpp"
#include "idem/store/postgres.hpp"
#include "idem/store/redis.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/mariadb_server.hpp"
#include "idem/testing/postgres_server.hpp"
#include "idem/testing/process.hpp"
#include "idem/testing/redis_cluster.hpp"
#include "idem/testing/redis_server.hpp"
#include "store_outage.hpp"

namespace chaos {
namespace {

using namespace harness;

CapturesByOrder postgres_captures(const idem::testing::PostgresServer& server) {
    CapturesByOrder out;
    idem::testing::PgConnection conn{server.connect()};
    std::unique_ptr<PGresult, decltype(&PQclear)> result{
        PQexec(conn.get(), "SELECT order_id, gateway_reference FROM captures"), &PQclear};
    if (PQresultStatus(result.get()) != PGRES_TUPLES_OK) {
        throw std::runtime_error(std::string("SELECT captures: ") + PQerrorMessage(conn.get()));
    }
    for (int row = 0; row < PQntuples(result.get()); ++row) {
        out[std::stol(PQgetvalue(result.get(), row, 0))].emplace_back(
            PQgetvalue(result.get(), row, 1));
    }
    return out;
}

CapturesByOrder mysql_captures(idem::testing::MariadbServer& server) {
    CapturesByOrder out;
    for (const auto& row :
         server.client().query("SELECT order_id, gateway_reference FROM captures"))
        out[std::stol(row.at(0).value_or("0"))].push_back(row.at(1).value_or(""));
    return out;
}

/// --store redis-cluster: every "chaos:captures:<order>{<claim tag>}" list on every live master.
CapturesByOrder redis_cluster_captures(idem::testing::RedisCluster& cluster) {
    CapturesByOrder out;
    for (std::size_t node = 0; node < cluster.size(); ++node) {
        if (!cluster.server(node).running() || !cluster.is_master(node)) continue;
        idem::RedisEndpoint endpoint;
        endpoint.host = cluster.host();
        endpoint.port = cluster.port(node);
        idem::redis::Connection redis{endpoint};
        std::vector<std::string> keys;
        std::string cursor = "0";
        do {
            const auto reply = redis.checked(
                {"SCAN", cursor, "MATCH", "chaos:captures:*", "COUNT", "1000"}, "SCAN");
            cursor = reply.elements.at(0).str;
            for (const auto& key : reply.elements.at(1).elements)
                keys.push_back(key.str);
        } while (cursor != "0");
        std::sort(keys.begin(), keys.end());
        keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
        const auto lists = lists_of(redis, keys);
        for (std::size_t k = 0; k < keys.size(); ++k) {
            const std::string digits = keys[k].substr(std::strlen("chaos:captures:"));
            auto& captures = out[std::stol(digits)];
            captures.insert(captures.end(), lists[k].begin(), lists[k].end());
        }
    }
    return out;
}

CapturesByOrder redis_captures(idem::redis::Connection& redis, long messages) {
    std::vector<std::string> keys;
    for (long order = 1; order <= messages; ++order)
        keys.push_back(redis_captures_key(order));
    const auto lists = lists_of(redis, keys);
    CapturesByOrder out;
    for (long order = 1; order <= messages; ++order) {
        const auto& list = lists[static_cast<std::size_t>(order - 1)];
        if (!list.empty()) out[order] = list;
    }
    return out;
}

/// Calls @p use with the run's store (a connection of the driver's own): @p db as the workers
/// get it, @p store_endpoint the Redis store's server.
template <class Use>
void with_store(const Options& o, const std::string& db, const idem::RedisEndpoint& store_endpoint,
                Use use) {
    switch (o.store) {
        case StoreKind::sqlite: {
            idem::SqliteStore store{db};
            use(store);
            return;
        }
        case StoreKind::postgres: {
            idem::PostgresStore store{db};
            use(store);
            return;
        }
        case StoreKind::mysql: {
            idem::MysqlStore store{mysql_endpoint_of(db)};
            use(store);
            return;
        }
        case StoreKind::redis: {
            idem::RedisStore store{store_endpoint};
            use(store);
            return;
        }
        case StoreKind::redis_cluster: {
            idem::RedisStore store{redis_cluster_seeds_of(db)};
            use(store);
            return;
        }
    }
}

/// --redrive: what is left to bring back. A dead letter counts as redriven once its entry is
/// marked (with --naive: once the naive redriver re-published it).
struct RedriveState {
    long redriven = 0;                        ///< dead-letter entries redriven
    std::map<std::string, std::string> left;  ///< the others: message id → reason
    long unsent = 0;                          ///< outbox intents the relay has not sent
};

RedriveState redrive_state(const Options& o, const std::string& db,
                           const idem::RedisEndpoint& store_endpoint,
                           idem::redis::Connection& redis) {
    std::set<std::string> naive_redriven;
    if (o.naive) {
        for (const auto& id : redis.checked({"SMEMBERS", naive_redriven_key}, "SMEMBERS").elements)
            naive_redriven.insert(id.str);
    }
    RedriveState state;
    with_store(o, db, store_endpoint, [&](auto& store) {
        for (const idem::DeadLetter& letter : store.dead_letters()) {
            const bool redriven = o.naive ? naive_redriven.count(letter.message_id) != 0
                                          : letter.redriven_at.has_value();
            if (redriven) {
                ++state.redriven;
            } else {
                state.left[letter.message_id] = letter.reason;
            }
        }
        for (const idem::OutboxRow& row : store.outbox_rows())
            state.unsent += row.sent_at ? 0 : 1;
    });
    return state;
}

// ---------------------------------------------------------------------------------------------

}  // namespace

int run_driver(const Options& o) {
    std::string why;
    if (!idem::testing::RedisServer::available(&why)) return missing_server("redis-server", why);
    if (o.store == StoreKind::postgres && !idem::testing::PostgresServer::available(&why)) {
        return missing_server("PostgreSQL", why);
    }
    if (o.store == StoreKind::mysql && !idem::testing::MariadbServer::available(&why)) {
        return missing_server("MariaDB", why);
    }
    if (o.store == StoreKind::redis_cluster && !idem::testing::RedisCluster::available(&why)) {
        return missing_server("Redis Cluster (redis-server, redis-cli)", why);
    }
    install_interrupt_handlers();

    const bool progress = ::isatty(STDERR_FILENO) != 0;
    auto say = [&](const std::string& text) {
        if (progress) std::fprintf(stderr, "\r\033[K[chaos] %s", text.c_str());
    };

    // --- servers and stores --------------------------------------------------------------------
    say("starting redis-server");
    idem::testing::RedisServer redis_server;
    idem::RedisEndpoint endpoint;
    endpoint.host = redis_server.host();
    endpoint.port = redis_server.port();
    idem::redis::Connection redis{endpoint};

    std::optional<idem::testing::PostgresServer> pg;
    std::optional<idem::testing::MariadbServer> maria;
    std::optional<idem::testing::RedisCluster>
        cluster;  // the store; the stream and gateway stay out
    // --store redis with --store-outage-ms: the store's own redis-server, stopped in outages
    // while the run's (gateway, counters, stream) stays up.
    std::optional<idem::testing::RedisServer> store_redis;
    RunDir run_dir;
    std::string db;
    switch (o.store) {
        case StoreKind::sqlite: {
            db = (run_dir.path / "shop.db").string();
            idem::SqliteStore store{db};  // creates idem's tables and switches to WAL
            store.execute(
                "CREATE TABLE captures(order_id INTEGER NOT NULL, gateway_reference TEXT NOT "
                "NULL)");
            break;
        }
        case StoreKind::postgres: {
            say("starting PostgreSQL");
            pg.emplace();
            pg->exec(
                "CREATE TABLE captures(order_id BIGINT NOT NULL, gateway_reference TEXT NOT "
                "NULL)");
            db = pg->conninfo();
            // Creates idem's tables once, before the workers race (in partitions if asked).
            idem::PostgresStore store{db, o.postgres_options()};
            break;
        }
        case StoreKind::mysql: {
            say("starting MariaDB");
            maria.emplace();
            maria->client().exec(
                "CREATE TABLE captures(order_id BIGINT NOT NULL, gateway_reference TEXT NOT "
                "NULL) ENGINE=InnoDB");
            db = fmt::format("{}:{}/idem_test", maria->host(), maria->port());
            idem::MysqlStore store{
                mysql_endpoint_of(db),
                o.store_options<idem::MysqlOptions>()};  // idem's tables, before the race
            break;
        }
        case StoreKind::redis:
            if (o.store_outage.count() > 0) {
                say("starting the store's redis-server");
                store_redis.emplace();
                db = std::to_string(store_redis->port());
            }
            break;
        case StoreKind::redis_cluster: {
            say("starting a Redis Cluster");
            cluster.emplace(3, 1, std::chrono::milliseconds(1000));
            for (std::size_t node = 0; node < cluster->size(); ++node)
                db += fmt::format("{}{}:{}", node == 0 ? "" : ",", cluster->host(),
                                  cluster->port(node));
            break;
        }
    }

    idem::RedisEndpoint store_endpoint = endpoint;  // --store redis: the store's server
    if (store_redis) store_endpoint.port = store_redis->port();

    // --- broker and producer ---------------------------------------------------------------------
    say(std::string("starting the broker: ") + to_string(o.broker));
    std::unique_ptr<BrokerRun> broker;
    try {
        broker = start_broker(o, redis_server.port(), run_dir.path);
    } catch (const server_missing& e) {
        return missing_server(e.what_server.c_str(), e.what());
    }
    const auto started = SteadyClock::now();
    broker->publish(o.messages);

    // --- workers, faults, drain ------------------------------------------------------------------
    std::mt19937_64 random(o.seed);
    auto next_kill_after = [&]() -> SteadyClock::duration {
        const double factor = std::uniform_real_distribution<double>(0.5, 1.5)(random);
        return std::chrono::duration_cast<SteadyClock::duration>(o.kill_interval * factor);
    };
    Fleet fleet{o.workers, worker_args(o, redis_server.port(), db, broker->worker_address())};
    // --redrive: the redriver, started once the first drain is over (the handler fixed).
    std::optional<Fleet> redriver;
    long outages_before_redrive = 0;  // --store-outage-ms: those begun before the redriver ran
    std::vector<std::string> redriver_args =
        worker_args(o, redis_server.port(), db, broker->worker_address());
    redriver_args.insert(redriver_args.end(), {"--role", "redriver"});
    auto next_redrive_look = SteadyClock::now();
    std::optional<StoreOutages> outages;
    if (o.store_outage.count() > 0) {
        StoreOutages::Target target;
        if (o.store == StoreKind::sqlite) target.sqlite_path = db;
        if (pg) target.postgres = &*pg;
        if (maria) target.mariadb = &*maria;
        if (store_redis) target.redis = &*store_redis;
        outages.emplace(o, target);
    }
    fleet.start();
    const auto deadline = started + o.timeout;
    auto next_kill = SteadyClock::now() + next_kill_after();
    auto next_look = SteadyClock::now();
    bool drained = false;
    bool timed_out = false;
    bool master_killed = false;
    bool first_outage_due = false;
    while (!interrupted) {
        fleet.reap();
        if (redriver) redriver->reap();
        const auto now = SteadyClock::now();
        if (o.kill_interval.count() > 0 && now >= next_kill) {
            // --redrive: once it runs, the redriver is the victim of one kill in three.
            if (redriver && std::uniform_int_distribution<int>(0, 2)(random) == 0) {
                redriver->kill_random(random);
            } else {
                fleet.kill_random(random);
            }
            next_kill = SteadyClock::now() + next_kill_after();
        }
        if (outages) {
            const std::string change = outages->tick();
            if (!change.empty()) say(change);
        }
        if (now >= next_look) {
            next_look = now + 50ms;
            // --store redis-cluster: a third of the way in (by the deliveries the workers
            // counted, whatever the broker), the master of slot 0 is SIGKILLed; once its replica
            // took over, it comes back as that replica's replica.
            if (cluster && !master_killed && get_int(redis, delivered_key) >= o.messages / 3) {
                master_killed = true;
                const std::size_t victim = cluster->master_index_of(0);
                say("killing a Redis Cluster master");
                cluster->kill_node(victim);
                if (!cluster->wait_until_ok(std::chrono::seconds(60))) {
                    throw std::runtime_error(
                        "the Redis Cluster did not recover from the kill within 60 s (waiting "
                        "for every live node to say cluster_state:ok with every slot served "
                        "and every replica known)\n" +
                        cluster->state());
                }
                cluster->restart_node(victim);
            }
            // --store-outage-ms: the first outage a tenth of the way in (by the deliveries the
            // workers counted), however fast the run.
            if (outages && !first_outage_due &&
                get_int(redis, delivered_key) >= std::max(1L, o.messages / 10)) {
                first_outage_due = true;
                outages->start_soon();
            }
            if (redriver) {
                // Done when nothing is left to redrive or relay, before and after the broker
                // said drained (a worker may park a redriven message again). The broker is
                // asked once per look: RabbitMQ's answer is its count of at most every 2 s.
                // Not while the store is down: a look would wait on a hung server.
                if (now >= next_redrive_look && !(outages && outages->active())) {
                    next_redrive_look = now + 500ms;
                    auto settled = [&] {
                        try {
                            const RedriveState state = redrive_state(o, db, store_endpoint, redis);
                            return state.left.empty() && state.unsent == 0;
                        } catch (const idem::error&) {  // still coming back from an outage
                            return false;
                        }
                    };
                    if (settled() && broker->drained() && settled()) {
                        drained = true;
                        break;
                    }
                }
            } else if (broker->drained()) {
                if (!o.redrive) {
                    drained = true;
                    break;
                }
                // --redrive, the first drain: every poisoned order is parked. The handler is
                // fixed, the redriver starts; the broker now also waits for what it relays.
                say("fixing the handler, starting the redriver");
                redis.checked({"SET", fixed_key, "1"}, "SET");
                broker->expect(o.messages);
                redriver.emplace(1, redriver_args);
                redriver->start();
                if (outages) outages_before_redrive = outages->count();
            }
            if (progress) {
                say(fmt::format("{} on {} {}: {}, delivered {}, kills {}", to_string(o.store),
                                to_string(o.broker), o.naive ? "naive" : "idem", broker->progress(),
                                get_int(redis, delivered_key), fleet.kills()));
            }
        }
        if (now >= deadline) {
            timed_out = true;
            break;
        }
        if (fleet.errors().size() > 20) break;
        std::this_thread::sleep_for(5ms);
    }
    if (outages) outages->end();  // the store back before the workers stop and it is read
    say("stopping the workers");
    if (redriver) redriver->stop();
    fleet.stop();
    if (progress) std::fprintf(stderr, "\r\033[K");

    // --- verification --------------------------------------------------------------------------
    CapturesByOrder captures_by_order;
    std::map<std::string, std::string> store_letters;  // the store's dead letters: id → reason
    // --redrive: only the dead letters left unredriven count; a redriven entry is history.
    std::optional<RedriveState> redrive_end;
    if (o.redrive) redrive_end = redrive_state(o, db, store_endpoint, redis);
    switch (o.store) {
        case StoreKind::sqlite: {
            idem::SqliteStore store{db};
            captures_by_order = sqlite_captures(store);
            for (const auto& letter : store.dead_letters())
                store_letters[letter.message_id] = letter.reason;
            break;
        }
        case StoreKind::postgres: {
            captures_by_order = postgres_captures(*pg);
            idem::PostgresStore store{db};
            for (const auto& letter : store.dead_letters())
                store_letters[letter.message_id] = letter.reason;
            break;
        }
        case StoreKind::mysql: {
            captures_by_order = mysql_captures(*maria);
            idem::MysqlStore store{mysql_endpoint_of(db)};
            for (const auto& letter : store.dead_letters())
                store_letters[letter.message_id] = letter.reason;
            break;
        }
        case StoreKind::redis: {
            idem::redis::Connection store_connection{store_endpoint};
            captures_by_order = redis_captures(store_connection, o.messages);
            idem::RedisStore store{store_endpoint};
            for (const auto& letter : store.dead_letters())
                store_letters[letter.message_id] = letter.reason;
            break;
        }
        case StoreKind::redis_cluster: {
            cluster->wait_until_ok(std::chrono::seconds(60));
            captures_by_order = redis_cluster_captures(*cluster);
            idem::RedisStore store{redis_cluster_seeds_of(db)};
            for (const auto& letter : store.dead_letters())
                store_letters[letter.message_id] = letter.reason;
            break;
        }
    }
    if (redrive_end) store_letters = redrive_end->left;
    const std::set<long> pending_orders = broker->unsettled_orders();
    const std::map<long, std::string> broker_letters = broker->dead_letters();
    std::set<long> dead_lettered_orders;
    // --redrive: the broker's dead-letter place keeps its copy of a redriven message (the
    // redrive re-publishes from the store); the store says which are left.
    for (const auto& [order, reason] : broker_letters)
        if (!o.redrive) dead_lettered_orders.insert(order);
    for (const auto& [id, reason] : store_letters)
        dead_lettered_orders.insert(broker->order_of(id).value_or(0));

    // What the store says of a message's claim (and, on a lease store, its attempts).
    auto describe_claim = [&](const std::string& id) -> std::string {
        std::optional<idem::ClaimRecord> claim;
        std::string attempts;
        with_store(o, db, store_endpoint, [&](auto& store) {
            claim = store.find_claim(scope_name, id);
            if constexpr (std::is_same_v<std::decay_t<decltype(store)>, idem::RedisStore>) {
                attempts = fmt::format(", claims counted {}", store.attempts(scope_name, id));
            }
        });
        if (!claim) return "no claim" + attempts;
        return fmt::format("claim {}{}{}", idem::to_string(claim->disposition),
                           claim->reason.empty() ? "" : " (" + claim->reason + ")", attempts);
    };

    // Every divergence explained: what each delivery of the order did, what the store and the
    // dead letters say.
    auto explain = [&](long order, const char* kind, const std::vector<std::string>& captures_of,
                       const std::vector<std::string>& charges_of, bool pending) {
        const std::string id = broker->message_id_of_order(order);
        std::string text = fmt::format(
            "divergence ({}): order {} (message id {}): captures [{}], charges [{}], {}", kind,
            order, id.empty() ? "?" : id, fmt::join(captures_of, " "), fmt::join(charges_of, " "),
            pending ? "still pending at the broker" : "settled at the broker");
        const auto letter = broker_letters.find(order);
        if (letter != broker_letters.end())
            text += fmt::format("\n  broker dead letter: {}", letter->second);
        const auto stored_letter = store_letters.find(id);
        if (stored_letter != store_letters.end())
            text += fmt::format("\n  store dead letter: {}", stored_letter->second);
        if (id.empty()) return text;
        text += "\n  store: " + describe_claim(id);
        const auto history = lists_of(redis, {history_key(id)}).front();
        long long first = -1;
        text += fmt::format(
            "\n  deliveries ({} lines; a start without an outcome: the worker "
            "died):",
            history.size());
        for (const std::string& line : history) {
            const std::size_t space = line.find(' ');
            const long long at = std::stoll(line.substr(0, space));
            if (first < 0) first = at;
            text += fmt::format("\n    +{:.3f} s {}", static_cast<double>(at - first) / 1000.0,
                                line.substr(space + 1));
        }
        return text;
    };

    std::vector<std::string> charged_keys;
    for (long order = 1; order <= o.messages; ++order)
        charged_keys.push_back(gw_charged_key(order));
    const auto charges_by_order = lists_of(redis, charged_keys);

    // Each order's verdict. Lost, doubled and dead-lettered orders are divergences; a pending
    // order (read, not settled) or one never read is what a run that did not drain leaves, told
    // apart by the order's delivery history (the workers log every delivery they start).
    long captures = 0;
    long no_capture = 0, extra_captures = 0, extra_charges = 0, mismatched = 0;
    long lost = 0, doubled = 0, parked = 0, pending = 0, never_read = 0;
    std::vector<std::string> explained;          // one block per divergent order
    std::vector<long> unsettled_without_effect;  // lost, or never read: the history decides
    for (long order = 1; order <= o.messages; ++order) {
        static const std::vector<std::string> none;
        const auto found = captures_by_order.find(order);
        const auto& c = found != captures_by_order.end() ? found->second : none;
        const auto& g = charges_by_order[static_cast<std::size_t>(order - 1)];
        captures += static_cast<long>(c.size());
        no_capture += c.empty() ? 1 : 0;
        extra_captures += c.size() > 1 ? 1 : 0;
        extra_charges += g.size() > 1 ? 1 : 0;
        const bool agree = c.size() == 1 && g.size() == 1 && c[0] == g[0];
        mismatched += (c.size() == 1 && g.size() == 1 && !agree) ? 1 : 0;
        const bool is_pending = pending_orders.count(order) != 0;
        if (c.size() > 1 || g.size() > 1 || (c.size() == 1 && g.size() == 1 && !agree)) {
            ++doubled;
            explained.push_back(explain(order, "doubled", c, g, is_pending));
        } else if (dead_lettered_orders.count(order) != 0) {
            ++parked;
            explained.push_back(explain(order, "dead-lettered", c, g, is_pending));
        } else if (is_pending) {
            ++pending;
        } else if (!agree) {
            unsettled_without_effect.push_back(order);
        }
    }
    {
        std::vector<std::string> keys;
        for (const long order : unsettled_without_effect)
            keys.push_back(history_key(broker->message_id_of_order(order)));
        const auto histories = lists_of(redis, keys);
        for (std::size_t i = 0; i < unsettled_without_effect.size(); ++i) {
            const long order = unsettled_without_effect[i];
            if (histories[i].empty()) {
                ++never_read;
                continue;
            }
            ++lost;
            const auto found = captures_by_order.find(order);
            static const std::vector<std::string> none;
            explained.push_back(
                explain(order, "lost", found != captures_by_order.end() ? found->second : none,
                        charges_by_order[static_cast<std::size_t>(order - 1)], false));
        }
    }
    const long divergences = lost + doubled + parked;
    const long delivered = static_cast<long>(get_int(redis, delivered_key));
    // The field note's count: deliveries beyond one per message (0 for a run that did not drain).
    const long redeliveries = std::max(0L, delivered - o.messages);
    const long gateway_requests = static_cast<long>(get_int(redis, gw_requests_key));
    const long gateway_calls = static_cast<long>(get_int(redis, gw_charges_key));
    const long gateway_refused = static_cast<long>(get_int(redis, gw_refused_key));
    const long dead_lettered = static_cast<long>(dead_lettered_orders.size());
    const double seconds = std::chrono::duration<double>(SteadyClock::now() - started).count();

    // --- report --------------------------------------------------------------------------------
    const auto outcomes = hash_of(redis, outcomes_key);
    const auto self_kills = hash_of(redis, self_kills_key);
    std::string outcome_text;
    for (const auto& [name, count] : outcomes)
        outcome_text += fmt::format("{}{} {}", outcome_text.empty() ? "" : ", ", count, name);
    std::map<long long, long long> by_count;  // delivery count → deliveries, in numeric order
    for (const auto& [count, deliveries] : hash_of(redis, counts_key))
        by_count[std::stoll(count)] = deliveries;
    std::string count_text;
    for (const auto& [count, deliveries] : by_count)
        count_text += fmt::format("{}{}: {}", count_text.empty() ? "" : ", ", count, deliveries);
    std::string window_text;
    for (const char* window : window_names) {
        const auto found = self_kills.find(window);
        window_text +=
            fmt::format(", {} {}", found != self_kills.end() ? found->second : 0, window);
    }
    std::printf(
        "%s handler on %s over %s, %ld messages, %d workers, seed %llu: %ld deliveries (%s; by "
        "delivery "
        "count %s); kills: %ld "
        "by the driver%s; %ld worker starts; gateway: %ld requests, %ld charges, %ld refused in "
        "flight; orders without a capture %ld, with several captures %ld, with several charges "
        "%ld, capture and charge disagree %ld; pending at the end %zu\n",
        o.naive              ? "naive"
        : o.pipelined        ? "idem pipelined"
        : o.offsets_in_store ? "idem (offsets in the store)"
        : o.batch            ? "idem in batches"
                             : "idem",
        to_string(o.store), to_string(o.broker), o.messages, o.workers,
        static_cast<unsigned long long>(o.seed), delivered, outcome_text.c_str(),
        count_text.c_str(), fleet.driver_kills(), window_text.c_str(), fleet.starts(),
        gateway_requests, gateway_calls, gateway_refused, no_capture, extra_captures, extra_charges,
        mismatched, pending_orders.size());

    int status = 0;
    if (interrupted) {
        std::printf("idem_chaos: interrupted\n");
        status = exit_harness;
    }
    if (timed_out) {
        std::printf(
            "idem_chaos: the stream did not drain within %lld s: %ld orders pending, %ld never "
            "read (not divergences; --timeout S waits longer)\n",
            static_cast<long long>(o.timeout.count()), pending, never_read);
    }
    if (!drained && !timed_out && !interrupted) status = exit_harness;
    for (const auto& error : fleet.errors()) {
        std::printf("idem_chaos: %s\n", error.c_str());
        status = exit_harness;
    }
    for (const std::string& block : explained)
        std::printf("%s\n", block.c_str());
    if (divergences > 0) {
        std::printf(
            "idem_chaos: %ld of %ld orders diverge: %ld lost, %ld doubled, %ld dead-lettered\n",
            divergences, o.messages, lost, doubled, parked);
        status = std::max(status, exit_failed);
    }
    if (drained && pending + never_read > 0) {  // the broker said drained: a harness fault
        std::printf("idem_chaos: drained, yet %ld orders pending and %ld never read\n", pending,
                    never_read);
        status = exit_harness;
    }
    if (drained && redeliveries * 20 < o.messages) {
        std::printf(
            "idem_chaos: only %ld redeliveries (< 5%% of %ld messages): the run proved too little; "
            "raise --kill-rate or lower --kill-interval-ms\n",
            redeliveries, o.messages);
        status = std::max(status, exit_failed);
    }
    if (fleet.kills() == 0) {
        std::printf("idem_chaos: no worker was killed: the run proved nothing\n");
        status = std::max(status, exit_failed);
    }
    if (outages) {
        std::printf(
            "store outages: %ld of %lld ms (%ld SIGSTOP hangs, %ld SIGKILL and restarts, %ld "
            "exclusive locks)\n",
            outages->count(), static_cast<long long>(o.store_outage.count()), outages->hangs(),
            outages->refusals(), outages->locks());
        if (outages->count() == 0) {
            std::printf(
                "idem_chaos: the store was never made unreachable: the run proved nothing about "
                "an outage (more messages, or a shorter --store-outage-ms)\n");
            status = std::max(status, exit_failed);
        }
    }
    if (redrive_end) {
        std::printf(
            "redrive: %ld of %ld orders poisoned until the fix; %ld dead-letter entries %s, %ld "
            "left parked, %ld intents unsent; redriver: %ld kills, %ld starts, %ld store "
            "outages\n",
            (o.messages + 13) / 20, o.messages, redrive_end->redriven,
            o.naive ? "re-published naively" : "redriven",
            static_cast<long>(redrive_end->left.size()), redrive_end->unsent,
            redriver ? redriver->kills() : 0L, redriver ? redriver->starts() : 0L,
            outages && redriver ? outages->count() - outages_before_redrive : 0L);
        if (redrive_end->redriven == 0) {
            std::printf(
                "idem_chaos: nothing was redriven: the run proved nothing about a redrive\n");
            status = std::max(status, exit_failed);
        }
        if (redriver && !redriver->errors().empty()) {
            for (const auto& error : redriver->errors())
                std::printf("idem_chaos: redriver: %s\n", error.c_str());
            status = exit_harness;
        }
    }
    const std::string redrive_field =
        redrive_end ? fmt::format("\"redrive\":true,\"redriven\":{},\"dead_lettered_left\":{},",
                                  redrive_end->redriven, redrive_end->left.size())
                    : std::string();
    const std::string outage_field =
        (outages ? fmt::format("\"store_outages\":{},", outages->count()) : std::string()) +
        (o.claim_partition_minutes > 0
             ? fmt::format(
                   "\"claim_partition_minutes\":{},\"claim_partitions\":{},",
                   o.claim_partition_minutes,
                   pg ? pg->query_value("SELECT count(*) FROM pg_inherits WHERE inhparent = "
                                        "'idem_claims'::regclass")
                            .value_or("?")
                   : maria ? maria->client()
                                 .value("SELECT COUNT(*) FROM information_schema.PARTITIONS WHERE "
                                        "TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'idem_claims' "
                                        "AND PARTITION_NAME IS NOT NULL")
                                 .value_or("?")
                           : std::string("?"))
             : std::string());
    if (cluster) {
        if (master_killed) {
            std::printf(
                "redis-cluster: the master of slot 0 was SIGKILLed a third of the way in; "
                "its replica took over, the killed node came back as its replica\n");
        } else {
            std::printf(
                "idem_chaos: no Redis Cluster master was killed: the run proved nothing "
                "about a failover\n");
            status = std::max(status, exit_failed);
        }
    }
    if (status == 0 && timed_out) status = exit_not_drained;
    std::printf(
        "{\"store\":\"%s\",\"broker\":\"%s\",%s%s%s\"messages\":%ld,\"workers\":%d,"
        "\"kills\":%ld,%s%s"
        "\"delivered\":%ld,"
        "\"redeliveries\":%ld,\"captures\":%ld,\"gateway_requests\":%ld,\"gateway_calls\":%ld,"
        "\"divergences\":%ld,\"lost\":%ld,\"doubled\":%ld,\"dead_lettered\":%ld,"
        "\"pending\":%ld,\"never_read\":%ld,\"drained\":%s,\"seconds\":%.1f}\n",
        to_string(o.store), to_string(o.broker), o.pipelined ? "\"pipelined\":true," : "",
        o.offsets_in_store ? "\"offsets\":\"store\"," : "", o.batch ? "\"batch\":true," : "",
        o.messages, o.workers, fleet.kills(), outage_field.c_str(), redrive_field.c_str(),
        delivered, redeliveries, captures, gateway_requests, gateway_calls, divergences, lost,
        doubled, dead_lettered, pending, never_read, drained ? "true" : "false", seconds);
    std::fflush(stdout);
    return status;
}

}  // namespace chaos
