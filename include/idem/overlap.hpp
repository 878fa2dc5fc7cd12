#pragma once
/// @file
/// @brief Forwards to idem/effects/overlap.hpp (without_overlapping(): one entity, one job at a
/// time). As before, it also brings idem/handler.hpp, so code that included only this header keeps
/// compiling.

#include "idem/effects/overlap.hpp"
#include "idem/handler.hpp"
