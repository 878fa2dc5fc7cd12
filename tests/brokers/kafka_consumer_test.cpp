// idem::KafkaConsumer against librdkafka's mock cluster (idem::testing::KafkaCluster: the Kafka
// protocol on loopback, consumer groups and offset commits; not Apache Kafka) and real stores
// (SQLite, PostgreSQL, Redis): a member SIGKILLed between its commit and its offset commit, a
// record that kills every worker parked after max_deliveries attempts counted in the store,
// retries in place keeping partition order, offsets kept in the store through a rebalance, the
// broker down and back, the store down while records keep coming, batch mode.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <idem/broker/kafka.hpp>
#include <idem/kafka/consumer.hpp>
#include <idem/kafka/producer.hpp>
#include <idem/store/memory.hpp>
#include <idem/store/postgres.hpp>
#include <idem/store/redis.hpp>
#include <idem/store/sqlite.hpp>
#include <idem/testing/kafka_cluster.hpp>
#include <idem/testing/postgres_server.hpp>
#include <idem/testing/process.hpp>
#include <idem/testing/redis_server.hpp>
#include <idem/testing/temp_dir.hpp>

#include "support/forked_child.hpp"
#include "support/require_postgres.hpp"
#include "support/require_redis.hpp"

IDEM_BEGIN_NAMESPACE
namespace detail {
/// The KafkaConsumer's fault seam: its next @p times seeks fail as a seek that timed out does
/// (the outcome unknown).
struct KafkaConsumerProbe {
    static void fail_seeks(KafkaConsumer& consumer, int times, std::atomic<int>& failed) {
        consumer.seek_fault_ = [left = times, &failed](const kafka::TopicPartition& p) mutable {
            if (left <= 0) return;
            --left;
            ++failed;
            throw kafka::timeout("seek to " + p.topic + "/" + std::to_string(p.partition) + "@" +
                                     std::to_string(p.offset) + " timed out (injected)",
                                 RD_KAFKA_RESP_ERR__TIMED_OUT);
        };
    }
};
}  // namespace detail
IDEM_END_NAMESPACE

namespace {

using namespace std::chrono_literals;
namespace kafka = idem::kafka;
using idem::KafkaConsumer;
using idem::KafkaConsumerOptions;
using idem::KafkaMessage;
using idem::KafkaOffsets;
using idem::testing::KafkaCluster;

// The cluster is made before any other thread or client of this process (its host is forked).
KafkaCluster* cluster = nullptr;

class ClusterEnvironment : public ::testing::Environment {
  public:
    void SetUp() override { cluster = new KafkaCluster(1); }
    void TearDown() override {
        delete cluster;
        cluster = nullptr;
    }
};
const auto* const registered = ::testing::AddGlobalTestEnvironment(new ClusterEnvironment);

/// A topic and group of this test's own (the cluster is shared by the binary).
std::string unique(const std::string& what) {
    static int n = 0;
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string(info->name()) + "-" + what + "-" + std::to_string(++n);
    for (char& c : name) {  // a topic name: [a-zA-Z0-9._-] (and a file name)
        if (c == '/') c = '.';
    }
    return name;
}

kafka::Config client_config() {
    return kafka::Config{}
        .bootstrap_servers(cluster->bootstrap_servers())
        .auto_offset_reset("earliest")
        .session_timeout(3000ms)
        .set("heartbeat.interval.ms", "300");
}

/// Produces "<prefix><i>" for i in [from, to) to @p topic (partition by key unless given),
/// each confirmed; the producer is gone when this returns (a fork may follow).
void produce(const std::string& topic, int from, int to, std::int32_t partition = -1,
             const std::string& prefix = "m") {
    kafka::Producer producer{kafka::Config{}.bootstrap_servers(cluster->bootstrap_servers())};
    for (int i = from; i < to; ++i) {
        const std::string value = prefix + std::to_string(i);
        producer.produce(topic, value, value, {}, partition).wait();
    }
}

/// Every record of @p topic (read by a group of its own), as (value, headers).
std::vector<KafkaMessage> read_all(const std::string& topic, std::size_t expected,
                                   std::chrono::milliseconds limit = 30s) {
    kafka::Consumer reader{client_config().group_id(unique("reader"))};
    reader.subscribe({topic});
    std::vector<KafkaMessage> out;
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (out.size() < expected && std::chrono::steady_clock::now() < deadline) {
        if (auto m = reader.poll(100ms)) {
            KafkaMessage body;
            body.topic = std::string(m->topic());
            body.offset = m->offset();
            body.value = std::string(m->value());
            body.headers = m->headers();
            out.push_back(std::move(body));
        }
    }
    // A last look: nothing more than expected arrives.
    const auto settle = std::chrono::steady_clock::now() + 500ms;
    while (std::chrono::steady_clock::now() < settle) {
        if (auto m = reader.poll(100ms)) {
            KafkaMessage body;
            body.value = std::string(m->value());
            out.push_back(std::move(body));
        }
    }
    return out;
}

// ---------------------------------------------------------------------------------------------
// Stores, reopened by name in each (forked) worker; the effect counts its applications per key
// in the claim's transaction.

enum class Kind { sqlite, postgres, redis };

struct Target {
    Kind kind = Kind::sqlite;
    std::string where;  ///< path, conninfo, or "host:port"
    int port = 0;
};

std::unique_ptr<idem::testing::TempDir> temp;

Target prepare(Kind kind) {
    Target target;
    target.kind = kind;
    switch (kind) {
        case Kind::sqlite: {
            if (!temp) temp = std::make_unique<idem::testing::TempDir>();
            target.where = temp->file(unique("db") + ".db");
            idem::SqliteStore store{target.where};
            sqlite3_exec(store.db(), "CREATE TABLE effects(k BLOB NOT NULL)", nullptr, nullptr,
                         nullptr);
            break;
        }
        case Kind::postgres: {
            auto& server = idem::testing::shared_postgres();
            const std::string db = server.fresh_database();
            server.exec("CREATE TABLE effects(k BYTEA NOT NULL)", db);
            target.where = server.conninfo(db);
            break;
        }
        case Kind::redis: {
            auto& server = idem::testing::shared_redis();
            server.flushall();
            target.where = server.host();
            target.port = server.port();
            break;
        }
    }
    return target;
}

idem::RedisEndpoint endpoint_of(const Target& target) {
    idem::RedisEndpoint endpoint;
    endpoint.host = target.where;
    endpoint.port = target.port;
    return endpoint;
}

/// Calls @p body with the store of @p target, opened here.
template <class Body>
void with_store(const Target& target, Body&& body) {
    switch (target.kind) {
        case Kind::sqlite: {
            idem::SqliteStore store{target.where};
            body(store);
            break;
        }
        case Kind::postgres: {
            idem::PostgresStore store{target.where};
            body(store);
            break;
        }
        case Kind::redis: {
            idem::RedisStore store{endpoint_of(target)};
            body(store);
            break;
        }
    }
}

template <class Tx>
void write_effect(Tx& tx, const std::string& key) {
    if constexpr (std::is_same_v<std::decay_t<Tx>, idem::RedisStore::Transaction>) {
        tx.write("HINCRBY", "effects", key, "1");
    } else if constexpr (std::is_same_v<std::decay_t<Tx>, idem::PostgresStore::Transaction>) {
        tx.execute("INSERT INTO effects(k) VALUES ($1)", idem::Blob{key});
    } else {
        tx.execute("INSERT INTO effects(k) VALUES (?)", idem::Blob{key});
    }
}

/// Committed effects per key.
std::map<std::string, long long> effects_of(const Target& target) {
    std::map<std::string, long long> out;
    switch (target.kind) {
        case Kind::sqlite: {
            idem::SqliteStore store{target.where};
            sqlite3_stmt* stmt = nullptr;
            sqlite3_prepare_v2(store.db(), "SELECT k, count(*) FROM effects GROUP BY k", -1, &stmt,
                               nullptr);
            while (sqlite3_step(stmt) == SQLITE_ROW) {
                out[std::string(static_cast<const char*>(sqlite3_column_blob(stmt, 0)),
                                static_cast<std::size_t>(sqlite3_column_bytes(stmt, 0)))] =
                    sqlite3_column_int64(stmt, 1);
            }
            sqlite3_finalize(stmt);
            break;
        }
        case Kind::postgres: {
            idem::testing::PgConnection conn{PQconnectdb(target.where.c_str())};
            PGresult* result = PQexec(conn.get(),
                                      "SELECT convert_from(k, 'UTF8'), count(*) "
                                      "FROM effects GROUP BY k");
            for (int i = 0; i < PQntuples(result); ++i)
                out[PQgetvalue(result, i, 0)] = std::stoll(PQgetvalue(result, i, 1));
            PQclear(result);
            break;
        }
        case Kind::redis: {
            idem::testing::RedisClient client{target.where, target.port};
            const auto all = client.array({"HGETALL", "effects"});
            for (std::size_t i = 0; i + 1 < all.size(); i += 2)
                out[all[i].value_or("")] = std::stoll(all[i + 1].value_or("0"));
            break;
        }
    }
    return out;
}

std::string name_of(Kind kind) {
    switch (kind) {
        case Kind::sqlite:
            return "sqlite";
        case Kind::postgres:
            return "postgres";
        case Kind::redis:
            return "redis";
    }
    return "?";
}

void require(Kind kind) {
    if (kind == Kind::postgres) IDEM_REQUIRE_POSTGRES();
    if (kind == Kind::redis) IDEM_REQUIRE_REDIS();
}

/// A Kafka worker over @p target's store: the effect writes "<value>" once per application;
/// @p before_effect runs first (a crash, a failure). Polls until @p done says so.
struct WorkerSpec {
    std::string topic;
    std::string group;
    KafkaOffsets offsets = KafkaOffsets::commit_after_store;
    std::uint32_t max_deliveries = 5;
    std::size_t batch_size = 1;
    bool batches = false;
};

template <class Store, class BeforeEffect, class After>
void run_worker(Store& store, const WorkerSpec& spec, BeforeEffect before_effect, After after) {
    idem::PolicyOptions policy_options;
    policy_options.max_deliveries = spec.max_deliveries;
    if constexpr (idem::has_default_lease<Store>::value) policy_options.lease = 1000ms;
    auto handler = idem::make_handler(store, idem::Policy{"capture", policy_options},
                                      [&](auto& tx, const KafkaMessage& m) {
                                          before_effect(m);
                                          write_effect(tx, m.value);
                                      });
    KafkaConsumerOptions options{{spec.topic}, spec.group};
    options.offsets = spec.offsets;
    options.batch_size = spec.batch_size;
    options.handle_in_batches = spec.batches;
    options.poll_wait = 100ms;
    options.redelivery_backoff = idem::RedeliveryBackoff::none();
    KafkaConsumer consumer{client_config(), options, handler};
    while (!after(consumer, handler))
        consumer.poll_once();
    consumer.close();
}

template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = 60s) {
    return idem::testing::eventually(pred, limit);
}

class KafkaStores : public ::testing::TestWithParam<Kind> {};

// ---------------------------------------------------------------------------------------------

// A member commits m5's effect and is SIGKILLed before its offset commit: the partition's next
// owner reads m5 again, the claim makes it a duplicate, and every effect happened once.
TEST_P(KafkaStores, AMemberKilledAfterItsCommitLeavesADuplicateNotASecondEffect) {
    require(GetParam());
    const Target target = prepare(GetParam());
    const std::string topic = unique("t");
    cluster->create_topic(topic, 1);
    produce(topic, 0, 10);
    WorkerSpec spec{topic, unique("g")};
    {
        idem_test::ForkedChild child([&](const auto&) {
            with_store(target, [&](auto& store) {
                run_worker(
                    store, spec, [](const KafkaMessage&) {},
                    [&](KafkaConsumer&, auto& handler) {
                        // m5's commit done, its offset not committed yet (the next poll would)
                        if (handler.counters().processed >= 6) ::raise(SIGKILL);
                        return false;
                    });
            });
        });
        ASSERT_TRUE(eventually([&] { return idem::testing::process_gone(child.pid()); }));
    }
    std::size_t duplicates = 0;
    with_store(target, [&](auto& store) {
        run_worker(
            store, spec, [](const KafkaMessage&) {},
            [&](KafkaConsumer&, auto& handler) {
                duplicates = handler.counters().duplicates;
                return handler.counters().processed + duplicates >= 5 &&
                       handler.counters().processed >= 4;
            });
    });
    EXPECT_GE(duplicates, 1u) << "m5 must come again to the next owner";
    const auto effects = effects_of(target);
    ASSERT_EQ(effects.size(), 10u);
    for (const auto& [key, count] : effects)
        EXPECT_EQ(count, 1) << key;
}

// A record whose effect kills the worker every time: each worker counts the attempt in the
// store before its effect, so the third worker parks it (max_deliveries 3) in <topic>.DLT, with
// the reason and the original position, and the partition moves on. With @p batch_size above 1
// a record's attempt is counted in the commit of the one before it (CountAhead): the count
// still stays when the worker dies, and the records after the poison one are counted once.
void poison_is_parked_after_max_deliveries(Kind kind, std::size_t batch_size) {
    const Target target = prepare(kind);
    const std::string topic = unique("t");
    cluster->create_topic(topic, 1);
    cluster->create_topic(topic + ".DLT", 1);
    produce(topic, 0, 3);
    produce(topic, 0, 1, -1, "poison");
    produce(topic, 3, 6);
    WorkerSpec spec{topic, unique("g")};
    spec.max_deliveries = 3;
    spec.batch_size = batch_size;
    int crashes = 0;
    for (int worker = 0; worker < 5; ++worker) {
        idem_test::ForkedChild child([&](const auto& send) {
            with_store(target, [&](auto& store) {
                run_worker(
                    store, spec,
                    [](const KafkaMessage& m) {
                        if (m.value == "poison0") ::raise(SIGKILL);
                    },
                    [&](KafkaConsumer& consumer, auto&) {
                        // Parked, and the partition read to its end (offset 7): the records
                        // after the poison one are handled, in this poll or a later one.
                        const auto positions = consumer.assignment();
                        const bool drained = positions.size() == 1 && positions[0].offset >= 7;
                        if (consumer.stats().dead_lettered == 1 && drained) {
                            send("parked");
                            return true;
                        }
                        return false;
                    });
            });
        });
        const auto line = child.line(90s);
        if (line && *line == "parked") break;
        ++crashes;
        ASSERT_TRUE(eventually([&] { return idem::testing::process_gone(child.pid()); }));
    }
    EXPECT_EQ(crashes, 2) << "attempts 1 and 2 crash; the third is parked without its effect";
    const auto effects = effects_of(target);
    EXPECT_EQ(effects.size(), 6u);
    for (const auto& [key, count] : effects)
        EXPECT_EQ(count, 1) << key;
    EXPECT_EQ(effects.count("poison0"), 0u);
    const auto letters = read_all(topic + ".DLT", 1);
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_EQ(letters[0].value, "poison0");
    const auto reason = letters[0].header("idem-reason");
    ASSERT_TRUE(reason);
    EXPECT_NE(reason->find("attempt 3"), std::string::npos) << *reason;
    EXPECT_EQ(letters[0].header("idem-original-topic").value_or(""), topic);
    EXPECT_EQ(letters[0].header("idem-original-offset").value_or(""), "3");
    // The count the poison limit judged (the store's), not this worker's one delivery.
    EXPECT_EQ(letters[0].header("idem-delivery-count").value_or(""), "3");
    // The store's copy says where it was: a redrive without a destination sends it back there.
    with_store(target, [&](auto& store) {
        const auto kept = store.dead_letters();
        ASSERT_EQ(kept.size(), 1u);
        EXPECT_EQ(kept[0].origin, topic);
        EXPECT_EQ(kept[0].origin_position, "partition 0 offset 3");
    });
    // The store's counts (a SQL store counts attempts apart; a lease store counts its claims).
    with_store(target, [&](auto& store) {
        if constexpr (idem::has_count_attempt<std::decay_t<decltype(store)>>::value) {
            EXPECT_EQ(store.attempts("capture", topic + "/0/3"), 3u) << "poison0";
            for (int offset = 4; offset <= 6; ++offset) {
                EXPECT_EQ(store.attempts("capture", topic + "/0/" + std::to_string(offset)), 1u)
                    << "the record at offset " << offset << " ran once, counted once";
            }
        }
    });
}

TEST_P(KafkaStores, ARecordThatKillsEveryWorkerIsParkedInTheDeadLetterTopicAfterMaxDeliveries) {
    require(GetParam());
    poison_is_parked_after_max_deliveries(GetParam(), 1);
}

TEST_P(KafkaStores, ARecordThatKillsEveryWorkerInAPollOfSevenIsParkedAndTheRestRunOnce) {
    require(GetParam());
    poison_is_parked_after_max_deliveries(GetParam(), 7);
}

INSTANTIATE_TEST_SUITE_P(Stores, KafkaStores,
                         ::testing::Values(Kind::sqlite, Kind::postgres, Kind::redis),
                         [](const auto& info) { return name_of(info.param); });

// ---------------------------------------------------------------------------------------------

// m2 fails twice: its partition pauses, seeks back and tries it again; m3.. wait for it.
TEST(KafkaConsumerOrder, ARetriedRecordKeepsPartitionOrder) {
    idem::testing::TempDir dir;
    idem::SqliteStore store{dir.file("order.db")};
    const std::string topic = unique("t");
    cluster->create_topic(topic, 1);
    produce(topic, 0, 6);
    std::vector<std::string> order;
    int failures = 0;
    auto handler =
        idem::make_handler(store, idem::Policy{"order"}, [&](auto&, const KafkaMessage& m) {
            if (m.value == "m2" && failures < 2) {
                ++failures;
                throw std::runtime_error("gateway away");
            }
            order.push_back(m.value);
        });
    KafkaConsumerOptions options{{topic}, unique("g")};
    options.batch_size = 6;
    options.poll_wait = 100ms;
    options.redelivery_backoff.initial = 50ms;
    options.redelivery_backoff.max = 200ms;
    KafkaConsumer consumer{client_config(), options, handler};
    ASSERT_TRUE(eventually([&] {
        consumer.poll_once();
        return order.size() >= 6;
    }));
    EXPECT_EQ(order, (std::vector<std::string>{"m0", "m1", "m2", "m3", "m4", "m5"}));
    EXPECT_EQ(consumer.retried_in_place(), 2u);
    EXPECT_EQ(handler.counters().failed, 2u);
    consumer.close();
}

// A record whose effect keeps failing is parked at the poison limit (the store's count: Kafka
// keeps none); its DLT copy says how the effect failed and when, as the store's entry does.
TEST(KafkaDeadLetters, TheCopySaysHowTheEffectFailed) {
    idem::testing::TempDir dir;
    idem::SqliteStore store{dir.file("failed.db")};
    const std::string topic = unique("t");
    cluster->create_topic(topic, 1);
    cluster->create_topic(topic + ".DLT", 1);
    produce(topic, 0, 1);
    idem::PolicyOptions policy;
    policy.max_deliveries = 3;
    auto handler = idem::make_handler(
        store, idem::Policy{"failing", policy},
        [&](auto&, const KafkaMessage&) -> void { throw std::runtime_error("gateway 503"); });
    KafkaConsumerOptions options{{topic}, unique("g")};
    options.poll_wait = 100ms;
    options.redelivery_backoff.initial = 20ms;
    options.redelivery_backoff.max = 50ms;
    KafkaConsumer consumer{client_config(), options, handler};
    ASSERT_TRUE(eventually([&] {
        consumer.poll_once();
        return handler.counters().dead_lettered == 1;
    }));
    consumer.close();
    const auto kept = store.dead_letters();
    ASSERT_EQ(kept.size(), 1u);
    EXPECT_NE(kept[0].failure.find("gateway 503"), std::string::npos) << kept[0].failure;
    ASSERT_TRUE(kept[0].first_failed_at && kept[0].last_failed_at);
    const auto letters = read_all(topic + ".DLT", 1);
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_EQ(letters[0].header("idem-delivery-count").value_or(""), "3");
    EXPECT_EQ(letters[0].header("idem-failure").value_or(""), kept[0].failure);
    EXPECT_EQ(letters[0].header("idem-first-failed-at").value_or(""),
              std::to_string(idem::to_unix_ms(*kept[0].first_failed_at)));
    EXPECT_EQ(letters[0].header("idem-last-failed-at").value_or(""),
              std::to_string(idem::to_unix_ms(*kept[0].last_failed_at)));
}

// Offsets in the store: a member SIGKILLed after its commit (its Kafka offset commit never
// sent); the next owner starts at the offset stored with the last effect, so no committed record
// reaches the handler again, and each partition's stored offset equals its effects.
TEST(KafkaOffsetsInStore, ARebalanceReplaysNothingThatCommitted) {
    idem::testing::TempDir dir;
    const std::string path = dir.file("offsets.db");
    {
        idem::SqliteStore store{path};
        sqlite3_exec(store.db(), "CREATE TABLE effects(k BLOB NOT NULL)", nullptr, nullptr,
                     nullptr);
    }
    Target target{Kind::sqlite, path, 0};
    const std::string topic = unique("t");
    cluster->create_topic(topic, 2);
    produce(topic, 0, 10, 0);
    produce(topic, 10, 20, 1);
    WorkerSpec spec{topic, unique("g")};
    spec.offsets = KafkaOffsets::in_store;
    {
        idem_test::ForkedChild child([&](const auto&) {
            idem::SqliteStore store{path};
            run_worker(
                store, spec, [](const KafkaMessage&) {},
                [&](KafkaConsumer&, auto& handler) {
                    if (handler.counters().processed >= 7) ::raise(SIGKILL);
                    return false;
                });
        });
        ASSERT_TRUE(eventually([&] { return idem::testing::process_gone(child.pid()); }));
    }
    idem::SqliteStore store{path};
    std::size_t duplicates = 99;
    run_worker(
        store, spec, [](const KafkaMessage&) {},
        [&](KafkaConsumer&, auto& handler) {
            duplicates = handler.counters().duplicates;
            return effects_of(target).size() >= 20;
        });
    EXPECT_EQ(duplicates, 0u) << "a committed record reached the handler again";
    const auto effects = effects_of(target);
    ASSERT_EQ(effects.size(), 20u);
    for (const auto& [key, count] : effects)
        EXPECT_EQ(count, 1) << key;
    EXPECT_EQ(store.stored_offset(spec.group, topic, 0), std::optional<std::int64_t>(10));
    EXPECT_EQ(store.stored_offset(spec.group, topic, 1), std::optional<std::int64_t>(10));
}

// Two members share four partitions, offsets in the store; the second joins mid-run and leaves
// again (eager: every partition revoked each time; cooperative-sticky: only those that move).
// Every record's effect ran once and no committed one came back.
void two_members_through_join_and_leave(bool cooperative) {
    idem::MemoryStore store;
    const std::string topic = unique("t");
    constexpr int records = 300;
    cluster->create_topic(topic, 4);
    produce(topic, 0, records);
    std::mutex mutex;
    std::map<std::string, int> calls;
    std::map<std::thread::id, int> by_thread;
    auto handler =
        idem::make_handler(store, idem::Policy{"share"}, [&](auto& tx, const KafkaMessage& m) {
            {
                std::lock_guard<std::mutex> lock(mutex);
                ++calls[m.value];
                ++by_thread[std::this_thread::get_id()];
            }
            tx.put("effects", m.value, "1");
            std::this_thread::sleep_for(10ms);
        });
    auto handled_by = [&](const std::thread& t) {
        std::lock_guard<std::mutex> lock(mutex);
        return by_thread[t.get_id()];
    };
    KafkaConsumerOptions options{{topic}, unique("g")};
    options.offsets = KafkaOffsets::in_store;
    options.poll_wait = 100ms;
    options.batch_size = 4;
    auto config = client_config();
    if (cooperative) config.cooperative();
    KafkaConsumer first{config, options, handler};
    std::thread one([&] { first.run(); });
    ASSERT_TRUE(eventually([&] { return store.count("effects") >= 20; }));
    {
        KafkaConsumer second{config, options, handler};
        std::thread two([&] { second.run(); });
        // The second member joins (a rebalance for both), takes partitions and works them.
        EXPECT_TRUE(eventually([&] { return handled_by(two) >= 20; }));
        second.request_stop();
        two.join();
        second.close();  // leaves: its partitions go back to the first member
        EXPECT_GE(second.rebalances(), 1u);
    }
    ASSERT_TRUE(eventually([&] { return store.count("effects") >= records; }));
    first.request_stop();
    one.join();
    first.close();
    EXPECT_GE(first.rebalances(), 3u) << "assigned, then partitions revoked, then given back";
    EXPECT_EQ(calls.size(), static_cast<std::size_t>(records));
    for (const auto& [key, n] : calls)
        EXPECT_EQ(n, 1) << key;
    EXPECT_EQ(handler.counters().duplicates, 0u);
    std::int64_t stored = 0;
    for (std::int32_t p = 0; p < 4; ++p)
        stored += store.stored_offset(options.group, topic, p).value_or(0);
    EXPECT_EQ(stored, records) << "the stored offsets sum to the effects";
}

TEST(KafkaOffsetsInStore, TwoMembersThroughJoinAndLeaveApplyEachRecordOnceEager) {
    two_members_through_join_and_leave(false);
}
TEST(KafkaOffsetsInStore, TwoMembersThroughJoinAndLeaveApplyEachRecordOnceCooperative) {
    two_members_through_join_and_leave(true);
}

// Offsets in the store, records the commit does not move past: a dead letter (no id header),
// whose offset is stored only after the dead-letter topic confirmed it, and a duplicate (the
// same id twice), whose offset is stored in a transaction of its own.
TEST(KafkaOffsetsInStore, ADeadLetterAndADuplicateMoveTheStoredOffsetToo) {
    idem::testing::TempDir dir;
    idem::SqliteStore store{dir.file("letters.db")};
    const std::string topic = unique("t");
    cluster->create_topic(topic, 1);
    cluster->create_topic(topic + ".DLT", 1);
    {
        kafka::Producer producer{kafka::Config{}.bootstrap_servers(cluster->bootstrap_servers())};
        producer.produce(topic, "a", "a", {{"idem-message-id", "a"}}).wait();
        producer.produce(topic, "x", "no id").wait();
        producer.produce(topic, "a", "a", {{"idem-message-id", "a"}}).wait();
    }
    int effects = 0;
    auto handler = idem::make_handler(store, idem::Policy{"letters"},
                                      [&](auto&, const KafkaMessage&) { ++effects; });
    KafkaConsumerOptions options{{topic}, unique("g")};
    options.offsets = KafkaOffsets::in_store;
    options.id_field = "idem-message-id";
    options.poll_wait = 100ms;
    KafkaConsumer consumer{client_config(), options, handler};
    ASSERT_TRUE(eventually([&] {
        consumer.poll_once();
        return consumer.stats().acked >= 3;
    }));
    consumer.close();
    EXPECT_EQ(effects, 1);
    EXPECT_EQ(handler.counters().duplicates, 1u);
    EXPECT_EQ(consumer.stats().dead_lettered, 1u);
    EXPECT_EQ(consumer.stats().acked_in_commit, 1u) << "only the processed one in its commit";
    EXPECT_EQ(store.stored_offset(options.group, topic, 0), std::optional<std::int64_t>(3));
    EXPECT_EQ(read_all(topic + ".DLT", 1).size(), 1u);
}

// ---------------------------------------------------------------------------------------------

// The broker goes down mid-run and comes back: the consumer reconnects and every record is
// applied once.
TEST(KafkaOutage, TheBrokerDownAndBack) {
    idem::testing::TempDir dir;
    idem::SqliteStore store{dir.file("outage.db")};
    const std::string topic = unique("t");
    cluster->create_topic(topic, 1);
    produce(topic, 0, 20);
    auto handler =
        idem::make_handler(store, idem::Policy{"outage"}, [&](auto& tx, const KafkaMessage& m) {
            tx.execute("CREATE TABLE IF NOT EXISTS e(k TEXT)");
            tx.execute("INSERT INTO e(k) VALUES (?)", m.value);
        });
    KafkaConsumerOptions options{{topic}, unique("g")};
    options.poll_wait = 100ms;
    options.batch_size = 5;
    KafkaConsumer consumer{client_config(), options, handler};
    std::thread worker([&] { consumer.run(); });
    ASSERT_TRUE(eventually([&] { return handler.counters().processed >= 5; }));
    cluster->broker_down(1);
    std::this_thread::sleep_for(1500ms);
    cluster->broker_up(1);
    produce(topic, 20, 30);
    ASSERT_TRUE(eventually([&] { return handler.counters().processed >= 30; }, 90s));
    consumer.request_stop();
    worker.join();
    consumer.close();
    EXPECT_EQ(handler.counters().processed, 30u);
    EXPECT_EQ(handler.counters().dead_lettered, 0u);
}

// The store (Redis) is stopped while records keep arriving: the circuit breaker pauses the
// partitions; nothing is parked, nothing is lost, and all is applied once it is back.
TEST(KafkaOutage, TheStoreDownWhileRecordsKeepArriving) {
    IDEM_REQUIRE_REDIS();
    idem::testing::RedisServer redis;
    const std::string topic = unique("t");
    cluster->create_topic(topic, 2);
    produce(topic, 0, 10);
    idem::RedisEndpoint endpoint;
    endpoint.host = redis.host();
    endpoint.port = redis.port();
    idem::RedisStore store{endpoint};
    auto handler = idem::make_handler(
        store, idem::Policy{"down"},
        [&](auto& tx, const KafkaMessage& m) { tx.write("HINCRBY", "effects", m.value, "1"); });
    KafkaConsumerOptions options{{topic}, unique("g")};
    options.poll_wait = 100ms;
    options.circuit_breaker.initial_backoff = 100ms;
    options.circuit_breaker.max_backoff = 300ms;
    KafkaConsumer consumer{client_config(), options, handler};
    std::thread worker([&] { consumer.run(); });
    ASSERT_TRUE(eventually([&] { return handler.counters().processed >= 10; }));
    redis.stop();
    produce(topic, 10, 40);
    ASSERT_TRUE(eventually([&] { return consumer.stats().circuit_opened >= 1; }));
    std::this_thread::sleep_for(1s);
    redis.start();
    ASSERT_TRUE(eventually([&] { return handler.counters().processed >= 40; }, 90s));
    consumer.request_stop();
    worker.join();
    consumer.close();
    EXPECT_EQ(handler.counters().dead_lettered, 0u);
    EXPECT_EQ(consumer.stats().dead_lettered, 0u);
    idem::testing::RedisClient client{redis.host(), redis.port()};
    EXPECT_EQ(client.integer({"HLEN", "effects"}).value_or(0), 40);
    for (int i = 0; i < 40; ++i) {
        EXPECT_EQ(client.integer({"HGET", "effects", "m" + std::to_string(i)}).value_or(0), 1);
    }
}

// ---------------------------------------------------------------------------------------------

// Batch mode: one handle_batch per poll, for one partition's records; a malformed record (no
// id header) is parked in the dead-letter topic with its reason, the others applied once.
TEST(KafkaBatches, OneHandleBatchPerPartitionAndAMalformedRecordDeadLettered) {
    idem::testing::TempDir dir;
    idem::SqliteStore store{dir.file("batch.db")};
    const std::string topic = unique("t");
    cluster->create_topic(topic, 2);
    cluster->create_topic(topic + ".DLT", 1);
    {
        kafka::Producer producer{kafka::Config{}.bootstrap_servers(cluster->bootstrap_servers())};
        for (int i = 0; i < 20; ++i) {
            const std::string id = "order-" + std::to_string(i);
            producer.produce(topic, id, id, {{"idem-message-id", id}}, i % 2).wait();
        }
        producer.produce(topic, "x", "no id", {}, 0).wait();
    }
    std::set<std::string> seen;
    std::vector<std::size_t> partitions_per_call;
    auto handler = idem::make_handler(store, idem::Policy{"batches"},
                                      [&](auto&, const KafkaMessage& m) { seen.insert(m.value); });
    KafkaConsumerOptions options{{topic}, unique("g")};
    options.poll_wait = 100ms;
    options.batch_size = 8;
    options.handle_in_batches = true;
    options.id_field = "idem-message-id";
    KafkaConsumer consumer{client_config(), options, handler};
    ASSERT_TRUE(eventually([&] {
        consumer.poll_once();
        return seen.size() >= 20 && consumer.stats().dead_lettered >= 1;
    }));
    consumer.close();
    EXPECT_EQ(seen.size(), 20u);
    EXPECT_EQ(handler.counters().processed, 20u);
    const auto letters = read_all(topic + ".DLT", 1);
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_EQ(letters[0].value, "no id");
    EXPECT_NE(letters[0].header("idem-reason").value_or("").find("empty message id"),
              std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// The store unreachable while records of a second partition are held: the circuit breaker opens
// on the first begin(); every record read but not yet handed to the handler is read again, in
// order, and no committed offset passes a record whose effect did not run.

struct HeldRecordsCase {
    bool batches = false;
    KafkaOffsets offsets = KafkaOffsets::commit_after_store;
    bool cooperative = false;
};

void held_records_come_back_after_a_store_outage(const HeldRecordsCase& c) {
    idem::MemoryStore store;
    store.inject(idem::Fault::begin);  // the first transaction finds the store unreachable
    const std::string topic = unique("t");
    cluster->create_topic(topic, 2);
    auto put = [&](int from, int to) {
        kafka::Producer producer{kafka::Config{}.bootstrap_servers(cluster->bootstrap_servers())};
        for (int i = from; i < to; ++i) {
            const std::string value = "m" + std::to_string(i);
            producer.produce(topic, value, value, {}, i % 2).wait();  // even ids to partition 0
        }
    };
    put(0, 6);
    std::map<std::string, int> applied;
    std::vector<std::string> order[2];
    auto handler =
        idem::make_handler(store, idem::Policy{"held"}, [&](auto& tx, const KafkaMessage& m) {
            ++applied[m.value];
            order[m.partition].push_back(m.value);
            tx.put("effects", m.value, "1");
        });
    KafkaConsumerOptions options{{topic}, unique("g")};
    options.offsets = c.offsets;
    options.handle_in_batches = c.batches;
    options.batch_size = 8;
    options.poll_wait = 100ms;
    options.circuit_breaker.initial_backoff = 50ms;
    options.circuit_breaker.max_backoff = 200ms;
    auto config = client_config();
    if (c.cooperative) config.cooperative();
    KafkaConsumer consumer{config, options, handler};
    ASSERT_TRUE(eventually([&] {
        consumer.poll_once();
        return consumer.stats().circuit_opened >= 1;
    }));
    put(6, 8);
    EXPECT_TRUE(eventually(
        [&] {
            consumer.poll_once();
            return applied.size() >= 8;
        },
        30s));
    for (int i = 0; i < 5; ++i)
        consumer.poll_once();  // nothing more comes
    consumer.close();
    EXPECT_EQ(consumer.stats().circuit_opened, 1u);
    EXPECT_EQ(applied.size(), 8u) << "a record read before the outage never reached the handler";
    for (const auto& [value, n] : applied)
        EXPECT_EQ(n, 1) << value;
    EXPECT_EQ(order[0], (std::vector<std::string>{"m0", "m2", "m4", "m6"}));
    EXPECT_EQ(order[1], (std::vector<std::string>{"m1", "m3", "m5", "m7"}));
    EXPECT_EQ(handler.counters().dead_lettered, 0u);
    kafka::Consumer reader{client_config().group_id(options.group)};
    const auto committed = reader.committed({{topic, 0}, {topic, 1}});
    ASSERT_EQ(committed.size(), 2u);
    EXPECT_EQ(committed[0].offset, 4) << "partition 0's group offset";
    EXPECT_EQ(committed[1].offset, 4) << "partition 1's group offset";
    if (c.offsets == KafkaOffsets::in_store) {
        EXPECT_EQ(store.stored_offset(options.group, topic, 0), std::optional<std::int64_t>(4));
        EXPECT_EQ(store.stored_offset(options.group, topic, 1), std::optional<std::int64_t>(4));
    }
}

TEST(KafkaBatchBreaker, HeldRecordsOfASecondPartitionAreReadAgainAfterAStoreOutage) {
    held_records_come_back_after_a_store_outage({true, KafkaOffsets::commit_after_store, false});
}
TEST(KafkaBatchBreaker, HeldRecordsAreReadAgainAfterAStoreOutageCooperative) {
    held_records_come_back_after_a_store_outage({true, KafkaOffsets::commit_after_store, true});
}
TEST(KafkaBatchBreaker, OneAtATimeRecordsAreReadAgainAfterAStoreOutage) {
    held_records_come_back_after_a_store_outage({false, KafkaOffsets::commit_after_store, false});
}
TEST(KafkaBatchBreaker, OneAtATimeWithOffsetsInStoreRecordsAreReadAgainAfterAStoreOutage) {
    held_records_come_back_after_a_store_outage({false, KafkaOffsets::in_store, false});
}
TEST(KafkaBatchBreaker, OffsetsInStoreCooperativeRecordsAreReadAgainAfterAStoreOutage) {
    held_records_come_back_after_a_store_outage({false, KafkaOffsets::in_store, true});
}

// A record left unsettled (its first attempt failed) is sought back to; that seek fails (a
// timeout: the client's position unknown). The record is not forgotten: nothing after it is
// handed out until a seek succeeds, it is applied once, in order, and the group's offset never
// passes it.
TEST(KafkaConsumerOrder, AFailedSeekBackForgetsNothing) {
    idem::MemoryStore store;
    const std::string topic = unique("t");
    cluster->create_topic(topic, 1);
    produce(topic, 0, 4);
    std::vector<std::string> applied;
    bool failed_once = false;
    auto handler =
        idem::make_handler(store, idem::Policy{"seek"}, [&](auto& tx, const KafkaMessage& m) {
            if (m.value == "m0" && !failed_once) {
                failed_once = true;
                throw std::runtime_error("the first attempt fails");
            }
            applied.push_back(m.value);
            tx.put("effects", m.value, "1");
        });
    KafkaConsumerOptions options{{topic}, unique("g")};
    options.batch_size = 1;
    options.poll_wait = 100ms;
    options.redelivery_backoff = idem::RedeliveryBackoff::none();
    std::atomic<int> seeks_failed{0};
    KafkaConsumer consumer{client_config(), options, handler};
    idem::detail::KafkaConsumerProbe::fail_seeks(consumer, 3, seeks_failed);
    auto poll = [&] {  // as run() does: a broker error is reported and the loop goes on
        try {
            consumer.poll_once();
        } catch (const idem::broker_error&) {
        }
    };
    EXPECT_TRUE(eventually(
        [&] {
            poll();
            return applied.size() >= 4;
        },
        30s));
    for (int i = 0; i < 5; ++i)
        poll();
    consumer.close();
    EXPECT_EQ(seeks_failed.load(), 3);
    EXPECT_EQ(applied, (std::vector<std::string>{"m0", "m1", "m2", "m3"}));
    kafka::Consumer reader{client_config().group_id(options.group)};
    EXPECT_EQ(reader.committed({{topic, 0}}).at(0).offset, 4);
}

// The coordinator refuses the first offset commits: they are sent again after later polls,
// though no record moved the position since, so the group's offset reaches the records done
// without waiting for close().
TEST(KafkaConsumerCommits, ARefusedCommitIsSentAgain) {
    idem::MemoryStore store;
    const std::string topic = unique("t");
    cluster->create_topic(topic, 1);
    produce(topic, 0, 5);
    auto handler = idem::make_handler(
        store, idem::Policy{"commits"},
        [&](auto& tx, const KafkaMessage& m) { tx.put("effects", m.value, "1"); });
    KafkaConsumerOptions options{{topic}, unique("g")};
    options.poll_wait = 100ms;
    std::vector<rd_kafka_resp_err_t> refusals;
    options.on_error = [&](const std::exception& e) {
        if (const auto* failure = dynamic_cast<const kafka::Failure*>(&e))
            refusals.push_back(failure->code());
    };
    constexpr int offset_commit_api = 8;  // Kafka's OffsetCommit request
    cluster->push_request_errors(offset_commit_api, {RD_KAFKA_RESP_ERR_OFFSET_METADATA_TOO_LARGE,
                                                     RD_KAFKA_RESP_ERR_OFFSET_METADATA_TOO_LARGE,
                                                     RD_KAFKA_RESP_ERR_OFFSET_METADATA_TOO_LARGE});
    KafkaConsumer consumer{client_config(), options, handler};
    kafka::Consumer reader{client_config().group_id(options.group)};
    EXPECT_TRUE(eventually([&] {
        consumer.poll_once();
        return handler.counters().processed >= 5 &&
               reader.committed({{topic, 0}}).at(0).offset == 5;
    }));
    EXPECT_GE(refusals.size(), 3u) << "the refusals were reported";
    EXPECT_EQ(reader.committed({{topic, 0}}).at(0).offset, 5);
    consumer.close();
    cluster->clear_request_errors(offset_commit_api);
}

// The usage errors say which option and why.
TEST(KafkaConsumerOptionsCheck, RefusesWhatCannotWork) {
    idem::MemoryStore store;
    auto handler = idem::make_handler(store, idem::Policy{"o"}, [](auto&, const KafkaMessage&) {});
    KafkaConsumerOptions none{{}, "g"};
    EXPECT_THROW(KafkaConsumer(client_config(), none, handler), idem::usage_error);
    KafkaConsumerOptions dlt{{"payments.DLT"}, "g"};
    EXPECT_THROW(KafkaConsumer(client_config(), dlt, handler), idem::usage_error);
    KafkaConsumerOptions both{{"payments"}, "g"};
    both.offsets = KafkaOffsets::in_store;
    both.handle_in_batches = true;
    EXPECT_THROW(KafkaConsumer(client_config(), both, handler), idem::usage_error);
    KafkaConsumerOptions plain{{"payments"}, "g"};
    plain.offsets = KafkaOffsets::in_store;
    EXPECT_THROW(KafkaConsumer(client_config(), plain,
                               [](const idem::Delivery&, const KafkaMessage&) {
                                   return idem::Outcome{idem::Disposition::processed, {}};
                               }),
                 idem::usage_error);
}

}  // namespace
