#pragma once
// idem_chaos: the first field note's chaos run, for real. Shared by the driver (driver.cpp: starts
// the servers, produces the messages, kills and restarts workers, verifies) and the workers
// (worker.cpp: RedisStreamConsumer + IdempotentHandler, killing themselves at the crash windows).
// The fake payment gateway lives in the same redis-server as Lua scripts (gateway.hpp).
// See docs/testing.md.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "idem/mysql/options.hpp"
#include "idem/postgres/options.hpp"
#include "idem/redis/endpoint.hpp"

#include <sys/types.h>

namespace chaos {

enum class StoreKind { sqlite, postgres, redis, mysql, redis_cluster };

/// What carries the capture messages (--broker). The run's redis-server (gateway, counters) is
/// there whatever the broker.
enum class BrokerKind { redis_streams, rabbitmq, nats, kafka };

inline const char* to_string(BrokerKind kind) {
    switch (kind) {
        case BrokerKind::redis_streams:
            return "redis";
        case BrokerKind::rabbitmq:
            return "rabbitmq";
        case BrokerKind::nats:
            return "nats";
        case BrokerKind::kafka:
            return "kafka";
    }
    return "?";
}

inline const char* to_string(StoreKind kind) {
    switch (kind) {
        case StoreKind::sqlite:
            return "sqlite";
        case StoreKind::postgres:
            return "postgres";
        case StoreKind::redis:
            return "redis";
        case StoreKind::mysql:
            return "mysql";
        case StoreKind::redis_cluster:
            return "redis-cluster";
    }
    return "?";
}

/// --store mysql: the workers' --db is "host:port/database" (user root, no password: the
/// driver's own MariaDB test server).
inline idem::MysqlEndpoint mysql_endpoint_of(const std::string& db) {
    idem::MysqlEndpoint endpoint;
    const auto colon = db.find(':');
    const auto slash = db.find('/');
    endpoint.host = db.substr(0, colon);
    endpoint.port = static_cast<unsigned>(std::stoul(db.substr(colon + 1, slash - colon - 1)));
    endpoint.database = db.substr(slash + 1);
    endpoint.user = "root";
    return endpoint;
}

/// --store redis-cluster: the workers' --db is "host:port,host:port,..." (every node: seeds).
inline std::vector<idem::RedisEndpoint> redis_cluster_seeds_of(const std::string& db) {
    std::vector<idem::RedisEndpoint> seeds;
    std::size_t start = 0;
    while (start < db.size()) {
        std::size_t end = db.find(',', start);
        if (end == std::string::npos) end = db.size();
        const std::string address = db.substr(start, end - start);
        const auto colon = address.rfind(':');
        idem::RedisEndpoint seed;
        seed.host = address.substr(0, colon);
        seed.port = std::stoi(address.substr(colon + 1));
        seeds.push_back(seed);
        start = end + 1;
    }
    return seeds;
}

/// The named crash windows: where a worker may kill itself (raise(SIGKILL)).
enum Window : int {
    after_claim,              ///< the effect has started: the claim is taken, nothing done yet
    after_external_call,      ///< the gateway charged; nothing recorded locally
    before_commit,            ///< the capture is written in the transaction, not committed
    after_commit_before_ack,  ///< committed; the broker has not heard the ack
    after_send_before_mark,   ///< the chain's relay: the next broker has it, the row is unsent
    window_count
};

inline constexpr const char* window_names[window_count] = {
    "after_claim", "after_external_call", "before_commit", "after_commit_before_ack",
    "after_send_before_mark"};

/// What a process of a chained run (--chain A:B, chain.cpp) is.
enum class Role {
    capture,    ///< the one-broker run's worker (and the chain's service B)
    service_a,  ///< consumes broker A, writes its row and the outbox intent for B
    relay,      ///< ships service A's outbox to broker B
    redriver,   ///< --redrive: brings the store's dead letters back and relays them
};

struct Options {
    // What the command line sets (both modes; see usage in main.cpp).
    StoreKind store = StoreKind::sqlite;
    BrokerKind broker = BrokerKind::redis_streams;
    long messages = 2000;
    int workers = 4;
    std::uint64_t seed = 1;
    bool naive = false;
    /// The worker hands the IdempotentHandler itself to the RedisStreamConsumer (Redis stream
    /// only), one entry at a time from polls of several: on a RedisStore each commit goes with the
    /// next claim (RedisStreamConsumerOptions::pipeline_commits) and the ack is in the commit.
    bool pipelined = false;
    /// --broker kafka: the read offsets kept in the store's transaction (KafkaOffsets::in_store;
    /// the worker gives the KafkaConsumer the IdempotentHandler itself) instead of committed to
    /// Kafka after the store's commit.
    bool offsets_in_store = false;
    /// --poll (--broker kafka, one at a time): records per poll. Above 1, each record handed to
    /// the IdempotentHandler itself (--offsets store) has its attempt counted in the commit of
    /// the one before (CountAhead).
    std::size_t poll = 1;
    /// --batch: the worker gives the IdempotentHandler itself to the broker's consumer with
    /// handle_in_batches (batch_size_in_batches per poll): each poll's deliveries in ONE
    /// handle_batch() transaction, then settled. Counted as --pipelined is (SettleCounter).
    bool batch = false;
    /// --store-outage-ms: the driver makes the workers' store unreachable this long, again and
    /// again at seeded random moments (never overlapping) while it also kills workers; 0: never.
    /// Server stores: the server stopped (SIGSTOP, a hang) or SIGKILLed and restarted on its data
    /// (a refusal), alternately; SQLite: the driver holds an exclusive lock on the database.
    std::chrono::milliseconds store_outage{0};
    /// --claim-partition-minutes (--store postgres or mysql): the claims in partitions of this
    /// many minutes (claim_partition_span), one made ahead, so the workers' stores make the next
    /// ones while the run goes on. 0: one claims table.
    int claim_partition_minutes = 0;
    /// The PostgresOptions or MysqlOptions of the run's stores.
    template <class Options>
    [[nodiscard]] Options store_options() const {
        Options options;
        options.claim_partition_span = std::chrono::minutes(claim_partition_minutes);
        options.claim_partitions_ahead = 1;
        return options;
    }
    [[nodiscard]] idem::PostgresOptions postgres_options() const {
        return store_options<idem::PostgresOptions>();
    }
    double kill_rate = 0.02;                       ///< per window, per delivery
    std::chrono::milliseconds kill_interval{250};  ///< mean time between driver kills; 0: none
    bool kill_interval_given = false;              ///< else each broker's default (defaults())
    std::chrono::milliseconds visibility{400};     ///< XCLAIM min-idle; the Redis lease
    std::chrono::milliseconds latency{3};          ///< a gateway request takes 0..latency
    std::chrono::milliseconds inflight{2000};      ///< a dead worker's request holds its key
    std::uint32_t max_deliveries = 10;
    /// The consumers' RedeliveryBackoff::initial; negative: the library's default.
    std::chrono::milliseconds backoff_initial{-1};
    /// The consumers' RedeliveryBackoff::max; negative: the library's default (5 minutes).
    std::chrono::milliseconds backoff_max{-1};
    std::chrono::seconds timeout{300};  ///< give up waiting for the stream to drain
    bool timeout_given = false;         ///< else it grows with the messages (defaults())
    /// --chain A:B: `broker` is A, this is B (the store is SQLite, one for each service).
    bool chain = false;
    BrokerKind chain_to = BrokerKind::nats;
    /// --redrive: the orders poisoned(order) fail until the driver "fixes" the handler (sets
    /// fixed_key) once the broker drained; then a redriver process (killed as the workers are)
    /// brings the store's dead letters back (Store::redrive) and relays the intents to the
    /// broker, and every order must end captured once. With --naive the redriver re-publishes
    /// each dead letter's payload itself, without the claim's reset.
    bool redrive = false;
    bool max_deliveries_given = false;  ///< else --redrive parks at 3 (defaults())

    // Worker mode only (set by the driver).
    bool worker = false;
    int redis_port = 0;
    std::string broker_address;  ///< BrokerRun::worker_address() of the driver's broker
    std::string db;              ///< the SQLite file or the PostgreSQL conninfo
    int slot = 0;
    int incarnation = 0;
    pid_t parent = 0;
    Role role = Role::capture;
    bool relayed = false;    ///< --relayed: service B, reading the relay's messages
    std::string to_address;  ///< service A: broker B's worker_address() (chain_to is B)
};

// Keys in the run's redis-server. The harness's own keys start with "chaos:", the gateway's with
// "gw:", the RedisStore's with "idem:".
/// --batch: deliveries per poll, handled together.
inline constexpr std::size_t batch_size_in_batches = 8;

inline constexpr const char* stream_key = "chaos:payments";
inline constexpr const char* dead_letter_stream_key = "chaos:payments.dead-letters";
inline constexpr const char* group_name = "capture-workers";
inline constexpr const char* scope_name = "capture-payment";
inline constexpr const char* delivered_key = "chaos:delivered";     ///< INCR per delivery
inline constexpr const char* outcomes_key = "chaos:outcomes";       ///< hash: disposition → count
inline constexpr const char* self_kills_key = "chaos:self-kills";   ///< hash: window → count
inline constexpr const char* counts_key = "chaos:delivery-counts";  ///< hash: count → deliveries
inline constexpr const char* relay_sends_key = "chaos:relay-sends";  ///< INCR per relay send
/// --redrive: set by the driver once the first drain is over; the poisoned orders succeed from
/// then.
inline constexpr const char* fixed_key = "chaos:fixed";
/// --redrive --naive: the message ids the naive redriver re-published (a set).
inline constexpr const char* naive_redriven_key = "chaos:naive-redriven";

/// --redrive: the orders that fail until the handler is fixed (one in 20).
inline bool poisoned(long order) {
    return order % 20 == 7;
}
/// A list per message id: one line per delivery as it starts and one as it settles, written by
/// the workers ("<unix ms> d<count> <worker> start" / "... <outcome>: <reason>"), read back by
/// the driver to explain a divergence.
inline std::string history_key(std::string_view message_id) {
    return "chaos:history:" + std::string(message_id);
}
inline std::string redis_captures_key(long order) {
    return "chaos:captures:" + std::to_string(order);
}

/// The amount of an order (any stable function; the demo's).
inline long amount_of(long order) {
    return 1000 + order % 997;
}

int run_driver(const Options& options);
int run_chain_driver(const Options& options);
int run_worker(const Options& options);

}  // namespace chaos
