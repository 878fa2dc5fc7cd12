#pragma once
/// @file
/// @brief idem::postgres::Connection: the PostgreSQL session under idem's driver
/// (postgres/driver.hpp). It owns or borrows the `PGconn*`, knows the process that opened it
/// (fork safety), reconnects an owned connection (PQreset), tracks which statements are
/// prepared on the current session (and asks the server again when the session lost some),
/// runs a pipelined round trip, routes notices and sets lock_timeout once per owned session.
/// The SQL store's logic (claims, statements, the transaction and its first error) is the
/// driver's: what the connection reports into it goes through a callback, a template parameter
/// (no virtual call, no std::function per statement).

#include <fcntl.h>
#include <libpq-fe.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/postgres/libpq.hpp"

IDEM_BEGIN_NAMESPACE
namespace postgres {

/// Throws the exception of a failed @p command (store_timeout, usage_error for a wrong parameter
/// count of the effect's SQL, store_unavailable, store_error), after handing its message to
/// @p record (the driver keeps the first failure of a transaction).
template <class Record>
[[noreturn]] void fail(const Command& command, const PGresult* result, std::string_view what,
                       Record&& record) {
    const std::string_view state = sqlstate(result);
    std::string message = fmt::format(
        "idem postgres: {} failed: {}", what,
        result != nullptr ? server_message(result) : std::string("no answer from the server"));
    if (command.user) {
        message += fmt::format("; SQL: {}", command.text());
        if (state == "42601" && command.text().find('?') != std::string::npos) {
            message += " (PostgreSQL's placeholders are $1, $2, …, not ?)";
        }
    }
    record(message);
    if (is_timeout(state)) throw store_timeout(message);
    if (command.user && state == "08P01") throw usage_error(message);  // wrong parameter count
    if (is_unavailable(state) || !command.user) throw store_unavailable(message);
    throw store_error(message);
}

/// A callback for what has no transaction to record a failure in.
struct NoRecord {
    /// Ignores the failure's message.
    void operator()(const std::string& /*message*/) const noexcept {}
};

/// The session: one `PGconn*`, owned (opened from a conninfo) or borrowed (the consumer's).
class Connection {
  public:
    /// The oldest server this store runs on (ON CONFLICT, SKIP LOCKED, to_regclass(text)).
    static constexpr int min_server_version = 100000;

    Connection() = default;
    Connection(const Connection&) = delete;
    Connection& operator=(const Connection&) = delete;
    ~Connection() { close_noexcept(); }

    /// Before open() / borrow(): where notices go, whether statements are prepared, and the
    /// prefix of the names of this store's prepared statements.
    void configure(std::function<void(std::string_view)> on_notice, bool prepare,
                   std::string statement_prefix) {
        on_notice_ = std::move(on_notice);
        prepare_ = prepare;
        statement_prefix_ = std::move(statement_prefix);
    }
    /// A statement whose `prepared` flag this connection keeps true to the session. It must
    /// outlive the connection (or its close).
    void track(Statement& statement) { statements_.push_back(&statement); }

    /// Owned: connects with @p conninfo. @throws store_unavailable.
    void open(const std::string& conninfo) {
        conninfo_ = conninfo;
        owned_ = true;
        connect_owned();
    }
    /// Borrowed: checks @p conn and sets it up; on failure it is left as it was (not closed).
    void borrow(PGconn* conn);
    /// In a fork()ed child (owned): connect anew with the same conninfo.
    void connect_owned();

    /// The libpq connection; null before open() / borrow() and once closed or forgotten.
    [[nodiscard]] PGconn* get() const noexcept { return conn_; }
    /// True when opened here from a conninfo (closed by this object), false for a borrowed one.
    [[nodiscard]] bool owned() const noexcept { return owned_; }
    /// Whether idem's statements are prepared once per session (configure()).
    [[nodiscard]] bool prepares() const noexcept { return prepare_; }
    /// Round trips to the server so far (a pipeline counts once); for tests and benchmarks.
    [[nodiscard]] std::uint64_t round_trips() const noexcept {
        return round_trips_.load(std::memory_order_relaxed);
    }
    /// libpq's message for the connection's last failure, on one line.
    [[nodiscard]] std::string error() const {
        std::string message = trimmed(PQerrorMessage(conn_));
        return message.empty() ? std::string("unknown libpq error") : message;
    }

    /// Drops a connection opened in another process without a byte to the server: PQfinish
    /// (and PQreset) would send Terminate on the socket the parent still uses. The socket's
    /// descriptor is first replaced by /dev/null (dup2), so PQfinish only frees memory and
    /// closes this process's descriptor; a borrowed connection is only forgotten.
    void forget_inherited() noexcept;
    /// Closes an owned connection; a borrowed one is left as found (our statements dropped,
    /// libpq's notice receiver back).
    void close_noexcept() noexcept;

    /// Before a statement outside a transaction or a BEGIN: reconnects a broken connection,
    /// finishes a rollback that failed, resyncs the prepared statements, and checks the
    /// connection is idle, blocking and outside pipeline mode.
    template <class Record>
    void ready(std::string_view what, Record&& record);
    /// Owned sessions: `SET lock_timeout` once per session (a reconnect is a new one).
    template <class Record>
    void set_session_lock_timeout(std::chrono::milliseconds timeout, Record&& record);
    /// Rolls back whatever is open; true when the connection is outside a transaction now.
    bool rollback_noexcept() noexcept;

    /// Sends @p commands as one pipeline (preparing what is not prepared on this session yet);
    /// a lost connection hands its message to @p record and throws store_unavailable.
    template <class Record>
    std::vector<Result> round_trip(std::vector<Command>& commands, Record&& record);
    /// One command outside a transaction; throws on failure.
    template <class Record>
    Result run(Command command, Record&& record) {
        std::vector<Command> commands;
        commands.push_back(std::move(command));
        std::vector<Result> results = round_trip(commands, record);
        if (!succeeded(results[0].get()))
            fail(commands[0], results[0].get(), commands[0].what, record);
        return std::move(results[0]);
    }

  private:
    void setup();
    void reconnect(std::string_view what);
    void forget_prepared() noexcept;
    template <class Record>
    void resync_prepared(Record&& record);
    void route_notices();
    void restore_notices() noexcept;
    static void notice_receiver(void* connection, const PGresult* notice) noexcept;

    PGconn* conn_ = nullptr;
    bool owned_ = false;
    std::string conninfo_;  ///< owned: what connect_owned() connects with
    std::function<void(std::string_view)> on_notice_;
    bool notices_routed_ = false;   ///< notice_receiver is installed on conn_
    bool chain_processor_ = false;  ///< also pass notices to the consumer's notice processor
    bool prepare_ = true;
    std::string statement_prefix_;
    std::vector<Statement*> statements_;
    int session_timeout_pid_ = 0;  ///< backend whose session has our lock_timeout (owned only)
    int backend_pid_ = 0;
    std::atomic<std::uint64_t> round_trips_{0};
    bool rollback_pending_ = false;  // our ROLLBACK failed: the connection is still in our tx
    bool resync_prepared_ = false;   // the session lost some of our prepared statements
};

inline void Connection::connect_owned() {
    // client_encoding and application_name come first: the expanded conninfo overrides them.
    const char* const keys[] = {"client_encoding", "fallback_application_name", "dbname", nullptr};
    const char* const values[] = {"UTF8", "idem", conninfo_.c_str(), nullptr};
    conn_ = PQconnectdbParams(keys, values, 1);
    if (conn_ == nullptr) throw store_unavailable("idem postgres: cannot connect: out of memory");
    if (PQstatus(conn_) != CONNECTION_OK) {
        const std::string message = fmt::format("idem postgres: cannot connect: {}", error());
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

inline void Connection::borrow(PGconn* conn) {
    conn_ = conn;
    owned_ = false;
    try {
        if (PQstatus(conn_) != CONNECTION_OK) {
            throw store_unavailable(
                fmt::format("idem postgres: the borrowed connection is broken: {}", error()));
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

inline void Connection::forget_inherited() noexcept {
    if (conn_ == nullptr) return;
    if (owned_) {
        const int fd = PQsocket(conn_);
        bool detached = fd < 0;
        if (!detached) {
            const int null = ::open("/dev/null", O_RDWR | O_CLOEXEC);
            if (null >= 0) {
                detached = ::dup2(null, fd) == fd;
                ::close(null);
            }
        }
        // Without /dev/null in its place the socket stays open and the PGconn is leaked: better
        // than a Terminate on the parent's session.
        if (detached) PQfinish(conn_);
    }
    conn_ = nullptr;
    notices_routed_ = false;
    forget_prepared();
    rollback_pending_ = false;
    session_timeout_pid_ = 0;
    backend_pid_ = 0;
}

inline void Connection::close_noexcept() noexcept {
    if (conn_ == nullptr) return;
    if (owned_) {
        PQfinish(conn_);
    } else if (PQstatus(conn_) == CONNECTION_OK && PQtransactionStatus(conn_) == PQTRANS_IDLE &&
               PQpipelineStatus(conn_) == PQ_PIPELINE_OFF) {
        // Leave the borrowed session as we found it: drop our prepared statements.
        try {
            std::string sql;
            for (const Statement* statement : statements_) {
                if (statement->prepared) sql += fmt::format("DEALLOCATE {};", statement->name);
            }
            if (!sql.empty()) PQclear(PQexec(conn_, sql.c_str()));
        } catch (...) {
        }
    }
    if (!owned_) restore_notices();
    conn_ = nullptr;
}

inline void Connection::route_notices() {
    const auto& libpq = libpq_notice_hooks();
    if (owned_) {
        // Our own connection: nobody else listens, so nothing reaches stderr.
        PQsetNoticeReceiver(conn_, &Connection::notice_receiver, this);
        notices_routed_ = true;
        return;
    }
    if (!on_notice_ || libpq.receiver == nullptr) return;  // the consumer's connection as it is
    if (PQsetNoticeReceiver(conn_, nullptr, nullptr) != libpq.receiver) {
        return;  // the consumer's own receiver: neither chainable nor restorable, so kept
    }
    chain_processor_ = PQsetNoticeProcessor(conn_, nullptr, nullptr) != libpq.processor;
    PQsetNoticeReceiver(conn_, &Connection::notice_receiver, this);
    notices_routed_ = true;
}

inline void Connection::restore_notices() noexcept {
    if (!notices_routed_ || owned_ || conn_ == nullptr) return;
    // libpq's receiver ignores its argument (a new PGconn has it null).
    PQsetNoticeReceiver(conn_, libpq_notice_hooks().receiver, nullptr);
    notices_routed_ = false;
}

inline void Connection::notice_receiver(void* connection, const PGresult* notice) noexcept {
    const auto* self = static_cast<const Connection*>(connection);
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
        libpq_notice_hooks().receiver(nullptr, notice);
    }
}

inline void Connection::forget_prepared() noexcept {
    for (Statement* statement : statements_)
        statement->prepared = false;
    resync_prepared_ = false;
}

template <class Record>
void Connection::resync_prepared(Record&& record) {
    forget_prepared();
    Command command;
    command.sql =
        "SELECT name FROM pg_catalog.pg_prepared_statements WHERE left(name, length($1)) = $1";
    command.what = "reading the prepared statements";
    add_params(command, statement_prefix_);
    Result names = run(std::move(command), record);
    for (int row = 0; row < PQntuples(names.get()); ++row) {
        const std::string name = bytes_of(names.get(), row, 0);
        for (Statement* statement : statements_)
            if (statement->name == name) statement->prepared = true;
    }
}

inline void Connection::setup() {
    if (PQserverVersion(conn_) < min_server_version) {
        throw store_unavailable(fmt::format(
            "idem postgres: the server is version {}; PostgresStore needs PostgreSQL 10 or later",
            PQserverVersion(conn_)));
    }
    backend_pid_ = PQbackendPID(conn_);
}

inline void Connection::reconnect(std::string_view what) {
    PQreset(conn_);
    forget_prepared();
    rollback_pending_ = false;
    if (PQstatus(conn_) != CONNECTION_OK) {
        throw store_unavailable(fmt::format(
            "idem postgres: {}: the connection to PostgreSQL broke and reconnecting failed: {}",
            what, error()));
    }
    backend_pid_ = PQbackendPID(conn_);
}

template <class Record>
void Connection::ready(std::string_view what, Record&& record) {
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
    if (status == PQTRANS_IDLE && resync_prepared_) resync_prepared(record);
    if (status != PQTRANS_IDLE) {
        throw usage_error(fmt::format(
            "idem postgres: {}: the connection is already inside a transaction (or busy with a "
            "query). idem needs its own BEGIN so the claim and the effect commit together: "
            "commit or roll back your transaction first, and write the effect's rows through the "
            "idem transaction (Transaction::execute() or Transaction::conn())",
            what));
    }
}

template <class Record>
void Connection::set_session_lock_timeout(std::chrono::milliseconds timeout, Record&& record) {
    if (session_timeout_pid_ == PQbackendPID(conn_)) return;
    Command command;
    command.sql = fmt::format("SET lock_timeout = {}", timeout.count());
    command.what = "begin (SET lock_timeout)";
    command.control = true;
    run(std::move(command), record);
    session_timeout_pid_ = PQbackendPID(conn_);
}

inline bool Connection::rollback_noexcept() noexcept {
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

template <class Record>
std::vector<Result> Connection::round_trip(std::vector<Command>& commands, Record&& record) {
    std::vector<Result> results(commands.size());
    if (commands.empty()) return results;
    if (PQenterPipelineMode(conn_) != 1) {
        throw store_unavailable(fmt::format("idem postgres: cannot start a pipeline: {}", error()));
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
                    send_error = error();
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
            send_error = error();
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
            if (succeeded(first.get()) || sqlstate(first.get()) == "42P05") {
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
        if (sqlstate(result.get()) == "26000") resync_prepared_ = true;
    }
    if (PQstatus(conn_) != CONNECTION_OK) {
        // Keep the server's own reason (e.g. "terminating connection due to administrator
        // command") when it sent one.
        std::string why;
        bool from_server = false;
        for (const auto& result : results) {
            if (failed(result.get())) {
                why = server_message(result.get());
                from_server = true;
                break;
            }
        }
        if (!from_server) why = error();
        std::string message = fmt::format(
            "idem postgres: the connection to PostgreSQL was lost ({}); the open transaction, if "
            "any, is gone, and the store reconnects on the next begin()",
            why);
        record(message);
        throw store_unavailable(message);
    }
    if (!send_error.empty()) {
        throw store_unavailable(
            fmt::format("idem postgres: sending a statement failed: {}", send_error));
    }
    return results;
}

}  // namespace postgres
IDEM_END_NAMESPACE
