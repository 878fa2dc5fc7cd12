#pragma once
/// @file
/// @brief idem::redis::locate_master(): where the master a group of Redis Sentinels names is now
/// (`SENTINEL get-master-addr-by-name`), and is_master_role() to check the server found there
/// (`ROLE`). Connection calls both at every connect of a RedisEndpoint with sentinels, so a pool, a
/// store and a RedisStreamConsumer follow a failover by reconnecting. Link idem::redis.
///
/// A Sentinel is asked one question on a short-lived connection of its own (no SELECT, no
/// scripts, no pooling: not a Connection, which would have to locate itself).

#include <hiredis/hiredis.h>

#include <sys/time.h>

#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/redis/endpoint.hpp"
#include "idem/redis/reply.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// @brief An address a Sentinel gave.
struct MasterAddress {
    /// The host name or address, as the Sentinel gave it.
    std::string host;
    /// The port.
    int port = 0;
};

namespace sentinel_detail {

/// redisFree() as a deleter.
struct SentinelContextFree {
    /// Frees @p c.
    void operator()(redisContext* c) const noexcept { redisFree(c); }
};
/// freeReplyObject() as a deleter.
struct SentinelReplyFree {
    /// Frees @p r.
    void operator()(redisReply* r) const noexcept { freeReplyObject(r); }
};

/// One command on @p context; an I/O failure or an error reply is written to @p why.
inline bool sentinel_command(redisContext& context, const std::vector<std::string>& args,
                             Reply& out, std::string& why) {
    std::vector<const char*> argv;
    std::vector<std::size_t> lengths;
    for (const auto& arg : args) {
        argv.push_back(arg.data());
        lengths.push_back(arg.size());
    }
    std::unique_ptr<redisReply, SentinelReplyFree> reply(static_cast<redisReply*>(
        redisCommandArgv(&context, static_cast<int>(argv.size()), argv.data(), lengths.data())));
    if (!reply) {
        why = context.err != 0 ? context.errstr : "no reply";
        return false;
    }
    out = copy_reply(reply.get());
    if (out.is_error()) {
        why = out.str;
        return false;
    }
    return true;
}

/// Asks one Sentinel; false with @p why when it cannot say.
inline bool ask_sentinel(const RedisEndpoint& endpoint, const RedisSentinelAddress& sentinel,
                         MasterAddress& out, std::string& why) {
    std::unique_ptr<redisContext, SentinelContextFree> context(redisConnectWithTimeout(
        sentinel.host.c_str(), sentinel.port, to_timeval(endpoint.connect_timeout)));
    if (!context || context->err != 0) {
        why = context ? context->errstr : "cannot allocate a connection";
        return false;
    }
    redisSetTimeout(context.get(), to_timeval(endpoint.command_timeout));
    Reply reply;
    if (!endpoint.sentinel_password.empty() &&
        !sentinel_command(*context, {"AUTH", endpoint.sentinel_password}, reply, why)) {
        why = "AUTH: " + why;
        return false;
    }
    if (!sentinel_command(*context, {"SENTINEL", "get-master-addr-by-name", endpoint.master_name},
                          reply, why)) {
        return false;
    }
    if (reply.is_nil()) {
        why = fmt::format("it monitors no master named '{}'", endpoint.master_name);
        return false;
    }
    if (!reply.is_array() || reply.elements.size() != 2) {
        why = "unexpected reply to SENTINEL get-master-addr-by-name";
        return false;
    }
    out.host = reply.elements[0].str;
    try {
        out.port = static_cast<int>(parse_int(reply.elements[1].str));
    } catch (const std::exception&) {
        out.port = 0;
    }
    if (out.host.empty() || out.port <= 0) {
        why = "unreadable master address";
        return false;
    }
    return true;
}

}  // namespace sentinel_detail

/// @brief The master's address as the first Sentinel of @p endpoint that answers names it.
/// @throws store_unavailable when none does (each one's reason in the message).
inline MasterAddress locate_master(const RedisEndpoint& endpoint) {
    std::string reasons;
    for (const RedisSentinelAddress& sentinel : endpoint.sentinels) {
        MasterAddress found;
        std::string why;
        if (sentinel_detail::ask_sentinel(endpoint, sentinel, found, why)) return found;
        reasons += fmt::format("; {}:{}: {}", sentinel.host, sentinel.port, why);
    }
    throw store_unavailable(
        fmt::format("idem: no Sentinel named the master of {}{}", endpoint.describe(), reasons));
}

/// @brief Whether a `ROLE` reply is a master's (a replica answers "slave", a Sentinel "sentinel").
[[nodiscard]] inline bool is_master_role(const Reply& role) {
    return role.is_array() && !role.elements.empty() && role.elements[0].str == "master";
}

/// @brief Whether an error reply says the server is a replica now (`READONLY`, also inside a
/// script's error): the master moved, and the connection must ask the Sentinels again.
[[nodiscard]] inline bool is_readonly_error(const Reply& reply) {
    return reply.is_error() && reply.str.find("READONLY") != std::string::npos;
}

}  // namespace redis
IDEM_END_NAMESPACE
