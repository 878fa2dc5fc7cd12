#pragma once
/// @file
/// @brief The conformance tests of payloads and time: fingerprints and reused ids, redaction,
/// the gateway key's lifetime, reconcile, and the overlap lock.
/// Part of idem/testing/conformance.hpp, which registers the suite; include that one.

#include "idem/testing/conformance/suite.hpp"

TYPED_TEST_P(IdemStoreConformance, ReusedIdWithAnotherPayloadIsDeadLetteredNotAcked) {
    int runs = 0;
    auto handler = this->make(idem::Policy{"orders"},
                              idem::with_fingerprint(
                                  [](const idem::testing::conformance::Order& o) {
                                      return o.id + "|" + std::to_string(o.amount);
                                  },
                                  [&](auto& tx, const idem::testing::conformance::Order& o) {
                                      ++runs;
                                      TypeParam::write_effect(tx, o.id);
                                  }));
    EXPECT_EQ(handler
                  .handle(idem::Delivery{"m-1", 1u},
                          idem::testing::conformance::Order{"o-1", 100, "10:00"})
                  .disposition,
              idem::Disposition::processed);
    // A redelivery: same stable part (the send time differs, it is not fingerprinted).
    EXPECT_EQ(handler
                  .handle(idem::Delivery{"m-1", 2u},
                          idem::testing::conformance::Order{"o-1", 100, "10:05"})
                  .disposition,
              idem::Disposition::duplicate);
    // The producer reused the id for another order.
    auto reused = handler.handle(idem::Delivery{"m-1", 1u},
                                 idem::testing::conformance::Order{"o-2", 999, "11:00"});
    EXPECT_EQ(reused.disposition, idem::Disposition::dead_lettered);
    EXPECT_TRUE(idem::should_ack(reused));
    EXPECT_NE(reused.reason.find("id reused with a different payload"), std::string::npos);
    // A local effect runs before the claim is checked (its writes then dropped): the duplicate's
    // and the reused id's runs left nothing.
    EXPECT_EQ(runs, TestFixture::effect_runs_before_claim ? 3 : 1);
    EXPECT_EQ(this->env.effect_rows(), 1u);
    auto letters = this->store().dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_EQ(letters[0].payload, "o-2:999");  // the reused message is kept, not lost
    auto claim = this->store().find_claim("orders", "m-1");
    ASSERT_TRUE(claim.has_value());
    EXPECT_EQ(claim->disposition, idem::Disposition::processed);
    EXPECT_EQ(claim->fingerprint.size(), 64u);  // SHA-256 hex of the stable part
}

// Found by model checking: a claim that takes over a released record must store ITS payload's
// fingerprint. Otherwise A (payload P1) fails, B (same id, payload P2) takes the record over and
// commits under fp(P1); A's redelivery then matches fp(P1) and is acked as a duplicate (P1 never
// runs, no dead letter) while B's redelivery is dead-lettered though B's payload ran.
TYPED_TEST_P(IdemStoreConformance, TakeoverOfAReleasedClaimStoresTheNewPayloadsFingerprint) {
    std::vector<long> ran;
    bool fail_next = true;
    auto handler = this->make(idem::Policy{"orders"},
                              idem::with_fingerprint(
                                  [](const idem::testing::conformance::Order& o) {
                                      return o.id + "|" + std::to_string(o.amount);
                                  },
                                  [&](auto& tx, const idem::testing::conformance::Order& o) {
                                      if (std::exchange(fail_next, false))
                                          throw std::runtime_error("gateway down");
                                      ran.push_back(o.amount);
                                      TypeParam::write_effect(tx, o.id);
                                  }));
    const idem::testing::conformance::Order p1{"o-1", 100, ""};
    const idem::testing::conformance::Order p2{"o-2", 200, ""};
    // A claims m-1 with P1 and fails: the claim is released (or rolled back), not completed.
    EXPECT_EQ(handler.handle(idem::Delivery{"m-1", 1u}, p1).disposition, idem::Disposition::failed);
    // B: the same id with another payload takes the record over and commits.
    EXPECT_EQ(handler.handle(idem::Delivery{"m-1", 1u}, p2).disposition,
              idem::Disposition::processed);
    auto claim = this->store().find_claim("orders", "m-1");
    ASSERT_TRUE(claim.has_value());
    EXPECT_EQ(claim->fingerprint, idem::detail::sha256_hex(std::string_view("o-2|200")));
    // B's redelivery: its own payload ran, a duplicate.
    EXPECT_EQ(handler.handle(idem::Delivery{"m-1", 2u}, p2).disposition,
              idem::Disposition::duplicate);
    // A's redelivery: P1 never ran, so it is the reused id, dead-lettered with its payload.
    auto again = handler.handle(idem::Delivery{"m-1", 2u}, p1);
    EXPECT_EQ(again.disposition, idem::Disposition::dead_lettered) << again.reason;
    EXPECT_NE(again.reason.find("id reused with a different payload"), std::string::npos)
        << again.reason;
    if constexpr (TestFixture::effect_runs_before_claim) {
        // Ran before their claims were checked (B's redelivery, A's): their writes were dropped.
        EXPECT_EQ(ran, (std::vector<long>{200, 200, 100}));
    } else {
        EXPECT_EQ(ran, std::vector<long>{200});
    }
    EXPECT_TRUE(this->env.has_effect("o-2"));
    EXPECT_FALSE(this->env.has_effect("o-1"));
    EXPECT_EQ(this->env.effect_rows(), 1u);
    auto letters = this->store().dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_EQ(letters[0].payload, "o-1:100");
}

// PolicyOptions::redact_payload runs before the store sees a dead letter, alone and in a batch,
// and a redactor that throws leaves nothing behind on any store.
TYPED_TEST_P(IdemStoreConformance, DeadLetterPayloadIsRedactedBeforeTheStoreKeepsIt) {
    idem::PolicyOptions options;
    options.redact_payload = idem::mask_card_numbers;
    // malformed_message rather than the delivery count: a lease store counts attempts itself.
    auto unusable = [](auto&, const std::string&) { throw idem::malformed_message("bad card"); };
    auto handler = this->make(idem::Policy{"orders", options}, unusable);
    EXPECT_EQ(
        handler.handle(idem::Delivery{"m-1", 1u}, std::string("pan=4111111111111111")).disposition,
        idem::Disposition::dead_lettered);
    const std::vector<std::string> bodies{"pan=5500005555555559", "pan=4222222222222"};
    for (const auto& outcome :
         handler.handle_batch(std::vector<idem::Delivery>{{"m-2", 1u}, {"", 1u}}, bodies)) {
        EXPECT_EQ(outcome.disposition, idem::Disposition::dead_lettered) << outcome.reason;
    }
    auto letters = this->store().dead_letters();
    ASSERT_EQ(letters.size(), 3u);
    EXPECT_EQ(letters[0].payload, "pan=************1111");
    EXPECT_EQ(letters[1].payload, "pan=************5559");
    EXPECT_EQ(letters[2].payload, "pan=*********2222");

    options.redact_payload = [](std::string_view) -> std::string {
        throw std::runtime_error("redactor down");
    };
    auto broken = this->make(idem::Policy{"orders", options}, unusable);
    auto failed = broken.handle(idem::Delivery{"m-3", 1u}, std::string("pan=4111111111111111"));
    EXPECT_EQ(failed.disposition, idem::Disposition::failed);
    EXPECT_NE(failed.reason.find("redact_payload threw: redactor down"), std::string::npos)
        << failed.reason;
    EXPECT_FALSE(this->store().find_claim("orders", "m-3").has_value());
    EXPECT_EQ(this->store().dead_letters().size(), 3u);
}

TYPED_TEST_P(IdemStoreConformance, ClaimWithoutFingerprintCannotBeComparedSoItIsADuplicate) {
    auto plain =
        this->make(idem::Policy{"orders"}, [](auto&, const idem::testing::conformance::Order&) {});
    auto fingerprinted = this->make(
        idem::Policy{"orders"},
        idem::with_fingerprint([](const idem::testing::conformance::Order& o) { return o.id; },
                               [](auto&, const idem::testing::conformance::Order&) {}));
    EXPECT_EQ(
        plain.handle(idem::Delivery{"m-1", 1u}, idem::testing::conformance::Order{"o-1", 1, ""})
            .disposition,
        idem::Disposition::processed);
    EXPECT_EQ(
        fingerprinted
            .handle(idem::Delivery{"m-1", 2u}, idem::testing::conformance::Order{"o-2", 1, ""})
            .disposition,
        idem::Disposition::duplicate);
}

TYPED_TEST_P(IdemStoreConformance, MessageOlderThanTheGatewayKeyLifetimeIsNotSentBlindly) {
    int gateway_calls = 0;
    auto handler = this->make(idem::testing::conformance::with_key_lifetime(std::chrono::hours(24)),
                              [&](auto& tx, const std::string& body) {
                                  ++gateway_calls;
                                  TypeParam::write_effect(tx, body);
                              });
    handler.set_clock([this] { return this->env.now; });
    const auto now = this->env.now;
    auto old =
        handler.handle(idem::Delivery{"m-old", 2u, now - std::chrono::hours(25)}, std::string("a"));
    EXPECT_EQ(old.disposition, idem::Disposition::dead_lettered);
    EXPECT_TRUE(idem::should_ack(old));
    EXPECT_NE(old.reason.find("idempotency-key lifetime"), std::string::npos) << old.reason;
    EXPECT_EQ(gateway_calls, 0);
    EXPECT_EQ(this->env.effect_rows(), 0u);
    ASSERT_EQ(this->store().dead_letters().size(), 1u);
    EXPECT_EQ(this->store().dead_letters()[0].payload, "a");

    auto young = handler.handle(idem::Delivery{"m-young", 1u, now - std::chrono::hours(23)},
                                std::string("b"));
    EXPECT_EQ(young.disposition, idem::Disposition::processed);
    auto unknown_age = handler.handle(idem::Delivery{"m-no-time", 1u}, std::string("c"));
    EXPECT_EQ(unknown_age.disposition,
              idem::Disposition::processed);  // no enqueue time: cannot age it
    // A processed message stays a duplicate however old its redelivery.
    this->env.now += std::chrono::hours(48);
    handler.set_clock([this] { return this->env.now; });
    EXPECT_EQ(
        handler
            .handle(idem::Delivery{"m-young", 2u, now - std::chrono::hours(23)}, std::string("b"))
            .disposition,
        idem::Disposition::duplicate);
    EXPECT_EQ(gateway_calls, 2);
}

TYPED_TEST_P(IdemStoreConformance, ReconcileCallbackTakesMessagesOlderThanTheKeyLifetime) {
    int gateway_calls = 0, reconciled = 0;
    auto handler = this->make(
        idem::testing::conformance::with_key_lifetime(std::chrono::hours(24)),
        idem::reconcile_expired(
            [&](auto&, const std::string&) { ++gateway_calls; },
            [&](auto& tx, const std::string& body) {
                ++reconciled;  // e.g. look the charge up by order id and record what it says
                TypeParam::write_effect(tx, "reconciled-" + body);
            }));
    handler.set_clock([this] { return this->env.now; });
    auto outcome = handler.handle(idem::Delivery{"m-old", 3u, this->env.now - idem::days(3)},
                                  std::string("a"));
    EXPECT_EQ(outcome.disposition, idem::Disposition::processed) << outcome.reason;
    EXPECT_EQ(reconciled, 1);
    EXPECT_EQ(gateway_calls, 0);
    EXPECT_TRUE(this->env.has_effect("reconciled-a"));
    EXPECT_TRUE(this->store().dead_letters().empty());
}

TYPED_TEST_P(IdemStoreConformance, OverlapLockDefersWhileAnotherJobHoldsTheEntity) {
    if constexpr (!TestFixture::has_overlap_lock) {
        GTEST_SKIP()
            << "the store has no overlap lock (Tx::try_lock, Store::hold_lock/release_lock)";
    } else {
        int runs = 0;
        auto refund = this->make(idem::Policy{"refund"},
                                 idem::without_overlapping(
                                     [](const idem::testing::conformance::Order& o) {
                                         return idem::key("invoice", o.id);
                                     },
                                     idem::OverlapOptions{},
                                     [&](auto& tx, const idem::testing::conformance::Order& o) {
                                         ++runs;
                                         TypeParam::write_effect(tx, o.id);
                                     }));
        ASSERT_TRUE(
            this->store().hold_lock("invoice-42", "nightly-batch", std::chrono::minutes(10)));
        EXPECT_FALSE(this->store().hold_lock("invoice-42", "other-job", std::chrono::minutes(10)));

        auto blocked = refund.handle(idem::Delivery{"m-1", 1u},
                                     idem::testing::conformance::Order{"42", 5, ""});
        EXPECT_EQ(blocked.disposition, idem::Disposition::deferred);
        EXPECT_FALSE(idem::should_ack(blocked));
        ASSERT_TRUE(blocked.retry_after.has_value());
        EXPECT_EQ(*blocked.retry_after, std::chrono::seconds(15));
        EXPECT_NE(blocked.reason.find("invoice-42"), std::string::npos) << blocked.reason;
        EXPECT_EQ(runs, 0);
        EXPECT_FALSE(this->store().find_claim("refund", "m-1").has_value());
        // Another invoice is not blocked.
        EXPECT_EQ(
            refund.handle(idem::Delivery{"m-2", 1u}, idem::testing::conformance::Order{"43", 5, ""})
                .disposition,
            idem::Disposition::processed);

        EXPECT_FALSE(this->store().release_lock("invoice-42", "other-job"));
        EXPECT_TRUE(this->store().release_lock("invoice-42", "nightly-batch"));
        EXPECT_EQ(
            refund.handle(idem::Delivery{"m-1", 2u}, idem::testing::conformance::Order{"42", 5, ""})
                .disposition,
            idem::Disposition::processed);
        EXPECT_EQ(runs, 2);
    }
}

TYPED_TEST_P(IdemStoreConformance, OverlapLockExpiresWhenItsHolderDies) {
    if constexpr (!TestFixture::has_overlap_lock) {
        GTEST_SKIP()
            << "the store has no overlap lock (Tx::try_lock, Store::hold_lock/release_lock)";
    } else {
        auto job = this->make(idem::Policy{"capture"},
                              idem::without_overlapping(
                                  [](const idem::testing::conformance::Order& o) { return o.id; },
                                  idem::OverlapOptions{},
                                  [](auto& tx, const idem::testing::conformance::Order& o) {
                                      TypeParam::write_effect(tx, o.id);
                                  }));
        ASSERT_TRUE(this->store().hold_lock("42", "crashed-worker", std::chrono::minutes(3)));
        EXPECT_EQ(
            job.handle(idem::Delivery{"m-1", 1u}, idem::testing::conformance::Order{"42", 1, ""})
                .disposition,
            idem::Disposition::deferred);
        this->env.now += std::chrono::minutes(3) + std::chrono::milliseconds(1);
        EXPECT_EQ(
            job.handle(idem::Delivery{"m-1", 2u}, idem::testing::conformance::Order{"42", 1, ""})
                .disposition,
            idem::Disposition::processed);
        // The expired lock can be taken by a new owner.
        EXPECT_TRUE(this->store().hold_lock("42", "new-owner", std::chrono::minutes(3)));
    }
}

TYPED_TEST_P(IdemStoreConformance, OverlapLockCanDropTheBlockedCopy) {
    if constexpr (!TestFixture::has_overlap_lock) {
        GTEST_SKIP()
            << "the store has no overlap lock (Tx::try_lock, Store::hold_lock/release_lock)";
    } else {
        idem::OverlapOptions drop;
        drop.on_contention = idem::OnContention::drop;
        auto job =
            this->make(idem::Policy{"reindex"},
                       idem::without_overlapping(
                           [](const idem::testing::conformance::Order& o) { return o.id; }, drop,
                           [](auto& tx, const idem::testing::conformance::Order& o) {
                               TypeParam::write_effect(tx, o.id);
                           }));
        ASSERT_TRUE(this->store().hold_lock("7", "first-copy", std::chrono::minutes(1)));
        auto dropped =
            job.handle(idem::Delivery{"m-1", 1u}, idem::testing::conformance::Order{"7", 1, ""});
        EXPECT_EQ(dropped.disposition, idem::Disposition::rejected);
        EXPECT_TRUE(idem::should_ack(dropped));
        EXPECT_NE(dropped.reason.find("dropped"), std::string::npos);
        EXPECT_EQ(this->env.effect_rows(), 0u);
    }
}
