#pragma once
/// @file
/// @brief idem::testing::RedisSentinelGroup: a throwaway Sentinel deployment for your tests: one
/// master, two replicas (`--replicaof`) and three Sentinels (`redis-server <conf> --sentinel`,
/// quorum 2), each a RedisServer (redis_server.hpp) on a free 127.0.0.1 port in its own temp dir,
/// stopped by pid. Helpers SIGKILL the master, wait for the Sentinels to promote a replica, and
/// bring the group back to one master with two replicas in sync. Link idem::redis. POSIX/Linux;
/// no gtest here.
///
/// @code
/// idem::testing::RedisSentinelGroup group;             // stable: see restore()
/// idem::RedisStore store{group.endpoint()};             // finds the master through the Sentinels
/// const int old_port = group.kill_master();             // SIGKILL
/// RedisServer& now = group.await_new_master(old_port);  // promoted and answering as master
/// group.restore();                                      // the killed one back, as its replica
/// @endcode
///
/// The failover is quick on purpose: `down-after-milliseconds` 2000, `failover-timeout` 5000.
/// Not 1000: after a switch each Sentinel counts the new master's first PING as pending from the
/// switch on, but reconnects at most once a second after its last try at the dead master, so with
/// 1000 ms a Sentinel may call the new master down before it could ask, and two of them fail it
/// over again (a second failover about a second after the first, seen on a loaded machine).

#include <signal.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
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

    /// Starts everything and waits (up to 30 s) until the group is stable (restore()).
    /// Throws std::runtime_error.
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
                                   master_name + " 2000\nsentinel failover-timeout " + master_name +
                                   " 5000\nsentinel parallel-syncs " + master_name + " 2\n";
        for (int i = 0; i < 3; ++i) {
            sentinels_.push_back(std::make_unique<RedisServer>(
                RedisServer::Setup{RedisServer::aof_always, {}, config}));
        }
        wait_until_stable(std::chrono::seconds(30));
    }

    RedisSentinelGroup(const RedisSentinelGroup&) = delete;
    RedisSentinelGroup& operator=(const RedisSentinelGroup&) = delete;

    /// The master's endpoint as a user writes it: the master name and the three Sentinels.
    [[nodiscard]] RedisEndpoint endpoint() const {
        std::vector<RedisSentinelAddress> addresses;
        for (const auto& s : sentinels_)
            addresses.push_back(RedisSentinelAddress{s->host(), s->port()});
        return RedisEndpoint::sentinel(master_name, std::move(addresses));
    }

    /// The data server that is master (as this fixture last saw it: after the constructor,
    /// restore() or await_new_master()).
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

    /// Waits until every Sentinel that answers (two at least) names one master other than
    /// @p old_port and that server says it is a master (INFO replication); returns it. Throws
    /// after @p limit with what it waited for, every node's state and the Sentinels' logs.
    RedisServer& await_new_master(int old_port,
                                  std::chrono::seconds limit = std::chrono::seconds(30)) {
        const auto deadline = std::chrono::steady_clock::now() + limit;
        for (;;) {
            const Observation seen = observe();
            std::string waiting_for;
            const std::optional<std::size_t> now = new_master(seen, old_port, &waiting_for);
            if (now) {
                master_ = *now;
                return *servers_[*now];
            }
            if (std::chrono::steady_clock::now() >= deadline) {
                throw std::runtime_error("RedisSentinelGroup: no new master within " +
                                         std::to_string(limit.count()) + " s; waiting for " +
                                         waiting_for + "\n" + describe(seen) + sentinel_logs());
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
    }

    /// Brings the group back to one master with two replicas in sync, whatever the last test
    /// killed, stopped or failed over, without waiting for the Sentinels' own timers: once every
    /// Sentinel names the same live master and no failover is in progress, each data server
    /// that is not running is started again as that master's replica (start_as_replica_of), and
    /// each other one that is not its replica (a demoted master still saying role:master, a
    /// replica of the wrong server) is told REPLICAOF, which the Sentinels would do themselves
    /// 5-8 s later. Settled: every Sentinel names that master with the flags `master` only,
    /// knows the two other Sentinels and sees both replicas as `slave` only; the master says
    /// role:master with two replicas; each replica says it replicates it with
    /// master_link_status:up and no sync in progress; and a write on the master is confirmed by
    /// both (WAIT 2). A failover the Sentinels start meanwhile is followed (the master is the one
    /// they name at the end). Throws after @p limit with the first condition not met, every
    /// node's state (role, master link, offsets) and the tail of each Sentinel's log.
    void restore(std::chrono::seconds limit = std::chrono::seconds(60)) {
        wait_until_stable(limit);
    }

    /// Waits until a write on the master reaches @p count replicas (WAIT). Throws after
    /// @p limit with what WAIT last counted and every node's state.
    void await_replicas(int count, std::chrono::seconds limit) {
        RedisClient client = master().client();
        const auto deadline = std::chrono::steady_clock::now() + limit;
        std::string last;
        for (;;) {
            try {
                client.exec({"INCR", "idem-testing:replication-probe"});
                const auto acked = client.integer({"WAIT", std::to_string(count), "100"});
                if (acked && *acked >= count) return;
                last = "WAIT counted " + std::to_string(acked.value_or(0));
            } catch (const std::exception& e) {
                last = e.what();
                client.disconnect();
            }
            if (std::chrono::steady_clock::now() >= deadline) {
                throw std::runtime_error(
                    "RedisSentinelGroup: fewer than " + std::to_string(count) +
                    " replicas in sync with the master :" + std::to_string(master_port()) +
                    " within " + std::to_string(limit.count()) + " s (" + last + ")\n" +
                    describe(observe()) + sentinel_logs());
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
    }

    /// Every node as it says it is now (role, master link, offsets; each Sentinel's master,
    /// flags and replicas), one line each: for a failure message.
    [[nodiscard]] std::string state() const { return describe(observe()); }

  private:
    std::vector<std::unique_ptr<RedisServer>> servers_;    ///< [0] the first master
    std::vector<std::unique_ptr<RedisServer>> sentinels_;  ///< after servers_: stopped first
    std::size_t master_ = 0;

    /// One data server's INFO replication.
    struct ServerView {
        int port = 0;
        bool running = false;
        std::string error;  ///< it did not answer: why
        std::string role;   ///< "master", "slave"
        int master_port = -1;
        std::string link;        ///< master_link_status
        long long syncing = -1;  ///< master_sync_in_progress
        long long link_down_seconds = -1;
        long long connected_slaves = -1;
        long long master_offset = -1;   ///< master_repl_offset
        long long replica_offset = -1;  ///< slave_repl_offset
    };
    /// One Sentinel's view of the master and its replicas.
    struct SentinelView {
        int port = 0;
        std::string error;
        int master_port = -1;
        std::string flags;
        long long other_sentinels = -1;
        std::string tilt;
        std::vector<std::pair<int, std::string>> replicas;  ///< port, flags
    };
    struct Observation {
        std::vector<ServerView> servers;
        std::vector<SentinelView> sentinels;
    };

    static std::string field(const std::vector<std::optional<std::string>>& pairs,
                             const std::string& name) {
        for (std::size_t i = 0; i + 1 < pairs.size(); i += 2) {
            if (pairs[i] == name) return pairs[i + 1].value_or("");
        }
        return "";
    }

    static int to_port(const std::string& text) {
        try {
            return text.empty() ? -1 : std::stoi(text);
        } catch (const std::exception&) {
            return -1;
        }
    }

    Observation observe() const {
        Observation seen;
        for (const auto& s : servers_) {
            ServerView v;
            v.port = s->port();
            v.running = s->running();
            if (v.running) {
                try {
                    RedisClient c{s->host(), s->port(), std::chrono::milliseconds(500)};
                    const std::string info = c.str({"INFO", "replication"}).value_or("");
                    v.role = detail::info_field(info, "role");
                    v.master_port = static_cast<int>(detail::info_number(info, "master_port"));
                    v.link = detail::info_field(info, "master_link_status");
                    v.syncing = detail::info_number(info, "master_sync_in_progress");
                    v.link_down_seconds =
                        detail::info_number(info, "master_link_down_since_seconds");
                    v.connected_slaves = detail::info_number(info, "connected_slaves");
                    v.master_offset = detail::info_number(info, "master_repl_offset");
                    v.replica_offset = detail::info_number(info, "slave_repl_offset");
                } catch (const std::exception& e) {
                    v.error = e.what();
                }
            }
            seen.servers.push_back(std::move(v));
        }
        for (const auto& s : sentinels_) {
            SentinelView v;
            v.port = s->port();
            try {
                RedisClient c{s->host(), s->port(), std::chrono::milliseconds(500)};
                const auto master = c.array({"SENTINEL", "MASTER", master_name});
                v.master_port = to_port(field(master, "port"));
                v.flags = field(master, "flags");
                const std::string others = field(master, "num-other-sentinels");
                v.other_sentinels = others.empty() ? -1 : to_port(others);
                for (const auto& replica : c.arrays({"SENTINEL", "REPLICAS", master_name}))
                    v.replicas.emplace_back(to_port(field(replica, "port")),
                                            field(replica, "flags"));
                v.tilt =
                    detail::info_field(c.str({"INFO", "sentinel"}).value_or(""), "sentinel_tilt");
            } catch (const std::exception& e) {
                v.error = e.what();
            }
            seen.sentinels.push_back(std::move(v));
        }
        return seen;
    }

    std::optional<std::size_t> index_of(int port) const {
        for (std::size_t i = 0; i < servers_.size(); ++i)
            if (servers_[i]->port() == port) return i;
        return std::nullopt;
    }

    /// The master every Sentinel names, with the flags `master` only (no failover in progress,
    /// not down), live and saying role:master; nothing (and why) otherwise.
    std::optional<std::size_t> agreed_master(const Observation& seen, std::string* why) const {
        int port = -1;
        for (const SentinelView& s : seen.sentinels) {
            if (!s.error.empty()) {
                *why = "Sentinel :" + std::to_string(s.port) + " to answer (" + s.error + ")";
                return std::nullopt;
            }
            if (port == -1) port = s.master_port;
            if (s.master_port != port) {
                *why =
                    "the Sentinels to name one master (:" + std::to_string(seen.sentinels[0].port) +
                    " names :" + std::to_string(port) + ", :" + std::to_string(s.port) +
                    " names :" + std::to_string(s.master_port) + ")";
                return std::nullopt;
            }
            if (s.flags != "master") {
                *why = "Sentinel :" + std::to_string(s.port) +
                       " to see the master :" + std::to_string(port) +
                       " with the flags 'master' only (it says '" + s.flags + "')";
                return std::nullopt;
            }
        }
        const auto i = index_of(port);
        if (!i) {
            *why = "the Sentinels to name one of the data servers (they name :" +
                   std::to_string(port) + ")";
            return std::nullopt;
        }
        const ServerView& m = seen.servers[*i];
        if (!m.running || !m.error.empty() || m.role != "master") {
            *why = "the master the Sentinels name, :" + std::to_string(port) +
                   ", to say role:master (" + summary(m) + ")";
            return std::nullopt;
        }
        return i;
    }

    std::optional<std::size_t> new_master(const Observation& seen, int old_port,
                                          std::string* why) const {
        int port = -1;
        std::size_t answered = 0;
        for (const SentinelView& s : seen.sentinels) {
            if (!s.error.empty()) continue;
            ++answered;
            if (port == -1) port = s.master_port;
            if (s.master_port != port) {
                *why = "the Sentinels to name one master (one names :" + std::to_string(port) +
                       ", :" + std::to_string(s.port) + " names :" + std::to_string(s.master_port) +
                       ")";
                return std::nullopt;
            }
        }
        if (answered < 2) {
            *why = "two Sentinels to answer (" + std::to_string(answered) + " did)";
            return std::nullopt;
        }
        if (port == old_port) {
            *why = "the Sentinels to name a master other than :" + std::to_string(old_port);
            return std::nullopt;
        }
        const auto i = index_of(port);
        if (!i || !seen.servers[*i].running || seen.servers[*i].role != "master") {
            *why = "the new master the Sentinels name, :" + std::to_string(port) +
                   ", to say role:master" +
                   (i ? " (" + summary(seen.servers[*i]) + ")" : std::string(" (not ours)"));
            return std::nullopt;
        }
        return i;
    }

    /// Whether the group is stable (restore()'s list, WAIT last); why not otherwise.
    bool stable(const Observation& seen, std::size_t m, std::string* why) const {
        const int master = servers_[m]->port();
        for (std::size_t i = 0; i < servers_.size(); ++i) {
            if (i == m) continue;
            const ServerView& r = seen.servers[i];
            if (!r.running || !r.error.empty() || r.role != "slave" || r.master_port != master ||
                r.link != "up" || r.syncing != 0) {
                *why = "the data server :" + std::to_string(r.port) +
                       " to replicate :" + std::to_string(master) +
                       " with master_link_status:up and no sync in progress (" + summary(r) + ")";
                return false;
            }
        }
        const long long replicas = static_cast<long long>(servers_.size()) - 1;
        if (seen.servers[m].connected_slaves != replicas) {
            *why = "the master :" + std::to_string(master) + " to count " +
                   std::to_string(replicas) + " connected replicas (" + summary(seen.servers[m]) +
                   ")";
            return false;
        }
        for (const SentinelView& s : seen.sentinels) {
            const std::string who = "Sentinel :" + std::to_string(s.port);
            if (s.other_sentinels != static_cast<long long>(sentinels_.size()) - 1) {
                *why = who + " to know the " + std::to_string(sentinels_.size() - 1) +
                       " other Sentinels (it knows " + std::to_string(s.other_sentinels) + ")";
                return false;
            }
            for (std::size_t i = 0; i < servers_.size(); ++i) {
                if (i == m) continue;
                const int port = servers_[i]->port();
                std::string flags = "(unknown to it)";
                for (const auto& r : s.replicas)
                    if (r.first == port) flags = r.second;
                if (flags != "slave") {
                    *why = who + " to see the replica :" + std::to_string(port) +
                           " with the flags 'slave' only (it says '" + flags + "')";
                    return false;
                }
            }
        }
        try {
            RedisClient c = servers_[m]->client();
            c.exec({"INCR", "idem-testing:replication-probe"});
            const auto acked = c.integer({"WAIT", std::to_string(replicas), "100"});
            if (acked == replicas) return true;
            *why = "WAIT " + std::to_string(replicas) +
                   " on the master :" + std::to_string(master) +
                   " to count every replica (it counted " + std::to_string(acked.value_or(0)) + ")";
        } catch (const std::exception& e) {
            *why = "a write on the master :" + std::to_string(master) + " (" + e.what() + ")";
        }
        return false;
    }

    /// The Sentinels agree on the live master m: start what is not running as its replica and
    /// turn every other data server that does not replicate it into its replica.
    void repair(const Observation& seen, std::size_t m) {
        const std::string host = servers_[m]->host();
        const int master = servers_[m]->port();
        for (std::size_t i = 0; i < servers_.size(); ++i) {
            if (i == m) continue;
            RedisServer& server = *servers_[i];
            try {
                if (!server.running()) {
                    server.start_as_replica_of(host, master);
                } else if (seen.servers[i].error.empty() &&
                           (seen.servers[i].role != "slave" ||
                            seen.servers[i].master_port != master)) {
                    server.client().exec({"REPLICAOF", host, std::to_string(master)});
                }
            } catch (const std::exception&) {  // seen again next round; its state says why
            }
        }
    }

    void wait_until_stable(std::chrono::seconds limit) {
        const auto deadline = std::chrono::steady_clock::now() + limit;
        for (;;) {
            const Observation seen = observe();
            std::string waiting_for;
            const std::optional<std::size_t> m = agreed_master(seen, &waiting_for);
            if (m) {
                if (stable(seen, *m, &waiting_for)) {
                    master_ = *m;
                    return;
                }
                repair(seen, *m);
            }
            if (std::chrono::steady_clock::now() >= deadline) {
                throw std::runtime_error("RedisSentinelGroup: not stable within " +
                                         std::to_string(limit.count()) + " s; waiting for " +
                                         waiting_for + "\n" + describe(seen) + sentinel_logs());
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
    }

    static std::string summary(const ServerView& v) {
        if (!v.running) return "not running";
        if (!v.error.empty()) return "no answer: " + v.error;
        std::string out = "role:" + v.role;
        if (v.role == "slave") {
            out += " of :" + std::to_string(v.master_port) + ", master_link_status:" + v.link +
                   ", master_sync_in_progress:" + std::to_string(v.syncing);
            if (v.link_down_seconds >= 0)
                out += ", link down for " + std::to_string(v.link_down_seconds) + " s";
            out += ", slave_repl_offset:" + std::to_string(v.replica_offset);
        } else {
            out += ", connected_slaves:" + std::to_string(v.connected_slaves);
        }
        return out + ", master_repl_offset:" + std::to_string(v.master_offset);
    }

    std::string describe(const Observation& seen) const {
        std::string out =
            "data servers (the fixture's master: :" + std::to_string(master_port()) + "):\n";
        for (const ServerView& v : seen.servers)
            out += "  :" + std::to_string(v.port) + " " + summary(v) + "\n";
        out += "Sentinels:\n";
        for (const SentinelView& s : seen.sentinels) {
            out += "  :" + std::to_string(s.port) + " ";
            if (!s.error.empty()) {
                out += "no answer: " + s.error + "\n";
                continue;
            }
            out += "names :" + std::to_string(s.master_port) + " (flags " + s.flags +
                   "), other Sentinels " + std::to_string(s.other_sentinels) + ", tilt " + s.tilt +
                   ", replicas:";
            for (const auto& r : s.replicas)
                out += " :" + std::to_string(r.first) + " (" + r.second + ")";
            out += "\n";
        }
        return out;
    }

    std::string sentinel_logs() const {
        std::string out;
        for (const auto& s : sentinels_)
            out += "Sentinel :" + std::to_string(s->port()) + "'s log, last lines:\n" +
                   s->log_tail(1500) + "\n";
        return out;
    }
};

}  // namespace testing

IDEM_END_NAMESPACE
