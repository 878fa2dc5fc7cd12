#pragma once
/// @file
/// @brief idem::RedisEndpoint: where a Redis server is (an address, or a master found through
/// Sentinels) and how long to wait for it; and redis::to_timeval(), its timeouts as hiredis
/// takes them. Link idem::redis.

#include <sys/time.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The address of one Redis Sentinel.
struct RedisSentinelAddress {
    /// The Sentinel's host name or address.
    std::string host = "127.0.0.1";
    /// Its port.
    int port = 26379;

    /// @brief Same host and port.
    friend bool operator==(const RedisSentinelAddress& a, const RedisSentinelAddress& b) {
        return a.host == b.host && a.port == b.port;
    }
};

/// @brief Where a Redis server is and how long to wait for it: one address, or (with
/// `sentinels` and `master_name`) the master a group of Redis Sentinels names, wherever it is now
/// (redis/sentinel.hpp; every connect asks them, and checks the answer with ROLE).
struct RedisEndpoint {
    std::string host = "127.0.0.1";  ///< unused with sentinels
    int port = 6379;                 ///< unused with sentinels
    int db = 0;                      ///< SELECTed after connecting (standalone servers only)
    std::string username{};          ///< ACL user (Redis 6+); empty: AUTH with the password only
    std::string password{};          ///< empty: no AUTH
    /// How long connecting (and asking the Sentinels) may take.
    std::chrono::milliseconds connect_timeout{2000};
    /// Per command. A command that times out is `failed` for the handler (never an ack); its
    /// effect on the server is unknown, which the lease and the claim record make harmless.
    std::chrono::milliseconds command_timeout{5000};
    /// Not empty: ask these Sentinels (in order, the first that answers) for the address of the
    /// master named `master_name`, at every connect. A connection whose server turns out to be a
    /// replica (ROLE, or a READONLY error after a failover) is dropped and the next call asks
    /// again; nothing is ever written to a replica.
    std::vector<RedisSentinelAddress> sentinels{};
    std::string master_name{};        ///< the name the Sentinels monitor the master under
    std::string sentinel_password{};  ///< AUTH for the Sentinels themselves; empty: none

    /// @brief The master @p name as @p sentinels know it (the other fields keep their defaults).
    [[nodiscard]] static RedisEndpoint sentinel(std::string name,
                                                std::vector<RedisSentinelAddress> sentinels) {
        RedisEndpoint endpoint;
        endpoint.master_name = std::move(name);
        endpoint.sentinels = std::move(sentinels);
        return endpoint;
    }

    /// Whether the address comes from Sentinels.
    [[nodiscard]] bool via_sentinel() const noexcept { return !sentinels.empty(); }

    /// @brief `host:port/db`, or the master and its Sentinels, for messages (no password).
    [[nodiscard]] std::string describe() const {
        if (!via_sentinel()) return fmt::format("{}:{}/{}", host, port, db);
        std::string list;
        for (const auto& s : sentinels)
            list += fmt::format("{}{}:{}", list.empty() ? "" : ",", s.host, s.port);
        return fmt::format("master '{}' of Sentinels {}/{}", master_name, list, db);
    }
    /// Same server and database: a consumer and a store that agree here can share a commit
    /// (with Sentinels: the same master name, Sentinels and database).
    [[nodiscard]] bool same_database(const RedisEndpoint& other) const {
        if (via_sentinel() || other.via_sentinel()) {
            return master_name == other.master_name && sentinels == other.sentinels &&
                   db == other.db;
        }
        return host == other.host && port == other.port && db == other.db;
    }
};

namespace redis {

/// A timeout as hiredis takes it.
inline timeval to_timeval(std::chrono::milliseconds ms) {
    timeval tv{};
    tv.tv_sec = static_cast<decltype(tv.tv_sec)>(ms.count() / 1000);
    tv.tv_usec = static_cast<decltype(tv.tv_usec)>((ms.count() % 1000) * 1000);
    return tv;
}

}  // namespace redis
IDEM_END_NAMESPACE
