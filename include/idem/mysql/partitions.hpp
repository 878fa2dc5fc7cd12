#pragma once
/// @file
/// @brief idem::mysql::Partitions: the claims of MysqlStore in range partitions of claimed_at
/// (MysqlOptions::claim_partition_span; MariaDB), so that retention drops whole partitions
/// instead of deleting rows. Converting the claims once, claiming under a bucket lock, keeping
/// partitions ahead of the clock, and dropping the expired ones for purge(). Mixed into
/// mysql::Driver (mysql/driver.hpp), whose connection it uses. Link idem::mysql.
///
/// A unique key of a partitioned InnoDB table must contain the partition column, so no key says
/// that an id is claimed once across partitions. A claim first locks its id's bucket, one of
/// 65,536 rows of idem_claim_locks chosen by the id's hash (an existing row of a primary key:
/// InnoDB locks that row only, no gap), then reads whether a partition holds the id and inserts
/// it if none does. Two transactions claiming one id serialize on the bucket. The read must see
/// the latest commit: under READ COMMITTED every read does; under REPEATABLE READ a plain read
/// sees the snapshot of the transaction's first one, so the claim's read is plain only while no
/// read ran before the bucket lock in its transaction (the snapshot is taken after the lock),
/// and a locking read otherwise. A locking read of a missing key takes a gap lock, and two such
/// claims of different ids in one gap deadlock on their inserts (InnoDB rolls one back: failed,
/// redelivered), which is why it is only the fallback.
///
/// The partitioned table's claim_key is an ordinary column the claim writes, checked by a
/// constraint: an insert that does not write it (an idem from before partitions, whose upsert
/// relies on the unique key the partitions lack) is refused instead of claiming an id twice.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "idem/blob.hpp"
#include "idem/config.hpp"
#include "idem/contract/store.hpp"
#include "idem/error.hpp"
#include "idem/mysql/errors.hpp"
#include "idem/mysql/options.hpp"
#include "idem/sql/own_claims.hpp"
#include "idem/sql/partitions.hpp"
#include "idem/sql/statements.hpp"
#include "idem/sql/stored_outcome.hpp"
#include "idem/sql/support.hpp"

IDEM_BEGIN_NAMESPACE
namespace mysql {

/// The rows of idem_claim_locks: a claim locks the one of its id's bucket.
inline constexpr int claim_lock_buckets = 65536;

/// @brief The claim partitions of mysql::Driver @p D (a base of it, which it befriends).
template <class D>
class Partitions {
  public:
    /// Whether the claims are partitioned (the table decides, once open_claim_partitions() ran).
    [[nodiscard]] bool claims_partitioned() const noexcept { return span_ms_ > 0; }

    /// After the schema: converts the claims to partitions when a span is asked for and they
    /// are not yet, learns whether they are, and adds the partitions from @p now's on.
    void open_claim_partitions(std::int64_t now);
    /// Before a transaction: once @p now nears the last partition, adds the next ones. A
    /// failure while the claims still have room is retried later; once they would have none,
    /// it throws (store_unavailable, store_timeout).
    void keep_claim_partitions_ahead(std::int64_t now);
    /// For purge(): the partitions ahead kept, then the ones whose every claim is before @p
    /// cutoff (their `to` at or before it), oldest first.
    std::vector<sql::ClaimPartition> expired_claim_partitions(std::int64_t now,
                                                              std::int64_t cutoff);
    /// Drops @p partition (`ALTER TABLE ... DROP PARTITION`). @return the claims it held. The
    /// ALTER needs the claims table's metadata lock, which every transaction that used the
    /// table holds until it ends, and new ones wait behind a waiting ALTER: it asks without
    /// waiting (NOWAIT) a few times, then waits at most a second, then throws store_timeout
    /// (the next purge drops it).
    std::size_t drop_claim_partition(const sql::ClaimPartition& partition);

    /// A claim found the claims table not as this store knew it (another process converted it
    /// to partitions); the next transaction learns it anew.
    void claims_table_changed() noexcept { relearn_ = true; }

  protected:
    /// From MysqlOptions (validated here). @throws usage_error.
    void configure_partitions(const MysqlOptions& options) {
        wanted_span_ms_ = sql::checked_partition_span("mysql", options.claim_partition_span,
                                                      options.claim_partitions_ahead);
        ahead_ = options.claim_partitions_ahead;
    }

    /// claim() on partitioned claims: the bucket lock, then the read and the insert.
    ClaimResult claim_in_partitions(sql::OwnClaims& own, std::string_view scope,
                                    std::string_view id, std::string_view fingerprint,
                                    std::int64_t now) {
        const bool latest = reads_latest();
        if (!lock_buckets(scope, {id})) return in_progress();
        return read_and_insert(own, scope, id, fingerprint, now, latest);
    }

    /// claim_many() on partitioned claims: every new id's bucket locked in one statement, in
    /// bucket order (two batches wait on one another in one order, never in a cycle), then each
    /// id read and inserted. A lock wait past the timeout falls back to one claim at a time.
    std::vector<ClaimResult> claim_many_in_partitions(sql::OwnClaims& own, std::string_view scope,
                                                      const std::vector<std::string_view>& ids,
                                                      const std::vector<std::string>& fingerprints,
                                                      std::int64_t now);

  private:
    D& driver() noexcept { return static_cast<D&>(*this); }
    [[nodiscard]] std::int64_t align_down(std::int64_t at) const noexcept {
        return sql::align_to_span(at, span_ms_);
    }
    static ClaimResult in_progress() {
        ClaimResult result;
        result.status = ClaimStatus::in_progress;
        return result;
    }
    /// Whether a plain read sees the latest commit: READ COMMITTED, or no read yet in this
    /// REPEATABLE READ transaction (its snapshot is taken by the claim's read, after the lock).
    [[nodiscard]] bool reads_latest() {
        D& d = driver();
        return !d.snapshot_taken_ || d.options_.isolation == MysqlIsolation::read_committed;
    }
    /// Locks the buckets of @p ids. @return false when the wait reached the lock timeout.
    bool lock_buckets(std::string_view scope, const std::vector<std::string_view>& ids);
    ClaimResult read_and_insert(sql::OwnClaims& own, std::string_view scope, std::string_view id,
                                std::string_view fingerprint, std::int64_t now, bool latest);

    /// The partitions, in order (empty: the claims are one table).
    std::vector<sql::ClaimPartition> list_partitions();
    /// The claims as partitions, the existing rows in the first one, and the bucket locks'
    /// table (inside the schema's named lock).
    void convert_claims(std::int64_t now);
    /// Adds the partitions that [align_down(now), + (ahead + 1) spans) lacks after the last
    /// one; waits for the metadata lock (a second at most) only when @p wait.
    void add_partitions(std::int64_t now, bool wait);
    /// `PARTITION p<stamp> VALUES LESS THAN (<to>)`, comma-separated, for [from, end): a span
    /// each from @p now's on, and before it one partition for the whole gap (a store idle for
    /// a year adds one, not 365, and purge() drops one).
    [[nodiscard]] std::string partition_list(std::int64_t from, std::int64_t end,
                                             std::int64_t now) const;
    std::int64_t run(const std::string& sql, std::string_view what) {
        return driver().must(sql, D::Kind::idem, what, sql::no_rows{});
    }

    std::int64_t wanted_span_ms_ = 0;  // asked for (0: no partitions unless there are)
    int ahead_ = 3;
    std::int64_t span_ms_ = 0;  // in use (0: the claims are one table)
    std::int64_t covered_until_ = std::numeric_limits<std::int64_t>::min();
    std::int64_t refresh_at_ = std::numeric_limits<std::int64_t>::min();
    bool relearn_ = false;  // claims_table_changed()
};

template <class D>
bool Partitions<D>::lock_buckets(std::string_view scope, const std::vector<std::string_view>& ids) {
    D& d = driver();
    std::string sql;
    if (ids.size() == 1) {
        sql = d.render_own(sql::stmt::claim_lock, Blob{scope}, Blob{ids.front()});
    } else {
        std::vector<std::string> buckets;
        buckets.reserve(ids.size());
        const std::string scope_literal = d.literal(Blob{scope});
        for (std::string_view id : ids)
            buckets.push_back(sql::mysql_claim_bucket(scope_literal, d.literal(Blob{id})));
        sql = fmt::format(
            "SELECT bucket FROM idem_claim_locks WHERE bucket IN ({}) ORDER BY bucket FOR UPDATE",
            fmt::join(buckets, ", "));
    }
    std::int64_t rows = 0;
    const unsigned code = d.exec(sql, sql::no_rows{}, rows);
    if (code == er_lock_wait_timeout) return false;
    if (code != 0) d.raise(code, D::Kind::idem, "claim (the ids' bucket locks)", {});
    if (rows < 1) {
        throw store_error(
            "idem mysql: claim: idem_claim_locks lacks the id's bucket row; the partitioned "
            "claims' lock table was changed by hand (it holds one row per bucket, 0 to 65535)");
    }
    return true;
}

template <class D>
ClaimResult Partitions<D>::read_and_insert(sql::OwnClaims& own, std::string_view scope,
                                           std::string_view id, std::string_view fingerprint,
                                           std::int64_t now, bool latest) {
    D& d = driver();
    std::optional<ClaimResult> stored;
    d.must(d.render_own(latest ? sql::stmt::claim_outcome_locked : sql::stmt::claim_outcome,
                        Blob{scope}, Blob{id}),
           D::Kind::idem, "claim (reading the recorded outcome)", [&](const auto& row) {
               if (!stored) stored = sql::stored_duplicate(row.bytes(0), row.bytes(1), D::name);
           });
    d.snapshot_taken_ = true;
    if (stored) return *stored;
    d.must(
        d.render_own(sql::stmt::claim_insert_locked, Blob{scope}, Blob{id}, now, Blob{fingerprint}),
        D::Kind::idem, "claim", sql::no_rows{});
    own.add(scope, id, fingerprint);
    return ClaimResult{};  // claimed
}

template <class D>
std::vector<ClaimResult> Partitions<D>::claim_many_in_partitions(
    sql::OwnClaims& own, std::string_view scope, const std::vector<std::string_view>& ids,
    const std::vector<std::string>& fingerprints, std::int64_t now) {
    D& d = driver();
    const bool latest = reads_latest();
    std::vector<std::string_view> fresh;  // not claimed by this transaction yet
    fresh.reserve(ids.size());
    for (std::string_view id : ids) {
        if (own.find(scope, id) == nullptr) fresh.push_back(id);
    }
    if (!fresh.empty() && !lock_buckets(scope, fresh)) {
        // Which bucket is held elsewhere, the error does not say: one id at a time (the
        // buckets locked already stay locked; the held one waits once more).
        return sql::claim_each(d, own, scope, ids, fingerprints, now);
    }
    std::vector<ClaimResult> results(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
        if (const auto* mine = own.find(scope, ids[i])) {
            results[i] = sql::OwnClaims::duplicate_of(*mine);
        } else {
            const std::string_view fingerprint =
                fingerprints.empty() ? std::string_view() : std::string_view(fingerprints[i]);
            results[i] = read_and_insert(own, scope, ids[i], fingerprint, now, latest);
        }
    }
    return results;
}

template <class D>
std::vector<sql::ClaimPartition> Partitions<D>::list_partitions() {
    D& d = driver();
    std::vector<sql::ClaimPartition> partitions;
    d.must(
        "SELECT PARTITION_NAME, PARTITION_DESCRIPTION FROM information_schema.PARTITIONS "
        "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'idem_claims' AND PARTITION_NAME IS "
        "NOT NULL ORDER BY PARTITION_ORDINAL_POSITION",
        D::Kind::idem, "listing the idem claim partitions", [&](const auto& row) {
            sql::ClaimPartition partition;
            partition.name = row.bytes(0);
            if (!partitions.empty()) partition.from = partitions.back().to;
            const std::string bound = row.bytes(1);
            if (bound != "MAXVALUE") {
                try {
                    std::size_t used = 0;
                    partition.to = std::stoll(bound, &used);
                    if (used != bound.size()) throw std::invalid_argument(bound);
                } catch (const std::exception&) {
                    throw store_error(fmt::format(
                        "idem mysql: the claim partition {} has a bound idem does not understand "
                        "({}); only range partitions of claimed_at are supported",
                        partition.name, bound));
                }
            }
            partitions.push_back(std::move(partition));
        });
    return partitions;
}

template <class D>
std::string Partitions<D>::partition_list(std::int64_t from, std::int64_t end,
                                          std::int64_t now) const {
    std::string out;
    for (std::int64_t at = from; at < end;) {
        const std::int64_t to = std::max(align_down(at) + span_ms_, align_down(now));
        out += fmt::format("{}PARTITION p{} VALUES LESS THAN ({})", out.empty() ? "" : ", ",
                           sql::claim_partition_stamp(at), to);
        at = to;
    }
    return out;
}

template <class D>
void Partitions<D>::open_claim_partitions(std::int64_t now) {
    D& d = driver();
    const std::string what = "opening the idem claim partitions";
    d.ready(what);
    std::vector<sql::ClaimPartition> partitions = list_partitions();
    if (partitions.empty() && wanted_span_ms_ > 0) {
        span_ms_ = wanted_span_ms_;
        d.begin_schema_change();
        try {
            if (list_partitions().empty()) convert_claims(now);  // else another process did
            d.commit_schema_change();
        } catch (...) {
            d.rollback_noexcept();
            throw;
        }
        partitions = list_partitions();
    }
    if (partitions.empty()) {
        span_ms_ = 0;
        return;
    }
    // Partitioned: by the span asked for, else the last bounded partition's.
    span_ms_ = wanted_span_ms_;
    if (span_ms_ == 0) {
        for (const sql::ClaimPartition& partition : partitions) {
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
    const std::string what = "converting the idem claims to partitions";
    // The buckets first: a store that finds partitions finds its locks.
    run("CREATE TABLE IF NOT EXISTS idem_claim_locks(bucket INT NOT NULL PRIMARY KEY) "
        "ENGINE=InnoDB",
        what);
    // MariaDB's Sequence engine: a table of the numbers, twice as fast as joined digits.
    run(fmt::format("INSERT IGNORE INTO idem_claim_locks(bucket) SELECT seq FROM seq_0_to_{}",
                    claim_lock_buckets - 1),
        what);
    std::optional<std::int64_t> newest;
    d.must("SELECT MAX(claimed_at) FROM idem_claims", D::Kind::idem, what, [&](const auto& row) {
        if (!row.is_null(0)) newest = row.int64(0);
    });
    // The claims there stay in the first partition, of everything before the first new span,
    // which starts after the newest claim (and not before now).
    std::string partitions;
    std::int64_t first_new = align_down(now);
    if (newest) {
        first_new = align_down(std::max(*newest + 1, now) - 1) + span_ms_;
        partitions = fmt::format("PARTITION p_before_{} VALUES LESS THAN ({}), ",
                                 sql::claim_partition_stamp(first_new), first_new);
    }
    const std::int64_t end =
        std::max(align_down(now) + (ahead_ + 1) * span_ms_, first_new + span_ms_);
    partitions += partition_list(first_new, end, now);
    // One ALTER (it copies the rows): the key becomes an ordinary column the claim writes,
    // checked, and no longer unique (the partitions cannot have it so).
    run("ALTER TABLE idem_claims MODIFY claim_key BINARY(32) NOT NULL, "
        "DROP KEY idem_claims_key, ADD KEY idem_claims_key(claim_key), "
        "ADD CONSTRAINT idem_claims_key_written CHECK (claim_key = " +
            sql::mysql_claim_key("scope", "message_id") + ") PARTITION BY RANGE (claimed_at) (" +
            partitions + ")",
        what);
}

template <class D>
void Partitions<D>::add_partitions(std::int64_t now, bool wait) {
    D& d = driver();
    const std::string what = "adding idem claim partitions";
    const std::int64_t end = align_down(now) + (ahead_ + 1) * span_ms_;
    for (int attempt = 0; attempt < 3; ++attempt) {
        const std::vector<sql::ClaimPartition> partitions = list_partitions();
        if (partitions.empty()) {
            relearn_ = true;  // made one table again by hand: learn it before the next claim
            return;
        }
        const std::int64_t last = partitions.back().to;
        if (last >= end) {
            covered_until_ = last;
            refresh_at_ = last == std::numeric_limits<std::int64_t>::max()
                              ? last
                              : last - std::max<std::int64_t>(ahead_ * span_ms_ / 2, 1);
            return;
        }
        std::int64_t added = 0;
        const unsigned code =
            d.exec(fmt::format("ALTER TABLE idem_claims {} ADD PARTITION ({})",
                               wait ? "WAIT 1" : "NOWAIT", partition_list(last, end, now)),
                   sql::no_rows{}, added);
        // Added by another process at once: listed again.
        if (code != 0 && code != er_range_not_increasing && code != er_same_name_partition)
            d.raise(code, D::Kind::idem, what, {});
    }
    throw store_error("idem mysql: adding idem claim partitions: the partitions kept changing");
}

template <class D>
void Partitions<D>::keep_claim_partitions_ahead(std::int64_t now) {
    if (relearn_) {
        relearn_ = false;
        open_claim_partitions(now);
    }
    if (span_ms_ == 0 || now < refresh_at_) return;
    D& d = driver();
    try {
        d.ready("adding idem claim partitions");
        // Without waiting while a whole span is left; then up to a second of the claims'.
        // (covered_until_ starts at the lowest int64: compared, never subtracted from.)
        add_partitions(now, now + span_ms_ >= covered_until_);
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
std::vector<sql::ClaimPartition> Partitions<D>::expired_claim_partitions(std::int64_t now,
                                                                         std::int64_t cutoff) {
    if (span_ms_ == 0) return {};
    refresh_at_ = std::numeric_limits<std::int64_t>::min();
    keep_claim_partitions_ahead(now);
    driver().ready("purge (claim partitions)");
    std::vector<sql::ClaimPartition> expired;
    std::vector<sql::ClaimPartition> partitions = list_partitions();
    // MariaDB keeps at least one partition; the ones ahead are never expired.
    if (!partitions.empty()) partitions.pop_back();
    for (sql::ClaimPartition& partition : partitions) {
        if (partition.to <= cutoff) expired.push_back(std::move(partition));
    }
    return expired;
}

template <class D>
std::size_t Partitions<D>::drop_claim_partition(const sql::ClaimPartition& partition) {
    D& d = driver();
    const std::string what = "purge (dropping a claim partition)";
    const std::string name = "`" + partition.name + "`";  // names idem made: p and digits
    std::int64_t claims = 0;
    std::int64_t rows = 0;
    const unsigned counted = d.exec(
        "SELECT COUNT(*) FROM idem_claims PARTITION (" + name + ")",
        [&](const auto& row) { claims = row.int64(0); }, rows);
    if (counted == er_unknown_partition) return 0;  // dropped by another process
    if (counted != 0) d.raise(counted, D::Kind::idem, what, {});
    constexpr int attempts = 10;
    for (int attempt = 1;; ++attempt) {
        std::int64_t n = 0;
        const unsigned code = d.exec(fmt::format("ALTER TABLE idem_claims {} DROP PARTITION {}",
                                                 attempt < attempts ? "NOWAIT" : "WAIT 1", name),
                                     sql::no_rows{}, n);
        if (code == 0) return static_cast<std::size_t>(claims);
        if (code == er_no_such_partition) return 0;
        if (code != er_lock_wait_timeout || attempt >= attempts)
            d.raise(code, D::Kind::idem, what, {});
        std::this_thread::sleep_for(std::chrono::milliseconds(20) * attempt);
    }
}

}  // namespace mysql
IDEM_END_NAMESPACE
