#pragma once
/// @file
/// @brief The type traits every SQL driver's parameter binding uses (the values the effect's
/// execute() / query_*() bind): std::optional, single characters (refused), and a dependent
/// false for static_assert.

#include <optional>
#include <type_traits>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace sql {

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

template <class>
inline constexpr bool always_false = false;

template <class T>
inline constexpr bool is_char_v = std::is_same_v<T, char> || std::is_same_v<T, wchar_t> ||
                                  std::is_same_v<T, char16_t> || std::is_same_v<T, char32_t>
#if defined(__cpp_char8_t)
                                  || std::is_same_v<T, char8_t>
#endif
    ;

}  // namespace sql
IDEM_END_NAMESPACE
