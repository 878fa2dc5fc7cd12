// Store outages under a broker that is not the store's own server, and the probe that ends them.
// The circuit breaker stops a consumer reading while its store is unreachable and probes the
// store (idem::probe_store) until it answers; that only works when the probe reaches the store's
// server. RedisStore::ping() does (PING; every master of a Cluster; the master the Sentinels name)
// and the Redis answers of a server that cannot serve now (LOADING, MASTERDOWN, CLUSTERDOWN,
// TRYAGAIN) read as store_unavailable.
//
// The probe tests: a killed, a hung (SIGSTOP), a loading and a "not now" Redis fail the probe, a
// Redis Cluster with one master down fails it, and each passes again once the server is back.
//
// The outage tests: a RabbitMQ quorum queue or a Redis stream on ANOTHER redis-server keeps
// delivering while the store's server (a Redis, every master of a Redis Cluster, a MariaDB) is
// killed for 1.5 s, or the Redis hung (SIGSTOP) for 3 s — at least five probe intervals with a
// 100 ms / 200 ms backoff — and messages keep arriving. Each checks: the breaker opened once (at
// most twice) and kept probing (store_probes grew by 5 or more), at most the prefetched
// deliveries were handed to the handler from the kill on (an observer counts every delivery the
// handler got), no delivery count grew with the outage (the highest any delivery had stays <= 2,
// or 3 for a hung server: the claim in flight when it hung runs when it resumes and holds a
// lease), nothing was dead-lettered, and every message was then processed exactly once.

// RabbitMQ, the Redis servers, the Redis Cluster and MariaDB are each started once for this
// binary (it runs as one ctest test).

#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "idem/broker/circuit_breaker.hpp"
#include "idem/broker/rabbitmq.hpp"
#include "idem/broker/redis_streams.hpp"
#include "idem/idem.hpp"
#include "idem/observer.hpp"
#include "idem/redis/cluster.hpp"
#include "idem/redis/connection.hpp"
#include "idem/store/mysql.hpp"
#include "idem/store/redis.hpp"
#include "idem/store/redis/keys.hpp"
#include "idem/testing/mariadb_server.hpp"
#include "idem/testing/rabbitmq_server.hpp"
#include "idem/testing/redis_cluster.hpp"
#include "idem/testing/redis_server.hpp"
#include "support/polling.hpp"
#include "support/refusing_proxy.hpp"
#include "support/require_mariadb.hpp"
#include "support/require_rabbitmq.hpp"
#include "support/require_redis.hpp"
#include "support/require_redis_cluster.hpp"

namespace {

namespace rmq = idem::rabbitmq;
using namespace std::chrono_literals;
using idem::Delivery;
using idem::Disposition;
using idem::StreamEntry;
using Clock = std::chrono::steady_clock;

template <class Pred>
bool wait_for(Pred done, std::chrono::milliseconds limit = 60s) {
    return idem_test::wait_within(limit, done);
}

idem::RedisEndpoint endpoint_of(const idem::testing::RedisServer& server,
                                std::chrono::milliseconds timeout = 2000ms) {
    idem::RedisEndpoint endpoint;
    endpoint.host = server.host();
    endpoint.port = server.port();
    endpoint.connect_timeout = timeout;
    endpoint.command_timeout = timeout;
    return endpoint;
}

/// The store's Redis: killed, hung and restarted by the tests.
idem::testing::RedisServer& store_redis() {
    return idem::testing::shared_redis();
}

/// The broker's Redis: another redis-server, never touched.
idem::testing::RedisServer& stream_redis() {
    static const auto server = std::make_unique<idem::testing::RedisServer>();
    return *server;
}

/// What the probe threw: "" when it passed.
template <class Store>
std::string probe(Store& store, bool* unreachable = nullptr) {
    bool down = false;
    std::string what;
    try {
        idem::probe_store(store);
    } catch (const idem::store_unavailable& e) {
        down = true;
        what = std::string("store_unavailable: ") + e.what();
    } catch (const idem::store_timeout& e) {
        down = true;
        what = std::string("store_timeout: ") + e.what();
    } catch (const std::exception& e) {
        what = std::string("other: ") + e.what();
    }
    if (unreachable != nullptr) *unreachable = down;
    return what;
}

// ---------------------------------------------------------------------------------------------
// The probe

TEST(RedisStoreProbeTest, PingFailsWhileRedisIsKilledAndPassesOnceItIsBack) {
    IDEM_REQUIRE_REDIS();
    auto& redis = store_redis();
    idem::RedisStore store{endpoint_of(redis)};
    EXPECT_EQ(probe(store), "");
    // A transaction begun and rolled back sends nothing: the old probe passed here.
    redis.kill9();
    bool unreachable = false;
    for (int i = 0; i < 3; ++i) {
        const std::string what = probe(store, &unreachable);
        EXPECT_TRUE(unreachable) << "probe " << i << ": " << (what.empty() ? "passed" : what);
    }
    EXPECT_THROW(store.ping(), idem::store_unavailable);
    redis.start();
    EXPECT_EQ(probe(store), "");
}

TEST(RedisStoreProbeTest, PingTimesOutWhileRedisHangs) {
    IDEM_REQUIRE_REDIS();
    auto& redis = store_redis();
    idem::RedisStore store{endpoint_of(redis, 300ms)};
    EXPECT_EQ(probe(store), "");
    redis.pause();  // SIGSTOP: connections stay open, nothing answers
    const auto start = Clock::now();
    bool timed_out = false;
    try {
        store.ping();
    } catch (const idem::store_timeout&) {
        timed_out = true;
    } catch (const std::exception& e) {
        ADD_FAILURE() << "not a store_timeout: " << e.what();
    }
    const auto took = Clock::now() - start;
    redis.resume();
    EXPECT_TRUE(timed_out);
    EXPECT_LT(took, 2s) << "the probe is bounded by the endpoint's command_timeout (300 ms)";
    EXPECT_TRUE(wait_for([&] { return probe(store).empty(); }, 10s)) << probe(store);
}

// A restarted Redis replays its AOF before it serves, answering LOADING meanwhile: the probe and
// a claim read that as unavailable (the breaker opens and stays open), not as a failed command.
TEST(RedisStoreProbeTest, ARedisStillLoadingItsAofIsUnavailable) {
    IDEM_REQUIRE_REDIS();
    // key-load-delay (µs per key loaded) makes the replay last long enough to be seen.
    idem::testing::RedisServer server{idem::testing::RedisServer::Setup{
        idem::testing::RedisServer::aof_always, {"--key-load-delay", "300"}, {}}};
    server.client().exec({"EVAL", "for i = 1, 8000 do redis.call('SET', 'k' .. i, i) end", "0"});
    idem::RedisStore store{endpoint_of(server)};
    EXPECT_EQ(probe(store), "");
    auto handler =
        idem::make_handler(store, idem::Policy{"loading"},
                           [](auto& tx, const std::string& b) { tx.write("SET", b, 1); });
    server.kill9();
    std::thread restart([&] { server.start(); });  // returns once the replay is over
    idem::testing::RedisClient watch{server.host(), server.port(), 500ms};
    auto loading = [&] {
        try {
            return watch.str({"INFO", "persistence"}).value_or("").find("loading:1") !=
                   std::string::npos;
        } catch (const std::exception&) {  // not listening yet
            watch.disconnect();
            return false;
        }
    };
    const bool seen = wait_for(loading, 20s);
    std::string first, second;
    std::optional<idem::Outcome> outcome;
    if (seen) {
        first = probe(store);  // may meet the connection the kill closed
        second = probe(store);
        outcome = handler.handle(Delivery{"during-load", 1u}, std::string("during-load"));
    }
    const bool still_loading = seen && loading();
    restart.join();
    ASSERT_TRUE(seen) << "the replay was not seen; " << server.log_tail();
    ASSERT_TRUE(still_loading) << "the load ended before the probes; make it longer";
    EXPECT_NE(first, "");
    EXPECT_EQ(second.rfind("store_unavailable:", 0), 0u) << second;
    EXPECT_NE(second.find("LOADING"), std::string::npos) << second;
    ASSERT_TRUE(outcome.has_value());
    EXPECT_EQ(outcome->disposition, Disposition::failed);
    EXPECT_TRUE(outcome->store_unreachable()) << outcome->reason;
    EXPECT_EQ(probe(store), "");
    EXPECT_EQ(handler.handle(Delivery{"after-load", 1u}, std::string("after-load")).disposition,
              Disposition::processed);
}

// The other "not now" answers, from a proxy in front of a real server: PING and a claim answered
// MASTERDOWN, CLUSTERDOWN, TRYAGAIN or LOADING throw store_unavailable (and the handler's outcome
// opens the breaker); any other error reply stays a store_error.
TEST(RedisStoreProbeTest, NotNowRepliesAreUnavailableOtherErrorsAreNot) {
    IDEM_REQUIRE_REDIS();
    auto& redis = store_redis();
    const auto refused = [](const std::vector<std::string>& args) {
        return !args.empty() && (args[0] == "PING" || args[0] == "SET" || args[0] == "EVALSHA" ||
                                 args[0] == "SCRIPT");
    };
    for (const std::string error :
         {"LOADING Redis is loading the dataset in memory", "MASTERDOWN Link with MASTER is down",
          "CLUSTERDOWN The cluster is down", "TRYAGAIN Multiple keys request during rehashing"}) {
        SCOPED_TRACE(error);
        idem_test::RefusingProxy proxy(redis.host(), redis.port(), refused, error);
        idem::RedisEndpoint endpoint = endpoint_of(redis);
        endpoint.port = proxy.port();
        idem::RedisStore store{endpoint};
        bool unreachable = false;
        const std::string what = probe(store, &unreachable);
        EXPECT_TRUE(unreachable) << what;
        EXPECT_NE(what.find(error.substr(0, error.find(' '))), std::string::npos) << what;
        if (error.rfind("LOADING", 0) == 0 || error.rfind("MASTERDOWN", 0) == 0) {
            // (CLUSTERDOWN and TRYAGAIN to a keyed command make the router treat the server as
            // a Cluster node; the cluster tests cover those.)
            auto handler =
                idem::make_handler(store, idem::Policy{"not-now"},
                                   [](auto& tx, const std::string& b) { tx.write("SET", b, 1); });
            const idem::Outcome outcome = handler.handle(Delivery{"m-1", 1u}, std::string("k"));
            EXPECT_EQ(outcome.disposition, Disposition::failed);
            EXPECT_TRUE(outcome.store_unreachable()) << outcome.reason;
        }
    }
    {
        // A server that answers the persistence check's INFO persistence with LOADING: no answer
        // yet, not a server without AOF (usage_error). The store is built, and the probe (whose
        // first contact runs the check) fails until the server answers.
        idem_test::RefusingProxy loading(
            redis.host(), redis.port(),
            [](const std::vector<std::string>& args) {
                return args.size() == 2 && args[0] == "INFO" && args[1] == "persistence";
            },
            "LOADING Redis is loading the dataset in memory");
        idem::RedisEndpoint endpoint = endpoint_of(redis);
        endpoint.port = loading.port();
        std::optional<idem::RedisStore> store;
        EXPECT_NO_THROW(store.emplace(endpoint));
        if (store) {
            bool unreachable = false;
            const std::string what = probe(*store, &unreachable);
            EXPECT_TRUE(unreachable) << what;
        }
    }
    idem_test::RefusingProxy other(redis.host(), redis.port(), refused, "NOPERM no PING for you");
    idem::RedisEndpoint endpoint = endpoint_of(redis);
    endpoint.port = other.port();
    idem::RedisStore store{endpoint};
    bool unreachable = true;
    const std::string what = probe(store, &unreachable);
    EXPECT_FALSE(unreachable) << what;
    EXPECT_EQ(what.rfind("other:", 0), 0u) << what;  // a failed probe, not an outage
}

/// The nodes of the master serving @p slot and its replicas.
std::vector<std::size_t> master_and_replicas(idem::testing::RedisCluster& cluster,
                                             std::uint16_t slot) {
    const std::size_t master = cluster.master_index_of(slot);
    const std::string id = cluster.id_of(master);
    std::vector<std::size_t> out{master};
    std::istringstream lines(cluster.client(master).str({"CLUSTER", "NODES"}).value_or(""));
    std::string line;
    while (std::getline(lines, line)) {
        std::istringstream fields(line);
        std::string node_id, address, flags, master_id;
        fields >> node_id >> address >> flags >> master_id;
        if (master_id != id) continue;
        const int port = std::stoi(address.substr(address.find(':') + 1));
        for (std::size_t i = 0; i < cluster.size(); ++i) {
            if (cluster.port(i) == port) out.push_back(i);
        }
    }
    return out;
}

// The probe of a Cluster PINGs every master: one master down (with its replica, so none takes
// over) fails it although the node the store was given answers.
TEST(RedisClusterStoreProbeTest, PingFailsWhileOneMasterIsDown) {
    IDEM_REQUIRE_REDIS_CLUSTER();
    auto& cluster = idem::testing::shared_redis_cluster();
    cluster.restore();
    idem::RedisEndpoint one_node;
    one_node.host = cluster.host();
    one_node.port = cluster.port(0);
    idem::RedisStore store{one_node};
    EXPECT_EQ(probe(store), "");
    ASSERT_TRUE(store.is_cluster());
    // A master whose group (it and its replicas) does not hold node 0, so node 0 keeps answering.
    std::vector<std::size_t> down;
    for (std::uint16_t slot : {std::uint16_t{0}, std::uint16_t{6000}, std::uint16_t{12000}}) {
        const std::vector<std::size_t> group = master_and_replicas(cluster, slot);
        if (std::find(group.begin(), group.end(), 0) == group.end()) {
            down = group;
            break;
        }
    }
    ASSERT_GE(down.size(), 2u) << cluster.state();
    for (std::size_t node : down)
        cluster.kill_node(node);
    bool unreachable = false;
    for (int i = 0; i < 3; ++i) {
        const std::string what = probe(store, &unreachable);
        EXPECT_TRUE(unreachable) << "probe " << i << ": " << (what.empty() ? "passed" : what);
    }
    cluster.restore();
    EXPECT_TRUE(wait_for([&] { return probe(store).empty(); }, 30s)) << probe(store);
}

// ---------------------------------------------------------------------------------------------
// Outages under a broker

/// The test's own RabbitMQ connection: declares a fresh quorum queue, publishes.
class RabbitAdmin {
  public:
    RabbitAdmin() : c_(idem::testing::shared_rabbitmq().endpoint()) {}
    void fresh_quorum_queue(const std::string& queue) {
        open();
        for (const std::string& q : {queue, queue + ".retry", queue + ".dead-letters"})
            c_.delete_queue(ch, q);
        for (std::uint64_t tier = 1; tier <= (1u << 20); tier <<= 1)
            c_.delete_queue(ch, queue + ".retry." + std::to_string(tier));
        rmq::QueueDeclare how;
        how.arguments = {{"x-queue-type", std::string("quorum")}};
        c_.declare_queue(ch, queue, how);
    }
    void publish(const std::string& queue, const std::string& id) {
        open();
        rmq::Publish p;
        p.routing_key = queue;
        p.properties.message_id = id;
        p.properties.delivery_mode = 2;
        c_.publish_confirmed(ch, p, id);
    }

  private:
    static constexpr std::uint16_t ch = 1;
    void open() {
        if (!c_.connected()) c_.connect();
        if (!c_.channel_open(ch)) c_.open_channel(ch);
    }
    rmq::Connection c_;
};

/// Every delivery handed to the handler, whatever its outcome: how many, and the highest delivery
/// count any had.
class DeliveryWatch final : public idem::Observer {
  public:
    void on_outcome(std::string_view, const Delivery& delivery, const idem::Outcome&) override {
        std::lock_guard<std::mutex> lock(mutex_);
        ++handed_;
        highest_ = std::max(highest_, delivery.delivery_count.value());
    }
    std::size_t handed() {
        std::lock_guard<std::mutex> lock(mutex_);
        return handed_;
    }
    std::uint32_t highest_count() {
        std::lock_guard<std::mutex> lock(mutex_);
        return highest_;
    }

  private:
    std::mutex mutex_;
    std::size_t handed_ = 0;
    std::uint32_t highest_ = 0;
};

/// How long the store is down (killed: 1.5 s; hung: 3 s, each probe then also waits out its
/// timeout), and the breaker's backoff: at least five probe intervals either way.
constexpr auto outage_length = 1500ms;
constexpr auto hang_length = 3000ms;
idem::CircuitBreakerOptions fast_breaker() {
    idem::CircuitBreakerOptions breaker;
    breaker.initial_backoff = 100ms;
    breaker.max_backoff = 200ms;
    return breaker;
}

/// What a consumer did around the outage.
struct OutageSeen {
    std::size_t opened = 0;         ///< circuit_opened during the outage
    std::size_t probes = 0;         ///< store_probes during the outage
    std::size_t handed = 0;         ///< deliveries handed to the handler from the kill on
    std::size_t handed_open = 0;    ///< of those, once the breaker was open
    std::size_t dead_lettered = 0;  ///< over the whole run
    std::size_t acked = 0;
    bool opened_in_time = false;
    bool finished = false;
};

/// Runs @p consumer (run() on a thread): @p before messages first; once 3 are acked the store
/// goes @p down for @p length while @p during more messages are published (a publisher thread),
/// then it comes back @p up; waits until all are acked. @p publish(i) publishes message i.
template <class Consumer>
OutageSeen run_outage(Consumer& consumer, DeliveryWatch& watch,
                      const std::function<void(int)>& publish, int before, int during,
                      const std::function<void()>& down, const std::function<void()>& up,
                      std::chrono::milliseconds length) {
    OutageSeen seen;
    for (int i = 0; i < before; ++i)
        publish(i);
    std::thread worker([&] { consumer.run(); });
    const bool started = wait_for([&] { return consumer.stats().acked >= 3; }, 30s);
    if (started) {
        const auto s0 = consumer.stats();
        const std::size_t handed0 = watch.handed();
        const auto down_at = Clock::now();
        down();
        std::thread publisher([&] {
            for (int i = before; i < before + during; ++i) {
                publish(i);
                std::this_thread::sleep_for(length / (during + 1));
            }
        });
        seen.opened_in_time = wait_for([&] { return consumer.stats().circuit_opened > 0; }, 10s);
        const std::size_t handed_open = watch.handed();
        std::this_thread::sleep_until(down_at + length);
        publisher.join();
        const auto s1 = consumer.stats();
        const std::size_t handed1 = watch.handed();
        up();
        seen.opened = s1.circuit_opened - s0.circuit_opened;
        seen.probes = s1.store_probes - s0.store_probes;
        seen.handed = handed1 - handed0;
        seen.handed_open = handed1 - handed_open;
        seen.finished = wait_for(
            [&] { return consumer.stats().acked >= static_cast<std::size_t>(before + during); });
    }
    consumer.request_stop();
    worker.join();
    seen.acked = consumer.stats().acked;
    seen.dead_lettered = consumer.stats().dead_lettered;
    EXPECT_TRUE(started) << "no message was processed before the outage";
    return seen;
}

/// The checks every outage test makes; @p prefetch: the deliveries the consumer may hold.
void expect_paused(const OutageSeen& seen, std::size_t prefetch, std::uint32_t highest_count,
                   std::uint32_t count_limit, int total) {
    std::printf(
        "outage: opened %zu, probes %zu, handed %zu (%zu once open), highest delivery "
        "count %u, acked %zu, dead-lettered %zu\n",
        seen.opened, seen.probes, seen.handed, seen.handed_open, highest_count, seen.acked,
        seen.dead_lettered);
    EXPECT_TRUE(seen.opened_in_time) << "the breaker did not open";
    EXPECT_TRUE(seen.finished) << "acked " << seen.acked << " of " << total;
    EXPECT_GE(seen.opened, 1u);
    EXPECT_LE(seen.opened, 2u) << "the breaker closed during the outage: the probe passed";
    EXPECT_GE(seen.probes, 5u) << "the breaker did not keep probing";
    EXPECT_LE(seen.handed, prefetch + 1)
        << "deliveries were handed to the handler while the store was down";
    EXPECT_LE(seen.handed_open, prefetch);
    EXPECT_LE(highest_count, count_limit) << "delivery counts grew with the outage";
    EXPECT_EQ(seen.dead_lettered, 0u);
    EXPECT_EQ(seen.acked, static_cast<std::size_t>(total));
}

/// The hash tag of (scope, id)'s claim key: an effect key with it is in the claim's slot, so on a
/// Cluster it commits with the claim (a write to another slot is at most once, docs/redis.md).
std::string claim_tag(const std::string& scope, const std::string& id) {
    const std::string key = idem::redis::KeyLayout("idem:").claim(scope, id);
    return key.substr(key.find('{'));
}

/// A Redis store's handler: the effect INCRs a key of the message (each must be 1 in the end).
template <class Message>
auto counting_handler(idem::RedisStore& store, const std::string& scope, DeliveryWatch& watch,
                      std::function<std::string(const Message&)> id_of) {
    return idem::make_handler(
        store, idem::Policy{scope},
        [scope, id_of](auto& tx, const Message& m) {
            tx.write("INCR", "fx" + claim_tag(scope, id_of(m)));
            std::this_thread::sleep_for(5ms);  // deliveries are in flight when the store dies
        },
        &watch);
}

/// Each message's effect key is 1 (@p reader_of: a client on the key's server).
void expect_each_once(
    const std::string& scope, int total,
    const std::function<idem::testing::RedisClient(const std::string&)>& reader_of) {
    for (int i = 0; i < total; ++i) {
        const std::string key = "fx" + claim_tag(scope, std::to_string(i));
        EXPECT_EQ(reader_of(key).integer({"GET", key}).value_or(0), 1) << key;
    }
}

idem::RabbitMqConsumerOptions rabbit_options(const std::string& queue) {
    idem::RabbitMqConsumerOptions options{queue};
    options.prefetch = 4;
    options.poll_wait = 50ms;
    options.in_progress_delay = 300ms;
    options.redelivery_backoff = idem::RedeliveryBackoff::none();  // a failure comes back at once
    options.circuit_breaker = fast_breaker();
    return options;
}

/// A RabbitMQ quorum queue's consumer on @p store through an outage (@p down, @p up).
void rabbit_outage(idem::RedisStore& store, const std::string& queue,
                   const std::function<void()>& down, const std::function<void()>& up,
                   std::chrono::milliseconds length, std::uint32_t count_limit,
                   const std::function<idem::testing::RedisClient(const std::string&)>& reader_of) {
    RabbitAdmin admin;
    admin.fresh_quorum_queue(queue);
    DeliveryWatch watch;
    auto handler = counting_handler<idem::RabbitMessage>(
        store, queue, watch, [](const idem::RabbitMessage& m) { return m.body; });
    idem::RabbitMqConsumer consumer{idem::testing::shared_rabbitmq().endpoint(),
                                    rabbit_options(queue), handler};
    constexpr int before = 20, during = 20;
    const OutageSeen seen = run_outage(
        consumer, watch, [&](int i) { admin.publish(queue, std::to_string(i)); }, before, during,
        down, up, length);
    expect_paused(seen, rabbit_options(queue).prefetch, watch.highest_count(), count_limit,
                  before + during);
    expect_each_once(queue, before + during, reader_of);
}

class RedisStoreOutageTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_REDIS();
        store_redis().flushall();
    }
    /// The store: leases of 1 s, shorter than the outage (the claim of the delivery in flight
    /// when the server died keeps its lease: its release could not reach the server).
    static std::unique_ptr<idem::RedisStore> make_store(
        std::chrono::milliseconds timeout = 2000ms) {
        idem::RedisOptions options;
        options.lease = 1s;
        return std::make_unique<idem::RedisStore>(endpoint_of(store_redis(), timeout), options);
    }
    static idem::testing::RedisClient reader(const std::string&) { return store_redis().client(); }
};

TEST_F(RedisStoreOutageTest, RabbitQueuePausesWhileRedisIsKilled) {
    IDEM_REQUIRE_RABBITMQ();
    auto store = make_store();
    rabbit_outage(
        *store, "outage_redis_killed", [] { store_redis().kill9(); }, [] { store_redis().start(); },
        outage_length, 2, reader);
}

// SIGSTOP: the server hangs, every command and the probe time out (store_timeout, 200 ms). The
// claim in flight when it hung runs once it resumes and holds a lease for a transaction that
// gave up: that message may come back in_progress once, so its count may reach 3.
TEST_F(RedisStoreOutageTest, RabbitQueuePausesWhileRedisHangs) {
    IDEM_REQUIRE_RABBITMQ();
    auto store = make_store(200ms);
    rabbit_outage(
        *store, "outage_redis_hung", [] { store_redis().pause(); }, [] { store_redis().resume(); },
        hang_length, 3, reader);
}

TEST_F(RedisStoreOutageTest, RedisStreamOnAnotherServerPausesWhileRedisIsKilled) {
    auto store = make_store();
    auto& broker = stream_redis();
    broker.flushall();
    DeliveryWatch watch;
    auto handler = counting_handler<StreamEntry>(
        *store, "outage_stream", watch,
        [](const StreamEntry& e) { return std::string(*e.field("order")); });
    idem::RedisStreamConsumerOptions options;
    options.stream = "orders";
    options.group = "workers";
    options.consumer = "c1";
    options.batch_size = 4;
    options.visibility_timeout = 1s;  // the lease's length; the broker redelivers after it
    options.poll_wait = 50ms;
    options.circuit_breaker = fast_breaker();
    idem::RedisStreamConsumer consumer{endpoint_of(broker), options, handler};
    idem::redis::Connection producer{endpoint_of(broker)};
    constexpr int before = 20, during = 20;
    const OutageSeen seen = run_outage(
        consumer, watch,
        [&](int i) {
            producer.checked({"XADD", "orders", "*", "order", std::to_string(i)}, "XADD");
        },
        before, during, [] { store_redis().kill9(); }, [] { store_redis().start(); },
        outage_length);
    expect_paused(seen, options.batch_size, watch.highest_count(), 2, before + during);
    expect_each_once("outage_stream", before + during, reader);
    EXPECT_EQ(broker.client().integer({"XLEN", "orders.dead-letters"}).value_or(0), 0);
}

// A Redis Cluster whose masters are all killed (no replica can be elected without them), then
// started again: the probe PINGs every master.
TEST(RedisClusterStoreOutageTest, RabbitQueuePausesWhileTheClusterMastersAreKilled) {
    IDEM_REQUIRE_REDIS_CLUSTER();
    IDEM_REQUIRE_RABBITMQ();
    auto& cluster = idem::testing::shared_redis_cluster();
    cluster.restore();
    cluster.flushall();
    idem::RedisEndpoint one_node;
    one_node.host = cluster.host();
    one_node.port = cluster.port(0);
    idem::RedisOptions store_options;
    store_options.lease = 1s;
    idem::RedisStore store{one_node, store_options};
    std::vector<std::size_t> masters;
    rabbit_outage(
        store, "outage_redis_cluster",
        [&] {
            for (std::size_t i = 0; i < cluster.size(); ++i) {
                if (cluster.is_master(i)) masters.push_back(i);
            }
            for (std::size_t i : masters)
                cluster.kill_node(i);
        },
        [&] { cluster.restore(); }, outage_length, 2,
        [&](const std::string& key) {
            return cluster.client(cluster.master_index_of(idem::redis::hash_slot(key)));
        });
    EXPECT_EQ(masters.size(), 3u);
}

TEST(MysqlStoreOutageTest, RabbitQueuePausesWhileMariadbIsKilled) {
    IDEM_REQUIRE_MARIADB();
    IDEM_REQUIRE_RABBITMQ();
    auto& mariadb = idem::testing::shared_mariadb();
    mariadb.client("").exec("DROP DATABASE IF EXISTS outage; CREATE DATABASE outage");
    mariadb.client("outage").exec("CREATE TABLE effects(k VARCHAR(64) NOT NULL) ENGINE=InnoDB");
    idem::MysqlEndpoint endpoint;
    endpoint.host = mariadb.host();
    endpoint.port = static_cast<unsigned>(mariadb.port());
    endpoint.user = mariadb.user();
    endpoint.database = "outage";
    idem::MysqlStore store{endpoint};
    const std::string queue = "outage_mysql";
    RabbitAdmin admin;
    admin.fresh_quorum_queue(queue);
    DeliveryWatch watch;
    auto handler = idem::make_handler(
        store, idem::Policy{queue},
        [&](auto& tx, const idem::RabbitMessage& m) {
            tx.execute("INSERT INTO effects(k) VALUES (?)", m.body);
            std::this_thread::sleep_for(5ms);
        },
        &watch);
    idem::RabbitMqConsumer consumer{idem::testing::shared_rabbitmq().endpoint(),
                                    rabbit_options(queue), handler};
    constexpr int before = 20, during = 20;
    const OutageSeen seen = run_outage(
        consumer, watch, [&](int i) { admin.publish(queue, std::to_string(i)); }, before, during,
        [&] { mariadb.kill9(); }, [&] { mariadb.start(); }, outage_length);
    expect_paused(seen, rabbit_options(queue).prefetch, watch.highest_count(), 2, before + during);
    EXPECT_EQ(store.query_int("SELECT COUNT(*) FROM effects").value_or(-1), before + during);
    EXPECT_EQ(store.query_int("SELECT COUNT(DISTINCT k) FROM effects").value_or(-1),
              before + during);
}

}  // namespace
