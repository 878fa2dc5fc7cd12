#pragma once
/// @file
/// @brief The dialect table: every statement text idem's SQL store runs, per dialect. A dialect
/// is data: placeholders (`?N` or `$N`), the upsert syntax, RETURNING, SKIP LOCKED, the boolean
/// literals, the schema prefix. The core (sql/store.hpp) binds the parameters in the order each
/// entry's comment gives, whatever the dialect; a driver may leave an entry it never runs empty.

#include <array>
#include <cstddef>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace sql {

/// idem's own statements. Parameters in binding order; "→" the result columns.
enum class stmt : std::size_t {
    // claim_insert is first: PostgreSQL prepares it as idem_<store>_0 (a test drops it).
    claim_insert,  ///< scope, id, claimed_at, fingerprint; inserts 'processed', '' or nothing
    begin_tx,      ///< BEGIN (SQLite: BEGIN IMMEDIATE)
    commit_tx,     ///< COMMIT
    rollback_tx,   ///< ROLLBACK
    savepoint,     ///< SAVEPOINT idem_effect
    rollback_to_savepoint,  ///< ROLLBACK TO idem_effect
    release_savepoint,      ///< RELEASE idem_effect
    claim_outcome,          ///< scope, id → outcome, fingerprint
    claim_rows,             ///< claim_many() (dialect-specific parameters) → message_id
    claim_rows_outcome,  ///< claim_many() (dialect-specific) → message_id, outcome, fingerprint
    record_update,       ///< scope, id, outcome, reason
    claim_delete,        ///< scope, id
    dead_letter_insert,  ///< scope, id, delivery_count, reason, payload, created_at, origin,
                         ///< position; the failures noted for the id come from its attempt row
    purge_claims,        ///< from, through: the claims with claimed_at in [from, through]
    purge_outbox,        ///< from, through (sent in [from, through], not parked)
    purge_locks,         ///< from, through (expired in [from, through])
    find_claim,  ///< scope, id → scope, message_id, claimed_at, outcome, reason, fingerprint
    /// after_id, any_scope (1: every scope), scope, created_from, created_before, rows → the
    /// dead-letter columns of the next page, by id (a cursor: ids after after_id)
    dead_letter_page,
    lock_advisory,  ///< a transaction-scoped lock on a 64-bit key (PostgreSQL) → bool
    lock_live,      ///< key, now → a row (or true) when an unexpired held lock exists
    lock_hold,      ///< key, owner, expires_at, now (+ dialect-specific) → 1 affected: ours
    lock_release,   ///< key, owner
    outbox_insert,  ///< destination, key, payload, created_at, scope, id; nothing on a known key
    outbox_lease,   ///< lease_until, now, limit → the outbox columns
    outbox_sent,    ///< id, sent_at
    outbox_failed,  ///< id, last_error, next_attempt_at, parked
    outbox_all,     ///< → the outbox columns, by id
    attempt_count,  ///< scope, id, counted_at: attempts + 1 (1 for a new row) → attempts;
                    ///< a dialect without RETURNING answers no row: attempt_count_read
    attempt_count_read,  ///< → the attempts attempt_count just wrote on this connection
    attempt_find,        ///< scope, id → attempts, last_failure, first/last_failed_at
    purge_attempts,      ///< from, through (counted in [from, through])
    offset_upsert,       ///< group, topic, partition, next_offset, updated_at: the greatest wins
    offset_find,         ///< group, topic, partition → next_offset
    // A purge batch's end: from, before, skip → the time of the (skip + 1)-th row in
    // [from, before), in time order; no row when fewer are left (a cursor: each batch starts
    // where the last ended and walks only its own rows).
    purge_claims_bound,
    purge_outbox_bound,
    purge_locks_bound,
    purge_attempts_bound,
    // The redrive (sql/redrive.hpp), each in the redrive's transaction.
    dead_letter_find,      ///< id → the dead-letter columns
    dead_letter_redrives,  ///< scope, id → the greatest redrive_count of the message's entries
    dead_letter_redrive,   ///< id, redriven_at, redrive_count: 1 affected when not redriven yet
    claim_release_parked,  ///< scope, id: deletes the claim only if dead_lettered (1 affected)
    attempt_delete,        ///< scope, id
    outbox_rearm,          ///< destination, key, payload, now: unsent again, created_at now
    dead_letter_delete,    ///< id: the entry removed (purge_dead_letters())
    attempt_failure,  ///< scope, id, now, failure: noted in the id's attempt row (new: 0 attempts)
    outbox_of,        ///< scope, id → the outbox columns of the intents its attempts wrote, by id
    // Partitioned claims: no unique index spans the partitions, so a claim takes a lock of its
    // id first (PostgreSQL: a transaction-scoped advisory lock; MySQL: the row of the id's
    // bucket in idem_claim_locks), then inserts only where no partition holds the id.
    claim_lock,            ///< PostgreSQL: key; MySQL: scope, id. The id's lock, waited for
    claim_locks,           ///< PostgreSQL: keys (sorted): each id's advisory lock, in that order
    claim_insert_locked,   ///< as claim_insert, under claim_lock (MySQL: inserts)
    claim_rows_locked,     ///< as claim_rows, under claim_locks → message_id
    claim_outcome_locked,  ///< MySQL: as claim_outcome, under claim_lock: a consistent read
    count,
};

/// The number of statements of a dialect (stmt's values before `count`).
inline constexpr std::size_t statement_count = static_cast<std::size_t>(stmt::count);

/// The result columns of outbox_lease and outbox_all, in this order.
inline constexpr std::string_view outbox_columns =
    "id, destination, idempotency_key, payload, created_at, sent_at, attempts, last_error, "
    "next_attempt_at, parked, scope, message_id";

/// The result columns of dead_letter_page and dead_letter_find, in this order.
inline constexpr std::string_view dead_letter_columns =
    "id, scope, message_id, delivery_count, reason, payload, created_at, redrive_count, "
    "redriven_at, origin, origin_position, failure, first_failed_at, last_failed_at";

/// The dead letter's insert: the table @p prefix, the placeholder sign, and the WHERE that finds
/// the message's attempt row (scope 1, id 2), whose noted failure the entry copies.
inline std::string dead_letter_insert_text(const std::string& prefix, std::string_view sign,
                                           std::string_view attempt_of_message) {
    const auto p = [&](int n) { return fmt::format("{}{}", sign, n); };
    const auto noted = [&](std::string_view column) {
        return fmt::format("(SELECT {} FROM {}attempts{})", column, prefix, attempt_of_message);
    };
    return fmt::format(
        "INSERT INTO {}dead_letters(scope, message_id, delivery_count, reason, payload, "
        "created_at, origin, origin_position, failure, first_failed_at, last_failed_at) VALUES "
        "({}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {})",
        prefix, p(1), p(2), p(3), p(4), p(5), p(6), p(7), p(8), noted("last_failure"),
        noted("first_failed_at"), noted("last_failed_at"));
}

/// One dialect's texts, indexed by stmt.
struct statement_table {
    /// The texts, indexed by stmt's value.
    std::array<std::string, statement_count> text{};
    /// The text of statement @p which.
    [[nodiscard]] const std::string& operator[](stmt which) const noexcept {
        return text[static_cast<std::size_t>(which)];
    }
    /// The text of statement @p which, to fill in.
    std::string& operator[](stmt which) noexcept { return text[static_cast<std::size_t>(which)]; }
};

/// The purge batches' bounds, the same in every dialect but for the table prefix, the
/// placeholders (from, before, skip) and how "not parked" is written.
inline void purge_bounds(statement_table& t, const std::string& prefix, std::string_view from,
                         std::string_view before, std::string_view skip,
                         std::string_view not_parked) {
    const auto bound = [&](std::string_view table, std::string_view column, std::string_view also) {
        return fmt::format(
            "SELECT {1} FROM {0}{2} WHERE {1} >= {3} AND {1} < {4}{5} ORDER BY {1} LIMIT 1 "
            "OFFSET {6}",
            prefix, column, table, from, before, also, skip);
    };
    t[stmt::purge_claims_bound] = bound("claims", "claimed_at", "");
    t[stmt::purge_outbox_bound] = bound("outbox", "sent_at", fmt::format(" AND {}", not_parked));
    t[stmt::purge_locks_bound] = bound("locks", "expires_at", "");
    t[stmt::purge_attempts_bound] = bound("attempts", "counted_at", "");
}

/// The redrive's statements (and the dead letters' listing), the same in every dialect but for
/// the table prefix, the WHERE of one message (scope ?1 / $1, id ?2 / $2), the placeholder sign
/// and how "not parked" is written. MySQL replaces the ones that find a row by a hashed key.
inline void redrive_statements(statement_table& t, const std::string& prefix,
                               std::string_view one_message, std::string_view sign,
                               std::string_view not_parked) {
    const std::string letters = prefix + "dead_letters";
    const auto p = [&](int n) { return fmt::format("{}{}", sign, n); };
    t[stmt::dead_letter_page] = fmt::format(
        "SELECT {0} FROM {1} WHERE id > {2} AND ({3} = 1 OR scope = {4}) AND created_at >= {5} "
        "AND created_at < {6} ORDER BY id LIMIT {7}",
        dead_letter_columns, letters, p(1), p(2), p(3), p(4), p(5), p(6));
    t[stmt::dead_letter_find] =
        fmt::format("SELECT {} FROM {} WHERE id = {}", dead_letter_columns, letters, p(1));
    t[stmt::dead_letter_redrives] =
        fmt::format("SELECT COALESCE(MAX(redrive_count), 0) FROM {}{}", letters, one_message);
    t[stmt::dead_letter_redrive] = fmt::format(
        "UPDATE {} SET redriven_at = {}, redrive_count = {} WHERE id = {} AND "
        "redriven_at IS NULL",
        letters, p(2), p(3), p(1));
    t[stmt::claim_release_parked] =
        fmt::format("DELETE FROM {}claims{} AND outcome = 'dead_lettered'", prefix, one_message);
    t[stmt::attempt_delete] = fmt::format("DELETE FROM {}attempts{}", prefix, one_message);
    t[stmt::dead_letter_delete] = fmt::format("DELETE FROM {} WHERE id = {}", letters, p(1));
    t[stmt::dead_letter_insert] = dead_letter_insert_text(prefix, sign, one_message);
    t[stmt::outbox_of] =
        fmt::format("SELECT {} FROM {}outbox{} ORDER BY id", outbox_columns, prefix, one_message);
    t[stmt::outbox_rearm] = fmt::format(
        "UPDATE {0}outbox SET destination = {1}, payload = {3}, sent_at = NULL, attempts = 0, "
        "last_error = '', next_attempt_at = {4}, created_at = {4}, lease_until = NULL, {5} "
        "WHERE idempotency_key = {2}",
        prefix, p(1), p(2), p(3), p(4), not_parked);
}

/// SQLite (3.35+): `?N`, `INSERT OR IGNORE`, integers for booleans, RETURNING.
inline statement_table sqlite_statements() {
    const std::string cols(outbox_columns);
    statement_table t;
    t[stmt::begin_tx] = "BEGIN IMMEDIATE";
    t[stmt::commit_tx] = "COMMIT";
    t[stmt::rollback_tx] = "ROLLBACK";
    t[stmt::savepoint] = "SAVEPOINT idem_effect";
    t[stmt::rollback_to_savepoint] = "ROLLBACK TO idem_effect";
    t[stmt::release_savepoint] = "RELEASE idem_effect";
    t[stmt::claim_insert] =
        "INSERT OR IGNORE INTO idem_claims(scope, message_id, claimed_at, outcome, reason, "
        "fingerprint) VALUES (?1, ?2, ?3, 'processed', '', ?4)";
    t[stmt::claim_outcome] =
        "SELECT outcome, fingerprint FROM idem_claims WHERE scope = ?1 AND message_id = ?2";
    // claim_rows: built per row count by the driver (VALUES (?1, ?3, ?2, …), (?1, ?5, ?2, …)).
    t[stmt::record_update] =
        "UPDATE idem_claims SET outcome = ?3, reason = ?4 WHERE scope = ?1 AND message_id = ?2";
    t[stmt::claim_delete] = "DELETE FROM idem_claims WHERE scope = ?1 AND message_id = ?2";
    t[stmt::purge_claims] = "DELETE FROM idem_claims WHERE claimed_at BETWEEN ?1 AND ?2";
    t[stmt::purge_outbox] =
        "DELETE FROM idem_outbox WHERE sent_at BETWEEN ?1 AND ?2 AND parked = 0";
    t[stmt::purge_locks] = "DELETE FROM idem_locks WHERE expires_at BETWEEN ?1 AND ?2";
    purge_bounds(t, "idem_", "?1", "?2", "?3", "parked = 0");
    t[stmt::find_claim] =
        "SELECT scope, message_id, claimed_at, outcome, reason, fingerprint FROM idem_claims "
        "WHERE scope = ?1 AND message_id = ?2";
    redrive_statements(t, "idem_", " WHERE scope = ?1 AND message_id = ?2", "?", "parked = 0");
    t[stmt::lock_live] = "SELECT 1 FROM idem_locks WHERE lock_key = ?1 AND expires_at > ?2";
    t[stmt::lock_hold] =
        "INSERT INTO idem_locks(lock_key, owner, expires_at) VALUES (?1, ?2, ?3) "
        "ON CONFLICT(lock_key) DO UPDATE SET owner = excluded.owner, "
        "expires_at = excluded.expires_at "
        "WHERE idem_locks.owner = excluded.owner OR idem_locks.expires_at <= ?4";
    t[stmt::lock_release] = "DELETE FROM idem_locks WHERE lock_key = ?1 AND owner = ?2";
    t[stmt::outbox_insert] =
        "INSERT INTO idem_outbox(destination, idempotency_key, payload, created_at, "
        "next_attempt_at, scope, message_id) VALUES (?1, ?2, ?3, ?4, ?4, ?5, ?6) "
        "ON CONFLICT(idempotency_key) DO NOTHING";
    t[stmt::outbox_lease] =
        "UPDATE idem_outbox SET lease_until = ?1 WHERE id IN (SELECT id FROM idem_outbox "
        "WHERE sent_at IS NULL AND parked = 0 AND next_attempt_at <= ?2 "
        "AND (lease_until IS NULL OR lease_until <= ?2) ORDER BY id LIMIT ?3) RETURNING " +
        cols;
    t[stmt::outbox_sent] = "UPDATE idem_outbox SET sent_at = ?2, lease_until = NULL WHERE id = ?1";
    t[stmt::outbox_failed] =
        "UPDATE idem_outbox SET attempts = attempts + 1, last_error = ?2, next_attempt_at = ?3, "
        "parked = ?4, lease_until = NULL WHERE id = ?1";
    t[stmt::outbox_all] = "SELECT " + cols + " FROM idem_outbox ORDER BY id";
    t[stmt::attempt_count] =
        "INSERT INTO idem_attempts(scope, message_id, attempts, counted_at) VALUES (?1, ?2, 1, ?3) "
        "ON CONFLICT(scope, message_id) DO UPDATE SET attempts = attempts + 1, "
        "counted_at = excluded.counted_at RETURNING attempts";
    t[stmt::attempt_find] =
        "SELECT attempts, last_failure, first_failed_at, last_failed_at FROM idem_attempts WHERE "
        "scope = ?1 AND message_id = ?2";
    t[stmt::attempt_failure] =
        "INSERT INTO idem_attempts(scope, message_id, attempts, counted_at, first_failed_at, "
        "last_failed_at, last_failure) VALUES (?1, ?2, 0, ?3, ?3, ?3, ?4) "
        "ON CONFLICT(scope, message_id) DO UPDATE SET counted_at = excluded.counted_at, "
        "first_failed_at = COALESCE(first_failed_at, excluded.first_failed_at), "
        "last_failed_at = excluded.last_failed_at, last_failure = excluded.last_failure";
    t[stmt::purge_attempts] = "DELETE FROM idem_attempts WHERE counted_at BETWEEN ?1 AND ?2";
    t[stmt::offset_upsert] =
        "INSERT INTO idem_offsets(consumer_group, topic, partition_id, next_offset, updated_at) "
        "VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT(consumer_group, topic, partition_id) "
        "DO UPDATE SET next_offset = max(next_offset, excluded.next_offset), "
        "updated_at = excluded.updated_at";
    t[stmt::offset_find] =
        "SELECT next_offset FROM idem_offsets "
        "WHERE consumer_group = ?1 AND topic = ?2 AND partition_id = ?3";
    return t;
}

/// PostgreSQL (10+): `$N`, `ON CONFLICT DO NOTHING`, `FOR UPDATE SKIP LOCKED`, arrays for
/// claim_many(), advisory locks. @p prefix: the quoted schema and a dot (`"public".`).
inline statement_table postgres_statements(std::string_view prefix) {
    const std::string s(prefix);
    const std::string claims = s + "idem_claims";
    const std::string locks = s + "idem_locks";
    const std::string outbox = s + "idem_outbox";
    const std::string cols(outbox_columns);
    statement_table t;
    t[stmt::begin_tx] = "BEGIN";
    t[stmt::commit_tx] = "COMMIT";
    t[stmt::rollback_tx] = "ROLLBACK";
    t[stmt::savepoint] = "SAVEPOINT idem_effect";
    t[stmt::rollback_to_savepoint] = "ROLLBACK TO SAVEPOINT idem_effect";
    t[stmt::release_savepoint] = "RELEASE SAVEPOINT idem_effect";
    // The affected row count says whether it was inserted; only when not is the stored claim
    // read (claim_outcome, a new statement: it also sees a claim that committed while this one
    // waited).
    t[stmt::claim_insert] =
        "INSERT INTO " + claims +
        "(scope, message_id, claimed_at, outcome, reason, fingerprint) "
        "VALUES ($1, $2, $3, 'processed', '', $4) ON CONFLICT (scope, message_id) DO NOTHING";
    t[stmt::claim_outcome] =
        "SELECT outcome, fingerprint FROM " + claims + " WHERE scope = $1 AND message_id = $2";
    // $1 scope, $2 claimed_at, $3 the ids (distinct, sorted: concurrent batches wait on one
    // another in one order, never in a cycle), $4 their fingerprints (empty array: none).
    t[stmt::claim_rows] =
        "INSERT INTO " + claims +
        "(scope, message_id, claimed_at, outcome, reason, fingerprint) "
        "SELECT $1::bytea, u.id, $2::bigint, 'processed', '', coalesce(u.fp, ''::bytea) "
        "FROM unnest($3::bytea[], $4::bytea[]) AS u(id, fp) "
        "ON CONFLICT (scope, message_id) DO NOTHING RETURNING message_id";
    // $1 scope, $2 the ids.
    t[stmt::claim_rows_outcome] = "SELECT message_id, outcome, fingerprint FROM " + claims +
                                  " WHERE scope = $1 AND message_id = ANY($2::bytea[])";
    t[stmt::claim_lock] = "SELECT pg_advisory_xact_lock($1::bigint)";
    // An aggregate, so the locks are taken once each, in the array's order, with one row back.
    t[stmt::claim_locks] = "SELECT count(pg_advisory_xact_lock(k)) FROM unnest($1::bigint[]) AS k";
    t[stmt::claim_insert_locked] =
        "INSERT INTO " + claims +
        "(scope, message_id, claimed_at, outcome, reason, fingerprint) "
        "SELECT $1::bytea, $2::bytea, $3::bigint, 'processed', '', $4::bytea WHERE NOT EXISTS "
        "(SELECT 1 FROM " +
        claims + " WHERE scope = $1 AND message_id = $2)";
    t[stmt::claim_rows_locked] =
        "INSERT INTO " + claims +
        "(scope, message_id, claimed_at, outcome, reason, fingerprint) "
        "SELECT $1::bytea, u.id, $2::bigint, 'processed', '', coalesce(u.fp, ''::bytea) "
        "FROM unnest($3::bytea[], $4::bytea[]) AS u(id, fp) WHERE NOT EXISTS (SELECT 1 FROM " +
        claims + " AS c WHERE c.scope = $1 AND c.message_id = u.id) RETURNING message_id";
    t[stmt::record_update] =
        "UPDATE " + claims + " SET outcome = $3, reason = $4 WHERE scope = $1 AND message_id = $2";
    t[stmt::claim_delete] = "DELETE FROM " + claims + " WHERE scope = $1 AND message_id = $2";
    // SKIP LOCKED: a row a consumer holds now stays for the next run instead of waiting.
    t[stmt::purge_claims] = "DELETE FROM " + claims +
                            " WHERE (scope, message_id) IN (SELECT scope, message_id FROM " +
                            claims + " WHERE claimed_at BETWEEN $1 AND $2 FOR UPDATE SKIP LOCKED)";
    t[stmt::purge_outbox] = "DELETE FROM " + outbox + " WHERE id IN (SELECT id FROM " + outbox +
                            " WHERE sent_at BETWEEN $1 AND $2 AND NOT parked "
                            "FOR UPDATE SKIP LOCKED)";
    t[stmt::purge_locks] = "DELETE FROM " + locks + " WHERE lock_key IN (SELECT lock_key FROM " +
                           locks + " WHERE expires_at BETWEEN $1 AND $2 FOR UPDATE SKIP LOCKED)";
    purge_bounds(t, s + "idem_", "$1", "$2", "$3", "NOT parked");
    t[stmt::find_claim] =
        "SELECT scope, message_id, claimed_at, outcome, reason, fingerprint FROM " + claims +
        " WHERE scope = $1 AND message_id = $2";
    redrive_statements(t, s + "idem_", " WHERE scope = $1 AND message_id = $2", "$",
                       "parked = false");
    t[stmt::lock_advisory] = "SELECT pg_try_advisory_xact_lock($1::bigint)";
    t[stmt::lock_live] = "SELECT EXISTS (SELECT 1 FROM " + locks +
                         " WHERE lock_key = $1 AND expires_at > $2::bigint)";
    // $5: the advisory key. Only while no transaction holds the key (the advisory lock), and
    // only a free, expired or own lock: another owner's live row makes the DO UPDATE's WHERE
    // false (no change).
    t[stmt::lock_hold] = "INSERT INTO " + locks +
                         " AS l(lock_key, owner, expires_at) SELECT $1, $2, $3::bigint "
                         "WHERE pg_try_advisory_xact_lock($5::bigint) "
                         "ON CONFLICT (lock_key) DO UPDATE SET owner = EXCLUDED.owner, "
                         "expires_at = EXCLUDED.expires_at "
                         "WHERE l.owner = EXCLUDED.owner OR l.expires_at <= $4::bigint";
    t[stmt::lock_release] = "DELETE FROM " + locks + " WHERE lock_key = $1 AND owner = $2";
    t[stmt::outbox_insert] = "INSERT INTO " + outbox +
                             "(destination, idempotency_key, payload, created_at, "
                             "next_attempt_at, attempts, last_error, parked, scope, message_id) "
                             "VALUES ($1, $2, $3, $4, $4, 0, '', false, $5, $6) "
                             "ON CONFLICT (idempotency_key) DO NOTHING";
    t[stmt::outbox_lease] = "UPDATE " + outbox +
                            " SET lease_until = $1 WHERE id IN (SELECT id FROM " + outbox +
                            " WHERE sent_at IS NULL AND NOT parked AND next_attempt_at <= $2 "
                            "AND (lease_until IS NULL OR lease_until <= $2) ORDER BY id LIMIT $3 "
                            "FOR UPDATE SKIP LOCKED) RETURNING " +
                            cols;
    t[stmt::outbox_sent] =
        "UPDATE " + outbox + " SET sent_at = $2, lease_until = NULL WHERE id = $1";
    t[stmt::outbox_failed] = "UPDATE " + outbox +
                             " SET attempts = attempts + 1, last_error = $2, "
                             "next_attempt_at = $3, parked = $4, lease_until = NULL WHERE id = $1";
    t[stmt::outbox_all] = "SELECT " + cols + " FROM " + outbox + " ORDER BY id";
    const std::string attempts = s + "idem_attempts";
    t[stmt::attempt_count] = "INSERT INTO " + attempts +
                             " AS a(scope, message_id, attempts, counted_at) "
                             "VALUES ($1, $2, 1, $3::bigint) ON CONFLICT (scope, message_id) "
                             "DO UPDATE SET attempts = a.attempts + 1, "
                             "counted_at = EXCLUDED.counted_at RETURNING attempts";
    t[stmt::attempt_find] = "SELECT attempts, last_failure, first_failed_at, last_failed_at FROM " +
                            attempts + " WHERE scope = $1 AND message_id = $2";
    t[stmt::attempt_failure] =
        "INSERT INTO " + attempts +
        " AS a(scope, message_id, attempts, counted_at, first_failed_at, last_failed_at, "
        "last_failure) VALUES ($1, $2, 0, $3::bigint, $3::bigint, $3::bigint, $4) "
        "ON CONFLICT (scope, message_id) DO UPDATE SET counted_at = EXCLUDED.counted_at, "
        "first_failed_at = COALESCE(a.first_failed_at, EXCLUDED.first_failed_at), "
        "last_failed_at = EXCLUDED.last_failed_at, last_failure = EXCLUDED.last_failure";
    t[stmt::purge_attempts] = "DELETE FROM " + attempts +
                              " WHERE (scope, message_id) IN (SELECT scope, message_id FROM " +
                              attempts +
                              " WHERE counted_at BETWEEN $1 AND $2 FOR UPDATE SKIP LOCKED)";
    const std::string offsets = s + "idem_offsets";
    t[stmt::offset_upsert] = "INSERT INTO " + offsets +
                             " AS o(consumer_group, topic, partition_id, next_offset, updated_at) "
                             "VALUES ($1, $2, $3::integer, $4::bigint, $5::bigint) "
                             "ON CONFLICT (consumer_group, topic, partition_id) "
                             "DO UPDATE SET next_offset = GREATEST(o.next_offset, "
                             "EXCLUDED.next_offset), updated_at = EXCLUDED.updated_at";
    t[stmt::offset_find] = "SELECT next_offset FROM " + offsets +
                           " WHERE consumer_group = $1 AND topic = $2 AND partition_id = "
                           "$3::integer";
    return t;
}

/// MySQL / MariaDB (MariaDB 10.6+, MySQL 8.0+): `?N` placeholders that the driver renders as
/// literals (binary values as `X'…'`), `INSERT … ON DUPLICATE KEY UPDATE` (affected rows: 1
/// inserted, 0 there already — the driver refuses CLIENT_FOUND_ROWS), `FOR UPDATE SKIP LOCKED`,
/// integers for booleans. The unique keys are SHA-256 hashes (stored generated columns) of the
/// binary values, so any scope and id fit InnoDB's 3072-byte index limit: every lookup gives the
/// hash and the values themselves. lock_hold is the driver's own (hold_lock()); outbox_lease is
/// the SELECT … FOR UPDATE SKIP LOCKED, the driver adds the UPDATE (no UPDATE … RETURNING).
inline std::string mysql_claim_key(std::string_view scope, std::string_view id) {
    const std::string s(scope);
    const std::string i(id);
    return "UNHEX(SHA2(CONCAT(LPAD(LENGTH(" + s + "), 10, '0'), " + s + ", " + i + "), 256))";
}

/// The bucket of a claim's id, 0 to 65535 (MySQL's partitioned claims: the row of
/// idem_claim_locks a claim locks), from the first 16 bits of its claim key's hash.
inline std::string mysql_claim_bucket(std::string_view scope, std::string_view id) {
    const std::string s(scope);
    const std::string i(id);
    return "CONV(LEFT(SHA2(CONCAT(LPAD(LENGTH(" + s + "), 10, '0'), " + s + ", " + i +
           "), 256), 4), 16, 10)";
}

/// The hash of an idem_offsets row's key (group, topic, partition), as its offset_key column.
inline std::string mysql_offset_key(std::string_view group, std::string_view topic,
                                    std::string_view partition) {
    const std::string g(group);
    const std::string t(topic);
    return "UNHEX(SHA2(CONCAT(LPAD(LENGTH(" + g + "), 10, '0'), " + g + ", LPAD(LENGTH(" + t +
           "), 10, '0'), " + t + ", " + std::string(partition) + "), 256))";
}

/// MySQL / MariaDB's texts: the dialect described at mysql_claim_key() (`?N` rendered as literals,
/// hashed unique keys, no RETURNING).
inline statement_table mysql_statements() {
    const std::string cols(outbox_columns);
    const std::string claim =
        " WHERE claim_key = " + mysql_claim_key("?1", "?2") + " AND scope = ?1 AND message_id = ?2";
    const std::string lock = " WHERE lock_hash = UNHEX(SHA2(?1, 256)) AND lock_key = ?1";
    statement_table t;
    t[stmt::begin_tx] = "START TRANSACTION";
    t[stmt::commit_tx] = "COMMIT";
    t[stmt::rollback_tx] = "ROLLBACK";
    // The savepoints are named per depth by the driver (mysql/driver.hpp): none here.
    // Not INSERT IGNORE: it would also turn a truncation or a NOT NULL violation into a warning.
    t[stmt::claim_insert] =
        "INSERT INTO idem_claims(scope, message_id, claimed_at, outcome, reason, fingerprint) "
        "VALUES (?1, ?2, ?3, 'processed', X'', ?4) ON DUPLICATE KEY UPDATE claimed_at = claimed_at";
    // A locking read: under REPEATABLE READ a plain SELECT would read the transaction's snapshot
    // and miss a claim that committed while the INSERT waited.
    t[stmt::claim_outcome] =
        "SELECT outcome, fingerprint FROM idem_claims" + claim + " LOCK IN SHARE MODE";
    // Partitioned claims (mysql/partitions.hpp): the bucket's row is locked (an existing row
    // of a unique key: no gap lock), then the claim read and inserted with its key.
    t[stmt::claim_lock] =
        "SELECT bucket FROM idem_claim_locks WHERE bucket = " + mysql_claim_bucket("?1", "?2") +
        " FOR UPDATE";
    t[stmt::claim_outcome_locked] = "SELECT outcome, fingerprint FROM idem_claims" + claim;
    t[stmt::claim_insert_locked] =
        "INSERT INTO idem_claims(scope, message_id, claim_key, claimed_at, outcome, reason, "
        "fingerprint) VALUES (?1, ?2, " +
        mysql_claim_key("?1", "?2") + ", ?3, 'processed', X'', ?4)";
    t[stmt::record_update] = "UPDATE idem_claims SET outcome = ?3, reason = ?4" + claim;
    t[stmt::claim_delete] = "DELETE FROM idem_claims" + claim;
    t[stmt::purge_claims] = "DELETE FROM idem_claims WHERE claimed_at BETWEEN ?1 AND ?2";
    t[stmt::purge_outbox] =
        "DELETE FROM idem_outbox WHERE sent_at BETWEEN ?1 AND ?2 AND parked = 0";
    t[stmt::purge_locks] = "DELETE FROM idem_locks WHERE expires_at BETWEEN ?1 AND ?2";
    purge_bounds(t, "idem_", "?1", "?2", "?3", "parked = 0");
    t[stmt::find_claim] =
        "SELECT scope, message_id, claimed_at, outcome, reason, fingerprint FROM idem_claims" +
        claim;
    redrive_statements(t, "idem_", " WHERE scope = ?1 AND message_id = ?2", "?", "parked = 0");
    // The claims' and the attempt counts' rows are found by their hashed key.
    t[stmt::claim_release_parked] =
        "DELETE FROM idem_claims" + claim + " AND outcome = 'dead_lettered'";
    t[stmt::attempt_delete] =
        "DELETE FROM idem_attempts WHERE attempt_key = " + mysql_claim_key("?1", "?2") +
        " AND scope = ?1 AND message_id = ?2";
    t[stmt::dead_letter_insert] =
        dead_letter_insert_text("idem_", "?",
                                " WHERE attempt_key = " + mysql_claim_key("?1", "?2") +
                                    " AND scope = ?1 AND message_id = ?2");
    t[stmt::outbox_rearm] =
        "UPDATE idem_outbox SET destination = ?1, payload = ?3, sent_at = NULL, attempts = 0, "
        "last_error = X'', next_attempt_at = ?4, created_at = ?4, lease_until = NULL, "
        "parked = 0 "
        "WHERE key_hash = UNHEX(SHA2(?2, 256)) AND idempotency_key = ?2";
    // try_lock(): the row lock is the transaction's lock (placeholder row: owner '', expired).
    t[stmt::lock_advisory] =
        "SET STATEMENT innodb_lock_wait_timeout = 0 FOR INSERT INTO idem_locks(lock_key, owner, "
        "expires_at) VALUES (?1, X'', 0) ON DUPLICATE KEY UPDATE lock_key = lock_key";
    t[stmt::lock_live] = "SELECT 1 FROM idem_locks" + lock + " AND expires_at > ?2 FOR UPDATE";
    t[stmt::lock_hold] = "UPDATE idem_locks SET owner = ?2, expires_at = ?3" + lock +
                         " AND (owner = ?2 OR expires_at <= ?4)";
    t[stmt::lock_release] = "DELETE FROM idem_locks" + lock + " AND owner = ?2";
    t[stmt::outbox_insert] =
        "INSERT INTO idem_outbox(destination, idempotency_key, payload, created_at, "
        "next_attempt_at, attempts, last_error, parked, scope, message_id) "
        "VALUES (?1, ?2, ?3, ?4, ?4, 0, X'', 0, ?5, ?6) ON DUPLICATE KEY UPDATE id = id";
    t[stmt::outbox_lease] = "SELECT " + cols +
                            " FROM idem_outbox WHERE sent_at IS NULL AND parked = 0 AND "
                            "next_attempt_at <= ?2 AND (lease_until IS NULL OR lease_until <= ?2) "
                            "ORDER BY id LIMIT ?3 FOR UPDATE SKIP LOCKED";
    t[stmt::outbox_sent] = "UPDATE idem_outbox SET sent_at = ?2, lease_until = NULL WHERE id = ?1";
    t[stmt::outbox_failed] =
        "UPDATE idem_outbox SET attempts = attempts + 1, last_error = ?2, next_attempt_at = ?3, "
        "parked = ?4, lease_until = NULL WHERE id = ?1";
    t[stmt::outbox_all] = "SELECT " + cols + " FROM idem_outbox ORDER BY id";
    // No RETURNING: LAST_INSERT_ID(expr) remembers the count for this connection's next
    // SELECT LAST_INSERT_ID(), which no other session can change in between.
    t[stmt::attempt_count] =
        "INSERT INTO idem_attempts(scope, message_id, attempts, counted_at) "
        "VALUES (?1, ?2, LAST_INSERT_ID(1), ?3) "
        "ON DUPLICATE KEY UPDATE attempts = LAST_INSERT_ID(attempts + 1), counted_at = ?3";
    t[stmt::attempt_count_read] = "SELECT LAST_INSERT_ID()";
    t[stmt::attempt_find] =
        "SELECT attempts, last_failure, first_failed_at, last_failed_at FROM idem_attempts WHERE "
        "attempt_key = " +
        mysql_claim_key("?1", "?2") + " AND scope = ?1 AND message_id = ?2";
    t[stmt::attempt_failure] =
        "INSERT INTO idem_attempts(scope, message_id, attempts, counted_at, first_failed_at, "
        "last_failed_at, last_failure) VALUES (?1, ?2, 0, ?3, ?3, ?3, ?4) "
        "ON DUPLICATE KEY UPDATE counted_at = ?3, "
        "first_failed_at = COALESCE(first_failed_at, ?3), last_failed_at = ?3, last_failure = ?4";
    t[stmt::purge_attempts] = "DELETE FROM idem_attempts WHERE counted_at BETWEEN ?1 AND ?2";
    t[stmt::offset_upsert] =
        "INSERT INTO idem_offsets(consumer_group, topic, partition_id, next_offset, updated_at) "
        "VALUES (?1, ?2, ?3, ?4, ?5) "
        "ON DUPLICATE KEY UPDATE next_offset = GREATEST(next_offset, ?4), updated_at = ?5";
    t[stmt::offset_find] = "SELECT next_offset FROM idem_offsets WHERE offset_key = " +
                           mysql_offset_key("?1", "?2", "?3") +
                           " AND consumer_group = ?1 AND topic = ?2 AND partition_id = ?3";
    return t;
}

}  // namespace sql
IDEM_END_NAMESPACE
