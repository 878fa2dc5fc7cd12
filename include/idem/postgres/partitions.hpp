#pragma once
/// @file
/// @brief idem::postgres::Partitions: the claims of PostgresStore in declarative range
/// partitions of claimed_at (PostgresOptions::claim_partition_span), so that retention drops
/// whole partitions instead of deleting rows. Creating them (and converting an unpartitioned
/// table once), keeping some ahead of the clock, and dropping the expired ones for purge().
/// Mixed into postgres::Driver (postgres/driver.hpp), whose connection it uses. Link
/// idem::postgres.
///
/// A unique index of a partitioned table must contain the partition key, so no index says that
/// an id is claimed once across partitions. The claims (postgres/claims.hpp) keep that promise
/// instead with the id's transaction-scoped advisory lock, taken before an INSERT that looks in
/// every partition: two transactions claiming one id serialize on the lock, and the second's
/// INSERT, a new statement, sees the first's committed claim.

#include <libpq-fe.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/postgres/libpq.hpp"
#include "idem/postgres/options.hpp"
#include "idem/sql/partitions.hpp"

IDEM_BEGIN_NAMESPACE
namespace postgres {

/// One partition of the claims (the name is its table's, in the store's schema).
using ClaimPartition = sql::ClaimPartition;

/// The bounds of a range partition as pg_get_expr() writes them
/// (`FOR VALUES FROM ('1') TO ('2')`, `FROM (MINVALUE)`). @return false for any other text.
inline bool parse_partition_bounds(std::string_view text, ClaimPartition& partition) {
    const auto bound = [&](std::string_view keyword, std::int64_t& out) {
        const auto at = text.find(keyword);
        if (at == std::string_view::npos) return false;
        std::string_view rest = text.substr(at + keyword.size());
        const auto close = rest.find(')');
        if (close == std::string_view::npos) return false;
        rest = rest.substr(0, close);
        if (rest == "MINVALUE") {
            out = std::numeric_limits<std::int64_t>::min();
            return true;
        }
        if (rest == "MAXVALUE") {
            out = std::numeric_limits<std::int64_t>::max();
            return true;
        }
        if (rest.size() >= 2 && rest.front() == '\'' && rest.back() == '\'')
            rest = rest.substr(1, rest.size() - 2);
        try {
            std::size_t used = 0;
            out = std::stoll(std::string(rest), &used);
            return used == rest.size();
        } catch (const std::exception&) {
            return false;
        }
    };
    return bound("FROM (", partition.from) && bound("TO (", partition.to);
}

/// The table of the partition starting at @p from_ms: `idem_claims_p` and its UTC start,
/// `idem_claims_p20261205_0000`.
inline std::string claim_partition_name(std::int64_t from_ms) {
    return "idem_claims_p" + sql::claim_partition_stamp(from_ms);
}

/// @brief The claim partitions of postgres::Driver @p D (a base of it, which it befriends).
template <class D>
class Partitions {
  public:
    /// Whether the claims are partitioned (the table decides, once open_claim_partitions() ran).
    [[nodiscard]] bool claims_partitioned() const noexcept { return span_ms_ > 0; }

    /// After the schema: converts the claims to partitions when a span is asked for and they
    /// are not yet, learns whether they are, and creates the partitions from @p now's on.
    void open_claim_partitions(std::int64_t now);
    /// Before a transaction: once @p now nears the last partition, creates the next ones. A
    /// failure while the current partition still has room is retried later; once the claims
    /// would have no partition, it throws (store_unavailable, store_timeout).
    void keep_claim_partitions_ahead(std::int64_t now);
    /// For purge(): the partitions ahead kept, then the ones whose every claim is before @p
    /// cutoff (their `to` at or before it), oldest first.
    std::vector<ClaimPartition> expired_claim_partitions(std::int64_t now, std::int64_t cutoff);
    /// Drops @p partition in a transaction of its own. @return the claims it held. DROP takes
    /// the claims table's ACCESS EXCLUSIVE lock, so it waits for the transactions using it and
    /// new ones wait behind it: it waits at most 100 ms at a time, a few times, then throws
    /// store_timeout (the next purge drops it).
    std::size_t drop_claim_partition(const ClaimPartition& partition);

    /// A claim found the claims table not as this store knew it (another process converted it
    /// to partitions: no unique index for its ON CONFLICT); the next transaction learns it anew.
    void claims_table_changed() noexcept { relearn_ = true; }

  protected:
    /// From PostgresOptions (validated here). @throws usage_error.
    void configure_partitions(const PostgresOptions& options) {
        wanted_span_ms_ = sql::checked_partition_span("postgres", options.claim_partition_span,
                                                      options.claim_partitions_ahead);
        ahead_ = options.claim_partitions_ahead;
    }

  private:
    D& driver() noexcept { return static_cast<D&>(*this); }
    [[nodiscard]] std::string claims_table() { return driver().table_prefix_ + "idem_claims"; }

    [[nodiscard]] std::int64_t align_down(std::int64_t at) const noexcept {
        return sql::align_to_span(at, span_ms_);
    }
    /// 'p' (partitioned), 'r' (a table) or "" (none) for the claims table.
    std::string claims_kind();
    std::vector<ClaimPartition> list_partitions();
    /// In a transaction holding the schema's advisory lock, @p lock_timeout long at most.
    template <class Body>
    void in_schema_transaction(std::string_view what, std::chrono::milliseconds lock_timeout,
                               Body&& body);
    /// The claims as partitions, the existing rows in the first one (inside the schema lock).
    void convert_claims(std::int64_t now);
    /// Creates the partitions that [align_down(now), + (ahead + 1) spans) lacks (inside the
    /// schema lock).
    void add_partitions(std::int64_t now);
    /// A partition analyzed while it was empty (an ANALYZE of the whole claims table analyzes
    /// the ones made ahead, and the current one if it has no claim yet) makes PostgreSQL plan
    /// the claims' lookups in it as sequential scans, and a cached plan keeps them while the
    /// partition fills. When the current partition holds claims and its statistics still say
    /// empty, it is analyzed, which also replans the cached statements.
    void check_current_statistics(std::int64_t now);
    void exec(const std::string& sql, std::string_view what) {
        driver().run(driver().control(sql, what));
    }

    std::int64_t wanted_span_ms_ = 0;  // asked for (0: no partitions unless there are)
    int ahead_ = 3;
    std::int64_t span_ms_ = 0;  // in use (0: the claims are one table)
    std::int64_t covered_until_ = std::numeric_limits<std::int64_t>::min();
    std::int64_t refresh_at_ = std::numeric_limits<std::int64_t>::min();
    std::int64_t statistics_check_at_ = std::numeric_limits<std::int64_t>::min();
    bool relearn_ = false;  // claims_table_changed()
};

template <class D>
std::string Partitions<D>::claims_kind() {
    D& d = driver();
    Result kind =
        d.run(d.adhoc("SELECT c.relkind::text FROM pg_catalog.pg_class c "
                      "WHERE c.oid = to_regclass($1)",
                      "reading the idem claims table", claims_table()));
    if (PQntuples(kind.get()) < 1) return "";
    return bytes_of(kind.get(), 0, 0);
}

template <class D>
std::vector<ClaimPartition> Partitions<D>::list_partitions() {
    D& d = driver();
    Result rows = d.run(d.adhoc(
        "SELECT c.relname::text, pg_get_expr(c.relpartbound, c.oid) FROM pg_catalog.pg_inherits i "
        "JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass($1)",
        "listing the idem claim partitions", claims_table()));
    std::vector<ClaimPartition> partitions;
    for (int row = 0; row < PQntuples(rows.get()); ++row) {
        ClaimPartition partition;
        partition.name = bytes_of(rows.get(), row, 0);
        const std::string bounds = bytes_of(rows.get(), row, 1);
        if (!parse_partition_bounds(bounds, partition)) {
            throw store_error(fmt::format(
                "idem postgres: the claim partition {} has bounds idem does not understand ({}); "
                "only range partitions of claimed_at are supported",
                partition.name, bounds));
        }
        partitions.push_back(std::move(partition));
    }
    std::sort(partitions.begin(), partitions.end(),
              [](const ClaimPartition& a, const ClaimPartition& b) { return a.from < b.from; });
    return partitions;
}

template <class D>
template <class Body>
void Partitions<D>::in_schema_transaction(std::string_view what,
                                          std::chrono::milliseconds lock_timeout, Body&& body) {
    D& d = driver();
    d.ready(what);
    try {
        exec("BEGIN", what);
        exec(fmt::format("SET LOCAL lock_timeout = {}", lock_timeout.count()), what);
        exec("SET LOCAL client_min_messages = warning", what);
        d.run(d.adhoc("SELECT pg_advisory_xact_lock($1::bigint)", what,
                      advisory_key("idem schema", d.schema_)));
        body();
        exec("COMMIT", what);
    } catch (...) {
        d.rollback_noexcept();
        throw;
    }
}

template <class D>
void Partitions<D>::open_claim_partitions(std::int64_t now) {
    D& d = driver();
    d.ready("opening the idem claim partitions");
    std::string kind = claims_kind();
    if (kind == "r" && wanted_span_ms_ > 0) {
        if (PQserverVersion(d.conn()) < 110000) {
            throw usage_error(fmt::format(
                "idem postgres: claim_partition_span needs PostgreSQL 11 or newer (indexes on "
                "partitioned tables); this server is version {}",
                PQserverVersion(d.conn())));
        }
        span_ms_ = wanted_span_ms_;
        in_schema_transaction("converting the idem claims to partitions", d.lock_timeout_, [&] {
            if (claims_kind() == "r") convert_claims(now);  // else another process did
        });
        kind = claims_kind();
    }
    if (kind != "p") {
        span_ms_ = 0;
        return;
    }
    // Partitioned: by the span asked for, else the newest partition's.
    span_ms_ = wanted_span_ms_;
    if (span_ms_ == 0) {
        for (const ClaimPartition& partition : list_partitions()) {
            if (partition.from != std::numeric_limits<std::int64_t>::min() &&
                partition.to != std::numeric_limits<std::int64_t>::max())
                span_ms_ = partition.to - partition.from;
        }
        if (span_ms_ <= 0) span_ms_ = 24 * 3600 * 1000;
    }
    refresh_at_ = std::numeric_limits<std::int64_t>::min();
    keep_claim_partitions_ahead(now);
}

template <class D>
void Partitions<D>::convert_claims(std::int64_t now) {
    D& d = driver();
    const std::string table = claims_table();
    const std::string& prefix = d.table_prefix_;
    const std::string what = "converting the idem claims to partitions";
    // No claim goes in (or is read) while the rows move under the new table.
    exec("LOCK TABLE " + table + " IN ACCESS EXCLUSIVE MODE", what);
    Result newest = d.run(d.adhoc("SELECT max(claimed_at)::bigint FROM " + table, what));
    std::string legacy;  // the old table, kept as the first partition when it holds claims
    std::int64_t first_new = 0;
    if (PQgetisnull(newest.get(), 0, 0) != 0) {
        exec("DROP TABLE " + table, what);
    } else {
        // The old table becomes the partition of everything before the first new one, which
        // starts after its newest claim (and not before now).
        const std::int64_t last = std::max(binary_int(newest.get(), 0, 0) + 1, now);
        first_new = align_down(last - 1) + span_ms_;
        legacy = "idem_claims_p_before_" +
                 claim_partition_name(first_new).substr(sizeof "idem_claims_p" - 1);
        exec("ALTER TABLE " + table + " RENAME TO " + quote_identifier(legacy), what);
        exec("ALTER TABLE " + prefix + quote_identifier(legacy) +
                 " RENAME CONSTRAINT idem_claims_pkey TO " + quote_identifier(legacy + "_pkey"),
             what);
        exec("ALTER INDEX IF EXISTS " + prefix + "idem_claims_claimed_at RENAME TO " +
                 quote_identifier(legacy + "_claimed_at"),
             what);
    }
    exec("CREATE TABLE " + table +
             "(scope BYTEA NOT NULL, message_id BYTEA NOT NULL, claimed_at BIGINT NOT NULL, "
             "outcome TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '', "
             "fingerprint BYTEA NOT NULL DEFAULT ''::bytea) PARTITION BY RANGE (claimed_at)",
         what);
    exec("CREATE INDEX idem_claims_message ON " + table + "(scope, message_id)", what);
    if (!legacy.empty()) {
        exec(fmt::format("ALTER TABLE {} ATTACH PARTITION {}{} FOR VALUES FROM (MINVALUE) TO ({})",
                         table, prefix, quote_identifier(legacy), first_new),
             what);
    }
    add_partitions(now);
}

template <class D>
void Partitions<D>::add_partitions(std::int64_t now) {
    D& d = driver();
    const std::string table = claims_table();
    const std::string what = "creating idem claim partitions";
    const std::vector<ClaimPartition> partitions = list_partitions();
    const std::int64_t end = align_down(now) + (ahead_ + 1) * span_ms_;
    std::int64_t at = align_down(now);
    while (at < end) {
        const auto holder = std::find_if(partitions.begin(), partitions.end(),
                                         [&](const auto& p) { return p.from <= at && at < p.to; });
        if (holder != partitions.end()) {
            at = holder->to;
            continue;
        }
        // Up to the span's end, or the next partition's start when it comes first.
        std::int64_t to = align_down(at) + span_ms_;
        for (const ClaimPartition& p : partitions) {
            if (p.from > at) to = std::min(to, p.from);
        }
        const std::string name = claim_partition_name(at);
        // Created alone, then attached: ATTACH takes a lock that lets the claims go on
        // (SHARE UPDATE EXCLUSIVE), CREATE ... PARTITION OF would stop them (ACCESS EXCLUSIVE).
        exec("CREATE TABLE " + d.table_prefix_ + quote_identifier(name) + " (LIKE " + table +
                 " INCLUDING DEFAULTS)",
             what);
        exec(fmt::format("ALTER TABLE {} ATTACH PARTITION {}{} FOR VALUES FROM ({}) TO ({})", table,
                         d.table_prefix_, quote_identifier(name), at, to),
             what);
        at = to;
    }
    covered_until_ = end;
    refresh_at_ = end - std::max<std::int64_t>(ahead_ * span_ms_ / 2, 1);
}

template <class D>
void Partitions<D>::keep_claim_partitions_ahead(std::int64_t now) {
    if (relearn_) {
        relearn_ = false;
        open_claim_partitions(now);
    }
    if (span_ms_ == 0) return;
    if (now >= statistics_check_at_) check_current_statistics(now);
    if (now < refresh_at_) return;
    D& d = driver();
    try {
        in_schema_transaction("creating idem claim partitions", d.lock_timeout_,
                              [&] { add_partitions(now); });
    } catch (const store_error&) {
        // The claims still have a partition: try again in a while.
        if (now < covered_until_) {
            refresh_at_ = now + std::min<std::int64_t>(span_ms_ / 10, 60'000);
            return;
        }
        throw;
    }
}

template <class D>
void Partitions<D>::check_current_statistics(std::int64_t now) {
    D& d = driver();
    // Looked at again a second later: one catalog query, so an ANALYZE of the whole table
    // costs the claims at most a second of sequential scans.
    statistics_check_at_ = now + 1000;
    const std::string table =
        d.table_prefix_ + quote_identifier(claim_partition_name(align_down(now)));
    const std::string what = "checking the current claim partition's statistics";
    try {
        d.ready(what);
        Result found =
            d.run(d.adhoc("SELECT c.reltuples::float8 = 0 FROM pg_catalog.pg_class c "
                          "WHERE c.oid = to_regclass($1)",
                          what, table));
        // Not ours (the converted table), or planned as not empty: nothing to do.
        if (PQntuples(found.get()) < 1 || !binary_bool(found.get(), 0, 0)) return;
        Result rows = d.run(d.adhoc("SELECT EXISTS (SELECT 1 FROM " + table + ")", what));
        if (!binary_bool(rows.get(), 0, 0)) return;  // still empty
        exec("ANALYZE " + table, what);
    } catch (const store_error&) {
        // Not the owner, or the server is away: the claims go on; asked again later.
    }
}

template <class D>
std::vector<ClaimPartition> Partitions<D>::expired_claim_partitions(std::int64_t now,
                                                                    std::int64_t cutoff) {
    if (span_ms_ == 0) return {};
    refresh_at_ = std::numeric_limits<std::int64_t>::min();
    keep_claim_partitions_ahead(now);
    driver().ready("purge (claim partitions)");
    std::vector<ClaimPartition> expired;
    for (ClaimPartition& partition : list_partitions()) {
        if (partition.to <= cutoff) expired.push_back(std::move(partition));
    }
    return expired;
}

template <class D>
std::size_t Partitions<D>::drop_claim_partition(const ClaimPartition& partition) {
    D& d = driver();
    const std::string what = "purge (dropping a claim partition)";
    const std::string table = d.table_prefix_ + quote_identifier(partition.name);
    const auto wait = std::min<std::chrono::milliseconds>(
        d.lock_timeout_.count() > 0 ? d.lock_timeout_ : std::chrono::milliseconds(100),
        std::chrono::milliseconds(100));
    for (int attempt = 1;; ++attempt) {
        std::size_t claims = 0;
        try {
            in_schema_transaction(what, wait, [&] {
                Result count = d.run(d.adhoc("SELECT count(*)::bigint FROM " + table, what));
                claims = static_cast<std::size_t>(binary_int(count.get(), 0, 0));
                exec("DROP TABLE " + table, what);
            });
            return claims;
        } catch (const store_timeout&) {
            if (attempt >= 10) throw;
            std::this_thread::sleep_for(std::chrono::milliseconds(20) * attempt);
        }
    }
}

}  // namespace postgres
IDEM_END_NAMESPACE
