#pragma once
/// @file
/// @brief RedisStore: claims held as leases in Redis, taken in one round trip (a plain
/// `SET … NX GET` for a new id, a Lua script for a contested one) and completed by
/// compare-and-set on the lease's token. Redis-side writes of the effect (and the
/// stream XACK when the broker is the same Redis) commit atomically with the completion. A face
/// over the parts in idem/redis/ (claims.hpp, commit.hpp, slot_commit.hpp, claim_and_commit.hpp,
/// next_claim.hpp, replication.hpp, admin.hpp). Link idem::redis. See docs/redis.md.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/redrive.hpp"
#include "idem/contract/store.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"
#include "idem/policy.hpp"
#include "idem/redis/cluster.hpp"
#include "idem/redis/endpoint.hpp"
#include "idem/redis/stream_ack.hpp"
#include "idem/store/redis/admin.hpp"
#include "idem/store/redis/claim_and_commit.hpp"
#include "idem/store/redis/claims.hpp"
#include "idem/store/redis/commit.hpp"
#include "idem/store/redis/context.hpp"
#include "idem/store/redis/next_claim.hpp"
#include "idem/store/redis/options.hpp"
#include "idem/store/redis/outbox.hpp"
#include "idem/store/redis/redrive.hpp"
#include "idem/store/redis/replication.hpp"
#include "idem/store/redis/slot_commit.hpp"
#include "idem/store/redis/transaction_state.hpp"

IDEM_BEGIN_NAMESPACE

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

    /// @brief Version of the layout of the store's keys and claim records
    /// (IDEM_REDIS_SCHEMA_VERSION, idem/config.hpp). Not written to Redis and not checked: a
    /// change of it is a major version of idem (docs/compatibility.md).
    static constexpr int schema_version = IDEM_REDIS_SCHEMA_VERSION;

    /// @brief A store on one server (or one seed node of a Redis Cluster, or Sentinels: see
    /// RedisEndpoint); as the constructor below, with one seed.
    explicit RedisStore(RedisEndpoint endpoint, RedisOptions options = {})
        : RedisStore(std::vector<RedisEndpoint>{std::move(endpoint)}, std::move(options)) {}

    /// @brief A store given several seed nodes of a Redis Cluster (or one server): the first
    /// that answers is asked whether it is a cluster node, and for the slot map.
    /// @throws usage_error for options out of range, or a server without AOF
    /// (RedisOptions::accept_no_persistence).
    explicit RedisStore(std::vector<RedisEndpoint> seeds, RedisOptions options = {})
        : context_(std::move(seeds), std::move(options)) {}
    RedisStore(const RedisStore&) = delete;
    RedisStore& operator=(const RedisStore&) = delete;

    /// The address given (the first seed node, on a cluster).
    [[nodiscard]] const RedisEndpoint& endpoint() const noexcept { return context_.endpoint(); }
    /// @brief Whether the store talks to a Redis Cluster (asks the server on the first call
    /// that reaches it). @throws store_unavailable when no seed answers yet.
    [[nodiscard]] bool is_cluster() { return context_.cluster(); }
    /// @brief The cluster redirects followed so far (MOVED, ASK, TRYAGAIN / CLUSTERDOWN waits,
    /// slot-map reads); all zero on a standalone server.
    [[nodiscard]] redis::RedirectCounts redirects() const noexcept {
        return context_.router.redirects();
    }
    /// @brief The router (slot map, pools per node): for tests and tools.
    [[nodiscard]] redis::Router& router() noexcept { return context_.router; }
    /// The options the store was made with.
    [[nodiscard]] const RedisOptions& options() const noexcept { return context_.options; }
    /// Whether new ids are claimed with `SET … NX … GET` (RedisOptions::claim_with_set, until a
    /// server before 7.0 refuses it) rather than the claim script.
    [[nodiscard]] bool claims_with_set() const noexcept {
        return context_.claim_with_set.load(std::memory_order_relaxed);
    }
    /// The lease used when the handler's policy sets none.
    [[nodiscard]] std::chrono::milliseconds default_lease() const noexcept {
        return context_.options.lease;
    }

    /// @brief Starts a transaction. No round trip: Redis is contacted by claim() and commit().
    [[nodiscard]] Transaction begin();

    /// @brief One round trip to every server the store writes to, now: what idem::probe_store()
    /// (the circuit breaker's probe) calls, since begin() and a rollback of nothing send nothing.
    /// A PING to the server; with Sentinels, the Sentinels are asked for the master first and the
    /// master is PINGed; on a Cluster every master is PINGed and asked `CLUSTER INFO`. Each
    /// exchange is bounded by the endpoint's connect_timeout and command_timeout. A server
    /// still loading its data (`LOADING`), a replica without its master (`MASTERDOWN`) and a
    /// cluster without quorum (`CLUSTERDOWN`, cluster_state:fail) read as unavailable. On a
    /// node's first contact the persistence check runs too (RedisOptions::accept_no_persistence).
    /// @throws store_unavailable when a server cannot be reached or cannot serve now;
    /// store_timeout when one does not answer in time (a hung server); usage_error from the
    /// persistence check.
    void ping() { context_.router.ping(); }

    /// @brief Whether this store's transactions do @p hook in their commit: a stream ack
    /// (redis::StreamAck, from RedisStreamConsumer or your own loop) on this store's server and
    /// database. The ack (and a dead letter's dead-letter stream entry) is then part of the
    /// commit script; otherwise the hook is ignored and the broker acks after the commit.
    /// On a Redis Cluster never: a stream and a claim are in different hash slots, so the
    /// XACK cannot be in the claim's commit script; the consumer then acks after the commit.
    [[nodiscard]] bool accepts_commit_hook(const CommitHook& hook) const noexcept {
        const auto* ack = hook.request_as<redis::StreamAck>();
        return ack != nullptr && !context_.router.known_cluster() &&
               ack->endpoint.same_database(endpoint());
    }

    /// @brief The claim record, or nothing when there is none or it was released.
    std::optional<ClaimRecord> find_claim(std::string_view scope, std::string_view id) {
        return redis::find_claim(context_, scope, id);
    }
    /// @brief How many times the effect started for this claim (0 when there is no record).
    std::uint32_t attempts(std::string_view scope, std::string_view id) {
        std::optional<redis::Record> stored = redis::read_record(context_, scope, id);
        return stored ? stored->attempts : 0;
    }
    /// @brief Every dead letter, oldest first (redriven ones too: their redriven_at is set).
    /// Kept until a human deletes them: purge() and the claims' expiry never touch them.
    std::vector<DeadLetter> dead_letters() { return redis::dead_letters(context_); }

    /// @brief The dead letters @p selection takes, oldest first (contract/redrive.hpp).
    std::vector<DeadLetter> dead_letters(const DeadLetterSelection& selection) {
        return redis::dead_letters(context_, selection);
    }

    /// @brief Records a failure of the effect of (@p scope, @p id) in a hash in its claim's slot
    /// (one script), kept @p keep_for and cleared by its redrive: a later dead letter of it
    /// carries @p failure and when the first and the last were. @throws store_error.
    void note_failure(std::string_view scope, std::string_view id, std::string_view failure,
                      std::chrono::seconds keep_for) {
        redis::note_failure(context_, scope, id, failure, keep_for);
    }
    /// @brief What note_failure() recorded for (@p scope, @p id), if it is still kept.
    [[nodiscard]] std::optional<NotedFailure> noted_failure(std::string_view scope,
                                                            std::string_view id) {
        return redis::noted_failure(context_, scope, id);
    }

    /// @brief Brings the dead letters @p selection takes back, each exactly once, by one script
    /// per entry on its claim's hash slot (store/redis/redrive.hpp): the claim that still records
    /// it as dead_lettered is deleted (with its attempt count: a fresh poison limit), an outbox
    /// intent re-publishes the payload to RedriveOptions::destination under the message id, and
    /// the entry is marked redriven; all of it, or (a script that fails) none. idem::Relay
    /// ships the intents (lease_outbox()). An entry redriven before, or whose claim records
    /// another outcome now, is reported and left alone; concurrent redrives redrive each entry
    /// once. A dry run judges and changes nothing.
    /// @throws usage_error for a bad rate. A failed entry is reported (RedriveStatus::failed)
    /// with nothing of it written.
    RedriveReport redrive(const DeadLetterSelection& selection, const RedriveOptions& options) {
        return redis::redrive(context_, outbox_, selection, options);
    }

    /// @brief Deletes the dead letters @p selection takes (an empty selection takes them all),
    /// each on its own; their claims stay, so a re-published copy is still answered `duplicate`.
    /// A dry run deletes nothing. @return the entries deleted (dry run: that would be).
    std::vector<DeadLetter> purge_dead_letters(const DeadLetterSelection& selection,
                                               bool dry_run = false) {
        return redis::purge_dead_letters(context_, selection, dry_run);
    }

    /// @brief Leases up to @p limit due intents (a redrive's), lowest id first, until clock() +
    /// @p lease; a relay elsewhere gets none of them while the lease lives.
    std::vector<OutboxRow> lease_outbox(std::size_t limit, std::chrono::milliseconds lease) {
        return outbox_.lease(limit, lease);
    }
    /// @brief Marks the intent @p id (leased by this store object) sent, ending its lease.
    /// @throws usage_error when this store did not lease it.
    void mark_outbox_sent(std::int64_t id) { outbox_.mark_sent(id); }
    /// @brief Records a failed send of the intent @p id (leased by this store object):
    /// attempts + 1, last_error, due again at @p retry_at, or parked. @throws usage_error when
    /// this store did not lease it.
    void mark_outbox_failed(std::int64_t id, std::string_view error,
                            std::chrono::system_clock::time_point retry_at, bool park) {
        outbox_.mark_failed(id, error, retry_at, park);
    }
    /// @brief Every outbox intent (a message's latest redrive), oldest first.
    std::vector<OutboxRow> outbox_rows() { return outbox_.rows(); }
    /// @brief The intents the attempts of message (@p scope, @p id) wrote: its redrive's.
    std::vector<OutboxRow> outbox_rows(std::string_view scope, std::string_view id) {
        return outbox_.rows_of(scope, id);
    }

    /// @brief Deletes claims claimed before clock() - @p older_than (never a live lease), outbox
    /// intents sent before it and expired locks. Redis also expires claims by itself (each
    /// record's TTL is the retention); this is for a clock the server does not share (tests) and
    /// for claims kept longer than the purge's age. Dead letters are kept. Paced as PurgeOptions
    /// says: a batch is one SCAN page per master (about `batch_rows` keys looked at) and the
    /// scripts over the keys it found, so a run holds one page of keys whatever the keyspace.
    PurgeResult purge(std::chrono::system_clock::duration older_than,
                      const PurgeOptions& options = {}) {
        options.validate("idem::RedisStore: purge()");
        const std::int64_t cutoff_ms =
            context_.now_ms() -
            std::chrono::duration_cast<std::chrono::milliseconds>(older_than).count();
        const detail::PurgePacer pacer(options);
        PurgeResult result;
        redis::purge(context_, cutoff_ms, options.batch_rows, pacer, result);
        if (result.complete) outbox_.purge_sent(cutoff_ms, options.batch_rows, pacer, result);
        pacer.finish(result);
        return result;
    }

    /// @brief Takes a lock outside any transaction (a long job, another system); false when
    /// another owner holds it and it has not expired.
    bool hold_lock(std::string_view key, std::string_view owner,
                   std::chrono::milliseconds expire_after) {
        return redis::hold_lock(context_, key, owner, expire_after);
    }
    /// @brief Releases a lock @p owner holds; false when it holds none.
    bool release_lock(std::string_view key, std::string_view owner) {
        return redis::release_lock(context_, key, owner);
    }

    /// @brief The record of (scope, id). The hash tag holds both, so one claim's keys (record,
    /// dead letters) share a Cluster slot whatever bytes the id has.
    [[nodiscard]] std::string claim_key(std::string_view scope, std::string_view id) const {
        return context_.keys.claim(scope, id);
    }
    /// The key of the dead letters of (scope, id), in the claim's Cluster slot.
    [[nodiscard]] std::string dead_letter_key(std::string_view scope, std::string_view id) const {
        return context_.keys.dead_letter(scope, id);
    }
    /// The key of the lock hold_lock() takes on @p key.
    [[nodiscard]] std::string lock_key(std::string_view key) const {
        return context_.keys.lock(key);
    }

    /// @brief Runs @p fn with a pooled connection (reconnecting if it was dropped): to the
    /// server, or on a cluster to one of its masters (for keyless commands; with_connection_for()
    /// routes by key). Waits up to RedisOptions::pool_wait_timeout when max_connections are in
    /// use.
    /// @throws store_timeout when no connection became free in time; usage_error when the server
    /// has no AOF (RedisOptions::accept_no_persistence).
    template <class Fn>
    auto with_connection(Fn&& fn) -> decltype(fn(std::declval<redis::Connection&>())) {
        return context_.router.on_any(std::forward<Fn>(fn));
    }
    /// @brief Runs @p fn, which sends ONE command or script on keys of @p key's hash slot, on
    /// the node serving that slot (the server, standalone), following the cluster's redirects.
    template <class Fn>
    redis::Reply with_connection_for(std::string_view key, Fn&& fn) {
        return context_.router.on_key(key, std::forward<Fn>(fn));
    }

    /// @brief What the persistence check found; nothing before the first call that reached the
    /// server, or with RedisOptions::accept_no_persistence (which skips the check).
    [[nodiscard]] std::optional<RedisPersistence> persistence() const {
        return context_.persistence();
    }
    /// @brief Request/reply exchanges with Redis so far, over all pooled connections (a
    /// pipeline counts once): the cost tests and benchmarks check.
    [[nodiscard]] std::size_t round_trips() const noexcept { return context_.router.round_trips(); }

    /// @brief Connects ahead: opens @p connections pooled connections (at most max_connections)
    /// to the server, or on a Redis Cluster to each master, runs the persistence check, and loads
    /// the store's scripts on each, so the first messages pay neither the connect nor a `SCRIPT
    /// LOAD` (a message then costs its round trips only: docs/performance.md). Its own round trips
    /// count in round_trips(). A server that restarts later forgets the scripts; they are loaded
    /// again on first use, as without warm_up(). On a cluster, a master that joins later (a
    /// failover, a resharding) is not warmed: its first use loads what it needs.
    /// @throws store_unavailable / store_timeout when Redis cannot be reached; usage_error when
    /// it has no AOF (RedisOptions::accept_no_persistence).
    void warm_up(std::size_t connections = 1) { redis::warm_up(context_, connections); }

    /// @brief Milliseconds since the epoch on the store's clock (the server's by default).
    std::int64_t now_ms() { return context_.now_ms(); }

  private:
    friend class Transaction;
    redis::StoreContext context_;
    redis::Outbox outbox_{context_};
};

/// @brief One handler run's claims and queued writes; frees its leases in its destructor unless
/// committed. Never throws from the destructor.
class RedisStore::Transaction {
  public:
    /// Takes over @p other's transaction (@p other then holds none).
    Transaction(Transaction&& other) noexcept
        : store_(std::exchange(other.store_, nullptr)), state_(std::move(other.state_)) {}
    Transaction& operator=(Transaction&&) = delete;
    Transaction(const Transaction&) = delete;
    Transaction& operator=(const Transaction&) = delete;
    ~Transaction() { rollback(); }

    /// @brief The handler passes its policy's lease and retention before claiming.
    void set_terms(const ClaimTerms& terms) {
        active();
        state_.set_terms(terms.lease.value_or(store_->options().lease), terms.retention);
    }

    /// @brief One round trip (two for an id another worker holds or released). For a claim:
    /// ClaimResult::attempts is how many times the effect started (this time included), which
    /// the handler's poison check uses.
    ClaimResult claim(std::string_view scope, std::string_view id,
                      std::string_view fingerprint = {}) {
        active();
        if (auto own = state_.own_claim(scope, id)) return *own;
        return redis::claim_all(context(), state_, scope, &id, 1,
                                fingerprint.empty() ? nullptr : &fingerprint)
            .front();
    }

    /// @brief Claims many ids of one scope in ONE round trip (pipelined SETs; one more for the
    /// ids other workers hold or released, together); results in order. An id repeated in @p ids
    /// is a duplicate of its first copy. @p fingerprints is empty or one per id. Used by
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
        return redis::claim_all(context(), state_, scope, ids.data(), ids.size(),
                                fps.empty() ? nullptr : fps.data());
    }

    /// @brief Gives back a claim this transaction holds without completing it (a batch message
    /// that failed): its lease is freed by the commit, or by the rollback.
    void unclaim(std::string_view scope, std::string_view id) {
        active();
        state_.unclaim(scope, id);
    }

    /// @brief Records the outcome of a claim this transaction holds; written by commit().
    /// @throws usage_error for a claim it does not hold.
    void record_outcome(std::string_view scope, std::string_view id, Disposition disposition,
                        std::string_view reason) {
        active();
        if (!state_.record_outcome(scope, id, to_string(disposition), reason)) {
            throw usage_error(
                "idem::RedisStore: record_outcome() for a claim this transaction does not hold");
        }
    }

    /// Queues @p letter; commit() stores it. With a commit hook attached (a stream's dead-letter
    /// copy written by the commit), the failures noted for it are read now for that copy: only
    /// past its first attempt (a failure is noted after an attempt, so the first has none).
    void dead_letter(const DeadLetter& letter) {
        active();
        DeadLetter queued = letter;
        if (!state_.hooks().empty() && !queued.last_failed_at && queued.delivery_count > 1) {
            if (auto noted = store_->noted_failure(letter.scope, letter.message_id))
                queued.take(*noted);
        }
        state_.add_letter(std::move(queued));
    }

    /// @brief Queues a Redis write (binary-safe arguments: text, idem::Blob, integers) that runs
    /// at commit, atomically with the completion, and only if every lease is still ours.
    /// Redis cannot undo a command that fails inside the commit: keep these to commands that
    /// cannot fail on keys of the right type (SET, HSET, HINCRBY, SADD, XADD, ...).
    template <class... Args>
    void write(const Args&... args) {
        active();
        static_assert(sizeof...(Args) > 0, "idem: write() needs a command");
        state_.queue_write(args...);
    }

    /// @brief Runs a read now, outside the transaction (it does not see this transaction's
    /// queued writes), routed by its key (the first argument). An error reply throws
    /// store_error.
    template <class... Args>
    redis::Reply read(const Args&... args) {
        active();
        redis::Args command;
        (command.add(args), ...);
        if constexpr (sizeof...(Args) > 1) {
            const std::string key = redis::to_arg(std::get<1>(std::tie(args...)));
            return context().checked_on(
                key, [&](redis::Connection& c) { return c.command(command); }, "read");
        } else {
            return store_->with_connection(
                [&](redis::Connection& c) { return c.checked(command, "read"); });
        }
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
        state_.attach(hook);
        return true;
    }

    /// Marks a savepoint in the queued writes, dead letters and claims (no round trip).
    void savepoint() {
        active();
        state_.savepoint();
    }
    /// @brief Drops the writes and dead letters queued since the latest savepoint, and frees the
    /// leases claimed since then (one round trip, only if there are any): a batch message that
    /// failed leaves nothing, not even its claim.
    void rollback_to_savepoint() {
        active();
        if (!state_.has_savepoint())
            throw usage_error("idem::RedisStore: no savepoint to roll back to");
        const std::vector<std::string> keys = state_.rollback_to_savepoint();
        for (const redis::Reply& reply : redis::release(context(), state_.token(), keys))
            context().check_script(reply, "release");
    }
    /// Drops the latest savepoint, keeping what followed it. @throws usage_error without one.
    void release_savepoint() {
        active();
        if (!state_.has_savepoint()) throw usage_error("idem::RedisStore: no savepoint to release");
        state_.release_savepoint();
    }

    /// @brief Overlap lock held until the transaction ends; false when another holder has it.
    bool try_lock(std::string_view key, std::chrono::milliseconds expire_after) {
        active();
        if (!store_->hold_lock(key, state_.token(), expire_after)) return false;
        state_.add_lock(std::string(key));
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
        redis::StoreContext& store = context();
        end_commit(store.cluster() ? redis::commit_per_slot(store, state_)
                                   : redis::commit_one_server(store, state_));
    }

    /// @brief Frees this transaction's leases and locks. A no-op after commit. Never throws:
    /// if Redis is unreachable the leases simply expire.
    void rollback() noexcept {
        if (store_ == nullptr) return;
        try {
            if (!state_.unstarted().empty()) {
                (void)redis::release(context(), state_.token(), state_.unstarted(),
                                     redis::release_unstarted_script());
            }
        } catch (...) {  // unreachable: the lease expires on its own, the attempt stays counted
        }
        try {
            if (!state_.claims().empty() || !state_.released().empty()) {
                (void)redis::release(context(), state_.token(), state_.lease_keys());
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
    /// On a Redis Cluster with a write outside the claim's slot, in two steps with the same
    /// answers (claim_then_commit()): never not_attempted, so the effect is not run again.
    /// @throws commit_failed when a queued write failed (as commit()); store_unavailable /
    /// store_timeout when Redis could not be reached (outcome unknown: a redelivery finds it).
    ClaimAndCommitResult claim_and_commit(const ClaimAndCommit& request) {
        active();
        if (state_.holds_anything()) {
            throw usage_error(
                "idem::RedisStore: claim_and_commit() on a transaction that already holds claims "
                "or dead letters");
        }
        redis::StoreContext& store = context();
        redis::ClaimAndCommitSent sent = redis::claim_and_commit_round_trip(store, state_, request);
        if (!sent.attempted) return claim_then_commit(request);
        finish();
        return redis::read_claim_and_commit(store, sent);
    }

    /// @brief The commit-with-next-claim capability (idem/contract/store.hpp; used by
    /// idem::PipelinedLoop): this transaction's commit and @p next's claim of (scope, id) in
    /// ONE round trip (the commit script and the claim's `SET … NX PX … GET`, pipelined). The
    /// commit's fate is in the result (commit_error null: committed; else this transaction is
    /// rolled back, as a failed commit() leaves it); @p next's claim is answered as claim()
    /// would, whatever the commit's fate: a refused commit leaves the fresh lease in place (a
    /// different id). An id another worker holds or released needs the claim script: one more
    /// round trip, as claim(). Without SET claims (a server before 7.0), or on a Redis Cluster
    /// when the commit's keys and the claim's are not all in one hash slot, the commit and the
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
        redis::StoreContext& store = context();
        std::vector<redis::HeldClaim> held{redis::HeldClaim{std::string(scope),
                                                            std::string(id),
                                                            store.keys.claim(scope, id),
                                                            std::string(fingerprint),
                                                            {},
                                                            {}}};
        if (next.store_ != store_ || !store.claim_with_set.load(std::memory_order_relaxed) ||
            next.state_.holds(scope, id) ||
            !redis::fits_one_call(store, state_, held.front().key)) {
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
        }
        const redis::PreparedCommit prepared = redis::prepare_commit(store, state_);
        const std::vector<redis::Args> sets = redis::set_claims(store, next.state_, held);
        // Until its answer is read, next may hold a lease whose effect has not started: its
        // rollback releases it (by its token) and takes the attempt back.
        next.state_.claim_unanswered(held.front().key);
        redis::CommitReplies replies = redis::commit_and_claim_round_trip(
            store, prepared, sets, store.slot_of(held.front().key));
        try {
            end_commit(redis::conclude_commit(store, state_, replies, prepared.acked_hooks));
        } catch (const store_error&) {
            result.commit_error = std::current_exception();
        }
        try {
            std::optional<ClaimResult> answered =
                redis::read_next_claim(store, next.state_, held, replies.next_claims);
            // Else the SET wrote nothing: the claim script decides, as claim().
            result.next = answered ? std::move(*answered) : next.claim(scope, id, fingerprint);
        } catch (const store_error&) {  // the commit's fate is known: it stays in the result
            result.next_error = std::current_exception();
            return result;
        }
        next.state_.claims_answered();  // a claim now held is in its claims
        return result;
    }

    /// @brief The hash tag (`{scope:id}`) of the claim whose effect is running; empty when there
    /// is none. Append it to the effect's own keys (`"captures:42" + tx.claim_tag()`) and they
    /// share the claim's Cluster slot, so the commit writes them atomically with the claim.
    [[nodiscard]] std::string claim_tag() const { return state_.claim_tag(); }

    /// @brief The token fencing this transaction's leases (for logs and tests).
    [[nodiscard]] const std::string& token() const noexcept { return state_.token(); }
    /// The store that began the transaction.
    [[nodiscard]] RedisStore& store() noexcept { return *store_; }

  private:
    friend class RedisStore;

    explicit Transaction(RedisStore& store)
        : store_(&store),
          state_(redis::new_lease_token(), store.options().lease, store.options().retention) {}

    redis::StoreContext& context() const noexcept { return store_->context_; }
    void active() const {
        if (store_ == nullptr) {
            throw usage_error(
                "idem::RedisStore: the transaction is already committed or rolled back");
        }
    }
    /// Ends a commit: done, or (@p error) rolled back and @p error thrown.
    /// claim_and_commit() when the writes are not all in the claim's Cluster slot: this
    /// transaction claims, and only a new claim under the limit records the outcome and commits
    /// (per slot, as commit()); anything else ends it rolled back, the effect's writes unapplied,
    /// a failed effect's attempt counted by its claim.
    ClaimAndCommitResult claim_then_commit(const ClaimAndCommit& request) {
        ClaimAndCommitResult result;
        result.claim = claim(request.scope, request.message_id, request.fingerprint);
        if (result.claim.status == ClaimStatus::duplicate) {
            result.status = ClaimAndCommitStatus::duplicate;
        } else if (result.claim.status == ClaimStatus::in_progress) {
            result.status = ClaimAndCommitStatus::in_progress;
        } else if (result.claim.attempts.value_or(1) >= request.max_attempts) {
            result.status = ClaimAndCommitStatus::at_limit;
        } else if (request.outcome) {
            record_outcome(request.scope, request.message_id, *request.outcome, request.reason);
            commit();
            return result;  // committed
        }  // else the effect threw: committed means the attempt is counted, the id left free
        rollback();
        return result;
    }

    void end_commit(const std::exception_ptr& error) {
        if (!error) {
            finish();
            return;
        }
        rollback();
        std::rethrow_exception(error);
    }
    /// Releases overlap locks (best effort: they expire anyway) and ends the transaction.
    void finish() noexcept {
        RedisStore* store = std::exchange(store_, nullptr);
        if (store == nullptr) return;
        for (const auto& key : state_.locks()) {
            try {
                store->release_lock(key, state_.token());
            } catch (...) {  // expires by itself
            }
        }
        state_.clear();
    }

    RedisStore* store_;
    redis::TransactionState state_;
};

inline RedisStore::Transaction RedisStore::begin() {
    return Transaction(*this);
}

IDEM_END_NAMESPACE
