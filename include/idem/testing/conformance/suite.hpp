#pragma once
/// @file
/// @brief The conformance suite's fixture (idem::testing::StoreConformance<Env>), the detected
/// optional capabilities of an Env and the suite's declaration. idem/testing/conformance.hpp
/// documents the Env, holds the tests' registration, and is the header to include.

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
#include "idem/contract/stored_offset.hpp"
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

/// A store that purges claims a whole span at a time (PostgreSQL's claim partitions) names the
/// span: `static constexpr std::chrono::milliseconds purge_granularity`, spans aligned to
/// conformance_epoch(). A claim then stays until every claim of its span has expired.
template <class Env, class = void>
struct purge_granularity {
    static constexpr std::chrono::milliseconds value{0};
};
template <class Env>
struct purge_granularity<Env, std::void_t<decltype(Env::purge_granularity)>> {
    static constexpr std::chrono::milliseconds value{Env::purge_granularity};
};

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
    /// The span purge() removes claims by (0: one claim at a time).
    static constexpr std::chrono::milliseconds purge_granularity =
        conformance::purge_granularity<Env>::value;
    /// Whether the store keeps offsets (idem/contract/stored_offset.hpp): the offsets tests.
    static constexpr bool has_stored_offsets = idem::has_stored_offsets<Store>::value;

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
