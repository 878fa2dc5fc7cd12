#pragma once
/// @file
/// @brief Compatibility header: the Redis client under its old names. The client lives in
/// `idem/redis/` (namespace idem::redis): endpoint.hpp, reply.hpp, resp.hpp, connection.hpp,
/// pool.hpp, scripts.hpp, record.hpp, keys.hpp, stream_ack.hpp. New code names
/// idem::redis::Connection and friends; idem::RedisEndpoint is the user-facing name and stays.
/// Link idem::redis.

#include "idem/config.hpp"
#include "idem/redis/connection.hpp"
#include "idem/redis/endpoint.hpp"
#include "idem/redis/record.hpp"
#include "idem/redis/reply.hpp"
#include "idem/redis/resp.hpp"
#include "idem/redis/scripts.hpp"
#include "idem/redis/stream_ack.hpp"

IDEM_BEGIN_NAMESPACE

// RedisEndpoint: idem/redis/endpoint.hpp.
using RedisReply = redis::Reply;
using RedisScript = redis::Script;
using RedisArgs = redis::Args;
using RedisConnection = redis::Connection;
using StreamAck = redis::StreamAck;

namespace detail {
using RedisClaimRecord = redis::Record;
using redis::append_decimal;
using redis::copy_reply;
using redis::Decimal;
using redis::new_lease_token;
using redis::parse_int;
using redis::RespBuffer;
using redis::stream_dead_letter_command;
using redis::to_timeval;

template <class T>
std::string redis_arg(const T& value) {
    return redis::to_arg(value);
}
template <class... Args>
std::vector<std::string> redis_command(const Args&... args) {
    return redis::to_command(args...);
}
inline const RedisScript& redis_claim_script() {
    return redis::claim_script();
}
inline const RedisScript& redis_complete_script() {
    return redis::complete_script();
}
}  // namespace detail

IDEM_END_NAMESPACE
