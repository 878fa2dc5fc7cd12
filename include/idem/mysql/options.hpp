#pragma once
/// @file
/// @brief idem::MysqlEndpoint and idem::MysqlOptions: where MysqlStore connects and how it uses
/// its connection (included by idem/store/mysql.hpp).

#include <chrono>
#include <optional>
#include <string>

#include "idem/config.hpp"
#include "idem/contract/store.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief A MySQL / MariaDB server and database for a connection the store opens and owns.
struct MysqlEndpoint {
    std::string host = "127.0.0.1";  ///< ignored when unix_socket is set
    /// The TCP port (ignored when unix_socket is set).
    unsigned port = 3306;
    /// The user to log in as.
    std::string user;
    std::string password;  ///< never repeated in messages
    std::string database;  ///< required: the idem tables live here, beside the effect's own
    /// A Unix socket path to connect through instead of TCP; empty: TCP.
    std::string unix_socket{};
};

/// @brief Transaction isolation for the store's sessions (`SET SESSION TRANSACTION ISOLATION
/// LEVEL …`); empty leaves the server's / session's own (InnoDB: REPEATABLE READ).
enum class MysqlIsolation { read_committed, repeatable_read };

/// @brief How MysqlStore uses its connection.
struct MysqlOptions {
    /// `SET SESSION innodb_lock_wait_timeout` (whole seconds, at least 1), once per session (a
    /// reconnect is a new one), on an owned or a borrowed connection: how long a claim waits
    /// for another transaction holding the same id (→ ClaimStatus::in_progress) and any
    /// statement waits for a row lock (→ store_timeout). Keep it below the broker's visibility
    /// timeout and below read_timeout.
    std::chrono::seconds lock_wait_timeout{5};
    /// Isolation of every transaction on the store's sessions; empty: the session's own.
    std::optional<MysqlIsolation> isolation{};
    /// Owned connections: MYSQL_OPT_CONNECT_TIMEOUT, MYSQL_OPT_READ_TIMEOUT and
    /// MYSQL_OPT_WRITE_TIMEOUT (a silent partition becomes an error instead of a hang).
    std::chrono::seconds connect_timeout{5};
    /// MYSQL_OPT_READ_TIMEOUT; 0: the client library's default. Must exceed lock_wait_timeout, or a
    /// claim waiting for a row lock would be cut off as a lost connection.
    std::chrono::seconds read_timeout{30};
    /// MYSQL_OPT_WRITE_TIMEOUT; 0: the client library's default.
    std::chrono::seconds write_timeout{30};
    /// Claims kept in one range partition per span of claimed_at (UTC-aligned: 24 h gives a
    /// partition per day), so that purge() drops whole partitions instead of deleting rows one
    /// by one. 0 (the default): one table, purge() deletes rows. A store given a span converts
    /// the claims once (an ALTER TABLE that copies them: their rows become the first
    /// partition's); a store opened on partitioned claims uses them whatever its own setting.
    /// MariaDB only (`ALTER TABLE ... NOWAIT`). See docs/mysql.md.
    std::chrono::minutes claim_partition_span{0};
    /// Partitions kept created beyond the current one, at least 1: the store adds them ahead
    /// of time (at open, before a transaction once the clock nears the last one, and in
    /// purge()), so that no claim waits for one.
    int claim_partitions_ahead = 3;
    /// Time source for claimed_at / created_at / purge() / locks / outbox; empty = system_clock.
    Clock clock{};
};

IDEM_END_NAMESPACE
