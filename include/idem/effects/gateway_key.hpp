#pragma once
/// @file
/// @brief with_gateway_key(): names the gateway idempotency key of a message, so the handler can
/// hand it to an observer (a LoggingObserver logs it at debug) without the observer ever seeing
/// the payload.

#include <string>
#include <type_traits>
#include <utility>

#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/effect.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The effect returned by with_gateway_key(); see there.
template <class KeyOf, class Effect>
class GatewayKeyed {
  public:
    /// @brief Wraps @p effect; @p key_of maps a body to its gateway idempotency key (see
    /// with_gateway_key()).
    GatewayKeyed(KeyOf key_of, Effect effect)
        : key_of_(std::move(key_of)), effect_(std::move(effect)) {}

    /// @brief Runs the wrapped effect, unchanged (the handler reads the key, not the effect). An
    /// effect returning void counts as applied.
    template <class Tx, class Body>
    EffectResult operator()(Tx& tx, const Body& body, const Delivery& delivery) {
        static_assert(detail::check_effect<Effect, Tx, Body>(), "idem: effect does not fit");
        return detail::run_effect(effect_, tx, body, delivery);
    }

    /// What key_of returns for the body: the key the effect sends to its gateway.
    template <class Body>
    std::string gateway_key(const Body& body) const {
        static_assert(std::is_invocable_v<const KeyOf&, const Body&>,
                      "idem::with_gateway_key: key_of must be callable with the body");
        return std::string(key_of_(body));
    }

    /// @brief The wrapped effect, for the handler's look through the chain of wrappers.
    Effect& inner() noexcept { return effect_; }

  private:
    KeyOf key_of_;
    Effect effect_;
};

/// @brief Wraps an effect with the function that derives its gateway idempotency key from the
/// message (`key_of(body)`, built with idem::key() from stable business ids). The effect is
/// called as it is; use the same `key_of` in it, so the key logged is the key sent.
///
/// The handler calls `key_of` only when its observer asks for the key
/// (Observer::wants_gateway_key(): a LoggingObserver whose debug records are on), after the
/// outcome, and passes the key in OutcomeDetails::gateway_key; an exception from `key_of` leaves
/// the key empty and changes nothing else.
///
/// @code
/// auto key_of = [](const CapturePayment& m) { return idem::key("capture", m.order_id); };
/// auto capture = idem::make_handler(store, idem::Policy{"capture"},
///     idem::with_gateway_key(key_of, [&](auto& tx, const CapturePayment& m) {
///         auto charge = gateway.capture(m.token, m.amount, key_of(m));
///         tx.execute("INSERT INTO captures ...", m.order_id, charge.reference); }),
///     &logs);
/// @endcode
template <class KeyOf, class Effect>
GatewayKeyed<std::decay_t<KeyOf>, std::decay_t<Effect>> with_gateway_key(KeyOf&& key_of,
                                                                         Effect&& effect) {
    return {std::forward<KeyOf>(key_of), std::forward<Effect>(effect)};
}

IDEM_END_NAMESPACE
