#pragma once
/// @file
/// @brief The durability suite (registered as IdemDurableStoreConformance): what a store keeps
/// when it is closed and opened again on the same data — claims, dead letters and stored
/// offsets. For every store that keeps its data across a restart; its environment is the main
/// suite's plus `void reopen()` (close the store, open it again on the same data). A memory fake
/// has no such restart and is not instantiated here.
/// Part of idem/testing/conformance.hpp, which registers the suite; include that one.

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "idem/contract/stored_offset.hpp"
#include "idem/delivery.hpp"
#include "idem/outcome.hpp"
#include "idem/testing/conformance/offsets.hpp"
#include "idem/testing/conformance/suite.hpp"

namespace idem {
namespace testing {
namespace conformance {

/// An environment whose store can be closed and opened again on the same data: `reopen()`.
template <class Env, class = void>
struct can_reopen : std::false_type {};
template <class Env>
struct can_reopen<Env, std::void_t<decltype(std::declval<Env&>().reopen())>> : std::true_type {};

}  // namespace conformance

/// @brief The fixture of the durability suite: the main suite's, on an environment that can
/// reopen its store.
template <class Env>
class DurableStoreConformance : public StoreConformance<Env> {
    static_assert(conformance::can_reopen<Env>::value,
                  "IdemDurableStoreConformance: the environment needs void reopen(), which closes "
                  "the store and opens it again on the same data");
};

}  // namespace testing
}  // namespace idem

/// The durability suite's registered name (a name at global scope: GoogleTest's *_P macros
/// paste it).
template <class Env>
using IdemDurableStoreConformance = ::idem::testing::DurableStoreConformance<Env>;

TYPED_TEST_SUITE_P(IdemDurableStoreConformance);

TYPED_TEST_P(IdemDurableStoreConformance, ProcessedClaimSurvivesReopeningTheStore) {
    auto handler = this->writer();
    ASSERT_EQ(handler.handle(idem::Delivery{"kept-1", 1u}, std::string("kept-1")).disposition,
              idem::Disposition::processed);
    this->env.reopen();
    auto again = this->writer();
    EXPECT_EQ(again.handle(idem::Delivery{"kept-1", 2u}, std::string("kept-1")).disposition,
              idem::Disposition::duplicate);
    EXPECT_EQ(this->env.effect_rows(), 1u);
    auto claim = this->store().find_claim("conformance", "kept-1");
    ASSERT_TRUE(claim.has_value());
    EXPECT_EQ(claim->disposition, idem::Disposition::processed);
}

TYPED_TEST_P(IdemDurableStoreConformance, DeadLetterSurvivesReopeningTheStore) {
    // Parked at the poison limit (max_deliveries 5) as in the main suite, then reopened.
    auto failing = this->make(idem::Policy{"conformance"}, [](auto&, const std::string&) {
        throw std::runtime_error("gateway 503");
    });
    for (std::uint32_t count = 1; count <= 4; ++count) {
        ASSERT_EQ(failing.handle(idem::Delivery{"parked-1", count}, std::string("parked-bytes"))
                      .disposition,
                  idem::Disposition::failed);
    }
    auto outcome = failing.handle(idem::Delivery{"parked-1", 5u}, std::string("parked-bytes"));
    ASSERT_EQ(outcome.disposition, idem::Disposition::dead_lettered);
    this->env.reopen();
    auto letters = this->store().dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_EQ(letters[0].message_id, "parked-1");
    EXPECT_EQ(letters[0].payload, "parked-bytes");
    EXPECT_EQ(letters[0].reason, outcome.reason);
    // Still parked: a redelivery after the restart is a duplicate, its effect never runs.
    auto writer = this->writer();
    EXPECT_EQ(
        writer.handle(idem::Delivery{"parked-1", 6u}, std::string("parked-bytes")).disposition,
        idem::Disposition::duplicate);
    EXPECT_EQ(this->env.effect_rows(), 0u);
}

TYPED_TEST_P(IdemDurableStoreConformance, StoredOffsetSurvivesReopeningTheStore) {
    if constexpr (!TestFixture::has_stored_offsets) {
        idem::testing::conformance::expect_offset_hook_refused(this->store());
        this->env.reopen();
        idem::testing::conformance::expect_offset_hook_refused(this->store());
    } else {
        using idem::testing::conformance::offset_hook;
        auto handler = this->writer("offsets");
        idem::CommitHook hook = offset_hook("group", "topic", 2, 1001);
        ASSERT_EQ(handler.handle(idem::Delivery{"r-1", 1u}, std::string("r-1"), hook).disposition,
                  idem::Disposition::processed);
        this->env.reopen();
        EXPECT_EQ(this->store().stored_offset("group", "topic", 2),
                  std::optional<std::int64_t>(1001));
    }
}
