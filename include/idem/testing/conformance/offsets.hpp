#pragma once
/// @file
/// @brief The conformance tests of stored offsets (idem/contract/stored_offset.hpp), for a store
/// that has them (idem::has_stored_offsets); on any other store, that it refuses the hook.
/// Part of idem/testing/conformance.hpp, which registers the suite; include that one.

#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/contract/commit_hook.hpp"
#include "idem/contract/stored_offset.hpp"
#include "idem/testing/conformance/suite.hpp"

namespace idem {
namespace testing {
namespace conformance {

/// A commit hook asking to store (group, topic, partition) → next_offset.
inline CommitHook offset_hook(std::string group, std::string topic, std::int32_t partition,
                              std::int64_t next_offset) {
    return CommitHook{StoredOffset{std::move(group), std::move(topic), partition, next_offset}};
}

/// offset_hook() stamped with its message, as the handler stamps it.
inline CommitHook offset_hook_of(std::string scope, std::string message_id, std::string group,
                                 std::string topic, std::int32_t partition,
                                 std::int64_t next_offset) {
    CommitHook hook = offset_hook(std::move(group), std::move(topic), partition, next_offset);
    hook.scope = std::move(scope);
    hook.message_id = std::move(message_id);
    return hook;
}

/// A store without stored offsets neither accepts nor attaches a StoredOffset hook, and leaves
/// it not done.
template <class Store>
void expect_offset_hook_refused(Store& store) {
    CommitHook hook = offset_hook("group", "topic", 0, 1);
    EXPECT_FALSE(accepts_commit_hook(store, hook));
    {
        auto tx = store.begin();
        EXPECT_FALSE(attach_commit_hook(tx, hook));
    }  // rolled back: nothing was written
    EXPECT_FALSE(hook.acked_in_commit);
}

/// begin(), attach(hook) for each, commit(): what a broker does after a duplicate or a dead
/// letter.
template <class Store>
void commit_hooks_only(Store& store, std::vector<CommitHook*> hooks) {
    auto tx = store.begin();
    for (CommitHook* hook : hooks)
        EXPECT_TRUE(tx.attach(*hook));
    tx.commit();
}

}  // namespace conformance
}  // namespace testing
}  // namespace idem

/// On a store without stored offsets each case checks the store says so instead: it neither
/// accepts nor attaches a StoredOffset hook, and the hook is never marked done, so a broker that
/// keeps its offsets in the store refuses it rather than losing positions.
#define IDEM_CONFORMANCE_NEEDS_STORED_OFFSETS()                                \
    if constexpr (!TestFixture::has_stored_offsets) {                          \
        idem::testing::conformance::expect_offset_hook_refused(this->store()); \
    } else

TYPED_TEST_P(IdemStoreConformance, StoredOffsetIsNulloptUntilACommitStoresOne) {
    IDEM_CONFORMANCE_NEEDS_STORED_OFFSETS() {
        using idem::testing::conformance::offset_hook;
        EXPECT_FALSE(this->store().stored_offset("group", "topic", 0).has_value());
        idem::CommitHook hook = offset_hook("group", "topic", 0, 1);
        EXPECT_TRUE(idem::accepts_commit_hook(this->store(), hook));
        idem::CommitHook foreign{std::string("another broker's request")};
        EXPECT_FALSE(idem::accepts_commit_hook(this->store(), foreign));
        auto tx = this->store().begin();
        EXPECT_FALSE(tx.attach(foreign));
        EXPECT_TRUE(tx.attach(hook));
        tx.commit();
        EXPECT_TRUE(hook.acked_in_commit);
        EXPECT_FALSE(foreign.acked_in_commit);
        EXPECT_EQ(this->store().stored_offset("group", "topic", 0), std::optional<std::int64_t>(1));
    }
}

TYPED_TEST_P(IdemStoreConformance, StoredOffsetCommitsWithTheClaimAndTheEffect) {
    IDEM_CONFORMANCE_NEEDS_STORED_OFFSETS() {
        using idem::testing::conformance::offset_hook;
        // Through the handler: handle(delivery, body, hook).
        auto handler = this->writer("offsets");
        idem::CommitHook hook = offset_hook("group", "orders", 3, 43);
        const idem::Outcome outcome =
            handler.handle(idem::Delivery{"o-42", 1u}, std::string("o-42"), hook);
        EXPECT_EQ(outcome.disposition, idem::Disposition::processed) << outcome.reason;
        EXPECT_TRUE(hook.acked_in_commit);
        EXPECT_EQ(hook.scope, "offsets");
        EXPECT_EQ(hook.message_id, "o-42");
        EXPECT_EQ(this->store().stored_offset("group", "orders", 3),
                  std::optional<std::int64_t>(43));
        EXPECT_TRUE(this->store().find_claim("offsets", "o-42").has_value());
        EXPECT_TRUE(this->env.has_effect("o-42"));

        // By hand: claim, effect, outcome and offset in one commit.
        idem::CommitHook next =
            idem::testing::conformance::offset_hook_of("offsets", "o-43", "group", "orders", 3, 44);
        {
            auto tx = this->store().begin();
            ASSERT_TRUE(tx.attach(next));
            ASSERT_EQ(tx.claim("offsets", "o-43").status, idem::ClaimStatus::claimed);
            TypeParam::write_effect(tx, "o-43");
            tx.record_outcome("offsets", "o-43", idem::Disposition::processed, "");
            tx.commit();
        }
        EXPECT_TRUE(next.acked_in_commit);
        EXPECT_EQ(this->store().stored_offset("group", "orders", 3),
                  std::optional<std::int64_t>(44));

        // A redelivery is a duplicate: that commit stores nothing, the broker's own
        // hooks-only transaction moves the offset.
        idem::CommitHook again = offset_hook("group", "orders", 3, 43);
        EXPECT_EQ(
            handler.handle(idem::Delivery{"o-42", 2u}, std::string("o-42"), again).disposition,
            idem::Disposition::duplicate);
        EXPECT_FALSE(again.acked_in_commit);
        EXPECT_EQ(this->store().stored_offset("group", "orders", 3),
                  std::optional<std::int64_t>(44));
    }
}

TYPED_TEST_P(IdemStoreConformance, StoredOffsetOfARolledBackTransactionIsNotWritten) {
    IDEM_CONFORMANCE_NEEDS_STORED_OFFSETS() {
        using idem::testing::conformance::offset_hook;
        idem::CommitHook dropped =
            idem::testing::conformance::offset_hook_of("offsets", "o-1", "group", "topic", 0, 10);
        {
            auto tx = this->store().begin();
            ASSERT_TRUE(tx.attach(dropped));
            ASSERT_EQ(tx.claim("offsets", "o-1").status, idem::ClaimStatus::claimed);
            tx.record_outcome("offsets", "o-1", idem::Disposition::processed, "");
        }  // never committed
        EXPECT_FALSE(dropped.acked_in_commit);
        EXPECT_FALSE(this->store().stored_offset("group", "topic", 0).has_value());
        {
            idem::CommitHook hook = offset_hook("group", "topic", 0, 11);
            auto tx = this->store().begin();
            ASSERT_TRUE(tx.attach(hook));
            tx.rollback();
            EXPECT_FALSE(hook.acked_in_commit);
        }
        EXPECT_FALSE(this->store().stored_offset("group", "topic", 0).has_value());

        // A throwing effect: failed, nothing stored.
        auto handler = this->make(idem::Policy{"offsets"}, [](auto& tx, const std::string& body) {
            TypeParam::write_effect(tx, body);
            throw std::runtime_error("gateway down");
        });
        idem::CommitHook failed = offset_hook("group", "topic", 0, 12);
        EXPECT_EQ(handler.handle(idem::Delivery{"o-2", 1u}, std::string("o-2"), failed).disposition,
                  idem::Disposition::failed);
        EXPECT_FALSE(failed.acked_in_commit);
        EXPECT_FALSE(this->store().stored_offset("group", "topic", 0).has_value());

        if constexpr (TestFixture::can_fail_commit) {
            idem::CommitHook refused = offset_hook("group", "topic", 0, 13);
            auto tx = this->store().begin();
            ASSERT_TRUE(tx.attach(refused));
            this->env.make_commit_fail(tx);
            EXPECT_THROW(tx.commit(), idem::commit_failed);
            EXPECT_FALSE(refused.acked_in_commit);
            EXPECT_FALSE(this->store().stored_offset("group", "topic", 0).has_value());
        }
    }
}

TYPED_TEST_P(IdemStoreConformance, StoredOffsetNeverMovesBack) {
    IDEM_CONFORMANCE_NEEDS_STORED_OFFSETS() {
        using idem::testing::conformance::commit_hooks_only;
        using idem::testing::conformance::offset_hook;
        idem::CommitHook five = offset_hook("group", "topic", 1, 5);
        commit_hooks_only(this->store(), {&five});
        EXPECT_TRUE(five.acked_in_commit);
        // A zombie member of the group commits an older position: kept at 5.
        idem::CommitHook three = offset_hook("group", "topic", 1, 3);
        commit_hooks_only(this->store(), {&three});
        EXPECT_TRUE(three.acked_in_commit);  // done: the stored position is past it
        EXPECT_EQ(this->store().stored_offset("group", "topic", 1), std::optional<std::int64_t>(5));
        // Several hooks of one partition in one commit: the greatest, in any order.
        idem::CommitHook nine = offset_hook("group", "topic", 1, 9);
        idem::CommitHook seven = offset_hook("group", "topic", 1, 7);
        commit_hooks_only(this->store(), {&nine, &seven});
        EXPECT_EQ(this->store().stored_offset("group", "topic", 1), std::optional<std::int64_t>(9));
        idem::CommitHook large =
            offset_hook("group", "topic", 1, std::numeric_limits<std::int64_t>::max() - 1);
        commit_hooks_only(this->store(), {&large});
        EXPECT_EQ(this->store().stored_offset("group", "topic", 1),
                  std::optional<std::int64_t>(std::numeric_limits<std::int64_t>::max() - 1));
    }
}

TYPED_TEST_P(IdemStoreConformance, DeadLetteredMessagesOffsetWaitsForTheBroker) {
    IDEM_CONFORMANCE_NEEDS_STORED_OFFSETS() {
        using idem::testing::conformance::commit_hooks_only;
        using idem::testing::conformance::offset_hook;
        idem::PolicyOptions park_at_once;
        park_at_once.max_deliveries = 1;
        auto poison = this->writer("offsets", park_at_once);
        idem::CommitHook hook = offset_hook("group", "topic", 0, 8);
        const idem::Outcome parked =
            poison.handle(idem::Delivery{"poison", 9u}, std::string("p"), hook);
        ASSERT_EQ(parked.disposition, idem::Disposition::dead_lettered) << parked.reason;
        EXPECT_FALSE(hook.acked_in_commit);  // the broker sends its dead-letter copy first
        EXPECT_FALSE(this->store().stored_offset("group", "topic", 0).has_value());
        EXPECT_EQ(this->store().dead_letters().size(), 1u);
        // A malformed delivery (no id) is parked without a claim: the same.
        idem::CommitHook malformed = offset_hook("group", "topic", 0, 9);
        EXPECT_EQ(poison.handle(idem::Delivery{"", 1u}, std::string("x"), malformed).disposition,
                  idem::Disposition::dead_lettered);
        EXPECT_FALSE(malformed.acked_in_commit);
        EXPECT_FALSE(this->store().stored_offset("group", "topic", 0).has_value());
        // Then the broker moves the position past them, in a transaction of the hook alone.
        commit_hooks_only(this->store(), {&hook, &malformed});
        EXPECT_TRUE(hook.acked_in_commit);
        EXPECT_TRUE(malformed.acked_in_commit);
        EXPECT_EQ(this->store().stored_offset("group", "topic", 0), std::optional<std::int64_t>(9));
        // By hand: a dead letter of the hook's message keeps it out; another message's does not.
        using idem::testing::conformance::offset_hook_of;
        idem::CommitHook mine = offset_hook_of("offsets", "m", "group", "topic", 1, 4);
        idem::CommitHook other = offset_hook_of("offsets", "n", "group", "topic", 2, 4);
        {
            auto tx = this->store().begin();
            ASSERT_TRUE(tx.attach(mine));
            ASSERT_TRUE(tx.attach(other));
            idem::DeadLetter letter;
            letter.scope = "offsets";
            letter.message_id = "m";
            letter.delivery_count = 1;
            letter.reason = "parked by hand";
            tx.dead_letter(letter);
            tx.commit();
        }
        EXPECT_FALSE(mine.acked_in_commit);
        EXPECT_TRUE(other.acked_in_commit);
        EXPECT_FALSE(this->store().stored_offset("group", "topic", 1).has_value());
        EXPECT_EQ(this->store().stored_offset("group", "topic", 2), std::optional<std::int64_t>(4));
    }
}

TYPED_TEST_P(IdemStoreConformance, StoredOffsetsOfABatchAreThoseOfItsCommittedMessages) {
    IDEM_CONFORMANCE_NEEDS_STORED_OFFSETS() {
        using idem::testing::conformance::offset_hook;
        auto handler = this->make(idem::Policy{"batch"}, [](auto& tx, const std::string& body) {
            if (body == "throws") throw std::runtime_error("boom");
            if (body == "defers") return idem::EffectResult::deferred("too early");
            if (body == "rejects") return idem::EffectResult::rejected("stale");
            TypeParam::write_effect(tx, body);
            return idem::EffectResult::applied();
        });
        ASSERT_EQ(handler.handle(idem::Delivery{"b-done", 1u}, std::string("done")).disposition,
                  idem::Disposition::processed);
        const std::vector<idem::Delivery> deliveries = {
            {"b-1", 1u}, {"b-throw", 1u}, {"b-defer", 1u}, {"b-reject", 1u},
            {"", 1u},    {"b-done", 2u},  {"b-2", 1u}};
        const std::vector<std::string> bodies = {"ok-1",  "throws", "defers", "rejects",
                                                 "no-id", "done",   "ok-2"};
        // One partition per message, so each hook's fate shows.
        std::vector<idem::CommitHook> hooks;
        for (std::int32_t p = 0; p < static_cast<std::int32_t>(deliveries.size()); ++p)
            hooks.push_back(offset_hook("group", "batch", p, 100 + p));
        const auto outcomes = handler.handle_batch(deliveries, bodies, hooks);
        const std::vector<idem::Disposition> expected = {
            idem::Disposition::processed,     idem::Disposition::failed,
            idem::Disposition::deferred,      idem::Disposition::rejected,
            idem::Disposition::dead_lettered, idem::Disposition::duplicate,
            idem::Disposition::processed};
        const std::vector<bool> stored = {true, false, false, true, false, false, true};
        for (std::size_t i = 0; i < deliveries.size(); ++i) {
            const auto p = static_cast<std::int32_t>(i);
            EXPECT_EQ(outcomes[i].disposition, expected[i]) << i << ": " << outcomes[i].reason;
            EXPECT_EQ(hooks[i].acked_in_commit, stored[i]) << i;
            EXPECT_EQ(this->store().stored_offset("group", "batch", p).has_value(), stored[i]) << i;
        }
        EXPECT_EQ(this->store().stored_offset("group", "batch", 6),
                  std::optional<std::int64_t>(106));
    }
}

TYPED_TEST_P(IdemStoreConformance, StoredOffsetsAreKeptPerGroupTopicAndPartition) {
    IDEM_CONFORMANCE_NEEDS_STORED_OFFSETS() {
        using idem::testing::conformance::commit_hooks_only;
        using idem::testing::conformance::offset_hook;
        const std::int32_t top = std::numeric_limits<std::int32_t>::max();
        idem::CommitHook a = offset_hook("g1", "t1", 0, 10);
        idem::CommitHook b = offset_hook("g2", "t1", 0, 20);
        idem::CommitHook c = offset_hook("g1", "t2", 0, 30);
        idem::CommitHook d = offset_hook("g1", "t1", 1, 40);
        idem::CommitHook e = offset_hook("g1", "t1", top, 50);
        // Length-prefixed keys: ("g1t", "1") is not ("g1", "t1").
        idem::CommitHook f = offset_hook("g1t", "1", 0, 60);
        commit_hooks_only(this->store(), {&a, &b, &c, &d, &e, &f});
        auto at = [&](const char* g, const char* t, std::int32_t p) {
            return this->store().stored_offset(g, t, p);
        };
        EXPECT_EQ(at("g1", "t1", 0), std::optional<std::int64_t>(10));
        EXPECT_EQ(at("g2", "t1", 0), std::optional<std::int64_t>(20));
        EXPECT_EQ(at("g1", "t2", 0), std::optional<std::int64_t>(30));
        EXPECT_EQ(at("g1", "t1", 1), std::optional<std::int64_t>(40));
        EXPECT_EQ(at("g1", "t1", top), std::optional<std::int64_t>(50));
        EXPECT_EQ(at("g1t", "1", 0), std::optional<std::int64_t>(60));
        EXPECT_FALSE(at("g2", "t2", 0).has_value());
        EXPECT_FALSE(at("g1", "t1", 2).has_value());
        // purge() leaves positions alone, however old.
        this->env.now += idem::days(400);
        this->store().purge(idem::days(1));
        EXPECT_EQ(at("g1", "t1", 0), std::optional<std::int64_t>(10));
    }
}

TYPED_TEST_P(IdemStoreConformance, StoredOffsetKeysAreBinarySafe) {
    IDEM_CONFORMANCE_NEEDS_STORED_OFFSETS() {
        using idem::testing::conformance::commit_hooks_only;
        using idem::testing::conformance::offset_hook;
        const std::string group("gr\0up'\"\\", 9);
        const std::string topic = std::string("t\0\xff\xfe", 4) + "%_ \xc3\x28" + "'; --";
        const std::string near(topic.data(), 2);  // a prefix, up to the NUL
        idem::CommitHook hook = offset_hook(group, topic, 7, 77);
        idem::CommitHook other = offset_hook(group, near, 7, 11);
        commit_hooks_only(this->store(), {&hook, &other});
        EXPECT_EQ(this->store().stored_offset(group, topic, 7), std::optional<std::int64_t>(77));
        EXPECT_EQ(this->store().stored_offset(group, near, 7), std::optional<std::int64_t>(11));
        EXPECT_FALSE(this->store().stored_offset(group.substr(0, 2), topic, 7).has_value());
    }
}

#undef IDEM_CONFORMANCE_NEEDS_STORED_OFFSETS
