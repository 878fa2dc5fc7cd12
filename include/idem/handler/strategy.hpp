#pragma once
/// @file
/// @brief The strategies of one attempt (attempt.hpp): how a message is kept apart from the
/// others in its transaction (isolate / keep / drop), where its claim comes from, and how it
/// keeps its claim without the effect's writes (Undo), and whether the effect already ran.
/// Alone, in a batch, claimed ahead (PipelinedLoop) or with the effect run ahead of the claim
/// (a local effect's claim-and-commit) differ only here, chosen at compile time.

#include <exception>
#include <string_view>
#include <utility>

#include "idem/config.hpp"
#include "idem/contract/records.hpp"
#include "idem/contract/store.hpp"
#include "idem/effect.hpp"

IDEM_BEGIN_NAMESPACE
namespace detail {

/// How a message keeps its claim but none of the effect's writes (rejected, or malformed).
enum class Undo {
    effect_savepoint,    ///< the effect ran in a savepoint: roll back to it, record, go on
    second_transaction,  ///< roll the whole transaction back; claim and record in a new one
};

/// @brief handle(): one message in its own transaction, so nothing to isolate: a failure or a
/// deferral rolls the transaction back, and a store error fails the attempt. The effect gets a
/// savepoint only where savepoints are cheap (memory, Redis); on SQL stores the common path goes
/// without one and the rare rejected or malformed outcome is recorded in a second transaction.
template <class Tx>
struct SingleStrategy {
    static constexpr Undo undo =
        cheap_savepoints<Tx>::value ? Undo::effect_savepoint : Undo::second_transaction;
    static constexpr bool contains_failures = false;  ///< a failure ends the transaction
    static constexpr bool ran_ahead = false;          ///< the attempt runs the effect
    void isolate(Tx& /*tx*/) noexcept {}
    void keep(Tx& /*tx*/) noexcept {}
    void drop(Tx& /*tx*/) noexcept {}
    template <class ClaimNow>
    ClaimResult claim(ClaimNow&& claim_now) {
        return claim_now();
    }
};

/// @brief handle_batch() on a store that claims one id per call: each message in a savepoint of
/// its own, around its claim, so one that fails or defers leaves nothing (not even its claim)
/// while the others commit together.
template <class Tx>
struct BatchSavepointStrategy {
    static constexpr Undo undo = Undo::effect_savepoint;
    static constexpr bool contains_failures = true;  ///< a failed message rolls back alone
    static constexpr bool ran_ahead = false;
    void isolate(Tx& tx) { tx.savepoint(); }
    void keep(Tx& tx) { tx.release_savepoint(); }
    void drop(Tx& tx) { tx.rollback_to_savepoint(); }
    template <class ClaimNow>
    ClaimResult claim(ClaimNow&& claim_now) {
        return claim_now();
    }
};

/// @brief handle_batch() on a store that claimed the whole batch up front (claim_many): the claim
/// lies outside any message savepoint, so a message that fails or defers gives it back with
/// unclaim().
template <class Tx>
struct BatchUnclaimStrategy {
    static constexpr Undo undo = Undo::effect_savepoint;
    static constexpr bool contains_failures = true;
    static constexpr bool ran_ahead = false;
    const ClaimResult& claimed;  ///< this message's answer from claim_many
    std::string_view scope;
    std::string_view id;
    void isolate(Tx& /*tx*/) noexcept {}
    void keep(Tx& /*tx*/) noexcept {}
    void drop(Tx& tx) {
        if (claimed.status == ClaimStatus::claimed) tx.unclaim(scope, id);
    }
    template <class ClaimNow>
    ClaimResult claim(ClaimNow&& /*claim_now*/) const {
        return claimed;
    }
};

/// @brief One message whose claim came before the attempt, with the previous message's commit
/// (PipelinedLoop, broker/pipeline.hpp): otherwise handle()'s, its effect in a savepoint (the loop
/// needs cheap savepoints: Redis).
template <class Tx>
struct PreclaimedStrategy {
    static constexpr Undo undo = Undo::effect_savepoint;
    static constexpr bool contains_failures = false;
    static constexpr bool ran_ahead = false;
    const ClaimResult& claimed;
    void isolate(Tx& /*tx*/) noexcept {}
    void keep(Tx& /*tx*/) noexcept {}
    void drop(Tx& /*tx*/) noexcept {}
    template <class ClaimNow>
    ClaimResult claim(ClaimNow&& /*claim_now*/) const {
        return claimed;
    }
};

/// @brief What a local effect gave when it ran ahead of its claim (handler/claim_and_commit.hpp)
/// and the one-step claim and commit could not take it: its result, or what it threw. Only for
/// answers whose writes the claim does not keep (a deferral, a malformed message), so nothing is
/// lost by replaying the answer instead of the effect.
struct EffectRanAhead {
    EffectResult result = EffectResult::applied();
    std::exception_ptr thrown;  ///< set: the effect threw this (a malformed_message)
    /// The effect's answer again, or its exception thrown again, for the attempt's handling.
    [[nodiscard]] EffectResult replay() const {
        if (thrown) std::rethrow_exception(thrown);
        return result;
    }
};

/// @brief handle() of a message whose local effect already ran (EffectRanAhead): handle()'s
/// steps (claim, fingerprint, poison check), but the effect's answer is replayed, not run again:
/// the effect runs at most once per attempt.
template <class Tx>
struct RanAheadStrategy : SingleStrategy<Tx> {
    static constexpr bool ran_ahead = true;
    const EffectRanAhead& ran;
    explicit RanAheadStrategy(const EffectRanAhead& answer) : ran(answer) {}
};

template <class Strategy>
inline constexpr bool effect_savepoint_v = Strategy::undo == Undo::effect_savepoint;

}  // namespace detail
IDEM_END_NAMESPACE
