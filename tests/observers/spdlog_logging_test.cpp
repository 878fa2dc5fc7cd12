// spdlog_logger(): a LoggingObserver writing to spdlog, captured by an ostream sink and a
// ringbuffer sink after real handle() calls on a MemoryStore; spdlog's own level filters too.

#include <gtest/gtest.h>

#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>

#include "idem/idem.hpp"
#include "idem/observers/logging.hpp"
#include "idem/observers/spdlog.hpp"
#include "idem/payload.hpp"
#include "idem/store/memory.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;
using idem::LogLevel;

bool contains(const std::string& text, const std::string& needle) {
    return text.find(needle) != std::string::npos;
}

std::vector<std::string> lines_of(const std::string& text) {
    std::vector<std::string> lines;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);)
        lines.push_back(line);
    return lines;
}

struct SpdlogLogging : ::testing::Test {
    idem::MemoryStore store;
    bool throw_in_effect = false;

    template <class Observer>
    auto handler(Observer& observer) {
        return idem::make_handler(
            store, idem::Policy{"capture"},
            [this](auto& tx, const std::string& body) {
                if (throw_in_effect) {
                    throw idem::malformed_message("card " + body + " is not a number");
                }
                tx.put("captures", body, "done");
            },
            &observer);
    }
};

TEST_F(SpdlogLogging, OstreamSinkCapturesTheFormattedLines) {
    std::ostringstream out;
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
    sink->set_pattern("%l|%v");
    auto logger = std::make_shared<spdlog::logger>("idem-test", sink);
    logger->set_level(spdlog::level::trace);

    idem::LoggingOptions options;
    options.min_level = LogLevel::debug;
    options.redact = idem::mask_card_numbers;
    idem::LoggingObserver logs(idem::spdlog_logger(logger), options);
    auto h = handler(logs);

    (void)h.handle(Delivery{"m-1", 1u}, std::string("o1"));  // processed: debug
    (void)h.handle(Delivery{"m-1", 2u}, std::string("o1"));  // duplicate: debug
    throw_in_effect = true;
    (void)h.handle(Delivery{"m-2", 1u}, std::string("5500-0000-0000-0004"));  // warn
    logger->flush();

    const auto lines = lines_of(out.str());
    ASSERT_EQ(lines.size(), 3u) << out.str();
    EXPECT_EQ(lines[0].rfind("debug|idem outcome scope=capture disposition=processed "
                             "message_id=m-1 delivery_count=1 duration_ms=",
                             0),
              0u)
        << lines[0];
    EXPECT_EQ(lines[1].rfind("debug|idem outcome scope=capture disposition=duplicate "
                             "message_id=m-1 delivery_count=2 ",
                             0),
              0u)
        << lines[1];
    EXPECT_EQ(lines[2].rfind("warning|idem outcome scope=capture disposition=dead_lettered "
                             "delivery_count=1 duration_ms=",
                             0),
              0u)
        << lines[2];
    EXPECT_TRUE(contains(lines[2],
                         "reason=\"malformed message: card ****-****-****-0004 is not "
                         "a number\""))
        << lines[2];
    EXPECT_FALSE(contains(out.str(), "5500")) << out.str();
    EXPECT_FALSE(contains(lines[2], "m-2")) << lines[2];
}

TEST_F(SpdlogLogging, RingbufferSinkAndSpdlogLevelFilter) {
    auto ring = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(16);
    ring->set_pattern("%l %v");
    auto logger = std::make_shared<spdlog::logger>("idem-ring", ring);
    logger->set_level(spdlog::level::warn);  // spdlog drops debug and info

    idem::LoggingOptions options;
    options.min_level = LogLevel::debug;
    auto adapter = idem::spdlog_logger(logger);
    EXPECT_FALSE(adapter->enabled(LogLevel::info));
    EXPECT_TRUE(adapter->enabled(LogLevel::warn));
    EXPECT_TRUE(adapter->enabled(LogLevel::error));
    idem::LoggingObserver logs(adapter, options);
    auto h = handler(logs);

    (void)h.handle(Delivery{"a", 1u}, std::string("o1"));  // debug: dropped by spdlog's level
    throw_in_effect = true;
    (void)h.handle(Delivery{"b", 1u}, std::string("o2"));  // warn
    logs.on_timed_outcome(
        "capture", Delivery{"c", 1u},
        idem::failed_outcome("store error: gone", idem::FailureCause::store_unavailable),
        std::chrono::milliseconds(3));

    const auto lines = ring->last_formatted();
    ASSERT_EQ(lines.size(), 2u);
    EXPECT_TRUE(contains(lines[0], "warning idem outcome scope=capture disposition=dead_lettered"))
        << lines[0];
    EXPECT_TRUE(contains(lines[1],
                         "error idem outcome scope=capture disposition=failed "
                         "cause=store_unavailable delivery_count=1 duration_ms=3.000 "
                         "reason=\"store error: gone\""))
        << lines[1];
    for (const auto& line : lines)
        EXPECT_FALSE(contains(line, "message_id")) << line;
}

TEST_F(SpdlogLogging, LevelMapping) {
    EXPECT_EQ(idem::spdlog_level_of(LogLevel::debug), spdlog::level::debug);
    EXPECT_EQ(idem::spdlog_level_of(LogLevel::info), spdlog::level::info);
    EXPECT_EQ(idem::spdlog_level_of(LogLevel::warn), spdlog::level::warn);
    EXPECT_EQ(idem::spdlog_level_of(LogLevel::error), spdlog::level::err);
}

TEST_F(SpdlogLogging, NullLoggerIsRefused) {
    EXPECT_THROW((void)idem::spdlog_logger(nullptr), idem::usage_error);
}

}  // namespace
