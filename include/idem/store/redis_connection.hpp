#pragma once
/// @file
/// @brief RedisConnection: one hiredis connection with binary-safe commands, pipelining, cached
/// Lua scripts and typed errors. Used by RedisStore and the Redis Streams consumer; users may use
/// it for their own reads. Link idem::redis.

#include <hiredis/hiredis.h>

#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <initializer_list>
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

/// An integer as decimal text, in a buffer of its own (no allocation).
class Decimal {
  public:
    template <class Int>
    explicit Decimal(Int value) noexcept
        : size_(static_cast<std::size_t>(
              std::to_chars(digits_, digits_ + sizeof digits_, value).ptr - digits_)) {}
    [[nodiscard]] std::string_view view() const noexcept { return {digits_, size_}; }

  private:
    char digits_[24];
    std::size_t size_;
};

inline void append_decimal(std::string& out, long long value) {
    out.append(Decimal(value).view());
}

/// The bytes of commands being encoded. Every argument of every command is appended here, so it
/// grows without std::string's per-append cost (a call into the library, a zero-fill on resize):
/// the string's own size is the capacity, `size_` the bytes in use.
class RespBuffer {
  public:
    void append(const char* data, std::size_t n) {
        if (n == 0) return;
        if (size_ + n > bytes_.size()) grow(size_ + n);
        std::memcpy(&bytes_[size_], data, n);
        size_ += n;
    }
    void append(std::string_view text) { append(text.data(), text.size()); }
    void append_decimal(long long value) { append(Decimal(value).view()); }
    /// One RESP bulk string: `$<length>\r\n<bytes>\r\n`.
    void append_bulk(std::string_view value) {
        char head[24];
        head[0] = '$';
        char* end = std::to_chars(head + 1, head + sizeof head - 2, value.size()).ptr;
        *end++ = '\r';
        *end++ = '\n';
        append(head, static_cast<std::size_t>(end - head));
        append(value);
        append("\r\n", 2);
    }
    void reserve(std::size_t bytes) {
        if (bytes > bytes_.size()) bytes_.resize(bytes);
    }
    void truncate(std::size_t size) noexcept { size_ = std::min(size_, size); }
    void clear() noexcept { size_ = 0; }
    [[nodiscard]] std::size_t size() const noexcept { return size_; }
    [[nodiscard]] std::string_view view() const noexcept { return {bytes_.data(), size_}; }

  private:
    void grow(std::size_t need) {
        // 256 bytes hold a claim or a commit: most buffers never grow twice.
        bytes_.resize(std::max({need, 2 * bytes_.size(), std::size_t{256}}));
    }

    std::string bytes_;
    std::size_t size_ = 0;
};

}  // namespace detail

/// @brief Command arguments encoded as RESP bulk strings as they are added, then sent as they are
/// (redisAppendFormattedCommand): no std::string per argument and no hiredis formatting, which
/// was 40 % of the client's instructions per message for a claim and a commit. Binary-safe:
/// text, idem::Blob (bytes) and integers (their decimal).
class RedisArgs {
  public:
    template <class T>
    RedisArgs& add(const T& value) {
        if constexpr (std::is_same_v<T, Blob>) {
            resp_.append_bulk(value.bytes);
        } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
            resp_.append_bulk(std::string_view(value));
        } else if constexpr (std::is_integral_v<T>) {
            resp_.append_bulk(detail::Decimal(value).view());
        } else {
            static_assert(std::is_integral_v<T>,
                          "idem: a Redis command argument must be text, idem::Blob or an integer");
        }
        ++count_;
        return *this;
    }
    /// Every argument of @p more, after these.
    RedisArgs& append(const RedisArgs& more) {
        resp_.append(more.resp_.view());
        count_ += more.count_;
        return *this;
    }

    [[nodiscard]] std::size_t count() const noexcept { return count_; }
    [[nodiscard]] bool empty() const noexcept { return count_ == 0; }
    /// The arguments as RESP, without the command's `*<count>` header.
    [[nodiscard]] std::string_view resp() const noexcept { return resp_.view(); }

    /// Where the arguments end now; truncate() drops what was added after it (savepoints).
    struct Mark {
        std::size_t count = 0;
        std::size_t bytes = 0;
    };
    [[nodiscard]] Mark mark() const noexcept { return Mark{count_, resp_.size()}; }
    void truncate(Mark mark) {
        resp_.truncate(mark.bytes);
        count_ = std::min(count_, mark.count);
    }
    void clear() noexcept {
        resp_.clear();
        count_ = 0;
    }
    void reserve(std::size_t bytes) { resp_.reserve(bytes); }

  private:
    detail::RespBuffer resp_;
    std::size_t count_ = 0;
};

/// @brief One connection to a Redis server. Not thread-safe: one thread at a time (RedisStore
/// keeps a pool). After an I/O error or timeout the connection is dropped and the next call
/// reconnects, so a restarted server is picked up without the caller doing anything.
class RedisConnection {
  public:
    explicit RedisConnection(RedisEndpoint endpoint) : endpoint_(std::move(endpoint)) {}
    RedisConnection(const RedisConnection&) = delete;
    RedisConnection& operator=(const RedisConnection&) = delete;

    [[nodiscard]] const RedisEndpoint& endpoint() const noexcept { return endpoint_; }
    /// Whether a socket is open (one inherited across fork() does not count: it is the parent's).
    [[nodiscard]] bool connected() const noexcept {
        return context_ != nullptr && pid_ == ::getpid();
    }
    /// How many times this connection (re)connected; a test sees reconnects with it.
    [[nodiscard]] std::size_t connects() const noexcept { return connects_; }
    /// Request/reply exchanges so far (a pipeline is one; connecting and loading a script count).
    [[nodiscard]] std::size_t round_trips() const noexcept { return round_trips_; }

    /// @brief Sends one command and reads its reply; an error reply is returned, not thrown.
    /// @throws store_unavailable (cannot connect, connection lost) or store_timeout.
    RedisReply command(const std::vector<std::string>& args) {
        ensure_connected();
        ++round_trips_;
        append(args);
        return read_reply();
    }
    /// @brief The same, with the arguments already encoded (RedisArgs).
    RedisReply command(const RedisArgs& args) {
        ensure_connected();
        ++round_trips_;
        append({}, args);
        return read_reply();
    }

    /// @brief Like command(), but an error reply throws store_error with @p what and the text.
    RedisReply checked(const std::vector<std::string>& args, std::string_view what) {
        return check(command(args), what);
    }
    RedisReply checked(const RedisArgs& args, std::string_view what) {
        return check(command(args), what);
    }

    /// @brief Sends every command, then reads every reply: one round trip for all of them.
    std::vector<RedisReply> pipeline(const std::vector<std::vector<std::string>>& commands) {
        ensure_connected();
        ++round_trips_;
        for (const auto& args : commands)
            append(args);
        return read_replies(commands.size());
    }

    /// @brief The same with each command's arguments already encoded (RedisArgs).
    std::vector<RedisReply> pipeline(const std::vector<RedisArgs>& commands) {
        ensure_connected();
        ++round_trips_;
        for (const auto& args : commands)
            append({}, args);
        return read_replies(commands.size());
    }

    /// @brief Runs a script by EVALSHA, loading it when the server does not know it (first use,
    /// or a restarted server). Error replies are returned (the caller knows what they mean).
    RedisReply eval(const RedisScript& script, const std::vector<std::string>& keys,
                    const std::vector<std::string>& args) {
        RedisArgs call;
        for (const auto& key : keys)
            call.add(key);
        for (const auto& arg : args)
            call.add(arg);
        return eval(script, keys.size(), call);
    }

    /// @brief The same with the keys and then the arguments already encoded: the first
    /// @p num_keys of @p keys_then_args are the script's KEYS, the rest its ARGV.
    RedisReply eval(const RedisScript& script, std::size_t num_keys,
                    const RedisArgs& keys_then_args) {
        ensure_connected();
        ++round_trips_;
        append_evalsha(sha_of(script), num_keys, keys_then_args);
        RedisReply reply = read_reply();
        if (is_noscript(reply)) {  // a restarted server emptied its script cache: nothing ran
            shas_.erase(script.source);
            ++round_trips_;
            append_evalsha(sha_of(script), num_keys, keys_then_args);
            reply = read_reply();
        }
        return reply;
    }

    /// @brief Runs one script many times in one round trip (pipelined EVALSHA), loading it first
    /// if this connection has not yet; a server that lost its script cache gets it again and
    /// the calls are repeated once. Replies in order; error replies are returned.
    std::vector<RedisReply> eval_many(const RedisScript& script,
                                      const std::vector<std::vector<std::string>>& keys,
                                      const std::vector<std::vector<std::string>>& args) {
        std::vector<RedisArgs> calls(keys.size());
        for (std::size_t i = 0; i < keys.size(); ++i) {
            for (const auto& key : keys[i])
                calls[i].add(key);
            for (const auto& arg : args[i])
                calls[i].add(arg);
        }
        auto send = [&] {
            ensure_connected();
            ++round_trips_;
            const std::string& sha = sha_of(script);
            for (std::size_t i = 0; i < calls.size(); ++i)
                append_evalsha(sha, keys[i].size(), calls[i]);
            return read_replies(calls.size());
        };
        std::vector<RedisReply> replies = send();
        // A restarted server has no scripts: every reply is NOSCRIPT, nothing ran.
        if (!replies.empty() && is_noscript(replies.front())) {
            shas_.erase(script.source);
            replies = send();
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

    static bool is_noscript(const RedisReply& reply) {
        return reply.is_error() && reply.str.rfind("NOSCRIPT", 0) == 0;
    }

    RedisReply check(RedisReply reply, std::string_view what) const {
        if (reply.is_error()) {
            throw store_error(fmt::format("idem: Redis {} failed on {}: {}", what,
                                          endpoint_.describe(), reply.str));
        }
        return reply;
    }

    const std::string& sha_of(const RedisScript& script) {
        auto it = shas_.find(script.source);
        if (it != shas_.end()) return it->second;
        RedisReply loaded = command({"SCRIPT", "LOAD", script.source});
        if (loaded.is_error()) {
            throw store_error(fmt::format("idem: Redis refused the {} script on {}: {}",
                                          script.name, endpoint_.describe(), loaded.str));
        }
        return shas_.emplace(script.source, std::move(loaded.str)).first->second;
    }

    void ensure_connected() {
        if (context_ && pid_ == ::getpid()) return;
        if (context_) forget_inherited();
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
        pid_ = ::getpid();
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

    /// A connection made before fork() is the parent's too: a command sent on it from here would
    /// interleave with the parent's on one socket, and each process could read the other's
    /// replies. The child closes its copy of the socket (the parent's stays open: no shutdown(),
    /// no QUIT) and connects anew.
    void forget_inherited() noexcept {
        context_.reset();
        shas_.clear();
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

    // Commands are written as RESP into out_ (reused) and handed to hiredis as they are.
    void append(const std::vector<std::string>& args) {
        out_.clear();
        out_.append("*", 1);
        out_.append_decimal(static_cast<long long>(args.size()));
        out_.append("\r\n", 2);
        for (const auto& arg : args)
            out_.append_bulk(arg);
        send_out();
    }
    /// @p head's arguments, then @p tail's, as one command.
    void append(std::initializer_list<std::string_view> head, const RedisArgs& tail) {
        out_.clear();
        out_.reserve(64 + tail.resp().size());
        out_.append("*", 1);
        out_.append_decimal(static_cast<long long>(head.size() + tail.count()));
        out_.append("\r\n", 2);
        for (std::string_view arg : head)
            out_.append_bulk(arg);
        out_.append(tail.resp());
        send_out();
    }
    void append_evalsha(const std::string& sha, std::size_t num_keys, const RedisArgs& call) {
        const detail::Decimal keys(num_keys);
        append({"EVALSHA", sha, keys.view()}, call);
    }
    void send_out() {
        const std::string_view command = out_.view();
        if (redisAppendFormattedCommand(context_.get(), command.data(), command.size()) !=
            REDIS_OK) {
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
    std::vector<RedisReply> read_replies(std::size_t count) {
        std::vector<RedisReply> replies;
        replies.reserve(count);
        for (std::size_t i = 0; i < count; ++i)
            replies.push_back(read_reply());
        return replies;
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
    pid_t pid_ = 0;  ///< the process that connected context_
    std::unordered_map<const char*, std::string> shas_;
    detail::RespBuffer out_;  ///< the command being sent, as RESP
    std::size_t connects_ = 0;
    std::size_t round_trips_ = 0;
};

IDEM_END_NAMESPACE
