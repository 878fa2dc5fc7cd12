#pragma once
/// @file
/// @brief The type traits every SQL driver's parameter binding uses (the values the effect's
/// execute() / query_*() bind): std::optional, single characters (refused), and a dependent
/// false for static_assert. They are the core's (detail/traits.hpp), named in idem::sql.

#include "idem/config.hpp"
#include "idem/detail/traits.hpp"

IDEM_BEGIN_NAMESPACE
namespace sql {

using detail::always_false;
using detail::is_char_v;
using detail::is_optional;

}  // namespace sql
IDEM_END_NAMESPACE
