#pragma once
// The Redis environment of the typed conformance suite (see store_envs.hpp for the others): the
// process's test redis-server, emptied for each environment, the store on a controllable clock,
// an effects set written through the claim's transaction (queued, applied by the commit), and a
// commit that really fails: the lease is lost behind the transaction's back.
//
// Without redis-server the constructor starts nothing and leaves `store` null (the fixture calls
// IDEM_REQUIRE_REDIS() in SetUp(), which skips the test, or fails it under CI=true).

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "idem/store/redis.hpp"
#include "idem/testing/redis_server.hpp"
#include "store_envs.hpp"

namespace idem_test {

inline idem::RedisEndpoint redis_endpoint(const idem::testing::RedisServer& server) {
    idem::RedisEndpoint endpoint;
    endpoint.host = server.host();
    endpoint.port = server.port();
    return endpoint;
}

struct RedisEnv {
    using Store = idem::RedisStore;
    static constexpr const char* name = "redis";
    static constexpr const char* effects_key = "conformance:effects";

    /// The conformance suite skips (or, in CI, fails) without the server.
    static bool available(std::string* why) { return idem::testing::RedisServer::available(why); }

    time_point now = test_epoch();
    std::unique_ptr<Store> store;
    std::unique_ptr<idem::testing::RedisClient> client;

    RedisEnv() {
        if (!idem::testing::RedisServer::available()) return;
        auto& server = idem::testing::shared_redis();
        server.flushall();
        open();
        client = std::make_unique<idem::testing::RedisClient>(server.host(), server.port());
    }
    /// Closes the store's connection and opens a new one on the same server (the durability
    /// suite).
    void reopen() {
        store.reset();
        open();
    }
    void open() {
        idem::RedisOptions options;
        options.clock = [this] { return now; };
        store = std::make_unique<Store>(redis_endpoint(idem::testing::shared_redis()), options);
    }

    /// A second store on the same server (the redrive suite races two).
    std::unique_ptr<Store> another_store() {
        idem::RedisOptions options;
        options.clock = [this] { return now; };
        return std::make_unique<Store>(redis_endpoint(idem::testing::shared_redis()), options);
    }
    /// The redrive suite's failing redrives: the server refuses every write (out of memory,
    /// with no eviction), as a full Redis does; reads go on.
    void refuse_redrives() {
        client->exec({"CONFIG", "SET", "maxmemory-policy", "noeviction"});
        client->exec({"CONFIG", "SET", "maxmemory", "1"});
    }
    void accept_redrives() { client->exec({"CONFIG", "SET", "maxmemory", "0"}); }

    template <class Tx>
    static void write_effect(Tx& tx, const std::string& key) {
        tx.write("SADD", effects_key, key);
    }
    /// Another worker took the expired lease over and gave it up (its effect threw): this
    /// transaction's token no longer holds the claim, so its commit must write nothing.
    template <class Tx>
    void make_commit_fail(Tx&) {
        for (const auto& key : client->array({"KEYS", store->options().key_prefix + "c{*"})) {
            if (!key) continue;
            auto r = record(*key);
            if (!r) continue;
            r->state = "free";
            r->token.clear();
            client->exec({"SET", *key, r->encode(), "KEEPTTL"});
        }
    }
    /// The claim record stored under @p key, read with this environment's own client.
    std::optional<idem::redis::Record> record(const std::string& key) {
        auto value = client->str({"GET", key});
        if (!value) return std::nullopt;
        return idem::redis::Record::decode(*value);
    }
    std::size_t effect_rows() {
        return static_cast<std::size_t>(client->integer({"SCARD", effects_key}).value_or(0));
    }
    bool has_effect(const std::string& key) {
        return client->integer({"SISMEMBER", effects_key, key}).value_or(0) == 1;
    }
    /// The probe's outage: the process's server SIGKILLed, then started again on its port and
    /// data (the AOF is replayed).
    void stop_server() { idem::testing::shared_redis().kill9(); }
    void start_server() { idem::testing::shared_redis().start(); }
};

/// The same store with every effect of the suite declared local (idem::local_effect): the effect
/// runs before the claim and its writes go with the claim in one script (claim_and_commit). No
/// lease is held while it runs, so a commit cannot fail by a lost lease: make_commit_fail()
/// queues a write that fails first instead (nothing applied, the attempt counted).
struct RedisLocalEnv : RedisEnv {
    static constexpr const char* name = "redis_local";
    static constexpr bool local_effects = true;

    template <class Tx>
    static void write_effect(Tx& tx, const std::string& key) {
        RedisEnv::write_effect(tx, key);
    }
    /// A write that fails in the script (HSET without a field: wrong arity, whatever the keys
    /// hold), as the first of the commit, so nothing is applied: the effect's own write, queued
    /// before this is called, is dropped with the savepoint the handler opened around the effect.
    /// On the ordinary path (handle_batch, a count at the limit) a lease is held: it is lost as
    /// in RedisEnv, which fails that commit before the write.
    template <class Tx>
    void make_commit_fail(Tx& tx) {
        RedisEnv::make_commit_fail(tx);
        tx.rollback_to_savepoint();
        tx.savepoint();
        tx.write("HSET", effects_key);
    }
};

}  // namespace idem_test
