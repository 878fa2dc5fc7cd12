#pragma once
/// @file
/// @brief idem::redis::FollowingConnection: one connection for the keys of one hash slot that
/// follows the slot across a Redis Cluster (`MOVED`, `ASK`); a plain Connection on a standalone
/// server. The Redis Streams consumer reads its stream through one. Link idem::redis.

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/redis/connection.hpp"
#include "idem/redis/endpoint.hpp"
#include "idem/redis/reply.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// @brief ONE connection for commands on the keys of one hash slot (a stream and the keys
/// tagged like it), that follows the slot: a `MOVED` reply makes it reconnect to the node named
/// and send the command(s) again, an `ASK` sends `ASKING` and the command(s) once to the node
/// named. On a standalone server it is a plain Connection (no reply looked at twice, no extra
/// round trip). Not thread-safe, like Connection. The Redis Streams consumer reads its stream
/// through one.
class FollowingConnection {
  public:
    /// @brief A connection to @p endpoint (not made yet: the first command makes it).
    explicit FollowingConnection(RedisEndpoint endpoint)
        : given_(endpoint), connection_(std::make_unique<Connection>(std::move(endpoint))) {}

    /// The address given (not the node followed to).
    [[nodiscard]] const RedisEndpoint& endpoint() const noexcept { return given_; }
    /// MOVED replies followed so far.
    [[nodiscard]] std::size_t moves() const noexcept { return moves_; }

    /// @brief One command, following MOVED and ASK. An error reply is returned, not thrown. @throws
    /// store_unavailable or store_timeout as Connection's, store_unavailable after too many
    /// redirects.
    Reply command(const std::vector<std::string>& args) {
        return follow([&](Connection& c) { return c.command(args); });
    }
    /// @brief Every command in one round trip, following MOVED and ASK (the commands are sent
    /// again). @throws as command().
    std::vector<Reply> pipeline(const std::vector<std::vector<std::string>>& commands) {
        return follow_all([&](Connection& c) { return c.pipeline(commands); });
    }
    /// @brief @p script on @p keys and @p args (EVALSHA), following MOVED and ASK. @throws as
    /// command().
    Reply eval(const Script& script, const std::vector<std::string>& keys,
               const std::vector<std::string>& args) {
        return follow([&](Connection& c) { return c.eval(script, keys, args); });
    }
    /// @brief Drops the connection; the next command reconnects (to the address given).
    void disconnect() noexcept { connection_->disconnect(); }

  private:
    static constexpr int max_redirects = 8;

    static bool is_redirect(const Reply& reply, std::string_view word) {
        return reply.is_error() && reply.str.size() > word.size() &&
               std::string_view(reply.str).substr(0, word.size()) == word &&
               reply.str[word.size()] == ' ';
    }
    /// A connection to the node at the end of a redirect (`MOVED 3999 127.0.0.1:6381`).
    std::unique_ptr<Connection> connection_to(const std::string& error) const {
        RedisEndpoint endpoint = given_;
        const std::size_t space = error.rfind(' ');
        const std::string address = error.substr(space + 1);
        const std::size_t colon = address.rfind(':');
        if (space == std::string::npos || colon == std::string::npos) {
            throw store_unavailable("idem: unreadable Redis Cluster redirect: " + error);
        }
        endpoint.host = address.substr(0, colon);
        endpoint.port = static_cast<int>(parse_int(address.substr(colon + 1)));
        endpoint.db = 0;
        return std::make_unique<Connection>(std::move(endpoint));
    }

    template <class Fn>
    Reply follow(Fn&& fn) {
        Reply reply = fn(*connection_);
        for (int hop = 0; hop < max_redirects; ++hop) {
            if (is_redirect(reply, "MOVED")) {
                ++moves_;
                connection_ = connection_to(reply.str);
                reply = fn(*connection_);
            } else if (is_redirect(reply, "ASK")) {
                std::unique_ptr<Connection> once = connection_to(reply.str);
                const Reply ok = once->command({"ASKING"});
                reply = ok.is_error() ? ok : fn(*once);
            } else {
                return reply;
            }
        }
        throw store_unavailable("idem: too many Redis Cluster redirects: " + reply.str);
    }

    /// A pipeline is sent again only when its first reply is a redirect (its commands share one
    /// slot, so a node that does not serve it refused them all).
    template <class Fn>
    std::vector<Reply> follow_all(Fn&& fn) {
        std::vector<Reply> replies = fn(*connection_);
        for (int hop = 0; hop < max_redirects; ++hop) {
            if (replies.empty()) return replies;
            const Reply& first = replies.front();
            if (is_redirect(first, "MOVED")) {
                ++moves_;
                connection_ = connection_to(first.str);
                replies = fn(*connection_);
            } else if (is_redirect(first, "ASK")) {
                std::unique_ptr<Connection> once = connection_to(first.str);
                const Reply ok = once->command({"ASKING"});
                if (ok.is_error()) return replies;
                replies = fn(*once);
            } else {
                return replies;
            }
        }
        throw store_unavailable("idem: too many Redis Cluster redirects: " + replies.front().str);
    }

    RedisEndpoint given_;
    std::unique_ptr<Connection> connection_;
    std::size_t moves_ = 0;
};

}  // namespace redis
IDEM_END_NAMESPACE
