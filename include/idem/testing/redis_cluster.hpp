#pragma once
/// @file
/// @brief idem::testing::RedisCluster: a throwaway Redis Cluster for your tests — 3 masters and
/// 3 replicas by default, each a RedisServer (redis_server.hpp) started with
/// `--cluster-enabled yes` on free 127.0.0.1 ports in its own temp dir, joined by `redis-cli
/// --cluster create … --cluster-replicas 1 --cluster-yes`; ready when every node says
/// `cluster_state:ok`. Stopped by pid with the servers. Helpers kill and restart a node and move
/// a slot by hand (`CLUSTER SETSLOT … IMPORTING / MIGRATING`, `MIGRATE`, `SETSLOT … NODE`), in
/// steps, so a test can catch a client between them (ASK) or after them (MOVED). Link idem::redis
/// (hiredis). POSIX/Linux; no gtest.
///
/// @code
/// auto& cluster = idem::testing::shared_redis_cluster();  // one per test process
/// idem::RedisStore store{idem::RedisEndpoint{cluster.host(), cluster.port(0)}};  // any node
/// cluster.move_slot(1234, cluster.master_index_of(1234) == 0 ? 1 : 0);
/// @endcode
///
/// Not thread-safe; the servers' life cycle is RedisServer's (a Watchdog each).

#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/testing/process.hpp"
#include "idem/testing/redis_server.hpp"

IDEM_BEGIN_NAMESPACE

namespace testing {

namespace detail {

inline Program find_redis_cli() {
    return find_program("redis-cli", "IDEM_TEST_REDIS_CLI", "Debian: redis-tools");
}

}  // namespace detail

/// One node of a RedisCluster as CLUSTER NODES shows it.
struct RedisClusterNode {
    std::string id;
    int port = 0;
    bool master = false;
    bool failed = false;  ///< fail or fail? flag
};

class RedisCluster {
  public:
    /// Whether redis-server and redis-cli exist; @p why says where they were looked for.
    static bool available(std::string* why = nullptr) {
        if (!RedisServer::available(why)) return false;
        const auto cli = detail::find_redis_cli();
        if (cli.path.empty() && why != nullptr) *why = cli.why;
        return !cli.path.empty();
    }

    /// Starts @p masters masters with @p replicas replicas each and joins them. @p node_timeout is
    /// cluster-node-timeout (a failover starts after it). Throws std::runtime_error.
    explicit RedisCluster(int masters = 3, int replicas = 1,
                          std::chrono::milliseconds node_timeout = std::chrono::milliseconds(2000))
        : masters_(static_cast<std::size_t>(masters)),
          replicas_per_master_(static_cast<std::size_t>(replicas)),
          replicas_expected_(static_cast<std::size_t>(masters * replicas)) {
        const auto cli = detail::find_redis_cli();
        if (cli.path.empty()) throw std::runtime_error("RedisCluster: " + cli.why);
        cli_ = cli.path;
        const int count = masters * (1 + replicas);
        for (int i = 0; i < count; ++i) {
            nodes_.push_back(std::make_unique<RedisServer>(
                RedisServer::aof_always,
                std::vector<std::string>{"--cluster-enabled", "yes", "--cluster-config-file",
                                         "nodes.conf", "--cluster-node-timeout",
                                         std::to_string(node_timeout.count()), "--cluster-port",
                                         std::to_string(probe_free_port()),
                                         // a replica answers for its master at once after a
                                         // failover (tests kill masters)
                                         "--cluster-replica-validity-factor", "0",
                                         "--cluster-allow-replica-migration", "no"}));
        }
        Spawn create;
        create.argv = {cli_.string(), "--cluster", "create"};
        for (const auto& node : nodes_)
            create.argv.push_back("127.0.0.1:" + std::to_string(node->port()));
        create.argv.insert(create.argv.end(),
                           {"--cluster-replicas", std::to_string(replicas), "--cluster-yes"});
        run_cli(create, "--cluster create");
        if (!wait_until_ok(std::chrono::seconds(30))) {
            throw std::runtime_error("RedisCluster: cluster_state did not become ok: " +
                                     nodes_.front()->log_tail());
        }
    }
    RedisCluster(const RedisCluster&) = delete;
    RedisCluster& operator=(const RedisCluster&) = delete;

    [[nodiscard]] std::string host() const { return "127.0.0.1"; }
    [[nodiscard]] std::size_t size() const { return nodes_.size(); }
    [[nodiscard]] int port(std::size_t node) const { return nodes_.at(node)->port(); }
    [[nodiscard]] RedisServer& server(std::size_t node) { return *nodes_.at(node); }
    [[nodiscard]] RedisClient client(std::size_t node) const {
        return RedisClient{host(), port(node)};
    }

    /// Every node as a live node sees it (CLUSTER NODES).
    std::vector<RedisClusterNode> nodes() {
        std::vector<RedisClusterNode> out;
        for (const auto& line : node_lines()) {
            RedisClusterNode node;
            node.id = line.id;
            node.port = line.port;
            node.master = line.flags.find("master") != std::string::npos;
            node.failed = line.flags.find("fail") != std::string::npos;
            out.push_back(node);
        }
        return out;
    }

    /// The index (into port()) of the master serving @p slot now, as a live node sees it.
    std::size_t master_index_of(std::uint16_t slot) {
        for (const auto& line : node_lines()) {
            if (line.flags.find("master") == std::string::npos) continue;
            for (const auto& range : line.ranges) {
                if (range.empty() || range[0] == '[') continue;  // a slot being moved
                const std::size_t dash = range.find('-');
                const int first = std::stoi(range.substr(0, dash));
                const int last =
                    dash == std::string::npos ? first : std::stoi(range.substr(dash + 1));
                if (slot >= first && slot <= last) return index_of_port(line.port);
            }
        }
        throw std::runtime_error("RedisCluster: no master serves slot " + std::to_string(slot));
    }

    /// The index of a master other than @p node (where to move a slot).
    std::size_t other_master(std::size_t node) {
        for (const auto& line : node_lines()) {
            if (line.flags.find("master") == std::string::npos ||
                line.flags.find("fail") != std::string::npos)
                continue;
            const std::size_t i = index_of_port(line.port);
            if (i != node) return i;
        }
        throw std::runtime_error("RedisCluster: no other master");
    }

    /// The node ids, by index.
    std::string id_of(std::size_t node) { return client(node).str({"CLUSTER", "MYID"}).value(); }

    /// Step 1 of moving @p slot to node @p to: IMPORTING on it, MIGRATING on the owner. Clients
    /// now get ASK for keys already moved.
    void begin_move(std::uint16_t slot, std::size_t to) {
        const std::size_t from = master_index_of(slot);
        const std::string s = std::to_string(slot);
        client(to).exec({"CLUSTER", "SETSLOT", s, "IMPORTING", id_of(from)});
        client(from).exec({"CLUSTER", "SETSLOT", s, "MIGRATING", id_of(to)});
        moving_.push_back(Move{slot, from, to});
    }
    /// Step 2: MIGRATE up to @p limit keys of the slot (all by default) to the importing node.
    /// Returns how many moved.
    std::size_t move_keys(std::uint16_t slot, std::size_t limit = static_cast<std::size_t>(-1)) {
        const Move move = find_move(slot);
        RedisClient from = client(move.from);
        std::size_t moved = 0;
        while (moved < limit) {
            const std::size_t batch = std::min<std::size_t>(100, limit - moved);
            const auto keys = from.array(
                {"CLUSTER", "GETKEYSINSLOT", std::to_string(slot), std::to_string(batch)});
            if (keys.empty()) break;
            std::vector<std::string> migrate{"MIGRATE", host(), std::to_string(port(move.to)),
                                             "",        "0",    "5000",
                                             "REPLACE", "KEYS"};
            for (const auto& key : keys)
                migrate.push_back(*key);
            from.exec(migrate);
            moved += keys.size();
        }
        return moved;
    }
    /// Step 3: SETSLOT … NODE on every master: the slot is the new node's; clients get MOVED.
    void end_move(std::uint16_t slot) {
        const Move move = find_move(slot);
        const std::string s = std::to_string(slot);
        const std::string id = id_of(move.to);
        client(move.to).exec({"CLUSTER", "SETSLOT", s, "NODE", id});
        client(move.from).exec({"CLUSTER", "SETSLOT", s, "NODE", id});
        for (std::size_t i = 0; i < nodes_.size(); ++i) {
            if (i == move.to || i == move.from || !nodes_[i]->running()) continue;
            try {
                if (is_master(i)) client(i).exec({"CLUSTER", "SETSLOT", s, "NODE", id});
            } catch (const std::exception&) {  // it learns from the others
            }
        }
        for (auto it = moving_.begin(); it != moving_.end(); ++it) {
            if (it->slot == slot) {
                moving_.erase(it);
                break;
            }
        }
    }
    /// All three steps.
    void move_slot(std::uint16_t slot, std::size_t to) {
        begin_move(slot, to);
        move_keys(slot);
        end_move(slot);
    }

    /// SIGKILL one node (its replica takes over after the node timeout if it was a master).
    void kill_node(std::size_t node) { nodes_.at(node)->kill9(); }
    /// Starts a killed or stopped node again on its port and dir (it rejoins from nodes.conf).
    void restart_node(std::size_t node) { nodes_.at(node)->start(); }

    /// Every live node says cluster_state:ok, sees every slot served and knows every replica
    /// as one (CLUSTER INFO, CLUSTER NODES).
    bool wait_until_ok(std::chrono::milliseconds limit) {
        return eventually(
            [&] {
                for (const auto& node : nodes_) {
                    if (!node->running()) continue;
                    try {
                        RedisClient c = node->client();
                        const auto info = c.str({"CLUSTER", "INFO"}).value_or("");
                        if (info.find("cluster_state:ok") == std::string::npos ||
                            info.find("cluster_slots_ok:16384") == std::string::npos)
                            return false;
                        const auto nodes = c.str({"CLUSTER", "NODES"}).value_or("");
                        std::size_t replicas = 0;
                        for (std::size_t at = nodes.find("slave"); at != std::string::npos;
                             at = nodes.find("slave", at + 1))
                            ++replicas;
                        if (replicas < live_replicas()) return false;
                    } catch (const std::exception&) {
                        return false;
                    }
                }
                return true;
            },
            limit);
    }

    /// Brings the cluster back to its layout after a test killed or stopped nodes: every node
    /// not running is started again (restart_node: a killed master rejoins from nodes.conf and
    /// hears from the others that its replica took over; every node is set to sync a replica
    /// without delay first), then waits (up to @p limit) until it
    /// is stable: every node answers with cluster_state:ok, all 16384 slots ok and every node
    /// known; every node's CLUSTER NODES shows the same masters with the same slots and the same
    /// replica of each master, no node flagged fail, pfail, handshake or noaddr, every link
    /// connected; as many masters as it was started with, each with its replicas; each master
    /// says role:master with that many connected replicas, and each replica replicates the
    /// master CLUSTER NODES names with master_link_status:up, no sync in progress and its
    /// master's offset. Which node is master may differ from before (a replica that took over
    /// stays master). Throws std::runtime_error after @p limit with the first condition not met
    /// and every node's state.
    void restore(std::chrono::milliseconds limit = std::chrono::seconds(60)) {
        // A restarted node's full sync starts at once, not after the default 5 s wait for more
        // replicas (repl-diskless-sync-delay, set here only: a chaos run restarting a node under
        // load keeps the default, so the sync does not fall in the moment the node still calls
        // itself master).
        for (std::size_t pass = 0; pass < 2; ++pass) {
            for (std::size_t i = 0; i < nodes_.size(); ++i) {
                if (pass == 1 && !nodes_[i]->running()) restart_node(i);
                if (!nodes_[i]->running()) continue;
                try {
                    client(i).exec({"CONFIG", "SET", "repl-diskless-sync-delay", "0"});
                } catch (const std::exception&) {  // stable() says what is wrong with it
                }
            }
        }
        const auto deadline = std::chrono::steady_clock::now() + limit;
        for (;;) {
            const std::vector<NodeView> seen = observe();
            std::string waiting_for;
            if (stable(seen, &waiting_for)) return;
            if (std::chrono::steady_clock::now() >= deadline) {
                throw std::runtime_error(
                    "RedisCluster: not stable within " +
                    std::to_string(
                        std::chrono::duration_cast<std::chrono::seconds>(limit).count()) +
                    " s; waiting for " + waiting_for + "\n" + describe(seen));
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
    }

    /// Every node as it says it is now, one line each (running, role, master link, offsets,
    /// cluster_state), then each distinct CLUSTER NODES view with the nodes that hold it: for a
    /// failure message.
    [[nodiscard]] std::string state() { return describe(observe()); }

    /// Whether node @p node is running as a master now (INFO replication).
    bool is_master(std::size_t node) {
        if (!nodes_.at(node)->running()) return false;
        RedisClient c = client(node);
        return c.str({"INFO", "replication"}).value_or("").find("role:master") != std::string::npos;
    }

    /// FLUSHALL on every live master.
    void flushall() {
        for (std::size_t i = 0; i < nodes_.size(); ++i) {
            if (nodes_[i]->running() && is_master(i)) client(i).exec({"FLUSHALL"});
        }
    }

  private:
    struct Move {
        std::uint16_t slot;
        std::size_t from;
        std::size_t to;
    };

    Move find_move(std::uint16_t slot) const {
        for (const Move& m : moving_)
            if (m.slot == slot) return m;
        throw std::runtime_error("RedisCluster: slot " + std::to_string(slot) +
                                 " is not being moved (begin_move first)");
    }

    struct NodeLine {
        std::string id;
        int port = 0;
        std::string flags;
        std::string master;  ///< a replica's master id; "-" for a master
        std::string link;    ///< connected, disconnected
        std::vector<std::string> ranges;
    };

    std::vector<NodeLine> node_lines() { return parse_nodes(ask_any({"CLUSTER", "NODES"})); }

    static std::vector<NodeLine> parse_nodes(const std::string& text) {
        std::vector<NodeLine> out;
        std::istringstream lines(text);
        std::string line;
        while (std::getline(lines, line)) {
            std::istringstream words(line);
            NodeLine node;
            std::string address, ping, pong, epoch;
            if (!(words >> node.id >> address >> node.flags >> node.master >> ping >> pong >>
                  epoch >> node.link))
                continue;
            node.port = std::stoi(address.substr(address.find(':') + 1));
            std::string range;
            while (words >> range)
                node.ranges.push_back(range);
            out.push_back(std::move(node));
        }
        return out;
    }

    /// One node as restore() looks at it.
    struct NodeView {
        int port = 0;
        bool running = false;
        std::string error;  ///< it did not answer: why
        std::string cluster_state;
        long long slots_ok = -1;
        long long known_nodes = -1;
        std::vector<NodeLine> lines;  ///< its CLUSTER NODES
        std::string role;             ///< INFO replication
        int master_port = -1;
        std::string link;  ///< master_link_status
        long long syncing = -1;
        long long connected_slaves = -1;
        long long master_offset = -1;
        long long replica_offset = -1;
    };

    std::vector<NodeView> observe() const {
        std::vector<NodeView> out;
        for (const auto& node : nodes_) {
            NodeView v;
            v.port = node->port();
            v.running = node->running();
            if (v.running) {
                try {
                    RedisClient c{node->host(), node->port(), std::chrono::milliseconds(500)};
                    const std::string info = c.str({"CLUSTER", "INFO"}).value_or("");
                    v.cluster_state = detail::info_field(info, "cluster_state");
                    v.slots_ok = detail::info_number(info, "cluster_slots_ok");
                    v.known_nodes = detail::info_number(info, "cluster_known_nodes");
                    v.lines = parse_nodes(c.str({"CLUSTER", "NODES"}).value_or(""));
                    const std::string repl = c.str({"INFO", "replication"}).value_or("");
                    v.role = detail::info_field(repl, "role");
                    v.master_port = static_cast<int>(detail::info_number(repl, "master_port"));
                    v.link = detail::info_field(repl, "master_link_status");
                    v.syncing = detail::info_number(repl, "master_sync_in_progress");
                    v.connected_slaves = detail::info_number(repl, "connected_slaves");
                    v.master_offset = detail::info_number(repl, "master_repl_offset");
                    v.replica_offset = detail::info_number(repl, "slave_repl_offset");
                } catch (const std::exception& e) {
                    v.error = e.what();
                }
            }
            out.push_back(std::move(v));
        }
        return out;
    }

    /// A node's CLUSTER NODES without what changes by itself (ping times, epochs, "myself"):
    /// each node as ":port master <slots>" or ":port replica of :port", sorted.
    static std::string layout(const std::vector<NodeLine>& lines) {
        std::vector<std::string> entries;
        for (const NodeLine& line : lines) {
            std::string entry = ":" + std::to_string(line.port);
            if (line.flags.find("master") != std::string::npos) {
                entry += " master";
                for (const auto& range : line.ranges)
                    entry += " " + range;
            } else {
                int master = 0;
                for (const NodeLine& other : lines)
                    if (other.id == line.master) master = other.port;
                entry += " replica of :" + std::to_string(master);
            }
            entries.push_back(std::move(entry));
        }
        std::sort(entries.begin(), entries.end());
        std::string out;
        for (const auto& entry : entries)
            out += (out.empty() ? "" : "; ") + entry;
        return out;
    }

    static std::string summary(const NodeView& v) {
        if (!v.running) return "not running";
        if (!v.error.empty()) return "no answer: " + v.error;
        std::string out = "cluster_state:" + v.cluster_state +
                          ", cluster_slots_ok:" + std::to_string(v.slots_ok) +
                          ", cluster_known_nodes:" + std::to_string(v.known_nodes) +
                          ", role:" + v.role;
        if (v.role == "slave") {
            out += " of :" + std::to_string(v.master_port) + ", master_link_status:" + v.link +
                   ", master_sync_in_progress:" + std::to_string(v.syncing) +
                   ", slave_repl_offset:" + std::to_string(v.replica_offset);
        } else {
            out += ", connected_slaves:" + std::to_string(v.connected_slaves) +
                   ", master_repl_offset:" + std::to_string(v.master_offset);
        }
        for (const NodeLine& line : v.lines) {
            if (line.flags.find("fail") != std::string::npos ||
                line.flags.find("handshake") != std::string::npos ||
                line.flags.find("noaddr") != std::string::npos || line.link != "connected")
                out +=
                    "; sees :" + std::to_string(line.port) + " as " + line.flags + " " + line.link;
        }
        return out;
    }

    std::string describe(const std::vector<NodeView>& seen) const {
        std::string out = "nodes:\n";
        for (const NodeView& v : seen)
            out += "  :" + std::to_string(v.port) + " " + summary(v) + "\n";
        std::vector<std::pair<std::string, std::string>> views;  // layout, the nodes holding it
        for (const NodeView& v : seen) {
            if (!v.running || !v.error.empty()) continue;
            const std::string l = layout(v.lines);
            bool found = false;
            for (auto& view : views) {
                if (view.first != l) continue;
                view.second += " :" + std::to_string(v.port);
                found = true;
            }
            if (!found) views.emplace_back(l, ":" + std::to_string(v.port));
        }
        for (const auto& view : views)
            out += "CLUSTER NODES as " + view.second + " see it: " + view.first + "\n";
        return out;
    }

    /// Whether the cluster is stable (restore()'s list); why not otherwise.
    bool stable(const std::vector<NodeView>& seen, std::string* why) const {
        std::string first_layout;
        int first_port = 0;
        for (const NodeView& v : seen) {
            const std::string node = "node :" + std::to_string(v.port);
            if (!v.running || !v.error.empty()) {
                *why = node + " to answer (" + summary(v) + ")";
                return false;
            }
            if (v.cluster_state != "ok" || v.slots_ok != 16384 ||
                v.known_nodes != static_cast<long long>(nodes_.size())) {
                *why = node + " to say cluster_state:ok, cluster_slots_ok:16384 and " +
                       "cluster_known_nodes:" + std::to_string(nodes_.size()) + " (" + summary(v) +
                       ")";
                return false;
            }
            for (const NodeLine& line : v.lines) {
                if (line.flags.find("fail") != std::string::npos ||
                    line.flags.find("handshake") != std::string::npos ||
                    line.flags.find("noaddr") != std::string::npos || line.link != "connected") {
                    *why = node + " to see :" + std::to_string(line.port) +
                           " as a healthy, connected node (it says " + line.flags + ", " +
                           line.link + ")";
                    return false;
                }
            }
            const std::string l = layout(v.lines);
            if (first_layout.empty()) {
                first_layout = l;
                first_port = v.port;
            } else if (l != first_layout) {
                *why = "every node to see the same layout (:" + std::to_string(first_port) +
                       " and :" + std::to_string(v.port) + " differ)";
                return false;
            }
        }
        // The layout they agree on: masters with slots, each with its replicas.
        const std::vector<NodeLine>& lines = seen.front().lines;
        std::size_t masters = 0;
        for (const NodeLine& line : lines) {
            if (line.flags.find("master") == std::string::npos) continue;
            ++masters;
            std::size_t replicas = 0;
            for (const NodeLine& other : lines)
                if (other.master == line.id) ++replicas;
            if (replicas != replicas_per_master_) {
                *why = "the master :" + std::to_string(line.port) + " to have " +
                       std::to_string(replicas_per_master_) + " replica(s) (it has " +
                       std::to_string(replicas) + ")";
                return false;
            }
        }
        if (masters != masters_) {
            *why =
                std::to_string(masters_) + " masters (there are " + std::to_string(masters) + ")";
            return false;
        }
        // What each node says of its own replication.
        for (const NodeLine& line : lines) {
            const NodeView& v = seen.at(index_of_port(line.port));
            const std::string node = "node :" + std::to_string(v.port);
            if (line.flags.find("master") != std::string::npos) {
                if (v.role != "master" ||
                    v.connected_slaves != static_cast<long long>(replicas_per_master_)) {
                    *why = node + " to say role:master with " +
                           std::to_string(replicas_per_master_) + " connected replica(s) (" +
                           summary(v) + ")";
                    return false;
                }
                continue;
            }
            int master = 0;
            for (const NodeLine& other : lines)
                if (other.id == line.master) master = other.port;
            if (v.role != "slave" || v.master_port != master || v.link != "up" || v.syncing != 0) {
                *why = node + " to replicate :" + std::to_string(master) +
                       " with master_link_status:up and no sync in progress (" + summary(v) + ")";
                return false;
            }
        }
        // Offsets, read again: each replica has what its master had a moment before.
        for (const NodeLine& line : lines) {
            if (line.flags.find("master") == std::string::npos) continue;
            try {
                const long long offset =
                    replication_offset(*nodes_.at(index_of_port(line.port)), "master_repl_offset");
                for (const NodeLine& other : lines) {
                    if (other.master != line.id) continue;
                    const long long has = replication_offset(*nodes_.at(index_of_port(other.port)),
                                                             "slave_repl_offset");
                    if (has < offset) {
                        *why = "node :" + std::to_string(other.port) +
                               " to reach its master :" + std::to_string(line.port) + "'s offset " +
                               std::to_string(offset) + " (it has " + std::to_string(has) + ")";
                        return false;
                    }
                }
            } catch (const std::exception& e) {
                *why = "the offsets of :" + std::to_string(line.port) + " and its replicas (" +
                       e.what() + ")";
                return false;
            }
        }
        return true;
    }

    std::size_t index_of_port(int port) const {
        for (std::size_t i = 0; i < nodes_.size(); ++i)
            if (nodes_[i]->port() == port) return i;
        throw std::runtime_error("RedisCluster: no node on port " + std::to_string(port));
    }

    RedisClient live_client() const {
        for (const auto& node : nodes_)
            if (node->running()) return node->client();
        throw std::runtime_error("RedisCluster: no node is running");
    }

    std::string ask_any(const std::vector<std::string>& command) {
        for (const auto& node : nodes_) {
            if (!node->running()) continue;
            try {
                RedisClient c = node->client();
                return c.str(command).value_or("");
            } catch (const std::exception&) {
            }
        }
        throw std::runtime_error("RedisCluster: no node answered " + command.front());
    }

    void run_cli(Spawn s, const char* what) {
        const std::filesystem::path path = nodes_.front()->dir() / "redis-cli.log";
        const int log = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (log < 0) throw std::runtime_error("RedisCluster: cannot open " + path.string());
        s.env = {"PATH=/usr/bin:/bin", "LC_ALL=C"};
        s.out_fd = log;
        const pid_t pid = spawn_handing_over(s, log);
        const auto status = wait_for(pid, std::chrono::seconds(60));
        if (!status || *status != 0) {
            throw std::runtime_error(std::string("RedisCluster: redis-cli ") + what +
                                     " failed: " + tail(read_text(path)));
        }
    }

    /// Replicas that should be known: all of them, less the nodes not running (a killed
    /// master's replica is a master now).
    std::size_t live_replicas() const {
        std::size_t down = 0;
        for (const auto& node : nodes_)
            if (!node->running()) ++down;
        return replicas_expected_ > down ? replicas_expected_ - down : 0;
    }

    std::size_t masters_ = 0;
    std::size_t replicas_per_master_ = 0;
    std::size_t replicas_expected_ = 0;
    std::filesystem::path cli_;
    std::vector<std::unique_ptr<RedisServer>> nodes_;
    std::vector<Move> moving_;
};

/// One cluster per test process, started on first use (shared_server()).
inline RedisCluster& shared_redis_cluster() {
    return shared_server<RedisCluster>("Redis Cluster");
}

}  // namespace testing

IDEM_END_NAMESPACE
