#pragma once
/// @file
/// @brief Deterministic keys: gateway idempotency keys, child message ids, and attempt keys.
///
/// A key must be the same on every redelivery of a message, so it is built from stable business
/// ids (order id, payment id), never from the delivery count or a fresh random value.

#include <array>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/detail/random.hpp"
#include "idem/detail/sha256.hpp"
#include "idem/error.hpp"

IDEM_BEGIN_NAMESPACE

/// Default longest key: the common gateway limit (Stripe's Idempotency-Key is 255 characters).
inline constexpr std::size_t default_key_limit = 255;

/// Smallest limit key_with_limit() accepts: "--" and a 64-character digest leave 14 readable.
inline constexpr std::size_t min_key_limit = 80;

namespace detail {

template <class T>
using remove_cvref_t = std::remove_cv_t<std::remove_reference_t<T>>;

template <class T>
inline constexpr bool is_char_type_v =
    std::is_same_v<T, char> || std::is_same_v<T, signed char> || std::is_same_v<T, unsigned char> ||
    std::is_same_v<T, wchar_t> ||
#if defined(__cpp_char8_t)
    std::is_same_v<T, char8_t> ||
#endif
    std::is_same_v<T, char16_t> || std::is_same_v<T, char32_t>;

template <class T>
inline constexpr bool is_delivery_part_v =
    std::is_same_v<T, DeliveryCount> || std::is_same_v<T, Delivery>;

// nullptr_t converts to string_view through the const char* constructor before C++23; refuse it.
template <class T>
inline constexpr bool is_string_part_v =
    std::is_convertible_v<const T&, std::string_view> && !std::is_same_v<T, std::nullptr_t> &&
    !is_delivery_part_v<T>;

template <class T>
inline constexpr bool is_integer_part_v =
    std::is_integral_v<T> && !std::is_same_v<T, bool> && !is_char_type_v<T>;

/// True when T (after removing cv and references) may be a key part or a child_id step.
template <class T>
inline constexpr bool is_key_part_v =
    is_string_part_v<remove_cvref_t<T>> || is_integer_part_v<remove_cvref_t<T>>;

// One static_assert per kind of mistake, so the compiler prints the one that applies.
template <class T>
struct key_part_check {
    static_assert(!is_delivery_part_v<T>,
                  "idem::key: never derive a key from the delivery count; it changes on every "
                  "redelivery. Use a stable business id (order id, payment id)");
    static_assert(!std::is_same_v<T, bool>,
                  "idem::key: a bool part is refused (it is not an id: every message would share "
                  "one of two keys); pass a stable business id");
    static_assert(!is_char_type_v<T>,
                  "idem::key: a single character part is ambiguous (letter or number?); pass a "
                  "string, or cast to int");
    static_assert(!std::is_floating_point_v<T>,
                  "idem::key: floating-point part refused (its text depends on rounding); pass "
                  "an integer id, e.g. the amount in cents, or a string");
    static_assert(!std::is_enum_v<T>,
                  "idem::key: enum part refused; pass its underlying integer or a name string");
    static_assert(!std::is_same_v<T, std::nullptr_t>, "idem::key: nullptr is not a key part");
    static_assert(is_delivery_part_v<T> || std::is_same_v<T, bool> || is_char_type_v<T> ||
                      std::is_floating_point_v<T> || std::is_enum_v<T> ||
                      std::is_same_v<T, std::nullptr_t> || is_string_part_v<T> ||
                      is_integer_part_v<T>,
                  "idem::key: unsupported part type; pass a string (std::string, "
                  "std::string_view, const char*) or an integer id");
    static constexpr bool value = true;
};

[[nodiscard]] constexpr bool is_unreserved(unsigned char c) noexcept {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '~';
}

/// Appends @p text, keeping [A-Za-z0-9._~] and writing every other byte as %XX. Since '-' is
/// escaped, the '-' between parts is unambiguous, which makes the part list recoverable.
inline void append_escaped(std::string& out, std::string_view text) {
    static constexpr char hex[] = "0123456789ABCDEF";
    for (const char ch : text) {
        const auto c = static_cast<unsigned char>(ch);
        if (is_unreserved(c)) {
            out.push_back(ch);
        } else {
            out.push_back('%');
            out.push_back(hex[c >> 4]);
            out.push_back(hex[c & 0x0f]);
        }
    }
}

/// Names a part in an error: "part 2" (numbered from 1 after the prefix) or "the step" (0).
[[nodiscard]] inline std::string part_name(std::size_t number) {
    return number == 0 ? std::string("the step") : fmt::format("part {}", number);
}

/// Appends one escaped part; @p number identifies it in errors (see part_name()).
template <class T>
void append_part(std::string& out, const T& part, const char* function, std::size_t number) {
    if constexpr (is_string_part_v<T>) {
        if constexpr (std::is_pointer_v<T>) {
            if (part == nullptr) {
                throw usage_error(
                    fmt::format("{}: {} is a null pointer", function, part_name(number)));
            }
        }
        const std::string_view text(part);
        if (text.empty()) {
            throw usage_error(
                fmt::format("{}: {} is empty; every part must be a non-empty stable id", function,
                            part_name(number)));
        }
        append_escaped(out, text);
    } else if constexpr (is_integer_part_v<T>) {
        // 64 chars hold any integer type up to 128 bits with its sign.
        std::array<char, 64> digits{};
        const auto result = std::to_chars(digits.data(), digits.data() + digits.size(), part);
        append_escaped(out, std::string_view(digits.data(),
                                             static_cast<std::size_t>(result.ptr - digits.data())));
    }
    // Any other type was refused by key_part_check's static_asserts.
}

/// Turns an over-long escaped key into readable-prefix + "--" + sha256(escaped), <= max_length.
/// Escaping never produces "--" (parts are non-empty and '-' inside a part is %2D), so a
/// shortened key can never equal a key that fit.
[[nodiscard]] inline std::string shorten(const std::string& escaped, std::size_t max_length) {
    constexpr std::size_t tail = 2 + 64;
    std::size_t keep = max_length - tail;
    // Do not split a %XX escape; '%' only ever starts one.
    if (escaped[keep - 1] == '%') {
        keep -= 1;
    } else if (escaped[keep - 2] == '%') {
        keep -= 2;
    }
    if (escaped[keep - 1] == '-') keep -= 1;  // avoid "---" before the digest
    std::string out = escaped.substr(0, keep);
    out += "--";
    out += sha256_hex(escaped);
    return out;
}

}  // namespace detail

/// @brief Builds a deterministic key from a prefix and stable parts, at most @p max_length bytes.
///
/// Same rules as key(). When the escaped key is longer than @p max_length, the result is a
/// readable start of it (no %XX escape split), then "--", then the 64-hex-digit SHA-256 of the
/// whole escaped key, in at most @p max_length bytes.
///
/// @code
/// auto k = idem::key_with_limit(100, "export", customer_id, long_report_name);
/// @endcode
/// @throws idem::usage_error if @p max_length < min_key_limit, the prefix or a string part is
/// empty, or a const char* part is null.
template <class... Parts>
[[nodiscard]] std::string key_with_limit(std::size_t max_length, std::string_view prefix,
                                         const Parts&... parts) {
    static_assert(sizeof...(Parts) > 0,
                  "idem::key: give at least one part after the prefix (a stable business id); a "
                  "prefix alone gives every message the same key");
    [[maybe_unused]] constexpr bool checked =
        (detail::key_part_check<detail::remove_cvref_t<Parts>>::value && ...);

    if (max_length < min_key_limit) {
        throw usage_error(fmt::format(
            "idem::key_with_limit: limit {} is below {}; a shortened key needs room for a "
            "readable prefix, \"--\" and a 64-character digest",
            max_length, min_key_limit));
    }
    if (prefix.empty()) throw usage_error("idem::key: the prefix is empty");

    std::string out;
    detail::append_escaped(out, prefix);
    std::size_t index = 0;
    // Parts are numbered from 1 after the prefix, as a caller reads the call.
    ((out.push_back('-'), detail::append_part(out, parts, "idem::key", ++index)), ...);

    if (out.size() <= max_length) return out;
    return detail::shorten(out, max_length);
}

/// @brief Builds a deterministic gateway idempotency key: prefix and parts, escaped, joined by
/// '-', at most default_key_limit (255) bytes.
///
/// Parts are strings (std::string, std::string_view, const char*) or integers. Every byte outside
/// [A-Za-z0-9._~] is written as %XX, so different part lists never give the same key. Passing an
/// idem::DeliveryCount (or a Delivery), a bool, a char, a floating-point value or an enum is a
/// compile error: a key must not change between redeliveries.
///
/// @code
/// idem::key("capture", 8814);              // "capture-8814"
/// idem::key("refund", "mugshop", 93);      // "refund-mugshop-93"
/// idem::key("note", "a-b");                // "note-a%2Db"
/// @endcode
/// @throws idem::usage_error if the prefix or a string part is empty, or a const char* is null.
template <class... Parts>
[[nodiscard]] std::string key(std::string_view prefix, const Parts&... parts) {
    return key_with_limit(default_key_limit, prefix, parts...);
}

/// @brief The message id of a follow-up message a handler dispatches, derived from the parent's
/// message id and the step, so a redelivered parent produces the same child id and the child's
/// consumer drops the copy.
///
/// Injective in (parent, step): both are escaped as in key() and joined by '-'. Binary-safe for
/// the parent (NULs, quotes). Never longer than max_message_id_bytes (512): longer ids take the
/// shortened form described at key_with_limit().
///
/// @code
/// bus.send(idem::child_id(delivery.message_id, "send-receipt"), receipt);
/// @endcode
/// @throws idem::usage_error if the parent id or a string step is empty, or a const char* is null.
template <class Step>
[[nodiscard]] std::string child_id(std::string_view parent_message_id, const Step& step) {
    [[maybe_unused]] constexpr bool checked =
        detail::key_part_check<detail::remove_cvref_t<Step>>::value;
    if (parent_message_id.empty())
        throw usage_error("idem::child_id: the parent message id is empty");

    std::string out;
    detail::append_escaped(out, parent_message_id);
    out.push_back('-');
    detail::append_part(out, step, "idem::child_id", 0);
    if (out.size() <= max_message_id_bytes) return out;
    return detail::shorten(out, max_message_id_bytes);
}

/// @brief A new random attempt key (RFC 4122 version-4 UUID, lowercase 8-4-4-4-12) for a producer.
///
/// Create it once per user action when dispatching and carry it in the message: a retry of the
/// same action keeps it, a second click gets a new one. Never call it in a consumer to key an
/// effect, since each redelivery would get a different key.
///
/// @code
/// msg.attempt_key = idem::new_attempt_key();  // "3f0c9a5e-6b1d-4c2a-9e47-0d8b5a1f2c63"
/// @endcode
/// @throws std::system_error if neither getrandom(2) nor /dev/urandom gives bytes.
[[nodiscard]] inline std::string new_attempt_key() {
    // From the kernel on every call: no state shared between threads or copied by fork().
    std::array<std::uint8_t, 16> bytes{};
    detail::os_random_bytes(bytes.data(), bytes.size());
    bytes[6] = static_cast<std::uint8_t>((bytes[6] & 0x0f) | 0x40);  // version 4
    bytes[8] = static_cast<std::uint8_t>((bytes[8] & 0x3f) | 0x80);  // variant 10xx (RFC 4122)

    static constexpr char hex[] = "0123456789abcdef";
    std::string out;
    out.reserve(36);
    for (std::size_t i = 0; i < bytes.size(); ++i) {
        if (i == 4 || i == 6 || i == 8 || i == 10) out.push_back('-');
        out.push_back(hex[bytes[i] >> 4]);
        out.push_back(hex[bytes[i] & 0x0f]);
    }
    return out;
}

IDEM_END_NAMESPACE
