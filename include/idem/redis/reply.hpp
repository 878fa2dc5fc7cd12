#pragma once
/// @file
/// @brief idem::redis::Reply: a Redis reply copied out of hiredis, and the decimal in a reply's
/// text. Link idem::redis.

#include <hiredis/hiredis.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "idem/config.hpp"
#include "idem/error.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// @brief A reply, copied out of hiredis so it outlives the connection's buffers.
struct Reply {
    /// @brief The RESP reply types idem reads.
    enum class Type { nil, string, status, integer, array, error };
    /// Which kind of reply.
    Type type = Type::nil;
    std::string str{};  ///< string, status and error replies
    /// An integer reply's value.
    long long integer = 0;
    /// An array reply's elements.
    std::vector<Reply> elements{};

    /// True for a nil reply (no value).
    [[nodiscard]] bool is_nil() const noexcept { return type == Type::nil; }
    /// True for an error reply (`str` has its text).
    [[nodiscard]] bool is_error() const noexcept { return type == Type::error; }
    /// True for an array reply.
    [[nodiscard]] bool is_array() const noexcept { return type == Type::array; }
    /// The text of a string or status reply, or the decimal of an integer reply.
    [[nodiscard]] std::string text() const {
        return type == Type::integer ? std::to_string(integer) : str;
    }
};

/// A deep copy of hiredis' @p reply; null gives a nil reply.
inline Reply copy_reply(const redisReply* reply) {
    Reply out;
    if (reply == nullptr) return out;
    switch (reply->type) {
        case REDIS_REPLY_STRING:
            out.type = Reply::Type::string;
            out.str.assign(reply->str, reply->len);
            break;
        case REDIS_REPLY_STATUS:
            out.type = Reply::Type::status;
            out.str.assign(reply->str, reply->len);
            break;
        case REDIS_REPLY_ERROR:
            out.type = Reply::Type::error;
            out.str.assign(reply->str, reply->len);
            break;
        case REDIS_REPLY_INTEGER:
            out.type = Reply::Type::integer;
            out.integer = reply->integer;
            break;
        case REDIS_REPLY_ARRAY:
            out.type = Reply::Type::array;
            out.elements.reserve(reply->elements);
            for (std::size_t i = 0; i < reply->elements; ++i)
                out.elements.push_back(copy_reply(reply->element[i]));
            break;
        default:
            out.type = Reply::Type::nil;
            break;
    }
    return out;
}

/// The decimal at the start of @p text (a reply's, a record's field); 0 when there is none.
/// Saturates at the int64 limits: a longer run of digits (a corrupt or hostile value) reads as
/// the nearest limit, never as a wrapped number.
inline std::int64_t parse_int(std::string_view text) {
    constexpr std::uint64_t limit = std::uint64_t{1} << 63;  // |INT64_MIN|
    std::uint64_t value = 0;
    bool negative = false;
    std::size_t i = 0;
    if (!text.empty() && text[0] == '-') {
        negative = true;
        i = 1;
    }
    for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) {
        const auto digit = static_cast<std::uint64_t>(text[i] - '0');
        value = value > (limit - digit) / 10 ? limit : value * 10 + digit;
    }
    if (negative) return value == limit ? INT64_MIN : -static_cast<std::int64_t>(value);
    return value >= limit ? INT64_MAX : static_cast<std::int64_t>(value);
}

/// @brief Whether an error reply says the server cannot serve commands NOW, though it may soon;
/// the command did not run. `LOADING` (a restarted server replaying its AOF or RDB, a replica
/// loading its master's data), `MASTERDOWN` (a replica that lost its master), `CLUSTERDOWN` (a
/// Redis Cluster without quorum, or a slot no master serves) and `TRYAGAIN` (a multi-key command
/// whose keys a migration split). They read as the server being unreachable (store_unavailable),
/// not as a failed command: the circuit breaker opens on them and its probe fails on them.
[[nodiscard]] inline bool is_unavailable_error(const Reply& reply) noexcept {
    if (!reply.is_error()) return false;
    const std::string_view text = reply.str;
    for (std::string_view word : {std::string_view("LOADING"), std::string_view("MASTERDOWN"),
                                  std::string_view("CLUSTERDOWN"), std::string_view("TRYAGAIN")}) {
        if (text.size() >= word.size() && text.substr(0, word.size()) == word &&
            (text.size() == word.size() || text[word.size()] == ' ')) {
            return true;
        }
    }
    return false;
}

/// @brief Throws the exception of an error reply, with @p message: store_unavailable for the
/// answers of a server that cannot serve now (is_unavailable_error()), store_error for the rest.
[[noreturn]] inline void throw_reply_error(const Reply& reply, const std::string& message) {
    if (is_unavailable_error(reply)) throw store_unavailable(message);
    throw store_error(message);
}

}  // namespace redis
IDEM_END_NAMESPACE
