#pragma once
/// @file
/// @brief The MySQL / MariaDB error numbers idem's driver tells apart: a lock wait timeout, a
/// deadlock, a lost connection (is_lost()), a timeout worth retrying (is_timeout()). Plain
/// functions of mysql_errno()'s number. Link idem::mysql.

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace mysql {

// Server and client error numbers (mysqld_error.h, errmsg.h).
/// ER_LOCK_WAIT_TIMEOUT: a row lock waited for past innodb_lock_wait_timeout (a claim's:
/// in_progress).
inline constexpr unsigned er_lock_wait_timeout = 1205;
/// ER_LOCK_DEADLOCK: InnoDB chose this transaction as a deadlock's victim and rolled it back.
inline constexpr unsigned er_lock_deadlock = 1213;

/// ER_DUP_FIELDNAME: ALTER TABLE ... ADD COLUMN of a column the table has.
inline constexpr unsigned er_dup_fieldname = 1060;
/// ER_DUP_KEYNAME: ALTER TABLE ... ADD KEY of a key the table has.
inline constexpr unsigned er_dup_keyname = 1061;

// Claims in partitions (mysql/partitions.hpp).
/// ER_NO_DEFAULT_FOR_FIELD: an insert without a column that has no default (a claim without
/// its key, written as for one table, on claims in partitions, in strict mode).
inline constexpr unsigned er_no_default_for_field = 1364;
/// ER_CONSTRAINT_FAILED: a CHECK constraint refused the row (the same claim, without strict
/// mode).
inline constexpr unsigned er_constraint_failed = 4025;
/// ER_DROP_PARTITION_NON_EXISTENT: no such partition (another process dropped it).
inline constexpr unsigned er_no_such_partition = 1507;
/// ER_UNKNOWN_PARTITION: a `PARTITION (name)` selection of a partition that is not there.
inline constexpr unsigned er_unknown_partition = 1735;
/// ER_RANGE_NOT_INCREASING: an added range partition is not past the last one (another
/// process added it).
inline constexpr unsigned er_range_not_increasing = 1493;
/// ER_SAME_NAME_PARTITION: a partition of that name exists (another process added it).
inline constexpr unsigned er_same_name_partition = 1517;

/// The connection is gone: the server went away, closed or killed it, or cannot be reached.
inline bool is_lost(unsigned code) noexcept {
    switch (code) {
        case 1053:  // ER_SERVER_SHUTDOWN
        case 1927:  // ER_CONNECTION_KILLED
        case 2002:  // CR_CONNECTION_ERROR
        case 2003:  // CR_CONN_HOST_ERROR
        case 2006:  // CR_SERVER_GONE_ERROR
        case 2013:  // CR_SERVER_LOST
        case 2026:  // CR_SSL_CONNECTION_ERROR
        case 2055:  // CR_SERVER_LOST_EXTENDED
        case 4031:  // ER_CLIENT_INTERACTION_TIMEOUT (MySQL 8)
            return true;
        default:
            return false;
    }
}

/// A lock or statement timeout, a deadlock: retrying later may work.
inline bool is_timeout(unsigned code) noexcept {
    return code == er_lock_wait_timeout || code == er_lock_deadlock ||
           code == 1969 /* ER_STATEMENT_TIMEOUT (MariaDB) */ ||
           code == 3024 /* ER_QUERY_TIMEOUT (MySQL) */;
}

}  // namespace mysql
IDEM_END_NAMESPACE
