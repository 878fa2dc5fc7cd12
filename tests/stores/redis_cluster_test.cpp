// RedisStore on a real Redis Cluster (3 masters, 3 replicas; testing/redis_cluster.hpp), given
// ONE node's address: cluster mode found by itself, 10,000 ids over every slot range processed
// once and then all duplicates (in batches: one round trip per node, not per message), slots
// moved by hand while messages are handled (MOVED and ASK both followed, counted), a batch whose
// slot groups do not all commit reporting each message truthfully, and the RedisStreamConsumer
// draining a stream on the cluster; warm_up() on every master, a local effect and the
// PipelinedLoop routed by their claim's slot. One cluster per process: this binary is one ctest
// test.

#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <iostream>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/broker/redis_streams.hpp"
#include "idem/idem.hpp"
#include "idem/redis/cluster.hpp"
#include "idem/store/redis.hpp"
#include "idem/testing/redis_cluster.hpp"
#include "idem/testing/redis_server.hpp"
#include "support/require_redis_cluster.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;
using idem::redis::hash_slot;

class RedisClusterTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_REDIS_CLUSTER();
        cluster_ = &idem::testing::shared_redis_cluster();
        ASSERT_TRUE(cluster_->wait_until_ok(std::chrono::seconds(20)));
        cluster_->flushall();
    }

    idem::RedisEndpoint node(std::size_t i) const {
        idem::RedisEndpoint endpoint;
        endpoint.host = cluster_->host();
        endpoint.port = cluster_->port(i);
        return endpoint;
    }

    /// An effect key in the claim's hash slot: the claim key's tag is {scope:id}.
    static std::string effect_key(const std::string& scope, const std::string& id) {
        return "fx{" + scope + ":" + id + "}";
    }

    /// The value of every key in @p keys, read straight from the masters (not through the store).
    std::map<std::string, std::string> read_all(const std::vector<std::string>& keys) {
        std::map<std::string, std::string> out;
        std::map<std::size_t, std::size_t> master_of_slot;
        for (const auto& key : keys) {
            const std::uint16_t slot = hash_slot(key);
            auto it = master_of_slot.find(slot);
            if (it == master_of_slot.end())
                it = master_of_slot.emplace(slot, cluster_->master_index_of(slot)).first;
            idem::testing::RedisClient c = cluster_->client(it->second);
            if (auto value = c.str({"GET", key})) out[key] = *value;
        }
        return out;
    }

    idem::testing::RedisCluster* cluster_ = nullptr;
};

TEST(RedisHashSlot, FollowsTheClusterSpecification) {
    EXPECT_EQ(idem::redis::crc16("123456789"), 0x31C3);  // the spec's check value
    EXPECT_EQ(hash_slot("foo"), 12182);
    EXPECT_EQ(hash_slot("{user1000}.following"), hash_slot("{user1000}.followers"));
    EXPECT_EQ(hash_slot("{user1000}.following"), hash_slot("user1000"));
    EXPECT_EQ(hash_slot("foo{}{bar}"), idem::redis::crc16("foo{}{bar}") % 16384);  // empty tag
    EXPECT_EQ(hash_slot("foo{{bar}}zap"), hash_slot("{bar"));
    EXPECT_EQ(hash_slot("foo{bar}{zap}"), hash_slot("bar"));
    idem::redis::KeyLayout keys("idem:");
    EXPECT_EQ(hash_slot(keys.claim("s", "m-1")), hash_slot(keys.dead_letter("s", "m-1")));
}

TEST_F(RedisClusterTest, OneNodesAddressIsEnoughToFindTheCluster) {
    for (std::size_t i : {std::size_t{0}, cluster_->size() - 1}) {  // a master, then a replica
        idem::RedisStore store(node(i));
        EXPECT_TRUE(store.is_cluster());
        auto handler = idem::make_handler(store, idem::Policy{"detect"},
                                          [](auto& tx, const std::string& body) {
                                              tx.write("SET", effect_key("detect", body), "1");
                                          });
        for (int k = 0; k < 30; ++k) {
            const std::string id = "m-" + std::to_string(i) + "-" + std::to_string(k);
            const auto outcome = handler.handle(Delivery{id, 1u}, id);
            EXPECT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
        }
        EXPECT_EQ(store.redirects().moved, 0u) << "routed by the slot map, not by MOVED";
        // The persistence check ran on every master.
        ASSERT_TRUE(store.persistence().has_value());
        EXPECT_TRUE(store.persistence()->aof_enabled);
    }
    // A standalone server is not taken for a cluster, and costs no extra round trip.
    idem::testing::RedisServer standalone;
    idem::RedisEndpoint plain;
    plain.host = standalone.host();
    plain.port = standalone.port();
    idem::RedisStore store(plain);
    EXPECT_FALSE(store.is_cluster());
    auto tx = store.begin();
    const std::size_t before = store.round_trips();
    EXPECT_EQ(tx.claim("s", "one").status, idem::ClaimStatus::claimed);
    EXPECT_EQ(store.round_trips() - before, 1u);
}

TEST_F(RedisClusterTest, TenThousandIdsOverEverySlotRangeAreProcessedOnceThenDuplicates) {
    idem::RedisStore store(node(0));
    const std::string scope = "spread";
    auto handler =
        idem::make_handler(store, idem::Policy{scope}, [&](auto& tx, const std::string& id) {
            tx.write("SET", effect_key(scope, id), "applied");
        });
    constexpr std::size_t total = 10'000;
    constexpr std::size_t batch = 500;
    std::vector<std::string> ids;
    std::set<std::uint16_t> slots;
    std::set<std::size_t> masters;
    for (std::size_t i = 0; i < total; ++i) {
        ids.push_back("order-" + std::to_string(i));
        slots.insert(hash_slot(store.claim_key(scope, ids.back())));
    }
    for (std::uint16_t slot : {std::uint16_t{0}, std::uint16_t{8000}, std::uint16_t{16383}})
        masters.insert(cluster_->master_index_of(slot));
    EXPECT_EQ(masters.size(), 3u) << "the three slot ranges are on three masters";
    EXPECT_GT(slots.size(), 7000u) << "the ids cover most of the 16384 slots";

    auto run = [&](Disposition expected) -> std::size_t {
        std::size_t most_round_trips = 0;
        for (std::size_t start = 0; start < total; start += batch) {
            std::vector<Delivery> deliveries;
            std::vector<std::string> bodies;
            for (std::size_t i = start; i < start + batch; ++i) {
                deliveries.push_back(Delivery{ids[i], 1u});
                bodies.push_back(ids[i]);
            }
            const std::size_t before = store.round_trips();
            const auto outcomes = handler.handle_batch(deliveries, bodies);
            if (start != 0)
                most_round_trips = std::max(most_round_trips, store.round_trips() - before);
            for (std::size_t k = 0; k < outcomes.size(); ++k) {
                if (outcomes[k].disposition != expected) {
                    ADD_FAILURE() << ids[start + k] << ": " << outcomes[k].reason;
                    return most_round_trips;
                }
            }
        }
        return most_round_trips;
    };
    // Claims: one SET pipeline per node; the commit: one pipeline of slot-group scripts per node.
    EXPECT_LE(run(Disposition::processed), 2 * masters.size());
    EXPECT_LE(run(Disposition::duplicate), masters.size()) << "duplicates: the SETs only";

    std::vector<std::string> keys;
    for (const auto& id : ids)
        keys.push_back(effect_key(scope, id));
    const auto effects = read_all(keys);
    EXPECT_EQ(effects.size(), total);
    for (const auto& [key, value] : effects)
        ASSERT_EQ(value, "applied") << key;
    EXPECT_EQ(handler.counters().processed, total);
    EXPECT_EQ(handler.counters().duplicates, total);
}

TEST_F(RedisClusterTest, SlotsMovedWhileMessagesAreHandledLoseNothingAndApplyNothingTwice) {
    idem::RedisStore store(node(0));
    const std::string scope = "reshard";
    auto handler = idem::make_handler(
        store, idem::Policy{scope},
        [&](auto& tx, const std::string& id) { tx.write("INCR", effect_key(scope, id)); });
    // Ids of two slots to move, and ids everywhere else.
    const std::uint16_t moved_slots[] = {hash_slot(store.claim_key(scope, "m-0")),
                                         hash_slot(store.claim_key(scope, "m-1"))};
    std::map<std::uint16_t, std::vector<std::string>> of_slot;
    std::vector<std::string> elsewhere;
    for (std::size_t i = 0;
         of_slot[moved_slots[0]].size() < 24 || of_slot[moved_slots[1]].size() < 24; ++i) {
        const std::string id = "m-" + std::to_string(i);
        const std::uint16_t slot = hash_slot(store.claim_key(scope, id));
        if (slot == moved_slots[0] || slot == moved_slots[1]) {
            of_slot[slot].push_back(id);
        } else if (elsewhere.size() < 300) {
            elsewhere.push_back(id);
        }
    }
    std::vector<std::string> all = elsewhere;
    std::size_t next_elsewhere = 0;
    auto handle = [&](const std::string& id) {
        const auto outcome = handler.handle(Delivery{id, 1u}, id);
        EXPECT_TRUE(outcome.disposition == Disposition::processed ||
                    outcome.disposition == Disposition::duplicate)
            << id << ": " << outcome.reason;
    };
    auto some_elsewhere = [&](std::size_t n) {
        for (std::size_t k = 0; k < n && next_elsewhere < elsewhere.size(); ++k)
            handle(elsewhere[next_elsewhere++]);
    };
    for (std::uint16_t slot : moved_slots) {
        std::vector<std::string>& ids = of_slot[slot];
        all.insert(all.end(), ids.begin(), ids.end());
        // Before: claimed and committed on the slot's first master.
        for (std::size_t k = 0; k < 8; ++k)
            handle(ids[k]);
        some_elsewhere(40);
        const std::size_t to = cluster_->other_master(cluster_->master_index_of(slot));
        cluster_->begin_move(slot, to);
        cluster_->move_keys(slot, 8);  // the records of the first 4 ids (claim + effect)
        // Mid-move: new ids of the slot are not on the old node any more -> ASK to the new one;
        // the moved ones are duplicates there (ASK), those not moved yet answer on the old one.
        for (std::size_t k = 0; k < 8; ++k)
            handle(ids[k]);  // all duplicates now
        for (std::size_t k = 8; k < 16; ++k)
            handle(ids[k]);
        some_elsewhere(40);
        cluster_->move_keys(slot);
        cluster_->end_move(slot);
        // After: the store's map still names the old node -> MOVED, then the new one.
        for (std::size_t k = 16; k < ids.size(); ++k)
            handle(ids[k]);
        some_elsewhere(40);
    }
    some_elsewhere(elsewhere.size());
    const idem::redis::RedirectCounts seen = store.redirects();
    EXPECT_GT(seen.moved, 0u);
    EXPECT_GT(seen.ask, 0u);
    std::cout << "[ reshard  ] MOVED " << seen.moved << ", ASK " << seen.ask << ", TRYAGAIN "
              << seen.retries << ", slot maps read " << seen.refreshes << " for " << all.size()
              << " messages\n";

    // A second pass: every id a duplicate; every effect applied exactly once.
    for (const auto& id : all) {
        const auto outcome = handler.handle(Delivery{id, 2u}, id);
        EXPECT_EQ(outcome.disposition, Disposition::duplicate) << id << ": " << outcome.reason;
    }
    std::vector<std::string> keys;
    for (const auto& id : all)
        keys.push_back(effect_key(scope, id));
    const auto effects = read_all(keys);
    EXPECT_EQ(effects.size(), all.size()) << "nothing lost";
    for (const auto& [key, value] : effects)
        EXPECT_EQ(value, "1") << key << " applied more than once";
}

TEST_F(RedisClusterTest, ABatchWhoseSlotGroupsDoNotAllCommitReportsEachMessageTruthfully) {
    idem::RedisStore store(node(0));
    const std::string scope = "partial";
    const std::string victim = "m-3";
    auto handler =
        idem::make_handler(store, idem::Policy{scope}, [&](auto& tx, const std::string& id) {
            tx.write("SET", effect_key(scope, id), "applied");
            if (id == victim) {  // another worker takes this claim over behind our back
                const std::string key = store.claim_key(scope, id);
                idem::testing::RedisClient c =
                    cluster_->client(cluster_->master_index_of(hash_slot(key)));
                auto record = idem::redis::Record::decode(*c.str({"GET", key}));
                record->state = "leased";
                record->token = "0123456789abcdef0123456789abcdef";
                c.exec({"SET", key, record->encode(), "KEEPTTL"});
            }
        });
    std::vector<Delivery> deliveries;
    std::vector<std::string> bodies;
    for (int i = 0; i < 8; ++i) {
        deliveries.push_back(Delivery{"m-" + std::to_string(i), 1u});
        bodies.push_back("m-" + std::to_string(i));
    }
    const auto outcomes = handler.handle_batch(deliveries, bodies);
    std::vector<std::string> keys;
    for (const auto& id : bodies)
        keys.push_back(effect_key(scope, id));
    const auto effects = read_all(keys);
    for (std::size_t i = 0; i < outcomes.size(); ++i) {
        if (bodies[i] == victim) {
            EXPECT_EQ(outcomes[i].disposition, Disposition::failed);
            EXPECT_NE(outcomes[i].reason.find("lease lost"), std::string::npos)
                << outcomes[i].reason;
            EXPECT_EQ(effects.count(keys[i]), 0u) << "its slot group wrote nothing";
        } else {
            EXPECT_EQ(outcomes[i].disposition, Disposition::processed) << outcomes[i].reason;
            EXPECT_EQ(effects.count(keys[i]), 1u);
            EXPECT_EQ(store.find_claim(scope, bodies[i])->disposition, Disposition::processed);
        }
    }
}

TEST_F(RedisClusterTest, TheStreamConsumerDrainsAStreamAndAcksAfterTheCommit) {
    idem::RedisStore store(node(0));
    const std::string scope = "drain";
    auto handler = idem::make_handler(store, idem::Policy{scope},
                                      [&](auto& tx, const idem::StreamEntry& entry) {
                                          tx.write("INCR", effect_key(scope, entry.id));
                                      });
    // The stream on a node other than the one given: the consumer follows MOVED to it.
    std::string stream = "{orders}";
    for (int i = 0; cluster_->master_index_of(hash_slot(stream)) == 0; ++i)
        stream = "{orders-" + std::to_string(i) + "}";
    idem::testing::RedisClient producer =
        cluster_->client(cluster_->master_index_of(hash_slot(stream)));
    constexpr int total = 300;
    std::vector<std::string> entry_ids;
    for (int i = 0; i < total; ++i)
        entry_ids.push_back(*producer.str({"XADD", stream, "*", "n", std::to_string(i)}));

    for (bool batches : {false, true}) {
        const std::string group = batches ? "batches" : "singles";
        idem::RedisStreamConsumerOptions options;
        options.stream = stream;
        options.group = group;
        options.consumer = "worker-1";
        options.batch_size = 64;
        options.poll_wait = std::chrono::milliseconds(50);
        options.handle_in_batches = batches;
        idem::RedisStreamConsumer consumer(node(0), options, handler);
        EXPECT_FALSE(consumer.acks_in_commit()) << "stream and claims are in different slots";
        std::size_t handled = 0;
        for (int poll = 0; poll < 100 && handled < total; ++poll)
            handled += consumer.poll_once();
        EXPECT_EQ(handled, static_cast<std::size_t>(total));
        EXPECT_EQ(consumer.stats().acked, static_cast<std::size_t>(total));
        const auto pending = producer.array({"XPENDING", stream, group});
        ASSERT_FALSE(pending.empty());
        EXPECT_EQ(pending[0], "0") << "every entry acked";
    }
    std::vector<std::string> keys;
    for (const auto& id : entry_ids)
        keys.push_back(effect_key(scope, id));
    const auto effects = read_all(keys);
    EXPECT_EQ(effects.size(), static_cast<std::size_t>(total));
    for (const auto& [key, value] : effects)
        EXPECT_EQ(value, "1") << key << ": the second group's copies are duplicates";
}

TEST_F(RedisClusterTest, PurgeAndDeadLettersScanEveryMaster) {
    idem::RedisStore store(node(0));
    auto handler = idem::make_handler(store, idem::Policy{"scan"}, [](auto&, const std::string&) {
        throw idem::malformed_message("unreadable body");  // dead-lettered with its claim
    });
    std::set<std::size_t> masters;
    for (int i = 0; i < 60; ++i) {
        const std::string id = "poison-" + std::to_string(i);
        masters.insert(cluster_->master_index_of(hash_slot(store.dead_letter_key("scan", id))));
        EXPECT_EQ(handler.handle(Delivery{id, 1u}, id).disposition, Disposition::dead_lettered);
    }
    EXPECT_EQ(masters.size(), 3u);
    EXPECT_EQ(store.dead_letters().size(), 60u);
    EXPECT_TRUE(store.hold_lock("job", "me", std::chrono::milliseconds(60'000)));
    EXPECT_FALSE(store.hold_lock("job", "you", std::chrono::milliseconds(60'000)));
    EXPECT_TRUE(store.release_lock("job", "me"));
    const idem::PurgeResult purged = store.purge(std::chrono::hours(-1));  // everything is older
    EXPECT_EQ(purged.claims, 60u);
    EXPECT_EQ(store.dead_letters().size(), 60u) << "dead letters are kept";
    EXPECT_FALSE(store.find_claim("scan", "poison-0").has_value());
}

// warm_up() reaches every master: after it, no node of the cluster pays a SCRIPT LOAD.
TEST_F(RedisClusterTest, WarmUpLoadsTheScriptsOnEveryMaster) {
    idem::RedisStore store(node(0));
    store.warm_up();
    auto handler = idem::make_handler(
        store, idem::Policy{"warm"},
        [](auto& tx, const std::string& id) { tx.write("SET", effect_key("warm", id), "1"); });
    std::set<std::size_t> masters;
    for (int i = 0; i < 30; ++i) {
        const std::string id = "w-" + std::to_string(i);
        masters.insert(cluster_->master_index_of(hash_slot(store.claim_key("warm", id))));
        const std::size_t before = store.round_trips();
        EXPECT_EQ(handler.handle(Delivery{id, 1u}, id).disposition, Disposition::processed);
        EXPECT_EQ(store.round_trips() - before, 2u) << id << ": claim, commit, no SCRIPT LOAD";
    }
    EXPECT_EQ(masters.size(), 3u);
}

// A store's very first transaction queues a write before anything reached the cluster (begin()
// and write() do no I/O): its place is recorded when it is queued, so the commit still sends it
// with its claim's slot group.
TEST_F(RedisClusterTest, AWriteQueuedBeforeTheStoreFirstReachedTheClusterCommitsWithItsClaim) {
    idem::RedisStore store(node(1));
    const std::string scope = "first";
    const std::string key = effect_key(scope, "m-1");
    auto tx = store.begin();
    tx.write("SET", key, "applied");
    ASSERT_EQ(tx.claim(scope, "m-1").status, idem::ClaimStatus::claimed);
    tx.record_outcome(scope, "m-1", Disposition::processed, "");
    EXPECT_NO_THROW(tx.commit());
    EXPECT_TRUE(store.is_cluster());
    EXPECT_EQ(read_all({key}).at(key), "applied");
    auto again = store.begin();
    EXPECT_EQ(again.claim(scope, "m-1").status, idem::ClaimStatus::duplicate);
}

// A local effect's one script runs on its claim's slot when every write is in that slot too;
// with a write elsewhere the transaction claims, then commits per slot: the effect runs once
// either way, and both apply once. A redelivery of the second is a duplicate in two steps too.
TEST_F(RedisClusterTest, ALocalEffectRunsInItsClaimsSlotOrInTwoSteps) {
    idem::RedisStore store(node(0));
    store.warm_up();
    const std::string scope = "local";
    int runs = 0;
    auto handler = idem::make_handler(store, idem::Policy{scope},
                                      idem::local_effect([&runs](auto& tx, const std::string& key) {
                                          ++runs;
                                          tx.write("INCR", key);
                                      }));
    const std::string same_slot = effect_key(scope, "m-1");
    std::size_t before = store.round_trips();
    auto outcome = handler.handle(Delivery{"m-1", 1u}, same_slot);
    EXPECT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
    EXPECT_EQ(store.round_trips() - before, 1u) << "claim, write and completion in one script";
    EXPECT_EQ(runs, 1);

    const std::string elsewhere = "fx-elsewhere";
    ASSERT_NE(hash_slot(elsewhere), hash_slot(store.claim_key(scope, "m-2")));
    before = store.round_trips();
    outcome = handler.handle(Delivery{"m-2", 1u}, elsewhere);
    EXPECT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
    EXPECT_GE(store.round_trips() - before, 2u) << "two steps: claim, then commit per slot";
    EXPECT_EQ(runs, 2) << "each ran once: the claim came after, not a second run";

    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, same_slot).disposition, Disposition::duplicate);
    EXPECT_EQ(handler.handle(Delivery{"m-2", 2u}, elsewhere).disposition, Disposition::duplicate);
    EXPECT_EQ(runs, 4) << "a redelivery runs the local effect once and drops its writes";
    const auto effects = read_all({same_slot, elsewhere});
    EXPECT_EQ(effects.at(same_slot), "1");
    EXPECT_EQ(effects.at(elsewhere), "1");
}

// The two steps answer as the one script: a throw counts the attempt and leaves the id free, a
// rejection keeps the claim without the writes, a takeover at the limit applies nothing and is
// parked by the ordinary path without running the effect.
TEST_F(RedisClusterTest, ALocalEffectsTwoStepsAnswerAsTheOneScript) {
    idem::RedisStore store(node(0));
    store.warm_up();
    const std::string scope = "local2";
    idem::PolicyOptions options;
    options.max_deliveries = 3;
    int runs = 0;
    auto handler = idem::make_handler(
        store, idem::Policy{scope, options},
        idem::local_effect([&runs](auto& tx, const std::string& what) -> idem::EffectResult {
            ++runs;
            tx.write("INCR", "fx-two-steps");  // never in the claims' slots below
            if (what == "throw" && runs == 1) throw std::runtime_error("gateway said no");
            if (what == "reject") return idem::EffectResult::rejected("stale");
            return idem::EffectResult::applied();
        }));
    ASSERT_NE(hash_slot("fx-two-steps"), hash_slot(store.claim_key(scope, "t-1")));
    auto failed = handler.handle(Delivery{"t-1", 1u}, std::string("throw"));
    EXPECT_EQ(failed.disposition, Disposition::failed) << failed.reason;
    EXPECT_EQ(failed.cause, idem::FailureCause::effect_threw);
    EXPECT_FALSE(store.find_claim(scope, "t-1").has_value());
    EXPECT_EQ(store.attempts(scope, "t-1"), 1u);
    EXPECT_EQ(handler.handle(Delivery{"t-1", 2u}, std::string("throw")).disposition,
              Disposition::processed);
    EXPECT_EQ(store.attempts(scope, "t-1"), 2u);
    EXPECT_EQ(runs, 2);
    EXPECT_EQ(read_all({"fx-two-steps"}).at("fx-two-steps"), "1");

    ASSERT_NE(hash_slot("fx-two-steps"), hash_slot(store.claim_key(scope, "r-1")));
    EXPECT_EQ(handler.handle(Delivery{"r-1", 1u}, std::string("reject")).disposition,
              Disposition::rejected);
    EXPECT_EQ(store.find_claim(scope, "r-1")->disposition, Disposition::rejected);
    EXPECT_EQ(runs, 3);
    EXPECT_EQ(read_all({"fx-two-steps"}).at("fx-two-steps"), "1");

    // Two attempts released (the broker's count lags): the third is a takeover at the limit.
    ASSERT_NE(hash_slot("fx-two-steps"), hash_slot(store.claim_key(scope, "p-1")));
    for (int attempt = 0; attempt < 2; ++attempt) {
        auto tx = store.begin();
        ASSERT_EQ(tx.claim(scope, "p-1").status, idem::ClaimStatus::claimed);
    }
    auto parked = handler.handle(Delivery{"p-1", 2u}, std::string("apply"));
    EXPECT_EQ(parked.disposition, Disposition::dead_lettered) << parked.reason;
    EXPECT_EQ(runs, 4) << "once before the claim; the ordinary path parked it before the effect";
    EXPECT_EQ(store.find_claim(scope, "p-1")->disposition, Disposition::dead_lettered);
    EXPECT_EQ(read_all({"fx-two-steps"}).at("fx-two-steps"), "1");
}

// The PipelinedLoop on a cluster: a commit goes with the next claim in one round trip only when
// all their keys share a hash slot (one node, one redirect target); otherwise the commit and the
// claim go one after the other. Every message settles processed and is applied once.
TEST_F(RedisClusterTest, ThePipelinedLoopSharesARoundTripOnlyWithinOneSlot) {
    idem::RedisStore store(node(0));
    store.warm_up();
    const std::string scope = "loop";
    auto handler = idem::make_handler(
        store, idem::Policy{scope},
        [&](auto& tx, const std::string& id) { tx.write("INCR", effect_key(scope, id)); });
    const std::string first = "a";
    const std::uint16_t slot = hash_slot(store.claim_key(scope, first));
    std::string same;  // another id whose claim is in the same slot
    for (int i = 0; same.empty(); ++i) {
        const std::string id = "b-" + std::to_string(i);
        if (hash_slot(store.claim_key(scope, id)) == slot) same = id;
    }
    const std::string other = "c";
    ASSERT_NE(hash_slot(store.claim_key(scope, other)), slot);

    idem::PipelinedLoop<decltype(handler)> loop(handler);
    std::vector<std::string> settled;
    auto note = [&](const auto& done) {
        for (const auto& s : done) {
            EXPECT_EQ(s.outcome.disposition, Disposition::processed) << s.outcome.reason;
            settled.push_back(s.tag);
        }
    };
    std::size_t before = store.round_trips();
    note(loop.handle(Delivery{first, 1u}, first, first));
    EXPECT_EQ(store.round_trips() - before, 1u);  // the claim
    before = store.round_trips();
    note(loop.handle(Delivery{same, 1u}, same, same));
    EXPECT_EQ(store.round_trips() - before, 1u) << "one slot: the commit with the next claim";
    before = store.round_trips();
    note(loop.handle(Delivery{other, 1u}, other, other));
    EXPECT_EQ(store.round_trips() - before, 2u) << "two slots: the commit, then the claim";
    note(loop.flush());
    EXPECT_EQ(settled, (std::vector<std::string>{first, same, other}));
    for (const auto& id : {first, same, other})
        EXPECT_EQ(handler.handle(Delivery{id, 2u}, id).disposition, Disposition::duplicate);
    const auto effects =
        read_all({effect_key(scope, first), effect_key(scope, same), effect_key(scope, other)});
    ASSERT_EQ(effects.size(), 3u);
    for (const auto& [key, value] : effects)
        EXPECT_EQ(value, "1") << key;
}

}  // namespace
