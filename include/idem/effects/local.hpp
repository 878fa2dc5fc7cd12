#pragma once
/// @file
/// @brief local_effect(): an effect that declares its only effect is the transaction's queued
/// writes, so a store that can (Redis) runs it before any claim and sends its writes with the
/// claim in one round trip.

#include <type_traits>
#include <utility>

#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/effect.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The effect returned by local_effect(); see there.
template <class Effect>
class LocalEffect {
  public:
    /// What the handler looks for in the chain (detail::chain_only_transaction_writes).
    static constexpr bool only_transaction_writes = true;

    /// @brief Wraps @p effect, declared to do nothing but the transaction's queued writes.
    explicit LocalEffect(Effect effect) : effect_(std::move(effect)) {}

    /// @brief Runs the wrapped effect, unchanged. An effect returning void counts as applied.
    template <class Tx, class Body>
    EffectResult operator()(Tx& tx, const Body& body, const Delivery& delivery) {
        static_assert(detail::check_effect<Effect, Tx, Body>(), "idem: effect does not fit");
        return detail::run_effect(effect_, tx, body, delivery);
    }

    /// @brief The wrapped effect, for the handler's look through the chain of wrappers.
    Effect& inner() noexcept { return effect_; }

  private:
    Effect effect_;
};

/// @brief Declares that @p effect has no effect outside the transaction: it only queues
/// `tx.write(...)`s (and reads), calls no gateway, sends nothing, touches no other system, and
/// running it and dropping its writes leaves no trace. The claim then need not come first.
///
/// On a store whose transaction offers claim_and_commit() (RedisStore) handle() runs the effect
/// with no claim held and sends its queued writes with the claim in ONE script call (one round
/// trip): the writes are applied and the claim recorded only if the id is new (or its claim was
/// released or its lease expired); otherwise nothing is applied and the answer is duplicate or
/// in_progress, as ever. The poison check keeps its meaning: a delivery whose count is at the
/// limit (or 0), or one older than the gateway's keys, takes the ordinary path (claim → poison
/// check → effect), so a poison body never runs the effect; a takeover whose attempt count
/// would reach the limit applies nothing and goes the ordinary way too. A deferral and a
/// malformed_message also take the ordinary path, which replays the effect's answer with the
/// claim held, and a reused id (fingerprint differs) is dead-lettered there before any effect:
/// the effect runs at most once per delivery.
/// A stream ack attached as a commit hook rides in the same script. On any other store (and in
/// handle_batch) the wrapper changes nothing: claim → effect → commit.
///
/// Wrong use is not detected: an effect that calls out from inside a local_effect may call out
/// for a duplicate (the claim is checked after it ran). Use an idempotency key there, or do not
/// declare it local.
///
/// @code
/// auto count = idem::make_handler(store, idem::Policy{"page-views"},
///     idem::local_effect([](auto& tx, const View& v) { tx.write("HINCRBY", "views", v.page, 1);
///     }));
/// @endcode
template <class Effect>
LocalEffect<std::decay_t<Effect>> local_effect(Effect&& effect) {
    return LocalEffect<std::decay_t<Effect>>(std::forward<Effect>(effect));
}

IDEM_END_NAMESPACE
