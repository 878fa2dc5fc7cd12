#pragma once
/// @file
/// @brief reconcile_expired(): what to do with a message older than the gateway's
/// idempotency-key lifetime, instead of dead-lettering it.

#include <type_traits>
#include <utility>

#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/effect.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The effect returned by reconcile_expired(); see there.
template <class Effect, class Reconcile>
class Reconciling {
  public:
    /// @brief Wraps @p effect; @p reconcile runs instead of it for an expired message (see
    /// reconcile_expired()).
    Reconciling(Effect effect, Reconcile reconcile)
        : effect_(std::move(effect)), reconcile_(std::move(reconcile)) {}

    /// @brief Runs the wrapped effect (for a message within the key lifetime; the handler calls
    /// reconcile() otherwise). An effect returning void counts as applied.
    template <class Tx, class Body>
    EffectResult operator()(Tx& tx, const Body& body, const Delivery& delivery) {
        static_assert(detail::check_effect<Effect, Tx, Body>(), "idem: effect does not fit");
        return detail::run_effect(effect_, tx, body, delivery);
    }

    /// Called by the handler instead of the effect for a message older than the key lifetime.
    template <class Tx, class Body>
    EffectResult reconcile(Tx& tx, const Body& body, const Delivery& delivery) {
        static_assert(detail::check_effect<Reconcile, Tx, Body>(),
                      "idem::reconcile_expired: the reconcile callback must be callable like an "
                      "effect: (Transaction&, const Body&[, const idem::Delivery&])");
        return detail::run_effect(reconcile_, tx, body, delivery);
    }

    /// @brief The wrapped effect, for the handler's look through the chain of wrappers.
    Effect& inner() noexcept { return effect_; }

  private:
    Effect effect_;
    Reconcile reconcile_;
};

/// @brief Gives messages older than Policy::gateway_key_lifetime to `reconcile` instead of the
/// effect.
///
/// A gateway forgets its idempotency keys (often after 24 hours). A redelivery older than that
/// is no longer protected by the key, so sending it blindly could charge twice. Without this
/// wrapper such a message is dead-lettered for a human; with it, `reconcile(tx, body)` runs in
/// the claim's transaction and can ask the gateway what happened (look the charge up by order
/// id) and record the answer. It returns void / EffectResult like any effect.
template <class Effect, class Reconcile>
Reconciling<std::decay_t<Effect>, std::decay_t<Reconcile>> reconcile_expired(
    Effect&& effect, Reconcile&& reconcile) {
    return {std::forward<Effect>(effect), std::forward<Reconcile>(reconcile)};
}

IDEM_END_NAMESPACE
