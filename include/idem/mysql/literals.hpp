#pragma once
/// @file
/// @brief MySQL literals: how idem's MySQL driver renders a bound value into SQL text (hex for
/// BLOBs, mysql_real_escape_string for text; the text protocol, no server-side prepare), and the
/// substitution of `?N` (idem's statements) and `?` (the effect's SQL) by those literals.

#include <mysql.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "idem/blob.hpp"
#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/sql/bind_traits.hpp"

IDEM_BEGIN_NAMESPACE
namespace mysql {

/// Appends @p bytes as a hex literal `X'...'` (binary-safe, no escaping needed).
inline void append_hex(std::string& out, std::string_view bytes) {
    static constexpr char digits[] = "0123456789ABCDEF";
    out += "X'";
    for (const char c : bytes) {
        const auto b = static_cast<unsigned char>(c);
        out += digits[b >> 4];
        out += digits[b & 0xF];
    }
    out += '\'';
}

/// Appends @p text as a quoted string literal, escaped for @p conn's character set.
inline void append_text(MYSQL* conn, std::string& out, std::string_view text) {
    std::string buffer(text.size() * 2 + 1, '\0');
    const unsigned long n = mysql_real_escape_string(conn, buffer.data(), text.data(),
                                                     static_cast<unsigned long>(text.size()));
    out += '\'';
    out.append(buffer.data(), n);
    out += '\'';
}

/// Appends @p value as a SQL literal: Blob as hex, text quoted and escaped, integers, finite
/// floating point, bool as 1 / 0, null pointers and empty optionals as NULL. @throws usage_error
/// for an infinite or NaN floating point value.
template <class T>
void append(MYSQL* conn, std::string& out, const T& value) {
    if constexpr (std::is_same_v<T, Blob>) {
        append_hex(out, value.bytes);
    } else if constexpr (std::is_same_v<T, std::nullptr_t> || std::is_same_v<T, std::nullopt_t>) {
        out += "NULL";
    } else if constexpr (sql::is_optional<T>::value) {
        if (value) {
            append(conn, out, *value);
        } else {
            out += "NULL";
        }
    } else if constexpr (std::is_same_v<T, bool>) {
        out += value ? "1" : "0";
    } else if constexpr (sql::is_char_v<T>) {
        static_assert(sql::always_false<T>,
                      "idem: a single character would be bound as its code point; pass a "
                      "std::string_view for text or cast to an integer type");
    } else if constexpr (std::is_integral_v<T>) {
        out += fmt::format("{}", value);
    } else if constexpr (std::is_floating_point_v<T>) {
        if (!std::isfinite(value)) {
            throw usage_error("idem mysql: MySQL stores no infinity or NaN");
        }
        out += fmt::format("{}", value);
    } else if constexpr (std::is_array_v<T>) {
        static_assert(std::is_same_v<std::remove_cv_t<std::remove_extent_t<T>>, char>,
                      "idem: only char arrays (string literals) can be bound as text");
        const void* nul = std::memchr(value, 0, std::extent_v<T>);
        append_text(conn, out,
                    std::string_view(
                        value, nul != nullptr
                                   ? static_cast<std::size_t>(static_cast<const char*>(nul) - value)
                                   : std::extent_v<T>));
    } else if constexpr (std::is_same_v<T, const char*> || std::is_same_v<T, char*>) {
        if (value == nullptr) {
            out += "NULL";
        } else {
            append_text(conn, out, std::string_view(value));
        }
    } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
        append_text(conn, out, std::string_view(value));
    } else {
        static_assert(sql::always_false<T>,
                      "idem: execute()/query_*() bind integers, floating point, bool, "
                      "std::string / std::string_view / const char* (text), "
                      "idem::Blob{bytes} (binary), nullptr / std::nullopt (NULL) and "
                      "std::optional of those");
    }
}

/// Each of @p args as a SQL literal (append()), in order, for render_numbered() and the `?`
/// placeholders.
template <class... Args>
std::vector<std::string> literals([[maybe_unused]] MYSQL* conn, const Args&... args) {
    std::vector<std::string> out(sizeof...(Args));
    [[maybe_unused]] std::size_t i = 0;
    (append(conn, out[i++], args), ...);
    return out;
}

/// idem's statement @p text with `?N` replaced by the N-th of @p values.
inline std::string render_numbered(const std::string& text,
                                   const std::vector<std::string>& values) {
    std::string out;
    out.reserve(text.size() + 64);
    for (std::size_t i = 0; i < text.size(); ++i) {
        if (text[i] != '?') {
            out += text[i];
            continue;
        }
        std::size_t n = 0;
        while (i + 1 < text.size() && text[i + 1] >= '0' && text[i + 1] <= '9')
            n = n * 10 + static_cast<std::size_t>(text[++i] - '0');
        out += values.at(n - 1);
    }
    return out;
}

/// The effect's SQL with each `?` outside quotes and comments replaced by the next of @p values.
/// @throws usage_error when the counts differ.
inline std::string render_placeholders(std::string_view sql,
                                       const std::vector<std::string>& values) {
    std::string out;
    out.reserve(sql.size() + 64);
    std::size_t used = 0;
    for (std::size_t i = 0; i < sql.size(); ++i) {
        const char c = sql[i];
        if (c == '\'' || c == '"' || c == '`') {
            std::size_t j = i + 1;
            while (j < sql.size() && sql[j] != c) {
                if (sql[j] == '\\' && c != '`') ++j;
                ++j;
            }
            out.append(sql.substr(i, j + 1 - i));
            i = j;
        } else if (c == '#' || (c == '-' && sql.substr(i, 3) == "-- ")) {
            const std::size_t end = std::min(sql.find('\n', i), sql.size());
            out.append(sql.substr(i, end - i));
            i = end - 1;
        } else if (c == '/' && sql.substr(i, 2) == "/*") {
            const std::size_t end = std::min(sql.find("*/", i + 2), sql.size() - 2) + 2;
            out.append(sql.substr(i, end - i));
            i = end - 1;
        } else if (c == '?') {
            if (used < values.size()) {
                out += values[used];
            } else {
                out += c;
            }
            ++used;
        } else {
            out += c;
        }
    }
    if (used != values.size()) {
        throw usage_error(fmt::format(
            "idem mysql: the SQL has {} parameter(s) but {} value(s) were given; SQL: {}", used,
            values.size(), sql));
    }
    return out;
}

}  // namespace mysql
IDEM_END_NAMESPACE
