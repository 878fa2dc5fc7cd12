#pragma once
/// @file
/// @brief idem::spdlog_logger(): a LoggingObserver's Logger writing to an spdlog logger
/// (component idem::spdlog; link it to get spdlog).
///
/// @code
/// auto sink = spdlog::stderr_color_mt("idem");
/// idem::LoggingOptions options;
/// options.redact = idem::mask_card_numbers;
/// idem::LoggingObserver logs(idem::spdlog_logger(sink), options);
/// auto handler = idem::make_handler(store, policy, effect, &logs);
/// @endcode
///
/// Each record is written as `logger->log(level, "{}", record.message)`, at spdlog's level of the
/// same name (warn → spdlog::level::warn, ...); the spdlog logger's own level filters too (a
/// record it would drop is not even built). Use a thread-safe (`_mt`) logger when the observer is
/// shared between threads.

#include <memory>
#include <utility>

#include <spdlog/spdlog.h>

#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/observers/logging.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The spdlog level of an idem LogLevel.
[[nodiscard]] constexpr spdlog::level::level_enum spdlog_level_of(LogLevel level) noexcept {
    switch (level) {
        case LogLevel::debug:
            return spdlog::level::debug;
        case LogLevel::info:
            return spdlog::level::info;
        case LogLevel::warn:
            return spdlog::level::warn;
        case LogLevel::error:
            return spdlog::level::err;
    }
    return spdlog::level::err;
}

/// @brief A Logger writing each record's message to @p logger.
/// @throws usage_error when @p logger is null.
[[nodiscard]] inline std::shared_ptr<Logger> spdlog_logger(std::shared_ptr<spdlog::logger> logger) {
    class SpdlogLogger final : public Logger {
      public:
        explicit SpdlogLogger(std::shared_ptr<spdlog::logger> l) : logger_(std::move(l)) {}
        void log(const LogRecord& record) override {
            logger_->log(spdlog_level_of(record.level), "{}", record.message);
        }
        [[nodiscard]] bool enabled(LogLevel level) const override {
            return logger_->should_log(spdlog_level_of(level));
        }

      private:
        std::shared_ptr<spdlog::logger> logger_;
    };
    if (!logger) throw usage_error("idem::spdlog_logger: the logger is null");
    return std::make_shared<SpdlogLogger>(std::move(logger));
}

IDEM_END_NAMESPACE
