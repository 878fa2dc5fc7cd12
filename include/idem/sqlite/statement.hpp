#pragma once
/// @file
/// @brief SQLite statements for idem's SQLite driver: the error helpers (busy, message), binding
/// a value by its C++ type, reading a column, and the RAII pieces that reset a cached statement
/// (StatementUse) and read a row (Row).

#include <sqlite3.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include <fmt/format.h>

#include "idem/blob.hpp"
#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/sql/bind_traits.hpp"

IDEM_BEGIN_NAMESPACE
namespace sqlite {

using sql::always_false;
using sql::is_char_v;
using sql::is_optional;

/// True for SQLITE_BUSY and SQLITE_LOCKED (extended codes included): a wait on another connection
/// past the busy timeout.
inline bool is_busy(int rc) noexcept {
    const int primary = rc & 0xff;
    return primary == SQLITE_BUSY || primary == SQLITE_LOCKED;
}

/// SQLite's message for the last failure on @p db, with its (extended) result code.
inline std::string error_text(sqlite3* db, int rc) {
    if (db == nullptr) return fmt::format("{} (SQLite error {})", sqlite3_errstr(rc), rc);
    return fmt::format("{} (SQLite error {})", sqlite3_errmsg(db), sqlite3_extended_errcode(db));
}

/// Binds @p text as TEXT, not copied (the value outlives the statement's use). @return SQLite's
/// result code.
inline int bind_text(sqlite3_stmt* stmt, int index, std::string_view text) noexcept {
    // SQLITE_STATIC: the caller's value outlives the statement's use (bindings are cleared
    // before execute() returns), so nothing is copied.
    return sqlite3_bind_text64(stmt, index, text.empty() ? "" : text.data(),
                               static_cast<sqlite3_uint64>(text.size()), SQLITE_STATIC,
                               SQLITE_UTF8);
}

/// Binds @p bytes as a BLOB, not copied; empty binds a zero-length BLOB, not NULL. @return SQLite's
/// result code.
inline int bind_blob(sqlite3_stmt* stmt, int index, std::string_view bytes) noexcept {
    // A null pointer would bind NULL; an empty id is a zero-length BLOB, not NULL.
    if (bytes.empty()) return sqlite3_bind_zeroblob(stmt, index, 0);
    return sqlite3_bind_blob64(stmt, index, bytes.data(), static_cast<sqlite3_uint64>(bytes.size()),
                               SQLITE_STATIC);
}

/// Binds one value; returns SQLite's result code.
template <class T>
int bind_value(sqlite3_stmt* stmt, int index, const T& value) {
    if constexpr (std::is_same_v<T, Blob>) {
        return bind_blob(stmt, index, value.bytes);
    } else if constexpr (std::is_same_v<T, std::nullptr_t> || std::is_same_v<T, std::nullopt_t>) {
        return sqlite3_bind_null(stmt, index);
    } else if constexpr (is_optional<T>::value) {
        if (value) return bind_value(stmt, index, *value);
        return sqlite3_bind_null(stmt, index);
    } else if constexpr (std::is_same_v<T, bool>) {
        return sqlite3_bind_int64(stmt, index, value ? 1 : 0);
    } else if constexpr (is_char_v<T>) {
        static_assert(always_false<T>,
                      "idem: a single character would be bound as its code point; pass a "
                      "std::string_view for TEXT or cast to an integer type");
        return SQLITE_MISUSE;
    } else if constexpr (std::is_integral_v<T>) {
        if constexpr (std::is_unsigned_v<T> && sizeof(T) >= sizeof(std::int64_t)) {
            if (value > static_cast<T>(std::numeric_limits<std::int64_t>::max())) {
                throw usage_error(fmt::format(
                    "idem sqlite: parameter {} is {}, above SQLite's largest integer (2^63-1)",
                    index, value));
            }
        }
        return sqlite3_bind_int64(stmt, index, static_cast<sqlite3_int64>(value));
    } else if constexpr (std::is_floating_point_v<T>) {
        return sqlite3_bind_double(stmt, index, static_cast<double>(value));
    } else if constexpr (std::is_array_v<T>) {
        static_assert(std::is_same_v<std::remove_cv_t<std::remove_extent_t<T>>, char>,
                      "idem: only char arrays (string literals) can be bound as TEXT");
        const void* nul = std::memchr(value, 0, std::extent_v<T>);
        const std::size_t size =
            nul != nullptr ? static_cast<std::size_t>(static_cast<const char*>(nul) - value)
                           : std::extent_v<T>;
        return bind_text(stmt, index, std::string_view(value, size));
    } else if constexpr (std::is_same_v<T, const char*> || std::is_same_v<T, char*>) {
        if (value == nullptr) return sqlite3_bind_null(stmt, index);
        return bind_text(stmt, index, std::string_view(value));
    } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
        return bind_text(stmt, index, std::string_view(value));
    } else {
        static_assert(always_false<T>,
                      "idem: execute()/query_*() bind integers (INTEGER), floating point (REAL), "
                      "std::string / std::string_view / const char* (TEXT), idem::Blob{bytes} "
                      "(BLOB), nullptr / std::nullopt (NULL) and std::optional of those");
        return SQLITE_MISUSE;
    }
}

/// The bytes of one column, binary-safe (BLOB or TEXT with NULs / invalid UTF-8).
inline std::string column_string(sqlite3_stmt* stmt, int column) {
    if (sqlite3_column_type(stmt, column) == SQLITE_BLOB) {
        const void* data = sqlite3_column_blob(stmt, column);
        const int size = sqlite3_column_bytes(stmt, column);
        if (data == nullptr || size <= 0) return {};
        return std::string(static_cast<const char*>(data), static_cast<std::size_t>(size));
    }
    const unsigned char* data = sqlite3_column_text(stmt, column);
    const int size = sqlite3_column_bytes(stmt, column);
    if (data == nullptr || size <= 0) return {};
    return std::string(reinterpret_cast<const char*>(data), static_cast<std::size_t>(size));
}

/// Resets and clears a cached statement (or finalizes a one-off one) when a use ends.
class StatementUse {
  public:
    /// Guards one use of @p stmt: a cached one (@p one_off false) is reset and its bindings
    /// cleared, a one-off one finalized.
    StatementUse(sqlite3_stmt* stmt, bool one_off) noexcept : stmt_(stmt), one_off_(one_off) {}
    StatementUse(const StatementUse&) = delete;
    StatementUse& operator=(const StatementUse&) = delete;
    ~StatementUse() {
        if (one_off_) {
            sqlite3_finalize(stmt_);
        } else {
            sqlite3_reset(stmt_);
            sqlite3_clear_bindings(stmt_);
        }
    }

  private:
    sqlite3_stmt* stmt_;
    bool one_off_;
};

/// One result row of a stepped statement (sql/driver.hpp's Row).
class Row {
  public:
    /// The current row of @p stmt, just stepped to SQLITE_ROW.
    explicit Row(sqlite3_stmt* stmt) noexcept : stmt_(stmt) {}
    /// A BLOB or TEXT column's bytes; NULL gives "".
    [[nodiscard]] std::string bytes(int column) const { return column_string(stmt_, column); }
    /// An integer column (booleans as 0 / 1).
    [[nodiscard]] std::int64_t int64(int column) const noexcept {
        return sqlite3_column_int64(stmt_, column);
    }
    /// An integer column as a boolean (non-zero).
    [[nodiscard]] bool boolean(int column) const noexcept { return int64(column) != 0; }
    /// True when the column is NULL.
    [[nodiscard]] bool is_null(int column) const noexcept {
        return sqlite3_column_type(stmt_, column) == SQLITE_NULL;
    }
    /// The statement, for the columns the helpers above do not read.
    [[nodiscard]] sqlite3_stmt* stmt() const noexcept { return stmt_; }

  private:
    sqlite3_stmt* stmt_;
};

}  // namespace sqlite
IDEM_END_NAMESPACE
