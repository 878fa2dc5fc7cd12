#pragma once
/// @file
/// @brief RedisConnection: one hiredis connection with binary-safe commands, pipelining, cached
/// Lua scripts and typed errors. Used by RedisStore and the Redis Streams consumer; users may use
/// it for their own reads. Link idem::redis.

#include <hiredis/hiredis.h>

#include <sys/time.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/blob.hpp"
#include "idem/config.hpp"
#include "idem/error.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief Where a Redis server is and how long to wait for it.
struct RedisEndpoint {
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
    [[nodiscard]] bool same_database(const RedisEndpoint& other) const {
        return host == other.host && port == other.port && db == other.db;
    }
};

/// @brief A reply, copied out of hiredis so it outlives the connection's buffers.
struct RedisReply {
    enum class Type { nil, string, status, integer, array, error };
    Type type = Type::nil;
    std::string str{};  ///< string, status and error replies
    long long integer = 0;
    std::vector<RedisReply> elements{};

    [[nodiscard]] bool is_nil() const noexcept { return type == Type::nil; }
    [[nodiscard]] bool is_error() const noexcept { return type == Type::error; }
    [[nodiscard]] bool is_array() const noexcept { return type == Type::array; }
    /// The text of a string or status reply, or the decimal of an integer reply.
    [[nodiscard]] std::string text() const {
        return type == Type::integer ? std::to_string(integer) : str;
    }
};

/// @brief A Lua script sent by EVALSHA; loaded on first use on each connection (and again after a
/// server restart emptied the script cache).
struct RedisScript {
    const char* name;    ///< for error messages
    const char* source;  ///< must outlive every connection that runs it (a string literal)
};

namespace detail {

inline RedisReply copy_reply(const redisReply* reply) {
    RedisReply out;
    if (reply == nullptr) return out;
    switch (reply->type) {
        case REDIS_REPLY_STRING:
            out.type = RedisReply::Type::string;
            out.str.assign(reply->str, reply->len);
            break;
        case REDIS_REPLY_STATUS:
            out.type = RedisReply::Type::status;
            out.str.assign(reply->str, reply->len);
            break;
        case REDIS_REPLY_ERROR:
            out.type = RedisReply::Type::error;
            out.str.assign(reply->str, reply->len);
            break;
        case REDIS_REPLY_INTEGER:
            out.type = RedisReply::Type::integer;
            out.integer = reply->integer;
            break;
        case REDIS_REPLY_ARRAY:
            out.type = RedisReply::Type::array;
            out.elements.reserve(reply->elements);
            for (std::size_t i = 0; i < reply->elements; ++i)
                out.elements.push_back(copy_reply(reply->element[i]));
            break;
        default:
            out.type = RedisReply::Type::nil;
            break;
    }
    return out;
}

inline timeval to_timeval(std::chrono::milliseconds ms) {
    timeval tv{};
    tv.tv_sec = static_cast<decltype(tv.tv_sec)>(ms.count() / 1000);
    tv.tv_usec = static_cast<decltype(tv.tv_usec)>((ms.count() % 1000) * 1000);
    return tv;
}

/// One command argument as bytes: text, bytes (idem::Blob) or an integer.
template <class T>
std::string redis_arg(const T& value) {
    if constexpr (std::is_same_v<T, Blob>) {
        return std::string(value.bytes);
    } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
        return std::string(std::string_view(value));
    } else if constexpr (std::is_integral_v<T>) {
        return std::to_string(value);
    } else {
        static_assert(std::is_integral_v<T>,
                      "idem: a Redis command argument must be text, idem::Blob or an integer");
        return {};
    }
}

template <class... Args>
std::vector<std::string> redis_command(const Args&... args) {
    std::vector<std::string> out;
    out.reserve(sizeof...(Args));
    (out.push_back(redis_arg(args)), ...);
    return out;
}

}  // namespace detail

/// @brief One connection to a Redis server. Not thread-safe: one thread at a time (RedisStore
/// keeps a pool). After an I/O error or timeout the connection is dropped and the next call
/// reconnects, so a restarted server is picked up without the caller doing anything.
class RedisConnection {
  public:
    explicit RedisConnection(RedisEndpoint endpoint) : endpoint_(std::move(endpoint)) {}
    RedisConnection(const RedisConnection&) = delete;
    RedisConnection& operator=(const RedisConnection&) = delete;

    [[nodiscard]] const RedisEndpoint& endpoint() const noexcept { return endpoint_; }
    [[nodiscard]] bool connected() const noexcept { return context_ != nullptr; }
    /// How many times this connection (re)connected; a test sees reconnects with it.
    [[nodiscard]] std::size_t connects() const noexcept { return connects_; }
    /// Request/reply exchanges so far (a pipeline is one; connecting and loading a script count).
    [[nodiscard]] std::size_t round_trips() const noexcept { return round_trips_; }

    /// @brief Sends one command and reads its reply; an error reply is returned, not thrown.
    /// @throws store_unavailable (cannot connect, connection lost) or store_timeout.
    RedisReply command(const std::vector<std::string>& args) {
        return std::move(pipeline({args}).front());
    }

    /// @brief Like command(), but an error reply throws store_error with @p what and the text.
    RedisReply checked(const std::vector<std::string>& args, std::string_view what) {
        RedisReply reply = command(args);
        if (reply.is_error()) {
            throw store_error(fmt::format("idem: Redis {} failed on {}: {}", what,
                                          endpoint_.describe(), reply.str));
        }
        return reply;
    }

    /// @brief Sends every command, then reads every reply: one round trip for all of them.
    std::vector<RedisReply> pipeline(const std::vector<std::vector<std::string>>& commands) {
        ensure_connected();
        ++round_trips_;
        for (const auto& args : commands)
            append(args);
        std::vector<RedisReply> replies;
        replies.reserve(commands.size());
        for (std::size_t i = 0; i < commands.size(); ++i)
            replies.push_back(read_reply());
        return replies;
    }

    /// @brief Runs a script by EVALSHA, loading it when the server does not know it (first use,
    /// or a restarted server). Error replies are returned (the caller knows what they mean).
    RedisReply eval(const RedisScript& script, const std::vector<std::string>& keys,
                    const std::vector<std::string>& args) {
        std::vector<std::string> command;
        command.reserve(3 + keys.size() + args.size());
        command.emplace_back("EVALSHA");
        command.emplace_back(sha_of(script));
        command.push_back(std::to_string(keys.size()));
        command.insert(command.end(), keys.begin(), keys.end());
        command.insert(command.end(), args.begin(), args.end());
        RedisReply reply = command_once(command);
        if (reply.is_error() && reply.str.rfind("NOSCRIPT", 0) == 0) {
            shas_.erase(script.source);
            command[1] = sha_of(script);
            reply = command_once(command);
        }
        return reply;
    }

    /// @brief Runs one script many times in one round trip (pipelined EVALSHA), loading it first
    /// if this connection has not yet; a server that lost its script cache gets it again and
    /// the calls are repeated once. Replies in order; error replies are returned.
    std::vector<RedisReply> eval_many(const RedisScript& script,
                                      const std::vector<std::vector<std::string>>& keys,
                                      const std::vector<std::vector<std::string>>& args) {
        std::vector<std::vector<std::string>> commands(keys.size());
        auto build = [&](const std::string& sha) {
            for (std::size_t i = 0; i < keys.size(); ++i) {
                auto& command = commands[i];
                command.clear();
                command.reserve(3 + keys[i].size() + args[i].size());
                command.emplace_back("EVALSHA");
                command.push_back(sha);
                command.push_back(std::to_string(keys[i].size()));
                command.insert(command.end(), keys[i].begin(), keys[i].end());
                command.insert(command.end(), args[i].begin(), args[i].end());
            }
        };
        build(sha_of(script));
        std::vector<RedisReply> replies = pipeline(commands);
        // A restarted server has no scripts: every reply is NOSCRIPT, nothing ran.
        if (!replies.empty() && replies.front().is_error() &&
            replies.front().str.rfind("NOSCRIPT", 0) == 0) {
            shas_.erase(script.source);
            build(sha_of(script));
            replies = pipeline(commands);
        }
        return replies;
    }

    /// @brief Drops the connection (the next call reconnects). Never throws.
    void disconnect() noexcept {
        context_.reset();
        shas_.clear();
    }

  private:
    struct ContextFree {
        void operator()(redisContext* c) const noexcept { redisFree(c); }
    };
    struct ReplyFree {
        void operator()(void* r) const noexcept { freeReplyObject(r); }
    };

    RedisReply command_once(const std::vector<std::string>& args) {
        ensure_connected();
        ++round_trips_;
        append(args);
        return read_reply();
    }

    std::string sha_of(const RedisScript& script) {
        auto it = shas_.find(script.source);
        if (it != shas_.end()) return it->second;
        RedisReply loaded = command_once({"SCRIPT", "LOAD", script.source});
        if (loaded.is_error()) {
            throw store_error(fmt::format("idem: Redis refused the {} script on {}: {}",
                                          script.name, endpoint_.describe(), loaded.str));
        }
        shas_.emplace(script.source, loaded.str);
        return loaded.str;
    }

    void ensure_connected() {
        if (context_) return;
        redisContext* raw = redisConnectWithTimeout(endpoint_.host.c_str(), endpoint_.port,
                                                    detail::to_timeval(endpoint_.connect_timeout));
        std::unique_ptr<redisContext, ContextFree> context(raw);
        if (!context) {
            throw store_unavailable(fmt::format("idem: cannot allocate a Redis connection to {}",
                                                endpoint_.describe()));
        }
        if (context->err != 0) {
            throw store_unavailable(fmt::format("idem: cannot connect to Redis at {}: {}",
                                                endpoint_.describe(), context->errstr));
        }
        redisSetTimeout(context.get(), detail::to_timeval(endpoint_.command_timeout));
        context_ = std::move(context);
        ++connects_;
        ++round_trips_;  // the TCP handshake
        try {
            if (!endpoint_.password.empty()) {
                std::vector<std::string> auth{"AUTH"};
                if (!endpoint_.username.empty()) auth.push_back(endpoint_.username);
                auth.push_back(endpoint_.password);
                expect_ok(auth, "AUTH");
            }
            if (endpoint_.db != 0) expect_ok({"SELECT", std::to_string(endpoint_.db)}, "SELECT");
        } catch (...) {
            disconnect();
            throw;
        }
    }

    void expect_ok(const std::vector<std::string>& args, const char* what) {
        ++round_trips_;
        append(args);
        RedisReply reply = read_reply();
        if (reply.is_error()) {
            throw store_unavailable(fmt::format("idem: Redis {} refused on {}: {}", what,
                                                endpoint_.describe(), reply.str));
        }
    }

    void append(const std::vector<std::string>& args) {
        argv_.clear();
        lengths_.clear();
        for (const auto& a : args) {
            argv_.push_back(a.data());
            lengths_.push_back(a.size());
        }
        if (redisAppendCommandArgv(context_.get(), static_cast<int>(args.size()), argv_.data(),
                                   lengths_.data()) != REDIS_OK) {
            fail("sending a command");
        }
    }

    RedisReply read_reply() {
        void* raw = nullptr;
        if (redisGetReply(context_.get(), &raw) != REDIS_OK || raw == nullptr) {
            fail("reading a reply");
        }
        std::unique_ptr<void, ReplyFree> reply(raw);
        return detail::copy_reply(static_cast<redisReply*>(raw));
    }

    /// Drops the connection and throws the matching error; replies still in flight are lost
    /// with it, so nothing later reads a reply meant for an earlier command.
    [[noreturn]] void fail(const char* doing) {
        const int err = context_ ? context_->err : REDIS_ERR_OTHER;
        const std::string text =
            context_ ? std::string(context_->errstr) : std::string("no context");
        disconnect();
        const bool timed_out =
            err == REDIS_ERR_IO &&
            (text.find("Resource temporarily unavailable") != std::string::npos ||
             text.find("timed out") != std::string::npos);
        std::string message = fmt::format("idem: Redis connection to {} failed while {}: {}",
                                          endpoint_.describe(), doing, text);
        if (timed_out) throw store_timeout(message);
        throw store_unavailable(message);
    }

    RedisEndpoint endpoint_;
    std::unique_ptr<redisContext, ContextFree> context_;
    std::unordered_map<const char*, std::string> shas_;
    std::vector<const char*> argv_;
    std::vector<std::size_t> lengths_;
    std::size_t connects_ = 0;
    std::size_t round_trips_ = 0;
};

IDEM_END_NAMESPACE
