#pragma once
/// @file
/// @brief idem::PostgresOptions: how PostgresStore uses its connection (included by
/// idem/store/postgres.hpp).

#include <chrono>
#include <functional>
#include <string>
#include <string_view>

#include "idem/config.hpp"
#include "idem/contract/store.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief How PostgresStore uses its connection.
struct PostgresOptions {
    /// `SET LOCAL lock_timeout` of every idem transaction: how long a claim waits for another
    /// transaction holding the same id (→ ClaimStatus::in_progress) and any statement waits for
    /// a row lock (→ store_timeout). 0 waits without limit (PostgreSQL's meaning).
    std::chrono::milliseconds lock_timeout{5000};
    /// Schema of the idem tables (created if missing); quoted, so any name works.
    std::string schema = "public";
    /// Prepare idem's and the effect's statements once per session. Switch off behind a pooler
    /// in transaction mode that cannot keep prepared statements (PgBouncer before 1.21).
    bool prepare_statements = true;
    /// Claims kept in one partition per span of claimed_at (PostgreSQL 11+ declarative range
    /// partitions, UTC-aligned: 24 h gives a partition per day), so that purge() drops whole
    /// partitions instead of deleting rows one by one. 0 (the default): one table, purge()
    /// deletes rows. A store given a span converts an existing unpartitioned table once (the
    /// table becomes its first partition, dropped when all of it has expired); a store opened
    /// on partitioned claims uses them whatever its own setting. See docs/postgres.md.
    std::chrono::minutes claim_partition_span{0};
    /// Partitions kept created beyond the current one, at least 1: the store adds them ahead
    /// of time (at open, before a transaction once the clock nears the last one, and in
    /// purge()), so that no claim waits for one.
    int claim_partitions_ahead = 3;
    /// Time source for claimed_at / created_at / purge() / locks / outbox; empty = system_clock.
    Clock clock{};
    /// Receives the server's notices and warnings on the store's connection (`RAISE NOTICE` in
    /// the effect's SQL, a `WARNING` …): the message as libpq formats it, severity first
    /// (`NOTICE:  hello`), without its final newline. Called on the thread running the
    /// statement, from inside libpq and usually under the store's mutex: it must not use the
    /// store or its connection; an exception it throws is dropped.
    ///
    /// - A connection the store opens: notices go here; when this is empty they are dropped
    ///   (libpq would print them on stderr).
    /// - A borrowed connection: when this is empty the store leaves the connection's notice
    ///   handling alone. When it is set, the store installs its notice receiver for its lifetime
    ///   (PQsetNoticeReceiver), forwards each notice here and then to the connection's notice
    ///   processor if the consumer had installed one (PQsetNoticeProcessor; libpq's default one,
    ///   which prints on stderr, is not called), and reinstalls libpq's receiver in its
    ///   destructor; the processor itself is never touched. A connection whose notice
    ///   *receiver* the consumer replaced is left alone (libpq cannot hand back that receiver's
    ///   argument, so it could be neither chained nor restored): its receiver gets the notices
    ///   and this is not called.
    ///
    /// A PGresult the consumer made on the borrowed connection while the store lived keeps the
    /// store's receiver for libpq's own warnings about it (a row number out of range): do not
    /// misuse such a result after the store is gone.
    std::function<void(std::string_view)> on_notice{};
};

IDEM_END_NAMESPACE
