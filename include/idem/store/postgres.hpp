#pragma once
/// @file
/// @brief idem::PostgresStore: the scale-out store on PostgreSQL (libpq). Claims are
/// `INSERT … ON CONFLICT DO NOTHING` in the user's transaction on the same `PGconn*`; a
/// concurrent claim of one id waits on the unique index, bounded by `lock_timeout`. The only
/// idem header that includes <libpq-fe.h>.
///
/// @code
/// idem::PostgresStore store{"host=db dbname=shop user=consumer"};   // or the consumer's PGconn*
/// auto tx = store.begin();                        // sends nothing yet (see "Round trips")
/// if (tx.claim("capture-payment", msg_id).status == idem::ClaimStatus::claimed) {
///     tx.execute("INSERT INTO captures(order_id, ref) VALUES ($1, $2)", order_id, ref);
///     tx.record_outcome("capture-payment", msg_id, idem::Disposition::processed, {});
///     tx.commit();                                // claim and rows become visible together
/// }                                               // otherwise ~Transaction rolls back
/// @endcode
///
/// Schema (created and versioned by the store in `idem_schema`, in PostgresOptions::schema;
/// every time is unix ms from the store's clock):
/// - `idem_claims(scope BYTEA, message_id BYTEA, claimed_at BIGINT, outcome TEXT, reason TEXT,
///   fingerprint BYTEA, PRIMARY KEY(scope, message_id))`, indexed on claimed_at;
/// - `idem_dead_letters(id BIGSERIAL, scope, message_id, delivery_count, reason, payload BYTEA,
///   created_at)`;
/// - `idem_locks(lock_key BYTEA PRIMARY KEY, owner BYTEA, expires_at BIGINT)`: hold_lock();
/// - `idem_outbox(id BIGSERIAL PRIMARY KEY, destination TEXT, idempotency_key BYTEA UNIQUE,
///   payload BYTEA, created_at, sent_at NULL, attempts INT, last_error TEXT, next_attempt_at,
///   lease_until NULL, parked BOOLEAN)`, with a partial index on the unsent rows.
/// The tables are created under `pg_advisory_xact_lock`, so processes starting at once on an
/// empty database do not race; a database holding a newer schema version is refused.
///
/// Round trips: commands whose answer is not needed at once (BEGIN, `SET LOCAL lock_timeout`,
/// SAVEPOINT, RELEASE, record_outcome(), dead_letter()) are queued and sent in one libpq
/// pipeline with the next command that needs an answer. A handled message costs one round trip
/// for BEGIN + claim, one per statement of the effect, and one for RELEASE + outcome + COMMIT:
/// the same count as the effect's own transaction without idem; a duplicate costs the claim, the
/// read of its stored outcome and a ROLLBACK. A batch (handle_batch) claims all its ids in one
/// round trip (claim_many), plus one reading the stored outcomes when some were there already.
/// Errors of a queued command surface at that next call. Statements are prepared once per session
/// (named `idem_<n>_<m>`; switch off with PostgresOptions::prepare_statements for poolers that
/// cannot keep them).
///
/// Binding: every value reaches SQL as a bound parameter (`$1`, `$2`, …). Integers, floating
/// point, bool and strings go as text and take the type the SQL gives them; `idem::Blob{bytes}`
/// goes as binary BYTEA. Scopes, ids, keys and payloads are stored as BYTEA: bind them as
/// `idem::Blob{id}` when querying the idem tables by hand. Reasons and last errors are stored as
/// TEXT in valid UTF-8 (invalid bytes and NULs become U+FFFD); the database should be UTF8.
///
/// Failures: a claim that waits past lock_timeout → ClaimStatus::in_progress (PostgreSQL has
/// aborted the transaction; the handler drops it; claim_many() recovers through a savepoint and
/// answers in_progress for the held ids only). Other lock / statement timeouts,
/// serialization failures and deadlocks → idem::store_timeout; a refused COMMIT (a deferred
/// constraint, an earlier failed statement) → idem::commit_failed, everything rolled back; a
/// lost connection → idem::store_unavailable (during COMMIT the outcome is unknown: the
/// redelivery finds the claim if it committed), and the next begin() reconnects (PQreset, also
/// for a borrowed connection: the pointer stays valid, the session is new). Errors of the
/// effect's SQL → idem::store_error with the server's message and the SQL. The handler turns
/// each into `failed`. Set TCP keepalives / `tcp_user_timeout` in the conninfo so a silent
/// network partition becomes an error instead of a hang.
///
/// Notices (NOTICE, WARNING, INFO … from the server, `RAISE NOTICE` in the effect's SQL) never go
/// to stderr from a connection the store opened: they reach PostgresOptions::on_notice, or are
/// dropped. A borrowed connection keeps its own notice handling unless on_notice is set; then the
/// store routes notices to it while it lives — still passing them to a notice processor the
/// consumer installed — and puts libpq's receiver back in its destructor (see on_notice).
///
/// Thread safety: one PostgresStore may be shared by threads. Every operation (begin() up to the
/// end of its Transaction, purge(), find_claim(), ...) holds the store's mutex; a Transaction must
/// end on the thread that began it. For parallelism use one store (one connection) per thread:
/// concurrent claims of one id then wait on PostgreSQL's unique index. The overlap lock assumes
/// READ COMMITTED (PostgreSQL's default isolation).

#include <libpq-fe.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/blob.hpp"
#include "idem/config.hpp"
#include "idem/detail/own_claims.hpp"
#include "idem/detail/sha256.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"
#include "idem/store.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief How PostgresStore uses its connection.
struct PostgresOptions {
    /// `SET LOCAL lock_timeout` of every idem transaction: how long a claim waits for another
    /// transaction holding the same id (→ ClaimStatus::in_progress) and any statement waits for
    /// a row lock (→ store_timeout). 0 waits without limit (PostgreSQL's meaning).
    std::chrono::milliseconds lock_timeout{5000};
    /// Schema of the idem tables (created if missing); quoted, so any name works.
    std::string schema = "public";
    /// Prepare idem's and the effect's statements once per session. Switch off behind a pooler
    /// in transaction mode that cannot keep prepared statements (PgBouncer before 1.21).
    bool prepare_statements = true;
    /// Time source for claimed_at / created_at / purge() / locks / outbox; empty = system_clock.
    Clock clock{};
    /// Receives the server's notices and warnings on the store's connection (`RAISE NOTICE` in
    /// the effect's SQL, a `WARNING` …): the message as libpq formats it, severity first
    /// (`NOTICE:  hello`), without its final newline. Called on the thread running the
    /// statement, from inside libpq and usually under the store's mutex: it must not use the
    /// store or its connection; an exception it throws is dropped.
    ///
    /// - A connection the store opens: notices go here; when this is empty they are dropped
    ///   (libpq would print them on stderr).
    /// - A borrowed connection: when this is empty the store leaves the connection's notice
    ///   handling alone. When it is set, the store installs its notice receiver for its lifetime
    ///   (PQsetNoticeReceiver), forwards each notice here and then to the connection's notice
    ///   processor if the consumer had installed one (PQsetNoticeProcessor; libpq's default one,
    ///   which prints on stderr, is not called), and reinstalls libpq's receiver in its
    ///   destructor; the processor itself is never touched. A connection whose notice
    ///   *receiver* the consumer replaced is left alone (libpq cannot hand back that receiver's
    ///   argument, so it could be neither chained nor restored): its receiver gets the notices
    ///   and this is not called.
    ///
    /// A PGresult the consumer made on the borrowed connection while the store lived keeps the
    /// store's receiver for libpq's own warnings about it (a row number out of range): do not
    /// misuse such a result after the store is gone.
    std::function<void(std::string_view)> on_notice{};
};

namespace detail {
namespace postgres_store {

// Type OIDs of the built-in types idem reads or binds (pg_type.h, stable across versions).
inline constexpr Oid bool_oid = 16;
inline constexpr Oid bytea_oid = 17;
inline constexpr Oid int8_oid = 20;
inline constexpr Oid int2_oid = 21;
inline constexpr Oid int4_oid = 23;
inline constexpr Oid bytea_array_oid = 1001;

inline constexpr std::size_t max_parameters = 65535;  // the protocol's limit

/// libpq's own notice receiver and processor, those every new PGconn starts with. libpq does not
/// export them; a connection object that never connects (its conninfo has an unknown option, so
/// nothing is sent) hands them out, once per process.
struct LibpqNoticeHooks {
    PQnoticeReceiver receiver = nullptr;
    PQnoticeProcessor processor = nullptr;
};
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

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

template <class>
inline constexpr bool always_false = false;

template <class T>
inline constexpr bool is_char_v = std::is_same_v<T, char> || std::is_same_v<T, wchar_t> ||
                                  std::is_same_v<T, char16_t> || std::is_same_v<T, char32_t>
#if defined(__cpp_char8_t)
                                  || std::is_same_v<T, char8_t>
#endif
    ;

struct ResultFree {
    void operator()(PGresult* result) const noexcept { PQclear(result); }
};
using Result = std::unique_ptr<PGresult, ResultFree>;

/// A statement that can be prepared once per session under `name`.
struct Statement {
    std::string sql;
    std::string name;  // empty: never prepared (transaction control)
    std::vector<Oid> types;
    bool prepared = false;
};

/// One command of a pipeline. It owns its parameter values: it may be queued and sent later.
struct Command {
    Statement* statement = nullptr;  // or, when null, `sql`
    std::string sql;
    std::vector<std::string> values;
    std::vector<char> nulls;
    std::vector<int> formats;
    std::vector<Oid> types;
    int result_format = 1;    // idem's own statements read binary results
    bool user = false;        // the effect's SQL: errors become store_error, with the SQL
    bool control = false;     // BEGIN / SET / SAVEPOINT …: writes nothing
    bool savepoint = false;   // `SAVEPOINT idem_effect` (a RELEASE right after cancels it)
    std::string_view what{};  // for messages

    [[nodiscard]] const std::string& text() const {
        return statement != nullptr ? statement->sql : sql;
    }
};

using detail::from_unix_ms;  // store.hpp: one conversion for every store
using detail::to_unix_ms;

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

/// A stable 64-bit key for pg_advisory_xact_lock (first 8 bytes of SHA-256).
inline std::int64_t advisory_key(std::string_view domain, std::string_view key) {
    Sha256 hash;
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

inline void add_null(Command& command) {
    command.values.emplace_back();
    command.nulls.push_back(1);
    command.formats.push_back(0);
    command.types.push_back(0);
}

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

template <class... Args>
void add_params(Command& command, const Args&... args) {
    if (sizeof...(Args) > max_parameters) {
        throw usage_error("idem postgres: more than 65535 parameters in one statement");
    }
    command.values.reserve(sizeof...(Args));
    (add_param(command, args), ...);
}

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

inline std::string_view sqlstate(const PGresult* result) noexcept {
    const char* state = result != nullptr ? PQresultErrorField(result, PG_DIAG_SQLSTATE) : nullptr;
    return state != nullptr ? std::string_view(state) : std::string_view();
}

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

inline std::int64_t affected_rows(const PGresult* result) {
    const char* text = PQcmdTuples(const_cast<PGresult*>(result));
    if (text == nullptr || *text == '\0') return 0;
    std::int64_t value = 0;
    std::from_chars(text, text + std::strlen(text), value);
    return value;
}

inline std::uint32_t to_count(std::int64_t value) noexcept {
    if (value < 0) return 0;
    if (value > std::numeric_limits<std::uint32_t>::max()) {
        return std::numeric_limits<std::uint32_t>::max();
    }
    return static_cast<std::uint32_t>(value);
}

}  // namespace postgres_store
}  // namespace detail

/// @brief The scale-out store: claims, outcomes, dead letters, locks and outbox intents in
/// PostgreSQL tables, written in the same transaction (the same `PGconn*`) as the effect's rows.
///
/// @throws store_unavailable when the server cannot be reached or the tables cannot be set up,
/// store_timeout on lock / statement timeouts, store_error when the database holds a newer idem
/// schema than this code understands, usage_error for misuse (see each member).
class PostgresStore {
  public:
    class Transaction;

    /// Version of the idem tables this code writes; a database with a newer one is refused.
    static constexpr int schema_version = 1;
    /// Effect statements (SQL and parameter kinds) kept prepared; further ones are not.
    static constexpr std::size_t max_cached_statements = 256;
    /// The oldest server this store runs on (ON CONFLICT, SKIP LOCKED, to_regclass(text)).
    static constexpr int min_server_version = 100000;

    /// @brief Connects with @p conninfo (a libpq connection string or URI) and owns the
    /// connection. client_encoding defaults to UTF8 and application_name to "idem" unless the
    /// string sets them. The conninfo is never repeated in messages (it may hold a password).
    /// @throws store_unavailable when the connection or the schema setup fails.
    explicit PostgresStore(const std::string& conninfo, PostgresOptions options = {});
    /// @brief Uses the consumer's own connection, which it never closes. After the connection
    /// broke, begin() resets it (PQreset): the pointer stays valid, the session is new.
    /// @throws usage_error when @p conn is null, inside a transaction, in pipeline mode or
    /// non-blocking.
    explicit PostgresStore(PGconn* conn, PostgresOptions options = {});
    /// Closes the connection if the store opened it; on a borrowed one, deallocates the store's
    /// prepared statements when the connection is idle.
    ~PostgresStore();

    PostgresStore(const PostgresStore&) = delete;
    PostgresStore& operator=(const PostgresStore&) = delete;
    PostgresStore(PostgresStore&&) = delete;
    PostgresStore& operator=(PostgresStore&&) = delete;

    /// @brief Takes the store's mutex and starts a transaction. `BEGIN` and `SET LOCAL
    /// lock_timeout` are queued and travel with the transaction's first statement (usually the
    /// claim), so begin() itself sends nothing — unless the connection broke, in which case it
    /// reconnects first.
    /// @throws store_unavailable when reconnecting fails, usage_error when the connection is
    /// already in a transaction or this thread already holds a transaction of this store.
    [[nodiscard]] Transaction begin();

    /// @brief Deletes claims whose claimed_at is older than clock() - @p older_than, outbox
    /// intents sent before that cutoff, and locks held with hold_lock() that have expired
    /// (expires_at before clock()), in batches of 5,000 (each its own statement, skipping rows a
    /// live transaction holds). Dead letters, unsent and parked intents are kept.
    /// @return how many claims, sent intents and expired locks were deleted.
    /// @throws usage_error when @p older_than is negative.
    PurgeResult purge(std::chrono::system_clock::duration older_than);

    /// @brief The committed claim of (scope, id), if any.
    [[nodiscard]] std::optional<ClaimRecord> find_claim(std::string_view scope,
                                                        std::string_view id);

    /// @brief Every dead letter, oldest first.
    [[nodiscard]] std::vector<DeadLetter> dead_letters();

    /// @brief Takes (or renews) the lock on @p key for @p owner until clock() + @p expire_after
    /// or release_lock(), committed at once. Refused while another owner's lock is live or while
    /// a transaction holds the key with Transaction::try_lock().
    /// @return false when someone else holds the lock.
    bool hold_lock(std::string_view key, std::string_view owner,
                   std::chrono::milliseconds expire_after);
    /// @brief Releases a lock taken with hold_lock(); false when @p owner does not hold it.
    bool release_lock(std::string_view key, std::string_view owner);

    /// @brief Leases up to @p limit unsent, unparked, due intents, lowest id first, until
    /// clock() + @p lease, in one statement (`FOR UPDATE SKIP LOCKED`): relays on several
    /// connections or hosts share the rows and never lease one row twice while its lease lives.
    std::vector<OutboxRow> lease_outbox(std::size_t limit, std::chrono::milliseconds lease);
    /// @brief Marks an intent sent (sent_at = clock()) and ends its lease.
    /// @throws usage_error when no intent has this id.
    void mark_outbox_sent(std::int64_t id);
    /// @brief Records a failed send: attempts + 1, last_error, next_attempt_at = @p retry_at,
    /// parked = @p park; ends its lease. @throws usage_error when no intent has this id.
    void mark_outbox_failed(std::int64_t id, std::string_view error,
                            std::chrono::system_clock::time_point retry_at, bool park);
    /// @brief Every committed outbox intent, oldest first.
    [[nodiscard]] std::vector<OutboxRow> outbox_rows();

    /// @brief The connection (owned or borrowed). Use it only while no other thread uses the
    /// store; inside a transaction prefer Transaction::conn().
    [[nodiscard]] PGconn* conn() const noexcept { return conn_; }
    /// @brief The schema holding the idem tables.
    [[nodiscard]] const std::string& schema() const noexcept { return schema_; }
    /// @brief Round trips to the server so far (pipelines, ROLLBACKs); for tests and budgets.
    [[nodiscard]] std::uint64_t round_trips() const noexcept {
        return round_trips_.load(std::memory_order_relaxed);
    }

    /// @brief Runs one statement outside any idem transaction (autocommit; setup, tests) with
    /// bound @p args. @return the affected rows. @throws store_error with the server's message.
    template <class... Args>
    std::int64_t execute(std::string_view sql, const Args&... args);
    /// @brief First column of the first row as an integer; empty when no row or NULL.
    template <class... Args>
    std::optional<std::int64_t> query_int(std::string_view sql, const Args&... args);
    /// @brief First column of the first row as bytes (BYTEA decoded); empty when no row or NULL.
    template <class... Args>
    std::optional<std::string> query_text(std::string_view sql, const Args&... args);

  private:
    using Command = detail::postgres_store::Command;
    using Result = detail::postgres_store::Result;
    using Statement = detail::postgres_store::Statement;

    enum Own : std::size_t {
        claim_insert,
        claim_outcome,
        record_update,
        dead_letter_insert,
        purge_batch,
        purge_outbox_batch,
        purge_locks_batch,
        find_one_claim,
        all_dead_letters,
        lock_advisory,
        lock_live,
        lock_hold,
        lock_release,
        outbox_insert,
        outbox_lease,
        outbox_sent,
        outbox_failed,
        outbox_all,
        claim_rows,
        claim_rows_outcome,
        claim_delete,
        own_count,
    };

    static constexpr std::int64_t purge_batch_rows = 5000;

    /// The store's mutex, held by a Transaction until it ends; refuses re-entry from the
    /// thread that holds it (which would otherwise deadlock).
    class Lock {
      public:
        Lock() noexcept = default;
        Lock(PostgresStore& store, std::string_view what) : store_(&store) { store.lock(what); }
        Lock(Lock&& other) noexcept : store_(std::exchange(other.store_, nullptr)) {}
        Lock& operator=(Lock&& other) noexcept {
            if (this != &other) {
                unlock();
                store_ = std::exchange(other.store_, nullptr);
            }
            return *this;
        }
        Lock(const Lock&) = delete;
        Lock& operator=(const Lock&) = delete;
        ~Lock() { unlock(); }
        void unlock() noexcept {
            if (store_ != nullptr) std::exchange(store_, nullptr)->unlock();
        }

      private:
        PostgresStore* store_ = nullptr;
    };

    /// The commands of one round trip and their results (null: skipped after an error).
    struct Exchange {
        std::vector<Command> commands;
        std::vector<Result> results;
        std::size_t first = 0;  // index of the first command the caller asked for
        [[nodiscard]] const Command& command(std::size_t k) const { return commands[first + k]; }
        [[nodiscard]] const PGresult* result(std::size_t k) const {
            return results[first + k].get();
        }
    };

    void lock(std::string_view what);
    void unlock() noexcept;
    void init(const PostgresOptions& options);
    void build_statements();
    void setup();
    void ensure_schema();
    void check_not_newer(std::int64_t version) const;
    void ready(std::string_view what);
    void reconnect(std::string_view what);
    void forget_prepared() noexcept;
    void resync_prepared();
    bool rollback_noexcept() noexcept;
    void close_noexcept() noexcept;
    /// Installs notice_receiver on conn_ as PostgresOptions::on_notice describes.
    void route_notices();
    /// Puts libpq's receiver back on a borrowed connection if route_notices() replaced it.
    void restore_notices() noexcept;
    static void notice_receiver(void* store, const PGresult* notice) noexcept;
    [[nodiscard]] std::string connection_error() const;
    [[nodiscard]] std::chrono::system_clock::time_point now() const {
        return clock_ ? clock_() : std::chrono::system_clock::now();
    }
    [[nodiscard]] std::int64_t now_ms() const { return detail::postgres_store::to_unix_ms(now()); }

    template <class... Args>
    Command own(Own which, std::string_view what, const Args&... args);
    /// idem's statement that is not prepared (setup, schema).
    template <class... Args>
    Command adhoc(std::string sql, std::string_view what, const Args&... args);
    Command control(const std::string& sql, std::string_view what, bool savepoint = false);
    template <class... Args>
    Command user(std::string_view sql, std::string_view what, const Args&... args);

    /// Sends @p commands as one pipeline; throws store_unavailable when the connection is lost.
    std::vector<Result> round_trip(std::vector<Command>& commands);
    /// The queued commands + @p commands in one round trip; throws the first failure of a queued
    /// command when @p check_queued.
    Exchange tx_exchange(std::vector<Command> commands, bool check_queued = true);
    /// One command outside a transaction (the connection must be idle); throws on failure.
    Result run(Command command);
    /// Sends the queued commands now (before raw use of the connection).
    void flush();

    [[noreturn]] void fail(const Command& command, const PGresult* result, std::string_view what);
    [[noreturn]] void connection_lost(std::string_view what);

    static OutboxRow read_outbox_row(const PGresult* result, int row);

    /// Runs a purge statement ($1 = the bound, $2 = the batch size) until a batch deletes fewer
    /// rows than the batch size; each batch is its own statement. Returns the total.
    std::size_t purge_in_batches(Own which, std::string_view what, std::int64_t before);

    PGconn* conn_ = nullptr;
    bool owned_ = false;
    Clock clock_;
    std::function<void(std::string_view)> on_notice_;
    bool notices_routed_ = false;   ///< notice_receiver is installed on conn_
    bool chain_processor_ = false;  ///< also pass notices to the consumer's notice processor
    std::chrono::milliseconds lock_timeout_{5000};
    std::string schema_;
    std::string table_prefix_;  // "schema".
    bool prepare_ = true;
    unsigned store_number_ = 0;
    std::string begin_sql_ = "BEGIN";
    std::string set_timeout_sql_;
    int session_timeout_pid_ = 0;  ///< backend whose session has our lock_timeout (owned only)
    std::string commit_sql_ = "COMMIT";
    std::string savepoint_sql_ = "SAVEPOINT idem_effect";
    std::string rollback_to_sql_ = "ROLLBACK TO SAVEPOINT idem_effect";
    std::string release_sql_ = "RELEASE SAVEPOINT idem_effect";
    // Around claims of a batch, so a lock timeout undoes only them (not the transaction).
    std::string claim_savepoint_sql_ = "SAVEPOINT idem_claims";
    std::string claim_rollback_to_sql_ = "ROLLBACK TO SAVEPOINT idem_claims";
    std::string claim_release_sql_ = "RELEASE SAVEPOINT idem_claims";
    std::array<Statement, own_count> own_{};
    std::unordered_map<std::string, std::unique_ptr<Statement>> cache_;
    std::mutex mutex_;
    std::atomic<std::thread::id> owner_{};
    std::atomic<std::uint64_t> round_trips_{0};
    int backend_pid_ = 0;
    std::vector<Command> queued_;    // commands of the open transaction not sent yet
    bool tx_open_ = false;           // a Transaction of this store is running
    bool tx_begun_ = false;          // its BEGIN reached the server
    std::string tx_error_;           // first failure inside it
    bool rollback_pending_ = false;  // our ROLLBACK failed: the connection is still in our tx
    bool resync_prepared_ = false;   // the session lost some of our prepared statements
};

/// @brief One transaction on the store's connection, holding the store's mutex.
///
/// Move-only RAII: rolls back in its destructor unless committed, and never throws from it. The
/// effect's own SQL runs through execute() / query_*() or conn() and commits or rolls back with
/// the claim. Every member throws usage_error once the transaction has ended (a second commit()
/// included). After any failed statement PostgreSQL refuses the rest of the transaction until it
/// is rolled back (or rolled back to the effect's savepoint). It must not outlive its store,
/// and must end on the thread that began it.
class PostgresStore::Transaction {
  public:
    /// Each savepoint is a statement: the handler avoids them on its common path.
    static constexpr bool cheap_savepoints = false;

    Transaction(Transaction&& other) noexcept
        : store_(std::exchange(other.store_, nullptr)),
          lock_(std::move(other.lock_)),
          state_(std::exchange(other.state_, State::rolled_back)),
          savepoints_(std::exchange(other.savepoints_, 0)),
          own_claims_(std::move(other.own_claims_)) {}
    Transaction& operator=(Transaction&& other) noexcept {
        if (this != &other) {
            end_noexcept();
            store_ = std::exchange(other.store_, nullptr);
            lock_ = std::move(other.lock_);
            state_ = std::exchange(other.state_, State::rolled_back);
            savepoints_ = std::exchange(other.savepoints_, 0);
            own_claims_ = std::move(other.own_claims_);
        }
        return *this;
    }
    Transaction(const Transaction&) = delete;
    Transaction& operator=(const Transaction&) = delete;
    /// Rolls back unless committed; never throws.
    ~Transaction() { end_noexcept(); }

    /// @brief `INSERT … ON CONFLICT DO NOTHING` the claim (its row says 'processed' until
    /// another outcome is recorded, and is visible to others only after commit) with its payload
    /// @p fingerprint — one round trip, with the queued BEGIN; a duplicate costs a second one,
    /// which reads the stored outcome. A concurrent transaction holding the same id makes it wait
    /// until that one ends: then duplicate (it committed) or claimed (it rolled back).
    /// @return claimed; duplicate with the outcome and fingerprint a finished run recorded
    /// (`recorded` is in_progress when this same transaction claimed the id before); or
    /// in_progress when the wait reached PostgresOptions::lock_timeout — PostgreSQL has then
    /// aborted the transaction: roll it back (the handler does).
    ClaimResult claim(std::string_view scope, std::string_view id,
                      std::string_view fingerprint = {});
    /// @brief Claims @p ids as claim() would one after the other, in one multi-row
    /// `INSERT … SELECT … FROM unnest($ids, $fingerprints) ON CONFLICT DO NOTHING RETURNING` (one
    /// round trip, with the queued BEGIN), plus one `SELECT` of the stored outcomes when some ids
    /// were not inserted. @p fingerprints: empty, or one per id. The first copy of an id repeated
    /// in @p ids is claimed, later copies (and ids this transaction claimed before) are
    /// duplicates with `recorded` in_progress.
    ///
    /// The INSERT runs in a savepoint: when it waits past lock_timeout for an id another
    /// transaction holds, only the savepoint is rolled back, and the ids are claimed one by one,
    /// each in its own savepoint (a round trip each): the held ones answer in_progress, the rest
    /// are claimed as usual, and the transaction stays usable. That case costs one lock_timeout
    /// wait more than claiming one by one would.
    /// @throws usage_error when @p fingerprints is neither empty nor one per id.
    std::vector<ClaimResult> claim_many(std::string_view scope,
                                        const std::vector<std::string_view>& ids,
                                        const std::vector<std::string>& fingerprints);
    /// @brief Gives back a claim this transaction made (claim() or claim_many()): its row is
    /// deleted (queued: sent with the next statement). Does nothing for any other id.
    void unclaim(std::string_view scope, std::string_view id);
    /// @brief Stores the outcome and reason on the claim (queued: sent with the next statement
    /// or the commit); does nothing if there is no claim row.
    void record_outcome(std::string_view scope, std::string_view id, Disposition disposition,
                        std::string_view reason);
    /// @brief Inserts a dead letter (queued); created_at from the store's clock when left default.
    void dead_letter(const DeadLetter& letter);
    /// @brief `SAVEPOINT idem_effect` (queued; may nest).
    void savepoint();
    /// @brief Undoes everything since the latest savepoint() and removes it; also recovers the
    /// transaction from a failed statement of the effect.
    void rollback_to_savepoint();
    /// @brief Keeps everything since the latest savepoint() and removes it.
    void release_savepoint();
    /// @brief Overlap lock on @p key until the transaction ends: `pg_try_advisory_xact_lock` on
    /// a 64-bit hash of the key (released with the transaction, also when the session dies, so
    /// @p expire_after is not needed) and no live lock of PostgresStore::hold_lock() on it.
    /// One round trip. @return false when another transaction or holder has it.
    bool try_lock(std::string_view key, std::chrono::milliseconds expire_after);
    /// @brief Adds an outbox intent (created_at = next_attempt_at = clock()) that commits or
    /// rolls back with this transaction. @return false when its idempotency key is already
    /// there. @throws usage_error when the destination is not valid UTF-8 or holds a NUL.
    bool add_outbox(const OutboxIntent& intent);
    /// @brief Sends the queued commands and `COMMIT` in one round trip.
    /// @throws commit_failed (with the server's message) when PostgreSQL refuses the commit (a
    /// deferred constraint, an earlier failed statement): everything is rolled back.
    /// store_unavailable when the connection is lost during COMMIT: the outcome is unknown, and
    /// a redelivery finds the claim if it committed. usage_error when called twice.
    void commit();
    /// @brief Rolls back now (the destructor does the same).
    void rollback();
    /// @brief True until commit() or rollback().
    [[nodiscard]] bool active() const noexcept {
        return store_ != nullptr && state_ == State::active;
    }

    /// @brief The connection, inside this transaction: sends the queued commands first (BEGIN,
    /// SAVEPOINT…), so what you run on it joins the transaction. Do not COMMIT or ROLLBACK on it.
    [[nodiscard]] PGconn* conn();

    /// @brief Runs one statement with bound @p args (`$1`, `$2`, …: integers, floating point,
    /// bool and strings as text, idem::Blob as BYTEA, nullptr/std::nullopt as NULL,
    /// std::optional). @return the affected rows. @throws store_error with the server's message
    /// and the SQL, store_timeout on a lock timeout, usage_error on a wrong parameter count.
    template <class... Args>
    std::int64_t execute(std::string_view sql, const Args&... args) {
        PostgresStore& store = open("execute()");
        auto exchange = store.tx_exchange(vec(store.user(sql, "execute", args...)));
        const PGresult* result = exchange.result(0);
        if (!detail::postgres_store::succeeded(result)) {
            store.fail(exchange.command(0), result, "execute");
        }
        check_still_open("execute()");
        return detail::postgres_store::affected_rows(result);
    }
    /// @brief First column of the first row as an integer; empty when no row or NULL.
    template <class... Args>
    std::optional<std::int64_t> query_int(std::string_view sql, const Args&... args) {
        PostgresStore& store = open("query_int()");
        auto exchange = store.tx_exchange(vec(store.user(sql, "query_int", args...)));
        const PGresult* result = exchange.result(0);
        if (!detail::postgres_store::succeeded(result)) {
            store.fail(exchange.command(0), result, "query_int");
        }
        check_still_open("query_int()");
        if (PQntuples(result) < 1 || PQnfields(result) < 1 || PQgetisnull(result, 0, 0) != 0) {
            return std::nullopt;
        }
        return detail::postgres_store::text_int(result, 0, 0, sql);
    }
    /// @brief First column of the first row as bytes (text, or BYTEA decoded); empty when no
    /// row or NULL.
    template <class... Args>
    std::optional<std::string> query_text(std::string_view sql, const Args&... args) {
        PostgresStore& store = open("query_text()");
        auto exchange = store.tx_exchange(vec(store.user(sql, "query_text", args...)));
        const PGresult* result = exchange.result(0);
        if (!detail::postgres_store::succeeded(result)) {
            store.fail(exchange.command(0), result, "query_text");
        }
        check_still_open("query_text()");
        if (PQntuples(result) < 1 || PQnfields(result) < 1 || PQgetisnull(result, 0, 0) != 0) {
            return std::nullopt;
        }
        return detail::postgres_store::text_column(result, 0, 0);
    }

  private:
    friend class PostgresStore;
    enum class State { active, committed, rolled_back };

    Transaction(PostgresStore& store, Lock lock) noexcept
        : store_(&store), lock_(std::move(lock)), state_(State::active) {}

    static std::vector<Command> vec(Command command) {
        std::vector<Command> commands;
        commands.push_back(std::move(command));
        return commands;
    }

    PostgresStore& open(std::string_view what, bool committing = false);
    void check_still_open(std::string_view what);
    /// One id not claimed by this transaction before: insert, or read the stored claim. With
    /// @p guarded, inside its own savepoint, so a lock timeout leaves the transaction usable.
    ClaimResult insert_claim(PostgresStore& store, std::string_view scope, std::string_view id,
                             std::string_view fingerprint, bool guarded);
    /// A stored claim as a duplicate: outcome and fingerprint columns of @p row.
    static ClaimResult stored_claim(const PGresult* result, int row, int outcome_column,
                                    int fingerprint_column);
    void finish(State state) noexcept;
    void end_noexcept() noexcept;

    PostgresStore* store_ = nullptr;
    Lock lock_;
    State state_ = State::rolled_back;
    int savepoints_ = 0;
    detail::OwnClaims own_claims_;  ///< inserted as 'processed': see own_claims.hpp
};

// ---------------------------------------------------------------------------------------------
// PostgresStore

inline PostgresStore::PostgresStore(const std::string& conninfo, PostgresOptions options)
    : owned_(true) {
    init(options);
    if (conninfo.find('\0') != std::string::npos) {
        throw usage_error("idem postgres: the connection string contains a NUL byte");
    }
    // client_encoding and application_name come first: the expanded conninfo overrides them.
    const char* const keys[] = {"client_encoding", "fallback_application_name", "dbname", nullptr};
    const char* const values[] = {"UTF8", "idem", conninfo.c_str(), nullptr};
    conn_ = PQconnectdbParams(keys, values, 1);
    if (conn_ == nullptr) throw store_unavailable("idem postgres: cannot connect: out of memory");
    if (PQstatus(conn_) != CONNECTION_OK) {
        const std::string message =
            fmt::format("idem postgres: cannot connect: {}", connection_error());
        close_noexcept();
        throw store_unavailable(message);
    }
    try {
        route_notices();
        setup();
    } catch (...) {
        close_noexcept();
        throw;
    }
}

inline PostgresStore::PostgresStore(PGconn* conn, PostgresOptions options)
    : conn_(conn), owned_(false) {
    if (conn_ == nullptr) {
        throw usage_error("idem postgres: PostgresStore needs a connection, got null");
    }
    try {
        init(options);
        if (PQstatus(conn_) != CONNECTION_OK) {
            throw store_unavailable(fmt::format(
                "idem postgres: the borrowed connection is broken: {}", connection_error()));
        }
        if (PQpipelineStatus(conn_) != PQ_PIPELINE_OFF || PQisnonblocking(conn_) != 0) {
            throw usage_error(
                "idem postgres: the borrowed connection is in pipeline or non-blocking mode; "
                "PostgresStore needs a blocking connection outside pipeline mode");
        }
        if (PQtransactionStatus(conn_) != PQTRANS_IDLE) {
            throw usage_error(
                "idem postgres: the borrowed connection is inside a transaction (or busy); "
                "construct the PostgresStore outside any transaction (it may create its tables)");
        }
        route_notices();
        setup();
    } catch (...) {
        restore_notices();
        conn_ = nullptr;  // borrowed: never closed
        throw;
    }
}

inline PostgresStore::~PostgresStore() {
    close_noexcept();
}

inline void PostgresStore::init(const PostgresOptions& options) {
    static std::atomic<unsigned> stores{0};
    store_number_ = ++stores;
    clock_ = options.clock;
    on_notice_ = options.on_notice;
    prepare_ = options.prepare_statements;
    if (options.lock_timeout.count() < 0) {
        throw usage_error("idem postgres: lock_timeout must not be negative (0 waits forever)");
    }
    if (options.lock_timeout.count() > INT_MAX) {
        throw usage_error("idem postgres: lock_timeout is longer than PostgreSQL allows");
    }
    lock_timeout_ = options.lock_timeout;
    if (options.schema.empty() || options.schema.find('\0') != std::string::npos) {
        throw usage_error("idem postgres: PostgresOptions::schema must be a non-empty name");
    }
    schema_ = options.schema;
    table_prefix_ = detail::postgres_store::quote_identifier(schema_) + ".";
    // A fixed integer, never a value from outside.
    set_timeout_sql_ = fmt::format("SET LOCAL lock_timeout = {}", lock_timeout_.count());
    build_statements();
}

inline void PostgresStore::build_statements() {
    const std::string& s = table_prefix_;
    const std::string claims = s + "idem_claims";
    const std::string letters = s + "idem_dead_letters";
    const std::string locks = s + "idem_locks";
    const std::string outbox = s + "idem_outbox";
    const std::string outbox_columns =
        "id, destination, idempotency_key, payload, created_at, sent_at, attempts, last_error, "
        "next_attempt_at, parked";
    own_[claim_insert].sql =
        // The affected row count says whether it was inserted; only when not is the stored
        // claim read (claim_outcome, a new statement: it also sees a claim that committed while
        // this one waited).
        "INSERT INTO " + claims +
        "(scope, message_id, claimed_at, outcome, reason, fingerprint) "
        "VALUES ($1, $2, $3, 'processed', '', $4) ON CONFLICT (scope, message_id) DO NOTHING";
    own_[claim_outcome].sql =
        "SELECT outcome, fingerprint FROM " + claims + " WHERE scope = $1 AND message_id = $2";
    own_[claim_rows].sql =
        // claim_many(): $3 the ids (distinct, sorted: concurrent batches wait on one another in
        // one order, never in a cycle), $4 their fingerprints (empty array: none).
        "INSERT INTO " + claims +
        "(scope, message_id, claimed_at, outcome, reason, fingerprint) "
        "SELECT $1::bytea, u.id, $2::bigint, 'processed', '', coalesce(u.fp, ''::bytea) "
        "FROM unnest($3::bytea[], $4::bytea[]) AS u(id, fp) "
        "ON CONFLICT (scope, message_id) DO NOTHING RETURNING message_id";
    own_[claim_rows_outcome].sql = "SELECT message_id, outcome, fingerprint FROM " + claims +
                                   " WHERE scope = $1 AND message_id = ANY($2::bytea[])";
    own_[claim_delete].sql = "DELETE FROM " + claims + " WHERE scope = $1 AND message_id = $2";
    own_[record_update].sql =
        "UPDATE " + claims + " SET outcome = $3, reason = $4 WHERE scope = $1 AND message_id = $2";
    own_[dead_letter_insert].sql =
        "INSERT INTO " + letters +
        "(scope, message_id, delivery_count, reason, payload, created_at) "
        "VALUES ($1, $2, $3, $4, $5, $6)";
    own_[purge_batch].sql = "DELETE FROM " + claims +
                            " WHERE (scope, message_id) IN (SELECT scope, message_id FROM " +
                            claims + " WHERE claimed_at < $1 LIMIT $2 FOR UPDATE SKIP LOCKED)";
    own_[purge_outbox_batch].sql = "DELETE FROM " + outbox + " WHERE id IN (SELECT id FROM " +
                                   outbox +
                                   " WHERE sent_at < $1 AND NOT parked LIMIT $2 "
                                   "FOR UPDATE SKIP LOCKED)";
    own_[purge_locks_batch].sql = "DELETE FROM " + locks +
                                  " WHERE lock_key IN (SELECT lock_key FROM " + locks +
                                  " WHERE expires_at < $1 LIMIT $2 FOR UPDATE SKIP LOCKED)";
    own_[find_one_claim].sql =
        "SELECT scope, message_id, claimed_at, outcome, reason, fingerprint FROM " + claims +
        " WHERE scope = $1 AND message_id = $2";
    own_[all_dead_letters].sql =
        "SELECT scope, message_id, delivery_count, reason, payload, created_at FROM " + letters +
        " ORDER BY id";
    own_[lock_advisory].sql = "SELECT pg_try_advisory_xact_lock($1::bigint)";
    own_[lock_live].sql = "SELECT EXISTS (SELECT 1 FROM " + locks +
                          " WHERE lock_key = $1 AND expires_at > $2::bigint)";
    own_[lock_hold].sql =
        // Only while no transaction holds the key (the advisory lock), and only a free, expired
        // or own lock: another owner's live row makes the DO UPDATE's WHERE false (no change).
        "INSERT INTO " + locks +
        " AS l(lock_key, owner, expires_at) SELECT $1, $2, $3::bigint "
        "WHERE pg_try_advisory_xact_lock($4::bigint) "
        "ON CONFLICT (lock_key) DO UPDATE SET owner = EXCLUDED.owner, "
        "expires_at = EXCLUDED.expires_at "
        "WHERE l.owner = EXCLUDED.owner OR l.expires_at <= $5::bigint";
    own_[lock_release].sql = "DELETE FROM " + locks + " WHERE lock_key = $1 AND owner = $2";
    own_[outbox_insert].sql =
        "INSERT INTO " + outbox +
        "(destination, idempotency_key, payload, created_at, next_attempt_at, attempts, "
        "last_error, parked) VALUES ($1, $2, $3, $4, $4, 0, '', false) "
        "ON CONFLICT (idempotency_key) DO NOTHING";
    own_[outbox_lease].sql = "UPDATE " + outbox +
                             " SET lease_until = $1 WHERE id IN (SELECT id FROM " + outbox +
                             " WHERE sent_at IS NULL AND NOT parked AND next_attempt_at <= $2 "
                             "AND (lease_until IS NULL OR lease_until <= $2) ORDER BY id LIMIT $3 "
                             "FOR UPDATE SKIP LOCKED) RETURNING " +
                             outbox_columns;
    own_[outbox_sent].sql =
        "UPDATE " + outbox + " SET sent_at = $2, lease_until = NULL WHERE id = $1";
    own_[outbox_failed].sql = "UPDATE " + outbox +
                              " SET attempts = attempts + 1, last_error = $2, "
                              "next_attempt_at = $3, parked = $4, lease_until = NULL WHERE id = $1";
    own_[outbox_all].sql = "SELECT " + outbox_columns + " FROM " + outbox + " ORDER BY id";
    for (std::size_t i = 0; i < own_.size(); ++i) {
        own_[i].name = fmt::format("idem_{}_{}", store_number_, i);
    }
}

inline void PostgresStore::lock(std::string_view what) {
    if (owner_.load(std::memory_order_relaxed) == std::this_thread::get_id()) {
        throw usage_error(fmt::format(
            "idem postgres: {} called on a thread that holds an open transaction of this "
            "PostgresStore (it would deadlock); use that transaction, or commit / roll it back "
            "first",
            what));
    }
    mutex_.lock();
    owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
}

inline void PostgresStore::unlock() noexcept {
    owner_.store(std::thread::id{}, std::memory_order_relaxed);
    mutex_.unlock();
}

inline std::string PostgresStore::connection_error() const {
    std::string message = detail::postgres_store::trimmed(PQerrorMessage(conn_));
    return message.empty() ? std::string("unknown libpq error") : message;
}

inline void PostgresStore::close_noexcept() noexcept {
    if (conn_ == nullptr) return;
    if (owned_) {
        PQfinish(conn_);
    } else if (PQstatus(conn_) == CONNECTION_OK && PQtransactionStatus(conn_) == PQTRANS_IDLE &&
               PQpipelineStatus(conn_) == PQ_PIPELINE_OFF) {
        // Leave the borrowed session as we found it: drop our prepared statements.
        try {
            std::string sql;
            for (const Statement& statement : own_) {
                if (statement.prepared) sql += fmt::format("DEALLOCATE {};", statement.name);
            }
            for (const auto& entry : cache_) {
                if (entry.second->prepared) {
                    sql += fmt::format("DEALLOCATE {};", entry.second->name);
                }
            }
            if (!sql.empty()) PQclear(PQexec(conn_, sql.c_str()));
        } catch (...) {
        }
    }
    if (!owned_) restore_notices();
    conn_ = nullptr;
}

inline void PostgresStore::route_notices() {
    const auto& libpq = detail::postgres_store::libpq_notice_hooks();
    if (owned_) {
        // Our own connection: nobody else listens, so nothing reaches stderr.
        PQsetNoticeReceiver(conn_, &PostgresStore::notice_receiver, this);
        notices_routed_ = true;
        return;
    }
    if (!on_notice_ || libpq.receiver == nullptr) return;  // the consumer's connection as it is
    if (PQsetNoticeReceiver(conn_, nullptr, nullptr) != libpq.receiver) {
        return;  // the consumer's own receiver: neither chainable nor restorable, so kept
    }
    chain_processor_ = PQsetNoticeProcessor(conn_, nullptr, nullptr) != libpq.processor;
    PQsetNoticeReceiver(conn_, &PostgresStore::notice_receiver, this);
    notices_routed_ = true;
}

inline void PostgresStore::restore_notices() noexcept {
    if (!notices_routed_ || owned_ || conn_ == nullptr) return;
    // libpq's receiver ignores its argument (a new PGconn has it null).
    PQsetNoticeReceiver(conn_, detail::postgres_store::libpq_notice_hooks().receiver, nullptr);
    notices_routed_ = false;
}

inline void PostgresStore::notice_receiver(void* store, const PGresult* notice) noexcept {
    const auto* self = static_cast<const PostgresStore*>(store);
    if (self->on_notice_) {
        std::string_view text = PQresultErrorMessage(notice);
        while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) {
            text.remove_suffix(1);
        }
        try {
            self->on_notice_(text);
        } catch (...) {
            // Never through libpq's C frames.
        }
    }
    if (self->chain_processor_) {
        // libpq's receiver hands the notice to the connection's processor (the consumer's).
        detail::postgres_store::libpq_notice_hooks().receiver(nullptr, notice);
    }
}

inline void PostgresStore::forget_prepared() noexcept {
    for (Statement& statement : own_)
        statement.prepared = false;
    for (auto& entry : cache_)
        entry.second->prepared = false;
    resync_prepared_ = false;
}

inline void PostgresStore::resync_prepared() {
    forget_prepared();
    const std::string prefix = fmt::format("idem_{}_", store_number_);
    Result names =
        run(adhoc("SELECT name FROM pg_catalog.pg_prepared_statements "
                  "WHERE left(name, length($1)) = $1",
                  "reading the prepared statements", prefix));
    for (int row = 0; row < PQntuples(names.get()); ++row) {
        const std::string name = detail::postgres_store::bytes_of(names.get(), row, 0);
        for (Statement& statement : own_)
            if (statement.name == name) statement.prepared = true;
        for (auto& entry : cache_)
            if (entry.second->name == name) entry.second->prepared = true;
    }
}

inline void PostgresStore::setup() {
    if (PQserverVersion(conn_) < min_server_version) {
        throw store_unavailable(fmt::format(
            "idem postgres: the server is version {}; PostgresStore needs PostgreSQL 10 or later",
            PQserverVersion(conn_)));
    }
    backend_pid_ = PQbackendPID(conn_);
    ensure_schema();
}

inline void PostgresStore::check_not_newer(std::int64_t version) const {
    if (version > schema_version) {
        throw store_error(fmt::format(
            "idem postgres: schema {} holds idem schema version {}, newer than the version this "
            "build of idem understands ({}); it was written by a newer idem. Upgrade idem in this "
            "program, or point it at another schema (PostgresOptions::schema)",
            detail::postgres_store::quote_identifier(schema_), version, schema_version));
    }
}

inline void PostgresStore::ensure_schema() {
    using detail::postgres_store::binary_int;
    const std::string version_table = table_prefix_ + "idem_schema";
    const std::string read_version = "SELECT max(version)::bigint FROM " + version_table;
    const auto stored_version = [&]() -> std::optional<std::int64_t> {
        Result version = run(adhoc(read_version, "reading the idem schema version"));
        if (PQntuples(version.get()) < 1 || PQgetisnull(version.get(), 0, 0) != 0) {
            return std::nullopt;
        }
        return binary_int(version.get(), 0, 0);
    };
    // Fast path: an up-to-date schema needs no lock and no CREATE privilege.
    {
        Result exists = run(
            adhoc("SELECT to_regclass($1) IS NOT NULL", "reading the idem schema", version_table));
        if (detail::postgres_store::binary_bool(exists.get(), 0, 0)) {
            if (const auto version = stored_version()) {
                check_not_newer(*version);
                if (*version == schema_version) return;
            }
        }
    }
    // Create (or migrate) in one transaction under an advisory lock, so processes starting at
    // once on an empty database serialize here and the later ones find the finished schema.
    const std::string& s = table_prefix_;
    const auto exec = [&](const std::string& sql) {
        run(control(sql, "creating the idem schema"));
    };
    try {
        exec(begin_sql_);
        exec(set_timeout_sql_);
        exec("SET LOCAL client_min_messages = warning");  // no "already exists" notices
        run(adhoc("SELECT pg_advisory_xact_lock($1::bigint)", "locking the idem schema",
                  detail::postgres_store::advisory_key("idem schema", schema_)));
        Result has_schema =
            run(adhoc("SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)",
                      "reading the idem schema", schema_));
        if (!detail::postgres_store::binary_bool(has_schema.get(), 0, 0)) {
            exec("CREATE SCHEMA IF NOT EXISTS " +
                 detail::postgres_store::quote_identifier(schema_));
        }
        exec("CREATE TABLE IF NOT EXISTS " + version_table + "(version INTEGER NOT NULL)");
        const auto version = stored_version();
        if (version) check_not_newer(*version);
        if (!version || *version < schema_version) {
            // Version 1 is the first schema; later versions add their migrations here.
            exec("CREATE TABLE IF NOT EXISTS " + s +
                 "idem_claims(scope BYTEA NOT NULL, message_id BYTEA NOT NULL, "
                 "claimed_at BIGINT NOT NULL, outcome TEXT NOT NULL, "
                 "reason TEXT NOT NULL DEFAULT '', fingerprint BYTEA NOT NULL DEFAULT ''::bytea, "
                 "PRIMARY KEY (scope, message_id))");
            exec("CREATE INDEX IF NOT EXISTS idem_claims_claimed_at ON " + s +
                 "idem_claims(claimed_at)");
            exec("CREATE TABLE IF NOT EXISTS " + s +
                 "idem_dead_letters(id BIGSERIAL PRIMARY KEY, scope BYTEA NOT NULL, "
                 "message_id BYTEA NOT NULL, delivery_count BIGINT NOT NULL, "
                 "reason TEXT NOT NULL, payload BYTEA NOT NULL, created_at BIGINT NOT NULL)");
            exec("CREATE TABLE IF NOT EXISTS " + s +
                 "idem_locks(lock_key BYTEA PRIMARY KEY, owner BYTEA NOT NULL, "
                 "expires_at BIGINT NOT NULL)");
            exec("CREATE TABLE IF NOT EXISTS " + s +
                 "idem_outbox(id BIGSERIAL PRIMARY KEY, destination TEXT NOT NULL, "
                 "idempotency_key BYTEA NOT NULL UNIQUE, payload BYTEA NOT NULL, "
                 "created_at BIGINT NOT NULL, sent_at BIGINT, attempts INTEGER NOT NULL DEFAULT 0, "
                 "last_error TEXT NOT NULL DEFAULT '', next_attempt_at BIGINT NOT NULL, "
                 "lease_until BIGINT, parked BOOLEAN NOT NULL DEFAULT false)");
            // The relay's query: unsent, unparked rows in id order.
            exec("CREATE INDEX IF NOT EXISTS idem_outbox_unsent ON " + s +
                 "idem_outbox(id) WHERE sent_at IS NULL AND NOT parked");
            // purge(): sent intents by age, held locks by expiry.
            exec("CREATE INDEX IF NOT EXISTS idem_outbox_sent ON " + s +
                 "idem_outbox(sent_at) WHERE sent_at IS NOT NULL");
            exec("CREATE INDEX IF NOT EXISTS idem_locks_expires_at ON " + s +
                 "idem_locks(expires_at)");
            exec("DELETE FROM " + version_table);
            run(adhoc("INSERT INTO " + version_table + "(version) VALUES ($1)",
                      "creating the idem schema", schema_version));
        }
        exec(commit_sql_);
    } catch (...) {
        rollback_noexcept();
        throw;
    }
}

inline void PostgresStore::reconnect(std::string_view what) {
    PQreset(conn_);
    forget_prepared();
    rollback_pending_ = false;
    if (PQstatus(conn_) != CONNECTION_OK) {
        throw store_unavailable(fmt::format(
            "idem postgres: {}: the connection to PostgreSQL broke and reconnecting failed: {}",
            what, connection_error()));
    }
    backend_pid_ = PQbackendPID(conn_);
}

inline void PostgresStore::ready(std::string_view what) {
    if (PQstatus(conn_) != CONNECTION_OK) reconnect(what);
    if (PQbackendPID(conn_) != backend_pid_) {
        // Someone reset the (borrowed) connection: the session and its statements are new.
        forget_prepared();
        backend_pid_ = PQbackendPID(conn_);
    }
    if (PQpipelineStatus(conn_) != PQ_PIPELINE_OFF) {
        throw usage_error(fmt::format(
            "idem postgres: {}: the connection is in pipeline mode; leave it first", what));
    }
    if (PQisnonblocking(conn_) != 0) {
        throw usage_error(fmt::format(
            "idem postgres: {}: the connection is in non-blocking mode; PostgresStore needs a "
            "blocking connection (PQsetnonblocking(conn, 0))",
            what));
    }
    PGTransactionStatusType status = PQtransactionStatus(conn_);
    if (status != PQTRANS_IDLE && rollback_pending_) {
        rollback_noexcept();
        status = PQtransactionStatus(conn_);
    }
    if (status == PQTRANS_UNKNOWN) {
        reconnect(what);
        status = PQtransactionStatus(conn_);
    }
    if (status == PQTRANS_IDLE && resync_prepared_) resync_prepared();
    if (status != PQTRANS_IDLE) {
        throw usage_error(fmt::format(
            "idem postgres: {}: the connection is already inside a transaction (or busy with a "
            "query). idem needs its own BEGIN so the claim and the effect commit together: "
            "commit or roll back your transaction first, and write the effect's rows through the "
            "idem transaction (Transaction::execute() or Transaction::conn())",
            what));
    }
}

inline bool PostgresStore::rollback_noexcept() noexcept {
    queued_.clear();
    if (conn_ == nullptr || PQstatus(conn_) != CONNECTION_OK) {
        rollback_pending_ = false;  // the server rolls back a transaction whose session died
        return true;
    }
    if (PQpipelineStatus(conn_) != PQ_PIPELINE_OFF) {
        for (int nulls = 0; nulls < 2;) {
            PGresult* result = PQgetResult(conn_);
            if (result == nullptr) {
                ++nulls;
            } else {
                nulls = 0;
                PQclear(result);
            }
            if (PQstatus(conn_) != CONNECTION_OK) break;
        }
        PQexitPipelineMode(conn_);
    }
    if (PQtransactionStatus(conn_) == PQTRANS_ACTIVE) {
        while (PGresult* result = PQgetResult(conn_))
            PQclear(result);
    }
    if (PQtransactionStatus(conn_) != PQTRANS_IDLE) {
        round_trips_.fetch_add(1, std::memory_order_relaxed);
        PQclear(PQexec(conn_, "ROLLBACK"));
    }
    rollback_pending_ =
        PQstatus(conn_) == CONNECTION_OK && PQtransactionStatus(conn_) != PQTRANS_IDLE;
    return !rollback_pending_;
}

template <class... Args>
PostgresStore::Command PostgresStore::own(Own which, std::string_view what, const Args&... args) {
    Command command;
    command.statement = &own_[which];
    command.what = what;
    detail::postgres_store::add_params(command, args...);
    return command;
}

template <class... Args>
PostgresStore::Command PostgresStore::adhoc(std::string sql, std::string_view what,
                                            const Args&... args) {
    Command command;
    command.sql = std::move(sql);
    command.what = what;
    detail::postgres_store::add_params(command, args...);
    return command;
}

inline PostgresStore::Command PostgresStore::control(const std::string& sql, std::string_view what,
                                                     bool savepoint) {
    Command command;
    command.sql = sql;
    command.what = what;
    command.control = true;
    command.savepoint = savepoint;
    return command;
}

template <class... Args>
PostgresStore::Command PostgresStore::user(std::string_view sql, std::string_view what,
                                           const Args&... args) {
    if (sql.find('\0') != std::string_view::npos) {
        throw usage_error("idem postgres: the SQL text contains a NUL byte");
    }
    Command command;
    command.user = true;
    command.what = what;
    command.result_format = 0;  // text: the effect's columns may be of any type
    command.sql.assign(sql.data(), sql.size());
    detail::postgres_store::add_params(command, args...);
    if (!prepare_) return command;
    // Cached per SQL text and parameter kinds (a BYTEA parameter is typed at PREPARE).
    std::string key;
    key.reserve(command.types.size() + 1 + sql.size());
    for (Oid type : command.types)
        key.push_back(type == detail::postgres_store::bytea_oid ? 'b' : 't');
    key.push_back('\n');
    key.append(sql.data(), sql.size());
    auto found = cache_.find(key);
    if (found == cache_.end()) {
        if (cache_.size() >= max_cached_statements) return command;
        auto statement = std::make_unique<Statement>();
        statement->sql = command.sql;
        statement->name = fmt::format("idem_{}_u{}", store_number_, cache_.size());
        found = cache_.emplace(std::move(key), std::move(statement)).first;
    }
    command.statement = found->second.get();
    command.sql.clear();
    return command;
}

inline std::vector<PostgresStore::Result> PostgresStore::round_trip(
    std::vector<Command>& commands) {
    using detail::postgres_store::failed;
    std::vector<Result> results(commands.size());
    if (commands.empty()) return results;
    if (PQenterPipelineMode(conn_) != 1) {
        throw store_unavailable(
            fmt::format("idem postgres: cannot start a pipeline: {}", connection_error()));
    }
    round_trips_.fetch_add(1, std::memory_order_relaxed);

    struct Slot {
        std::size_t command;
        Statement* preparing;  // a Parse of this statement, or null: the command itself
    };
    std::vector<Slot> slots;
    slots.reserve(commands.size() * 2);
    std::string send_error;
    std::vector<const char*> values;
    std::vector<int> lengths;
    for (std::size_t i = 0; i < commands.size() && send_error.empty(); ++i) {
        const Command& command = commands[i];
        const int count = static_cast<int>(command.values.size());
        Statement* statement = prepare_ ? command.statement : nullptr;
        if (statement != nullptr && !statement->prepared) {
            const bool queued = std::any_of(slots.begin(), slots.end(), [&](const Slot& slot) {
                return slot.preparing == statement;
            });
            if (!queued) {
                if (statement->types.empty()) statement->types = command.types;
                if (PQsendPrepare(conn_, statement->name.c_str(), statement->sql.c_str(), count,
                                  statement->types.empty() ? nullptr : statement->types.data()) !=
                    1) {
                    send_error = connection_error();
                    break;
                }
                slots.push_back(Slot{i, statement});
            }
        }
        values.assign(command.values.size(), nullptr);
        lengths.assign(command.values.size(), 0);
        for (std::size_t k = 0; k < command.values.size(); ++k) {
            if (command.nulls[k] == 0) values[k] = command.values[k].c_str();
            lengths[k] = static_cast<int>(command.values[k].size());
        }
        const int sent =
            statement != nullptr
                ? PQsendQueryPrepared(conn_, statement->name.c_str(), count, values.data(),
                                      lengths.data(), command.formats.data(), command.result_format)
                : PQsendQueryParams(conn_, command.text().c_str(), count, command.types.data(),
                                    values.data(), lengths.data(), command.formats.data(),
                                    command.result_format);
        if (sent != 1) {
            send_error = connection_error();
            break;
        }
        slots.push_back(Slot{i, nullptr});
    }

    bool broken = PQpipelineSync(conn_) != 1;
    for (const Slot& slot : slots) {
        if (broken) break;
        Result first;
        while (PGresult* raw = PQgetResult(conn_)) {
            Result result(raw);
            if (!first || (!failed(first.get()) && failed(result.get()))) first = std::move(result);
        }
        if (slot.preparing != nullptr) {
            // 42P05: it survived a partial DEALLOCATE; the name is this store's, so it is ours.
            if (detail::postgres_store::succeeded(first.get()) ||
                detail::postgres_store::sqlstate(first.get()) == "42P05") {
                slot.preparing->prepared = true;
            }
            if (failed(first.get())) {
                results[slot.command] = std::move(first);  // the command inherits the failure
            }
        } else if (!results[slot.command]) {
            results[slot.command] = std::move(first);
        }
        broken = PQstatus(conn_) != CONNECTION_OK;
    }
    // Up to the sync point; a lost connection ends the stream with an error and nulls.
    for (int nulls = 0; !broken && nulls < 2;) {
        PGresult* raw = PQgetResult(conn_);
        if (raw == nullptr) {
            ++nulls;
            continue;
        }
        const bool sync = PQresultStatus(raw) == PGRES_PIPELINE_SYNC;
        PQclear(raw);
        if (sync) break;
        nulls = 0;
        broken = PQstatus(conn_) != CONNECTION_OK;
    }
    if (PQexitPipelineMode(conn_) != 1 && PQstatus(conn_) == CONNECTION_OK) {
        while (PGresult* raw = PQgetResult(conn_))
            PQclear(raw);
        PQexitPipelineMode(conn_);
    }
    for (const auto& result : results) {
        // "prepared statement does not exist": the session lost statements (DEALLOCATE, DISCARD
        // ALL, a pooler); ready() asks the server which ones are left before the next use.
        if (detail::postgres_store::sqlstate(result.get()) == "26000") resync_prepared_ = true;
    }
    if (PQstatus(conn_) != CONNECTION_OK) {
        // Keep the server's own reason (e.g. "terminating connection due to administrator
        // command") when it sent one.
        for (const auto& result : results) {
            if (failed(result.get())) {
                connection_lost(detail::postgres_store::server_message(result.get()));
            }
        }
        connection_lost(connection_error());
    }
    if (!send_error.empty()) {
        throw store_unavailable(
            fmt::format("idem postgres: sending a statement failed: {}", send_error));
    }
    return results;
}

inline void PostgresStore::connection_lost(std::string_view why) {
    std::string message = fmt::format(
        "idem postgres: the connection to PostgreSQL was lost ({}); the open transaction, if "
        "any, is gone, and the store reconnects on the next begin()",
        why);
    if (tx_open_ && tx_error_.empty()) tx_error_ = message;
    throw store_unavailable(message);
}

inline PostgresStore::Exchange PostgresStore::tx_exchange(std::vector<Command> commands,
                                                          bool check_queued) {
    Exchange exchange;
    exchange.commands = std::move(queued_);
    queued_.clear();
    exchange.first = exchange.commands.size();
    for (Command& command : commands)
        exchange.commands.push_back(std::move(command));
    exchange.results = round_trip(exchange.commands);
    const PGTransactionStatusType status = PQtransactionStatus(conn_);
    if (status == PQTRANS_INTRANS || status == PQTRANS_INERROR) tx_begun_ = true;
    if (check_queued) {
        for (std::size_t i = 0; i < exchange.first; ++i) {
            if (detail::postgres_store::failed(exchange.results[i].get())) {
                fail(exchange.commands[i], exchange.results[i].get(), exchange.commands[i].what);
            }
        }
    }
    return exchange;
}

inline PostgresStore::Result PostgresStore::run(Command command) {
    std::vector<Command> commands;
    commands.push_back(std::move(command));
    std::vector<Result> results = round_trip(commands);
    if (!detail::postgres_store::succeeded(results[0].get())) {
        fail(commands[0], results[0].get(), commands[0].what);
    }
    return std::move(results[0]);
}

inline void PostgresStore::flush() {
    if (queued_.empty()) return;
    tx_exchange({});
}

inline void PostgresStore::fail(const Command& command, const PGresult* result,
                                std::string_view what) {
    namespace pg = detail::postgres_store;
    const std::string_view state = pg::sqlstate(result);
    std::string message = fmt::format(
        "idem postgres: {} failed: {}", what,
        result != nullptr ? pg::server_message(result) : std::string("no answer from the server"));
    if (command.user) {
        message += fmt::format("; SQL: {}", command.text());
        if (state == "42601" && command.text().find('?') != std::string::npos) {
            message += " (PostgreSQL's placeholders are $1, $2, …, not ?)";
        }
    }
    if (tx_open_ && tx_error_.empty()) tx_error_ = message;
    if (pg::is_timeout(state)) throw store_timeout(message);
    if (command.user && state == "08P01") throw usage_error(message);  // wrong parameter count
    if (pg::is_unavailable(state) || !command.user) throw store_unavailable(message);
    throw store_error(message);
}

template <class... Args>
std::int64_t PostgresStore::execute(std::string_view sql, const Args&... args) {
    Lock lock(*this, "PostgresStore::execute()");
    ready("PostgresStore::execute()");
    Result result = run(user(sql, "execute", args...));
    return detail::postgres_store::affected_rows(result.get());
}

template <class... Args>
std::optional<std::int64_t> PostgresStore::query_int(std::string_view sql, const Args&... args) {
    Lock lock(*this, "PostgresStore::query_int()");
    ready("PostgresStore::query_int()");
    Result result = run(user(sql, "query_int", args...));
    if (PQntuples(result.get()) < 1 || PQnfields(result.get()) < 1 ||
        PQgetisnull(result.get(), 0, 0) != 0) {
        return std::nullopt;
    }
    return detail::postgres_store::text_int(result.get(), 0, 0, sql);
}

template <class... Args>
std::optional<std::string> PostgresStore::query_text(std::string_view sql, const Args&... args) {
    Lock lock(*this, "PostgresStore::query_text()");
    ready("PostgresStore::query_text()");
    Result result = run(user(sql, "query_text", args...));
    if (PQntuples(result.get()) < 1 || PQnfields(result.get()) < 1 ||
        PQgetisnull(result.get(), 0, 0) != 0) {
        return std::nullopt;
    }
    return detail::postgres_store::text_column(result.get(), 0, 0);
}

inline PostgresStore::Transaction PostgresStore::begin() {
    Lock lock(*this, "begin()");
    ready("begin()");
    queued_.clear();
    if (owned_) {
        // Our own session: set the lock timeout once per session (a reconnect is a new one),
        // not in every transaction.
        if (session_timeout_pid_ != PQbackendPID(conn_)) {
            run(control(fmt::format("SET lock_timeout = {}", lock_timeout_.count()),
                        "begin (SET lock_timeout)"));
            session_timeout_pid_ = PQbackendPID(conn_);
        }
        queued_.push_back(control(begin_sql_, "begin"));
    } else {
        // A borrowed session keeps its own setting outside our transactions.
        queued_.push_back(control(begin_sql_, "begin"));
        queued_.push_back(control(set_timeout_sql_, "begin (SET LOCAL lock_timeout)"));
    }
    tx_open_ = true;
    tx_begun_ = false;
    tx_error_.clear();
    return Transaction(*this, std::move(lock));
}

inline PurgeResult PostgresStore::purge(std::chrono::system_clock::duration older_than) {
    if (older_than.count() < 0) {
        throw usage_error("idem postgres: purge() needs a non-negative age");
    }
    Lock lock(*this, "purge()");
    const std::int64_t at = now_ms();
    const std::int64_t cutoff =
        at - std::chrono::duration_cast<std::chrono::milliseconds>(older_than).count();
    PurgeResult result;
    result.claims = purge_in_batches(purge_batch, "purge (claims)", cutoff);
    result.sent_intents =
        purge_in_batches(purge_outbox_batch, "purge (sent outbox intents)", cutoff);
    result.expired_locks = purge_in_batches(purge_locks_batch, "purge (expired locks)", at);
    return result;
}

inline std::size_t PostgresStore::purge_in_batches(Own which, std::string_view what,
                                                   std::int64_t before) {
    std::size_t total = 0;
    for (;;) {
        ready("purge()");
        Result result = run(own(which, what, before, purge_batch_rows));
        const std::int64_t deleted = detail::postgres_store::affected_rows(result.get());
        total += static_cast<std::size_t>(deleted);
        if (deleted < purge_batch_rows) return total;
    }
}

inline std::optional<ClaimRecord> PostgresStore::find_claim(std::string_view scope,
                                                            std::string_view id) {
    namespace pg = detail::postgres_store;
    Lock lock(*this, "find_claim()");
    ready("find_claim()");
    Result result = run(own(find_one_claim, "find_claim", Blob{scope}, Blob{id}));
    const PGresult* r = result.get();
    if (PQntuples(r) < 1) return std::nullopt;
    ClaimRecord found;
    found.scope = pg::bytes_of(r, 0, 0);
    found.message_id = pg::bytes_of(r, 0, 1);
    found.claimed_at = pg::from_unix_ms(pg::binary_int(r, 0, 2));
    const std::string outcome = pg::bytes_of(r, 0, 3);
    found.reason = pg::bytes_of(r, 0, 4);
    found.fingerprint = pg::bytes_of(r, 0, 5);
    if (outcome == "claimed") {
        found.disposition = Disposition::in_progress;  // claimed, no outcome recorded yet
    } else if (!from_string(outcome, found.disposition)) {
        throw store_error(
            fmt::format("idem postgres: unknown outcome '{}' stored in idem_claims", outcome));
    }
    return found;
}

inline std::vector<DeadLetter> PostgresStore::dead_letters() {
    namespace pg = detail::postgres_store;
    Lock lock(*this, "dead_letters()");
    ready("dead_letters()");
    Result result = run(own(all_dead_letters, "dead_letters"));
    const PGresult* r = result.get();
    std::vector<DeadLetter> letters;
    letters.reserve(static_cast<std::size_t>(PQntuples(r)));
    for (int row = 0; row < PQntuples(r); ++row) {
        DeadLetter letter;
        letter.scope = pg::bytes_of(r, row, 0);
        letter.message_id = pg::bytes_of(r, row, 1);
        letter.delivery_count = pg::to_count(pg::binary_int(r, row, 2));
        letter.reason = pg::bytes_of(r, row, 3);
        letter.payload = pg::bytes_of(r, row, 4);
        letter.created_at = pg::from_unix_ms(pg::binary_int(r, row, 5));
        letters.push_back(std::move(letter));
    }
    return letters;
}

inline bool PostgresStore::hold_lock(std::string_view key, std::string_view owner,
                                     std::chrono::milliseconds expire_after) {
    Lock lock(*this, "hold_lock()");
    ready("hold_lock()");
    const std::int64_t at = now_ms();
    Result result =
        run(own(lock_hold, "hold_lock", Blob{key}, Blob{owner}, at + expire_after.count(),
                detail::postgres_store::advisory_key("idem lock", key), at));
    return detail::postgres_store::affected_rows(result.get()) == 1;
}

inline bool PostgresStore::release_lock(std::string_view key, std::string_view owner) {
    Lock lock(*this, "release_lock()");
    ready("release_lock()");
    Result result = run(own(lock_release, "release_lock", Blob{key}, Blob{owner}));
    return detail::postgres_store::affected_rows(result.get()) >= 1;
}

inline OutboxRow PostgresStore::read_outbox_row(const PGresult* r, int row) {
    namespace pg = detail::postgres_store;
    OutboxRow out;
    out.id = pg::binary_int(r, row, 0);
    out.destination = pg::bytes_of(r, row, 1);
    out.idempotency_key = pg::bytes_of(r, row, 2);
    out.payload = pg::bytes_of(r, row, 3);
    out.created_at = pg::from_unix_ms(pg::binary_int(r, row, 4));
    if (PQgetisnull(r, row, 5) == 0) out.sent_at = pg::from_unix_ms(pg::binary_int(r, row, 5));
    out.attempts = pg::to_count(pg::binary_int(r, row, 6));
    out.last_error = pg::bytes_of(r, row, 7);
    out.next_attempt_at = pg::from_unix_ms(pg::binary_int(r, row, 8));
    out.parked = pg::binary_bool(r, row, 9);
    return out;
}

inline std::vector<OutboxRow> PostgresStore::lease_outbox(std::size_t limit,
                                                          std::chrono::milliseconds lease) {
    std::vector<OutboxRow> rows;
    if (limit == 0) return rows;
    const auto max_rows = static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max());
    const auto wanted = static_cast<std::int64_t>(limit < max_rows ? limit : max_rows);
    Lock lock(*this, "lease_outbox()");
    ready("lease_outbox()");
    const std::int64_t at = now_ms();
    Result result = run(own(outbox_lease, "lease_outbox", at + lease.count(), at, wanted));
    rows.reserve(static_cast<std::size_t>(PQntuples(result.get())));
    for (int row = 0; row < PQntuples(result.get()); ++row)
        rows.push_back(read_outbox_row(result.get(), row));
    // The order of RETURNING rows is unspecified.
    std::sort(rows.begin(), rows.end(),
              [](const OutboxRow& a, const OutboxRow& b) { return a.id < b.id; });
    return rows;
}

inline void PostgresStore::mark_outbox_sent(std::int64_t id) {
    Lock lock(*this, "mark_outbox_sent()");
    ready("mark_outbox_sent()");
    Result result = run(own(outbox_sent, "mark_outbox_sent", id, now_ms()));
    if (detail::postgres_store::affected_rows(result.get()) != 1) {
        throw usage_error(fmt::format("idem postgres: no outbox intent with id {}", id));
    }
}

inline void PostgresStore::mark_outbox_failed(std::int64_t id, std::string_view error,
                                              std::chrono::system_clock::time_point retry_at,
                                              bool park) {
    Lock lock(*this, "mark_outbox_failed()");
    ready("mark_outbox_failed()");
    Result result =
        run(own(outbox_failed, "mark_outbox_failed", id, detail::postgres_store::valid_utf8(error),
                detail::postgres_store::to_unix_ms(retry_at), park));
    if (detail::postgres_store::affected_rows(result.get()) != 1) {
        throw usage_error(fmt::format("idem postgres: no outbox intent with id {}", id));
    }
}

inline std::vector<OutboxRow> PostgresStore::outbox_rows() {
    Lock lock(*this, "outbox_rows()");
    ready("outbox_rows()");
    Result result = run(own(outbox_all, "outbox_rows"));
    std::vector<OutboxRow> rows;
    rows.reserve(static_cast<std::size_t>(PQntuples(result.get())));
    for (int row = 0; row < PQntuples(result.get()); ++row)
        rows.push_back(read_outbox_row(result.get(), row));
    return rows;
}

// ---------------------------------------------------------------------------------------------
// PostgresStore::Transaction

inline PostgresStore& PostgresStore::Transaction::open(std::string_view what, bool committing) {
    if (store_ == nullptr) {
        throw usage_error(fmt::format("idem postgres: {} on a moved-from transaction", what));
    }
    if (state_ != State::active) {
        throw usage_error(fmt::format(
            "idem postgres: {} on a transaction that was already {}{}", what,
            state_ == State::committed ? "committed" : "rolled back",
            committing && state_ == State::committed ? " (a second commit() is an error)" : ""));
    }
    PostgresStore& store = *store_;
    if (PQstatus(store.conn_) != CONNECTION_OK) {
        const std::string cause = store.tx_error_;
        finish(State::rolled_back);
        const std::string message = fmt::format(
            "idem postgres: {} failed: the connection to PostgreSQL was lost{}{}; the "
            "transaction is gone and nothing it wrote is stored",
            what, cause.empty() ? "" : ": ", cause);
        if (committing) throw commit_failed(message);
        throw store_unavailable(message);
    }
    check_still_open(what);
    return store;
}

inline void PostgresStore::Transaction::check_still_open(std::string_view what) {
    PostgresStore& store = *store_;
    if (store.tx_begun_ && PQstatus(store.conn_) == CONNECTION_OK &&
        PQtransactionStatus(store.conn_) == PQTRANS_IDLE) {
        finish(State::rolled_back);
        throw usage_error(fmt::format(
            "idem postgres: {}: the transaction was ended by a statement run through the "
            "connection (COMMIT, ROLLBACK or END inside the effect?); idem ends its own "
            "transaction",
            what));
    }
}

inline void PostgresStore::Transaction::finish(State state) noexcept {
    state_ = state;
    savepoints_ = 0;
    own_claims_.clear();
    if (store_ != nullptr) {
        store_->tx_open_ = false;
        store_->tx_begun_ = false;
        store_->tx_error_.clear();
        store_->queued_.clear();
    }
    lock_.unlock();
}

inline void PostgresStore::Transaction::end_noexcept() noexcept {
    if (active()) {
        store_->rollback_noexcept();
        finish(State::rolled_back);
    }
}

inline ClaimResult PostgresStore::Transaction::stored_claim(const PGresult* result, int row,
                                                            int outcome_column,
                                                            int fingerprint_column) {
    namespace pg = detail::postgres_store;
    return detail::stored_duplicate(pg::bytes_of(result, row, outcome_column),
                                    pg::bytes_of(result, row, fingerprint_column), "postgres");
}

inline ClaimResult PostgresStore::Transaction::insert_claim(PostgresStore& store,
                                                            std::string_view scope,
                                                            std::string_view id,
                                                            std::string_view fingerprint,
                                                            bool guarded) {
    namespace pg = detail::postgres_store;
    const auto end_guard = [&] {
        if (guarded) store.queued_.push_back(store.control(store.claim_release_sql_, "claim"));
    };
    // Rarely more than one pass: only when the row we waited for vanished again (purge).
    for (int attempt = 0; attempt < 3; ++attempt) {
        if (guarded) store.queued_.push_back(store.control(store.claim_savepoint_sql_, "claim"));
        auto exchange = store.tx_exchange(vec(store.own(
            claim_insert, "claim", Blob{scope}, Blob{id}, store.now_ms(), Blob{fingerprint})));
        const PGresult* inserted = exchange.result(0);
        if (!pg::succeeded(inserted)) {
            if (pg::sqlstate(inserted) == "55P03") {
                // Another live transaction holds this id past lock_timeout, and PostgreSQL
                // aborted ours: back to the savepoint, or the caller rolls it back.
                ClaimResult result;
                result.status = ClaimStatus::in_progress;
                if (guarded) {
                    store.queued_.push_back(
                        store.control(store.claim_rollback_to_sql_, "claim (lock timeout)"));
                    end_guard();
                    return result;
                }
                store.tx_error_ = fmt::format(
                    "idem postgres: claim waited {} ms (lock_timeout) for another transaction "
                    "holding the same id",
                    store.lock_timeout_.count());
                return result;
            }
            store.fail(exchange.command(0), inserted, "claim");
        }
        if (pg::affected_rows(inserted) == 1) {
            own_claims_.add(scope, id, fingerprint);
            end_guard();
            return ClaimResult{};  // claimed
        }
        // The row exists: committed before, or while we waited (a new statement sees it).
        auto again = store.tx_exchange(vec(store.own(
            claim_outcome, "claim (reading the recorded outcome)", Blob{scope}, Blob{id})));
        if (!pg::succeeded(again.result(0))) {
            store.fail(again.command(0), again.result(0), "claim (reading the outcome)");
        }
        end_guard();
        if (PQntuples(again.result(0)) > 0) return stored_claim(again.result(0), 0, 0, 1);
    }
    throw store_unavailable(
        "idem postgres: claim: the conflicting claim kept disappearing (purged while claiming?)");
}

inline ClaimResult PostgresStore::Transaction::claim(std::string_view scope, std::string_view id,
                                                     std::string_view fingerprint) {
    PostgresStore& store = open("claim()");
    if (const auto* own = own_claims_.find(scope, id)) return detail::OwnClaims::duplicate_of(*own);
    return insert_claim(store, scope, id, fingerprint, false);
}

inline std::vector<ClaimResult> PostgresStore::Transaction::claim_many(
    std::string_view scope, const std::vector<std::string_view>& ids,
    const std::vector<std::string>& fingerprints) {
    namespace pg = detail::postgres_store;
    PostgresStore& store = open("claim_many()");
    if (!fingerprints.empty() && fingerprints.size() != ids.size()) {
        throw usage_error("idem postgres: claim_many() needs one fingerprint per id");
    }
    const auto fingerprint = [&](std::size_t i) {
        return fingerprints.empty() ? std::string_view() : std::string_view(fingerprints[i]);
    };
    std::vector<ClaimResult> results(ids.size());
    // The ids to insert: not claimed by this transaction before; each distinct id once, with
    // the index of its first copy (whose fingerprint goes with it), sorted by id.
    std::vector<std::size_t> pending;
    pending.reserve(ids.size());
    const bool had_claims = own_claims_.size() > 0;
    for (std::size_t i = 0; i < ids.size(); ++i) {
        const auto* own = had_claims ? own_claims_.find(scope, ids[i]) : nullptr;
        if (own != nullptr) {
            results[i] = detail::OwnClaims::duplicate_of(*own);
        } else {
            pending.push_back(i);
        }
    }
    if (pending.empty()) return results;
    std::vector<std::size_t> order = pending;
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return ids[a] < ids[b]; });
    std::vector<std::size_t> first(ids.size());  // index of the first copy of ids[i]'s id
    std::vector<std::string_view> distinct;
    std::vector<std::string_view> distinct_fingerprints;
    distinct.reserve(order.size());
    for (std::size_t k = 0; k < order.size(); ++k) {
        const std::size_t i = order[k];
        if (k > 0 && ids[order[k - 1]] == ids[i]) {
            first[i] = first[order[k - 1]];
            continue;
        }
        first[i] = i;
        distinct.push_back(ids[i]);
        if (!fingerprints.empty()) distinct_fingerprints.push_back(fingerprint(i));
    }

    // One round trip (with the queued BEGIN): the savepoint and the INSERT of every id.
    store.queued_.push_back(store.control(store.claim_savepoint_sql_, "claim_many"));
    Command insert = store.own(claim_rows, "claim_many", Blob{scope}, store.now_ms());
    pg::add_bytea_array(insert, distinct);
    pg::add_bytea_array(insert, distinct_fingerprints);
    auto exchange = store.tx_exchange(vec(std::move(insert)));
    const PGresult* inserted = exchange.result(0);
    if (!pg::succeeded(inserted)) {
        if (pg::sqlstate(inserted) != "55P03")
            store.fail(exchange.command(0), inserted, "claim_many");
        // It waited past lock_timeout for an id another transaction holds; which one, the
        // error does not say. Undo the INSERT, then claim one id at a time, each in its own
        // savepoint. A repeated copy of an id held elsewhere is not waited for twice.
        store.queued_.push_back(
            store.control(store.claim_rollback_to_sql_, "claim_many (lock timeout)"));
        store.queued_.push_back(store.control(store.claim_release_sql_, "claim_many"));
        for (std::size_t i : pending) {
            if (first[i] != i && results[first[i]].status == ClaimStatus::in_progress) {
                results[i] = results[first[i]];
            } else if (const auto* own = own_claims_.find(scope, ids[i])) {
                results[i] = detail::OwnClaims::duplicate_of(*own);
            } else {
                results[i] = insert_claim(store, scope, ids[i], fingerprint(i), true);
            }
        }
        return results;
    }
    store.queued_.push_back(store.control(store.claim_release_sql_, "claim_many"));

    // Claimed: the first copy of each inserted id (added in the batch's order, the order the
    // handler records outcomes in); later copies are this transaction's duplicates.
    std::unordered_set<std::string_view> fresh;
    const int rows = PQntuples(inserted);
    fresh.reserve(static_cast<std::size_t>(rows));
    for (int row = 0; row < rows; ++row) {
        fresh.emplace(PQgetvalue(inserted, row, 0),
                      static_cast<std::size_t>(PQgetlength(inserted, row, 0)));
    }
    std::vector<std::string_view> stored;  // distinct ids that were there already
    for (std::size_t i : pending) {
        if (fresh.count(ids[i]) == 0) {
            if (first[i] == i) stored.push_back(ids[i]);
        } else if (first[i] == i) {
            own_claims_.add(scope, ids[i], fingerprint(i));
            results[i] = ClaimResult{};  // claimed
        } else {
            results[i] = detail::OwnClaims::duplicate_of(*own_claims_.find(scope, ids[i]));
        }
    }
    if (static_cast<std::size_t>(rows) < distinct.size()) {
        // The rest exist: read their outcomes (a new statement: it also sees claims that
        // committed while the INSERT waited).
        Command read = store.own(claim_rows_outcome, "claim_many (reading the recorded outcomes)",
                                 Blob{scope});
        pg::add_bytea_array(read, stored);
        auto again = store.tx_exchange(vec(std::move(read)));
        const PGresult* found = again.result(0);
        if (!pg::succeeded(found)) {
            store.fail(again.command(0), found, "claim_many (reading the outcomes)");
        }
        std::unordered_map<std::string_view, ClaimResult> recorded;
        recorded.reserve(stored.size());
        for (int row = 0; row < PQntuples(found); ++row) {
            recorded.emplace(std::string_view(PQgetvalue(found, row, 0),
                                              static_cast<std::size_t>(PQgetlength(found, row, 0))),
                             stored_claim(found, row, 1, 2));
        }
        for (std::size_t i : pending) {
            if (fresh.count(ids[i]) != 0) continue;
            const auto it = recorded.find(ids[i]);
            if (it != recorded.end()) {
                results[i] = it->second;
            } else if (const auto* own = own_claims_.find(scope, ids[i])) {
                results[i] = detail::OwnClaims::duplicate_of(*own);
            } else {
                // Gone again since the INSERT (purged): claim it like claim() would.
                results[i] = insert_claim(store, scope, ids[i], fingerprint(i), true);
            }
        }
    }
    return results;
}

inline void PostgresStore::Transaction::unclaim(std::string_view scope, std::string_view id) {
    PostgresStore& store = open("unclaim()");
    if (own_claims_.remove(scope, id)) {
        store.queued_.push_back(store.own(claim_delete, "unclaim", Blob{scope}, Blob{id}));
    }
}

inline void PostgresStore::Transaction::record_outcome(std::string_view scope, std::string_view id,
                                                       Disposition disposition,
                                                       std::string_view reason) {
    PostgresStore& store = open("record_outcome()");
    // Our own row already says 'processed' (and no reason): nothing to write.
    if (own_claims_.record(scope, id, disposition, reason, savepoints_)) return;
    store.queued_.push_back(store.own(record_update, "record_outcome", Blob{scope}, Blob{id},
                                      to_string(disposition),
                                      detail::postgres_store::valid_utf8(reason)));
}

inline void PostgresStore::Transaction::dead_letter(const DeadLetter& letter) {
    PostgresStore& store = open("dead_letter()");
    const auto created = letter.created_at == std::chrono::system_clock::time_point{}
                             ? store.now()
                             : letter.created_at;
    store.queued_.push_back(
        store.own(dead_letter_insert, "dead_letter", Blob{letter.scope}, Blob{letter.message_id},
                  static_cast<std::int64_t>(letter.delivery_count),
                  detail::postgres_store::valid_utf8(letter.reason), Blob{letter.payload},
                  detail::postgres_store::to_unix_ms(created)));
}

inline void PostgresStore::Transaction::savepoint() {
    PostgresStore& store = open("savepoint()");
    store.queued_.push_back(store.control(store.savepoint_sql_, "savepoint", true));
    own_claims_.savepoint();
    ++savepoints_;
}

inline void PostgresStore::Transaction::rollback_to_savepoint() {
    PostgresStore& store = open("rollback_to_savepoint()");
    if (savepoints_ == 0) {
        throw usage_error("idem postgres: rollback_to_savepoint() without an open savepoint()");
    }
    if (!store.queued_.empty() && store.queued_.back().savepoint) {
        store.queued_.pop_back();  // nothing happened since the savepoint: nothing to undo
    } else {
        store.queued_.push_back(store.control(store.rollback_to_sql_, "rollback_to_savepoint"));
        store.queued_.push_back(store.control(store.release_sql_, "rollback_to_savepoint"));
    }
    own_claims_.rollback_to_savepoint(savepoints_);
    --savepoints_;
}

inline void PostgresStore::Transaction::release_savepoint() {
    PostgresStore& store = open("release_savepoint()");
    if (savepoints_ == 0) {
        throw usage_error("idem postgres: release_savepoint() without an open savepoint()");
    }
    if (!store.queued_.empty() && store.queued_.back().savepoint) {
        store.queued_.pop_back();
    } else {
        store.queued_.push_back(store.control(store.release_sql_, "release_savepoint"));
    }
    own_claims_.release_savepoint(savepoints_);
    --savepoints_;
}

inline bool PostgresStore::Transaction::try_lock(std::string_view key,
                                                 std::chrono::milliseconds /*expire_after*/) {
    namespace pg = detail::postgres_store;
    PostgresStore& store = open("try_lock()");
    // Two statements in one round trip: the lock check runs after the advisory lock is taken
    // (a new READ COMMITTED snapshot), so a hold_lock() that committed before is seen, and one
    // that comes later cannot take the advisory lock.
    std::vector<Command> commands;
    commands.push_back(store.own(lock_advisory, "try_lock", pg::advisory_key("idem lock", key)));
    commands.push_back(store.own(lock_live, "try_lock", Blob{key}, store.now_ms()));
    auto exchange = store.tx_exchange(std::move(commands));
    for (std::size_t k = 0; k < 2; ++k) {
        if (!pg::succeeded(exchange.result(k))) {
            store.fail(exchange.command(k), exchange.result(k), "try_lock");
        }
    }
    const bool locked = pg::binary_bool(exchange.result(0), 0, 0);
    const bool held = pg::binary_bool(exchange.result(1), 0, 0);
    return locked && !held;
}

inline bool PostgresStore::Transaction::add_outbox(const OutboxIntent& intent) {
    PostgresStore& store = open("add_outbox()");
    if (detail::postgres_store::valid_utf8(intent.destination) != intent.destination) {
        throw usage_error(
            "idem postgres: add_outbox(): the destination is not valid UTF-8 or holds a NUL "
            "byte; it is stored as TEXT");
    }
    auto exchange = store.tx_exchange(
        vec(store.own(outbox_insert, "add_outbox", intent.destination, Blob{intent.idempotency_key},
                      Blob{intent.payload}, store.now_ms())));
    if (!detail::postgres_store::succeeded(exchange.result(0))) {
        store.fail(exchange.command(0), exchange.result(0), "add_outbox");
    }
    return detail::postgres_store::affected_rows(exchange.result(0)) == 1;
}

inline PGconn* PostgresStore::Transaction::conn() {
    PostgresStore& store = open("conn()");
    store.flush();
    return store.conn_;
}

inline void PostgresStore::Transaction::commit() {
    namespace pg = detail::postgres_store;
    PostgresStore& store = open("commit()", true);
    // A claim nobody recorded an outcome for is stored as claimed, not as the provisional
    // 'processed' its row was inserted with (queued: no extra round trip).
    for (const auto& claim : own_claims_.claims()) {
        if (claim.recorded_depth < 0) {
            store.queued_.push_back(store.own(record_update, "commit", Blob{claim.scope},
                                              Blob{claim.id}, "claimed", ""));
        }
    }
    const bool writes = std::any_of(store.queued_.begin(), store.queued_.end(),
                                    [](const Command& command) { return !command.control; });
    if (!store.tx_begun_ && !writes) {
        // Nothing reached the server, nothing to write: an empty transaction.
        const std::string cause = store.tx_error_;
        finish(cause.empty() ? State::committed : State::rolled_back);
        if (!cause.empty()) {
            throw commit_failed(
                fmt::format("idem postgres: commit failed: an earlier statement failed ({}); "
                            "rolled back",
                            cause));
        }
        return;
    }
    std::vector<Command> commands;
    commands.push_back(store.control(store.commit_sql_, "commit"));
    Exchange exchange;
    try {
        exchange = store.tx_exchange(std::move(commands), false);
    } catch (const store_unavailable& e) {
        finish(State::rolled_back);
        throw store_unavailable(fmt::format(
            "idem postgres: commit: the outcome is unknown: {} (a redelivery finds the claim if "
            "the commit went through)",
            e.what()));
    }
    std::string failure;
    for (std::size_t i = 0; i < exchange.commands.size() && failure.empty(); ++i) {
        if (pg::failed(exchange.results[i].get())) {
            failure = fmt::format("{}: {}", exchange.commands[i].what,
                                  pg::server_message(exchange.results[i].get()));
            if (exchange.commands[i].user) {
                failure += fmt::format("; SQL: {}", exchange.commands[i].text());
            }
        }
    }
    const PGresult* committed = exchange.result(0);
    if (failure.empty() && committed != nullptr &&
        std::string_view(PQcmdStatus(const_cast<PGresult*>(committed))) == "ROLLBACK") {
        // COMMIT of a transaction an earlier statement had aborted: PostgreSQL rolls it back.
        failure =
            store.tx_error_.empty() ? std::string("an earlier statement failed") : store.tx_error_;
        failure = fmt::format("the transaction had failed earlier ({})", failure);
    }
    if (failure.empty()) {
        finish(State::committed);
        return;
    }
    const bool rolled_back = store.rollback_noexcept();
    finish(State::rolled_back);
    throw commit_failed(fmt::format("idem postgres: commit failed: {}; rolled back{}", failure,
                                    rolled_back ? "" : " (and the rollback failed too)"));
}

inline void PostgresStore::Transaction::rollback() {
    if (store_ == nullptr) {
        throw usage_error("idem postgres: rollback() on a moved-from transaction");
    }
    if (state_ == State::committed) {
        throw usage_error("idem postgres: rollback() on a transaction that was already committed");
    }
    if (state_ == State::rolled_back) return;
    const bool ok = store_->rollback_noexcept();
    const std::string error = ok ? std::string() : store_->connection_error();
    finish(State::rolled_back);
    if (!ok) throw store_unavailable(fmt::format("idem postgres: rollback failed: {}", error));
}

static_assert(detail::check_store<PostgresStore>());

IDEM_END_NAMESPACE
