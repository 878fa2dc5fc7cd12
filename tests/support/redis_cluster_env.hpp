#pragma once
// The Redis Cluster environment of the typed conformance suite (redis_cluster_conformance_test:
// conformance_test.cpp built with IDEM_CONFORMANCE_ON_REDIS_CLUSTER): the process's test cluster
// (3 masters, 3 replicas), emptied for each environment, and a store given ONE node's address —
// it finds out by itself that it is a cluster. The effects set is a key of its own hash slot, so
// the suite also runs the commit's writes outside the claim's slot.
//
// Without redis-server / redis-cli the constructor starts nothing and leaves `store` null (the
// fixture calls IDEM_REQUIRE_REDIS_CLUSTER() in SetUp()).

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "idem/redis/cluster.hpp"
#include "idem/store/redis.hpp"
#include "idem/testing/redis_cluster.hpp"
#include "store_envs.hpp"

namespace idem_test {

struct RedisClusterEnv {
    using Store = idem::RedisStore;
    static constexpr const char* name = "redis_cluster";
    static constexpr const char* effects_key = "conformance:effects";

    /// The conformance suite skips (or, in CI, fails) without the server.
    static bool available(std::string* why) { return idem::testing::RedisCluster::available(why); }

    time_point now = test_epoch();
    std::unique_ptr<Store> store;
    idem::testing::RedisCluster* cluster = nullptr;

    RedisClusterEnv() {
        if (!idem::testing::RedisCluster::available()) return;
        cluster = &idem::testing::shared_redis_cluster();
        cluster->flushall();
        open();
    }
    /// Closes the store's connections and opens new ones on the same cluster (the durability
    /// suite).
    void reopen() {
        store.reset();
        open();
    }
    void open() {
        idem::RedisOptions options;
        options.clock = [this] { return now; };
        idem::RedisEndpoint one_node;
        one_node.host = cluster->host();
        one_node.port = cluster->port(0);
        store = std::make_unique<Store>(one_node, options);
    }

    /// A second store on the same cluster (the redrive suite races two).
    std::unique_ptr<Store> another_store() {
        idem::RedisOptions options;
        options.clock = [this] { return now; };
        idem::RedisEndpoint another_node;
        another_node.host = cluster->host();
        another_node.port = cluster->port(1);
        return std::make_unique<Store>(another_node, options);
    }
    /// The redrive suite's failing redrives: every master refuses every write (out of memory,
    /// with no eviction), as a full Redis does; reads go on.
    void refuse_redrives() { set_maxmemory("1"); }
    void accept_redrives() { set_maxmemory("0"); }

    template <class Tx>
    static void write_effect(Tx& tx, const std::string& key) {
        tx.write("SADD", effects_key, key);
    }
    /// Another worker took the expired lease over and gave it up: this transaction's token no
    /// longer holds the claim, so its commit must write nothing. Every master's claims.
    template <class Tx>
    void make_commit_fail(Tx&) {
        for (std::size_t i = 0; i < cluster->size(); ++i) {
            if (!cluster->is_master(i)) continue;
            idem::testing::RedisClient c = cluster->client(i);
            for (const auto& key : c.array({"KEYS", store->options().key_prefix + "c{*"})) {
                if (!key) continue;
                auto value = c.str({"GET", *key});
                if (!value) continue;
                auto r = idem::redis::Record::decode(*value);
                if (!r) continue;
                r->state = "free";
                r->token.clear();
                c.exec({"SET", *key, r->encode(), "KEEPTTL"});
            }
        }
    }
    std::size_t effect_rows() {
        return static_cast<std::size_t>(effects().integer({"SCARD", effects_key}).value_or(0));
    }
    bool has_effect(const std::string& key) {
        return effects().integer({"SISMEMBER", effects_key, key}).value_or(0) == 1;
    }

    /// The probe's outage: every node SIGKILLed (so no replica takes over), then all started
    /// again and settled (RedisCluster::restore()).
    void stop_server() {
        for (std::size_t i = 0; i < cluster->size(); ++i)
            cluster->kill_node(i);
    }
    void start_server() { cluster->restore(); }

  private:
    void set_maxmemory(const char* bytes) {
        for (std::size_t i = 0; i < cluster->size(); ++i) {
            if (!cluster->is_master(i)) continue;
            idem::testing::RedisClient c = cluster->client(i);
            c.exec({"CONFIG", "SET", "maxmemory-policy", "noeviction"});
            c.exec({"CONFIG", "SET", "maxmemory", bytes});
        }
    }
    /// A client on the master of the effects key's slot.
    idem::testing::RedisClient effects() {
        return cluster->client(cluster->master_index_of(idem::redis::hash_slot(effects_key)));
    }
};

}  // namespace idem_test
