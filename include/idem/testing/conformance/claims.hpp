#pragma once
/// @file
/// @brief The conformance tests of claims and outcomes: processed, duplicate, scope, the poison
/// limit, failures, rejected and deferred outcomes, malformed deliveries, hostile ids.
/// Part of idem/testing/conformance.hpp, which registers the suite; include that one.

#include "idem/testing/conformance/suite.hpp"

TYPED_TEST_P(IdemStoreConformance, NewIdIsProcessedAndAcked) {
    auto handler = this->writer();
    auto outcome = handler.handle(idem::Delivery{"m-1", 1u}, std::string("row-1"));
    EXPECT_EQ(outcome.disposition, idem::Disposition::processed) << outcome.reason;
    EXPECT_TRUE(idem::should_ack(outcome));
    EXPECT_EQ(this->env.effect_rows(), 1u);
    auto claim = this->store().find_claim("conformance", "m-1");
    ASSERT_TRUE(claim.has_value());
    EXPECT_EQ(claim->disposition, idem::Disposition::processed);
    EXPECT_EQ(claim->claimed_at, this->env.now);
}

TYPED_TEST_P(IdemStoreConformance, RedeliveryIsDuplicateAndEffectRunsOnce) {
    auto handler = this->writer();
    EXPECT_EQ(handler.handle(idem::Delivery{"m-1", 1u}, std::string("row")).disposition,
              idem::Disposition::processed);
    for (std::uint32_t count = 2; count <= 4; ++count) {
        auto outcome = handler.handle(idem::Delivery{"m-1", count}, std::string("row"));
        EXPECT_EQ(outcome.disposition, idem::Disposition::duplicate);
        EXPECT_TRUE(idem::should_ack(outcome));
        EXPECT_NE(outcome.reason.find("processed"), std::string::npos) << outcome.reason;
    }
    EXPECT_EQ(this->env.effect_rows(), 1u);
}

TYPED_TEST_P(IdemStoreConformance, ClaimsAreScopedPerHandler) {
    auto capture = this->writer("capture");
    auto notify = this->writer("notify");
    EXPECT_EQ(capture.handle(idem::Delivery{"m-1", 1u}, std::string("a")).disposition,
              idem::Disposition::processed);
    EXPECT_EQ(notify.handle(idem::Delivery{"m-1", 1u}, std::string("b")).disposition,
              idem::Disposition::processed);
    EXPECT_EQ(this->env.effect_rows(), 2u);
}

TYPED_TEST_P(IdemStoreConformance, PoisonLimitDeadLettersWithoutRunningTheEffect) {
    // Four attempts fail; the fifth delivery reaches max_deliveries (5) and is parked without
    // running. SQL stores count the broker's deliveries, lease stores the attempts they saw
    // start: both reach 5 here.
    int runs = 0;
    auto handler = this->make(idem::Policy{"conformance"}, [&](auto& tx, const std::string& body) {
        ++runs;
        TypeParam::write_effect(tx, body);
        throw std::runtime_error("gateway 503");
    });
    for (std::uint32_t count = 1; count <= 4; ++count) {
        EXPECT_EQ(handler.handle(idem::Delivery{"m-poison", count}, std::string("payload-bytes"))
                      .disposition,
                  idem::Disposition::failed);
    }
    auto outcome = handler.handle(idem::Delivery{"m-poison", 5u}, std::string("payload-bytes"));
    EXPECT_EQ(outcome.disposition, idem::Disposition::dead_lettered);
    EXPECT_TRUE(idem::should_ack(outcome));
    EXPECT_NE(outcome.reason.find("max_deliveries"), std::string::npos) << outcome.reason;
    EXPECT_EQ(runs, 4);
    EXPECT_EQ(this->env.effect_rows(), 0u);
    auto letters = this->store().dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_EQ(letters[0].message_id, "m-poison");
    EXPECT_EQ(letters[0].scope, "conformance");
    EXPECT_EQ(letters[0].delivery_count, 5u);
    EXPECT_EQ(letters[0].payload, "payload-bytes");
    EXPECT_EQ(letters[0].reason, outcome.reason);
    auto claim = this->store().find_claim("conformance", "m-poison");
    ASSERT_TRUE(claim.has_value());
    EXPECT_EQ(claim->disposition, idem::Disposition::dead_lettered);
    // Parked for good: a further redelivery is a duplicate, not a second dead letter.
    EXPECT_EQ(handler.handle(idem::Delivery{"m-poison", 6u}, std::string("x")).disposition,
              idem::Disposition::duplicate);
    EXPECT_EQ(this->store().dead_letters().size(), 1u);
    EXPECT_EQ(runs, 4);
}

TYPED_TEST_P(IdemStoreConformance, BelowThePoisonLimitTheEffectRuns) {
    auto handler = this->writer();
    EXPECT_EQ(handler.handle(idem::Delivery{"m-4", 4u}, std::string("r")).disposition,
              idem::Disposition::processed);
}

TYPED_TEST_P(IdemStoreConformance, DuplicateDetectionComesBeforeThePoisonCheck) {
    auto handler = this->writer();
    EXPECT_EQ(handler.handle(idem::Delivery{"m-acked-late", 1u}, std::string("r")).disposition,
              idem::Disposition::processed);
    // Its acks kept failing: the broker's count climbed past the limit.
    auto outcome = handler.handle(idem::Delivery{"m-acked-late", 7u}, std::string("r"));
    EXPECT_EQ(outcome.disposition, idem::Disposition::duplicate);
    EXPECT_TRUE(this->store().dead_letters().empty());
}

TYPED_TEST_P(IdemStoreConformance, ThrowingEffectLeavesNothingAndIsNotAcked) {
    int calls = 0;
    auto handler = this->make(idem::Policy{"conformance"}, [&](auto& tx, const std::string& body) {
        TypeParam::write_effect(tx, body);
        if (++calls == 1) throw std::runtime_error("gateway 503");
    });
    auto outcome = handler.handle(idem::Delivery{"m-1", 1u}, std::string("row"));
    EXPECT_EQ(outcome.disposition, idem::Disposition::failed);
    EXPECT_FALSE(idem::should_ack(outcome));
    EXPECT_NE(outcome.reason.find("gateway 503"), std::string::npos);
    EXPECT_EQ(this->env.effect_rows(), 0u);
    EXPECT_FALSE(this->store().find_claim("conformance", "m-1").has_value());
    // The redelivery does the work once.
    EXPECT_EQ(handler.handle(idem::Delivery{"m-1", 2u}, std::string("row")).disposition,
              idem::Disposition::processed);
    EXPECT_EQ(this->env.effect_rows(), 1u);
}

TYPED_TEST_P(IdemStoreConformance, FailedCommitLeavesNothingAndIsNotAcked) {
    if constexpr (!TestFixture::can_fail_commit) {
        GTEST_SKIP() << "the environment cannot make a commit fail (no make_commit_fail(tx))";
    } else {
        bool sabotage = true;
        auto handler =
            this->make(idem::Policy{"conformance"}, [&](auto& tx, const std::string& body) {
                TypeParam::write_effect(tx, body);
                if (sabotage) this->env.make_commit_fail(tx);
            });
        auto outcome = handler.handle(idem::Delivery{"m-1", 1u}, std::string("row"));
        EXPECT_EQ(outcome.disposition, idem::Disposition::failed);
        EXPECT_NE(outcome.reason.find("commit failed"), std::string::npos) << outcome.reason;
        EXPECT_EQ(this->env.effect_rows(), 0u);
        EXPECT_FALSE(this->store().find_claim("conformance", "m-1").has_value());
        sabotage = false;
        EXPECT_EQ(handler.handle(idem::Delivery{"m-1", 2u}, std::string("row")).disposition,
                  idem::Disposition::processed);
        EXPECT_EQ(this->env.effect_rows(), 1u);
    }
}

TYPED_TEST_P(IdemStoreConformance, RejectedKeepsTheClaimButNotTheEffectsWrites) {
    auto handler = this->make(idem::Policy{"conformance"}, [](auto& tx, const std::string& body) {
        TypeParam::write_effect(tx, body);
        return idem::EffectResult::rejected("stale event");
    });
    auto outcome = handler.handle(idem::Delivery{"m-1", 1u}, std::string("row"));
    EXPECT_EQ(outcome.disposition, idem::Disposition::rejected);
    EXPECT_TRUE(idem::should_ack(outcome));
    EXPECT_EQ(outcome.reason, "stale event");
    EXPECT_EQ(this->env.effect_rows(), 0u);
    auto claim = this->store().find_claim("conformance", "m-1");
    ASSERT_TRUE(claim.has_value());
    EXPECT_EQ(claim->disposition, idem::Disposition::rejected);
    EXPECT_EQ(claim->reason, "stale event");
    auto again = handler.handle(idem::Delivery{"m-1", 2u}, std::string("row"));
    EXPECT_EQ(again.disposition, idem::Disposition::duplicate);
    EXPECT_NE(again.reason.find("rejected"), std::string::npos) << again.reason;
}

TYPED_TEST_P(IdemStoreConformance, DeferredStoresNothingAndIsNotAcked) {
    bool early = true;
    auto handler = this->make(idem::Policy{"conformance"}, [&](auto& tx, const std::string& body) {
        TypeParam::write_effect(tx, body);
        return early ? idem::EffectResult::deferred("too early") : idem::EffectResult::applied();
    });
    auto outcome = handler.handle(idem::Delivery{"m-1", 1u}, std::string("row"));
    EXPECT_EQ(outcome.disposition, idem::Disposition::deferred);
    EXPECT_FALSE(idem::should_ack(outcome));
    EXPECT_EQ(this->env.effect_rows(), 0u);
    EXPECT_FALSE(this->store().find_claim("conformance", "m-1").has_value());
    early = false;
    EXPECT_EQ(handler.handle(idem::Delivery{"m-1", 2u}, std::string("row")).disposition,
              idem::Disposition::processed);
    EXPECT_EQ(this->env.effect_rows(), 1u);
}

TYPED_TEST_P(IdemStoreConformance, MalformedMessageIsDeadLetteredWithItsPayload) {
    auto handler = this->make(idem::Policy{"conformance"}, [](auto& tx, const std::string& body) {
        TypeParam::write_effect(tx, body);
        throw idem::malformed_message("amount is not a number");
    });
    auto outcome = handler.handle(idem::Delivery{"m-bad", 1u}, std::string("{\"amount\":\"ten\"}"));
    EXPECT_EQ(outcome.disposition, idem::Disposition::dead_lettered);
    EXPECT_NE(outcome.reason.find("amount is not a number"), std::string::npos);
    EXPECT_EQ(this->env.effect_rows(), 0u);
    auto letters = this->store().dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_EQ(letters[0].payload, "{\"amount\":\"ten\"}");
}

TYPED_TEST_P(IdemStoreConformance, MalformedDeliveriesAreDeadLetteredNeverCrash) {
    auto handler = this->writer();
    const std::string long_id(513, 'x');
    struct Case {
        idem::Delivery delivery;
        const char* reason_part;
    };
    std::vector<Case> cases = {{idem::Delivery{"", 1u}, "empty message id"},
                               {idem::Delivery{long_id, 1u}, "513 bytes"},
                               {idem::Delivery{"m-zero", 0u}, "delivery count 0"}};
    for (const auto& c : cases) {
        auto outcome = handler.handle(c.delivery, std::string("body-of-") + c.reason_part);
        EXPECT_EQ(outcome.disposition, idem::Disposition::dead_lettered) << c.reason_part;
        EXPECT_TRUE(idem::should_ack(outcome));
        EXPECT_NE(outcome.reason.find(c.reason_part), std::string::npos) << outcome.reason;
    }
    EXPECT_EQ(this->env.effect_rows(), 0u);
    auto letters = this->store().dead_letters();
    ASSERT_EQ(letters.size(), cases.size());
    for (std::size_t i = 0; i < cases.size(); ++i) {
        EXPECT_EQ(letters[i].message_id, cases[i].delivery.message_id);  // nothing lost
        EXPECT_EQ(letters[i].payload, std::string("body-of-") + cases[i].reason_part);
    }
    // The longest legal id is fine.
    EXPECT_EQ(
        handler.handle(idem::Delivery{std::string(512, 'y'), 1u}, std::string("r")).disposition,
        idem::Disposition::processed);
}

// A usable id with count 0 is parked WITH its claim: a later delivery of the id is a duplicate,
// so one message never ends with a dead letter and an effect.
TYPED_TEST_P(IdemStoreConformance, ZeroCountIsParkedWithItsClaimSoOneIdHasOneOutcome) {
    auto handler = this->writer();
    const auto zero = handler.handle(idem::Delivery{"m-zero", 0u}, std::string("body"));
    EXPECT_EQ(zero.disposition, idem::Disposition::dead_lettered);
    EXPECT_NE(zero.reason.find("delivery count 0"), std::string::npos) << zero.reason;
    const auto later = handler.handle(idem::Delivery{"m-zero", 1u}, std::string("body"));
    EXPECT_EQ(later.disposition, idem::Disposition::duplicate) << later.reason;
    EXPECT_EQ(later.recorded, std::optional<idem::Disposition>(idem::Disposition::dead_lettered));
    EXPECT_EQ(this->env.effect_rows(), 0u);
    EXPECT_EQ(this->store().dead_letters().size(), 1u);
}

TYPED_TEST_P(IdemStoreConformance, HostileIdsRoundTripExactly) {
    auto handler = this->writer();
    const std::vector<std::string> ids = {
        "'); DROP TABLE idem_claims; --", std::string("nul\0inside", 10), std::string("\0", 1),
        "quote\"double\"and'single'",     "\xff\xfe invalid utf-8 \xc3",  "{hash}tag with spaces",
        std::string(512, '\''),
    };
    for (const auto& id : ids) {
        auto outcome = handler.handle(idem::Delivery{id, 1u}, id);
        EXPECT_EQ(outcome.disposition, idem::Disposition::processed) << outcome.reason;
    }
    for (const auto& id : ids) {
        EXPECT_EQ(handler.handle(idem::Delivery{id, 2u}, id).disposition,
                  idem::Disposition::duplicate);
        auto claim = this->store().find_claim("conformance", id);
        ASSERT_TRUE(claim.has_value());
        EXPECT_EQ(claim->message_id, id);
        EXPECT_TRUE(this->env.has_effect(id));
    }
    // "nul" and "nul\0inside" are different ids.
    EXPECT_FALSE(this->store().find_claim("conformance", "nul").has_value());
    EXPECT_EQ(this->env.effect_rows(), ids.size());
}
