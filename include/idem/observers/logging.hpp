#pragma once
/// @file
/// @brief LoggingObserver: one log record per outcome, forwarded to an idem::Logger (std and fmt
/// only; the spdlog adapter is idem/observers/spdlog.hpp, component idem::spdlog).
///
/// @code
/// idem::LoggingOptions options;
/// options.min_level = idem::LogLevel::info;
/// options.redact = idem::mask_card_numbers;  // or [&policy](auto s) { return policy.redact(s); }
/// idem::LoggingObserver logs(idem::function_logger([](const idem::LogRecord& r) {
///     std::fprintf(stderr, "%s %s\n", idem::to_string(r.level).data(), r.message.c_str()); }),
///     options);
/// auto handler = idem::make_handler(store, policy, effect, &logs);
/// @endcode
///
/// Levels: processed and duplicate → debug, deferred and in_progress → info, dead_lettered and
/// rejected → warn, failed → error (log_level_of()).
///
/// What is never logged: the payload. The observer never sees a body; what it logs of one is
/// what the handler put in the outcome's reason, and the handler passes every text an exception
/// brings into a reason (a malformed_message's, the effect's, the store's) through the policy's
/// redaction hook (PolicyOptions::redact_payload) first, so with a hook set, a card number a
/// malformed message quotes never reaches a Logger. LoggingOptions::redact applies on top of it
/// (e.g. `idem::mask_card_numbers` for handlers whose policy has no hook).
///
/// The message id and the gateway idempotency key (from the effect chain's with_gateway_key(),
/// effects/gateway_key.hpp) are logged at debug only: a record of level info and above has an
/// empty LogRecord::message_id and gateway_key and neither in its line (omitted, not hashed: a
/// hash of a short id is still a key to it).

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/error.hpp"
#include "idem/observer.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The level of a log record, lowest first.
enum class LogLevel : std::uint8_t { debug, info, warn, error };

/// @brief Name of a level: "debug", "info", "warn", "error".
[[nodiscard]] constexpr std::string_view to_string(LogLevel level) noexcept {
    switch (level) {
        case LogLevel::debug:
            return "debug";
        case LogLevel::info:
            return "info";
        case LogLevel::warn:
            return "warn";
        case LogLevel::error:
            return "error";
    }
    return "unknown";
}

/// @brief The level an outcome of disposition @p d is logged at.
[[nodiscard]] constexpr LogLevel log_level_of(Disposition d) noexcept {
    switch (d) {
        case Disposition::processed:
        case Disposition::duplicate:
            return LogLevel::debug;
        case Disposition::deferred:
        case Disposition::in_progress:
            return LogLevel::info;
        case Disposition::dead_lettered:
        case Disposition::rejected:
            return LogLevel::warn;
        case Disposition::failed:
            return LogLevel::error;
    }
    return LogLevel::error;
}

/// @brief One outcome, as a Logger receives it. The views are valid during Logger::log() only.
struct LogRecord {
    /// The record's level: log_level_of() the disposition.
    LogLevel level = LogLevel::debug;
    std::string_view scope;       ///< the handler's Policy scope
    std::string_view message_id;  ///< the broker's id at debug; empty at info and above
    /// The gateway idempotency key at debug, when the effect chain names one
    /// (with_gateway_key()); empty at info and above.
    std::string_view gateway_key;
    /// The outcome's disposition.
    Disposition disposition = Disposition::failed;
    /// For a failed outcome, why (Outcome::cause); else none.
    FailureCause cause = FailureCause::none;
    /// The delivery's count, as the handler saw it.
    std::uint32_t delivery_count = 0;
    std::string reason;  ///< the outcome's reason through LoggingOptions::redact
    /// The time the handler spent (Observer::on_timed_outcome()); empty from on_outcome().
    std::optional<std::chrono::nanoseconds> duration{};
    /// The time the effect took (Observer::on_detailed_outcome(), when the effect ran).
    std::optional<std::chrono::nanoseconds> effect_duration{};
    /// The formatted line (logfmt-like, no level, no newline), e.g.
    /// `idem outcome scope=capture disposition=failed cause=effect_threw delivery_count=1
    /// duration_ms=0.412 effect_ms=0.380 reason="effect threw: gateway 502"`, at debug with
    /// `message_id=... gateway_key=...` after the disposition.
    std::string message;
};

/// @brief Where a LoggingObserver sends its records. Called on the handling thread: must be
/// thread-safe when the observer is shared between threads.
class Logger {
  public:
    virtual ~Logger() = default;
    /// @brief Writes @p record (its `message` is the formatted line). Should not throw: what it
    /// throws is swallowed by the handler (observing never changes an outcome).
    virtual void log(const LogRecord& record) = 0;
    /// False when a record of @p level would be dropped anyway (the observer then skips
    /// building it). Default: every level.
    [[nodiscard]] virtual bool enabled(LogLevel level) const {
        static_cast<void>(level);
        return true;
    }
};

/// @brief A Logger calling @p sink for every record of at least @p min_level.
/// @throws usage_error when @p sink is empty.
[[nodiscard]] inline std::shared_ptr<Logger> function_logger(
    std::function<void(const LogRecord&)> sink, LogLevel min_level = LogLevel::debug) {
    class FunctionLogger final : public Logger {
      public:
        FunctionLogger(std::function<void(const LogRecord&)> f, LogLevel min)
            : sink_(std::move(f)), min_(min) {}
        void log(const LogRecord& record) override {
            if (enabled(record.level)) sink_(record);
        }
        [[nodiscard]] bool enabled(LogLevel level) const override { return level >= min_; }

      private:
        std::function<void(const LogRecord&)> sink_;
        LogLevel min_;
    };
    if (!sink) throw usage_error("idem::function_logger: the function is empty");
    return std::make_shared<FunctionLogger>(std::move(sink), min_level);
}

/// @brief Options of a LoggingObserver.
struct LoggingOptions {
    /// Records below this level are not built nor sent.
    LogLevel min_level = LogLevel::info;
    /// Applied to every reason before it is logged (e.g. `idem::mask_card_numbers`, or
    /// `[&policy](std::string_view s) { return policy.redact(s); }`). Empty: reasons are logged
    /// as they are. If it throws, the reason is replaced by "<reason withheld: redaction
    /// failed>", never logged unredacted.
    std::function<std::string(std::string_view reason)> redact{};
};

/// @brief @p text as a logfmt value: in double quotes when empty or holding a space, '=', '"'
/// or a control character; '"' and '\\' escaped, control bytes as \\n, \\r, \\t or \\xNN.
[[nodiscard]] inline std::string log_quote(std::string_view text) {
    bool plain = !text.empty();
    for (char c : text) {
        const auto u = static_cast<unsigned char>(c);
        if (u <= 0x20 || u == 0x7f || c == '=' || c == '"' || c == '\\') plain = false;
    }
    if (plain) return std::string(text);
    std::string out = "\"";
    for (char c : text) {
        const auto u = static_cast<unsigned char>(c);
        switch (c) {
            case '"':
                out += "\\\"";
                break;
            case '\\':
                out += "\\\\";
                break;
            case '\n':
                out += "\\n";
                break;
            case '\r':
                out += "\\r";
                break;
            case '\t':
                out += "\\t";
                break;
            default:
                if (u < 0x20 || u == 0x7f) {
                    out += fmt::format("\\x{:02x}", u);
                } else {
                    out += c;
                }
        }
    }
    out += '"';
    return out;
}

/// @brief An Observer that formats every outcome of at least LoggingOptions::min_level into a
/// LogRecord and hands it to a Logger. Stateless apart from its options: share one between
/// handlers and threads when the Logger is thread-safe.
class LoggingObserver final : public Observer {
  public:
    /// @throws usage_error when @p logger is null.
    explicit LoggingObserver(std::shared_ptr<Logger> logger, LoggingOptions options = {})
        : logger_(std::move(logger)), options_(std::move(options)) {
        if (!logger_) throw usage_error("idem::LoggingObserver: the logger is null");
    }

    void on_outcome(std::string_view scope, const Delivery& delivery,
                    const Outcome& outcome) override {
        emit(scope, delivery, outcome, std::nullopt);
    }

    void on_timed_outcome(std::string_view scope, const Delivery& delivery, const Outcome& outcome,
                          std::chrono::nanoseconds handled_in) override {
        OutcomeDetails details;
        details.handled_in = handled_in;
        emit(scope, delivery, outcome, details);
    }

    void on_detailed_outcome(std::string_view scope, const Delivery& delivery,
                             const Outcome& outcome, const OutcomeDetails& details) override {
        emit(scope, delivery, outcome, details);
    }

    /// True when debug records are built (the only ones that carry the key).
    [[nodiscard]] bool wants_gateway_key() const override {
        return options_.min_level <= LogLevel::debug && logger_->enabled(LogLevel::debug);
    }

    /// @brief The options this observer was built with.
    [[nodiscard]] const LoggingOptions& options() const noexcept { return options_; }

  private:
    void emit(std::string_view scope, const Delivery& delivery, const Outcome& outcome,
              const std::optional<OutcomeDetails>& details) {
        const LogLevel level = log_level_of(outcome.disposition);
        if (level < options_.min_level || !logger_->enabled(level)) return;

        LogRecord record;
        record.level = level;
        record.scope = scope;
        if (level == LogLevel::debug) {
            record.message_id = delivery.message_id;
            if (details) record.gateway_key = details->gateway_key;
        }
        record.disposition = outcome.disposition;
        record.cause = outcome.cause;
        record.delivery_count = delivery.delivery_count.value();
        record.reason = redacted(outcome.reason);
        if (details) {
            record.duration = details->handled_in;
            record.effect_duration = details->effect_in;
        }

        std::string& m = record.message;
        m = fmt::format("idem outcome scope={} disposition={}", log_quote(scope),
                        outcome.disposition);
        if (outcome.cause != FailureCause::none) m += fmt::format(" cause={}", outcome.cause);
        if (level == LogLevel::debug) {
            m += fmt::format(" message_id={}", log_quote(record.message_id));
            if (!record.gateway_key.empty())
                m += fmt::format(" gateway_key={}", log_quote(record.gateway_key));
        }
        m += fmt::format(" delivery_count={}", record.delivery_count);
        auto ms = [](std::chrono::nanoseconds d) {
            return std::chrono::duration<double, std::milli>(d).count();
        };
        if (record.duration) m += fmt::format(" duration_ms={:.3f}", ms(*record.duration));
        if (record.effect_duration)
            m += fmt::format(" effect_ms={:.3f}", ms(*record.effect_duration));
        if (!record.reason.empty()) m += fmt::format(" reason={}", log_quote(record.reason));
        logger_->log(record);
    }

    [[nodiscard]] std::string redacted(const std::string& reason) const {
        if (!options_.redact || reason.empty()) return reason;
        try {
            return options_.redact(reason);
        } catch (...) {
            return "<reason withheld: redaction failed>";
        }
    }

    std::shared_ptr<Logger> logger_;
    LoggingOptions options_;
};

IDEM_END_NAMESPACE

/// @cond fmt_formatters
/// @brief `fmt::format("{}", level)`: the level's name.
template <>
struct fmt::formatter<idem::LogLevel> : fmt::formatter<std::string_view> {
    template <class FormatContext>
    auto format(idem::LogLevel level, FormatContext& ctx) const {
        return fmt::formatter<std::string_view>::format(idem::to_string(level), ctx);
    }
};
/// @endcond
