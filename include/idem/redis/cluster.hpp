#pragma once
/// @file
/// @brief idem::redis::Router: where each command goes, for ONE server or a Redis Cluster, found
/// out by itself. Given one address (or a list of seed nodes) it asks the first that answers
/// `INFO cluster`; a standalone server gets every command as before (one pool, no reply looked
/// at twice, no extra round trip), a cluster node makes the router learn the slot map (`CLUSTER
/// SLOTS`), keep one Pool per node and send each command to the master of its keys' hash slot.
/// It follows `MOVED` (and refreshes the map), `ASK` (`ASKING`, then the command again on the
/// node named, the map unchanged), retries `TRYAGAIN` and `CLUSTERDOWN` with a bounded backoff,
/// and throws store_unavailable for what it cannot route. A standalone server that answers
/// `MOVED` (INFO disabled) switches the router to cluster mode then. Link idem::redis.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/redis/connection.hpp"
#include "idem/redis/endpoint.hpp"
#include "idem/redis/hash_slot.hpp"
#include "idem/redis/pool.hpp"
#include "idem/redis/reply.hpp"
#include "idem/redis/resp.hpp"
#include "idem/redis/sentinel.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// What the router did besides sending commands (Router::redirects()): tests and operators
/// see a resharding or a failover with it.
struct RedirectCounts {
    std::size_t moved = 0;      ///< `MOVED` replies followed (each refreshed the slot map)
    std::size_t ask = 0;        ///< `ASK` replies followed (ASKING, then the command again)
    std::size_t retries = 0;    ///< `TRYAGAIN` / `CLUSTERDOWN` replies waited out
    std::size_t refreshes = 0;  ///< slot maps read (`CLUSTER SLOTS`)
};

/// One script call of Router::eval_each(): its keys' slot, then its keys and arguments.
struct SlotCall {
    /// The hash slot of its keys.
    std::uint16_t slot = 0;
    /// How many of keys_then_args are keys.
    std::size_t num_keys = 0;
    /// The keys, then the arguments.
    Args keys_then_args{};
};

/// @brief Connections to a standalone server or to every master of a Redis Cluster, and the
/// routing between them. Thread-safe.
class Router {
  public:
    /// @p seeds: one address (any node of a cluster, or the server) or several seed nodes.
    Router(std::vector<RedisEndpoint> seeds, PoolOptions options)
        : seeds_(std::move(seeds)), options_(options) {
        if (seeds_.empty()) throw usage_error("idem::redis::Router: no address given");
        nodes_.push_back(std::make_unique<Node>(seeds_.front(), options_));
        server_.store(nodes_.front().get(), std::memory_order_release);
    }
    Router(const Router&) = delete;
    Router& operator=(const Router&) = delete;

    /// The first address given: the server, or the first seed node.
    [[nodiscard]] const RedisEndpoint& endpoint() const noexcept { return seeds_.front(); }
    /// Every address given: the server, or the cluster's seed nodes.
    [[nodiscard]] const std::vector<RedisEndpoint>& seeds() const noexcept { return seeds_; }

    /// @brief Whether the server is a cluster node. Asks it (`INFO cluster`) on the first call
    /// that reaches a server.
    /// @throws store_unavailable when no seed answers yet.
    bool is_cluster() {
        detect();
        return cluster_.load(std::memory_order_acquire);
    }
    /// Whether detection has run and found a cluster (never contacts a server).
    [[nodiscard]] bool known_cluster() const noexcept {
        return cluster_.load(std::memory_order_acquire);
    }

    /// @brief Run on each node's first connection, before the caller's command, and again until
    /// it succeeds (the store's persistence check). Its round trips are not counted. Set it
    /// before the first call.
    void set_first_use(std::function<void(Connection&)> check) { first_use_ = std::move(check); }

    /// Request/reply exchanges of callers' commands so far (a pipeline counts once per node).
    [[nodiscard]] std::size_t round_trips() const noexcept {
        return round_trips_.load(std::memory_order_relaxed);
    }
    /// What the router did besides sending commands so far (see RedirectCounts).
    [[nodiscard]] RedirectCounts redirects() const noexcept {
        RedirectCounts out;
        out.moved = moved_.load(std::memory_order_relaxed);
        out.ask = ask_.load(std::memory_order_relaxed);
        out.retries = retries_.load(std::memory_order_relaxed);
        out.refreshes = refreshes_.load(std::memory_order_relaxed);
        return out;
    }

    /// @brief Runs @p fn with a connection to the server (standalone) or to a master of the
    /// cluster (for keyless commands: TIME, PING). Not redirected.
    template <class Fn>
    auto on_any(Fn&& fn) -> decltype(fn(std::declval<Connection&>())) {
        detect();
        return with_node(any_master(), fn);
    }

    /// @brief Runs @p fn (which sends ONE command or script whose keys are all in @p slot) on
    /// the master of @p slot and follows the cluster's redirects; on a standalone server, runs it
    /// there. Error replies other than redirects are returned.
    /// @throws store_unavailable when the slot cannot be served (no master, too many redirects,
    /// the cluster down for longer than the backoff), store_timeout.
    template <class Fn>
    Reply on_slot(std::uint16_t slot, Fn&& fn) {
        detect();
        if (!cluster_.load(std::memory_order_acquire)) {
            Reply reply = with_node(server(), fn);
            if (!is_redirect(reply)) return reply;
            become_cluster();  // INFO said nothing, but this is a cluster
        }
        return routed(slot, fn, nullptr);
    }

    /// @brief on_slot() for the slot of @p key.
    template <class Fn>
    Reply on_key(std::string_view key, Fn&& fn) {
        return on_slot(hash_slot(key), std::forward<Fn>(fn));
    }

    /// @brief Runs @p fn once per master (the server, when standalone): SCAN, INFO.
    template <class Fn>
    void on_each_master(Fn&& fn) {
        detect();
        if (!cluster_.load(std::memory_order_acquire)) {
            with_node(server(), fn);
            return;
        }
        for (Node* node : masters()) {
            with_node(*node, fn);
        }
    }

    /// @brief Opens @p connections pooled connections at once to each master (the server, when
    /// standalone), runs the first-use check where it has not passed yet, and @p fn on each (a
    /// store's warm-up: it loads its scripts). Every round trip, the check's included, is
    /// counted in round_trips(): it is the caller's own cost.
    template <class Fn>
    void on_connections_of_each_master(std::size_t connections, Fn&& fn) {
        detect();
        const std::vector<Node*> nodes =
            cluster_.load(std::memory_order_acquire) ? masters() : std::vector<Node*>{&server()};
        for (Node* node : nodes) {
            std::vector<std::unique_ptr<Connection>> held;
            held.reserve(connections);
            auto give_back_all = [&]() noexcept {
                for (auto& connection : held)
                    node->pool.give_back(std::move(connection));
                held.clear();
            };
            try {
                for (std::size_t i = 0; i < connections; ++i)
                    held.push_back(node->pool.acquire());  // all at once: each is another one
                for (auto& connection : held) {
                    const std::size_t before = connection->round_trips();
                    if (first_use_ && !node->checked.load(std::memory_order_acquire)) {
                        first_use_(*connection);
                        node->checked.store(true, std::memory_order_release);
                    }
                    fn(*connection);
                    round_trips_.fetch_add(connection->round_trips() - before,
                                           std::memory_order_relaxed);
                }
            } catch (...) {
                give_back_all();
                throw;
            }
            give_back_all();
        }
    }

    /// @brief Sends @p commands (command i's keys in @p slots[i]) in one round trip per node
    /// (one pipeline on a standalone server); replies in order. Commands a node redirected are
    /// sent again, one by one, where the redirect says.
    std::vector<Reply> pipeline(const std::vector<Args>& commands,
                                const std::vector<std::uint16_t>& slots) {
        detect();
        if (!cluster_.load(std::memory_order_acquire)) {
            std::vector<Reply> replies =
                with_node(server(), [&](Connection& c) { return c.pipeline(commands); });
            if (std::none_of(replies.begin(), replies.end(),
                             [](const Reply& r) { return is_redirect(r); })) {
                return replies;
            }
            become_cluster();
            redo_redirected(replies, [&](std::size_t i) {
                return routed(
                    slots[i], [&](Connection& c) { return c.command(commands[i]); }, nullptr);
            });
            return replies;
        }
        std::vector<Reply> replies(commands.size());
        for (auto& [node, indexes] : by_node(slots)) {
            std::vector<Args> sent;
            sent.reserve(indexes.size());
            for (std::size_t i : indexes)
                sent.push_back(commands[i]);
            std::vector<Reply> got =
                with_node(*node, [&](Connection& c) { return c.pipeline(sent); });
            for (std::size_t k = 0; k < indexes.size(); ++k)
                replies[indexes[k]] = std::move(got[k]);
        }
        redo_redirected(replies, [&](std::size_t i) {
            return routed(
                slots[i], [&](Connection& c) { return c.command(commands[i]); }, nullptr);
        });
        return replies;
    }

    /// @brief Runs @p script once per call, pipelined per node: one round trip per node.
    /// Replies in order; a call a node redirected runs again where the redirect says. A node
    /// that cannot be reached does not stop the others: its calls' replies are left nil and
    /// @p unreachable (when given) gets the error's text for each of them.
    ///
    /// With @p wait (a `WAIT` command), each node's pipeline ends with it, and @p waited[i] is the
    /// reply of the WAIT that followed call i on its node (nil when the node was unreachable).
    std::vector<Reply> eval_each(const Script& script, const std::vector<SlotCall>& calls,
                                 std::vector<std::string>* unreachable = nullptr,
                                 const Args* wait = nullptr, std::vector<Reply>* waited = nullptr) {
        if (waited != nullptr) waited->assign(calls.size(), Reply{});
        std::vector<Args> after;
        if (wait != nullptr) after.push_back(*wait);
        detect();
        std::vector<Reply> replies(calls.size());
        if (unreachable != nullptr) unreachable->assign(calls.size(), std::string());
        std::vector<std::uint16_t> slots;
        slots.reserve(calls.size());
        for (const auto& call : calls)
            slots.push_back(call.slot);
        const bool cluster = cluster_.load(std::memory_order_acquire);
        auto groups = cluster ? by_node(slots)
                              : std::vector<std::pair<Node*, std::vector<std::size_t>>>{
                                    {&server(), all_indexes(calls.size())}};
        for (auto& [node, indexes] : groups) {
            std::vector<std::size_t> num_keys;
            std::vector<const Args*> args;
            for (std::size_t i : indexes) {
                num_keys.push_back(calls[i].num_keys);
                args.push_back(&calls[i].keys_then_args);
            }
            try {
                std::vector<Reply> got = with_node(*node, [&](Connection& c) {
                    return c.eval_pipeline(script, num_keys, args, after);
                });
                for (std::size_t k = 0; k < indexes.size(); ++k) {
                    replies[indexes[k]] = std::move(got[k]);
                    if (waited != nullptr && wait != nullptr) (*waited)[indexes[k]] = got.back();
                }
            } catch (const store_error& e) {
                if (unreachable == nullptr) throw;
                for (std::size_t i : indexes)
                    (*unreachable)[i] = e.what();
            }
        }
        if (!cluster && std::any_of(replies.begin(), replies.end(),
                                    [](const Reply& r) { return is_redirect(r); })) {
            become_cluster();
        }
        redo_redirected(replies, [&](std::size_t i) {
            try {
                return routed(
                    calls[i].slot,
                    [&](Connection& c) {
                        if (wait == nullptr) {
                            return c.eval(script, calls[i].num_keys, calls[i].keys_then_args);
                        }
                        // WAIT must follow the script it confirms: sent again after NOSCRIPT.
                        std::vector<Reply> got =
                            c.eval_then(script, calls[i].num_keys, calls[i].keys_then_args,
                                        {ThenCommand{wait, AfterNoscript::resend}});
                        if (waited != nullptr) (*waited)[i] = got.back();
                        return std::move(got.front());
                    },
                    nullptr);
            } catch (const store_error& e) {
                if (unreachable == nullptr) throw;
                (*unreachable)[i] = e.what();
                return Reply{};
            }
        });
        return replies;
    }

    /// @brief One round trip, now, to every server commands go to: a PING to the server (with
    /// Sentinels: to the master they name now, asked first; a pooled connection to another
    /// address is dropped), or to each master of the cluster, with `CLUSTER INFO` in the same
    /// round trip (a cluster_state other than ok refuses keyed commands: unavailable). On a
    /// cluster the slot map is read again first when a failure marked it stale, so a master that
    /// failed over is not asked. Each exchange is bounded by the endpoint's connect_timeout and
    /// command_timeout (and pool_wait_timeout for a pooled connection).
    /// @throws store_unavailable (a server that refuses or drops the connection, answers LOADING,
    /// MASTERDOWN or CLUSTERDOWN, no Sentinel names a master, the cluster is down), store_timeout
    /// (no answer in time: a hung server), store_error (another error reply to PING).
    void ping() {
        detect();
        if (!cluster_.load(std::memory_order_acquire)) {
            Node& node = server();
            const RedisEndpoint& endpoint = node.pool.endpoint();
            if (!endpoint.via_sentinel()) {
                ping_node(node, false);
                return;
            }
            const MasterAddress master = locate_master(endpoint);
            with_node(node, [&](Connection& c) {
                if (c.connected() && (c.peer().host != master.host || c.peer().port != master.port))
                    c.disconnect();  // the next command connects where the Sentinels say now
                return ping_on(c, false);
            });
            return;
        }
        if (stale_.exchange(false, std::memory_order_relaxed)) {
            try {
                refresh_map();
            } catch (const store_error&) {  // the PINGs below say what is down
            }
        }
        const std::vector<Node*> all = masters();
        if (all.empty()) throw store_unavailable("idem: the Redis Cluster has no master");
        for (Node* node : all)
            ping_node(*node, true);
    }

    /// @brief Reads the slot map again now (a test after a resharding; normally a MOVED does).
    void refresh() {
        detect();
        if (cluster_.load(std::memory_order_acquire)) refresh_map();
    }

    /// @brief The address of the master serving @p slot now (standalone: the server).
    RedisEndpoint master_of(std::uint16_t slot) {
        detect();
        if (!cluster_.load(std::memory_order_acquire)) return server().pool.endpoint();
        return node_for(slot).pool.endpoint();
    }

  private:
    struct Node {
        Node(RedisEndpoint endpoint, PoolOptions options) : pool(std::move(endpoint), options) {}
        Pool pool;
        std::atomic<bool> checked{false};  ///< first_use_ ran and passed
    };

    /// The standalone server (the first seed, or the seed that answered): read without the
    /// mutex, which guards nodes_ growing.
    Node& server() const noexcept { return *server_.load(std::memory_order_acquire); }

    static constexpr int max_redirects = 16;
    static constexpr int max_waits = 12;  ///< TRYAGAIN / CLUSTERDOWN: 10 ms doubling to 320 ms
    static constexpr std::chrono::milliseconds first_wait{10};
    static constexpr std::chrono::milliseconds longest_wait{320};

    static bool starts_with(const Reply& reply, std::string_view word) {
        return reply.is_error() && reply.str.size() > word.size() &&
               std::string_view(reply.str).substr(0, word.size()) == word &&
               reply.str[word.size()] == ' ';
    }
    /// A reply that says "not here" or "not now": the command did not run.
    static bool is_redirect(const Reply& reply) {
        return starts_with(reply, "MOVED") || starts_with(reply, "ASK") ||
               starts_with(reply, "TRYAGAIN") || starts_with(reply, "CLUSTERDOWN");
    }

    void ping_node(Node& node, bool cluster) {
        with_node(node, [&](Connection& c) { return ping_on(c, cluster); });
    }
    /// PING (and CLUSTER INFO) on @p c; throws unless the server can serve commands.
    static int ping_on(Connection& c, bool cluster) {
        std::vector<std::vector<std::string>> commands{{"PING"}};
        if (cluster) commands.push_back({"CLUSTER", "INFO"});
        const std::vector<Reply> replies = c.pipeline(commands);
        if (replies[0].is_error()) {
            throw_reply_error(replies[0], fmt::format("idem: Redis at {} answered PING with {}",
                                                      c.endpoint().describe(), replies[0].str));
        }
        if (!cluster) return 0;
        const Reply& info = replies[1];
        if (is_unavailable_error(info) ||
            (info.type == Reply::Type::string &&
             info.str.find("cluster_state:ok") == std::string::npos)) {
            throw store_unavailable(fmt::format(
                "idem: Redis Cluster node {} does not serve commands: {}", c.endpoint().describe(),
                info.is_error() ? info.str : "cluster_state is not ok"));
        }
        return 0;  // CLUSTER INFO refused otherwise (an ACL): the PING answered
    }

    static std::vector<std::size_t> all_indexes(std::size_t n) {
        std::vector<std::size_t> out(n);
        for (std::size_t i = 0; i < n; ++i)
            out[i] = i;
        return out;
    }

    template <class Redo>
    static void redo_redirected(std::vector<Reply>& replies, Redo&& redo) {
        for (std::size_t i = 0; i < replies.size(); ++i) {
            if (is_redirect(replies[i])) replies[i] = redo(i);
        }
    }

    /// "host:port" of a redirect's target (`MOVED 3999 127.0.0.1:6381`).
    static std::optional<std::pair<std::string, int>> target_of(const std::string& error) {
        const std::size_t space = error.rfind(' ');
        if (space == std::string::npos) return std::nullopt;
        const std::string address = error.substr(space + 1);
        const std::size_t colon = address.rfind(':');
        if (colon == std::string::npos) return std::nullopt;
        return std::make_pair(address.substr(0, colon),
                              static_cast<int>(parse_int(address.substr(colon + 1))));
    }

    /// Runs @p fn on a connection of @p node: the first-use check first, round trips counted.
    template <class Fn>
    auto with_node(Node& node, Fn&& fn) -> decltype(fn(std::declval<Connection&>())) {
        std::unique_ptr<Connection> connection = node.pool.acquire();
        struct Return {
            Router* router;
            Node& node;
            std::unique_ptr<Connection>& connection;
            std::size_t before;
            ~Return() {
                router->round_trips_.fetch_add(connection->round_trips() - before,
                                               std::memory_order_relaxed);
                node.pool.give_back(std::move(connection));
            }
        } give_back{this, node, connection, connection->round_trips()};
        if (first_use_ && !node.checked.load(std::memory_order_acquire)) {
            first_use_(*connection);
            node.checked.store(true, std::memory_order_release);
            give_back.before = connection->round_trips();  // the check is not the caller's cost
        }
        try {
            return fn(*connection);
        } catch (const store_unavailable&) {
            if (cluster_.load(std::memory_order_relaxed))
                stale_.store(true, std::memory_order_relaxed);
            throw;
        } catch (const store_timeout&) {
            if (cluster_.load(std::memory_order_relaxed))
                stale_.store(true, std::memory_order_relaxed);
            throw;
        }
    }

    /// The cluster path of on_slot(): the slot's master, then wherever the replies say.
    template <class Fn>
    Reply routed(std::uint16_t slot, Fn&& fn, Node* asking) {
        std::chrono::milliseconds wait = first_wait;
        int waits = 0;
        std::string last;
        for (int hop = 0; hop < max_redirects + max_waits; ++hop) {
            if (stale_.exchange(false, std::memory_order_relaxed)) {
                try {
                    refresh_map();
                } catch (const store_error&) {  // the command's own call reports it
                }
            }
            Node& node = asking != nullptr ? *asking : node_for(slot);
            Reply reply;
            if (asking != nullptr) {
                auto ask_then = [&](Connection& c) {
                    const Reply ok = c.command({"ASKING"});
                    if (ok.is_error()) return ok;
                    return fn(c);
                };
                reply = with_node(node, ask_then);
                asking = nullptr;
            } else {
                reply = with_node(node, fn);
            }
            if (!is_redirect(reply)) return reply;
            last = reply.str;
            if (starts_with(reply, "MOVED")) {
                moved_.fetch_add(1, std::memory_order_relaxed);
                const auto target = target_of(reply.str);
                if (!target) break;
                point(slot, node_at(target->first, target->second));
                stale_.store(true, std::memory_order_relaxed);  // more slots moved, likely
                if (hop >= max_redirects) break;
                continue;
            }
            if (starts_with(reply, "ASK")) {
                ask_.fetch_add(1, std::memory_order_relaxed);
                const auto target = target_of(reply.str);
                if (!target) break;
                asking = &node_at(target->first, target->second);
                if (hop >= max_redirects) break;
                continue;
            }
            // TRYAGAIN (keys of a multi-key command split by a migration) or CLUSTERDOWN (a
            // failover): wait, read the map again, retry.
            retries_.fetch_add(1, std::memory_order_relaxed);
            if (++waits > max_waits) break;
            std::this_thread::sleep_for(wait);
            wait = std::min(wait * 2, longest_wait);
            if (starts_with(reply, "CLUSTERDOWN")) stale_.store(true, std::memory_order_relaxed);
        }
        throw store_unavailable(fmt::format(
            "idem: Redis Cluster could not serve hash slot {} (last reply: {}); nothing was "
            "acknowledged",
            slot, last.empty() ? "none" : last));
    }

    /// INFO cluster on the first seed that answers, once. The first seed is asked on a pooled
    /// connection (kept for the caller's commands: a standalone server sees no extra connection).
    void detect() {
        if (detected_.load(std::memory_order_acquire)) return;
        std::lock_guard<std::mutex> lock(detect_mutex_);
        if (detected_.load(std::memory_order_acquire)) return;
        std::optional<store_error> failure;
        for (std::size_t i = 0; i < seeds_.size(); ++i) {
            try {
                auto ask = [&](Connection& c) {
                    const Reply info = c.command({"INFO", "cluster"});
                    if (is_unavailable_error(info)) {  // not an answer yet: ask again next time
                        throw store_unavailable(
                            fmt::format("idem: Redis at {} cannot answer yet: {}",
                                        c.endpoint().describe(), info.str));
                    }
                    const bool cluster = info.type == Reply::Type::string &&
                                         info.str.find("cluster_enabled:1") != std::string::npos;
                    if (cluster) load_map(c);
                    return cluster;
                };
                bool cluster = false;
                if (i == 0) {
                    Node& first = server();
                    std::unique_ptr<Connection> connection = first.pool.acquire();
                    try {
                        cluster = ask(*connection);
                    } catch (...) {
                        first.pool.give_back(nullptr);
                        throw;
                    }
                    first.pool.give_back(std::move(connection));
                } else {
                    Connection probe(seeds_[i]);
                    cluster = ask(probe);
                    if (!cluster) {  // a standalone server: the seed that answered
                        std::lock_guard<std::mutex> nodes_lock(mutex_);
                        nodes_.push_back(std::make_unique<Node>(seeds_[i], options_));
                        server_.store(nodes_.back().get(), std::memory_order_release);
                    }
                }
                cluster_.store(cluster, std::memory_order_release);
                detected_.store(true, std::memory_order_release);
                return;
            } catch (const store_error& e) {
                failure.emplace(e);
            }
        }
        throw store_unavailable(fmt::format("idem: no Redis seed answered ({}; first tried {})",
                                            failure ? failure->what() : "no seed",
                                            seeds_.front().describe()));
    }

    void become_cluster() {
        cluster_.store(true, std::memory_order_release);
        refresh_map();
    }

    /// CLUSTER SLOTS from a node that answers: the known masters first, then the seeds.
    void refresh_map() {
        std::vector<RedisEndpoint> ask;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            for (const auto& node : nodes_)
                ask.push_back(node->pool.endpoint());
        }
        for (const RedisEndpoint& seed : seeds_)
            ask.push_back(seed);
        std::optional<store_error> failure;
        for (const RedisEndpoint& where : ask) {
            try {
                Connection probe(where);
                load_map(probe);
                return;
            } catch (const store_error& e) {
                failure.emplace(e);
            }
        }
        throw store_unavailable(fmt::format("idem: no Redis Cluster node gave its slot map ({})",
                                            failure ? failure->what() : "no node"));
    }

    void load_map(Connection& probe) {
        const Reply slots = probe.command({"CLUSTER", "SLOTS"});
        if (!slots.is_array()) {
            throw store_unavailable(fmt::format("idem: Redis at {} gave no slot map: {}",
                                                probe.endpoint().describe(),
                                                slots.is_error() ? slots.str : "not an array"));
        }
        refreshes_.fetch_add(1, std::memory_order_relaxed);
        std::vector<std::tuple<std::int64_t, std::int64_t, std::string, int>> ranges;
        for (const Reply& range : slots.elements) {
            if (range.elements.size() < 3 || range.elements[2].elements.size() < 2) continue;
            std::string host = range.elements[2].elements[0].str;
            if (host.empty() || host == "?") host = probe.endpoint().host;
            ranges.emplace_back(range.elements[0].integer, range.elements[1].integer,
                                std::move(host),
                                static_cast<int>(range.elements[2].elements[1].integer));
        }
        std::lock_guard<std::mutex> lock(mutex_);
        for (const auto& [first, last, host, port] : ranges) {
            Node* node = node_at_locked(host, port);
            for (std::int64_t s = std::max<std::int64_t>(first, 0);
                 s <= last && s < static_cast<std::int64_t>(slot_count); ++s)
                owners_[static_cast<std::size_t>(s)] = node;
        }
    }

    Node& node_at(const std::string& host, int port) {
        std::lock_guard<std::mutex> lock(mutex_);
        return *node_at_locked(host, port);
    }
    Node* node_at_locked(const std::string& host, int port) {
        for (const auto& node : nodes_) {
            const RedisEndpoint& e = node->pool.endpoint();
            if (e.host == host && e.port == port) return node.get();
        }
        RedisEndpoint endpoint = seeds_.front();  // credentials and timeouts of the seed
        endpoint.host = host;
        endpoint.port = port;
        endpoint.db = 0;  // a cluster has database 0 only
        nodes_.push_back(std::make_unique<Node>(std::move(endpoint), options_));
        return nodes_.back().get();
    }

    void point(std::uint16_t slot, Node& node) {
        std::lock_guard<std::mutex> lock(mutex_);
        owners_[slot] = &node;
    }

    Node& node_for(std::uint16_t slot) {
        std::lock_guard<std::mutex> lock(mutex_);
        Node* node = owners_[slot];
        if (node == nullptr) {
            throw store_unavailable(fmt::format(
                "idem: no Redis Cluster master serves hash slot {}; nothing was acknowledged",
                slot));
        }
        return *node;
    }

    Node& any_master() {
        if (!cluster_.load(std::memory_order_acquire)) return server();
        std::vector<Node*> all = masters();
        if (all.empty()) throw store_unavailable("idem: the Redis Cluster has no master");
        return *all.front();
    }

    /// The masters of the map, each once, in slot order.
    std::vector<Node*> masters() {
        std::lock_guard<std::mutex> lock(mutex_);
        std::vector<Node*> out;
        for (Node* node : owners_) {
            if (node != nullptr && std::find(out.begin(), out.end(), node) == out.end())
                out.push_back(node);
        }
        return out;
    }

    /// Indexes of @p slots grouped by the master serving each, in order of first appearance.
    std::vector<std::pair<Node*, std::vector<std::size_t>>> by_node(
        const std::vector<std::uint16_t>& slots) {
        if (stale_.exchange(false, std::memory_order_relaxed)) {
            try {
                refresh_map();
            } catch (const store_error&) {
            }
        }
        std::vector<std::pair<Node*, std::vector<std::size_t>>> out;
        for (std::size_t i = 0; i < slots.size(); ++i) {
            Node* node = &node_for(slots[i]);
            auto it = std::find_if(out.begin(), out.end(),
                                   [&](const auto& group) { return group.first == node; });
            if (it == out.end()) {
                out.emplace_back(node, std::vector<std::size_t>{});
                it = out.end() - 1;
            }
            it->second.push_back(i);
        }
        return out;
    }

    std::vector<RedisEndpoint> seeds_;
    PoolOptions options_;
    std::function<void(Connection&)> first_use_;
    std::mutex detect_mutex_;
    std::atomic<bool> detected_{false};
    std::atomic<bool> cluster_{false};
    std::atomic<bool> stale_{false};  ///< read the slot map again before the next command
    std::mutex mutex_;                ///< nodes_, owners_
    std::vector<std::unique_ptr<Node>> nodes_;
    std::atomic<Node*> server_{nullptr};
    std::array<Node*, slot_count> owners_{};
    std::atomic<std::size_t> round_trips_{0};
    std::atomic<std::size_t> moved_{0};
    std::atomic<std::size_t> ask_{0};
    std::atomic<std::size_t> retries_{0};
    std::atomic<std::size_t> refreshes_{0};
};

}  // namespace redis
IDEM_END_NAMESPACE
