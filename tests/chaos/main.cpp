// idem_chaos: workers killed with SIGKILL mid-handler over a real Redis stream; every order must
// end with exactly one capture and one charge. See docs/testing.md and chaos.hpp.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>

#include "chaos.hpp"

namespace {

constexpr const char* usage =
    "usage: idem_chaos [--store sqlite|postgres|redis|mysql|redis-cluster]\n"
    "                  [--broker redis|rabbitmq|nats|kafka] [--offsets kafka|store]\n"
    "                  [--messages N] [--workers K] [--seed S]\n"
    "                  [--naive | --pipelined | --batch] [--poll N] [--kill-rate P]\n"
    "                  [--kill-interval-ms MS]\n"
    "                  [--store-outage-ms MS] [--claim-partition-minutes N] [--visibility-ms MS]\n"
    "                  [--latency-ms MS] [--inflight-ms MS] [--max-deliveries N] [--timeout S]\n"
    "                  [--backoff-ms MS] [--chain A:B] [--redrive]\n"
    "\n"
    "  --store           the idem store the workers use (default sqlite); redis-server always "
    "runs\n"
    "                    (gateway, counters), PostgreSQL only for --store postgres;\n"
    "                    redis-cluster: a 3-master Redis Cluster (replicas_to_ack = 1) whose\n"
    "                    slot-0 master is SIGKILLed a third of the way in\n"
    "  --broker          what carries the messages (default redis: a Redis stream in the run's\n"
    "                    redis-server; rabbitmq: a quorum queue; nats: a JetStream stream;\n"
    "                    kafka: a 4-partition topic on librdkafka's mock cluster)\n"
    "  --offsets         (--broker kafka) kafka: offsets committed after the store's commit\n"
    "                    (default); store: kept in the store's transaction (SQL stores)\n"
    "  --messages        capture messages, order ids 1..N (default 2000)\n"
    "  --workers         worker processes (default 4)\n"
    "  --seed            seeds the driver's kills and each worker's self-kills (default 1)\n"
    "  --naive           the handler as first written (no claim, a fresh gateway key per\n"
    "                    attempt): the negative control, which must report divergences > 0\n"
    "  --pipelined       (--broker redis) the RedisStreamConsumer is given the handler itself and\n"
    "                    reads 4 entries per poll: on a RedisStore each commit goes with the\n"
    "                    next claim and the ack is in the commit (pipeline_commits)\n"
    "  --batch           the workers' consumers handle each poll's deliveries together\n"
    "                    (handle_in_batches, 8 per poll): the IdempotentHandler itself is given\n"
    "                    to the consumer, one handle_batch() transaction per poll; any broker\n"
    "  --poll            (--broker kafka, without --batch) records per poll, handled one at a\n"
    "                    time (default 1); with --offsets store each record's attempt is then\n"
    "                    counted in the commit of the one before it (CountAhead)\n"
    "  --store-outage-ms  makes the workers' store unreachable for MS, again and again at\n"
    "                    random moments (seeded; one every ~max(MS, 2000) ms, never overlapping)\n"
    "                    while workers are killed too. postgres, mysql, redis: the store's server\n"
    "                    alternately SIGSTOPped (a hang) and SIGKILLed + restarted on its data\n"
    "                    (a refusal; --store redis then gets a redis-server of its own); sqlite:\n"
    "                    the driver holds BEGIN EXCLUSIVE on the database (the workers' busy\n"
    "                    timeout is MS/4, so they see store_timeout). Not with redis-cluster\n"
    "  --claim-partition-minutes  (--store postgres, mysql) the claims in partitions of N "
    "minutes,\n"
    "                    one made ahead: the workers' stores make the next ones while the run\n"
    "                    goes on\n"
    "  --kill-rate       probability that a worker kills itself at each crash window of each\n"
    "                    delivery (default 0.02)\n"
    "  --kill-interval-ms  mean time between the driver's SIGKILLs of a random worker (default\n"
    "                    250, with Kafka 2000: a killed member holds its partitions for the\n"
    "                    group's 3 s session timeout; 0: none)\n"
    "  --visibility-ms   the stream's visibility timeout, and the Redis store's lease (default "
    "400)\n"
    "  --latency-ms      a gateway request takes 0..MS (default 3)\n"
    "  --inflight-ms     how long a request whose worker died keeps its key in flight (default\n"
    "                    2000)\n"
    "  --max-deliveries  the handler's poison limit (default 10, see docs/testing.md)\n"
    "  --backoff-ms      the consumers' redelivery backoff before the second delivery, doubling\n"
    "                    from there (default: the library's, 2000); 0: none, each broker's own\n"
    "                    redelivery (what the run did before the backoff existed)\n"
    "  --backoff-max-ms  the longest redelivery backoff (default: the library's, 5 minutes);\n"
    "                    a run whose messages fail many times (store outages) keeps it under\n"
    "                    --timeout\n"
    "  --timeout         seconds to wait for the stream to drain (default: 300, or more with\n"
    "                    --messages: 15 ms a message, 40 ms chained, 600 ms with Kafka, 1 s\n"
    "                    with Kafka and --redrive)\n"
    "  --chain A:B       two services (docs/chain.md): service A consumes broker A and writes its\n"
    "                    row and an outbox intent in one transaction (SQLite), a relay ships\n"
    "                    the intents to broker B, service B charges the gateway and writes its\n"
    "                    capture; A's workers, the relay and B's workers are all killed. With\n"
    "                    --naive: A publishes inside its effect, B has no claim and a fresh key\n"
    "                    per attempt (divergences > 0)\n"
    "  --redrive         one order in 20 fails until the handler is \"fixed\" once the broker\n"
    "                    drained (parked after --max-deliveries, default 3 here); then a\n"
    "                    redriver process brings the store's dead letters back (Store::redrive)\n"
    "                    and relays them to the broker, and is killed as the workers are; every\n"
    "                    order must end captured once and no dead letter left unredriven. With\n"
    "                    --naive the redriver re-publishes the payloads without the claim's\n"
    "                    reset (divergences > 0). Every store; on a Redis stream each entry\n"
    "                    then carries its id in the field message_id\n"
    "\n"
    "The last stdout line is one JSON object. Each order is ok (one capture and one charge that\n"
    "agree, settled), lost (settled at the broker without its effect), doubled (more than one\n"
    "capture or charge, or two that disagree), dead_lettered, pending (read and not settled) or\n"
    "never_read; divergences = lost + doubled + dead_lettered. Exit status: 0 when every order is\n"
    "ok, redeliveries are at least 5% of the messages and a worker was killed; 1 when an order\n"
    "diverged (or the run proved nothing); 3 when nothing diverged but the run did not drain in\n"
    "time (pending or never_read orders left: \"drained\":false); 2 when the harness failed; 77\n"
    "when a server is missing (outside CI).\n";

/// What the run chooses when the command line does not: a Kafka member killed holds its
/// partitions for the group's 3 s session timeout, so kills come every 2 s on average (every
/// 250 ms would keep the group rebalancing and deliver next to nothing); the drain timeout
/// grows with the messages, at what a busy 2-core machine drains per broker.
void defaults(chaos::Options& o) {
    const bool kafka =
        o.broker == chaos::BrokerKind::kafka || (o.chain && o.chain_to == chaos::BrokerKind::kafka);
    if (!o.kill_interval_given && kafka) o.kill_interval = std::chrono::milliseconds(2000);
    if (o.redrive) {
        // Parked soon: three deliveries two seconds apart, so a run's poison orders are all
        // parked when its first drain ends.
        if (!o.max_deliveries_given) o.max_deliveries = 3;
        if (o.backoff_max.count() < 0) o.backoff_max = std::chrono::milliseconds(2000);
    }
    if (!o.timeout_given) {
        // --redrive on Kafka: two drains, the second after the redrive (2,000 messages, seed 7:
        // 1,583 s on a busy machine, beyond 600 ms a message).
        const std::chrono::milliseconds per_message{kafka     ? (o.redrive ? 1000 : 600)
                                                    : o.chain ? 40
                                                              : 15};
        o.timeout = std::max(
            o.timeout, std::chrono::duration_cast<std::chrono::seconds>(per_message * o.messages));
    }
}

long number(const std::string& option, const std::string& text, long min, long max) {
    std::size_t used = 0;
    long value = 0;
    try {
        value = std::stol(text, &used, 10);
    } catch (const std::exception&) {
        used = 0;
    }
    if (used != text.size() || text.empty() || value < min || value > max) {
        throw std::invalid_argument(option + " wants a number from " + std::to_string(min) +
                                    " to " + std::to_string(max) + ", not '" + text + "'");
    }
    return value;
}

chaos::BrokerKind broker_kind(const std::string& option, const std::string& broker) {
    if (broker == "redis") return chaos::BrokerKind::redis_streams;
    if (broker == "rabbitmq") return chaos::BrokerKind::rabbitmq;
    if (broker == "nats") return chaos::BrokerKind::nats;
    if (broker == "kafka") return chaos::BrokerKind::kafka;
    throw std::invalid_argument(option + ": a broker is redis, rabbitmq, nats or kafka, not '" +
                                broker + "'");
}

chaos::Options parse(int argc, char** argv) {
    using std::chrono::milliseconds;
    chaos::Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
            return argv[++i];
        };
        if (arg == "--store") {
            const std::string store = value();
            if (store == "sqlite") {
                o.store = chaos::StoreKind::sqlite;
            } else if (store == "postgres") {
                o.store = chaos::StoreKind::postgres;
            } else if (store == "redis") {
                o.store = chaos::StoreKind::redis;
            } else if (store == "mysql") {
                o.store = chaos::StoreKind::mysql;
            } else if (store == "redis-cluster") {
                o.store = chaos::StoreKind::redis_cluster;
            } else {
                throw std::invalid_argument(
                    "--store is sqlite, postgres, redis, mysql or redis-cluster, not '" + store +
                    "'");
            }
        } else if (arg == "--broker") {
            o.broker = broker_kind(arg, value());
        } else if (arg == "--chain") {
            const std::string pair = value();
            const auto colon = pair.find(':');
            if (colon == std::string::npos) throw std::invalid_argument("--chain wants A:B");
            o.chain = true;
            o.broker = broker_kind(arg, pair.substr(0, colon));
            o.chain_to = broker_kind(arg, pair.substr(colon + 1));
        } else if (arg == "--chain-to") {  // internal, service A
            o.chain_to = broker_kind(arg, value());
        } else if (arg == "--to-address") {  // internal, service A
            o.to_address = value();
        } else if (arg == "--role") {  // internal, worker mode
            const std::string role = value();
            if (role == "a") {
                o.role = chaos::Role::service_a;
            } else if (role == "relay") {
                o.role = chaos::Role::relay;
            } else if (role == "redriver") {
                o.role = chaos::Role::redriver;
            } else {
                throw std::invalid_argument("--role is a, relay or redriver");
            }
        } else if (arg == "--relayed") {  // internal, service B
            o.relayed = true;
        } else if (arg == "--offsets") {
            const std::string mode = value();
            if (mode != "kafka" && mode != "store") {
                throw std::invalid_argument("--offsets is kafka or store, not '" + mode + "'");
            }
            o.offsets_in_store = mode == "store";
        } else if (arg == "--broker-address") {  // internal, worker mode
            o.broker_address = value();
        } else if (arg == "--messages") {
            o.messages = number(arg, value(), 1, 10'000'000);
        } else if (arg == "--workers") {
            o.workers = static_cast<int>(number(arg, value(), 1, 64));
        } else if (arg == "--seed") {
            const std::string text = value();
            std::size_t used = 0;
            try {
                o.seed = std::stoull(text, &used, 10);
            } catch (const std::exception&) {
                used = 0;
            }
            if (used == 0 || used != text.size() || text[0] == '-') {
                throw std::invalid_argument("--seed wants a non-negative integer, not '" + text +
                                            "'");
            }
        } else if (arg == "--naive") {
            o.naive = true;
        } else if (arg == "--pipelined") {
            o.pipelined = true;
        } else if (arg == "--batch") {
            o.batch = true;
        } else if (arg == "--poll") {
            o.poll = static_cast<std::size_t>(number(arg, value(), 1, 100));
        } else if (arg == "--redrive") {
            o.redrive = true;
        } else if (arg == "--store-outage-ms") {
            o.store_outage = milliseconds(number(arg, value(), 0, 600'000));
        } else if (arg == "--claim-partition-minutes") {
            o.claim_partition_minutes = static_cast<int>(number(arg, value(), 1, 10'000));
        } else if (arg == "--kill-rate") {
            const std::string text = value();
            std::size_t used = 0;
            try {
                o.kill_rate = std::stod(text, &used);
            } catch (const std::exception&) {
                used = 0;
            }
            if (used == 0 || used != text.size() || !(o.kill_rate >= 0.0 && o.kill_rate <= 0.5)) {
                throw std::invalid_argument("--kill-rate wants a probability from 0 to 0.5, not '" +
                                            text + "'");
            }
        } else if (arg == "--kill-interval-ms") {
            o.kill_interval = milliseconds(number(arg, value(), 0, 3'600'000));
            o.kill_interval_given = true;
        } else if (arg == "--visibility-ms") {
            o.visibility = milliseconds(number(arg, value(), 50, 3'600'000));
        } else if (arg == "--latency-ms") {
            o.latency = milliseconds(number(arg, value(), 0, 60'000));
        } else if (arg == "--inflight-ms") {
            o.inflight = milliseconds(number(arg, value(), 1, 3'600'000));
        } else if (arg == "--backoff-ms") {
            o.backoff_initial = milliseconds(number(arg, value(), 0, 3'600'000));
        } else if (arg == "--backoff-max-ms") {
            o.backoff_max = milliseconds(number(arg, value(), 1, 3'600'000));
        } else if (arg == "--max-deliveries") {
            o.max_deliveries = static_cast<std::uint32_t>(number(arg, value(), 1, 1000));
            o.max_deliveries_given = true;
        } else if (arg == "--timeout") {
            o.timeout = std::chrono::seconds(number(arg, value(), 1, 86'400));
            o.timeout_given = true;
        } else if (arg == "--worker") {  // internal: the driver starts its workers this way
            o.worker = true;
        } else if (arg == "--redis-port") {
            o.redis_port = static_cast<int>(number(arg, value(), 1, 65535));
        } else if (arg == "--db") {
            o.db = value();
        } else if (arg == "--slot") {
            o.slot = static_cast<int>(number(arg, value(), 0, 64));
        } else if (arg == "--incarnation") {
            o.incarnation = static_cast<int>(number(arg, value(), 0, 1'000'000'000));
        } else if (arg == "--parent") {
            o.parent = static_cast<pid_t>(number(arg, value(), 1, 1L << 30));
        } else if (arg == "--help" || arg == "-h") {
            std::fputs(usage, stdout);
            std::exit(0);
        } else {
            throw std::invalid_argument("unknown option " + arg + " (try --help)");
        }
    }
    if (o.pipelined && (o.naive || o.broker != chaos::BrokerKind::redis_streams)) {
        throw std::invalid_argument("--pipelined is for the idem handler on --broker redis");
    }
    if (o.offsets_in_store &&
        (o.naive || o.broker != chaos::BrokerKind::kafka ||
         (o.store != chaos::StoreKind::sqlite && o.store != chaos::StoreKind::postgres &&
          o.store != chaos::StoreKind::mysql))) {
        throw std::invalid_argument(
            "--offsets store is for the idem handler on --broker kafka with an SQL store");
    }
    if (o.poll != 1 && (o.broker != chaos::BrokerKind::kafka || o.batch)) {
        throw std::invalid_argument("--poll is for --broker kafka, one record at a time");
    }
    if (o.chain && (o.pipelined || o.offsets_in_store || o.store != chaos::StoreKind::sqlite)) {
        throw std::invalid_argument("--chain runs on SQLite, without --pipelined or --offsets");
    }
    if (o.batch && (o.naive || o.pipelined || o.offsets_in_store || o.chain)) {
        // KafkaConsumer refuses KafkaOffsets::in_store with handle_in_batches.
        throw std::invalid_argument(
            "--batch is for the idem handler, without --pipelined, --offsets store or --chain");
    }
    if (o.store_outage.count() > 0 && (o.chain || o.store == chaos::StoreKind::redis_cluster)) {
        throw std::invalid_argument(
            "--store-outage-ms is for one broker's run on sqlite, postgres, mysql or redis");
    }
    if (o.claim_partition_minutes > 0 && o.store != chaos::StoreKind::postgres &&
        o.store != chaos::StoreKind::mysql) {
        throw std::invalid_argument("--claim-partition-minutes is for --store postgres or mysql");
    }
    if (o.redrive && (o.chain || o.pipelined || o.offsets_in_store)) {
        throw std::invalid_argument(
            "--redrive runs without --chain, --pipelined or --offsets store");
    }
    if (o.worker && (o.redis_port == 0 || o.parent == 0)) {
        throw std::invalid_argument("--worker is started by the driver, with its arguments");
    }
    defaults(o);
    return o;
}

}  // namespace

int main(int argc, char** argv) {
    chaos::Options options;
    try {
        options = parse(argc, argv);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "idem_chaos: %s\n", e.what());
        return 2;
    }
    try {
        if (options.worker) return chaos::run_worker(options);
        return options.chain ? chaos::run_chain_driver(options) : chaos::run_driver(options);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "idem_chaos%s: %s\n", options.worker ? " worker" : "", e.what());
        return 2;
    }
}
