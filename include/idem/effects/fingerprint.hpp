#pragma once
/// @file
/// @brief with_fingerprint(): store a fingerprint of the payload's stable part with the claim, so
/// an id reused for a different message is dead-lettered instead of silently acked.

#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/detail/sha256.hpp"
#include "idem/effect.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The effect returned by with_fingerprint(); see there.
template <class FingerprintOf, class Effect>
class Fingerprinted {
  public:
    /// @brief Wraps @p effect; @p fingerprint_of maps a body to its stable part (see
    /// with_fingerprint()).
    Fingerprinted(FingerprintOf fingerprint_of, Effect effect)
        : fingerprint_of_(std::move(fingerprint_of)), effect_(std::move(effect)) {}

    /// @brief Runs the wrapped effect, unchanged (the handler reads the fingerprint, not the
    /// effect). An effect returning void counts as applied.
    template <class Tx, class Body>
    EffectResult operator()(Tx& tx, const Body& body, const Delivery& delivery) {
        static_assert(detail::check_effect<Effect, Tx, Body>(), "idem: effect does not fit");
        return detail::run_effect(effect_, tx, body, delivery);
    }

    /// SHA-256 (hex) of what fingerprint_of returns for the body.
    template <class Body>
    std::string fingerprint(const Body& body) const {
        static_assert(std::is_invocable_v<const FingerprintOf&, const Body&>,
                      "idem::with_fingerprint: fingerprint_of must be callable with the body");
        return detail::sha256_hex(std::string_view(fingerprint_of_(body)));
    }

    /// @brief The wrapped effect, for the handler's look through the chain of wrappers.
    Effect& inner() noexcept { return effect_; }

  private:
    FingerprintOf fingerprint_of_;
    Effect effect_;
};

/// @brief Wraps an effect so the handler stores a fingerprint of the payload with the claim.
///
/// `fingerprint_of(body)` returns the stable part of the message (the fields that define it:
/// order id, amount, currency — not a timestamp the producer sets on each send); the handler
/// stores its SHA-256 with a new claim. A later delivery with the same id but another
/// fingerprint is not a redelivery: the producer reused an id. It is dead-lettered as "id
/// reused with a different payload" (acked, payload kept) instead of being acked as a duplicate
/// and lost.
///
/// @code
/// auto capture = idem::make_handler(store, idem::Policy{"capture"},
///     idem::with_fingerprint([](const CapturePayment& m) {
///         return fmt::format("{}|{}|{}", m.order_id, m.amount, m.currency); },
///         [&](auto& tx, const CapturePayment& m) { ... }));
/// @endcode
template <class FingerprintOf, class Effect>
Fingerprinted<std::decay_t<FingerprintOf>, std::decay_t<Effect>> with_fingerprint(
    FingerprintOf&& fingerprint_of, Effect&& effect) {
    return {std::forward<FingerprintOf>(fingerprint_of), std::forward<Effect>(effect)};
}

IDEM_END_NAMESPACE
