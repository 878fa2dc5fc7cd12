// LoggingObserver and function_logger: the level of each disposition, the minimum level, the
// redaction of reasons (a card number in a malformed_message text is masked, by the observer's
// option or by the policy's hook before any observer sees it, dead letters included), the message
// id and the gateway key at debug only, the durations, and FanOutObserver feeding a
// PrometheusObserver and a LoggingObserver from one handler, after real handle() calls on a
// MemoryStore.

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/effects/gateway_key.hpp"
#include "idem/idem.hpp"
#include "idem/observers/fan_out.hpp"
#include "idem/observers/logging.hpp"
#include "idem/observers/prometheus.hpp"
#include "idem/payload.hpp"
#include "idem/store/memory.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;
using idem::FailureCause;
using idem::LogLevel;

bool contains(const std::string& text, const std::string& needle) {
    return text.find(needle) != std::string::npos;
}

/// A LogRecord with its views copied.
struct Seen {
    LogLevel level;
    std::string scope;
    std::string message_id;
    Disposition disposition;
    FailureCause cause;
    std::uint32_t delivery_count;
    std::string reason;
    std::optional<std::chrono::nanoseconds> duration;
    std::string message;
    std::string gateway_key;
    std::optional<std::chrono::nanoseconds> effect_duration;
};

enum class Act { apply, reject, defer, throw_, malformed };

struct Logging : ::testing::Test {
    idem::MemoryStore store;
    std::vector<Seen> seen;
    Act act = Act::apply;
    std::chrono::milliseconds sleep{0};

    std::shared_ptr<idem::Logger> sink(LogLevel min = LogLevel::debug) {
        return idem::function_logger(
            [this](const idem::LogRecord& r) {
                seen.push_back(Seen{r.level, std::string(r.scope), std::string(r.message_id),
                                    r.disposition, r.cause, r.delivery_count, r.reason, r.duration,
                                    r.message, std::string(r.gateway_key), r.effect_duration});
            },
            min);
    }

    auto handler(idem::Observer& observer, const std::string& scope = "capture") {
        return idem::make_handler(
            store, idem::Policy{scope},
            [this](auto& tx, const std::string& body) -> idem::EffectResult {
                if (sleep.count() > 0) std::this_thread::sleep_for(sleep);
                switch (act) {
                    case Act::reject:
                        return idem::EffectResult::rejected("payment is refunded");
                    case Act::defer:
                        return idem::EffectResult::deferred("authorization not seen yet");
                    case Act::throw_:
                        throw std::runtime_error("gateway 502");
                    case Act::malformed:
                        throw idem::malformed_message("bad amount in {\"pan\":\"" + body + "\"}");
                    case Act::apply:
                        break;
                }
                tx.put("captures", body, "done");
                return idem::EffectResult::applied();
            },
            &observer);
    }
};

TEST_F(Logging, LevelOfEveryDisposition) {
    EXPECT_EQ(idem::log_level_of(Disposition::processed), LogLevel::debug);
    EXPECT_EQ(idem::log_level_of(Disposition::duplicate), LogLevel::debug);
    EXPECT_EQ(idem::log_level_of(Disposition::deferred), LogLevel::info);
    EXPECT_EQ(idem::log_level_of(Disposition::in_progress), LogLevel::info);
    EXPECT_EQ(idem::log_level_of(Disposition::dead_lettered), LogLevel::warn);
    EXPECT_EQ(idem::log_level_of(Disposition::rejected), LogLevel::warn);
    EXPECT_EQ(idem::log_level_of(Disposition::failed), LogLevel::error);
    EXPECT_EQ(idem::to_string(LogLevel::warn), "warn");
    EXPECT_EQ(fmt::format("{}", LogLevel::error), "error");
}

TEST_F(Logging, RealOutcomesGetTheirLevels) {
    idem::LoggingOptions options;
    options.min_level = LogLevel::debug;
    idem::LoggingObserver logs(sink(), options);
    auto h = handler(logs);

    (void)h.handle(Delivery{"a", 1u}, std::string("o1"));  // processed
    (void)h.handle(Delivery{"a", 2u}, std::string("o1"));  // duplicate
    (void)h.handle(Delivery{"b", 9u}, std::string("o2"));  // over max_deliveries: dead-lettered
    act = Act::reject;
    (void)h.handle(Delivery{"c", 1u}, std::string("o3"));
    act = Act::defer;
    (void)h.handle(Delivery{"d", 1u}, std::string("o4"));
    act = Act::throw_;
    (void)h.handle(Delivery{"e", 1u}, std::string("o5"));

    ASSERT_EQ(seen.size(), 6u);
    const std::vector<std::pair<Disposition, LogLevel>> expected = {
        {Disposition::processed, LogLevel::debug},    {Disposition::duplicate, LogLevel::debug},
        {Disposition::dead_lettered, LogLevel::warn}, {Disposition::rejected, LogLevel::warn},
        {Disposition::deferred, LogLevel::info},      {Disposition::failed, LogLevel::error}};
    for (std::size_t i = 0; i < expected.size(); ++i) {
        EXPECT_EQ(seen[i].disposition, expected[i].first) << i;
        EXPECT_EQ(seen[i].level, expected[i].second) << i;
        EXPECT_EQ(seen[i].scope, "capture");
        EXPECT_TRUE(contains(seen[i].message, "idem outcome scope=capture disposition=" +
                                                  std::string(idem::to_string(expected[i].first))))
            << seen[i].message;
    }
    EXPECT_EQ(seen[1].delivery_count, 2u);
    EXPECT_EQ(seen[5].cause, FailureCause::effect_threw);
    EXPECT_TRUE(contains(seen[5].message, " cause=effect_threw ")) << seen[5].message;
    EXPECT_TRUE(contains(seen[5].message, "reason=\"effect threw: gateway 502\""))
        << seen[5].message;
    EXPECT_FALSE(contains(seen[0].message, "cause=")) << seen[0].message;
}

TEST_F(Logging, MinimumLevelFilters) {
    idem::LoggingOptions options;
    options.min_level = LogLevel::warn;
    idem::LoggingObserver logs(sink(), options);
    auto h = handler(logs);
    (void)h.handle(Delivery{"a", 1u}, std::string("o1"));  // debug: dropped
    act = Act::defer;
    (void)h.handle(Delivery{"b", 1u}, std::string("o2"));  // info: dropped
    act = Act::reject;
    (void)h.handle(Delivery{"c", 1u}, std::string("o3"));  // warn
    act = Act::throw_;
    (void)h.handle(Delivery{"d", 1u}, std::string("o4"));  // error
    ASSERT_EQ(seen.size(), 2u);
    EXPECT_EQ(seen[0].disposition, Disposition::rejected);
    EXPECT_EQ(seen[1].disposition, Disposition::failed);
}

TEST_F(Logging, DefaultMinimumIsInfo) {
    idem::LoggingObserver logs(sink());
    EXPECT_EQ(logs.options().min_level, LogLevel::info);
    auto h = handler(logs);
    (void)h.handle(Delivery{"a", 1u}, std::string("o1"));
    act = Act::defer;
    (void)h.handle(Delivery{"b", 1u}, std::string("o2"));
    ASSERT_EQ(seen.size(), 1u);
    EXPECT_EQ(seen[0].disposition, Disposition::deferred);
}

TEST_F(Logging, FunctionLoggerMinimumLevelFilters) {
    idem::LoggingOptions options;
    options.min_level = LogLevel::debug;
    auto logger = sink(LogLevel::error);
    EXPECT_FALSE(logger->enabled(LogLevel::warn));
    EXPECT_TRUE(logger->enabled(LogLevel::error));
    idem::LoggingObserver logs(logger, options);
    auto h = handler(logs);
    (void)h.handle(Delivery{"a", 1u}, std::string("o1"));
    act = Act::reject;
    (void)h.handle(Delivery{"b", 1u}, std::string("o2"));
    act = Act::throw_;
    (void)h.handle(Delivery{"c", 1u}, std::string("o3"));
    ASSERT_EQ(seen.size(), 1u);
    EXPECT_EQ(seen[0].level, LogLevel::error);
}

TEST_F(Logging, CardNumberInAMalformedMessageIsMasked) {
    idem::LoggingOptions options;
    options.redact = idem::mask_card_numbers;
    idem::LoggingObserver logs(sink(), options);
    auto h = handler(logs);
    act = Act::malformed;
    const auto outcome = h.handle(Delivery{"m", 1u}, std::string("4111 1111 1111 1111"));
    ASSERT_EQ(outcome.disposition, Disposition::dead_lettered);
    ASSERT_TRUE(contains(outcome.reason, "4111 1111 1111 1111"));  // the outcome itself is raw
    ASSERT_EQ(seen.size(), 1u);
    EXPECT_EQ(seen[0].level, LogLevel::warn);
    EXPECT_FALSE(contains(seen[0].reason, "4111 1111")) << seen[0].reason;
    EXPECT_TRUE(contains(seen[0].reason, "**** **** **** 1111")) << seen[0].reason;
    EXPECT_FALSE(contains(seen[0].message, "4111 1111")) << seen[0].message;
    EXPECT_TRUE(contains(seen[0].message, "**** **** **** 1111")) << seen[0].message;
    // Quotes in the reason are escaped in the line.
    EXPECT_TRUE(contains(seen[0].message, "{\\\"pan\\\":")) << seen[0].message;
}

TEST_F(Logging, PolicyRedactCanBePassed) {
    idem::PolicyOptions policy_options;
    policy_options.redact_payload = [](std::string_view) { return std::string("<hidden>"); };
    const idem::Policy policy{"capture", policy_options};
    idem::LoggingOptions options;
    options.redact = [&policy](std::string_view s) { return policy.redact(s); };
    idem::LoggingObserver logs(sink(), options);
    auto h = handler(logs);
    act = Act::throw_;
    (void)h.handle(Delivery{"a", 1u}, std::string("o1"));
    ASSERT_EQ(seen.size(), 1u);
    EXPECT_EQ(seen[0].reason, "<hidden>");
    EXPECT_TRUE(contains(seen[0].message, "reason=<hidden>")) << seen[0].message;
}

TEST_F(Logging, NoRedactionByDefault) {
    idem::LoggingObserver logs(sink());
    auto h = handler(logs);
    act = Act::throw_;
    (void)h.handle(Delivery{"a", 1u}, std::string("o1"));
    ASSERT_EQ(seen.size(), 1u);
    EXPECT_EQ(seen[0].reason, "effect threw: gateway 502");
}

TEST_F(Logging, ARedactionThatThrowsWithholdsTheReason) {
    idem::LoggingOptions options;
    options.redact = [](std::string_view) -> std::string { throw std::runtime_error("boom"); };
    idem::LoggingObserver logs(sink(), options);
    auto h = handler(logs);
    act = Act::malformed;
    const auto outcome = h.handle(Delivery{"m", 1u}, std::string("4111111111111111"));
    EXPECT_EQ(outcome.disposition, Disposition::dead_lettered);
    ASSERT_EQ(seen.size(), 1u);
    EXPECT_EQ(seen[0].reason, "<reason withheld: redaction failed>");
    EXPECT_FALSE(contains(seen[0].message, "4111111111111111")) << seen[0].message;
}

TEST_F(Logging, MessageIdAtDebugOnly) {
    idem::LoggingOptions options;
    options.min_level = LogLevel::debug;
    idem::LoggingObserver logs(sink(), options);
    auto h = handler(logs);
    (void)h.handle(Delivery{"id-processed", 1u}, std::string("o1"));
    (void)h.handle(Delivery{"id-processed", 2u}, std::string("o1"));
    act = Act::defer;
    (void)h.handle(Delivery{"id-deferred", 1u}, std::string("o2"));
    act = Act::reject;
    (void)h.handle(Delivery{"id-rejected", 1u}, std::string("o3"));
    act = Act::throw_;
    (void)h.handle(Delivery{"id-failed", 1u}, std::string("o4"));

    ASSERT_EQ(seen.size(), 5u);
    for (std::size_t i = 0; i < 2; ++i) {
        EXPECT_EQ(seen[i].level, LogLevel::debug);
        EXPECT_EQ(seen[i].message_id, "id-processed");
        EXPECT_TRUE(contains(seen[i].message, " message_id=id-processed ")) << seen[i].message;
    }
    for (std::size_t i = 2; i < seen.size(); ++i) {
        EXPECT_NE(seen[i].level, LogLevel::debug);
        EXPECT_TRUE(seen[i].message_id.empty()) << seen[i].message_id;
        EXPECT_FALSE(contains(seen[i].message, "message_id")) << seen[i].message;
        EXPECT_FALSE(contains(seen[i].message, "id-")) << seen[i].message;
    }
}

TEST_F(Logging, BinaryMessageIdIsEscaped) {
    idem::LoggingOptions options;
    options.min_level = LogLevel::debug;
    idem::LoggingObserver logs(sink(), options);
    auto h = handler(logs);
    (void)h.handle(Delivery{std::string("a b\n\x01", 5), 1u}, std::string("o1"));
    ASSERT_EQ(seen.size(), 1u);
    EXPECT_TRUE(contains(seen[0].message, " message_id=\"a b\\n\\x01\" ")) << seen[0].message;
    EXPECT_EQ(idem::log_quote(""), "\"\"");
    EXPECT_EQ(idem::log_quote("plain"), "plain");
    EXPECT_EQ(idem::log_quote("a=b"), "\"a=b\"");
}

TEST_F(Logging, DurationsArePassed) {
    idem::LoggingOptions options;
    options.min_level = LogLevel::debug;
    idem::LoggingObserver logs(sink(), options);
    auto h = handler(logs);
    sleep = std::chrono::milliseconds(20);
    (void)h.handle(Delivery{"a", 1u}, std::string("o1"));
    ASSERT_EQ(seen.size(), 1u);
    ASSERT_TRUE(seen[0].duration.has_value());
    EXPECT_GE(*seen[0].duration, std::chrono::milliseconds(20));
    EXPECT_LT(*seen[0].duration, std::chrono::seconds(10));
    EXPECT_TRUE(contains(seen[0].message, " duration_ms=")) << seen[0].message;

    // on_outcome() (no timing): no duration.
    logs.on_outcome("capture", Delivery{"b", 1u}, idem::Outcome{Disposition::processed, ""});
    ASSERT_EQ(seen.size(), 2u);
    EXPECT_FALSE(seen[1].duration.has_value());
    EXPECT_FALSE(contains(seen[1].message, "duration_ms")) << seen[1].message;
    EXPECT_FALSE(contains(seen[1].message, "reason=")) << seen[1].message;

    logs.on_timed_outcome("capture", Delivery{"c", 1u}, idem::Outcome{Disposition::processed, ""},
                          std::chrono::microseconds(1500));
    ASSERT_EQ(seen.size(), 3u);
    EXPECT_EQ(seen[2].duration, std::chrono::nanoseconds(1500000));
    EXPECT_TRUE(contains(seen[2].message, " duration_ms=1.500")) << seen[2].message;
}

TEST_F(Logging, ALoggerThatThrowsDoesNotChangeTheOutcome) {
    idem::LoggingObserver logs(
        idem::function_logger([](const idem::LogRecord&) { throw std::runtime_error("disk"); }));
    auto h = handler(logs);
    act = Act::throw_;
    EXPECT_EQ(h.handle(Delivery{"a", 1u}, std::string("o1")).disposition, Disposition::failed);
    act = Act::apply;
    EXPECT_EQ(h.handle(Delivery{"a", 2u}, std::string("o1")).disposition, Disposition::processed);
}

TEST_F(Logging, NullLoggerAndEmptyFunctionAreRefused) {
    EXPECT_THROW(idem::LoggingObserver{nullptr}, idem::usage_error);
    EXPECT_THROW((void)idem::function_logger({}), idem::usage_error);
}

// ---- the policy's redaction hook, before any observer ----

/// Every record's reason and line, and the store's dead letters: nothing may hold @p raw.
void expect_nowhere(const std::vector<Seen>& seen, idem::MemoryStore& store,
                    const std::string& raw) {
    for (const Seen& r : seen) {
        EXPECT_FALSE(contains(r.reason, raw)) << r.reason;
        EXPECT_FALSE(contains(r.message, raw)) << r.message;
    }
    for (const auto& letter : store.dead_letters()) {
        EXPECT_FALSE(contains(letter.reason, raw)) << letter.reason;
        EXPECT_FALSE(contains(letter.payload, raw)) << letter.payload;
    }
}

TEST_F(Logging, ACardNumberInAMalformedMessageNeverReachesTheSinkNorTheDeadLetter) {
    idem::PolicyOptions policy_options;
    policy_options.redact_payload = idem::mask_card_numbers;
    idem::LoggingOptions options;  // no redaction of its own: the policy's hook is enough
    options.min_level = LogLevel::debug;
    idem::LoggingObserver logs(sink(), options);
    auto h = idem::make_handler(
        store, idem::Policy{"capture", policy_options},
        [](auto&, const std::string& body) {
            throw idem::malformed_message("cannot parse amount in {\"pan\":\"" + body + "\"}");
        },
        &logs);
    const std::string card = "4111 1111 1111 1111";
    const auto outcome = h.handle(Delivery{"m-1", 1u}, card);
    ASSERT_EQ(outcome.disposition, Disposition::dead_lettered);
    EXPECT_FALSE(contains(outcome.reason, card)) << outcome.reason;
    EXPECT_TRUE(contains(outcome.reason, "**** **** **** 1111")) << outcome.reason;
    ASSERT_EQ(seen.size(), 1u);
    EXPECT_TRUE(contains(seen[0].message, "**** **** **** 1111")) << seen[0].message;
    const auto letters = store.dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_TRUE(contains(letters[0].reason, "malformed message: cannot parse amount"))
        << letters[0].reason;
    EXPECT_TRUE(contains(letters[0].reason, "**** **** **** 1111")) << letters[0].reason;
    expect_nowhere(seen, store, card);
    expect_nowhere(seen, store, "4111111111111111");
}

TEST_F(Logging, TheEffectsAndTheStoresTextsGoThroughThePolicyHookToo) {
    idem::PolicyOptions policy_options;
    policy_options.redact_payload = idem::mask_card_numbers;
    idem::LoggingObserver logs(sink());
    bool store_error = false;
    auto h = idem::make_handler(
        store, idem::Policy{"capture", policy_options},
        [&store_error](auto&, const std::string& body) {
            if (store_error) throw idem::store_error("constraint failed: pan=" + body);
            throw std::runtime_error("gateway declined card " + body);
        },
        &logs);
    const std::string card = "5500000000000004";
    EXPECT_EQ(h.handle(Delivery{"m-1", 1u}, card).disposition, Disposition::failed);
    store_error = true;
    EXPECT_EQ(h.handle(Delivery{"m-2", 1u}, card).disposition, Disposition::failed);
    ASSERT_EQ(seen.size(), 2u);
    EXPECT_EQ(seen[0].reason, "effect threw: gateway declined card ************0004");
    EXPECT_TRUE(contains(seen[1].reason, "pan=************0004")) << seen[1].reason;
    expect_nowhere(seen, store, card);
}

TEST_F(Logging, APolicyHookThatThrowsWithholdsTheTextAndTheMalformedMessageIsNotParkedRaw) {
    idem::PolicyOptions policy_options;
    policy_options.redact_payload = [](std::string_view) -> std::string {
        throw std::runtime_error("hook down");
    };
    idem::LoggingObserver logs(sink());
    auto h = idem::make_handler(
        store, idem::Policy{"capture", policy_options},
        [](auto&, const std::string& body) { throw idem::malformed_message("bad " + body); },
        &logs);
    const std::string card = "4111111111111111";
    // The payload's redaction throws too: the dead letter is not stored (failed, redelivered).
    EXPECT_EQ(h.handle(Delivery{"m-1", 1u}, card).disposition, Disposition::failed);
    EXPECT_TRUE(store.dead_letters().empty());
    ASSERT_EQ(seen.size(), 1u);
    expect_nowhere(seen, store, card);
}

// ---- the gateway key at debug ----

TEST_F(Logging, TheGatewayKeyIsLoggedAtDebugOnly) {
    idem::LoggingOptions options;
    options.min_level = LogLevel::debug;
    idem::LoggingObserver logs(sink(), options);
    EXPECT_TRUE(logs.wants_gateway_key());
    int keys_built = 0;
    auto key_of = [&keys_built](const std::string& order) {
        ++keys_built;
        return idem::key("capture", order);
    };
    bool fail = false;
    auto h = idem::make_handler(store, idem::Policy{"capture"},
                                idem::with_gateway_key(key_of,
                                                       [&](auto& tx, const std::string& order) {
                                                           if (fail)
                                                               throw std::runtime_error("502");
                                                           tx.put("captures", key_of(order), "ok");
                                                       }),
                                &logs);
    (void)h.handle(Delivery{"m-1", 1u}, std::string("8814"));
    (void)h.handle(Delivery{"m-1", 2u}, std::string("8814"));  // duplicate
    fail = true;
    (void)h.handle(Delivery{"m-2", 1u}, std::string("8815"));  // failed: error level
    ASSERT_EQ(seen.size(), 3u);
    for (std::size_t i = 0; i < 2; ++i) {
        EXPECT_EQ(seen[i].gateway_key, "capture-8814");
        EXPECT_TRUE(contains(seen[i].message, " message_id=m-1 gateway_key=capture-8814 "))
            << seen[i].message;
    }
    EXPECT_TRUE(seen[2].gateway_key.empty());
    EXPECT_FALSE(contains(seen[2].message, "gateway_key")) << seen[2].message;
    EXPECT_FALSE(contains(seen[2].message, "8815")) << seen[2].message;
    // The effect ran for m-1 (processed) and m-2: its duration is in the record.
    EXPECT_TRUE(seen[0].effect_duration.has_value());
    EXPECT_FALSE(seen[1].effect_duration.has_value());  // a duplicate runs nothing
    EXPECT_TRUE(contains(seen[0].message, " effect_ms=")) << seen[0].message;
    EXPECT_EQ(keys_built, 1 + 3);  // the effect's own call, and one per outcome for the log
}

TEST_F(Logging, NoDebugRecordsNoKeyIsBuilt) {
    idem::LoggingObserver logs(sink());  // min_level info
    EXPECT_FALSE(logs.wants_gateway_key());
    int keys_built = 0;
    auto h = idem::make_handler(
        store, idem::Policy{"capture"},
        idem::with_gateway_key(
            [&keys_built](const std::string& order) {
                ++keys_built;
                return idem::key("capture", order);
            },
            [](auto& tx, const std::string& order) { tx.put("captures", order, "ok"); }),
        &logs);
    (void)h.handle(Delivery{"m-1", 1u}, std::string("8814"));
    EXPECT_EQ(keys_built, 0);
    EXPECT_TRUE(seen.empty());
}

TEST_F(Logging, AKeyFunctionThatThrowsLeavesTheKeyEmptyAndTheOutcomeAsItIs) {
    idem::LoggingOptions options;
    options.min_level = LogLevel::debug;
    idem::LoggingObserver logs(sink(), options);
    auto h = idem::make_handler(
        store, idem::Policy{"capture"},
        idem::with_gateway_key([](const std::string& order) { return idem::key("capture", order); },
                               [](auto& tx, const std::string&) { tx.put("captures", "x", "1"); }),
        &logs);
    // idem::key refuses an empty part: the key function throws.
    EXPECT_EQ(h.handle(Delivery{"m-1", 1u}, std::string()).disposition, Disposition::processed);
    ASSERT_EQ(seen.size(), 1u);
    EXPECT_TRUE(seen[0].gateway_key.empty());
    EXPECT_FALSE(contains(seen[0].message, "gateway_key")) << seen[0].message;
}

// ---- FanOutObserver ----

struct ThrowingObserver final : idem::Observer {
    int calls = 0;
    void on_outcome(std::string_view, const Delivery&, const idem::Outcome&) override {
        ++calls;
        throw std::runtime_error("observer down");
    }
};

TEST_F(Logging, FanOutFeedsPrometheusAndLoggingFromOneHandler) {
    idem::PrometheusObserver metrics;
    idem::LoggingOptions options;
    options.min_level = LogLevel::debug;
    idem::LoggingObserver logs(sink(), options);
    ThrowingObserver broken;
    idem::FanOutObserver both{&broken, &metrics, &logs};
    EXPECT_EQ(both.observers().size(), 3u);
    EXPECT_TRUE(both.wants_gateway_key());  // the logger's debug records want it
    auto h = idem::make_handler(
        store, idem::Policy{"capture"},
        idem::with_gateway_key([](const std::string& order) { return idem::key("capture", order); },
                               [&](auto& tx, const std::string& order) {
                                   if (order == "bad") throw std::runtime_error("502");
                                   tx.put("captures", order, "ok");
                               }),
        &both);
    EXPECT_EQ(h.handle(Delivery{"m-1", 1u}, std::string("8814")).disposition,
              Disposition::processed);
    EXPECT_EQ(h.handle(Delivery{"m-1", 2u}, std::string("8814")).disposition,
              Disposition::duplicate);
    EXPECT_EQ(h.handle(Delivery{"m-2", 1u}, std::string("bad")).disposition, Disposition::failed);

    EXPECT_EQ(broken.calls, 3);  // it threw each time; the others still got every outcome
    EXPECT_EQ(metrics.deliveries("capture", Disposition::processed), 1u);
    EXPECT_EQ(metrics.deliveries("capture", Disposition::duplicate), 1u);
    EXPECT_EQ(metrics.failed("capture", FailureCause::effect_threw), 1u);
    const auto effect = metrics.bucket_counts("capture", idem::PrometheusHistogram::effect);
    EXPECT_EQ(std::accumulate(effect.begin(), effect.end(), std::uint64_t{0}), 2u);
    ASSERT_EQ(seen.size(), 3u);
    EXPECT_EQ(seen[0].gateway_key, "capture-8814");
    EXPECT_TRUE(seen[0].duration.has_value());
    EXPECT_EQ(seen[2].cause, FailureCause::effect_threw);

    idem::FanOutObserver quiet{&metrics};
    EXPECT_FALSE(quiet.wants_gateway_key());
    EXPECT_THROW((idem::FanOutObserver{&metrics, nullptr}), idem::usage_error);
}

}  // namespace
