#pragma once
/// @file
/// @brief The libpq layer of idem's PostgreSQL driver (namespace idem::postgres): the values a
/// pipeline sends (Command, Statement, the binding of parameters as text or binary BYTEA), the
/// reading of results, the classification of SQLSTATEs into idem's exceptions, and libpq's own
/// notice hooks. With postgres/connection.hpp (the session: postgres::Connection),
/// postgres/driver.hpp, postgres/claims.hpp and idem/store/postgres.hpp, the only idem headers
/// that include <libpq-fe.h>.

#include <libpq-fe.h>

#include <charconv>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "idem/blob.hpp"
#include "idem/config.hpp"
#include "idem/contract/records.hpp"
#include "idem/detail/sha256.hpp"
#include "idem/error.hpp"
#include "idem/sql/bind_traits.hpp"

IDEM_BEGIN_NAMESPACE
namespace postgres {

// Type OIDs of the built-in types idem reads or binds (pg_type.h, stable across versions).
/// OID of `boolean`.
inline constexpr Oid bool_oid = 16;
/// OID of `bytea`.
inline constexpr Oid bytea_oid = 17;
/// OID of `bigint`.
inline constexpr Oid int8_oid = 20;
/// OID of `smallint`.
inline constexpr Oid int2_oid = 21;
/// OID of `integer`.
inline constexpr Oid int4_oid = 23;
/// OID of `bytea[]`.
inline constexpr Oid bytea_array_oid = 1001;
/// OID of `bigint[]`.
inline constexpr Oid int8_array_oid = 1016;

/// The most parameters one statement can have: the protocol's limit.
inline constexpr std::size_t max_parameters = 65535;  // the protocol's limit

/// libpq's own notice receiver and processor, those every new PGconn starts with. libpq does not
/// export them; a connection object that never connects (its conninfo has an unknown option, so
/// nothing is sent) hands them out, once per process.
struct LibpqNoticeHooks {
    /// libpq's default notice receiver (null if it could not be read).
    PQnoticeReceiver receiver = nullptr;
    /// libpq's default notice processor (null if it could not be read).
    PQnoticeProcessor processor = nullptr;
};
/// @brief libpq's default notice hooks, read once per process (see LibpqNoticeHooks): a borrowed
/// connection still using them gets idem's receiver, chained to its processor, and them back when
/// the store lets it go.
inline const LibpqNoticeHooks& libpq_notice_hooks() {
    static const LibpqNoticeHooks hooks = [] {
        LibpqNoticeHooks found;
        if (PGconn* probe = PQconnectStart("idem_no_such_option=1")) {
            // A null function reads the current hook without changing it.
            found.receiver = PQsetNoticeReceiver(probe, nullptr, nullptr);
            found.processor = PQsetNoticeProcessor(probe, nullptr, nullptr);
            PQfinish(probe);
        }
        return found;
    }();
    return hooks;
}

using sql::always_false;
using sql::is_char_v;
using sql::is_optional;

/// PQclear() as a deleter.
struct ResultFree {
    /// Frees @p result.
    void operator()(PGresult* result) const noexcept { PQclear(result); }
};
/// An owned PGresult.
using Result = std::unique_ptr<PGresult, ResultFree>;

/// A statement that can be prepared once per session under `name`.
struct Statement {
    /// The statement's text, `$N` placeholders.
    std::string sql;
    std::string name;  ///< empty: never prepared (transaction control)
    /// Its parameters' type OIDs (0: inferred by the server).
    std::vector<Oid> types;
    /// Prepared on the current session.
    bool prepared = false;
};

/// One command of a pipeline. It owns its parameter values: it may be queued and sent later.
struct Command {
    Statement* statement = nullptr;  ///< the statement to run or, when null, `sql`
    /// The text to run when `statement` is null.
    std::string sql;
    /// The parameters' values, text or binary.
    std::vector<std::string> values;
    /// Per parameter: 1 for NULL.
    std::vector<char> nulls;
    /// Per parameter: 0 text, 1 binary.
    std::vector<int> formats;
    /// Per parameter: its type OID (0: inferred).
    std::vector<Oid> types;
    int result_format = 1;    ///< idem's own statements read binary results
    bool user = false;        ///< the effect's SQL: errors become store_error, with the SQL
    bool control = false;     ///< BEGIN / SET / SAVEPOINT …: writes nothing
    bool savepoint = false;   ///< `SAVEPOINT idem_effect` (a RELEASE right after cancels it)
    std::string_view what{};  ///< for messages

    /// The text it runs: the statement's, or `sql`.
    [[nodiscard]] const std::string& text() const {
        return statement != nullptr ? statement->sql : sql;
    }
};

/// @p text as valid UTF-8 without NULs: each invalid byte (and each NUL) becomes U+FFFD.
inline std::string valid_utf8(std::string_view text) {
    static constexpr std::string_view replacement = "\xEF\xBF\xBD";
    std::string out;
    out.reserve(text.size());
    std::size_t i = 0;
    while (i < text.size()) {
        const auto lead = static_cast<unsigned char>(text[i]);
        if (lead != 0 && lead < 0x80) {
            out.push_back(static_cast<char>(lead));
            ++i;
            continue;
        }
        std::size_t length = 0;
        std::uint32_t code = 0;
        std::uint32_t smallest = 0;
        if ((lead & 0xE0) == 0xC0) {
            length = 2, code = lead & 0x1Fu, smallest = 0x80;
        } else if ((lead & 0xF0) == 0xE0) {
            length = 3, code = lead & 0x0Fu, smallest = 0x800;
        } else if ((lead & 0xF8) == 0xF0) {
            length = 4, code = lead & 0x07u, smallest = 0x10000;
        }
        bool ok = length != 0 && i + length <= text.size();
        for (std::size_t k = 1; ok && k < length; ++k) {
            const auto next = static_cast<unsigned char>(text[i + k]);
            ok = (next & 0xC0) == 0x80;
            code = (code << 6) | (next & 0x3Fu);
        }
        ok = ok && code >= smallest && code <= 0x10FFFF && (code < 0xD800 || code > 0xDFFF);
        if (ok) {
            out.append(text.substr(i, length));
            i += length;
        } else {
            out.append(replacement);
            ++i;
        }
    }
    return out;
}

/// An outbox destination is stored as TEXT: @throws usage_error unless it is valid UTF-8.
inline void check_text_destination(const OutboxIntent& intent) {
    if (valid_utf8(intent.destination) != intent.destination) {
        throw usage_error(
            "idem postgres: add_outbox(): the destination is not valid UTF-8 or holds a NUL "
            "byte; it is stored as TEXT");
    }
}

/// A stable 64-bit key for pg_advisory_xact_lock (first 8 bytes of SHA-256).
inline std::int64_t advisory_key(std::string_view domain, std::string_view key) {
    detail::Sha256 hash;
    hash.update(domain);
    hash.update(std::string_view("\0", 1));
    hash.update(key);
    const auto digest = hash.finish();
    std::uint64_t value = 0;
    for (std::size_t i = 0; i < 8; ++i)
        value = (value << 8) | digest[i];
    return static_cast<std::int64_t>(value);
}

/// `"name"` with embedded quotes doubled: a safe SQL identifier for any name.
inline std::string quote_identifier(std::string_view name) {
    std::string out = "\"";
    for (char c : name) {
        if (c == '"') out.push_back('"');
        out.push_back(c);
    }
    out.push_back('"');
    return out;
}

/// Appends a NULL parameter to @p command.
inline void add_null(Command& command) {
    command.values.emplace_back();
    command.nulls.push_back(1);
    command.formats.push_back(0);
    command.types.push_back(0);
}

/// Appends a text parameter (its type inferred by the server). @throws usage_error when @p text
/// holds a NUL byte.
inline void add_text(Command& command, std::string text) {
    if (text.find('\0') != std::string::npos) {
        throw usage_error(fmt::format(
            "idem postgres: parameter ${} contains a NUL byte, which PostgreSQL text cannot hold; "
            "bind it as idem::Blob{{bytes}} into a BYTEA column{}{}",
            command.values.size() + 1, command.user ? "; SQL: " : "",
            command.user ? command.text() : std::string()));
    }
    command.values.push_back(std::move(text));
    command.nulls.push_back(0);
    command.formats.push_back(0);
    command.types.push_back(0);  // the server infers the type from the SQL
}

/// Appends a binary `bytea` parameter. @throws usage_error when it is over 2 GiB.
inline void add_blob(Command& command, std::string_view bytes) {
    if (bytes.size() > static_cast<std::size_t>(INT_MAX)) {
        throw usage_error(
            fmt::format("idem postgres: parameter ${} is over 2 GiB", command.values.size() + 1));
    }
    command.values.emplace_back(bytes);
    command.nulls.push_back(0);
    command.formats.push_back(1);
    command.types.push_back(bytea_oid);
}

/// Appends a `bigint[]` parameter, in text (`{1,-2,3}`).
inline void add_int8_array(Command& command, const std::vector<std::int64_t>& items) {
    std::string out = "{";
    for (std::size_t i = 0; i < items.size(); ++i) {
        if (i > 0) out.push_back(',');
        out += std::to_string(items[i]);
    }
    out.push_back('}');
    command.values.push_back(std::move(out));
    command.nulls.push_back(0);
    command.formats.push_back(0);
    command.types.push_back(int8_array_oid);
}

/// Appends a `bytea[]` parameter in PostgreSQL's binary array format (one dimension, no NULLs).
inline void add_bytea_array(Command& command, const std::vector<std::string_view>& items) {
    std::size_t size = 20;
    for (std::string_view item : items)
        size += 4 + item.size();
    if (size > static_cast<std::size_t>(INT_MAX)) {
        throw usage_error(
            fmt::format("idem postgres: parameter ${} is over 2 GiB", command.values.size() + 1));
    }
    std::string out;
    out.reserve(size);
    const auto put = [&out](std::uint32_t value) {
        for (int shift = 24; shift >= 0; shift -= 8)
            out.push_back(static_cast<char>((value >> shift) & 0xFFu));
    };
    put(items.empty() ? 0 : 1);  // dimensions
    put(0);                      // no NULLs
    put(bytea_oid);
    if (!items.empty()) {
        put(static_cast<std::uint32_t>(items.size()));
        put(1);  // lower bound
    }
    for (std::string_view item : items) {
        put(static_cast<std::uint32_t>(item.size()));
        out.append(item.data(), item.size());
    }
    command.values.push_back(std::move(out));
    command.nulls.push_back(0);
    command.formats.push_back(1);
    command.types.push_back(bytea_array_oid);
}

/// @p value as PostgreSQL reads it back exactly (NaN and the infinities by name).
inline std::string float_text(double value) {
    if (value != value) return "NaN";
    if (value == std::numeric_limits<double>::infinity()) return "Infinity";
    if (value == -std::numeric_limits<double>::infinity()) return "-Infinity";
    return fmt::format("{}", value);  // shortest text that reads back exactly
}

/// Appends one bound value to @p command.
template <class T>
void add_param(Command& command, const T& value) {
    if constexpr (std::is_same_v<T, Blob>) {
        add_blob(command, value.bytes);
    } else if constexpr (std::is_same_v<T, std::nullptr_t> || std::is_same_v<T, std::nullopt_t>) {
        add_null(command);
    } else if constexpr (is_optional<T>::value) {
        if (value) {
            add_param(command, *value);
        } else {
            add_null(command);
        }
    } else if constexpr (std::is_same_v<T, bool>) {
        add_text(command, value ? "true" : "false");
    } else if constexpr (is_char_v<T>) {
        static_assert(always_false<T>,
                      "idem: a single character would be bound as its code point; pass a "
                      "std::string_view for text or cast to an integer type");
    } else if constexpr (std::is_integral_v<T>) {
        add_text(command, std::to_string(value));
    } else if constexpr (std::is_floating_point_v<T>) {
        add_text(command, float_text(static_cast<double>(value)));
    } else if constexpr (std::is_array_v<T>) {
        static_assert(std::is_same_v<std::remove_cv_t<std::remove_extent_t<T>>, char>,
                      "idem: only char arrays (string literals) can be bound as text");
        const void* nul = std::memchr(value, 0, std::extent_v<T>);
        const std::size_t size =
            nul != nullptr ? static_cast<std::size_t>(static_cast<const char*>(nul) - value)
                           : std::extent_v<T>;
        add_text(command, std::string(value, size));
    } else if constexpr (std::is_same_v<T, const char*> || std::is_same_v<T, char*>) {
        if (value == nullptr) {
            add_null(command);
        } else {
            add_text(command, std::string(value));
        }
    } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
        add_text(command, std::string(std::string_view(value)));
    } else {
        static_assert(always_false<T>,
                      "idem: execute()/query_*() bind integers, floating point, bool, "
                      "std::string / std::string_view / const char* (text), idem::Blob{bytes} "
                      "(bytea), nullptr / std::nullopt (NULL) and std::optional of those");
    }
}

/// Appends each of @p args as a parameter (add_param()), in order. @throws usage_error past
/// max_parameters, or as add_param().
template <class... Args>
void add_params(Command& command, const Args&... args) {
    if (sizeof...(Args) > max_parameters) {
        throw usage_error("idem postgres: more than 65535 parameters in one statement");
    }
    command.values.reserve(sizeof...(Args));
    (add_param(command, args), ...);
}

/// True for a command that completed (with or without rows).
inline bool succeeded(const PGresult* result) noexcept {
    if (result == nullptr) return false;
    const ExecStatusType status = PQresultStatus(result);
    return status == PGRES_COMMAND_OK || status == PGRES_TUPLES_OK;
}

/// A command that failed itself (not one skipped because an earlier one failed).
inline bool failed(const PGresult* result) noexcept {
    if (result == nullptr) return false;
    const ExecStatusType status = PQresultStatus(result);
    return status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK &&
           status != PGRES_PIPELINE_ABORTED && status != PGRES_PIPELINE_SYNC;
}

/// The SQLSTATE of a failed command; empty for libpq's own failures.
inline std::string_view sqlstate(const PGresult* result) noexcept {
    const char* state = result != nullptr ? PQresultErrorField(result, PG_DIAG_SQLSTATE) : nullptr;
    return state != nullptr ? std::string_view(state) : std::string_view();
}

/// @p text (null: "") on one line: trailing newlines and spaces removed, inner newlines and tabs as
/// spaces.
inline std::string trimmed(const char* text) {
    std::string out = text != nullptr ? text : "";
    while (!out.empty() && (out.back() == '\n' || out.back() == ' ' || out.back() == '\r'))
        out.pop_back();
    for (char& c : out)
        if (c == '\n' || c == '\t') c = ' ';
    return out;
}

/// The server's message for a failed command: primary text, detail, hint and SQLSTATE.
inline std::string server_message(const PGresult* result) {
    const char* primary = PQresultErrorField(result, PG_DIAG_MESSAGE_PRIMARY);
    if (primary == nullptr) return trimmed(PQresultErrorMessage(result));
    std::string out = primary;
    if (const char* detail = PQresultErrorField(result, PG_DIAG_MESSAGE_DETAIL)) {
        out += fmt::format("; {}", detail);
    }
    if (const char* hint = PQresultErrorField(result, PG_DIAG_MESSAGE_HINT)) {
        out += fmt::format("; hint: {}", hint);
    }
    const std::string_view state = sqlstate(result);
    if (!state.empty()) out += fmt::format(" (SQLSTATE {})", state);
    return out;
}

/// Lock, statement and serialization timeouts: the work may succeed when retried.
inline bool is_timeout(std::string_view state) noexcept {
    return state == "55P03" || state == "57014" || state == "40001" || state == "40P01";
}

/// The connection or the server is gone or out of resources.
inline bool is_unavailable(std::string_view state) noexcept {
    if (state.empty()) return true;  // libpq's own failure
    const std::string_view cls = state.substr(0, 2);
    return (cls == "08" && state != "08P01") || cls == "57" || cls == "53" || cls == "58" ||
           cls == "XX";
}

/// Integer of a binary int2 / int4 / int8 column (also bool: 0 / 1).
inline std::int64_t binary_int(const PGresult* result, int row, int column) {
    const auto* bytes = reinterpret_cast<const unsigned char*>(PQgetvalue(result, row, column));
    const int length = PQgetlength(result, row, column);
    std::uint64_t value = 0;
    for (int i = 0; i < length && i < 8; ++i)
        value = (value << 8) | bytes[i];
    if (length > 1 && length < 8 && (bytes[0] & 0x80) != 0)
        value |= ~std::uint64_t{0} << (8 * length);
    return static_cast<std::int64_t>(value);
}

/// A binary `boolean` column.
inline bool binary_bool(const PGresult* result, int row, int column) {
    return PQgetlength(result, row, column) == 1 && PQgetvalue(result, row, column)[0] != 0;
}

/// The bytes of a column (binary BYTEA or TEXT), NUL-safe.
inline std::string bytes_of(const PGresult* result, int row, int column) {
    if (PQgetisnull(result, row, column) != 0) return {};
    return std::string(PQgetvalue(result, row, column),
                       static_cast<std::size_t>(PQgetlength(result, row, column)));
}

/// A text-format column as bytes: BYTEA is decoded from its hex (or escape) output.
inline std::string text_column(const PGresult* result, int row, int column) {
    if (PQftype(result, column) != bytea_oid) return bytes_of(result, row, column);
    std::size_t length = 0;
    unsigned char* decoded = PQunescapeBytea(
        reinterpret_cast<const unsigned char*>(PQgetvalue(result, row, column)), &length);
    if (decoded == nullptr) throw std::bad_alloc();
    std::string out(reinterpret_cast<const char*>(decoded), length);
    PQfreemem(decoded);
    return out;
}

/// A text-format column as an integer (integer types, bool, and numerics without a fraction).
inline std::int64_t text_int(const PGresult* result, int row, int column, std::string_view sql) {
    const char* text = PQgetvalue(result, row, column);
    const std::size_t length = static_cast<std::size_t>(PQgetlength(result, row, column));
    if (PQftype(result, column) == bool_oid) return length > 0 && text[0] == 't' ? 1 : 0;
    std::int64_t value = 0;
    const auto [end, error] = std::from_chars(text, text + length, value);
    if (error != std::errc() || end != text + length) {
        throw usage_error(fmt::format(
            "idem postgres: query_int(): the first column is '{}' (type OID {}), not an integer "
            "that fits 64 bits; SQL: {}",
            std::string_view(text, length), PQftype(result, column), sql));
    }
    return value;
}

/// The rows a command changed or returned (PQcmdTuples); 0 when it does not say.
inline std::int64_t affected_rows(const PGresult* result) {
    const char* text = PQcmdTuples(const_cast<PGresult*>(result));
    if (text == nullptr || *text == '\0') return 0;
    std::int64_t value = 0;
    std::from_chars(text, text + std::strlen(text), value);
    return value;
}

/// One row of an idem statement's (binary) result (sql/driver.hpp's Row).
class Row {
  public:
    /// Row @p row of @p result (which must outlive it).
    Row(const PGresult* result, int row) noexcept : result_(result), row_(row) {}
    /// A binary BYTEA or TEXT column's bytes; NULL gives "".
    [[nodiscard]] std::string bytes(int column) const { return bytes_of(result_, row_, column); }
    /// A binary int2 / int4 / int8 column (bool as 0 / 1).
    [[nodiscard]] std::int64_t int64(int column) const { return binary_int(result_, row_, column); }
    /// A binary `boolean` column.
    [[nodiscard]] bool boolean(int column) const { return binary_bool(result_, row_, column); }
    /// True when the column is NULL.
    [[nodiscard]] bool is_null(int column) const noexcept {
        return PQgetisnull(result_, row_, column) != 0;
    }

  private:
    const PGresult* result_;
    int row_;
};

}  // namespace postgres
IDEM_END_NAMESPACE
