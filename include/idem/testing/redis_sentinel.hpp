#pragma once
/// @file
/// @brief idem::testing::RedisSentinelGroup: a throwaway Sentinel deployment for your tests: one
/// master, two replicas (`--replicaof`) and three Sentinels (`redis-server <conf> --sentinel`,
/// quorum 2), each a RedisServer (redis_server.hpp) on a free 127.0.0.1 port in its own temp dir,
/// stopped by pid. Helpers SIGKILL the master and wait for the Sentinels to promote a replica.
/// Link idem::redis. POSIX/Linux; no gtest here.
///
/// @code
/// idem::testing::RedisSentinelGroup group;             // ready: replicas synced, Sentinels agree
/// idem::RedisStore store{group.endpoint()};             // finds the master through the Sentinels
/// const int old_port = group.kill_master();             // SIGKILL
/// RedisServer& now = group.await_new_master(old_port);  // promoted and answering as master
/// group.restore();                                      // the killed one back, as a replica
/// @endcode
///
/// The failover is quick on purpose: `down-after-milliseconds` 1000, `failover-timeout` 5000.

#include <signal.h>

#include <chrono>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/config.hpp"
#include "idem/redis/endpoint.hpp"
#include "idem/testing/redis_server.hpp"

IDEM_BEGIN_NAMESPACE

namespace testing {

class RedisSentinelGroup {
  public:
    /// The name the Sentinels monitor the master under.
    static constexpr const char* master_name = "idem-master";

    /// Starts everything and waits (up to 30 s) until both replicas are in sync and every
    /// Sentinel knows the two replicas and the two other Sentinels. Throws std::runtime_error.
    RedisSentinelGroup() {
        // No 5 s wait for more replicas before a (diskless) full sync: after a failover too.
        const std::vector<std::string> quick_sync = {"--repl-diskless-sync-delay", "0"};
        servers_.push_back(std::make_unique<RedisServer>(
            RedisServer::Setup{RedisServer::aof_always, quick_sync, {}}));
        for (int i = 0; i < 2; ++i) {
            std::vector<std::string> args = quick_sync;
            args.insert(args.end(), {"--replicaof", "127.0.0.1", std::to_string(master_port())});
            servers_.push_back(std::make_unique<RedisServer>(
                RedisServer::Setup{RedisServer::aof_always, std::move(args), {}}));
        }
        master_ = 0;
        await_replicas(2, std::chrono::seconds(30));
        const std::string config = std::string("sentinel monitor ") + master_name + " 127.0.0.1 " +
                                   std::to_string(master_port()) +
                                   " 2\n"
                                   "sentinel down-after-milliseconds " +
                                   master_name + " 1000\nsentinel failover-timeout " + master_name +
                                   " 5000\nsentinel parallel-syncs " + master_name + " 2\n";
        for (int i = 0; i < 3; ++i) {
            sentinels_.push_back(std::make_unique<RedisServer>(
                RedisServer::Setup{RedisServer::aof_always, {}, config}));
        }
        await_sentinels_agree(std::chrono::seconds(30));
    }

    RedisSentinelGroup(const RedisSentinelGroup&) = delete;
    RedisSentinelGroup& operator=(const RedisSentinelGroup&) = delete;

    /// The master's endpoint as a user writes it: the master name and the three Sentinels.
    [[nodiscard]] redis::Endpoint endpoint() const {
        std::vector<redis::SentinelAddress> addresses;
        for (const auto& s : sentinels_)
            addresses.push_back(redis::SentinelAddress{s->host(), s->port()});
        return redis::Endpoint::sentinel(master_name, std::move(addresses));
    }

    /// The data server that is master now (as this fixture last saw it).
    [[nodiscard]] RedisServer& master() { return *servers_.at(master_); }
    [[nodiscard]] int master_port() const { return servers_.at(master_)->port(); }
    /// The three data servers (master and replicas), and the three Sentinels.
    [[nodiscard]] const std::vector<std::unique_ptr<RedisServer>>& servers() const {
        return servers_;
    }
    [[nodiscard]] const std::vector<std::unique_ptr<RedisServer>>& sentinels() const {
        return sentinels_;
    }

    /// The master's address as the first Sentinel that answers gives it, nothing when none does.
    [[nodiscard]] std::optional<int> sentinels_master_port() const {
        for (const auto& s : sentinels_) {
            try {
                RedisClient client{s->host(), s->port(), std::chrono::milliseconds(500)};
                const auto reply =
                    client.array({"SENTINEL", "get-master-addr-by-name", master_name});
                if (reply.size() == 2 && reply[1]) return std::stoi(*reply[1]);
            } catch (const std::exception&) {
            }
        }
        return std::nullopt;
    }

    /// SIGKILLs the master (no shutdown, nothing flushed to its replicas); returns its port.
    int kill_master() {
        RedisServer& old = master();
        const int port = old.port();
        old.kill9();
        return port;
    }

    /// Waits until the Sentinels name a master other than @p old_port and that server says it
    /// is a master (ROLE); returns it. Throws after @p limit with the Sentinels' logs.
    RedisServer& await_new_master(int old_port,
                                  std::chrono::seconds limit = std::chrono::seconds(30)) {
        const auto deadline = std::chrono::steady_clock::now() + limit;
        for (;;) {
            const auto port = sentinels_master_port();
            if (port && *port != old_port) {
                for (std::size_t i = 0; i < servers_.size(); ++i) {
                    if (servers_[i]->port() != *port || !servers_[i]->running()) continue;
                    if (role_of(*servers_[i]) == "master") {
                        master_ = i;
                        return *servers_[i];
                    }
                }
            }
            if (std::chrono::steady_clock::now() >= deadline) {
                throw std::runtime_error("RedisSentinelGroup: no new master within " +
                                         std::to_string(limit.count()) +
                                         " s; a Sentinel's log: " + sentinels_.front()->log_tail());
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
    }

    /// Starts every killed data server again (same port and dir); the Sentinels turn each into a
    /// replica of the current master. Waits (up to @p limit) until the master has two replicas
    /// in sync.
    void restore(std::chrono::seconds limit = std::chrono::seconds(60)) {
        for (auto& server : servers_) {
            if (!server->running()) server->start();
        }
        await_replicas(2, limit);
    }

    /// Waits until a write on the master reaches @p count replicas (WAIT).
    void await_replicas(int count, std::chrono::seconds limit) {
        RedisClient client = master().client();
        const auto deadline = std::chrono::steady_clock::now() + limit;
        for (;;) {
            try {
                client.exec({"INCR", "idem-testing:replication-probe"});
                if (client.integer({"WAIT", std::to_string(count), "100"}) >= count) return;
            } catch (const std::exception&) {
                client.disconnect();
            }
            if (std::chrono::steady_clock::now() >= deadline) {
                throw std::runtime_error("RedisSentinelGroup: fewer than " + std::to_string(count) +
                                         " replicas in sync within " +
                                         std::to_string(limit.count()) + " s");
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
    }

  private:
    std::vector<std::unique_ptr<RedisServer>> servers_;    ///< [0] the first master
    std::vector<std::unique_ptr<RedisServer>> sentinels_;  ///< after servers_: stopped first
    std::size_t master_ = 0;

    static std::string role_of(RedisServer& server) {
        try {
            RedisClient client{server.host(), server.port(), std::chrono::milliseconds(500)};
            const auto reply = client.str({"INFO", "replication"});
            if (reply && reply->find("role:master") != std::string::npos) return "master";
            return "replica";
        } catch (const std::exception&) {
            return "";
        }
    }

    void await_sentinels_agree(std::chrono::seconds limit) {
        const auto deadline = std::chrono::steady_clock::now() + limit;
        for (;;) {
            bool all = true;
            for (const auto& s : sentinels_) {
                try {
                    RedisClient client{s->host(), s->port(), std::chrono::milliseconds(500)};
                    const auto info = client.str({"INFO", "sentinel"});
                    // master0:name=idem-master,status=ok,address=...,slaves=2,sentinels=3
                    all = all && info && info->find("status=ok") != std::string::npos &&
                          info->find("slaves=2") != std::string::npos &&
                          info->find("sentinels=3") != std::string::npos;
                } catch (const std::exception&) {
                    all = false;
                }
            }
            if (all) return;
            if (std::chrono::steady_clock::now() >= deadline) {
                throw std::runtime_error(
                    "RedisSentinelGroup: the Sentinels did not find each other and both replicas "
                    "within " +
                    std::to_string(limit.count()) + " s: " + sentinels_.front()->log_tail());
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
    }
};

}  // namespace testing

IDEM_END_NAMESPACE
