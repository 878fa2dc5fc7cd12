#pragma once
/// @file
/// @brief Version and the versioned inline namespace shared by every idem header.

// The one place idem's version is written: CMakeLists.txt reads these three lines for
// project(idem VERSION ...), hence the CMake package's and the pkg-config files' versions and the
// Debian package's. What a version number promises: docs/compatibility.md.

/// @brief idem's major version: a change of the API or of a store's data that breaks code or
/// databases written for the previous one (docs/compatibility.md).
#define IDEM_VERSION_MAJOR 0
/// @brief idem's minor version: additions that keep code and databases working.
#define IDEM_VERSION_MINOR 1
/// @brief idem's patch version: fixes only.
#define IDEM_VERSION_PATCH 0
/// @brief The version as one number, major * 10000 + minor * 100 + patch (0.1.0 is 100), for `#if`.
#define IDEM_VERSION (IDEM_VERSION_MAJOR * 10000 + IDEM_VERSION_MINOR * 100 + IDEM_VERSION_PATCH)

/// @brief Version of the tables the SQL stores (SqliteStore, PostgresStore, MysqlStore) create
/// and migrate to, recorded in their `idem_schema` table; a database with a newer one is refused.
/// The same number as idem::sql::schema_version and each SQL store's `schema_version`.
#define IDEM_SQL_SCHEMA_VERSION 6
/// @brief Version of the layout of RedisStore's keys and claim records
/// (idem/store/redis/record.hpp, keys.hpp); the same number as idem::RedisStore::schema_version.
/// It is not written to Redis: a worker does not detect a record of another layout, so a change
/// of it is a major version of idem (docs/compatibility.md).
#define IDEM_REDIS_SCHEMA_VERSION 1

/// @brief Opens `namespace idem { inline namespace v0 {`. A future ABI change becomes a new
/// inline namespace (v1) instead of a silent break (docs/compatibility.md).
#define IDEM_BEGIN_NAMESPACE \
    namespace idem {         \
    inline namespace v0 {
/// @brief Closes what IDEM_BEGIN_NAMESPACE opened.
#define IDEM_END_NAMESPACE \
    }                      \
    }

/// @brief 1 when the compiler has C++20 concepts (idem then also declares the Store concept).
#if defined(__cpp_concepts) && __cpp_concepts >= 201907L
#define IDEM_HAS_CONCEPTS 1
#else
#define IDEM_HAS_CONCEPTS 0
#endif
