#pragma once
/// @file
/// @brief What a dead letter keeps of a message body: the body's bytes (text, bytes, or a typed
/// body's `idem_payload()`), through the policy's redaction hook; or, by explicit choice,
/// nothing (keep_no_payload).
///
/// A dead letter is for a human to read and replay, so one that silently keeps nothing loses the
/// message. A typed body without `idem_payload()` is therefore a compile error unless the handler
/// says, visibly, that its dead letters keep no payload.
///
/// Why the opt-out is an effect wrapper, `idem::keep_no_payload(effect)`, and not a
/// PolicyOptions flag: the check is a static_assert on the body type, and a runtime value cannot
/// turn a static_assert off. A wrapper is part of the handler's type, so the handler knows at
/// compile time; it composes with the other wrappers (the handler looks through inner()), it
/// sits where the handler is built, next to the effect that decides what the body holds, and it
/// is per handler rather than per body type, so one body type may be kept by one handler and not
/// by another. A trait specialised on the body type would hide the choice far from the handler.
///
/// Why the redaction hook is a PolicyOptions member (`redact_payload`) and not a wrapper: it is
/// runtime data (a pattern, a list of fields) rather than a compile-time property, it applies to
/// text bodies as much as to typed ones, and the policy is what every consumer of a payload can
/// reach (`policy.redact(payload)`: the handler's dead letters now, log adapters later) — a
/// wrapper in the effect chain would be invisible to a logger that only holds the policy.

#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/effect.hpp"
#include "idem/policy.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The effect returned by keep_no_payload(); see there. Calls the effect as it is, with or
/// without the delivery, and returns what it returns.
template <class Effect>
class KeepNoPayload {
  public:
    /// Wraps @p effect.
    explicit KeepNoPayload(Effect effect) : effect_(std::move(effect)) {}

    /// Calls the effect with @p args and returns what it returns.
    template <class... Args>
    auto operator()(Args&&... args)
        -> decltype(std::declval<Effect&>()(std::forward<Args>(args)...)) {
        return effect_(std::forward<Args>(args)...);
    }

    /// The wrapped effect.
    Effect& inner() noexcept { return effect_; }

    /// Marks the chain: the handler's dead letters store an empty payload.
    static constexpr bool keeps_no_payload = true;

  private:
    Effect effect_;
};

/// @brief Wraps an effect so that the handler's dead letters keep NO payload (reason, id and
/// count only), stated where the handler is built. For a typed body without `idem_payload()`
/// this is the explicit alternative to defining one; for any body it is the way to keep a
/// payload that must never be stored out of failed-job storage altogether.
///
/// @code
/// auto h = idem::make_handler(store, idem::Policy{"tick"},
///                             idem::keep_no_payload([&](auto& tx, const Tick& t) { ... }));
/// @endcode
template <class Effect>
KeepNoPayload<std::decay_t<Effect>> keep_no_payload(Effect&& effect) {
    return KeepNoPayload<std::decay_t<Effect>>(std::forward<Effect>(effect));
}

/// @brief A ready-made PolicyOptions::redact_payload: every run of 13 to 19 digits (digits may
/// be separated by single spaces or dashes, as card numbers are written) keeps its last 4
/// digits, the others become '*': `4111 1111 1111 1111` → `**** **** **** 1111`. It errs towards
/// hiding: any such run is masked (a 13-digit millisecond timestamp too); shorter and longer
/// runs are kept.
[[nodiscard]] inline std::string mask_card_numbers(std::string_view payload) {
    auto is_digit = [](char c) { return c >= '0' && c <= '9'; };
    std::string out(payload);
    std::size_t i = 0;
    while (i < out.size()) {
        if (!is_digit(out[i])) {
            ++i;
            continue;
        }
        // A run: digits, each separated from the next by at most one space or dash.
        const std::size_t begin = i;
        std::size_t end = i;
        std::size_t digits = 0;
        while (end < out.size()) {
            if (is_digit(out[end])) {
                ++digits;
                ++end;
            } else if ((out[end] == ' ' || out[end] == '-') && end + 1 < out.size() &&
                       is_digit(out[end + 1])) {
                ++end;
            } else {
                break;
            }
        }
        if (digits >= 13 && digits <= 19) {
            std::size_t to_mask = digits - 4;
            for (std::size_t k = begin; k < end && to_mask > 0; ++k) {
                if (is_digit(out[k])) {
                    out[k] = '*';
                    --to_mask;
                }
            }
        }
        i = end;
    }
    return out;
}

namespace detail {

template <class, class = void>
struct has_adl_payload : std::false_type {};
template <class B>
struct has_adl_payload<B, std::void_t<decltype(idem_payload(std::declval<const B&>()))>>
    : std::true_type {};

/// True when payload_of() keeps the body's bytes: text, bytes, or a typed body with
/// `idem_payload(const Body&)` (found by ADL).
template <class Body>
inline constexpr bool payload_kept_v =
    std::is_convertible_v<const Body&, std::string_view> || has_adl_payload<Body>::value ||
    std::is_same_v<Body, std::vector<char>> || std::is_same_v<Body, std::vector<unsigned char>>;

/// The bytes a dead letter keeps of a body, before redaction: the body itself when it is text or
/// bytes, or what the user's `idem_payload(const Body&)` (found by ADL) returns.
template <class Body>
std::string payload_of(const Body& body) {
    static_assert(payload_kept_v<Body>,
                  "idem: payload_of() needs a text, byte or typed body "
                  "with idem_payload(const Body&)");
    if constexpr (std::is_convertible_v<const Body&, std::string_view>) {
        return std::string(std::string_view(body));
    } else if constexpr (has_adl_payload<Body>::value) {
        return std::string(idem_payload(body));
    } else {
        return std::string(body.begin(), body.end());
    }
}

// The effect chain (wrappers expose inner(), effect.hpp), walked for the keep_no_payload mark.
template <class E, class = void>
struct marks_no_payload : std::false_type {};
template <class E>
struct marks_no_payload<E, std::void_t<decltype(E::keeps_no_payload)>>
    : std::bool_constant<E::keeps_no_payload> {};

template <class E>
constexpr bool chain_keeps_no_payload() {
    if constexpr (marks_no_payload<E>::value) {
        return true;
    } else if constexpr (has_inner<E>::value) {
        return chain_keeps_no_payload<
            std::remove_reference_t<decltype(std::declval<E&>().inner())>>();
    } else {
        return false;
    }
}

/// What a dead letter of @p body stores as its payload for a handler with effect @p Effect:
/// nothing under keep_no_payload, else the body's bytes through policy.redact().
/// @throws redaction_failed when the policy's redact_payload hook throws.
template <class Effect, class Body>
std::string dead_letter_payload(const Policy& policy, const Body& body) {
    constexpr bool keeps_nothing = chain_keeps_no_payload<Effect>();
    static_assert(keeps_nothing || payload_kept_v<Body>,
                  "idem: dead letters of this typed body would keep nothing: define std::string "
                  "idem_payload(const Body&) next to the type (found by ADL), or wrap the effect "
                  "in idem::keep_no_payload(effect)");
    if constexpr (keeps_nothing || !payload_kept_v<Body>) {
        return std::string();
    } else {
        return policy.redact(payload_of(body));
    }
}

}  // namespace detail

IDEM_END_NAMESPACE
