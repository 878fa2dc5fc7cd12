#pragma once
/// @file
/// @brief The small type traits every idem header shares (one copy each): is_optional,
/// always_false, is_char_v.

#include <optional>
#include <type_traits>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace detail {

/// True for std::optional<T>.
template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

/// False, but dependent on T: for a static_assert in the last branch of an if constexpr chain.
template <class>
inline constexpr bool always_false = false;

/// True for the character types (a single char is not text: SQL binders refuse it).
template <class T>
inline constexpr bool is_char_v = std::is_same_v<T, char> || std::is_same_v<T, wchar_t> ||
                                  std::is_same_v<T, char16_t> || std::is_same_v<T, char32_t>
#if defined(__cpp_char8_t)
                                  || std::is_same_v<T, char8_t>
#endif
    ;

}  // namespace detail
IDEM_END_NAMESPACE
