#pragma once
/// @file
/// @brief idem::redis::Endpoint (user-facing as idem::RedisEndpoint): where a Redis server is and
/// how long to wait for it. Link idem::redis.

#include <chrono>
#include <string>

#include <fmt/format.h>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// @brief Where a Redis server is and how long to wait for it.
struct Endpoint {
    std::string host = "127.0.0.1";
    int port = 6379;
    int db = 0;              ///< SELECTed after connecting (standalone servers only)
    std::string username{};  ///< ACL user (Redis 6+); empty: AUTH with the password only
    std::string password{};  ///< empty: no AUTH
    std::chrono::milliseconds connect_timeout{2000};
    /// Per command. A command that times out is `failed` for the handler (never an ack); its
    /// effect on the server is unknown, which the lease and the claim record make harmless.
    std::chrono::milliseconds command_timeout{5000};

    [[nodiscard]] std::string describe() const { return fmt::format("{}:{}/{}", host, port, db); }
    /// Same server and database: a consumer and a store that agree here can share a commit.
    [[nodiscard]] bool same_database(const Endpoint& other) const {
        return host == other.host && port == other.port && db == other.db;
    }
};

}  // namespace redis

/// @brief The user-facing name of redis::Endpoint.
using RedisEndpoint = redis::Endpoint;

IDEM_END_NAMESPACE
