#pragma once
/// @file
/// @brief idem::redis::Connection: one hiredis connection to one address (connect, AUTH, SELECT,
/// timeouts), binary-safe commands, pipelining, Lua scripts by EVALSHA, typed errors, and
/// fork-safety. Used by the pool (pool.hpp), RedisStore and the Redis Streams consumer; users may
/// use it for their own reads. Link idem::redis.

#include <hiredis/hiredis.h>

#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/detail/process_id.hpp"
#include "idem/error.hpp"
#include "idem/redis/endpoint.hpp"
#include "idem/redis/reply.hpp"
#include "idem/redis/resp.hpp"
#include "idem/redis/sentinel.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// @brief A Lua script sent by EVALSHA; loaded on first use on each connection (and again after a
/// server restart emptied the script cache). The cache of its SHA1 is the connection's: it goes
/// with the socket (a reconnect, a fork).
struct Script {
    const char* name;    ///< for error messages
    const char* source;  ///< must outlive every connection that runs it (a string literal)
};

/// @brief What Connection::eval_then() does with a command it pipelined after its script when
/// the server answered the script NOSCRIPT (it lost its script cache: the script did not run,
/// the commands after it did).
enum class AfterNoscript : std::uint8_t {
    /// Send it again after the loaded script is re-run: a command about the script's effect
    /// (`WAIT` confirms only the writes sent before it, so the first one confirmed nothing).
    resend,
    /// Keep the reply it gave, do not send it again: a command that must not run twice (the next
    /// claim's `SET ... NX GET` already took its lease; a second one would find it taken).
    keep_reply,
};

/// @brief A command Connection::eval_then() pipelines after its script, and what a NOSCRIPT
/// answer does to it. @p args must outlive the call.
struct ThenCommand {
    /// The command, encoded.
    const Args* args;
    /// Whether it is sent again after a NOSCRIPT reload.
    AfterNoscript after_noscript;
};

/// @brief One connection to a Redis server. Not thread-safe: one thread at a time (a Pool keeps
/// several to one address). After an I/O error or timeout the connection is dropped and the next
/// call reconnects, so a restarted server is picked up without the caller doing anything.
class Connection {
  public:
    /// @brief A connection to @p endpoint, not made yet: the first command makes it.
    explicit Connection(RedisEndpoint endpoint) : endpoint_(std::move(endpoint)) {}
    Connection(const Connection&) = delete;
    Connection& operator=(const Connection&) = delete;

    /// The address (or Sentinels) given.
    [[nodiscard]] const RedisEndpoint& endpoint() const noexcept { return endpoint_; }
    /// Whether a socket is open (one inherited across fork() does not count: it is the parent's).
    [[nodiscard]] bool connected() const noexcept {
        return context_ != nullptr && pid_ == idem::detail::current_pid();
    }
    /// The address of the server connected to (with Sentinels: the master they named at the
    /// last connect); meaningful while connected().
    [[nodiscard]] const MasterAddress& peer() const noexcept { return peer_; }
    /// How many times this connection (re)connected; a test sees reconnects with it.
    [[nodiscard]] std::size_t connects() const noexcept { return connects_; }
    /// Request/reply exchanges so far (a pipeline is one; connecting and loading a script count).
    [[nodiscard]] std::size_t round_trips() const noexcept { return round_trips_; }

    /// @brief Sends one command and reads its reply; an error reply is returned, not thrown.
    /// @throws store_unavailable (cannot connect, connection lost) or store_timeout.
    Reply command(const std::vector<std::string>& args) {
        ensure_connected();
        ++round_trips_;
        append(args);
        return read_reply();
    }
    /// @brief The same, with the arguments already encoded (Args).
    Reply command(const Args& args) {
        ensure_connected();
        ++round_trips_;
        append({}, args);
        return read_reply();
    }

    /// @brief Like command(), but an error reply throws store_error with @p what and the text.
    Reply checked(const std::vector<std::string>& args, std::string_view what) {
        return check(command(args), what);
    }
    /// @brief The same, with the arguments already encoded (Args).
    Reply checked(const Args& args, std::string_view what) { return check(command(args), what); }

    /// @brief Sends every command, then reads every reply: one round trip for all of them.
    std::vector<Reply> pipeline(const std::vector<std::vector<std::string>>& commands) {
        ensure_connected();
        ++round_trips_;
        for (const auto& args : commands)
            append(args);
        return read_replies(commands.size());
    }

    /// @brief The same with each command's arguments already encoded (Args).
    std::vector<Reply> pipeline(const std::vector<Args>& commands) {
        ensure_connected();
        ++round_trips_;
        for (const auto& args : commands)
            append({}, args);
        return read_replies(commands.size());
    }

    /// @brief Runs a script by EVALSHA, loading it when the server does not know it (first use,
    /// or a restarted server). Error replies are returned (the caller knows what they mean).
    Reply eval(const Script& script, const std::vector<std::string>& keys,
               const std::vector<std::string>& args) {
        Args call;
        for (const auto& key : keys)
            call.add(key);
        for (const auto& arg : args)
            call.add(arg);
        return eval(script, keys.size(), call);
    }

    /// @brief The same with the keys and then the arguments already encoded: the first
    /// @p num_keys of @p keys_then_args are the script's KEYS, the rest its ARGV.
    Reply eval(const Script& script, std::size_t num_keys, const Args& keys_then_args) {
        ensure_connected();
        ++round_trips_;
        append_evalsha(sha_of(script), num_keys, keys_then_args);
        Reply reply = read_reply();
        if (is_noscript(reply)) {  // a restarted server emptied its script cache: nothing ran
            shas_.erase(script.source);
            ++round_trips_;
            append_evalsha(sha_of(script), num_keys, keys_then_args);
            reply = read_reply();
        }
        return reply;
    }

    /// @brief Runs @p script by EVALSHA and then the commands of @p then, pipelined in ONE round
    /// trip; the script's reply first, then one per command. A server that lost its script cache
    /// answers NOSCRIPT: the script did not run, the commands after it did. Each command's
    /// ThenCommand::after_noscript says what happens then: the script is loaded and run again,
    /// followed by the commands marked AfterNoscript::resend (their new replies replace the old);
    /// those marked AfterNoscript::keep_reply are not sent again. Error replies are returned.
    std::vector<Reply> eval_then(const Script& script, std::size_t num_keys,
                                 const Args& keys_then_args, const std::vector<ThenCommand>& then) {
        ensure_connected();
        ++round_trips_;
        append_evalsha(sha_of(script), num_keys, keys_then_args);
        for (const ThenCommand& command : then)
            append({}, *command.args);
        std::vector<Reply> replies = read_replies(1 + then.size());
        if (!is_noscript(replies.front())) return replies;
        shas_.erase(script.source);
        std::vector<std::size_t> resent;
        for (std::size_t i = 0; i < then.size(); ++i) {
            if (then[i].after_noscript == AfterNoscript::resend) resent.push_back(i);
        }
        if (resent.empty()) {
            replies.front() = eval(script, num_keys, keys_then_args);
            return replies;
        }
        const std::string& sha = sha_of(script);
        ++round_trips_;
        append_evalsha(sha, num_keys, keys_then_args);
        for (std::size_t i : resent)
            append({}, *then[i].args);
        std::vector<Reply> again = read_replies(1 + resent.size());
        replies.front() = std::move(again.front());
        for (std::size_t k = 0; k < resent.size(); ++k)
            replies[1 + resent[k]] = std::move(again[1 + k]);
        return replies;
    }

    /// @brief Runs one script many times in one round trip (pipelined EVALSHA), loading it first
    /// if this connection has not yet; a server that lost its script cache gets it again and
    /// the calls are repeated once. Replies in order; error replies are returned.
    std::vector<Reply> eval_many(const Script& script,
                                 const std::vector<std::vector<std::string>>& keys,
                                 const std::vector<std::vector<std::string>>& args) {
        std::vector<Args> calls(keys.size());
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
        std::vector<Reply> replies = send();
        // A restarted server has no scripts: every reply is NOSCRIPT, nothing ran.
        if (!replies.empty() && is_noscript(replies.front())) {
            shas_.erase(script.source);
            replies = send();
        }
        return replies;
    }

    /// @brief eval_many() with each call's keys and then arguments already encoded: call i has
    /// @p num_keys[i] keys at the front of @p calls[i]. One round trip (two after NOSCRIPT).
    /// Commands in @p after (e.g. `WAIT`) follow the calls in the same round trip; their replies
    /// come after the calls'. After NOSCRIPT the whole pipeline, @p after included, is sent again
    /// (AfterNoscript::resend for every command: only commands about the calls' effect, as
    /// `WAIT`, belong in @p after).
    std::vector<Reply> eval_pipeline(const Script& script, const std::vector<std::size_t>& num_keys,
                                     const std::vector<const Args*>& calls,
                                     const std::vector<Args>& after = {}) {
        auto send = [&] {
            ensure_connected();
            ++round_trips_;
            const std::string& sha = sha_of(script);
            for (std::size_t i = 0; i < calls.size(); ++i)
                append_evalsha(sha, num_keys[i], *calls[i]);
            for (const auto& args : after)
                append({}, args);
            return read_replies(calls.size() + after.size());
        };
        std::vector<Reply> replies = send();
        if (!replies.empty() && is_noscript(replies.front())) {
            shas_.erase(script.source);
            replies = send();
        }
        return replies;
    }

    /// @brief Connects now (if not connected) and loads @p scripts that this connection has not
    /// loaded yet, their SCRIPT LOADs pipelined in one round trip: the first EVALSHA of each then
    /// costs no SCRIPT LOAD.
    /// @throws store_unavailable / store_timeout; store_error when the server refuses a script.
    void preload(std::initializer_list<const Script*> scripts) {
        ensure_connected();
        std::vector<const Script*> missing;
        for (const Script* script : scripts) {
            if (shas_.find(script->source) == shas_.end()) missing.push_back(script);
        }
        if (missing.empty()) return;
        std::vector<std::vector<std::string>> loads;
        loads.reserve(missing.size());
        for (const Script* script : missing)
            loads.push_back({"SCRIPT", "LOAD", script->source});
        std::vector<Reply> loaded = pipeline(loads);
        for (std::size_t i = 0; i < missing.size(); ++i) {
            if (loaded[i].is_error()) {
                throw_reply_error(
                    loaded[i], fmt::format("idem: Redis refused the {} script on {}: {}",
                                           missing[i]->name, endpoint_.describe(), loaded[i].str));
            }
            shas_.emplace(missing[i]->source, std::move(loaded[i].str));
        }
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

    static bool is_noscript(const Reply& reply) {
        return reply.is_error() && reply.str.rfind("NOSCRIPT", 0) == 0;
    }

    Reply check(Reply reply, std::string_view what) const {
        if (reply.is_error()) {
            throw_reply_error(reply, fmt::format("idem: Redis {} failed on {}: {}", what,
                                                 endpoint_.describe(), reply.str));
        }
        return reply;
    }

    const std::string& sha_of(const Script& script) {
        auto it = shas_.find(script.source);
        if (it != shas_.end()) return it->second;
        Reply loaded = command({"SCRIPT", "LOAD", script.source});
        if (loaded.is_error()) {
            throw_reply_error(loaded, fmt::format("idem: Redis refused the {} script on {}: {}",
                                                  script.name, endpoint_.describe(), loaded.str));
        }
        return shas_.emplace(script.source, std::move(loaded.str)).first->second;
    }

    void ensure_connected() {
        if (context_ && pid_ == idem::detail::current_pid()) return;
        if (context_) forget_inherited();
        // With Sentinels: wherever they say the master is now.
        MasterAddress address{endpoint_.host, endpoint_.port};
        if (endpoint_.via_sentinel()) {
            address = locate_master(endpoint_);
            ++round_trips_;  // the question to a Sentinel
        }
        redisContext* raw = redisConnectWithTimeout(address.host.c_str(), address.port,
                                                    to_timeval(endpoint_.connect_timeout));
        std::unique_ptr<redisContext, ContextFree> context(raw);
        if (!context) {
            throw store_unavailable(fmt::format("idem: cannot allocate a Redis connection to {}",
                                                endpoint_.describe()));
        }
        if (context->err != 0) {
            throw store_unavailable(
                fmt::format("idem: cannot connect to Redis at {}{}: {}", endpoint_.describe(),
                            endpoint_.via_sentinel() ? at(address) : "", context->errstr));
        }
        redisSetTimeout(context.get(), to_timeval(endpoint_.command_timeout));
        context_ = std::move(context);
        pid_ = idem::detail::current_pid();
        peer_ = address;
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
            if (endpoint_.via_sentinel()) expect_master(address);
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

    static std::string at(const MasterAddress& address) {
        return fmt::format(" (at {}:{})", address.host, address.port);
    }

    /// The Sentinels' answer may be stale (a failover under way, a Sentinel that has not heard
    /// yet): a server that is not a master is never written to. The next call asks again.
    void expect_master(const MasterAddress& address) {
        ++round_trips_;
        append({"ROLE"});
        const Reply role = read_reply();
        if (is_master_role(role)) return;
        throw store_unavailable(fmt::format(
            "idem: the Sentinels named {}:{} as the master of {}, but it is a {} (a failover under "
            "way?); nothing was sent to it, the next call asks them again",
            address.host, address.port, endpoint_.describe(),
            role.is_array() && !role.elements.empty() ? role.elements[0].str
                                                      : "server of no role"));
    }

    void expect_ok(const std::vector<std::string>& args, const char* what) {
        ++round_trips_;
        append(args);
        Reply reply = read_reply();
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
    void append(std::initializer_list<std::string_view> head, const Args& tail) {
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
    void append_evalsha(const std::string& sha, std::size_t num_keys, const Args& call) {
        const Decimal keys(num_keys);
        append({"EVALSHA", sha, keys.view()}, call);
    }
    void send_out() {
        const std::string_view command = out_.view();
        if (redisAppendFormattedCommand(context_.get(), command.data(), command.size()) !=
            REDIS_OK) {
            fail("sending a command");
        }
    }

    Reply read_reply() {
        void* raw = nullptr;
        if (redisGetReply(context_.get(), &raw) != REDIS_OK || raw == nullptr) {
            fail("reading a reply");
        }
        std::unique_ptr<void, ReplyFree> reply(raw);
        Reply copied = copy_reply(static_cast<redisReply*>(raw));
        if (endpoint_.via_sentinel() && is_readonly_error(copied)) {
            // The master became a replica (a failover): nothing was written. The replies still
            // in flight go with the connection; the next call asks the Sentinels again.
            disconnect();
            throw store_unavailable(fmt::format(
                "idem: Redis {} answered READONLY: the server is a replica now (a failover); "
                "nothing was written, the next call asks the Sentinels for the master: {}",
                endpoint_.describe(), copied.str));
        }
        return copied;
    }
    std::vector<Reply> read_replies(std::size_t count) {
        std::vector<Reply> replies;
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
    MasterAddress peer_{};
    std::unordered_map<const char*, std::string> shas_;
    RespBuffer out_;  ///< the command being sent, as RESP
    std::size_t connects_ = 0;
    std::size_t round_trips_ = 0;
};

}  // namespace redis
IDEM_END_NAMESPACE
