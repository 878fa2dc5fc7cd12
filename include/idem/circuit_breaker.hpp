#pragma once
/// @file
/// @brief Deprecated: this header moved to idem/broker/circuit_breaker.hpp (a part of the
/// broker consumers). This path only includes it, for one release; include the new one.

#include "idem/broker/circuit_breaker.hpp"
