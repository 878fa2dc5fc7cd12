#pragma once
/// @file
/// @brief The versioned schema of the SQL stores: the DDL per dialect, one migration per
/// version, and ensure_schema(), which creates or migrates the tables once, under the driver's
/// exclusive schema lock, and refuses a database written by a newer idem.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"

IDEM_BEGIN_NAMESPACE
namespace sql {

/// Version of the idem tables this code writes; a database with a newer one is refused
/// (IDEM_SQL_SCHEMA_VERSION in idem/config.hpp, beside idem's version).
inline constexpr int schema_version = IDEM_SQL_SCHEMA_VERSION;

/// SQLite's DDL to go from @p from_version (0: nothing there) to schema_version.
inline std::vector<std::string> sqlite_schema_ddl(int from_version) {
    std::vector<std::string> ddl;
    if (from_version < 1) {
        // Version 1 is the first schema; later versions append their migrations.
        ddl = {
            "CREATE TABLE IF NOT EXISTS idem_claims("
            "scope BLOB NOT NULL, message_id BLOB NOT NULL, "
            "claimed_at INTEGER NOT NULL, outcome TEXT NOT NULL, "
            "reason TEXT NOT NULL DEFAULT '', "
            "fingerprint BLOB NOT NULL DEFAULT x'', "
            "PRIMARY KEY(scope, message_id)) WITHOUT ROWID",
            "CREATE INDEX IF NOT EXISTS idem_claims_claimed_at ON idem_claims(claimed_at)",
            "CREATE TABLE IF NOT EXISTS idem_dead_letters("
            "id INTEGER PRIMARY KEY, scope BLOB NOT NULL, message_id BLOB NOT NULL, "
            "delivery_count INTEGER NOT NULL, reason TEXT NOT NULL, "
            "payload BLOB NOT NULL, created_at INTEGER NOT NULL)",
            "CREATE TABLE IF NOT EXISTS idem_locks("
            "lock_key BLOB PRIMARY KEY, owner BLOB NOT NULL, "
            "expires_at INTEGER NOT NULL) WITHOUT ROWID",
            "CREATE TABLE IF NOT EXISTS idem_outbox("
            "id INTEGER PRIMARY KEY AUTOINCREMENT, destination TEXT NOT NULL, "
            "idempotency_key BLOB NOT NULL UNIQUE, payload BLOB NOT NULL, "
            "created_at INTEGER NOT NULL, sent_at INTEGER, "
            "attempts INTEGER NOT NULL DEFAULT 0, "
            "last_error TEXT NOT NULL DEFAULT '', "
            "next_attempt_at INTEGER NOT NULL, lease_until INTEGER, "
            "parked INTEGER NOT NULL DEFAULT 0)",
            // The relay's query: unsent, unparked, due, in id order.
            "CREATE INDEX IF NOT EXISTS idem_outbox_due "
            "ON idem_outbox(parked, next_attempt_at, id) WHERE sent_at IS NULL",
            // purge(): sent intents by age, held locks by expiry.
            "CREATE INDEX IF NOT EXISTS idem_outbox_sent "
            "ON idem_outbox(sent_at) WHERE sent_at IS NOT NULL",
            "CREATE INDEX IF NOT EXISTS idem_locks_expires_at ON idem_locks(expires_at)",
        };
    }
    if (from_version < 2) {
        // Version 2: attempts counted by the store (count_attempt()), for brokers without a
        // delivery count.
        ddl.push_back(
            "CREATE TABLE IF NOT EXISTS idem_attempts("
            "scope BLOB NOT NULL, message_id BLOB NOT NULL, attempts INTEGER NOT NULL, "
            "counted_at INTEGER NOT NULL, PRIMARY KEY(scope, message_id)) WITHOUT ROWID");
        ddl.push_back(
            "CREATE INDEX IF NOT EXISTS idem_attempts_counted_at ON idem_attempts(counted_at)");
    }
    if (from_version < 3) {
        // Version 3: the read offsets a broker keeps in the store (stored_offset()).
        ddl.push_back(
            "CREATE TABLE IF NOT EXISTS idem_offsets("
            "consumer_group BLOB NOT NULL, topic BLOB NOT NULL, partition_id INTEGER NOT NULL, "
            "next_offset INTEGER NOT NULL, updated_at INTEGER NOT NULL, "
            "PRIMARY KEY(consumer_group, topic, partition_id)) WITHOUT ROWID");
    }
    if (from_version < 4) {
        // Version 4: dead letters brought back (redrive()): when and how often; a message's
        // entries found by its id.
        ddl.push_back(
            "ALTER TABLE idem_dead_letters ADD COLUMN redrive_count INTEGER NOT NULL DEFAULT 0");
        ddl.push_back("ALTER TABLE idem_dead_letters ADD COLUMN redriven_at INTEGER");
        ddl.push_back(
            "CREATE INDEX IF NOT EXISTS idem_dead_letters_message "
            "ON idem_dead_letters(scope, message_id)");
    }
    if (from_version < 5) {
        // Version 5: where the broker held a parked message (a redrive's way back), and how
        // its effect failed before (note_failure(), kept in its attempt row until parked).
        ddl.push_back("ALTER TABLE idem_dead_letters ADD COLUMN origin BLOB NOT NULL DEFAULT x''");
        ddl.push_back(
            "ALTER TABLE idem_dead_letters ADD COLUMN origin_position BLOB NOT NULL DEFAULT x''");
        ddl.push_back("ALTER TABLE idem_dead_letters ADD COLUMN failure BLOB");
        ddl.push_back("ALTER TABLE idem_dead_letters ADD COLUMN first_failed_at INTEGER");
        ddl.push_back("ALTER TABLE idem_dead_letters ADD COLUMN last_failed_at INTEGER");
        ddl.push_back("ALTER TABLE idem_attempts ADD COLUMN last_failure BLOB");
        ddl.push_back("ALTER TABLE idem_attempts ADD COLUMN first_failed_at INTEGER");
        ddl.push_back("ALTER TABLE idem_attempts ADD COLUMN last_failed_at INTEGER");
    }
    if (from_version < 6) {
        // Version 6: the message whose attempt wrote an outbox intent (its story, idem claims
        // show). Found by a scan: an operator's lookup, not worth an index on every insert.
        ddl.push_back("ALTER TABLE idem_outbox ADD COLUMN scope BLOB NOT NULL DEFAULT x''");
        ddl.push_back("ALTER TABLE idem_outbox ADD COLUMN message_id BLOB NOT NULL DEFAULT x''");
    }
    return ddl;
}

/// PostgreSQL's DDL (tables under @p prefix, the quoted schema and a dot).
inline std::vector<std::string> postgres_schema_ddl(std::string_view prefix, int from_version) {
    const std::string s(prefix);
    std::vector<std::string> ddl;
    if (from_version < 1) {
        ddl = {
            "CREATE TABLE IF NOT EXISTS " + s +
                "idem_claims(scope BYTEA NOT NULL, message_id BYTEA NOT NULL, "
                "claimed_at BIGINT NOT NULL, outcome TEXT NOT NULL, "
                "reason TEXT NOT NULL DEFAULT '', fingerprint BYTEA NOT NULL DEFAULT ''::bytea, "
                "PRIMARY KEY (scope, message_id))",
            "CREATE INDEX IF NOT EXISTS idem_claims_claimed_at ON " + s + "idem_claims(claimed_at)",
            "CREATE TABLE IF NOT EXISTS " + s +
                "idem_dead_letters(id BIGSERIAL PRIMARY KEY, scope BYTEA NOT NULL, "
                "message_id BYTEA NOT NULL, delivery_count BIGINT NOT NULL, "
                "reason TEXT NOT NULL, payload BYTEA NOT NULL, created_at BIGINT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS " + s +
                "idem_locks(lock_key BYTEA PRIMARY KEY, owner BYTEA NOT NULL, "
                "expires_at BIGINT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS " + s +
                "idem_outbox(id BIGSERIAL PRIMARY KEY, destination TEXT NOT NULL, "
                "idempotency_key BYTEA NOT NULL UNIQUE, payload BYTEA NOT NULL, "
                "created_at BIGINT NOT NULL, sent_at BIGINT, attempts INTEGER NOT NULL DEFAULT 0, "
                "last_error TEXT NOT NULL DEFAULT '', next_attempt_at BIGINT NOT NULL, "
                "lease_until BIGINT, parked BOOLEAN NOT NULL DEFAULT false)",
            // The relay's query: unsent, unparked rows in id order.
            "CREATE INDEX IF NOT EXISTS idem_outbox_unsent ON " + s +
                "idem_outbox(id) WHERE sent_at IS NULL AND NOT parked",
            // purge(): sent intents by age, held locks by expiry.
            "CREATE INDEX IF NOT EXISTS idem_outbox_sent ON " + s +
                "idem_outbox(sent_at) WHERE sent_at IS NOT NULL",
            "CREATE INDEX IF NOT EXISTS idem_locks_expires_at ON " + s + "idem_locks(expires_at)",
        };
    }
    if (from_version < 2) {
        ddl.push_back("CREATE TABLE IF NOT EXISTS " + s +
                      "idem_attempts(scope BYTEA NOT NULL, message_id BYTEA NOT NULL, "
                      "attempts BIGINT NOT NULL, counted_at BIGINT NOT NULL, "
                      "PRIMARY KEY (scope, message_id))");
        ddl.push_back("CREATE INDEX IF NOT EXISTS idem_attempts_counted_at ON " + s +
                      "idem_attempts(counted_at)");
    }
    if (from_version < 3) {
        ddl.push_back("CREATE TABLE IF NOT EXISTS " + s +
                      "idem_offsets(consumer_group BYTEA NOT NULL, topic BYTEA NOT NULL, "
                      "partition_id INTEGER NOT NULL, next_offset BIGINT NOT NULL, "
                      "updated_at BIGINT NOT NULL, "
                      "PRIMARY KEY (consumer_group, topic, partition_id))");
    }
    if (from_version < 4) {
        ddl.push_back("ALTER TABLE " + s +
                      "idem_dead_letters ADD COLUMN IF NOT EXISTS redrive_count BIGINT NOT NULL "
                      "DEFAULT 0, ADD COLUMN IF NOT EXISTS redriven_at BIGINT");
        ddl.push_back("CREATE INDEX IF NOT EXISTS idem_dead_letters_message ON " + s +
                      "idem_dead_letters(scope, message_id)");
    }
    if (from_version < 5) {
        ddl.push_back("ALTER TABLE " + s +
                      "idem_dead_letters ADD COLUMN IF NOT EXISTS origin BYTEA NOT NULL DEFAULT "
                      "''::bytea, ADD COLUMN IF NOT EXISTS origin_position BYTEA NOT NULL DEFAULT "
                      "''::bytea, ADD COLUMN IF NOT EXISTS failure BYTEA, "
                      "ADD COLUMN IF NOT EXISTS first_failed_at BIGINT, "
                      "ADD COLUMN IF NOT EXISTS last_failed_at BIGINT");
        ddl.push_back("ALTER TABLE " + s +
                      "idem_attempts ADD COLUMN IF NOT EXISTS last_failure BYTEA, "
                      "ADD COLUMN IF NOT EXISTS first_failed_at BIGINT, "
                      "ADD COLUMN IF NOT EXISTS last_failed_at BIGINT");
    }
    if (from_version < 6) {
        ddl.push_back("ALTER TABLE " + s +
                      "idem_outbox ADD COLUMN IF NOT EXISTS scope BYTEA NOT NULL DEFAULT "
                      "''::bytea, ADD COLUMN IF NOT EXISTS message_id BYTEA NOT NULL DEFAULT "
                      "''::bytea");
    }
    return ddl;
}

/// MySQL / MariaDB's DDL (InnoDB). Binary values are BLOBs; the unique keys are SHA-256 hashes
/// in stored generated columns (InnoDB indexes at most 3072 bytes; a 512-byte id and its scope
/// would not fit a plain composite key, and a prefix key is not unique).
inline std::vector<std::string> mysql_schema_ddl(int from_version) {
    std::vector<std::string> ddl;
    if (from_version < 1) {
        ddl = {
            "CREATE TABLE IF NOT EXISTS idem_claims("
            "scope BLOB NOT NULL, message_id BLOB NOT NULL, "
            "claim_key BINARY(32) AS (UNHEX(SHA2(CONCAT(LPAD(LENGTH(scope), 10, '0'), scope, "
            "message_id), 256))) STORED, "
            "claimed_at BIGINT NOT NULL, outcome VARBINARY(32) NOT NULL, reason BLOB NOT NULL, "
            "fingerprint BLOB NOT NULL, UNIQUE KEY idem_claims_key(claim_key), "
            "KEY idem_claims_claimed_at(claimed_at)) ENGINE=InnoDB",
            "CREATE TABLE IF NOT EXISTS idem_dead_letters("
            "id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, scope BLOB NOT NULL, "
            "message_id BLOB NOT NULL, delivery_count BIGINT NOT NULL, reason BLOB NOT NULL, "
            "payload LONGBLOB NOT NULL, created_at BIGINT NOT NULL) ENGINE=InnoDB",
            "CREATE TABLE IF NOT EXISTS idem_locks("
            "lock_key BLOB NOT NULL, "
            "lock_hash BINARY(32) AS (UNHEX(SHA2(lock_key, 256))) STORED, "
            "owner BLOB NOT NULL, expires_at BIGINT NOT NULL, "
            "UNIQUE KEY idem_locks_key(lock_hash), KEY idem_locks_expires_at(expires_at)) "
            "ENGINE=InnoDB",
            "CREATE TABLE IF NOT EXISTS idem_outbox("
            "id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, destination BLOB NOT NULL, "
            "idempotency_key BLOB NOT NULL, "
            "key_hash BINARY(32) AS (UNHEX(SHA2(idempotency_key, 256))) STORED, "
            "payload LONGBLOB NOT NULL, created_at BIGINT NOT NULL, sent_at BIGINT NULL, "
            "attempts INT NOT NULL DEFAULT 0, last_error BLOB NOT NULL, "
            "next_attempt_at BIGINT NOT NULL, lease_until BIGINT NULL, "
            "parked TINYINT(1) NOT NULL DEFAULT 0, UNIQUE KEY idem_outbox_key(key_hash), "
            // The relay's query (unsent, unparked, by id) and purge() (sent by age).
            "KEY idem_outbox_unsent(sent_at, parked, id)) ENGINE=InnoDB",
        };
    }
    if (from_version < 2) {
        ddl.push_back(
            "CREATE TABLE IF NOT EXISTS idem_attempts("
            "scope BLOB NOT NULL, message_id BLOB NOT NULL, "
            "attempt_key BINARY(32) AS (UNHEX(SHA2(CONCAT(LPAD(LENGTH(scope), 10, '0'), scope, "
            "message_id), 256))) STORED, "
            "attempts BIGINT NOT NULL, counted_at BIGINT NOT NULL, "
            "UNIQUE KEY idem_attempts_key(attempt_key), "
            "KEY idem_attempts_counted_at(counted_at)) ENGINE=InnoDB");
    }
    if (from_version < 3) {
        // The key (group, topic, partition) as the claims': a hash, unique.
        ddl.push_back(
            "CREATE TABLE IF NOT EXISTS idem_offsets("
            "consumer_group BLOB NOT NULL, topic BLOB NOT NULL, partition_id INT NOT NULL, "
            "offset_key BINARY(32) AS (UNHEX(SHA2(CONCAT(LPAD(LENGTH(consumer_group), 10, '0'), "
            "consumer_group, LPAD(LENGTH(topic), 10, '0'), topic, partition_id), 256))) STORED, "
            "next_offset BIGINT NOT NULL, updated_at BIGINT NOT NULL, "
            "UNIQUE KEY idem_offsets_key(offset_key)) ENGINE=InnoDB");
    }
    if (from_version < 4) {
        // A message's entries are found by a prefix of its id (a BLOB has no full index).
        ddl.push_back(
            "ALTER TABLE idem_dead_letters ADD COLUMN redrive_count BIGINT NOT NULL DEFAULT 0, "
            "ADD COLUMN redriven_at BIGINT NULL, "
            "ADD KEY idem_dead_letters_message(message_id(191))");
    }
    if (from_version < 5) {
        // NULL for the rows already there: a BLOB takes no default in every MySQL.
        ddl.push_back(
            "ALTER TABLE idem_dead_letters ADD COLUMN origin BLOB NULL, "
            "ADD COLUMN origin_position BLOB NULL, ADD COLUMN failure BLOB NULL, "
            "ADD COLUMN first_failed_at BIGINT NULL, ADD COLUMN last_failed_at BIGINT NULL");
        ddl.push_back(
            "ALTER TABLE idem_attempts ADD COLUMN last_failure BLOB NULL, "
            "ADD COLUMN first_failed_at BIGINT NULL, ADD COLUMN last_failed_at BIGINT NULL");
    }
    if (from_version < 6) {
        ddl.push_back(
            "ALTER TABLE idem_outbox ADD COLUMN scope BLOB NULL, ADD COLUMN message_id BLOB NULL");
    }
    return ddl;
}

/// @throws store_error when @p version is newer than this build understands.
template <class Driver>
void check_not_newer(const Driver& driver, std::int64_t version) {
    if (version > schema_version) {
        throw store_error(fmt::format(
            "idem {}: {} holds idem schema version {}, newer than the version this build of idem "
            "understands ({}); it was written by a newer idem. Upgrade idem in this program, or "
            "point it at {}",
            Driver::name, driver.schema_location(), version, schema_version,
            driver.schema_elsewhere()));
    }
}

/// Creates or migrates the idem tables. Fast path without the lock: an up-to-date database
/// opens even while another process writes. Otherwise in one transaction under the driver's
/// exclusive schema lock, so processes starting at once on an empty database serialize and the
/// later ones find the finished schema.
template <class Driver>
void ensure_schema(Driver& driver) {
    if (const auto version = driver.stored_schema_version()) {
        check_not_newer(driver, *version);
        if (*version == schema_version) return;
    }
    driver.begin_schema_change();
    try {
        const auto version = driver.read_schema_version();
        if (version) check_not_newer(driver, *version);
        if (!version || *version < schema_version) {
            for (const std::string& ddl :
                 driver.schema_ddl(version ? static_cast<int>(*version) : 0)) {
                driver.execute_ddl(ddl);
            }
            driver.write_schema_version(schema_version);
        }
        driver.commit_schema_change();
    } catch (...) {
        driver.rollback_noexcept();
        driver.end_transaction();
        throw;
    }
}

}  // namespace sql
IDEM_END_NAMESPACE
