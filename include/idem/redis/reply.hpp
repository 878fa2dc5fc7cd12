#pragma once
/// @file
/// @brief idem::redis::Reply: a Redis reply copied out of hiredis, and the decimal in a reply's
/// text. Link idem::redis.

#include <hiredis/hiredis.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// @brief A reply, copied out of hiredis so it outlives the connection's buffers.
struct Reply {
    enum class Type { nil, string, status, integer, array, error };
    Type type = Type::nil;
    std::string str{};  ///< string, status and error replies
    long long integer = 0;
    std::vector<Reply> elements{};

    [[nodiscard]] bool is_nil() const noexcept { return type == Type::nil; }
    [[nodiscard]] bool is_error() const noexcept { return type == Type::error; }
    [[nodiscard]] bool is_array() const noexcept { return type == Type::array; }
    /// The text of a string or status reply, or the decimal of an integer reply.
    [[nodiscard]] std::string text() const {
        return type == Type::integer ? std::to_string(integer) : str;
    }
};

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
inline std::int64_t parse_int(std::string_view text) {
    std::int64_t value = 0;
    bool negative = false;
    std::size_t i = 0;
    if (!text.empty() && text[0] == '-') {
        negative = true;
        i = 1;
    }
    for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i)
        value = value * 10 + (text[i] - '0');
    return negative ? -value : value;
}

}  // namespace redis
IDEM_END_NAMESPACE
