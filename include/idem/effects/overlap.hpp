#pragma once
/// @file
/// @brief without_overlapping(): one entity, one job at a time, across handler kinds.

#include <chrono>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/store.hpp"  // has_try_lock
#include "idem/delivery.hpp"
#include "idem/effect.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief What a delivery does when another job holds the entity's lock.
enum class OnContention {
    /// Not acked, with `release_after` as the retry delay; the delivery count still grows, so
    /// the poison limit must cover the waits.
    defer,
    /// Acked and recorded as rejected: the copy is dropped and never retried. Only for work the
    /// holder will finish anyway; unsafe for payments (if the holder crashes, the dropped copy
    /// was the one that would have finished the job).
    drop,
};

/// @brief The lock's terms for without_overlapping(): how long it may outlive a dead holder, and
/// what a delivery that finds it taken does.
struct OverlapOptions {
    /// How long the lock may be held if its holder dies; longer than the job can run.
    std::chrono::milliseconds expire_after = std::chrono::minutes(3);
    /// The retry delay reported with a deferred outcome.
    std::chrono::milliseconds release_after = std::chrono::seconds(15);
    /// What a delivery that finds the lock taken does: defer it (default) or drop it.
    OnContention on_contention = OnContention::defer;
};

/// @brief The effect returned by without_overlapping(); see there.
template <class KeyOf, class Effect>
class WithoutOverlapping {
  public:
    /// @brief Wraps @p effect; @p key_of maps a body to the entity's lock key (see
    /// without_overlapping()).
    WithoutOverlapping(KeyOf key_of, OverlapOptions options, Effect effect)
        : key_of_(std::move(key_of)), options_(options), effect_(std::move(effect)) {}

    /// @brief Takes the lock on `key_of(body)` in @p tx, then runs the wrapped effect; when another
    /// job holds it, returns deferred (retry after release_after) or, under OnContention::drop,
    /// rejected, and runs nothing. An effect returning void counts as applied.
    /// @throws what the store's try_lock() (store errors) or the wrapped effect throws.
    template <class Tx, class Body>
    EffectResult operator()(Tx& tx, const Body& body, const Delivery& delivery) {
        static_assert(has_try_lock<Tx>::value,
                      "idem::without_overlapping: this store's transaction has no "
                      "try_lock(key, expire_after)");
        static_assert(detail::check_effect<Effect, Tx, Body>(), "idem: effect does not fit");
        const std::string key(key_of_(body));
        if (!tx.try_lock(key, options_.expire_after)) {
            if (options_.on_contention == OnContention::drop) {
                return EffectResult::rejected(
                    fmt::format("dropped: another job holds the lock on {}", key));
            }
            return EffectResult::deferred(fmt::format("another job holds the lock on {}", key),
                                          options_.release_after);
        }
        return detail::run_effect(effect_, tx, body, delivery);
    }

    /// @brief The wrapped effect, for the handler's look through the chain of wrappers.
    Effect& inner() noexcept { return effect_; }

  private:
    KeyOf key_of_;
    OverlapOptions options_;
    Effect effect_;
};

/// @brief Runs the effect only while holding a lock on the entity `key_of(body)` returns (e.g.
/// "invoice:42"), shared by every handler that names the same key — a refund job and a capture
/// job on one invoice never run side by side.
///
/// The lock lasts until the claim's transaction ends; `expire_after` bounds it if the holder
/// dies (lease stores) and must be longer than any job may run. On contention the delivery is
/// deferred (default; not acked, retried after `release_after`) or dropped (acked; see
/// OnContention::drop). The lock is not a record of success: the claim is.
///
/// @code
/// idem::without_overlapping([](const InvoiceMessage& m) { return idem::key("invoice", m.id); },
///                           idem::OverlapOptions{}, [&](auto& tx, const InvoiceMessage& m) {...})
/// @endcode
template <class KeyOf, class Effect>
WithoutOverlapping<std::decay_t<KeyOf>, std::decay_t<Effect>> without_overlapping(
    KeyOf&& key_of, OverlapOptions options, Effect&& effect) {
    return {std::forward<KeyOf>(key_of), options, std::forward<Effect>(effect)};
}

IDEM_END_NAMESPACE
