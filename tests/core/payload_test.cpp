// What dead letters keep of a body (payload.hpp): the redaction hook on every dead-letter path,
// alone and in a batch, for text and typed bodies, on the memory store and on SQLite (read back
// from its idem_dead_letters table); a throwing redactor; keep_no_payload; mask_card_numbers.

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "idem/idem.hpp"
#include "idem/store/memory.hpp"
#include "support/backends.hpp"
#if IDEM_HAS_SQLITE
#include "idem/store/sqlite.hpp"
#include "idem/testing/temp_dir.hpp"
#endif

namespace {

using idem::Delivery;
using idem::Disposition;
using idem::Outcome;

const std::string pan = "4111111111111111";
const std::string masked = "************1111";

struct Capture {
    std::string order;
    std::string card;
};
std::string idem_payload(const Capture& c) {
    return c.order + "|" + c.card;
}

// A typed body with no idem_payload: only usable with keep_no_payload.
struct Tick {
    int n;
};

// ---- the two body kinds -----------------------------------------------------------------------
struct TextBody {
    using Body = std::string;
    static Body make(const std::string& order) { return "order=" + order + " card=" + pan; }
    static std::string kept(const std::string& order) {
        return "order=" + order + " card=" + masked;
    }
    static std::string stable(const Body& b) { return b; }
};
struct TypedBody {
    using Body = Capture;
    static Body make(const std::string& order) { return Capture{order, pan}; }
    static std::string kept(const std::string& order) { return order + "|" + masked; }
    static std::string stable(const Body& b) { return idem_payload(b); }
};

// ---- the two stores, each read back its own way -----------------------------------------------
struct MemoryEnv {
    idem::MemoryStore store;
    std::vector<std::string> payloads() {
        std::vector<std::string> out;
        for (const auto& letter : store.dead_letters())
            out.push_back(letter.payload);
        return out;
    }
};
#if IDEM_HAS_SQLITE
struct SqliteEnv {
    idem::testing::TempDir dir;
    idem::SqliteStore store{dir.file("idem.db")};
    // Straight from the table, not through the store's dead_letters(): what is on disk.
    std::vector<std::string> payloads() {
        std::vector<std::string> out;
        const std::int64_t n = store.query_int("SELECT count(*) FROM idem_dead_letters").value();
        for (std::int64_t i = 0; i < n; ++i) {
            out.push_back(store
                              .query_text("SELECT payload FROM idem_dead_letters ORDER BY id "
                                          "LIMIT 1 OFFSET ?",
                                          i)
                              .value_or("<null>"));
        }
        return out;
    }
};
#endif  // IDEM_HAS_SQLITE

template <class E, class B>
struct Param {
    using Env = E;
    using Kind = B;
};

enum class Path { poison, malformed_delivery, malformed_message, fingerprint, key_lifetime };
constexpr Path all_paths[] = {Path::poison, Path::malformed_delivery, Path::malformed_message,
                              Path::fingerprint, Path::key_lifetime};
const char* name(Path p) {
    switch (p) {
        case Path::poison:
            return "poison";
        case Path::malformed_delivery:
            return "malformed delivery";
        case Path::malformed_message:
            return "malformed_message thrown";
        case Path::fingerprint:
            return "fingerprint mismatch";
        case Path::key_lifetime:
            return "gateway key lifetime";
    }
    return "?";
}

const auto now = std::chrono::system_clock::time_point(std::chrono::hours(500000));

idem::PolicyOptions options_for(Path path) {
    idem::PolicyOptions options;
    if (path == Path::key_lifetime) options.gateway_key_lifetime = std::chrono::hours(1);
    return options;
}

std::string redactor_down(std::string_view) {
    throw std::runtime_error("redactor down");
}

template <class Handler, class Body>
std::vector<Outcome> handle_all(Handler& handler, const std::vector<Delivery>& deliveries,
                                const std::vector<Body>& bodies, bool batch) {
    if (batch) return handler.handle_batch(deliveries, bodies);
    std::vector<Outcome> out;
    for (std::size_t i = 0; i < deliveries.size(); ++i)
        out.push_back(handler.handle(deliveries[i], bodies[i]));
    return out;
}

/// Sends two messages (orders 8814 and 8815) down one dead-letter path, alone or as a batch.
template <class Kind, class Store>
std::vector<Outcome> run_path(Store& store, Path path, idem::PolicyOptions options, bool batch,
                              int& effect_runs) {
    using Body = typename Kind::Body;
    const std::vector<Body> bodies{Kind::make("8814"), Kind::make("8815")};
    idem::Policy policy{"capture", options};
    auto plain = [&](auto& tx, const Body& b) {
        ++effect_runs;
        if (path == Path::malformed_message) throw idem::malformed_message("no such card");
        (void)tx;
        (void)b;
    };
    if (path == Path::fingerprint) {
        auto handler = idem::make_handler(
            store, policy,
            idem::with_fingerprint([](const Body& b) { return Kind::stable(b); }, plain));
        // The first messages under these ids (no dead letter, so the redactor is not involved).
        const std::vector<Body> first{Kind::make("1"), Kind::make("2")};
        for (const auto& outcome :
             handle_all(handler, {Delivery{"m-1", 1u}, Delivery{"m-2", 1u}}, first, batch)) {
            EXPECT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
        }
        effect_runs = 0;
        return handle_all(handler, {Delivery{"m-1", 1u}, Delivery{"m-2", 1u}}, bodies, batch);
    }
    auto handler = idem::make_handler(store, policy, plain);
    handler.set_clock([] { return now; });
    std::vector<Delivery> deliveries;
    switch (path) {
        case Path::poison:
            deliveries = {Delivery{"m-1", 5u}, Delivery{"m-2", 7u}};
            break;
        case Path::malformed_delivery:
            deliveries = {Delivery{"", 1u}, Delivery{"m-2", 0u}};
            break;
        case Path::key_lifetime:
            deliveries = {Delivery{"m-1", 1u, now - std::chrono::hours(2)},
                          Delivery{"m-2", 2u, now - std::chrono::hours(3)}};
            break;
        default:
            deliveries = {Delivery{"m-1", 1u}, Delivery{"m-2", 1u}};
            break;
    }
    return handle_all(handler, deliveries, bodies, batch);
}

template <class P>
class DeadLetterPayload : public ::testing::Test {};
using Params = ::testing::Types<Param<MemoryEnv, TextBody>, Param<MemoryEnv, TypedBody>
#if IDEM_HAS_SQLITE
                                ,
                                Param<SqliteEnv, TextBody>, Param<SqliteEnv, TypedBody>
#endif
                                >;
// Named, and with the names argument given: clang's -Wpedantic refuses an empty variadic
// argument in C++17.
struct ParamNames {
    template <class P>
    static std::string GetName(int index) {
        return std::to_string(index);
    }
};
TYPED_TEST_SUITE(DeadLetterPayload, Params, ParamNames);

TYPED_TEST(DeadLetterPayload, EveryPathStoresTheRedactedPayloadAloneAndInABatch) {
    using Kind = typename TypeParam::Kind;
    for (Path path : all_paths) {
        for (bool batch : {false, true}) {
            SCOPED_TRACE(std::string(name(path)) + (batch ? ", batch" : ", alone"));
            typename TypeParam::Env env;
            idem::PolicyOptions options = options_for(path);
            options.redact_payload = idem::mask_card_numbers;
            int runs = 0;
            const auto outcomes = run_path<Kind>(env.store, path, options, batch, runs);
            ASSERT_EQ(outcomes.size(), 2u);
            for (const auto& outcome : outcomes) {
                EXPECT_EQ(outcome.disposition, Disposition::dead_lettered) << outcome.reason;
            }
            const std::vector<std::string> expected{Kind::kept("8814"), Kind::kept("8815")};
            EXPECT_EQ(env.payloads(), expected);
            if (path != Path::malformed_message) {
                EXPECT_EQ(runs, 0);
            }
        }
    }
}

TYPED_TEST(DeadLetterPayload, WithoutARedactorTheBytesAreKeptAsTheyAre) {
    using Kind = typename TypeParam::Kind;
    for (Path path : all_paths) {
        for (bool batch : {false, true}) {
            SCOPED_TRACE(std::string(name(path)) + (batch ? ", batch" : ", alone"));
            typename TypeParam::Env env;
            int runs = 0;
            const auto outcomes = run_path<Kind>(env.store, path, options_for(path), batch, runs);
            for (const auto& outcome : outcomes) {
                EXPECT_EQ(outcome.disposition, Disposition::dead_lettered) << outcome.reason;
            }
            const std::vector<std::string> expected{Kind::stable(Kind::make("8814")),
                                                    Kind::stable(Kind::make("8815"))};
            EXPECT_EQ(env.payloads(), expected);
        }
    }
}

TYPED_TEST(DeadLetterPayload, AThrowingRedactorFailsTheDeliveryAndStoresNothing) {
    using Kind = typename TypeParam::Kind;
    for (Path path : all_paths) {
        for (bool batch : {false, true}) {
            SCOPED_TRACE(std::string(name(path)) + (batch ? ", batch" : ", alone"));
            typename TypeParam::Env env;
            idem::PolicyOptions options = options_for(path);
            options.redact_payload = redactor_down;
            int runs = 0;
            const auto outcomes = run_path<Kind>(env.store, path, options, batch, runs);
            ASSERT_EQ(outcomes.size(), 2u);
            for (const auto& outcome : outcomes) {
                EXPECT_EQ(outcome.disposition, Disposition::failed) << outcome.reason;
                EXPECT_FALSE(idem::should_ack(outcome));
                EXPECT_NE(outcome.reason.find("redact_payload threw: redactor down"),
                          std::string::npos)
                    << outcome.reason;
                EXPECT_EQ(outcome.reason.find("effect threw"), std::string::npos) << outcome.reason;
            }
            EXPECT_TRUE(env.payloads().empty());
            EXPECT_TRUE(env.store.dead_letters().empty());
            for (const char* id : {"m-1", "m-2"}) {
                const auto claim = env.store.find_claim("capture", id);
                if (path == Path::fingerprint) {  // the first message's claim, untouched
                    ASSERT_TRUE(claim.has_value());
                    EXPECT_EQ(claim->disposition, Disposition::processed);
                } else {
                    EXPECT_FALSE(claim.has_value()) << id << ": " << claim->reason;
                }
            }
        }
    }
}

TEST(DeadLetterPayload, AThrowingRedactorInABatchFailsOnlyWhatWouldHaveCommitted) {
    idem::MemoryStore store;
    idem::PolicyOptions options;
    options.redact_payload = redactor_down;
    auto handler =
        idem::make_handler(store, idem::Policy{"capture", options},
                           [](auto& tx, const Capture& c) { tx.put("captures", c.order, "done"); });
    const auto outcomes =
        handler.handle_batch({Delivery{"m-1", 1u}, Delivery{"m-2", 5u}},
                             std::vector<Capture>{Capture{"1", pan}, Capture{"2", pan}});
    // One transaction: the poison message's dead letter cannot be stored, so nothing commits.
    EXPECT_EQ(outcomes[0].disposition, Disposition::failed) << outcomes[0].reason;
    EXPECT_EQ(outcomes[1].disposition, Disposition::failed) << outcomes[1].reason;
    EXPECT_FALSE(store.find_claim("capture", "m-1").has_value());
    EXPECT_TRUE(store.dead_letters().empty());
}

TEST(DeadLetterPayload, NonStandardExceptionFromTheRedactorIsFailedToo) {
    idem::MemoryStore store;
    idem::PolicyOptions options;
    options.redact_payload = [](std::string_view) -> std::string { throw 42; };
    auto handler = idem::make_handler(store, idem::Policy{"capture", options},
                                      [](auto&, const std::string&) {});
    // Before any claim (park_malformed_delivery), where only std::exception is caught.
    const auto outcome = handler.handle(Delivery{"", 1u}, std::string("x"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_NE(outcome.reason.find("redact_payload threw a non-standard exception"),
              std::string::npos)
        << outcome.reason;
    EXPECT_TRUE(store.dead_letters().empty());
}

TEST(KeepNoPayload, TypedBodyWithoutPayloadKeepsReasonAndIdButNoBytes) {
    idem::MemoryStore store;
    int redactions = 0;
    idem::PolicyOptions options;
    options.redact_payload = [&](std::string_view p) {
        ++redactions;
        return std::string(p);
    };
    auto handler = idem::make_handler(store, idem::Policy{"tick", options},
                                      idem::keep_no_payload([](auto&, const Tick&) {}));
    const auto outcome = handler.handle(Delivery{"t-1", 5u}, Tick{3});
    EXPECT_EQ(outcome.disposition, Disposition::dead_lettered);
    ASSERT_EQ(store.dead_letters().size(), 1u);
    EXPECT_EQ(store.dead_letters()[0].message_id, "t-1");
    EXPECT_EQ(store.dead_letters()[0].reason, outcome.reason);
    EXPECT_EQ(store.dead_letters()[0].payload, "");
    EXPECT_EQ(redactions, 0);  // nothing kept, nothing to redact
}

TEST(KeepNoPayload, TextBodyIsNotKeptEither) {
    idem::MemoryStore store;
    auto handler = idem::make_handler(store, idem::Policy{"capture"},
                                      idem::keep_no_payload([](auto&, const std::string&) {
                                          throw idem::malformed_message("bad");
                                      }));
    EXPECT_EQ(handler.handle(Delivery{"m-1", 1u}, "card=" + pan).disposition,
              Disposition::dead_lettered);
    ASSERT_EQ(store.dead_letters().size(), 1u);
    EXPECT_EQ(store.dead_letters()[0].payload, "");
}

TEST(KeepNoPayload, ComposesWithTheOtherWrappersEitherWayRound) {
    idem::MemoryStore store;
    auto fp = [](const Tick& t) { return std::to_string(t.n); };
    int runs = 0;
    // Outside with_fingerprint: the handler still finds the fingerprint through inner().
    auto outer = idem::make_handler(
        store, idem::Policy{"outer"},
        idem::keep_no_payload(idem::with_fingerprint(fp, [&](auto&, const Tick&) { ++runs; })));
    EXPECT_EQ(outer.handle(Delivery{"t-1", 1u}, Tick{1}).disposition, Disposition::processed);
    EXPECT_EQ(outer.handle(Delivery{"t-1", 2u}, Tick{2}).disposition, Disposition::dead_lettered);
    // Inside with_fingerprint, and an effect that takes the delivery.
    auto inner = idem::make_handler(
        store, idem::Policy{"inner"},
        idem::with_fingerprint(fp,
                               idem::keep_no_payload([&](auto&, const Tick&, const Delivery& d) {
                                   EXPECT_EQ(d.message_id, "t-1");
                                   ++runs;
                               })));
    EXPECT_EQ(inner.handle(Delivery{"t-1", 1u}, Tick{1}).disposition, Disposition::processed);
    EXPECT_EQ(inner.handle(Delivery{"t-1", 2u}, Tick{2}).disposition, Disposition::dead_lettered);
    EXPECT_EQ(runs, 2);
    ASSERT_EQ(store.dead_letters().size(), 2u);
    EXPECT_EQ(store.dead_letters()[0].payload, "");
    EXPECT_EQ(store.dead_letters()[1].payload, "");
}

TEST(KeepNoPayload, EffectResultPassesThrough) {
    idem::MemoryStore store;
    auto handler = idem::make_handler(store, idem::Policy{"tick"},
                                      idem::keep_no_payload([](auto&, const Tick&) {
                                          return idem::EffectResult::rejected("stale");
                                      }));
    const auto outcome = handler.handle(Delivery{"t-1", 1u}, Tick{1});
    EXPECT_EQ(outcome.disposition, Disposition::rejected);
    EXPECT_EQ(outcome.reason, "stale");
}

TEST(MaskCardNumbers, KeepsTheLastFourOfEveryThirteenToNineteenDigitRun) {
    EXPECT_EQ(idem::mask_card_numbers("card=4111111111111111;"), "card=************1111;");
    EXPECT_EQ(idem::mask_card_numbers("4111 1111 1111 1111"), "**** **** **** 1111");
    EXPECT_EQ(idem::mask_card_numbers("4111-1111-1111-1111"), "****-****-****-1111");
    EXPECT_EQ(idem::mask_card_numbers("{\"pan\":\"4222222222222\"}"),
              "{\"pan\":\"*********2222\"}");  // 13 digits
    EXPECT_EQ(idem::mask_card_numbers("6011000990139424123"),
              "***************4123");  // 19 digits
    EXPECT_EQ(idem::mask_card_numbers("a 4111111111111111 b 5500005555555559"),
              "a ************1111 b ************5559");
}

TEST(MaskCardNumbers, LeavesOtherNumbersAlone) {
    EXPECT_EQ(idem::mask_card_numbers(""), "");
    EXPECT_EQ(idem::mask_card_numbers("order 8814 amount 1250"), "order 8814 amount 1250");
    EXPECT_EQ(idem::mask_card_numbers("411111111111"), "411111111111");                  // 12
    EXPECT_EQ(idem::mask_card_numbers("41111111111111111111"), "41111111111111111111");  // 20
    EXPECT_EQ(idem::mask_card_numbers("2024-01-15 10:30"), "2024-01-15 10:30");
    EXPECT_EQ(idem::mask_card_numbers("4111  1111 1111 1111"), "4111  1111 1111 1111");  // 2 gaps
    EXPECT_EQ(idem::mask_card_numbers("trailing-"), "trailing-");
}

TEST(PolicyRedact, IsTheHookOrTheBytesUnchanged) {
    EXPECT_EQ(idem::Policy{"capture"}.redact("card=" + pan), "card=" + pan);
    idem::PolicyOptions options;
    options.redact_payload = idem::mask_card_numbers;
    EXPECT_EQ(idem::Policy("capture", options).redact("card=" + pan), "card=" + masked);
    options.redact_payload = redactor_down;
    try {
        (void)idem::Policy("capture", options).redact("x");
        FAIL() << "expected redaction_failed";
    } catch (const idem::redaction_failed& e) {
        EXPECT_NE(std::string(e.what()).find("\"capture\""), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("redactor down"), std::string::npos) << e.what();
    }
}

}  // namespace
