#pragma once
/// @file
/// @brief RedisStore: claims held as leases in Redis, taken in one round trip (a plain
/// `SET … NX GET` for a new id, a Lua script for a contested one) and completed by
/// compare-and-set on the lease's token. Redis-side writes of the effect (and the
/// stream XACK when the broker is the same Redis) commit atomically with the completion. Link
/// idem::redis. See docs/redis.md.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/store.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"
#include "idem/policy.hpp"
#include "idem/redis/cluster.hpp"
#include "idem/redis/connection.hpp"
#include "idem/redis/endpoint.hpp"
#include "idem/redis/keys.hpp"
#include "idem/redis/pool.hpp"
#include "idem/redis/record.hpp"
#include "idem/redis/reply.hpp"
#include "idem/redis/resp.hpp"
#include "idem/redis/scripts.hpp"
#include "idem/redis/stream_ack.hpp"
#include "idem/store/redis_connection.hpp"  // the old names (redis::Connection, redis::Reply, ...)

IDEM_BEGIN_NAMESPACE

struct RedisOptions {
    /// Lease of a claim when the handler's policy sets none. Keep it equal to the broker's
    /// visibility timeout or just under (docs/redis.md).
    std::chrono::milliseconds lease{30'000};
    /// How long a finished claim is kept when the transaction is used without a handler (the
    /// handler passes its policy's retention).
    std::chrono::seconds retention = days(14);
    /// Prefix of every key the store writes.
    std::string key_prefix = "idem:";
    /// Time source for leases and claimed_at. Empty (the default): the Redis server's clock, read
    /// inside the scripts, so workers with skewed clocks still agree on when a lease expires.
    Clock clock;
    /// Claim a new id with one plain `SET … NX PX … GET` (Redis 7.0 and later) rather than a
    /// script; contested ids still go through the claim script. A server that refuses the
    /// command (before 7.0) switches the store to the script for good on the first claim.
    bool claim_with_set = true;
    /// A Redis without the append-only file loses every claim written since its last snapshot
    /// when it restarts, and a redelivery then runs those effects again. So the constructor (or,
    /// when the server is down or still loading its data then, the first call) reads `INFO
    /// persistence` and throws usage_error unless `aof_enabled` is 1. Set this to run without AOF
    /// anyway (a cache, a test, a server whose data survives otherwise), accepting that a restart
    /// re-runs effects; the check is then skipped.
    bool accept_no_persistence = false;
    /// Connections the store opens at most (in use and idle together). A call that needs one
    /// when all are in use waits up to pool_wait_timeout, then throws store_timeout.
    std::size_t max_connections = 64;
    std::chrono::milliseconds pool_wait_timeout{5'000};
    /// A pooled connection idle this long is PINGed before it is reused; a dead one (the server
    /// restarted, CLIENT KILL, a proxy dropped it) is replaced, so the call does not fail on it.
    /// Zero: ping before every reuse.
    std::chrono::milliseconds ping_idle_after{10'000};
    /// Replicas that must have every commit before it counts. 0 (the default): the master's
    /// answer is enough, and a failover before its replicas caught up loses the commit although
    /// it was reported (and acked). Otherwise `WAIT replicas_to_ack replicas_timeout` follows the
    /// commit script on the same connection, in the same round trip, and a commit fewer replicas
    /// confirmed throws commit_unconfirmed: `failed` (outcome unknown), never acked.
    int replicas_to_ack = 0;
    /// How long WAIT waits for them; positive, and shorter than the endpoint's command_timeout.
    std::chrono::milliseconds replicas_timeout{1'000};
};

/// @brief What the store found out about the server's persistence (RedisStore::persistence()).
struct RedisPersistence {
    bool aof_enabled = false;
    /// `CONFIG GET appendfsync` (always, everysec, no); empty when CONFIG is disabled or renamed.
    std::string appendfsync{};
};

/// @brief Claims as leases in one Redis server, the master a group of Sentinels names
/// (RedisEndpoint::sentinel), or a Redis Cluster (docs/redis.md). Thread-safe: each call takes a
/// connection from a small pool (one per cluster node), so handlers on several threads share one
/// store.
///
/// Cluster mode is detected, not configured: given the address of any node (or several seed
/// nodes) the store asks `INFO cluster`, learns the slot map and sends each command and script to
/// the master of its keys' hash slot, following MOVED and ASK (redis::Router, redis/cluster.hpp).
/// A transaction whose keys span slots commits per slot group (see commit()).
///
/// - claim(): one round trip, `SET … NX PX … GET`: absent → leased to this transaction's token
///   (attempt 1); finished → duplicate with the recorded outcome. A record leased by another
///   worker or released goes on to the claim script (one more round trip): leased and live →
///   in_progress; expired or released → taken over with a new token (and the taker's
///   fingerprint), the attempt count goes up, claimed_at stays. The record expires the retention
///   after its latest claim. claim_many(): the same for a batch's ids, the SETs
///   pipelined in one round trip.
/// - commit(): one round trip, a script that checks every lease is still ours, runs the queued
///   Redis writes (write(), the XACKs of attach()ed commit hooks), stores dead letters and marks
///   the claims done. A lease lost to another worker writes nothing and throws commit_failed
///   ("lease lost").
/// - rollback (destructor, or an effect that threw): frees only this transaction's leases, so a
///   redelivery runs the work; the attempt count stays for the poison check.
///
/// @code
/// idem::RedisStore store{idem::RedisEndpoint{"127.0.0.1", 6379}};
/// auto handler = idem::make_handler(store, policy, [](auto& tx, const Order& o) {
///     tx.write("HINCRBY", "balance:" + o.account, o.amount);   // applied at commit
/// });
/// @endcode
class RedisStore {
  public:
    class Transaction;

    explicit RedisStore(RedisEndpoint endpoint, RedisOptions options = {})
        : RedisStore(std::vector<RedisEndpoint>{std::move(endpoint)}, std::move(options)) {}

    /// @brief A store given several seed nodes of a Redis Cluster (or one server): the first
    /// that answers is asked whether it is a cluster node, and for the slot map.
    explicit RedisStore(std::vector<RedisEndpoint> seeds, RedisOptions options = {})
        : options_(std::move(options)),
          keys_(options_.key_prefix),
          router_(std::move(seeds),
                  redis::PoolOptions{options_.max_connections, options_.pool_wait_timeout,
                                     options_.ping_idle_after}) {
        claim_with_set_.store(options_.claim_with_set, std::memory_order_relaxed);
        if (options_.lease.count() <= 0) {
            throw usage_error("idem::RedisStore: the default lease must be positive");
        }
        if (options_.max_connections == 0) {
            throw usage_error("idem::RedisStore: max_connections must be at least 1");
        }
        if (options_.replicas_to_ack < 0) {
            throw usage_error("idem::RedisStore: replicas_to_ack must be 0 (no WAIT) or more");
        }
        if (options_.replicas_to_ack > 0 &&
            (options_.replicas_timeout.count() <= 0 ||
             options_.replicas_timeout >= router_.endpoint().command_timeout)) {
            throw usage_error(fmt::format(
                "idem::RedisStore: replicas_timeout ({} ms) must be positive and shorter than the "
                "endpoint's command_timeout ({} ms): WAIT {} 0 would wait for ever",
                options_.replicas_timeout.count(), router_.endpoint().command_timeout.count(),
                options_.replicas_to_ack));
        }
        if (options_.key_prefix.find_first_of("{}") != std::string::npos) {
            throw usage_error(
                "idem::RedisStore: the key prefix must not contain braces (they would change the "
                "keys' Cluster hash tags)");
        }
        // The persistence check, now if the server answers (a store on a server without AOF
        // does not start), else on first use; on a cluster, on each master's first use.
        if (!options_.accept_no_persistence) {
            router_.set_first_use([this](redis::Connection& c) { check_persistence(c); });
            try {
                with_connection([](redis::Connection&) { return 0; });
            } catch (const store_error&) {  // unreachable for now: checked on first use
            }
        }
    }
    RedisStore(const RedisStore&) = delete;
    RedisStore& operator=(const RedisStore&) = delete;

    /// The address given (the first seed node, on a cluster).
    [[nodiscard]] const RedisEndpoint& endpoint() const noexcept { return router_.endpoint(); }
    /// @brief Whether the store talks to a Redis Cluster (asks the server on the first call
    /// that reaches it). @throws store_unavailable when no seed answers yet.
    [[nodiscard]] bool is_cluster() { return router_.is_cluster(); }
    /// @brief The cluster redirects followed so far (MOVED, ASK, TRYAGAIN / CLUSTERDOWN waits,
    /// slot-map reads); all zero on a standalone server.
    [[nodiscard]] redis::RedirectCounts redirects() const noexcept { return router_.redirects(); }
    /// @brief The router (slot map, pools per node): for tests and tools.
    [[nodiscard]] redis::Router& router() noexcept { return router_; }
    [[nodiscard]] const RedisOptions& options() const noexcept { return options_; }
    /// Whether new ids are claimed with `SET … NX … GET` (RedisOptions::claim_with_set, until a
    /// server before 7.0 refuses it) rather than the claim script.
    [[nodiscard]] bool claims_with_set() const noexcept {
        return claim_with_set_.load(std::memory_order_relaxed);
    }
    /// The lease used when the handler's policy sets none.
    [[nodiscard]] std::chrono::milliseconds default_lease() const noexcept {
        return options_.lease;
    }

    /// @brief Starts a transaction. No round trip: Redis is contacted by claim() and commit().
    [[nodiscard]] Transaction begin();

    /// @brief Whether this store's transactions do @p hook in their commit: a stream ack
    /// (redis::StreamAck, from StreamConsumer or your own loop) on this store's server and
    /// database. The ack (and a dead letter's dead-letter stream entry) is then part of the
    /// commit script; otherwise the hook is ignored and the broker acks after the commit.
    /// On a Redis Cluster never: a stream and a claim are in different hash slots, so the
    /// XACK cannot be in the claim's commit script; the consumer then acks after the commit.
    [[nodiscard]] bool accepts_commit_hook(const CommitHook& hook) const noexcept {
        const auto* ack = hook.request_as<redis::StreamAck>();
        return ack != nullptr && !router_.known_cluster() &&
               ack->endpoint.same_database(endpoint());
    }

    /// @brief The claim record, or nothing when there is none or it was released.
    std::optional<ClaimRecord> find_claim(std::string_view scope, std::string_view id) {
        std::optional<redis::Record> stored = read_record(scope, id);
        if (!stored || stored->state == "free") return std::nullopt;
        ClaimRecord record;
        record.scope = std::string(scope);
        record.message_id = std::string(id);
        record.disposition = Disposition::in_progress;
        if (stored->state == "done") record.disposition = disposition_from(stored->outcome);
        record.reason = std::move(stored->reason);
        record.claimed_at = from_unix_ms(stored->claimed_at);
        record.fingerprint = std::move(stored->fingerprint);
        return record;
    }

    /// @brief How many times the effect started for this claim (0 when there is no record).
    std::uint32_t attempts(std::string_view scope, std::string_view id) {
        std::optional<redis::Record> stored = read_record(scope, id);
        return stored ? stored->attempts : 0;
    }

    /// @brief Every dead letter, oldest first. Kept until a human deletes them: purge() and the
    /// claims' expiry never touch them.
    std::vector<DeadLetter> dead_letters() {
        struct Ordered {
            std::string order;
            DeadLetter letter;
        };
        std::vector<Ordered> found;
        for (const std::string& key : scan(keys_.glob() + "d{*")) {
            redis::Reply entries = checked_on(
                key,
                [&](redis::Connection& c) {
                    return c.command({"XRANGE", key, "-", "+"});
                },
                "XRANGE");
            for (const redis::Reply& entry : entries.elements) {
                if (entry.elements.size() < 2) continue;
                Ordered item;
                const auto& fields = entry.elements[1].elements;
                for (std::size_t i = 0; i + 1 < fields.size(); i += 2) {
                    const std::string& name = fields[i].str;
                    const std::string& value = fields[i + 1].str;
                    if (name == "scope") item.letter.scope = value;
                    if (name == "id") item.letter.message_id = value;
                    if (name == "delivery_count")
                        item.letter.delivery_count =
                            static_cast<std::uint32_t>(redis::parse_int(value));
                    if (name == "reason") item.letter.reason = value;
                    if (name == "payload") item.letter.payload = value;
                    if (name == "created_at")
                        item.letter.created_at = from_unix_ms(redis::parse_int(value));
                    if (name == "order_us") item.order = value;
                }
                found.push_back(std::move(item));
            }
        }
        std::sort(found.begin(), found.end(), [](const Ordered& a, const Ordered& b) {
            if (a.letter.created_at != b.letter.created_at)
                return a.letter.created_at < b.letter.created_at;
            if (a.order.size() != b.order.size()) return a.order.size() < b.order.size();
            return a.order < b.order;
        });
        std::vector<DeadLetter> letters;
        letters.reserve(found.size());
        for (auto& item : found)
            letters.push_back(std::move(item.letter));
        return letters;
    }

    /// @brief Deletes claims claimed before clock() - @p older_than (never a live lease) and
    /// expired locks. Redis also expires claims by itself (each record's TTL is the retention);
    /// this is for a clock the server does not share (tests) and for reporting. Dead letters are
    /// kept.
    PurgeResult purge(std::chrono::system_clock::duration older_than) {
        PurgeResult result;
        const std::string now = now_arg();
        const std::int64_t cutoff_ms =
            (now.empty() ? server_now_ms() : redis::parse_int(now)) -
            std::chrono::duration_cast<std::chrono::milliseconds>(older_than).count();
        for (const redis::Reply& reply :
             run_in_batches(redis::purge_claims_script(), scan(keys_.glob() + "c{*"),
                            {std::to_string(cutoff_ms), now})) {
            check_script(reply, "purge");
            if (reply.elements.size() == 2) {
                result.claims += static_cast<std::size_t>(reply.elements[0].integer);
            }
        }
        for (const redis::Reply& reply :
             run_in_batches(redis::purge_locks_script(), scan(keys_.glob() + "l{*"), {now})) {
            check_script(reply, "purge");
            result.expired_locks += static_cast<std::size_t>(reply.integer);
        }
        return result;
    }

    /// @brief Takes a lock outside any transaction (a long job, another system); false when
    /// another owner holds it and it has not expired.
    bool hold_lock(std::string_view key, std::string_view owner,
                   std::chrono::milliseconds expire_after) {
        const std::string lock = lock_key(key);
        redis::Reply reply = router_.on_key(lock, [&](redis::Connection& c) {
            return c.eval(redis::lock_script(), {lock},
                          {std::string(owner), std::to_string(expire_after.count()), now_arg()});
        });
        check_script(reply, "lock");
        return reply.integer == 1;
    }
    /// @brief Releases a lock @p owner holds; false when it holds none.
    bool release_lock(std::string_view key, std::string_view owner) {
        const std::string lock = lock_key(key);
        redis::Reply reply = router_.on_key(lock, [&](redis::Connection& c) {
            return c.eval(redis::unlock_script(), {lock}, {std::string(owner)});
        });
        check_script(reply, "unlock");
        return reply.integer == 1;
    }

    /// @brief The record of (scope, id). The hash tag holds both, so one claim's keys (record,
    /// dead letters) share a Cluster slot whatever bytes the id has.
    [[nodiscard]] std::string claim_key(std::string_view scope, std::string_view id) const {
        return keys_.claim(scope, id);
    }
    [[nodiscard]] std::string dead_letter_key(std::string_view scope, std::string_view id) const {
        return keys_.dead_letter(scope, id);
    }
    [[nodiscard]] std::string lock_key(std::string_view key) const { return keys_.lock(key); }

    /// @brief Runs @p fn with a pooled connection (reconnecting if it was dropped): to the
    /// server, or on a cluster to one of its masters (for keyless commands; with_connection_for()
    /// routes by key). Waits up to RedisOptions::pool_wait_timeout when max_connections are in
    /// use.
    /// @throws store_timeout when no connection became free in time; usage_error when the server
    /// has no AOF (RedisOptions::accept_no_persistence).
    template <class Fn>
    auto with_connection(Fn&& fn) -> decltype(fn(std::declval<redis::Connection&>())) {
        return router_.on_any(std::forward<Fn>(fn));
    }

    /// @brief Runs @p fn, which sends ONE command or script on keys of @p key's hash slot, on
    /// the node serving that slot (the server, standalone), following the cluster's redirects.
    template <class Fn>
    redis::Reply with_connection_for(std::string_view key, Fn&& fn) {
        return router_.on_key(key, std::forward<Fn>(fn));
    }

    /// @brief What the persistence check found; nothing before the first call that reached the
    /// server, or with RedisOptions::accept_no_persistence (which skips the check).
    [[nodiscard]] std::optional<RedisPersistence> persistence() const {
        std::lock_guard<std::mutex> lock(persistence_mutex_);
        return persistence_;
    }

    /// @brief Request/reply exchanges with Redis so far, over all pooled connections (a
    /// pipeline counts once): the cost tests and benchmarks check.
    [[nodiscard]] std::size_t round_trips() const noexcept { return router_.round_trips(); }

    /// @brief Connects ahead: opens @p connections pooled connections (at most max_connections)
    /// to the server, or on a Redis Cluster to each master, runs the persistence check, and loads
    /// the store's scripts on each, so the first messages pay neither the connect nor a `SCRIPT
    /// LOAD` (a message then costs its round trips only: docs/performance.md). Its own round trips
    /// count in round_trips(). A server that restarts later forgets the scripts; they are loaded
    /// again on first use, as without warm_up(). On a cluster, a master that joins later (a
    /// failover, a resharding) is not warmed: its first use loads what it needs.
    /// @throws store_unavailable / store_timeout when Redis cannot be reached; usage_error when
    /// it has no AOF (RedisOptions::accept_no_persistence).
    void warm_up(std::size_t connections = 1) {
        connections = std::max<std::size_t>(1, std::min(connections, options_.max_connections));
        router_.on_connections_of_each_master(connections, [](redis::Connection& connection) {
            connection.preload({&redis::claim_script(), &redis::complete_script(),
                                &redis::release_script(), &redis::claim_commit_script()});
        });
    }

    /// @brief Milliseconds since the epoch on the store's clock (the server's by default).
    std::int64_t now_ms() {
        return options_.clock ? to_unix_ms(options_.clock()) : server_now_ms();
    }

  private:
    friend class Transaction;

    static Disposition disposition_from(const std::string& text) {
        Disposition d = Disposition::processed;
        return from_string(text, d) ? d : Disposition::processed;
    }

    /// The stored record of (scope, id), as it is (any state); nothing when there is none.
    std::optional<redis::Record> read_record(std::string_view scope, std::string_view id) {
        const std::string key = claim_key(scope, id);
        redis::Args get;
        get.add("GET").add(key);
        redis::Reply reply = checked_on(
            key, [&](redis::Connection& c) { return c.command(get); }, "GET");
        if (reply.is_nil()) return std::nullopt;
        auto record = redis::Record::decode(reply.str);
        if (!record) {
            throw store_error(fmt::format("idem: unreadable claim record for {}/{} on {}", scope,
                                          id, endpoint().describe()));
        }
        if (record->times_before_expiry) {
            redis::Args expiry;
            expiry.add("PEXPIRETIME").add(key);
            redis::Reply at = checked_on(
                key, [&](redis::Connection& c) { return c.command(expiry); }, "PEXPIRETIME");
            record->resolve(at.integer);
        }
        return record;
    }

    /// Empty when the server's clock is used (the scripts read TIME themselves).
    [[nodiscard]] std::string now_arg() const {
        return options_.clock ? std::to_string(to_unix_ms(options_.clock())) : std::string();
    }

    std::int64_t server_now_ms() {
        redis::Reply reply =
            with_connection([](redis::Connection& c) { return c.checked({"TIME"}, "TIME"); });
        if (reply.elements.size() != 2) throw store_error("idem: Redis TIME gave no time");
        return redis::parse_int(reply.elements[0].str) * 1000 +
               redis::parse_int(reply.elements[1].str) / 1000;
    }

    std::vector<std::string> scan(const std::string& pattern) {
        std::vector<std::string> keys;
        router_.on_each_master([&](redis::Connection& c) {  // every master of a cluster
            std::string cursor = "0";
            do {
                redis::Reply reply =
                    c.checked({"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"}, "SCAN");
                if (reply.elements.size() != 2)
                    throw store_error("idem: Redis SCAN: unexpected reply");
                cursor = reply.elements[0].str;
                for (auto& key : reply.elements[1].elements)
                    keys.push_back(std::move(key.str));
            } while (cursor != "0");
            return 0;
        });
        std::sort(keys.begin(), keys.end());  // SCAN may return a key twice
        keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
        return keys;
    }

    /// @p script over @p keys, 256 keys a call, with @p args: one call per batch on a standalone
    /// server; on a cluster the keys are batched per hash slot and the calls pipelined per node.
    std::vector<redis::Reply> run_in_batches(const redis::Script& script,
                                             std::vector<std::string> keys,
                                             const std::vector<std::string>& args) {
        std::vector<redis::Reply> replies;
        if (!router_.is_cluster()) {
            for (const auto& batch : batches(std::move(keys))) {
                replies.push_back(with_connection(
                    [&](redis::Connection& c) { return c.eval(script, batch, args); }));
            }
            return replies;
        }
        std::vector<redis::SlotCall> calls;
        for (const auto& [slot, group] : by_slot(keys)) {
            for (const auto& batch : batches(group)) {
                redis::SlotCall call;
                call.slot = slot;
                call.num_keys = batch.size();
                for (const auto& key : batch)
                    call.keys_then_args.add(key);
                for (const auto& arg : args)
                    call.keys_then_args.add(arg);
                calls.push_back(std::move(call));
            }
        }
        return router_.eval_each(script, calls);
    }

    /// @p keys grouped by hash slot, in slot order.
    static std::map<std::uint16_t, std::vector<std::string>> by_slot(
        const std::vector<std::string>& keys) {
        std::map<std::uint16_t, std::vector<std::string>> out;
        for (const auto& key : keys)
            out[redis::hash_slot(key)].push_back(key);
        return out;
    }

    /// One command on @p key's slot; an error reply throws store_error naming @p what.
    template <class Fn>
    redis::Reply checked_on(std::string_view key, Fn&& fn, std::string_view what) {
        redis::Reply reply = router_.on_key(key, std::forward<Fn>(fn));
        if (reply.is_error()) {
            throw store_error(fmt::format("idem: Redis {} failed on {}: {}", what,
                                          router_.master_of(redis::hash_slot(key)).describe(),
                                          reply.str));
        }
        return reply;
    }

    static std::vector<std::vector<std::string>> batches(std::vector<std::string> keys) {
        std::vector<std::vector<std::string>> out;
        constexpr std::size_t size = 256;
        for (std::size_t i = 0; i < keys.size(); i += size) {
            out.emplace_back(
                std::make_move_iterator(keys.begin() + static_cast<std::ptrdiff_t>(i)),
                std::make_move_iterator(
                    keys.begin() + static_cast<std::ptrdiff_t>(std::min(keys.size(), i + size))));
        }
        return out;
    }

    void check_script(const redis::Reply& reply, const char* what) const {
        if (reply.is_error()) {
            throw store_error(fmt::format("idem: Redis {} script failed on {}: {}", what,
                                          endpoint().describe(), reply.str));
        }
    }

    /// Reads `INFO persistence` (and `CONFIG GET appendfsync` when CONFIG answers) once per
    /// store; refuses a server without AOF.
    void check_persistence(redis::Connection& connection) {
        RedisPersistence found;
        const redis::Reply info = connection.command({"INFO", "persistence"});
        if (info.is_error() || info.type != redis::Reply::Type::string) {
            throw usage_error(fmt::format(
                "idem::RedisStore: cannot tell whether Redis at {} persists claims (INFO "
                "persistence: {}); enable AOF (appendonly yes) and allow INFO, or set "
                "RedisOptions::accept_no_persistence to run without it and accept that a "
                "restart re-runs effects",
                endpoint().describe(), info.is_error() ? info.str : "no answer"));
        }
        // While it replays its AOF after a restart (or loads its master's data), Redis answers
        // INFO with loading:1 and aof_enabled:0: AOF is off during the load whatever the
        // configuration says. Not an answer yet: unavailable for now, checked on the next use.
        if (info.str.find("loading:1") != std::string::npos) {
            throw store_unavailable(fmt::format(
                "idem: Redis at {} is loading its data set (INFO persistence: loading:1); its "
                "persistence is checked once it is done",
                endpoint().describe()));
        }
        found.aof_enabled = info.str.find("aof_enabled:1") != std::string::npos;
        const redis::Reply config = connection.command({"CONFIG", "GET", "appendfsync"});
        if (config.is_array() && config.elements.size() == 2) {
            found.appendfsync = config.elements[1].str;
        }
        {
            std::lock_guard<std::mutex> lock(persistence_mutex_);
            persistence_ = found;
        }
        if (!found.aof_enabled) {
            throw usage_error(fmt::format(
                "idem::RedisStore: Redis at {} has no append-only file (aof_enabled:0): a restart "
                "would lose the claims written since the last snapshot and redeliveries would run "
                "those effects again. Enable AOF (appendonly yes, appendfsync always or everysec), "
                "or set RedisOptions::accept_no_persistence to accept the risk",
                endpoint().describe()));
        }
    }

    RedisOptions options_;
    redis::KeyLayout keys_;
    redis::Router router_;  ///< connections to the server, or to each master of a cluster
    mutable std::mutex persistence_mutex_;
    std::optional<RedisPersistence> persistence_;
    std::atomic<bool> claim_with_set_{true};
};

/// @brief One handler run's claims and queued writes; frees its leases in its destructor unless
/// committed. Never throws from the destructor.
class RedisStore::Transaction {
  public:
    Transaction(Transaction&& other) noexcept
        : store_(std::exchange(other.store_, nullptr)),
          token_(std::move(other.token_)),
          lease_(other.lease_),
          retention_(other.retention_),
          claims_(std::move(other.claims_)),
          letters_(std::move(other.letters_)),
          commands_(std::move(other.commands_)),
          command_count_(other.command_count_),
          savepoints_(std::move(other.savepoints_)),
          locks_(std::move(other.locks_)),
          released_(std::move(other.released_)),
          unstarted_(std::move(other.unstarted_)),
          hooks_(std::move(other.hooks_)),
          write_places_(std::move(other.write_places_)) {}
    Transaction& operator=(Transaction&&) = delete;
    Transaction(const Transaction&) = delete;
    Transaction& operator=(const Transaction&) = delete;
    ~Transaction() { rollback(); }

    /// @brief The handler passes its policy's lease and retention before claiming.
    void set_terms(const ClaimTerms& terms) {
        active();
        lease_ = terms.lease.value_or(store_->options_.lease);
        if (terms.retention.count() > 0) retention_ = terms.retention;
    }

    /// @brief One round trip (two for an id another worker holds or released). For a claim:
    /// ClaimResult::attempts is how many times the effect started (this time included), which
    /// the handler's poison check uses.
    ClaimResult claim(std::string_view scope, std::string_view id,
                      std::string_view fingerprint = {}) {
        active();
        if (auto own = own_claim(scope, id)) return *own;
        std::vector<ClaimResult> results =
            claim_all(scope, &id, 1, fingerprint.empty() ? nullptr : &fingerprint);
        return results.front();
    }

    /// @brief Claims many ids of one scope in ONE round trip (pipelined SETs; one more for the
    /// ids other workers hold or released, together); results in order. An id repeated in @p ids is
    /// a duplicate of its first copy. @p fingerprints is empty or one per id. Used by
    /// IdempotentHandler::handle_batch. On a Redis Cluster the SETs are pipelined per node (one
    /// round trip per node, not per id) and the contested ids' scripts per hash slot.
    std::vector<ClaimResult> claim_many(std::string_view scope,
                                        const std::vector<std::string_view>& ids,
                                        const std::vector<std::string>& fingerprints = {}) {
        active();
        if (!fingerprints.empty() && fingerprints.size() != ids.size()) {
            throw usage_error("idem::RedisStore: claim_many() needs one fingerprint per id");
        }
        if (ids.empty()) return {};
        std::vector<std::string_view> fps(fingerprints.begin(), fingerprints.end());
        return claim_all(scope, ids.data(), ids.size(), fps.empty() ? nullptr : fps.data());
    }

    /// @brief Gives back a claim this transaction holds without completing it (a batch message
    /// that failed): its lease is freed by the commit, or by the rollback.
    void unclaim(std::string_view scope, std::string_view id) {
        active();
        const std::size_t index = find_held(scope, id);
        if (index == claims_.size()) return;
        released_.push_back(claims_[index].key);
        claims_.erase(claims_.begin() + static_cast<std::ptrdiff_t>(index));
        for (auto& mark : savepoints_)
            mark.claims = std::min(mark.claims, claims_.size());
    }

    void record_outcome(std::string_view scope, std::string_view id, Disposition disposition,
                        std::string_view reason) {
        active();
        const std::size_t index = find_held(scope, id);
        if (index < claims_.size()) {
            claims_[index].outcome = to_string(disposition);
            claims_[index].reason = std::string(reason);
            return;
        }
        throw usage_error(
            "idem::RedisStore: record_outcome() for a claim this transaction does not hold");
    }

    void dead_letter(const DeadLetter& letter) {
        active();
        letters_.push_back(letter);
    }

    /// @brief Queues a Redis write (binary-safe arguments: text, idem::Blob, integers) that runs
    /// at commit, atomically with the completion, and only if every lease is still ours.
    /// Redis cannot undo a command that fails inside the commit: keep these to commands that
    /// cannot fail on keys of the right type (SET, HSET, HINCRBY, SADD, XADD, ...).
    template <class... Args>
    void write(const Args&... args) {
        active();
        static_assert(sizeof...(Args) > 0, "idem: write() needs a command");
        // Encoded now, as the commit script reads it: argc, then the arguments.
        commands_.add(sizeof...(Args));
        (commands_.add(args), ...);
        ++command_count_;
        if (store_->router_
                .known_cluster()) {  // where it goes: its key's slot (the first argument)
            std::string key;
            if constexpr (sizeof...(Args) > 1) key = redis::to_arg(std::get<1>(std::tie(args...)));
            write_places_.push_back(
                WritePlace{commands_.mark(), redis::hash_slot(key), current_owner()});
        }
    }

    /// @brief Runs a read now, outside the transaction (it does not see this transaction's
    /// queued writes). An error reply throws store_error.
    template <class... Args>
    redis::Reply read(const Args&... args) {
        active();
        redis::Args command;
        (command.add(args), ...);
        if constexpr (sizeof...(Args) > 1) {
            if (store_->router_.is_cluster()) {  // routed by its key, the first argument
                const std::string key = redis::to_arg(std::get<1>(std::tie(args...)));
                return store_->checked_on(
                    key, [&](redis::Connection& c) { return c.command(command); }, "read");
            }
        }
        return store_->with_connection(
            [&](redis::Connection& c) { return c.checked(command, "read"); });
    }

    /// @brief Acks a stream entry in the commit (when stream and claims share a server).
    void ack_on_commit(std::string_view stream, std::string_view group, std::string_view entry) {
        write("XACK", stream, group, entry);
    }

    /// @brief The commit-hook capability (idem/contract/commit_hook.hpp; the handler calls it
    /// right after begin()): true when @p hook is a stream ack (redis::StreamAck) on this
    /// store's server and database. Its commit then XACKs the entry of each hook whose message
    /// it completes (processed, rejected, dead_lettered; a dead letter is first added to the
    /// hook's dead-letter stream), in the commit script — no extra round trip — and sets
    /// CommitHook::acked_in_commit. False, and nothing changes, for any other hook: the broker
    /// acks after the commit. @p hook must outlive the transaction.
    bool attach(CommitHook& hook) {
        active();
        hook.acked_in_commit = false;
        if (!store_->accepts_commit_hook(hook)) return false;
        hooks_.push_back(&hook);
        return true;
    }

    void savepoint() {
        active();
        savepoints_.push_back(
            Mark{commands_.mark(), command_count_, letters_.size(), claims_.size()});
    }
    /// @brief Drops the writes and dead letters queued since the latest savepoint, and frees the
    /// leases claimed since then (one round trip, only if there are any): a batch message that
    /// failed leaves nothing, not even its claim.
    void rollback_to_savepoint() {
        active();
        if (savepoints_.empty())
            throw usage_error("idem::RedisStore: no savepoint to roll back to");
        const Mark mark = savepoints_.back();
        savepoints_.pop_back();
        commands_.truncate(mark.commands);
        command_count_ = mark.command_count;
        if (write_places_.size() > command_count_) write_places_.resize(command_count_);
        letters_.resize(mark.letters);
        if (claims_.size() > mark.claims) {
            std::vector<std::string> keys;
            for (std::size_t i = mark.claims; i < claims_.size(); ++i)
                keys.push_back(claims_[i].key);
            claims_.resize(mark.claims);
            for (const redis::Reply& reply : release(keys))
                store_->check_script(reply, "release");
        }
    }
    void release_savepoint() {
        active();
        if (savepoints_.empty()) throw usage_error("idem::RedisStore: no savepoint to release");
        savepoints_.pop_back();
    }

    /// @brief Overlap lock held until the transaction ends; false when another holder has it.
    bool try_lock(std::string_view key, std::chrono::milliseconds expire_after) {
        active();
        if (!store_->hold_lock(key, token_, expire_after)) return false;
        locks_.emplace_back(key);
        return true;
    }

    /// @brief One round trip: checks the leases, applies the queued writes, stores dead letters
    /// and marks the claims done (each keeps the expiry its claim set: the retention).
    /// @throws commit_failed when a lease was lost (nothing written) or a write failed;
    /// store_unavailable / store_timeout when Redis could not be reached (outcome unknown: the
    /// lease then expires, or the commit did happen and a redelivery is a duplicate).
    ///
    /// On a Redis Cluster the script runs once per hash slot of the transaction's claims (each
    /// with its claims' dead letters, its freed leases and the writes whose key is in that
    /// slot), pipelined per node: atomic per slot, not across slots. Writes to other slots run
    /// after, once their message's claim committed (at most once, not atomically with it). When
    /// some slot groups commit and others do not, throws partial_commit naming what committed.
    void commit() {
        active();
        if (store_->router_.is_cluster()) {
            commit_per_slot();
            return;
        }
        PreparedCommit prepared = prepare_commit();
        CommitReplies replies = commit_round_trip(prepared);
        settle_commit(replies.commit, prepared.acked_hooks, replies.replicas);
    }

    /// @brief Frees this transaction's leases and locks. A no-op after commit. Never throws:
    /// if Redis is unreachable the leases simply expire.
    void rollback() noexcept {
        if (store_ == nullptr) return;
        try {
            if (!unstarted_.empty()) (void)release_unstarted(unstarted_);
        } catch (...) {  // unreachable: the lease expires on its own, the attempt stays counted
        }
        try {
            if (!claims_.empty() || !released_.empty()) {
                std::vector<std::string> keys = released_;
                for (const auto& held : claims_)
                    keys.push_back(held.key);
                (void)release(keys);
            }
        } catch (...) {  // unreachable: the lease expires on its own
        }
        finish();
    }

    /// @brief The claim-and-commit capability (idem/contract/store.hpp), for a local effect
    /// (idem::local_effect) that already ran on this transaction with no claim held: ONE round
    /// trip, one script, that claims @p request's id and, only if it is new (or its claim was
    /// released or its lease expired), applies the queued writes and the attached hooks' XACKs
    /// and records the claim done with the outcome; otherwise it applies nothing and answers
    /// duplicate or in_progress (with the lease's time left), or at_limit when a takeover would
    /// reach request.max_attempts. An unset outcome (the effect threw) counts the attempt and
    /// leaves the id free. Ends the transaction. Only on a transaction that holds nothing yet.
    /// @throws commit_failed when a queued write failed (as commit()); store_unavailable /
    /// store_timeout when Redis could not be reached (outcome unknown: a redelivery finds it).
    ClaimAndCommitResult claim_and_commit(const ClaimAndCommit& request) {
        active();
        if (!claims_.empty() || !letters_.empty() || !released_.empty()) {
            throw usage_error(
                "idem::RedisStore: claim_and_commit() on a transaction that already holds claims "
                "or dead letters");
        }
        const std::string key = store_->claim_key(request.scope, request.message_id);
        // On a Redis Cluster the script runs on the claim's slot: only when every write is there
        // too. Otherwise nothing is sent and the handler takes the ordinary path.
        const bool cluster = store_->router_.is_cluster();
        if (cluster && !shares_slot_with_writes(redis::hash_slot(key))) {
            finish();
            ClaimAndCommitResult result;
            result.status = ClaimAndCommitStatus::not_attempted;
            return result;
        }
        const std::string_view outcome =
            request.outcome ? to_string(*request.outcome) : std::string_view();
        // The hooks' acks, for the outcome this call records (none for a failed effect).
        Commands acks;
        std::vector<CommitHook*> acked_hooks;
        if (request.outcome && !hooks_.empty()) {
            claims_.push_back(Claim{std::string(request.scope), std::string(request.message_id),
                                    key, std::string(request.fingerprint), outcome,
                                    std::string(request.reason)});
            acked_hooks = hook_commands(acks);
            claims_.clear();  // no lease is held: nothing to release
        }
        // A new id's record, whole (layout: record.hpp): attempt 1, claimed now — the server's
        // now as "the expiry minus the retention" when the store reads no clock of its own.
        const std::string fields =
            redis::Record::fields(request.fingerprint, request.scope, request.message_id);
        const std::string now = store_->now_arg();
        const std::string stamp = now.empty() ? '~' + std::to_string(retention_ms()) : now;
        std::string new_record =
            request.outcome ? "done||" + std::string(outcome) + '|' : std::string("free|||");
        new_record.append("1|").append(stamp).append("|").append(stamp).append("|");
        new_record.append(std::to_string(lease_.count())).append("|").append(fields);
        if (request.outcome) new_record.append(request.reason);
        redis::Args call;
        call.reserve(256 + 2 * fields.size() + commands_.resp().size() + acks.args.resp().size());
        call.add(key).add(store_->dead_letter_key(request.scope, request.message_id));
        call.add(now)
            .add(retention_ms())
            .add(lease_.count())
            .add(request.max_attempts)
            .add(outcome)
            .add(request.reason)
            .add(fields)
            .add(new_record)
            .add(command_count_ + acks.count)
            .append(commands_)
            .append(acks.args);
        // With replicas_to_ack, a mark then WAIT follow in the same round trip: they confirm a
        // commit and, when the script wrote nothing, the duplicate's record (confirm_duplicates()).
        const std::optional<redis::Args> wait = wait_command();
        redis::Args mark;
        if (wait) {
            mark.add("SET")
                .add(store_->keys_.replication_mark(request.scope, request.message_id))
                .add("1")
                .add("PX")
                .add(1000);
        }
        std::optional<redis::Reply> replicas;
        auto run = [&](redis::Connection& c) {
            if (!wait) return c.eval(redis::claim_commit_script(), 2, call);
            std::vector<redis::Reply> replies =
                c.eval_then(redis::claim_commit_script(), 2, call,
                            {redis::ThenCommand{&mark, redis::AfterNoscript::resend},
                             redis::ThenCommand{&*wait, redis::AfterNoscript::resend}});
            replicas = std::move(replies.at(2));
            return std::move(replies.at(0));
        };
        redis::Reply reply =
            cluster ? store_->router_.on_key(key, run) : store_->with_connection(run);
        // What the master answered counts only once its replicas have it (committed, duplicate).
        // Worded now: finish() ends the transaction (store_ is null after it).
        const bool replicated = !replicas || confirmed(*replicas);
        const std::string unconfirmed_commit = replicated ? "" : unconfirmed_text(*replicas);
        const std::string unconfirmed_duplicate =
            replicated ? ""
                       : unconfirmed_text(*replicas, "the record a duplicate rests on", "has it");
        auto confirm = [&](const std::string& unconfirmed) {
            if (!replicated) throw commit_unconfirmed(unconfirmed);
        };
        RedisStore* const store = store_;
        finish();
        store->check_script(reply, "claim and commit");
        ClaimAndCommitResult result;
        if (reply.type == redis::Reply::Type::string && reply.str == "ok") {
            confirm(unconfirmed_commit);
            result.status = ClaimAndCommitStatus::committed;
            result.claim.attempts = 1;
            for (CommitHook* hook : acked_hooks)
                hook->acked_in_commit = true;
            return result;
        }
        const std::string status = reply.elements.empty() ? std::string() : reply.elements[0].str;
        if (status == "command_failed" || status == "partial") {
            const std::string detail =
                reply.elements.size() > 2 ? reply.elements[2].str : "unknown reply";
            if (status == "partial") {
                throw commit_failed(detail +
                                    "; the claim is parked as a dead letter so a redelivery does "
                                    "not apply them twice");
            }
            throw commit_failed(fmt::format(
                "a Redis write of the commit failed before anything was applied: {}; the attempt "
                "is counted and the id stays free",
                detail));
        }
        if (reply.elements.size() != 4) {
            throw store_error("idem: Redis claim-and-commit script: unexpected reply");
        }
        result.claim.fingerprint = std::move(reply.elements[2].str);
        result.claim.attempts = static_cast<std::uint32_t>(redis::parse_int(reply.elements[3].str));
        if (status == "duplicate") {
            confirm(unconfirmed_duplicate);
            result.status = ClaimAndCommitStatus::duplicate;
            result.claim.status = ClaimStatus::duplicate;
            result.claim.recorded = disposition_from(reply.elements[1].str);
        } else if (status == "in_progress") {
            result.status = ClaimAndCommitStatus::in_progress;
            result.claim.status = ClaimStatus::in_progress;
            result.claim.retry_after =
                std::chrono::milliseconds(redis::parse_int(reply.elements[1].str));
        } else if (status == "limit") {
            result.status = ClaimAndCommitStatus::at_limit;
        } else if (status == "committed") {
            confirm(unconfirmed_commit);
            result.status = ClaimAndCommitStatus::committed;
            for (CommitHook* hook : acked_hooks)
                hook->acked_in_commit = true;
        } else {
            throw store_error("idem: Redis claim-and-commit script: unexpected reply " + status);
        }
        return result;
    }

    /// @brief The commit-with-next-claim capability (idem/contract/store.hpp; used by
    /// idem::PipelinedLoop): this transaction's commit and @p next's claim of (scope, id) in
    /// ONE round trip (the commit script and the claim's `SET … NX PX … GET`, pipelined). The
    /// commit's fate is in the result (commit_error null: committed; else this transaction is
    /// rolled back, as a failed commit() leaves it); @p next's claim is answered as claim()
    /// would, whatever the commit's fate: a refused commit leaves the fresh lease in place (a
    /// different id). An id another worker holds or released needs the claim script: one more
    /// round trip, as claim(). Without SET claims (a server before 7.0) the commit and the
    /// claim go one after the other.
    /// @throws store_unavailable / store_timeout when the round trip failed: both outcomes are
    /// unknown (the commit may have happened). The claim's lease, if it was taken, is released
    /// when @p next rolls back, and the attempt it counted is taken back: its effect never
    /// started. A failure after the commit's reply (the claim script for an id another worker
    /// holds) is not thrown but given in the result's next_error, beside the commit's fate.
    CommitAndClaimResult commit_with_next_claim(Transaction& next, std::string_view scope,
                                                std::string_view id,
                                                std::string_view fingerprint = {}) {
        active();
        next.active();
        CommitAndClaimResult result;
        auto one_after_the_other = [&] {
            try {
                commit();
            } catch (const store_error&) {
                result.commit_error = std::current_exception();
            }
            try {
                result.next = next.claim(scope, id, fingerprint);
            } catch (const store_error&) {  // after the commit: its fate stays in the result
                result.next_error = std::current_exception();
            }
            return result;
        };
        if (next.store_ != store_ || !store_->claim_with_set_.load(std::memory_order_relaxed) ||
            next.find_held(scope, id) < next.claims_.size()) {
            return one_after_the_other();
        }
        std::vector<Claim> held{Claim{std::string(scope),
                                      std::string(id),
                                      store_->claim_key(scope, id),
                                      std::string(fingerprint),
                                      {},
                                      {}}};
        // On a Redis Cluster one round trip reaches one node: only when every key of the commit
        // and the next claim's key share a hash slot; otherwise two round trips, as without it.
        const bool cluster = store_->router_.is_cluster();
        const std::uint16_t slot = redis::hash_slot(held.front().key);
        if (cluster && !(hooks_.empty() && commit_keys_in(slot) && shares_slot_with_writes(slot))) {
            return one_after_the_other();
        }
        PreparedCommit prepared = prepare_commit();
        const std::vector<redis::Args> sets = next.set_claims(held);
        // Until its answer is read, next may hold a lease whose effect has not started: its
        // rollback releases it (by its token) and takes the attempt back.
        next.unstarted_.push_back(held.front().key);
        CommitReplies replies;
        if (cluster) {
            // Followed where the slot's redirects say. A redirected commit ran nothing, but the
            // claim's SET may have run where the script was refused (TRYAGAIN during a
            // migration): its first real answer is kept, as eval_then() keeps it after NOSCRIPT.
            std::optional<redis::Reply> claim_answer;
            replies.commit = store_->router_.on_slot(slot, [&](redis::Connection& c) {
                replies = commit_round_trip(c, prepared, sets);
                if (!claim_answer && !replies.next_claims.front().is_error()) {
                    claim_answer = replies.next_claims.front();
                }
                return replies.commit;
            });
            if (claim_answer) replies.next_claims.front() = std::move(*claim_answer);
        } else {
            replies = store_->with_connection(
                [&](redis::Connection& c) { return commit_round_trip(c, prepared, sets); });
        }
        try {
            settle_commit(replies.commit, prepared.acked_hooks, replies.replicas);
        } catch (const store_error&) {
            result.commit_error = std::current_exception();
        }
        std::vector<ClaimResult> results(1);
        std::vector<std::size_t> contested;
        try {
            if (!next.read_set_claims(held, replies.next_claims, results, 0, contested) ||
                !contested.empty()) {
                result.next = next.claim(scope, id, fingerprint);  // the SET wrote nothing
            } else {
                next.confirm_duplicates(held, results);
                result.next = std::move(results.front());
            }
        } catch (const store_error&) {  // the commit's fate is known: it stays in the result
            result.next_error = std::current_exception();
            return result;
        }
        next.unstarted_.clear();  // answered: a claim now held is in claims_
        return result;
    }

    /// @brief The hash tag (`{scope:id}`) of the claim whose effect is running; empty when there
    /// is none. Append it to the effect's own keys (`"captures:42" + tx.claim_tag()`) and they
    /// share the claim's Cluster slot, so the commit writes them atomically with the claim.
    [[nodiscard]] std::string claim_tag() const {
        const std::string owner = current_owner();
        const std::size_t open = owner.find('{');
        const std::size_t close = owner.find('}', open);
        if (open == std::string::npos || close == std::string::npos) return {};
        return owner.substr(open, close - open + 1);
    }

    /// @brief The token fencing this transaction's leases (for logs and tests).
    [[nodiscard]] const std::string& token() const noexcept { return token_; }
    [[nodiscard]] RedisStore& store() noexcept { return *store_; }

  private:
    friend class RedisStore;

    struct Claim {
        std::string scope;
        std::string id;
        std::string key;
        std::string fingerprint;
        std::string_view outcome;  ///< a Disposition's name (static text); empty: none yet
        std::string reason;
    };
    struct Mark {
        redis::Args::Mark commands;
        std::size_t command_count;
        std::size_t letters;
        std::size_t claims;
    };
    /// Commands for the commit script, each as {argc, args...}.
    struct Commands {
        redis::Args args;
        std::size_t count = 0;
        void add(const std::vector<std::string>& command) {
            args.add(command.size());
            for (const auto& arg : command)
                args.add(arg);
            ++count;
        }
        void add(std::initializer_list<std::string_view> command) {
            args.add(command.size());
            for (std::string_view arg : command)
                args.add(arg);
            ++count;
        }
    };

    /// One hash slot's share of a cluster commit: one complete-script call.
    struct SlotGroup {
        std::vector<std::size_t> claims;   ///< into claims_
        std::vector<std::size_t> letters;  ///< into letters_
        std::vector<const std::string*> released;
        Commands commands;
    };
    /// Where a queued write goes on a cluster: its key's slot, and the claim of its message.
    struct WritePlace {
        redis::Args::Mark end;  ///< where its encoding ends in commands_
        std::uint16_t slot;
        std::string owner;  ///< the claim key of the message it was queued for; empty: none
    };
    /// A queued write outside its claim's slot (run after the claims committed).
    struct LaterWrite {
        std::uint16_t slot;
        const std::string* owner;  ///< the claim key of its message; null: none
        std::string_view resp;     ///< {argc, args...} as encoded in commands_
        std::size_t count;
    };

    /// The complete script's call for @p group (layout at complete_source()).
    redis::SlotCall completion_call(std::uint16_t slot, const SlotGroup& group) const {
        redis::SlotCall call;
        call.slot = slot;
        redis::Args& a = call.keys_then_args;
        for (std::size_t i : group.claims)
            a.add(claims_[i].key);
        for (std::size_t d : group.letters)
            a.add(store_->dead_letter_key(letters_[d].scope, letters_[d].message_id));
        for (const std::string* key : group.released)
            a.add(*key);
        call.num_keys = a.count();
        a.add(store_->now_arg()).add(token_).add(group.claims.size());
        for (std::size_t i : group.claims) {
            const Claim& held = claims_[i];
            a.add(held.outcome.empty() ? std::string_view("in_progress") : held.outcome)
                .add(held.reason);
        }
        a.add(group.letters.size());
        for (std::size_t d : group.letters) {
            const DeadLetter& letter = letters_[d];
            a.add(letter.scope)
                .add(letter.message_id)
                .add(letter.delivery_count)
                .add(letter.reason)
                .add(letter.payload);
            if (letter.created_at == std::chrono::system_clock::time_point{}) {
                a.add(std::string_view());
            } else {
                a.add(to_unix_ms(letter.created_at));
            }
        }
        a.add(group.commands.count).append(group.commands.args);
        return call;
    }

    /// Why one slot group's commit reply is not "ok" (empty when it is).
    std::string commit_problem(const redis::Reply& reply, const std::string& unreachable,
                               const SlotGroup& group, bool* parked) const {
        *parked = false;
        if (!unreachable.empty()) return "Redis unreachable, outcome unknown: " + unreachable;
        if (reply.is_error()) return "the commit script failed: " + reply.str;
        if (reply.type == redis::Reply::Type::string && reply.str == "ok") return {};
        const std::string status = reply.elements.empty() ? std::string() : reply.elements[0].str;
        if (status == "lease_lost" && reply.elements.size() > 2) {
            const std::size_t index =
                static_cast<std::size_t>(redis::parse_int(reply.elements[1].str)) - 1;
            const Claim& held = claims_.at(group.claims.at(index));
            return fmt::format(
                "lease lost: the claim on {}/{} expired and another worker took it over ({}); "
                "nothing of its hash slot was written",
                held.scope, held.id,
                reply.elements[2].str == "leased" ? "it holds it now" : reply.elements[2].str);
        }
        if (status == "partial" && reply.elements.size() > 2) {
            *parked = true;
            return reply.elements[2].str +
                   "; the claim is parked as a dead letter so a redelivery does not apply them "
                   "twice";
        }
        return fmt::format("a Redis write of the commit failed before anything was applied: {}",
                           reply.elements.size() > 2 ? reply.elements[2].str : "unknown reply");
    }

    /// commit() on a Redis Cluster: one complete-script call per hash slot, pipelined per node,
    /// then the writes outside their claims' slots; truthful about what committed.
    void commit_per_slot() {
        if (write_places_.size() != command_count_) {
            throw usage_error(
                "idem::RedisStore: on a Redis Cluster, queue writes after the first claim (the "
                "store learns the cluster's slots then)");
        }
        // In the order the transaction first touched each slot: one node's scripts run in that
        // order (dead letters of a batch keep their order on each node).
        std::vector<std::pair<std::uint16_t, SlotGroup>> groups;
        std::unordered_map<std::uint16_t, std::size_t> group_at;
        auto group = [&](std::uint16_t slot) -> SlotGroup& {
            auto [it, added] = group_at.try_emplace(slot, groups.size());
            if (added) groups.emplace_back(slot, SlotGroup{});
            return groups[it->second].second;
        };
        for (std::size_t i = 0; i < claims_.size(); ++i)
            group(redis::hash_slot(claims_[i].key)).claims.push_back(i);
        for (std::size_t d = 0; d < letters_.size(); ++d) {
            const DeadLetter& letter = letters_[d];
            group(redis::hash_slot(store_->dead_letter_key(letter.scope, letter.message_id)))
                .letters.push_back(d);
        }
        for (const std::string& key : released_)
            group(redis::hash_slot(key)).released.push_back(&key);
        std::vector<LaterWrite> later;
        std::size_t start = 0;
        const std::string_view encoded = commands_.resp();
        std::size_t start_count = 0;
        for (const WritePlace& place : write_places_) {
            const std::string_view resp = encoded.substr(start, place.end.bytes - start);
            const std::size_t count = place.end.count - start_count;
            start = place.end.bytes;
            start_count = place.end.count;
            const bool with_owner =
                !place.owner.empty() && redis::hash_slot(place.owner) == place.slot;
            const bool beside_claims = place.owner.empty() && group_at.count(place.slot) != 0;
            if (with_owner || beside_claims) {
                Commands& commands = group(place.slot).commands;
                commands.args.append_encoded(resp, count);
                ++commands.count;
            } else {
                later.push_back(LaterWrite{place.slot, place.owner.empty() ? nullptr : &place.owner,
                                           resp, count});
            }
        }

        std::vector<redis::SlotCall> calls;
        std::vector<const SlotGroup*> called;
        for (const auto& [slot, slot_group] : groups) {
            calls.push_back(completion_call(slot, slot_group));
            called.push_back(&slot_group);
        }
        std::vector<std::string> unreachable;
        // With replicas_to_ack, each node's pipeline ends with WAIT: a group its replicas did not
        // confirm is applied on its master but unconfirmed, and not reported as committed.
        const std::optional<redis::Args> wait = wait_command();
        std::vector<redis::Reply> waited;
        const redis::Args* wait_args = wait ? &*wait : nullptr;
        std::vector<redis::Reply> replies =
            calls.empty() ? std::vector<redis::Reply>{}
                          : store_->router_.eval_each(redis::complete_script(), calls, &unreachable,
                                                      wait_args, &waited);
        bool only_unconfirmed = true;

        std::vector<bool> done(claims_.size(), false);  ///< committed (or parked by the script)
        std::vector<partial_commit::Id> committed;
        std::string first_problem;
        bool only_unreachable = true;
        for (std::size_t g = 0; g < called.size(); ++g) {
            bool parked = false;
            std::string problem = commit_problem(replies[g], unreachable[g], *called[g], &parked);
            if (problem.empty() || parked) {
                for (std::size_t i : called[g]->claims)
                    done[i] = true;
            }
            const bool unconfirmed = problem.empty() && wait && !confirmed(waited[g]);
            if (unconfirmed) problem = unconfirmed_text(waited[g]);
            only_unconfirmed = only_unconfirmed && unconfirmed;
            if (problem.empty()) {
                for (std::size_t i : called[g]->claims)
                    committed.emplace_back(claims_[i].scope, claims_[i].id);
                for (std::size_t d : called[g]->letters)
                    committed.emplace_back(letters_[d].scope, letters_[d].message_id);
                continue;
            }
            if (first_problem.empty()) first_problem = problem;
            only_unreachable = only_unreachable && !unreachable[g].empty();
        }

        // The writes outside their claims' slots, for the messages whose claim committed.
        auto owner_committed = [&](const std::string* owner) {
            if (owner == nullptr) return first_problem.empty();
            for (std::size_t i = 0; i < claims_.size(); ++i) {
                if (claims_[i].key == *owner) return bool(done[i]);
            }
            return false;
        };
        std::map<std::uint16_t, SlotGroup> after;
        std::map<std::uint16_t, std::vector<const std::string*>> owners_of;
        for (const LaterWrite& write : later) {
            if (!owner_committed(write.owner)) continue;
            Commands& commands = after[write.slot].commands;
            commands.args.append_encoded(write.resp, write.count);
            ++commands.count;
            owners_of[write.slot].push_back(write.owner);
        }
        if (!after.empty()) {
            std::vector<redis::SlotCall> later_calls;
            std::vector<std::uint16_t> later_slots;
            for (const auto& [slot, group] : after) {
                later_calls.push_back(completion_call(slot, group));
                later_slots.push_back(slot);
            }
            std::vector<std::string> later_unreachable;
            std::vector<redis::Reply> later_waited;
            std::vector<redis::Reply> later_replies =
                store_->router_.eval_each(redis::complete_script(), later_calls, &later_unreachable,
                                          wait_args, &later_waited);
            for (std::size_t g = 0; g < later_calls.size(); ++g) {
                bool parked = false;
                std::string problem = commit_problem(later_replies[g], later_unreachable[g],
                                                     after[later_slots[g]], &parked);
                if (problem.empty() && wait && !confirmed(later_waited[g])) {
                    problem = unconfirmed_text(later_waited[g]);
                }
                if (problem.empty()) continue;
                only_unconfirmed = false;
                // The claims are done but these writes of their effect are not: say so.
                const std::string text = fmt::format(
                    "the claim committed but its writes outside the claim's hash slot did not "
                    "({}); they are not retried",
                    problem);
                if (first_problem.empty()) first_problem = text;
                only_unreachable = false;
                for (const std::string* owner : owners_of[later_slots[g]]) {
                    for (std::size_t i = 0; i < claims_.size(); ++i) {
                        if (owner == nullptr || claims_[i].key != *owner) continue;
                        committed.erase(
                            std::remove(committed.begin(), committed.end(),
                                        partial_commit::Id{claims_[i].scope, claims_[i].id}),
                            committed.end());
                    }
                }
            }
        }

        if (first_problem.empty()) {
            claims_.clear();  // done: nothing left to release
            released_.clear();
            finish();
            return;
        }
        // What committed or was parked is not ours to release any more; the rest is freed.
        std::vector<Claim> left;
        for (std::size_t i = 0; i < claims_.size(); ++i) {
            if (!done[i]) left.push_back(std::move(claims_[i]));
        }
        claims_ = std::move(left);
        rollback();
        if (!committed.empty()) {
            throw partial_commit(
                fmt::format("only part of the transaction committed on the Redis Cluster "
                            "({} of its messages): {}",
                            committed.size(), first_problem),
                std::move(committed));
        }
        if (only_unreachable) throw store_unavailable("idem: Redis commit: " + first_problem);
        if (wait && only_unconfirmed) throw commit_unconfirmed(first_problem);
        throw commit_failed(first_problem);
    }

    /// Whether every write queued so far has its key in @p slot (on a cluster; a write queued
    /// before the store knew it is on a cluster has no known slot: false).
    [[nodiscard]] bool shares_slot_with_writes(std::uint16_t slot) const {
        if (write_places_.size() != command_count_) return false;
        for (const WritePlace& place : write_places_) {
            if (place.slot != slot) return false;
        }
        return true;
    }
    /// Whether every key the commit script touches (claims, dead letters, freed leases) is in
    /// @p slot.
    [[nodiscard]] bool commit_keys_in(std::uint16_t slot) const {
        for (const Claim& held : claims_) {
            if (redis::hash_slot(held.key) != slot) return false;
        }
        for (const DeadLetter& letter : letters_) {
            if (redis::hash_slot(store_->dead_letter_key(letter.scope, letter.message_id)) != slot)
                return false;
        }
        for (const std::string& key : released_) {
            if (redis::hash_slot(key) != slot) return false;
        }
        return true;
    }

    /// The claim key of the message whose effect is running: the first claim held without an
    /// outcome (claims are recorded in order); empty when there is none.
    std::string current_owner() const {
        for (const Claim& held : claims_) {
            if (held.outcome.empty()) return held.key;
        }
        return {};
    }

    /// The commit script's call (KEYS, then ARGV: layout at complete_source()), encoded once,
    /// and the attached hooks it acks.
    struct PreparedCommit {
        redis::Args call;
        std::size_t num_keys = 0;
        std::vector<CommitHook*> acked_hooks;
    };
    PreparedCommit prepare_commit() {
        PreparedCommit prepared;
        redis::Args& call = prepared.call;
        call.reserve(256 + 96 * claims_.size() + commands_.resp().size());
        for (const auto& held : claims_)
            call.add(held.key);
        for (const auto& letter : letters_)
            call.add(store_->dead_letter_key(letter.scope, letter.message_id));
        for (const auto& key : released_)
            call.add(key);
        prepared.num_keys = call.count();

        call.add(store_->now_arg()).add(token_).add(claims_.size());
        for (const auto& held : claims_) {
            call.add(held.outcome.empty() ? std::string_view("in_progress") : held.outcome)
                .add(held.reason);
        }
        call.add(letters_.size());
        for (const auto& letter : letters_) {
            call.add(letter.scope)
                .add(letter.message_id)
                .add(letter.delivery_count)
                .add(letter.reason)
                .add(letter.payload);
            if (letter.created_at == std::chrono::system_clock::time_point{}) {
                call.add(std::string_view());
            } else {
                call.add(to_unix_ms(letter.created_at));
            }
        }
        // The attached stream acks (and dead-letter stream entries) run after the effect's
        // writes.
        Commands acks;
        if (!hooks_.empty()) prepared.acked_hooks = hook_commands(acks);
        call.add(command_count_ + acks.count).append(commands_).append(acks.args);

        return prepared;
    }
    /// Reads the commit script's reply (and WAIT's, @p replicas, with replicas_to_ack): done;
    /// or rolled back and commit_failed thrown; or applied but unconfirmed, commit_unconfirmed
    /// thrown (confirm_replicated()).
    void settle_commit(const redis::Reply& reply, const std::vector<CommitHook*>& acked_hooks,
                       const std::optional<redis::Reply>& replicas) {
        store_->check_script(reply, "commit");
        if (reply.type == redis::Reply::Type::string && reply.str == "ok") {
            if (replicas) confirm_replicated(*replicas);
            for (CommitHook* hook : acked_hooks)
                hook->acked_in_commit = true;
            claims_.clear();  // done: nothing left to release
            released_.clear();
            finish();
            return;
        }
        const std::string status = reply.elements.empty() ? std::string() : reply.elements[0].str;
        if (status == "lease_lost") {
            const std::size_t index =
                static_cast<std::size_t>(redis::parse_int(reply.elements.at(1).str)) - 1;
            const auto& held = claims_.at(index);
            std::string message = fmt::format(
                "lease lost: the claim on {}/{} expired and another worker took it over ({}); "
                "nothing was written",
                held.scope, held.id,
                reply.elements.at(2).str == "leased" ? "it holds it now"
                                                     : reply.elements.at(2).str);
            rollback();
            throw commit_failed(message);
        }
        if (status == "partial") {
            claims_.clear();  // parked by the script: not ours to release any more
            std::string message = reply.elements.at(2).str;
            rollback();
            throw commit_failed(message +
                                "; the claim is parked as a dead letter so a "
                                "redelivery does not apply them twice");
        }
        std::string detail = reply.elements.size() > 2 ? reply.elements[2].str : "unknown reply";
        rollback();
        throw commit_failed(fmt::format(
            "a Redis write of the commit failed before anything was applied: {}", detail));
    }

    /// The index of the claim held on (scope, id), or claims_.size(). Starts after the last one
    /// found: a batch records its outcomes in claim order, so each search is one step, not a
    /// scan (which made a batch of N cost N * N / 2 comparisons).
    std::size_t find_held(std::string_view scope, std::string_view id) const {
        const std::size_t n = claims_.size();
        for (std::size_t k = 0; k < n; ++k) {
            const std::size_t i = (last_found_ + 1 + k) % n;
            if (claims_[i].id == id && claims_[i].scope == scope) {
                last_found_ = i;
                return i;
            }
        }
        return n;
    }

    /// A claim this transaction already holds is a duplicate, still in progress.
    std::optional<ClaimResult> own_claim(std::string_view scope, std::string_view id) const {
        const std::size_t index = find_held(scope, id);
        if (index == claims_.size()) return std::nullopt;
        ClaimResult own;
        own.status = ClaimStatus::duplicate;
        own.recorded = Disposition::in_progress;
        own.fingerprint = claims_[index].fingerprint;
        return own;
    }

    /// Claims @p count ids in one round trip: a pipelined `SET … NX PX … GET` per id, which
    /// claims a new id outright and otherwise returns its record without writing. A finished id
    /// is then a duplicate, a second copy of an id of this call is this transaction's own; only
    /// the rest (leased by another worker, or released) go through the claim script, in one more
    /// round trip. Without SET claims (option off, or a server before 7.0) every id goes through
    /// the script. @p fingerprints is null or one per id.
    std::vector<ClaimResult> claim_all(std::string_view scope, const std::string_view* ids,
                                       std::size_t count, const std::string_view* fingerprints) {
        std::vector<Claim> held;
        held.reserve(count);
        for (std::size_t i = 0; i < count; ++i) {
            held.push_back(
                Claim{std::string(scope),
                      std::string(ids[i]),
                      store_->claim_key(scope, ids[i]),
                      fingerprints != nullptr ? std::string(fingerprints[i]) : std::string(),
                      {},
                      {}});
        }
        const std::size_t held_before = claims_.size();
        std::vector<ClaimResult> results(count);
        std::vector<std::size_t> contested;  // for the script
        if (store_->claim_with_set_.load(std::memory_order_relaxed)) {
            if (!claim_with_set(held, results, held_before, contested)) {
                contested.clear();  // the server refused SET … GET: nothing was written
                for (std::size_t i = 0; i < count; ++i)
                    contested.push_back(i);
            }
        } else {
            for (std::size_t i = 0; i < count; ++i)
                contested.push_back(i);
        }
        if (contested.empty()) {
            confirm_duplicates(held, results);
            return results;
        }

        std::vector<redis::Reply> answers = store_->router_.known_cluster()
                                                ? claim_per_slot(held, contested)
                                                : claim_in_one_script(held, contested);
        // An id this transaction held before the call is its own duplicate; a second copy of an
        // id in this call the script already answers so (the first copy made the lease ours).
        for (std::size_t k = 0; k < contested.size(); ++k) {
            const std::size_t i = contested[k];
            std::optional<ClaimResult> own;
            if (held_before > 0) own = own_claim(held[i].scope, held[i].id);
            results[i] = own ? *own : take(std::move(held[i]), answers[k]);
        }
        confirm_duplicates(held, results);
        return results;
    }

    /// With replicas_to_ack, a duplicate is acked on the strength of a record some commit wrote,
    /// maybe one whose WAIT timed out (failed, redelivered, and now found on the master): if the
    /// master died before its replicas got it, the ack would lose the message. So a write of this
    /// connection follows the record (a mark that expires in a second) and WAIT confirms it; the
    /// replication stream is in order, so a replica that has the mark has the record. One mark
    /// per hash slot (one in all on a standalone server), in a round trip of its own: only
    /// duplicates pay it. @throws commit_unconfirmed when fewer replicas confirmed it.
    void confirm_duplicates(const std::vector<Claim>& held,
                            const std::vector<ClaimResult>& results) {
        if (store_->options_.replicas_to_ack == 0) return;
        const bool cluster = store_->router_.known_cluster();
        std::map<std::uint16_t, std::string> marks;
        for (std::size_t i = 0; i < results.size(); ++i) {
            // A second copy of this transaction's own claim is not acked (in_progress).
            if (results[i].status != ClaimStatus::duplicate ||
                results[i].recorded == Disposition::in_progress) {
                continue;
            }
            std::string mark = store_->keys_.replication_mark(held[i].scope, held[i].id);
            marks.emplace(cluster ? redis::hash_slot(mark) : std::uint16_t{0}, std::move(mark));
        }
        const std::optional<redis::Args> wait = wait_command();
        for (const auto& [slot, mark] : marks) {
            std::vector<redis::Args> barrier(2);
            barrier[0].add("SET").add(mark).add("1").add("PX").add(1000);
            barrier[1] = *wait;
            redis::Reply replicas;
            const redis::Reply written = store_->router_.on_key(mark, [&](redis::Connection& c) {
                std::vector<redis::Reply> replies = c.pipeline(barrier);
                replicas = std::move(replies.at(1));
                return std::move(replies.at(0));  // a redirect here sends both again elsewhere
            });
            if (written.is_error()) {
                throw store_error("idem: Redis duplicate's replication mark (SET): " + written.str);
            }
            if (!confirmed(replicas)) {
                throw commit_unconfirmed(
                    unconfirmed_text(replicas, "the record a duplicate rests on", "has it"));
            }
        }
    }

    /// The claim script for the @p contested of @p held, in one call; one answer per id.
    std::vector<redis::Reply> claim_in_one_script(const std::vector<Claim>& held,
                                                  const std::vector<std::size_t>& contested) {
        redis::Args call;
        call.reserve(128 * contested.size() + 128);
        for (std::size_t i : contested)
            call.add(held[i].key);
        call.add(token_).add(lease_.count()).add(retention_ms()).add(store_->now_arg());
        for (std::size_t i : contested)
            call.add(redis::Record::fields(held[i].fingerprint, held[i].scope, held[i].id));
        redis::Reply reply = store_->with_connection([&](redis::Connection& c) {
            return c.eval(redis::claim_script(), contested.size(), call);
        });
        store_->check_script(reply, "claim");
        std::vector<redis::Reply> answers;  // one id: the script answers it alone
        if (contested.size() == 1) {
            answers.push_back(std::move(reply));
        } else {
            answers = std::move(reply.elements);
        }
        if (answers.size() != contested.size()) {
            throw store_error("idem: Redis claim script: unexpected reply");
        }
        return answers;
    }

    /// The same on a cluster: one script per hash slot, pipelined per node.
    std::vector<redis::Reply> claim_per_slot(const std::vector<Claim>& held,
                                             const std::vector<std::size_t>& contested) {
        std::map<std::uint16_t, std::vector<std::size_t>> groups;  // slot -> positions in contested
        for (std::size_t k = 0; k < contested.size(); ++k)
            groups[redis::hash_slot(held[contested[k]].key)].push_back(k);
        std::vector<redis::SlotCall> calls;
        const std::string now = store_->now_arg();
        for (const auto& [slot, positions] : groups) {
            redis::SlotCall call;
            call.slot = slot;
            call.num_keys = positions.size();
            for (std::size_t k : positions)
                call.keys_then_args.add(held[contested[k]].key);
            call.keys_then_args.add(token_).add(lease_.count()).add(retention_ms()).add(now);
            for (std::size_t k : positions) {
                const Claim& c = held[contested[k]];
                call.keys_then_args.add(redis::Record::fields(c.fingerprint, c.scope, c.id));
            }
            calls.push_back(std::move(call));
        }
        std::vector<redis::Reply> replies = store_->router_.eval_each(redis::claim_script(), calls);
        std::vector<redis::Reply> answers(contested.size());
        std::size_t g = 0;
        for (const auto& [slot, positions] : groups) {
            redis::Reply& reply = replies[g++];
            store_->check_script(reply, "claim");
            if (positions.size() == 1) {
                answers[positions.front()] = std::move(reply);
                continue;
            }
            if (reply.elements.size() != positions.size()) {
                throw store_error("idem: Redis claim script: unexpected reply");
            }
            for (std::size_t k = 0; k < positions.size(); ++k)
                answers[positions[k]] = std::move(reply.elements[k]);
        }
        return answers;
    }

    /// The SET round trip of claim_all(). Decides what it can into @p results and lists the
    /// rest in @p contested; false (nothing decided, nothing written) when the server does not
    /// know `SET … NX … GET`, which then stays off for this store.
    bool claim_with_set(std::vector<Claim>& held, std::vector<ClaimResult>& results,
                        std::size_t held_before, std::vector<std::size_t>& contested) {
        const std::vector<redis::Args> sets = set_claims(held);
        std::vector<redis::Reply> replies;
        if (store_->router_.is_cluster()) {  // one pipeline per node
            std::vector<std::uint16_t> slots;
            slots.reserve(held.size());
            for (const auto& claim : held)
                slots.push_back(redis::hash_slot(claim.key));
            replies = store_->router_.pipeline(sets, slots);
        } else {
            replies =
                store_->with_connection([&](redis::Connection& c) { return c.pipeline(sets); });
        }
        return read_set_claims(held, replies, results, held_before, contested);
    }

    /// The `SET … NX PX … GET` of each of @p held (claim_with_set()).
    std::vector<redis::Args> set_claims(const std::vector<Claim>& held) const {
        // A new record: attempt 1, claimed and leased now — the server's now, which a plain SET
        // cannot read, so the times say "the expiry minus the retention" (see redis_lua_now).
        const std::string now = store_->now_arg();
        const std::string retention = std::to_string(retention_ms());
        std::string head = "leased|" + token_ + "||1|";
        if (now.empty()) {
            head += '~' + retention + "|~" + retention;
        } else {
            head += now + '|' + now;
        }
        head += '|' + std::to_string(lease_.count()) + '|';
        std::vector<redis::Args> sets(held.size());
        for (std::size_t i = 0; i < held.size(); ++i) {
            sets[i]
                .add("SET")
                .add(held[i].key)
                .add(head + redis::Record::fields(held[i].fingerprint, held[i].scope, held[i].id))
                .add("NX")
                .add("PX")
                .add(retention)
                .add("GET");
        }
        return sets;
    }

    /// Reads the replies of set_claims(@p held) into @p results and @p contested, as
    /// claim_with_set() says.
    bool read_set_claims(std::vector<Claim>& held, std::vector<redis::Reply>& replies,
                         std::vector<ClaimResult>& results, std::size_t held_before,
                         std::vector<std::size_t>& contested) {
        if (!replies.empty() && replies[0].is_error() &&
            replies[0].str.rfind("ERR syntax error", 0) == 0) {
            store_->claim_with_set_.store(false, std::memory_order_relaxed);
            return false;
        }
        const redis::Reply* error = nullptr;  // thrown once the claims that went in are ours
        for (std::size_t i = 0; i < held.size(); ++i) {
            redis::Reply& reply = replies[i];
            if (reply.is_error()) {
                if (error == nullptr) error = &reply;
                continue;
            }
            std::optional<ClaimResult> own;
            if (held_before > 0) own = own_claim(held[i].scope, held[i].id);
            if (own) {
                results[i] = *own;
                continue;
            }
            if (reply.is_nil()) {  // a new claim: attempt 1
                results[i].status = ClaimStatus::claimed;
                results[i].fingerprint = held[i].fingerprint;
                results[i].attempts = 1;
                claims_.push_back(std::move(held[i]));
                continue;
            }
            auto record = redis::Record::decode(reply.str);
            if (!record) {
                if (error == nullptr) error = &reply;
                continue;
            }
            const bool mine = record->state == "leased" && record->token == token_;
            if (record->state == "done" || mine) {  // finished, or a second copy of ours
                results[i].status = ClaimStatus::duplicate;
                // A done record without an outcome name reads as processed, as in the script.
                results[i].recorded =
                    mine ? Disposition::in_progress : disposition_from(record->outcome);
                results[i].fingerprint = std::move(record->fingerprint);
                results[i].attempts = record->attempts;
                continue;
            }
            contested.push_back(i);
        }
        if (error != nullptr) {
            throw store_error(
                fmt::format("idem: Redis claim (SET … NX GET): {}",
                            error->is_error() ? error->str : "unreadable claim record"));
        }
        return true;
    }

    /// Reads one id's answer: 1 for a new claim, else {status, detail, fingerprint, attempts}.
    /// A claimed id joins this transaction's leases.
    ClaimResult take(Claim held, redis::Reply& answer) {
        ClaimResult result;
        if (answer.type == redis::Reply::Type::integer) {  // a new claim: attempt 1
            result.status = ClaimStatus::claimed;
            result.fingerprint = held.fingerprint;
            result.attempts = 1;
            claims_.push_back(std::move(held));
            return result;
        }
        if (!answer.is_array() || answer.elements.size() != 4) {
            throw store_error("idem: Redis claim script: unexpected reply");
        }
        const std::string& status = answer.elements[0].str;
        result.fingerprint = std::move(answer.elements[2].str);
        result.attempts = static_cast<std::uint32_t>(redis::parse_int(answer.elements[3].str));
        if (status == "duplicate") {
            result.status = ClaimStatus::duplicate;
            result.recorded = disposition_from(answer.elements[1].str);
        } else if (status == "in_progress") {
            result.status = ClaimStatus::in_progress;
            // The script's detail is what is left of the holder's lease, in milliseconds.
            result.retry_after =
                std::chrono::milliseconds(redis::parse_int(answer.elements[1].str));
        } else {
            result.status = ClaimStatus::claimed;
            claims_.push_back(std::move(held));
        }
        return result;
    }

    /// The replies of commit_round_trip().
    struct CommitReplies {
        redis::Reply commit;                    ///< the commit script's
        std::optional<redis::Reply> replicas;   ///< WAIT's, with replicas_to_ack
        std::vector<redis::Reply> next_claims;  ///< one per command of @p next_claims
    };
    /// The commit script of @p prepared, then `WAIT` when the store asks replicas to confirm
    /// commits, then @p next_claims (commit_with_next_claim()'s `SET … NX GET`), in ONE round trip
    /// on @p connection. After a NOSCRIPT the re-run script is followed by WAIT again (it confirms
    /// only the writes before it: AfterNoscript::resend), not by the claims (they already ran:
    /// AfterNoscript::keep_reply).
    CommitReplies commit_round_trip(redis::Connection& connection, const PreparedCommit& prepared,
                                    const std::vector<redis::Args>& next_claims = {}) const {
        CommitReplies out;
        const std::optional<redis::Args> wait = wait_command();
        if (!wait && next_claims.empty()) {
            out.commit =
                connection.eval(redis::complete_script(), prepared.num_keys, prepared.call);
            return out;
        }
        std::vector<redis::ThenCommand> then;
        then.reserve(1 + next_claims.size());
        if (wait) then.push_back(redis::ThenCommand{&*wait, redis::AfterNoscript::resend});
        for (const redis::Args& claim : next_claims)
            then.push_back(redis::ThenCommand{&claim, redis::AfterNoscript::keep_reply});
        std::vector<redis::Reply> replies =
            connection.eval_then(redis::complete_script(), prepared.num_keys, prepared.call, then);
        auto next = std::make_move_iterator(replies.begin());
        out.commit = *next++;
        if (wait) out.replicas = *next++;
        out.next_claims.assign(next, std::make_move_iterator(replies.end()));
        return out;
    }
    CommitReplies commit_round_trip(const PreparedCommit& prepared) const {
        return store_->with_connection(
            [&](redis::Connection& c) { return commit_round_trip(c, prepared); });
    }

    /// `WAIT replicas_to_ack replicas_timeout`, when the store asks replicas to confirm commits.
    [[nodiscard]] std::optional<redis::Args> wait_command() const {
        const RedisOptions& options = store_->options_;
        if (options.replicas_to_ack == 0) return std::nullopt;
        redis::Args wait;
        wait.add("WAIT").add(options.replicas_to_ack).add(options.replicas_timeout.count());
        return wait;
    }
    /// Whether WAIT's reply says enough replicas have the commit.
    [[nodiscard]] bool confirmed(const redis::Reply& replicas) const {
        return !replicas.is_error() && replicas.type == redis::Reply::Type::integer &&
               replicas.integer >= store_->options_.replicas_to_ack;
    }
    /// Why @p what (the master @p verb) is not acked: WAIT's answer @p replicas said too few.
    [[nodiscard]] std::string unconfirmed_text(const redis::Reply& replicas,
                                               std::string_view what = "commit",
                                               std::string_view verb = "applied it") const {
        const RedisOptions& options = store_->options_;
        return fmt::format(
            "{} not confirmed: the master on {} {} but {} within {} ms (WAIT {} {}); "
            "a failover now would lose it, so its outcome is unknown and it must not be acked",
            what, store_->endpoint().describe(), verb,
            replicas.is_error() ? fmt::format("WAIT failed ({})", replicas.str)
                                : fmt::format("only {} of {} replicas confirmed it",
                                              replicas.integer, options.replicas_to_ack),
            options.replicas_timeout.count(), options.replicas_to_ack,
            options.replicas_timeout.count());
    }

    /// After a commit the master applied: fewer replicas than asked have it, so a failover may
    /// still lose it. Nothing is left to release (the claims are done); the transaction ends and
    /// the commit is reported unconfirmed, which the handler turns into `failed` (no ack).
    void confirm_replicated(const redis::Reply& replicas) {
        if (confirmed(replicas)) return;
        std::string message = unconfirmed_text(replicas);
        claims_.clear();  // committed on the master: not ours to release any more
        released_.clear();
        finish();
        throw commit_unconfirmed(message);
    }

    /// Frees the leases of @p keys that this transaction's token still holds: one script (one
    /// per hash slot on a cluster, pipelined per node). @p script: release_script(), or
    /// release_unstarted_script() to take back the attempts too.
    std::vector<redis::Reply> release(const std::vector<std::string>& keys,
                                      const redis::Script& script = redis::release_script()) {
        if (!store_->router_.known_cluster()) {
            redis::Args call;
            for (const auto& key : keys)
                call.add(key);
            call.add(token_);
            return {store_->with_connection(
                [&](redis::Connection& c) { return c.eval(script, keys.size(), call); })};
        }
        std::vector<redis::SlotCall> calls;
        for (const auto& [slot, group] : by_slot(keys)) {
            redis::SlotCall call;
            call.slot = slot;
            call.num_keys = group.size();
            for (const auto& key : group)
                call.keys_then_args.add(key);
            call.keys_then_args.add(token_);
            calls.push_back(std::move(call));
        }
        return store_->router_.eval_each(script, calls);
    }

    /// Frees the leases of @p keys whose effects never started, with their attempts taken back.
    std::vector<redis::Reply> release_unstarted(const std::vector<std::string>& keys) {
        return release(keys, redis::release_unstarted_script());
    }

    explicit Transaction(RedisStore& store)
        : store_(&store),
          token_(redis::new_lease_token()),
          lease_(store.options_.lease),
          retention_(store.options_.retention) {}

    /// The attached hooks' acks: adds to @p out the dead-letter stream entries and then the
    /// XACKs of the entries this commit completes, and returns their hooks. Hooks are matched to
    /// the transaction's work by CommitHook::scope and message_id (set by the handler). For each
    /// (scope, message id): a claim with a final outcome (processed, rejected, dead_lettered) is
    /// the id's first hook's (claims go to an id's first copy; later copies in a batch are its
    /// duplicates, acked by the caller); without a claim, dead letters pair with the hooks in
    /// order when there is exactly one per hook (a malformed delivery, an id reused with another
    /// payload). Anything else (failed, deferred, in_progress, duplicate, a request this store
    /// does not know) is left to the caller.
    std::vector<CommitHook*> hook_commands(Commands& out) {
        // Entries and dead letters grouped by (scope, message id), in one pass each.
        auto group_key = [](std::string_view scope, std::string_view id) {
            std::string key = std::to_string(scope.size());
            key += ':';
            key.append(scope).append(id);
            return key;
        };
        std::vector<std::string> order;
        std::unordered_map<std::string, std::vector<CommitHook*>> copies_of;
        for (CommitHook* hook : hooks_) {
            if (hook->request_as<redis::StreamAck>() == nullptr)
                continue;  // not a stream ack (any more)
            auto [it, added] = copies_of.try_emplace(group_key(hook->scope, hook->message_id));
            if (added) order.push_back(it->first);
            it->second.push_back(hook);
        }
        std::unordered_map<std::string, std::vector<const DeadLetter*>> letters_of;
        for (const auto& letter : letters_)
            letters_of[group_key(letter.scope, letter.message_id)].push_back(&letter);

        std::vector<CommitHook*> acked;
        Commands xacks;
        auto add = [&](CommitHook& hook, const std::string* dead_letter_reason) {
            const redis::StreamAck& ack = *hook.request_as<redis::StreamAck>();
            if (dead_letter_reason != nullptr) {  // never XACKed without its copy
                out.add(redis::stream_dead_letter_command(
                    ack.dead_letter_destination(), ack.entry_id, ack.fields, *dead_letter_reason,
                    hook.scope, hook.message_id, ack.delivery_count));
            }
            xacks.add({"XACK", ack.stream, ack.group, ack.entry_id});
            acked.push_back(&hook);
        };
        for (const std::string& key : order) {
            const std::vector<CommitHook*>& copies = copies_of[key];
            CommitHook& first = *copies.front();
            const std::size_t held = find_held(first.scope, first.message_id);
            if (held < claims_.size()) {
                const Claim& claim = claims_[held];
                Disposition outcome = Disposition::in_progress;
                if (claim.outcome.empty() || !from_string(claim.outcome, outcome)) continue;
                if (outcome == Disposition::dead_lettered) {
                    add(first, &claim.reason);
                } else if (outcome == Disposition::processed || outcome == Disposition::rejected) {
                    add(first, nullptr);
                }
                continue;
            }
            auto letters = letters_of.find(key);
            if (letters != letters_of.end() && letters->second.size() == copies.size()) {
                for (std::size_t k = 0; k < copies.size(); ++k)
                    add(*copies[k], &letters->second[k]->reason);
            }
        }
        // Dead-letter entries before any XACK: one that fails leaves every entry pending.
        out.args.append(xacks.args);
        out.count += xacks.count;
        return acked;
    }

    void active() const {
        if (store_ == nullptr)
            throw usage_error(
                "idem::RedisStore: the transaction is already committed or rolled "
                "back");
    }
    [[nodiscard]] long long retention_ms() const {
        return std::chrono::duration_cast<std::chrono::milliseconds>(retention_).count();
    }

    /// Releases overlap locks (best effort: they expire anyway) and ends the transaction.
    void finish() noexcept {
        RedisStore* store = std::exchange(store_, nullptr);
        if (store == nullptr) return;
        for (const auto& key : locks_) {
            try {
                store->release_lock(key, token_);
            } catch (...) {  // expires by itself
            }
        }
        claims_.clear();
        released_.clear();
        unstarted_.clear();
        locks_.clear();
        hooks_.clear();
        write_places_.clear();
    }

    RedisStore* store_;
    std::string token_;
    std::chrono::milliseconds lease_;
    std::chrono::seconds retention_;
    std::vector<Claim> claims_;
    std::vector<DeadLetter> letters_;
    redis::Args commands_;  ///< the queued writes, encoded for the commit script
    std::size_t command_count_ = 0;
    std::vector<Mark> savepoints_;
    std::vector<std::string> locks_;
    std::vector<std::string> released_;  ///< keys of unclaim()ed leases, freed at the end
    /// Keys this transaction may hold a lease on whose effect never started (a pipelined claim
    /// whose answer was lost): released at rollback with their attempt taken back.
    std::vector<std::string> unstarted_;
    std::vector<CommitHook*> hooks_;        ///< attach()ed stream acks, done by the commit
    std::vector<WritePlace> write_places_;  ///< on a cluster: one per queued write
    mutable std::size_t last_found_ = 0;    ///< find_held()'s hint
};

inline RedisStore::Transaction RedisStore::begin() {
    return Transaction(*this);
}

IDEM_END_NAMESPACE
