#pragma once
/// @file
/// @brief idem::nats's typed errors: every failed cnats call becomes one of them, carrying the
/// natsStatus, the JetStream error code (when the server gave one) and cnats' own text.
/// Link idem::nats.
///
///   nats::error          a refused call (a bad stream config, a bad subject); a broker_error
///   nats::not_found      the stream or consumer does not exist; a nats::error
///   nats::unavailable    the server cannot be reached: connection closed or lost, no server,
///                        no responders (JetStream not answering, e.g. while it restarts); a
///                        broker_unavailable
///   nats::timeout        no answer in time; a nats::unavailable. Ambiguous for an ack or a
///                        publish: it may have been done (a redelivery then finds a duplicate)
/// All carry nats::Failure (status(), js_code()); catch idem::broker_error for any of them.

#include <nats/nats.h>

#include <string>
#include <string_view>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"

IDEM_BEGIN_NAMESPACE
namespace nats {

/// @brief What every idem::nats error carries: the cnats status and the JetStream error code.
class Failure {
  public:
    /// @brief A failure of cnats status @p status and JetStream error code @p js_code (0: none).
    Failure(natsStatus status, int js_code) noexcept : status_(status), js_code_(js_code) {}

    /// The cnats status of the call.
    [[nodiscard]] natsStatus status() const noexcept { return status_; }
    /// The JetStream error code the server answered (jsErrCode, e.g. 10059 stream not found);
    /// 0 when there was none.
    [[nodiscard]] int js_code() const noexcept { return js_code_; }

  private:
    natsStatus status_;
    int js_code_;
};

/// @brief A failed cnats call the server refused (a bad stream config, a bad subject): an
/// idem::broker_error, so a consumer's run() backs off and retries.
class error : public broker_error, public Failure {
  public:
    /// @brief A refusal described by @p what, with the call's cnats status and JetStream code.
    error(const std::string& what, natsStatus status, int js_code)
        : broker_error(what), Failure(status, js_code) {}
};

/// @brief The stream or the consumer named does not exist.
class not_found : public error {
  public:
    /// @brief As error's: @p what, the cnats status and the JetStream code (e.g. 10059).
    using error::error;
};

/// @brief The server cannot be reached (or JetStream does not answer): an
/// idem::broker_unavailable, counted as a connection error; retry later.
class unavailable : public broker_unavailable, public Failure {
  public:
    /// @brief An unreachable server described by @p what, with the call's cnats status and
    /// JetStream code.
    unavailable(const std::string& what, natsStatus status, int js_code)
        : broker_unavailable(what), Failure(status, js_code) {}
};

/// @brief No answer in time. For an ack or a publish: it may or may not have been done.
class timeout : public unavailable {
  public:
    /// @brief As unavailable's: @p what, the cnats status and the JetStream code.
    using unavailable::unavailable;
};

namespace detail {

/// Throws the error class @p status and @p js_code stand for; the message is
/// "idem::nats: <what>: <status text> (<cnats' last error text>)".
[[noreturn]] inline void raise(natsStatus status, int js_code, std::string_view what) {
    std::string text = natsStatus_GetText(status);
    natsStatus last = NATS_OK;
    if (const char* detail = nats_GetLastError(&last);
        detail != nullptr && *detail != '\0' && text != detail) {
        text += fmt::format(" ({})", detail);
    }
    if (js_code != 0) text += fmt::format(" [JetStream error {}]", js_code);
    const std::string message = fmt::format("idem::nats: {}: {}", what, text);
    if (js_code == JSStreamNotFoundErr || js_code == JSConsumerNotFoundErr) {
        throw not_found(message, status, js_code);
    }
    switch (status) {
        case NATS_TIMEOUT:
            throw timeout(message, status, js_code);
        case NATS_IO_ERROR:
        case NATS_CONNECTION_CLOSED:
        case NATS_NO_SERVER:
        case NATS_STALE_CONNECTION:
        case NATS_CONNECTION_DISCONNECTED:
        case NATS_NOT_YET_CONNECTED:
        case NATS_NO_RESPONDERS:
        case NATS_DRAINING:
            throw unavailable(message, status, js_code);
        case NATS_NOT_FOUND:
            throw not_found(message, status, js_code);
        default:
            throw error(message, status, js_code);
    }
}

/// raise() unless @p status is NATS_OK.
inline void check(natsStatus status, std::string_view what, int js_code = 0) {
    if (status != NATS_OK) raise(status, js_code, what);
}

}  // namespace detail
}  // namespace nats
IDEM_END_NAMESPACE
