#pragma once
/// @file
/// @brief idem::kafka's typed errors: every failed librdkafka call becomes one of them, carrying
/// the librdkafka error code and whether the failure is retriable or fatal. Link idem::kafka.
///
///   kafka::error        a refused call (an unknown topic, an invalid offset, a bad config);
///                       a broker_error. fatal(): the client handle is unusable from now on
///                       (an idempotent producer's fatal error, a fenced member): make a new one
///   kafka::unavailable  no broker can be reached (transport failure, all brokers down); a
///                       broker_unavailable, retriable
///   kafka::timeout      no answer in time; a kafka::unavailable. Ambiguous for a commit or a
///                       produce: it may have been done
/// All carry kafka::Failure (code(), retriable(), fatal()); catch idem::broker_error for any.

#include <librdkafka/rdkafka.h>

#include <string>
#include <string_view>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"

IDEM_BEGIN_NAMESPACE
namespace kafka {

/// @brief What every idem::kafka error carries.
class Failure {
  public:
    /// @brief A failure of librdkafka error @p code, as retriable and fatal as librdkafka says.
    Failure(rd_kafka_resp_err_t code, bool retriable, bool fatal) noexcept
        : code_(code), retriable_(retriable), fatal_(fatal) {}

    /// The librdkafka error code (rd_kafka_err2name() names it).
    [[nodiscard]] rd_kafka_resp_err_t code() const noexcept { return code_; }
    /// Whether the same call may succeed if repeated later (a leader moving, a coordinator
    /// loading, a broker coming back).
    [[nodiscard]] bool retriable() const noexcept { return retriable_; }
    /// Whether the client handle that failed can no longer be used.
    [[nodiscard]] bool fatal() const noexcept { return fatal_; }

  private:
    rd_kafka_resp_err_t code_;
    bool retriable_;
    bool fatal_;
};

/// @brief A librdkafka call the cluster or the client refused: an idem::broker_error.
class error : public broker_error, public Failure {
  public:
    /// @brief A refusal described by @p what, of librdkafka error @p code.
    error(const std::string& what, rd_kafka_resp_err_t code, bool retriable, bool fatal)
        : broker_error(what), Failure(code, retriable, fatal) {}
};

/// @brief No broker can be reached: an idem::broker_unavailable; retry later.
class unavailable : public broker_unavailable, public Failure {
  public:
    /// @brief An unreachable cluster described by @p what, of librdkafka error @p code: retriable,
    /// not fatal.
    unavailable(const std::string& what, rd_kafka_resp_err_t code)
        : broker_unavailable(what), Failure(code, true, false) {}
};

/// @brief No answer in time. For a commit or a produce: it may or may not have been done.
class timeout : public unavailable {
  public:
    /// @brief As unavailable's: @p what and the librdkafka error code (a timeout's).
    using unavailable::unavailable;
};

namespace detail {

/// Codes that name a passing state of the cluster (a leader or coordinator moving, a group
/// rebalancing): the same call may succeed later.
inline bool retriable_code(rd_kafka_resp_err_t code) noexcept {
    switch (code) {
        case RD_KAFKA_RESP_ERR_LEADER_NOT_AVAILABLE:
        case RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION:
        case RD_KAFKA_RESP_ERR_COORDINATOR_LOAD_IN_PROGRESS:
        case RD_KAFKA_RESP_ERR_COORDINATOR_NOT_AVAILABLE:
        case RD_KAFKA_RESP_ERR_NOT_COORDINATOR:
        case RD_KAFKA_RESP_ERR_REBALANCE_IN_PROGRESS:
        case RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS:
        case RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS_AFTER_APPEND:
        case RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART:
        case RD_KAFKA_RESP_ERR_NETWORK_EXCEPTION:
        case RD_KAFKA_RESP_ERR__WAIT_COORD:
        case RD_KAFKA_RESP_ERR__IN_PROGRESS:
        case RD_KAFKA_RESP_ERR__PREV_IN_PROGRESS:
            return true;
        default:
            return false;
    }
}

/// Throws the error class @p code stands for: "idem::kafka: <what>: <code name>: <text>".
/// @p retriable, @p fatal: what librdkafka said, when it said it (rd_kafka_error_t).
[[noreturn]] inline void raise(rd_kafka_resp_err_t code, std::string_view what,
                               std::string_view detail_text, bool retriable, bool fatal) {
    std::string message = fmt::format("idem::kafka: {}: {}: {}", what, rd_kafka_err2name(code),
                                      rd_kafka_err2str(code));
    if (!detail_text.empty() && detail_text != rd_kafka_err2str(code)) {
        message += fmt::format(" ({})", detail_text);
    }
    switch (code) {
        case RD_KAFKA_RESP_ERR__TIMED_OUT:
        case RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT:
        case RD_KAFKA_RESP_ERR__MSG_TIMED_OUT:
        case RD_KAFKA_RESP_ERR__TIMED_OUT_QUEUE:
            throw timeout(message, code);
        case RD_KAFKA_RESP_ERR__TRANSPORT:
        case RD_KAFKA_RESP_ERR__ALL_BROKERS_DOWN:
        case RD_KAFKA_RESP_ERR__RESOLVE:
            if (!fatal) throw unavailable(message, code);
            break;
        default:
            break;
    }
    throw error(message, code, retriable || retriable_code(code), fatal);
}

/// raise() unless @p code is RD_KAFKA_RESP_ERR_NO_ERROR.
inline void check(rd_kafka_resp_err_t code, std::string_view what) {
    if (code != RD_KAFKA_RESP_ERR_NO_ERROR) raise(code, what, {}, false, false);
}

/// Takes ownership of @p failure (null: success) and raises it with librdkafka's own verdict
/// on retriable and fatal.
inline void check(rd_kafka_error_t* failure, std::string_view what) {
    if (failure == nullptr) return;
    const rd_kafka_resp_err_t code = rd_kafka_error_code(failure);
    const std::string text = rd_kafka_error_string(failure);
    const bool retriable = rd_kafka_error_is_retriable(failure) != 0;
    const bool fatal = rd_kafka_error_is_fatal(failure) != 0;
    rd_kafka_error_destroy(failure);
    raise(code, what, text, retriable, fatal);
}

/// The handle's fatal error (RD_KAFKA_RESP_ERR__FATAL stands for it) raised as fatal.
[[noreturn]] inline void raise_fatal(rd_kafka_t* handle, std::string_view what) {
    char text[512] = {0};
    const rd_kafka_resp_err_t code = rd_kafka_fatal_error(handle, text, sizeof text);
    raise(code == RD_KAFKA_RESP_ERR_NO_ERROR ? RD_KAFKA_RESP_ERR__FATAL : code, what, text, false,
          true);
}

}  // namespace detail
}  // namespace kafka
IDEM_END_NAMESPACE
