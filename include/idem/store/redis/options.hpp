#pragma once
/// @file
/// @brief idem::RedisOptions: how RedisStore uses Redis (leases, retention, pool, persistence
/// check, replicas), and idem::RedisPersistence, what its persistence check found (included by
/// idem/store/redis.hpp).

#include <chrono>
#include <cstddef>
#include <string>

#include "idem/config.hpp"
#include "idem/contract/store.hpp"
#include "idem/policy.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief How RedisStore uses Redis.
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
    /// How long a call waits for a connection when max_connections are in use, before
    /// store_timeout.
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
    /// INFO persistence said aof_enabled:1 (AOF on).
    bool aof_enabled = false;
    /// `CONFIG GET appendfsync` (always, everysec, no); empty when CONFIG is disabled or renamed.
    std::string appendfsync{};
};

IDEM_END_NAMESPACE
