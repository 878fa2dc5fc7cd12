#pragma once
/// @file
/// @brief idem::mysql::Row: one row of a stored MySQL result as idem's driver reads it (text
/// protocol, binary-safe lengths). Link idem::mysql.

#include <mysql.h>

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <string>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace mysql {

/// One row of a stored result (sql/driver.hpp's Row): text protocol, binary-safe lengths.
class Row {
  public:
    /// A view of @p row with its column @p lengths (mysql_fetch_lengths()), valid until the next
    /// fetch.
    Row(MYSQL_ROW row, const unsigned long* lengths) noexcept : row_(row), lengths_(lengths) {}
    /// A column's bytes (binary-safe); NULL gives "".
    [[nodiscard]] std::string bytes(int column) const {
        const auto c = static_cast<std::size_t>(column);
        return row_[c] == nullptr ? std::string() : std::string(row_[c], lengths_[c]);
    }
    /// An integer column, parsed from its text; NULL or not a number gives 0.
    [[nodiscard]] std::int64_t int64(int column) const {
        const auto c = static_cast<std::size_t>(column);
        std::int64_t value = 0;
        if (row_[c] != nullptr) std::from_chars(row_[c], row_[c] + lengths_[c], value);
        return value;
    }
    /// An integer column as a boolean (non-zero).
    [[nodiscard]] bool boolean(int column) const { return int64(column) != 0; }
    /// True when the column is NULL.
    [[nodiscard]] bool is_null(int column) const noexcept {
        return row_[static_cast<std::size_t>(column)] == nullptr;
    }

  private:
    MYSQL_ROW row_;
    const unsigned long* lengths_;
};

}  // namespace mysql
IDEM_END_NAMESPACE
