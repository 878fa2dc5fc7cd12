#pragma once
/// @file
/// @brief idem::redis::StoreContext: what a RedisStore and its transactions share (options, key
/// layout, router, the persistence check) and the one place that knows whether the store talks
/// to one server or a Redis Cluster: every grouped call goes through slot_of(), by_slot(),
/// eval_calls() and pipeline(), so no other part branches on the topology for them. Link
/// idem::redis.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/store.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"
#include "idem/redis/cluster.hpp"
#include "idem/redis/connection.hpp"
#include "idem/redis/endpoint.hpp"
#include "idem/redis/pool.hpp"
#include "idem/redis/reply.hpp"
#include "idem/redis/resp.hpp"
#include "idem/store/redis/keys.hpp"
#include "idem/store/redis/options.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// A Disposition's stored name; a done record without one reads as processed (as in the Lua).
inline Disposition disposition_from(std::string_view text) {
    Disposition d = Disposition::processed;
    return from_string(text, d) ? d : Disposition::processed;
}

/// @brief The state a RedisStore shares with its transactions and parts. Checks the options and
/// the server's persistence on construction (or, when the server is down then, on first use).
class StoreContext {
  public:
    /// @brief The state of a store on @p seeds (one server, or a cluster's seed nodes). @throws
    /// usage_error for bad options, or for a server without AOF that answers now (unless
    /// accept_no_persistence); an unreachable one is checked on first use.
    StoreContext(std::vector<RedisEndpoint> seeds, RedisOptions options_)
        : options(std::move(options_)),
          keys(options.key_prefix),
          router(std::move(seeds), PoolOptions{options.max_connections, options.pool_wait_timeout,
                                               options.ping_idle_after}) {
        claim_with_set.store(options.claim_with_set, std::memory_order_relaxed);
        check_options();
        // The persistence check, now if the server answers (a store on a server without AOF
        // does not start), else on first use; on a cluster, on each master's first use.
        if (!options.accept_no_persistence) {
            router.set_first_use([this](Connection& c) { check_persistence(c); });
            try {
                router.on_any([](Connection&) { return 0; });
            } catch (const store_error&) {  // unreachable for now: checked on first use
            }
        }
    }
    StoreContext(const StoreContext&) = delete;
    StoreContext& operator=(const StoreContext&) = delete;

    /// The first address given (Router::endpoint()).
    [[nodiscard]] const RedisEndpoint& endpoint() const noexcept { return router.endpoint(); }

    /// Empty when the server's clock is used (the scripts read TIME themselves).
    [[nodiscard]] std::string now_arg() const {
        return options.clock ? std::to_string(to_unix_ms(options.clock())) : std::string();
    }
    /// The store's time in milliseconds since the Unix epoch: RedisOptions::clock's, else the
    /// server's (TIME). @throws what server_now_ms() throws.
    std::int64_t now_ms() { return options.clock ? to_unix_ms(options.clock()) : server_now_ms(); }
    /// The server's clock (TIME) in milliseconds since the Unix epoch. @throws store_unavailable,
    /// store_timeout, or store_error when the reply is no time.
    std::int64_t server_now_ms() {
        Reply reply = router.on_any([](Connection& c) { return c.checked({"TIME"}, "TIME"); });
        if (reply.elements.size() != 2) throw store_error("idem: Redis TIME gave no time");
        return parse_int(reply.elements[0].str) * 1000 + parse_int(reply.elements[1].str) / 1000;
    }

    /// @throws the store error an error @p reply of script @p what stands for; nothing for another
    /// reply.
    void check_script(const Reply& reply, const char* what) const {
        if (reply.is_error()) {
            throw_reply_error(reply, fmt::format("idem: Redis {} script failed on {}: {}", what,
                                                 endpoint().describe(), reply.str));
        }
    }
    /// One command on @p key's slot; an error reply throws store_error naming @p what.
    template <class Fn>
    Reply checked_on(std::string_view key, Fn&& fn, std::string_view what) {
        Reply reply = router.on_key(key, std::forward<Fn>(fn));
        if (reply.is_error()) {
            throw_reply_error(reply,
                              fmt::format("idem: Redis {} failed on {}: {}", what,
                                          router.master_of(hash_slot(key)).describe(), reply.str));
        }
        return reply;
    }

    // The topology. A transaction's keys are grouped by hash slot on a Cluster and all together
    // on one server; the first contact (Router::is_cluster()) decides which.

    /// Whether the store talks to a Cluster; asks the server on the first call that reaches one.
    [[nodiscard]] bool cluster() { return router.is_cluster(); }
    /// The group of @p key: its hash slot on a Cluster, 0 (one group) on one server.
    [[nodiscard]] std::uint16_t slot_of(std::string_view key) const noexcept {
        return router.known_cluster() ? hash_slot(key) : std::uint16_t{0};
    }
    /// Positions 0 .. @p count - 1 grouped by slot_of(key_of(i)), in slot order.
    template <class KeyOf>
    [[nodiscard]] std::map<std::uint16_t, std::vector<std::size_t>> by_slot(std::size_t count,
                                                                            KeyOf&& key_of) const {
        std::map<std::uint16_t, std::vector<std::size_t>> groups;
        for (std::size_t i = 0; i < count; ++i)
            groups[slot_of(key_of(i))].push_back(i);
        return groups;
    }
    /// @p script once per call: on one server a single call runs on a pooled connection, several
    /// are pipelined; on a Cluster they are pipelined per node (Router::eval_each).
    std::vector<Reply> eval_calls(const Script& script, const std::vector<SlotCall>& calls) {
        if (calls.size() == 1 && !router.known_cluster()) {
            const SlotCall& call = calls.front();
            return {router.on_any(
                [&](Connection& c) { return c.eval(script, call.num_keys, call.keys_then_args); })};
        }
        return router.eval_each(script, calls);
    }
    /// @p commands (command i on the key key_of(i)) in one round trip (one per node on a
    /// Cluster).
    template <class KeyOf>
    std::vector<Reply> pipeline(const std::vector<Args>& commands, KeyOf&& key_of) {
        if (!cluster()) {
            return router.on_any([&](Connection& c) { return c.pipeline(commands); });
        }
        std::vector<std::uint16_t> slots;
        slots.reserve(commands.size());
        for (std::size_t i = 0; i < commands.size(); ++i)
            slots.push_back(hash_slot(key_of(i)));
        return router.pipeline(commands, slots);
    }

    /// What the persistence check found (RedisStore::persistence()).
    [[nodiscard]] std::optional<RedisPersistence> persistence() const {
        std::lock_guard<std::mutex> lock(persistence_mutex_);
        return persistence_;
    }

    /// The store's options (checked).
    RedisOptions options;
    /// The store's keys (RedisOptions::key_prefix).
    KeyLayout keys;
    Router router;  ///< connections to the server, or to each master of a cluster
    /// Whether new ids are claimed with `SET … NX … GET` (off for good once a server refuses it).
    std::atomic<bool> claim_with_set{true};

  private:
    void check_options() const {
        if (options.lease.count() <= 0) {
            throw usage_error("idem::RedisStore: the default lease must be positive");
        }
        if (options.max_connections == 0) {
            throw usage_error("idem::RedisStore: max_connections must be at least 1");
        }
        if (options.replicas_to_ack < 0) {
            throw usage_error("idem::RedisStore: replicas_to_ack must be 0 (no WAIT) or more");
        }
        if (options.replicas_to_ack > 0 &&
            (options.replicas_timeout.count() <= 0 ||
             options.replicas_timeout >= router.endpoint().command_timeout)) {
            throw usage_error(fmt::format(
                "idem::RedisStore: replicas_timeout ({} ms) must be positive and shorter than the "
                "endpoint's command_timeout ({} ms): WAIT {} 0 would wait for ever",
                options.replicas_timeout.count(), router.endpoint().command_timeout.count(),
                options.replicas_to_ack));
        }
        if (options.key_prefix.find_first_of("{}") != std::string::npos) {
            throw usage_error(
                "idem::RedisStore: the key prefix must not contain braces (they would change the "
                "keys' Cluster hash tags)");
        }
    }

    /// Reads `INFO persistence` (and `CONFIG GET appendfsync` when CONFIG answers) once per
    /// store; refuses a server without AOF.
    void check_persistence(Connection& connection) {
        RedisPersistence found;
        const Reply info = connection.command({"INFO", "persistence"});
        if (is_unavailable_error(info)) {  // not an answer yet: checked on the next use
            throw store_unavailable(fmt::format("idem: Redis at {} cannot answer yet: {}",
                                                endpoint().describe(), info.str));
        }
        if (info.is_error() || info.type != Reply::Type::string) {
            throw usage_error(fmt::format(
                "idem::RedisStore: cannot tell whether Redis at {} persists claims (INFO "
                "persistence: {}); enable AOF (appendonly yes) and allow INFO, or set "
                "RedisOptions::accept_no_persistence to run without it and accept that a "
                "restart re-runs effects",
                endpoint().describe(), info.is_error() ? info.str : "no answer"));
        }
        // While it replays its AOF after a restart (or loads its master's data), Redis answers
        // INFO with loading:1 and aof_enabled:0: AOF is off during the load whatever the
        // configuration says. Not an answer yet: unavailable for now, checked on the next use.
        if (info.str.find("loading:1") != std::string::npos) {
            throw store_unavailable(fmt::format(
                "idem: Redis at {} is loading its data set (INFO persistence: loading:1); its "
                "persistence is checked once it is done",
                endpoint().describe()));
        }
        found.aof_enabled = info.str.find("aof_enabled:1") != std::string::npos;
        const Reply config = connection.command({"CONFIG", "GET", "appendfsync"});
        if (config.is_array() && config.elements.size() == 2) {
            found.appendfsync = config.elements[1].str;
        }
        {
            std::lock_guard<std::mutex> lock(persistence_mutex_);
            persistence_ = found;
        }
        if (!found.aof_enabled) {
            throw usage_error(fmt::format(
                "idem::RedisStore: Redis at {} has no append-only file (aof_enabled:0): a restart "
                "would lose the claims written since the last snapshot and redeliveries would run "
                "those effects again. Enable AOF (appendonly yes, appendfsync always or everysec), "
                "or set RedisOptions::accept_no_persistence to accept the risk",
                endpoint().describe()));
        }
    }

    mutable std::mutex persistence_mutex_;
    std::optional<RedisPersistence> persistence_;
};

}  // namespace redis
IDEM_END_NAMESPACE
