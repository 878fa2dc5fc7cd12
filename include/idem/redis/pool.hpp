#pragma once
/// @file
/// @brief idem::redis::Pool: the connections to ONE address (redis::Router, cluster.hpp, owns one
/// per node of a Redis Cluster). At most max_connections open (in use and idle together), a wait
/// of wait_timeout for one to come free, a PING for one idle longer than ping_idle_after, and a
/// fresh pool in a fork()ed child. Link idem::redis.

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/detail/process_id.hpp"
#include "idem/error.hpp"
#include "idem/redis/connection.hpp"
#include "idem/redis/endpoint.hpp"
#include "idem/redis/reply.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// The pool's limits (RedisOptions::max_connections, pool_wait_timeout, ping_idle_after).
struct PoolOptions {
    /// Connections open at most (in use and idle together). At least 1.
    std::size_t max_connections = 64;
    /// How long acquire() waits when max_connections are in use, before store_timeout.
    std::chrono::milliseconds wait_timeout{5'000};
    /// A pooled connection idle this long is PINGed before it is reused; zero: before every reuse.
    std::chrono::milliseconds ping_idle_after{10'000};
};

/// @brief Connections to one endpoint, shared by threads: acquire() one, use it on one thread,
/// give_back() it. Thread-safe.
class Pool {
  public:
    /// @brief An empty pool for @p endpoint: connections are made when acquired.
    Pool(RedisEndpoint endpoint, PoolOptions options)
        : endpoint_(std::move(endpoint)), options_(options) {}
    Pool(const Pool&) = delete;
    Pool& operator=(const Pool&) = delete;

    /// The address its connections go to.
    [[nodiscard]] const RedisEndpoint& endpoint() const noexcept { return endpoint_; }
    /// Its limits (max_connections, the wait, the idle ping).
    [[nodiscard]] const PoolOptions& options() const noexcept { return options_; }

    /// @brief A pooled connection, or a new one while fewer than max_connections are open; else
    /// waits. Every connection it returns goes back by give_back() (nullptr for one lost).
    /// @throws store_timeout when none came free within wait_timeout.
    std::unique_ptr<Connection> acquire() {
        std::unique_ptr<Connection> connection;
        bool ping = false;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            forget_inherited();
            const auto deadline = std::chrono::steady_clock::now() + options_.wait_timeout;
            while (idle_.empty() && in_use_ >= options_.max_connections) {
                if (free_.wait_until(lock, deadline) == std::cv_status::timeout && idle_.empty() &&
                    in_use_ >= options_.max_connections) {
                    throw store_timeout(fmt::format(
                        "idem::RedisStore: all {} connections to {} stayed in use for {} ms "
                        "(RedisOptions::max_connections, pool_wait_timeout)",
                        options_.max_connections, endpoint_.describe(),
                        options_.wait_timeout.count()));
                }
                forget_inherited();
            }
            ++in_use_;
            if (!idle_.empty()) {
                Idle& last = idle_.back();
                ping = std::chrono::steady_clock::now() - last.since >= options_.ping_idle_after;
                connection = std::move(last.connection);
                idle_.pop_back();
            }
        }
        if (connection) {
            if (ping && connection->connected()) check_alive(*connection);
            return connection;
        }
        try {
            return std::make_unique<Connection>(endpoint_);
        } catch (...) {
            give_back(nullptr);
            throw;
        }
    }

    /// @brief Returns a connection acquire() gave (nullptr: it is gone, its place is free).
    void give_back(std::unique_ptr<Connection> connection) noexcept {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (in_use_ > 0) --in_use_;
            if (connection && idle_.size() < max_idle_connections) {
                try {
                    idle_.push_back(Idle{std::move(connection), std::chrono::steady_clock::now()});
                } catch (...) {  // a connection that cannot be pooled is closed
                }
            }
        }
        free_.notify_one();
    }

  private:
    /// PING: a connection the server or the network closed while it was idle is dropped here
    /// (the next command reconnects) rather than failing the caller's command.
    static void check_alive(Connection& connection) noexcept {
        try {
            const Reply pong = connection.command({"PING"});
            if (pong.is_error()) connection.disconnect();
        } catch (...) {  // command() dropped the connection already
            connection.disconnect();
        }
    }

    /// After fork(), the pool (its idle connections, its count of those in use) is the parent's:
    /// the child starts an empty pool. Called with mutex_ held.
    void forget_inherited() noexcept {
        const pid_t pid = idem::detail::current_pid();
        if (pid == pid_) return;
        pid_ = pid;
        idle_.clear();  // each closes only this process's copy of its socket
        in_use_ = 0;
    }

    static constexpr std::size_t max_idle_connections = 16;

    struct Idle {
        std::unique_ptr<Connection> connection;
        std::chrono::steady_clock::time_point since;
    };

    RedisEndpoint endpoint_;
    PoolOptions options_;
    std::mutex mutex_;
    std::condition_variable free_;
    std::vector<Idle> idle_;
    std::size_t in_use_ = 0;
    pid_t pid_ = idem::detail::current_pid();
};

}  // namespace redis
IDEM_END_NAMESPACE
