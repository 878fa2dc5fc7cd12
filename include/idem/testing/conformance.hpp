#pragma once
/// @file
/// @brief The store conformance suite, installed: the typed GoogleTest suite every idem store
/// passes, for a store of your own to run the same tests. Needs GoogleTest (link GTest::gtest
/// or GTest::gtest_main); idem itself links it nowhere else.
///
/// You write one environment type per store and instantiate the suite with it:
/// @code
/// #include <idem/testing/conformance.hpp>
///
/// struct MyEnv {
///     using Store = MyStore;                       // what is tested
///     static constexpr const char* name = "mine";  // the test names' suffix
///     std::chrono::system_clock::time_point now = idem::testing::conformance_epoch();
///     std::unique_ptr<Store> store;                // fresh for each test, on a clock reading
///     `now` MyEnv() : store(std::make_unique<Store>(/* ..., */ [this] { return now; })) {}
///     template <class Tx>
///     static void write_effect(Tx& tx, const std::string& key);  // one row, in tx
///     std::size_t effect_rows();                    // committed rows written by write_effect
///     bool has_effect(const std::string& key);     // a committed row with this key
/// };
/// INSTANTIATE_TYPED_TEST_SUITE_P(Mine, IdemStoreConformance, ::testing::Types<MyEnv>,
///                                idem::testing::ConformanceNames);
/// @endcode
///
/// The environment (one is constructed per test, so each test gets a fresh store):
///   Store                      the store type; it must fit idem::check_store<Store>(), and
///                              offer find_claim(), dead_letters() and purge() (contract/store.hpp)
///   name                       `static constexpr const char* name`: the instantiation's suffix
///   now                        the time the store's clock reads; tests move it
///   store                      pointer-like (`*env.store` is the Store), built in the
///                              constructor on a clock reading `now`
///   write_effect(tx, key)      static: the effect's write through the claim's transaction
///   effect_rows(), has_effect(key)  what committed, read outside any transaction
/// Optional, detected:
///   make_commit_fail(tx)       makes this transaction's commit really fail (a deferred
///                              constraint, a quota, an injected fault); without it the two
///                              commit-failure tests are skipped
///   static bool available(std::string* why)  false when the store's server is missing: the
///                              tests are skipped with `why`, and fail instead under CI=true
///   static constexpr bool local_effects = true  every effect is declared idem::local_effect
/// Store capabilities the suite looks for (idem/contract/store.hpp): with Tx::try_lock and
/// Store::hold_lock / release_lock the overlap-lock tests run, else they are skipped.

#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/contract/store.hpp"
#include "idem/delivery.hpp"
#include "idem/detail/sha256.hpp"
#include "idem/effects/fingerprint.hpp"
#include "idem/effects/local.hpp"
#include "idem/effects/overlap.hpp"
#include "idem/effects/reconcile.hpp"
#include "idem/error.hpp"
#include "idem/handler.hpp"
#include "idem/key.hpp"
#include "idem/outcome.hpp"
#include "idem/policy.hpp"
#include "idem/testing/process.hpp"  // running_in_ci()

namespace idem {
namespace testing {

/// @brief A fixed instant (50 years after the epoch, millisecond-aligned) for `Env::now`.
inline std::chrono::system_clock::time_point conformance_epoch() {
    return std::chrono::system_clock::time_point{} + std::chrono::hours(24 * 365 * 50);
}

/// @brief The instantiation's test-name generator: each environment's `name`.
struct ConformanceNames {
    template <class Env>
    static std::string GetName(int) {
        return Env::name;
    }
};

namespace conformance {

template <class Env, class = void>
struct local_effects : std::false_type {};
template <class Env>
struct local_effects<Env, std::void_t<decltype(Env::local_effects)>>
    : std::bool_constant<Env::local_effects> {};

template <class Env, class = void>
struct has_availability : std::false_type {};
template <class Env>
struct has_availability<
    Env, std::void_t<decltype(bool{Env::available(static_cast<std::string*>(nullptr))})>>
    : std::true_type {};

template <class Env, class Tx, class = void>
struct can_fail_commit : std::false_type {};
template <class Env, class Tx>
struct can_fail_commit<
    Env, Tx, std::void_t<decltype(std::declval<Env&>().make_commit_fail(std::declval<Tx&>()))>>
    : std::true_type {};

template <class S, class = void>
struct has_held_locks : std::false_type {};
template <class S>
struct has_held_locks<
    S, std::void_t<decltype(bool{std::declval<S&>().hold_lock(
                       std::string_view{}, std::string_view{}, std::chrono::milliseconds{})}),
                   decltype(bool{std::declval<S&>().release_lock(
                       std::string_view{}, std::string_view{})})>> : std::true_type {};

/// A message with a stable part (id, amount) and a part each send changes (sent_at).
struct Order {
    std::string id;
    long amount = 0;
    std::string sent_at;  // set by the producer on each send: not part of the fingerprint
};
inline std::string idem_payload(const Order& o) {
    return o.id + ":" + std::to_string(o.amount);
}

inline idem::Policy with_key_lifetime(std::chrono::seconds lifetime) {
    idem::PolicyOptions options;
    options.gateway_key_lifetime = lifetime;
    return idem::Policy{"capture", options};
}

}  // namespace conformance

/// @brief The fixture of the suite (registered as IdemStoreConformance): one environment, its
/// store, and handlers on it.
template <class Env>
class StoreConformance : public ::testing::Test {
  protected:
    using Store = typename Env::Store;
    using Transaction = std::remove_reference_t<transaction_t<Store>>;
    static_assert(check_store<Store>(), "idem::testing::StoreConformance: Env::Store is no store");

    Env env;
    Store& store() { return *env.store; }

    void SetUp() override {
        // A real server or nothing: skipped outside CI, a failure in CI (CI=true).
        if constexpr (conformance::has_availability<Env>::value) {
            std::string why;
            if (!Env::available(&why)) {
                if (running_in_ci()) {
                    GTEST_FAIL() << Env::name << " is required in CI (CI=true): " << why;
                }
                GTEST_SKIP() << Env::name << " not available (set CI=true to make this a "
                             << "failure): " << why;
            }
        }
    }

    /// Whether every effect is declared local (idem::local_effect), to check that mode's
    /// contract too.
    static constexpr bool local_effects = conformance::local_effects<Env>::value;
    /// Whether the effect runs before the claim (local effects on a store that claims and
    /// commits in one step): a duplicate's effect then runs, and its writes are dropped.
    static constexpr bool effect_runs_before_claim = local_effects;
    static constexpr bool can_fail_commit = conformance::can_fail_commit<Env, Transaction>::value;
    static constexpr bool has_overlap_lock =
        has_try_lock<Transaction>::value && conformance::has_held_locks<Store>::value;

    /// A handler on this store.
    template <class Effect>
    auto make(idem::Policy policy, Effect&& effect) {
        if constexpr (local_effects) {
            return idem::make_handler(store(), std::move(policy),
                                      idem::local_effect(std::forward<Effect>(effect)));
        } else {
            return idem::make_handler(store(), std::move(policy), std::forward<Effect>(effect));
        }
    }

    /// A handler whose effect writes one row keyed by the body through the claim's transaction.
    auto writer(std::string scope = "conformance", idem::PolicyOptions options = {}) {
        return make(idem::Policy{std::move(scope), options},
                    [](auto& tx, const std::string& body) { Env::write_effect(tx, body); });
    }
};

}  // namespace testing
}  // namespace idem

/// The suite's registered name (a name at global scope: GoogleTest's *_P macros paste it).
template <class Env>
using IdemStoreConformance = ::idem::testing::StoreConformance<Env>;

TYPED_TEST_SUITE_P(IdemStoreConformance);

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

TYPED_TEST_P(IdemStoreConformance, TransactionRollsBackWhenDroppedAndSavepointsNest) {
    {
        auto tx = this->store().begin();
        EXPECT_EQ(tx.claim("s", "dropped").status, idem::ClaimStatus::claimed);
        TypeParam::write_effect(tx, "dropped");
    }  // destructor: rollback
    EXPECT_FALSE(this->store().find_claim("s", "dropped").has_value());
    EXPECT_EQ(this->env.effect_rows(), 0u);
    {
        auto tx = this->store().begin();
        EXPECT_EQ(tx.claim("s", "kept").status, idem::ClaimStatus::claimed);
        tx.savepoint();
        TypeParam::write_effect(tx, "undone");
        tx.rollback_to_savepoint();
        tx.savepoint();
        TypeParam::write_effect(tx, "kept");
        tx.release_savepoint();
        tx.record_outcome("s", "kept", idem::Disposition::processed, "");
        tx.commit();
    }
    EXPECT_TRUE(this->store().find_claim("s", "kept").has_value());
    EXPECT_TRUE(this->env.has_effect("kept"));
    EXPECT_FALSE(this->env.has_effect("undone"));
}

TYPED_TEST_P(IdemStoreConformance, ClaimInsideOneTransactionSeesItsOwnClaimAsDuplicate) {
    auto tx = this->store().begin();
    EXPECT_EQ(tx.claim("s", "id").status, idem::ClaimStatus::claimed);
    EXPECT_EQ(tx.claim("s", "id").status, idem::ClaimStatus::duplicate);
}

TYPED_TEST_P(IdemStoreConformance, PurgeRemovesOnlyClaimsOlderThanTheRetention) {
    auto handler = this->writer();
    idem::PolicyOptions park_at_once;  // the first attempt is already the limit, on any store
    park_at_once.max_deliveries = 1;
    auto poison = this->writer("conformance", park_at_once);
    ASSERT_EQ(handler.handle(idem::Delivery{"old", 1u}, std::string("a")).disposition,
              idem::Disposition::processed);
    ASSERT_EQ(poison.handle(idem::Delivery{"old-poison", 9u}, std::string("p")).disposition,
              idem::Disposition::dead_lettered);
    this->env.now += idem::days(10);
    ASSERT_EQ(handler.handle(idem::Delivery{"young", 1u}, std::string("b")).disposition,
              idem::Disposition::processed);
    this->env.now += idem::days(5);  // "old" is 15 days old, "young" 5 days

    const auto retention = handler.policy().retention();   // 14 days
    EXPECT_EQ(this->store().purge(retention).claims, 2u);  // "old" and "old-poison"
    EXPECT_FALSE(this->store().find_claim("conformance", "old").has_value());
    EXPECT_TRUE(this->store().find_claim("conformance", "young").has_value());
    EXPECT_EQ(this->store().dead_letters().size(), 1u);  // dead letters are for humans: kept
    EXPECT_EQ(this->store().purge(retention).claims, 0u);
    // Exactly at the boundary nothing goes: only strictly older claims are purged.
    this->env.now += idem::days(9);
    EXPECT_EQ(this->store().purge(retention).claims, 0u);
    this->env.now += std::chrono::milliseconds(1);
    EXPECT_EQ(this->store().purge(retention).claims, 1u);
}

TYPED_TEST_P(IdemStoreConformance, PurgeRemovesExpiredLocksButNotLiveOnes) {
    if constexpr (!TestFixture::has_overlap_lock) {
        GTEST_SKIP()
            << "the store has no overlap lock (Tx::try_lock, Store::hold_lock/release_lock)";
    } else {
        using std::chrono::milliseconds;
        auto& store = this->store();
        const auto t0 = this->env.now;
        ASSERT_TRUE(store.hold_lock("invoice-1", "batch", std::chrono::minutes(1)));
        const auto retention = idem::days(14);
        // At t0 + 1 min the lock's expires_at is now, not before it: kept.
        this->env.now = t0 + std::chrono::minutes(1);
        EXPECT_EQ(store.purge(retention).expired_locks, 0u);

        this->env.now = t0 + std::chrono::minutes(1) + milliseconds(1);
        ASSERT_TRUE(store.hold_lock("invoice-2", "live-job", idem::days(30)));
        auto expired = store.purge(retention);
        EXPECT_EQ(expired.claims, 0u);
        EXPECT_EQ(expired.expired_locks, 1u);  // "invoice-1", whatever the retention

        this->env.now = t0 + idem::days(15);
        EXPECT_EQ(store.purge(retention).expired_locks, 0u);
        // The live lock survived both purges: another owner is still refused.
        EXPECT_FALSE(store.hold_lock("invoice-2", "other-job", std::chrono::minutes(1)));
        EXPECT_TRUE(store.release_lock("invoice-2", "live-job"));
        // The purged lock's key is free.
        EXPECT_TRUE(store.hold_lock("invoice-1", "next-batch", std::chrono::minutes(1)));
    }
}

TYPED_TEST_P(IdemStoreConformance, ConcurrentThreadsApplyEachEffectOnce) {
    auto handler = this->writer();
    constexpr int kThreads = 4;
    constexpr int kIds = 100;
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&] {
            for (int i = 0; i < kIds; ++i) {
                auto id = "m-" + std::to_string(i);
                auto outcome = handler.handle(idem::Delivery{id, 1u}, id);
                // A lease store answers in_progress while another thread holds the lease; the
                // broker would redeliver, so the test does.
                for (std::uint32_t count = 2; outcome.disposition == idem::Disposition::in_progress;
                     ++count) {
                    std::this_thread::yield();
                    outcome = handler.handle(idem::Delivery{id, count}, id);
                }
                ASSERT_TRUE(outcome.disposition == idem::Disposition::processed ||
                            outcome.disposition == idem::Disposition::duplicate)
                    << outcome.reason;
            }
        });
    }
    for (auto& t : threads)
        t.join();
    EXPECT_EQ(this->env.effect_rows(), static_cast<std::size_t>(kIds));
    auto counters = handler.counters();
    EXPECT_EQ(counters.processed, static_cast<std::uint64_t>(kIds));
    EXPECT_EQ(counters.duplicates, static_cast<std::uint64_t>(kIds * (kThreads - 1)));
}

TYPED_TEST_P(IdemStoreConformance, BatchCommitsTogetherAndAFailingMessageRollsBackAlone) {
    auto seed = this->writer("batch");
    ASSERT_EQ(seed.handle(idem::Delivery{"m-done", 1u}, std::string("done")).disposition,
              idem::Disposition::processed);
    idem::PolicyOptions options;
    options.max_deliveries = 3;
    int runs = 0;
    auto handler =
        this->make(idem::Policy{"batch", options}, [&](auto& tx, const std::string& body) {
            ++runs;
            TypeParam::write_effect(tx, body);
            if (body == "throws") throw std::runtime_error("gateway 503");
            if (body == "defers") return idem::EffectResult::deferred("too early");
            if (body == "rejects") return idem::EffectResult::rejected("stale");
            if (body == "malformed") throw idem::malformed_message("no amount");
            return idem::EffectResult::applied();
        });
    const std::vector<idem::Delivery> deliveries = {
        idem::Delivery{"m-1", 1u},      idem::Delivery{"m-done", 2u},
        idem::Delivery{"m-throw", 1u},  idem::Delivery{"m-defer", 1u},
        idem::Delivery{"m-reject", 1u}, idem::Delivery{"", 1u},
        idem::Delivery{"m-bad", 1u},    idem::Delivery{"m-2", 1u},
        idem::Delivery{"m-1", 2u}};
    const std::vector<std::string> bodies = {"ok-1",  "done",      "throws", "defers", "rejects",
                                             "no-id", "malformed", "ok-2",   "ok-1"};
    auto outcomes = handler.handle_batch(deliveries, bodies);
    ASSERT_EQ(outcomes.size(), deliveries.size());
    const std::vector<idem::Disposition> expected = {
        idem::Disposition::processed,     idem::Disposition::duplicate,
        idem::Disposition::failed,        idem::Disposition::deferred,
        idem::Disposition::rejected,      idem::Disposition::dead_lettered,
        idem::Disposition::dead_lettered, idem::Disposition::processed,
        idem::Disposition::duplicate};
    for (std::size_t i = 0; i < expected.size(); ++i) {
        EXPECT_EQ(outcomes[i].disposition, expected[i]) << i << ": " << outcomes[i].reason;
    }
    EXPECT_EQ(runs, 6);  // m-done and the second m-1 are duplicates; "" never reaches the effect
    // Committed together: the two processed rows and the seed's; nothing of the others.
    EXPECT_EQ(this->env.effect_rows(), 3u);
    EXPECT_TRUE(this->env.has_effect("ok-1"));
    EXPECT_TRUE(this->env.has_effect("ok-2"));
    EXPECT_FALSE(this->store().find_claim("batch", "m-throw").has_value());
    EXPECT_FALSE(this->store().find_claim("batch", "m-defer").has_value());
    EXPECT_EQ(this->store().find_claim("batch", "m-reject")->disposition,
              idem::Disposition::rejected);
    EXPECT_EQ(this->store().find_claim("batch", "m-bad")->disposition,
              idem::Disposition::dead_lettered);
    EXPECT_EQ(this->store().dead_letters().size(), 2u);
    // The failed and deferred messages come back and run once.
    auto again = handler.handle_batch(std::vector<idem::Delivery>{{"m-throw", 2u}, {"m-defer", 2u}},
                                      std::vector<std::string>{"ok-3", "ok-4"});
    EXPECT_EQ(again[0].disposition, idem::Disposition::processed) << again[0].reason;
    EXPECT_EQ(again[1].disposition, idem::Disposition::processed) << again[1].reason;
    EXPECT_EQ(this->env.effect_rows(), 5u);
    EXPECT_EQ(handler.counters().processed, 4u);
}

// Batches larger than a store's claim chunk (SQLite: 64 rows per statement): an all-new batch,
// then one mixing new ids, ids committed before, ids repeated inside the batch and a failing
// message, with the repeats and the committed ids on both sides of the chunk boundaries.
TYPED_TEST_P(IdemStoreConformance, LargeBatchesClaimEachIdOnceAcrossChunks) {
    int runs = 0;
    auto handler = this->make(idem::Policy{"chunks"}, [&](auto& tx, const std::string& body) {
        ++runs;
        TypeParam::write_effect(tx, body);
        if (body == "b-throw") throw std::runtime_error("boom");
    });
    auto id = [](const char* prefix, int i) { return std::string(prefix) + std::to_string(i); };
    std::vector<idem::Delivery> first;
    std::vector<std::string> first_bodies;
    for (int i = 0; i < 130; ++i) {
        first.push_back(idem::Delivery{id("a-", i), 1u});
        first_bodies.push_back(id("a-", i));
    }
    for (const auto& outcome : handler.handle_batch(first, first_bodies)) {
        ASSERT_EQ(outcome.disposition, idem::Disposition::processed) << outcome.reason;
    }
    EXPECT_EQ(runs, 130);
    EXPECT_EQ(this->env.effect_rows(), 130u);

    std::vector<idem::Delivery> second;
    std::vector<std::string> bodies;
    std::vector<idem::Disposition> expected;
    for (int i = 0; i < 140; ++i) {
        if (i % 7 == 3 && i < 130) {  // committed by the first batch
            second.push_back(idem::Delivery{id("a-", i), 2u});
            bodies.push_back(id("a-", i));
            expected.push_back(idem::Disposition::duplicate);
        } else if (i % 11 == 5 && i >= 11) {  // a repeat of a new id earlier in this batch
            second.push_back(idem::Delivery{id("b-", i - 11), 2u});
            bodies.push_back(id("b-", i - 11));
            const bool earlier_is_new = (i - 11) % 7 != 3 && !((i - 11) % 11 == 5 && i - 11 >= 11);
            expected.push_back(earlier_is_new ? idem::Disposition::duplicate
                                              : idem::Disposition::processed);
        } else if (i == 70) {
            second.push_back(idem::Delivery{"b-throws", 1u});
            bodies.push_back("b-throw");
            expected.push_back(idem::Disposition::failed);
        } else {
            second.push_back(idem::Delivery{id("b-", i), 1u});
            bodies.push_back(id("b-", i));
            expected.push_back(idem::Disposition::processed);
        }
    }
    runs = 0;
    const auto outcomes = handler.handle_batch(second, bodies);
    ASSERT_EQ(outcomes.size(), second.size());
    std::size_t processed = 0;
    for (std::size_t i = 0; i < outcomes.size(); ++i) {
        EXPECT_EQ(outcomes[i].disposition, expected[i])
            << i << " " << second[i].message_id << ": " << outcomes[i].reason;
        if (expected[i] == idem::Disposition::processed) ++processed;
    }
    EXPECT_EQ(static_cast<std::size_t>(runs), processed + 1);  // + the one that threw
    EXPECT_EQ(this->env.effect_rows(), 130u + processed);
    EXPECT_FALSE(this->store().find_claim("chunks", "b-throws").has_value());
    for (std::size_t i = 0; i < second.size(); ++i) {
        if (expected[i] == idem::Disposition::failed) continue;
        const auto claim = this->store().find_claim("chunks", second[i].message_id);
        ASSERT_TRUE(claim.has_value()) << second[i].message_id;
        EXPECT_EQ(claim->disposition, idem::Disposition::processed) << second[i].message_id;
    }
}

TYPED_TEST_P(IdemStoreConformance, BatchWhoseCommitFailsAcksNothing) {
    if constexpr (!TestFixture::can_fail_commit) {
        GTEST_SKIP() << "the environment cannot make a commit fail (no make_commit_fail(tx))";
    } else {
        bool sabotage = true;
        auto handler = this->make(idem::Policy{"batch"}, [&](auto& tx, const std::string& body) {
            TypeParam::write_effect(tx, body);
            if (sabotage && body == "b") {
                this->env.make_commit_fail(tx);
            }
        });
        const std::vector<idem::Delivery> deliveries = {{"m-1", 1u}, {"m-2", 1u}, {"m-1", 1u}};
        const std::vector<std::string> bodies = {"a", "b", "a"};
        auto outcomes = handler.handle_batch(deliveries, bodies);
        for (const auto& outcome : outcomes) {
            EXPECT_EQ(outcome.disposition, idem::Disposition::failed) << outcome.reason;
            EXPECT_FALSE(idem::should_ack(outcome));
        }
        EXPECT_EQ(this->env.effect_rows(), 0u);
        EXPECT_FALSE(this->store().find_claim("batch", "m-1").has_value());
        sabotage = false;
        outcomes = handler.handle_batch(deliveries, bodies);
        EXPECT_EQ(outcomes[0].disposition, idem::Disposition::processed);
        EXPECT_EQ(outcomes[1].disposition, idem::Disposition::processed);
        EXPECT_EQ(outcomes[2].disposition, idem::Disposition::duplicate);
        EXPECT_EQ(this->env.effect_rows(), 2u);
    }
}

TYPED_TEST_P(IdemStoreConformance, EmptyBatchAndMismatchedSizes) {
    auto handler = this->writer();
    EXPECT_TRUE(
        handler.handle_batch(std::vector<idem::Delivery>{}, std::vector<std::string>{}).empty());
    EXPECT_THROW(
        handler.handle_batch(std::vector<idem::Delivery>{{"m", 1u}}, std::vector<std::string>{}),
        idem::usage_error);
}

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

REGISTER_TYPED_TEST_SUITE_P(
    IdemStoreConformance, NewIdIsProcessedAndAcked, RedeliveryIsDuplicateAndEffectRunsOnce,
    ClaimsAreScopedPerHandler, PoisonLimitDeadLettersWithoutRunningTheEffect,
    BelowThePoisonLimitTheEffectRuns, DuplicateDetectionComesBeforeThePoisonCheck,
    ThrowingEffectLeavesNothingAndIsNotAcked, FailedCommitLeavesNothingAndIsNotAcked,
    RejectedKeepsTheClaimButNotTheEffectsWrites, DeferredStoresNothingAndIsNotAcked,
    MalformedMessageIsDeadLetteredWithItsPayload, MalformedDeliveriesAreDeadLetteredNeverCrash,
    ZeroCountIsParkedWithItsClaimSoOneIdHasOneOutcome, HostileIdsRoundTripExactly,
    TransactionRollsBackWhenDroppedAndSavepointsNest,
    ClaimInsideOneTransactionSeesItsOwnClaimAsDuplicate,
    PurgeRemovesOnlyClaimsOlderThanTheRetention, PurgeRemovesExpiredLocksButNotLiveOnes,
    ConcurrentThreadsApplyEachEffectOnce, BatchCommitsTogetherAndAFailingMessageRollsBackAlone,
    LargeBatchesClaimEachIdOnceAcrossChunks, BatchWhoseCommitFailsAcksNothing,
    EmptyBatchAndMismatchedSizes, ReusedIdWithAnotherPayloadIsDeadLetteredNotAcked,
    TakeoverOfAReleasedClaimStoresTheNewPayloadsFingerprint,
    DeadLetterPayloadIsRedactedBeforeTheStoreKeepsIt,
    ClaimWithoutFingerprintCannotBeComparedSoItIsADuplicate,
    MessageOlderThanTheGatewayKeyLifetimeIsNotSentBlindly,
    ReconcileCallbackTakesMessagesOlderThanTheKeyLifetime,
    OverlapLockDefersWhileAnotherJobHoldsTheEntity, OverlapLockExpiresWhenItsHolderDies,
    OverlapLockCanDropTheBlockedCopy);
