#pragma once
/// @file
/// @brief Calling an effect and looking through a chain of effect wrappers: how the handler and
/// the wrappers (effects/) invoke an effect with or without the delivery, turn void into
/// EffectResult::applied(), check its signature with a readable message, and find the
/// fingerprint, gateway key or reconcile callback anywhere in the chain (wrappers expose inner()).

#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

namespace detail {

template <class Effect, class Tx, class Body>
inline constexpr bool effect_takes_delivery_v =
    std::is_invocable_v<Effect&, Tx&, const Body&, const Delivery&>;

template <class Effect, class Tx, class Body>
inline constexpr bool effect_fits_v =
    effect_takes_delivery_v<Effect, Tx, Body> || std::is_invocable_v<Effect&, Tx&, const Body&>;

template <class Effect, class Tx, class Body>
auto invoke_effect(Effect& effect, Tx& tx, const Body& body, const Delivery& delivery) {
    if constexpr (effect_takes_delivery_v<Effect, Tx, Body>) {
        return effect(tx, body, delivery);
    } else {
        return effect(tx, body);
    }
}

template <class Effect, class Tx, class Body>
using effect_result_t =
    decltype(invoke_effect(std::declval<Effect&>(), std::declval<Tx&>(),
                           std::declval<const Body&>(), std::declval<const Delivery&>()));

/// Runs an effect and turns a void return into EffectResult::applied().
template <class Effect, class Tx, class Body>
EffectResult run_effect(Effect& effect, Tx& tx, const Body& body, const Delivery& delivery) {
    if constexpr (std::is_void_v<effect_result_t<Effect, Tx, Body>>) {
        invoke_effect(effect, tx, body, delivery);
        return EffectResult::applied();
    } else {
        return invoke_effect(effect, tx, body, delivery);
    }
}

// Effect wrappers (with_fingerprint, with_gateway_key, reconcile_expired, without_overlapping)
// expose inner(); the handler looks through the chain for the capabilities it needs.
template <class E, class = void>
struct has_inner : std::false_type {};
template <class E>
struct has_inner<E, std::void_t<decltype(std::declval<E&>().inner())>> : std::true_type {};

template <class E, class Body, class = void>
struct has_fingerprint : std::false_type {};
template <class E, class Body>
struct has_fingerprint<
    E, Body, std::void_t<decltype(std::declval<E&>().fingerprint(std::declval<const Body&>()))>>
    : std::true_type {};

template <class E, class Body>
constexpr bool chain_has_fingerprint() {
    if constexpr (has_fingerprint<E, Body>::value) {
        return true;
    } else if constexpr (has_inner<E>::value) {
        return chain_has_fingerprint<std::remove_reference_t<decltype(std::declval<E&>().inner())>,
                                     Body>();
    } else {
        return false;
    }
}

/// The fingerprint of the body's stable part, from the first wrapper in the chain that has one.
template <class E, class Body>
std::string chain_fingerprint(E& effect, const Body& body) {
    if constexpr (has_fingerprint<E, Body>::value) {
        return effect.fingerprint(body);
    } else {
        return chain_fingerprint(effect.inner(), body);
    }
}

template <class E, class Body, class = void>
struct has_gateway_key : std::false_type {};
template <class E, class Body>
struct has_gateway_key<
    E, Body, std::void_t<decltype(std::declval<E&>().gateway_key(std::declval<const Body&>()))>>
    : std::true_type {};

template <class E, class Body>
constexpr bool chain_has_gateway_key() {
    if constexpr (has_gateway_key<E, Body>::value) {
        return true;
    } else if constexpr (has_inner<E>::value) {
        return chain_has_gateway_key<std::remove_reference_t<decltype(std::declval<E&>().inner())>,
                                     Body>();
    } else {
        return false;
    }
}

/// The gateway idempotency key of the body, from the first wrapper in the chain that has one
/// (with_gateway_key()).
template <class E, class Body>
std::string chain_gateway_key(E& effect, const Body& body) {
    if constexpr (has_gateway_key<E, Body>::value) {
        return effect.gateway_key(body);
    } else {
        return chain_gateway_key(effect.inner(), body);
    }
}

template <class E, class Tx, class Body, class = void>
struct has_reconcile : std::false_type {};
template <class E, class Tx, class Body>
struct has_reconcile<
    E, Tx, Body,
    std::void_t<decltype(std::declval<E&>().reconcile(
        std::declval<Tx&>(), std::declval<const Body&>(), std::declval<const Delivery&>()))>>
    : std::true_type {};

/// The reconcile callback's answer for a message too old for its gateway key, if the chain has
/// one.
template <class E, class Tx, class Body>
std::optional<EffectResult> chain_reconcile(E& effect, Tx& tx, const Body& body,
                                            const Delivery& delivery) {
    if constexpr (has_reconcile<E, Tx, Body>::value) {
        return EffectResult(effect.reconcile(tx, body, delivery));
    } else if constexpr (has_inner<E>::value) {
        return chain_reconcile(effect.inner(), tx, body, delivery);
    } else {
        return std::nullopt;
    }
}

template <class Effect, class Tx, class Body>
constexpr bool check_effect() {
    constexpr bool fits = effect_fits_v<Effect, Tx, Body>;
    static_assert(fits,
                  "idem: the effect must be callable as effect(Transaction&, const Body&) or "
                  "effect(Transaction&, const Body&, const idem::Delivery&), where Transaction "
                  "is the store's transaction type and Body the type passed to handle()");
    if constexpr (fits) {
        using R = effect_result_t<Effect, Tx, Body>;
        static_assert(std::is_void_v<R> || std::is_convertible_v<R, EffectResult>,
                      "idem: the effect must return void or idem::EffectResult");
    }
    return true;
}

}  // namespace detail

IDEM_END_NAMESPACE
