#pragma once
/// @file
/// @brief Forwards to idem/effects/fingerprint.hpp (with_fingerprint(): store a fingerprint of the
/// payload's stable part with the claim). As before, it also brings idem/handler.hpp, so code that
/// included only this header keeps compiling.

#include "idem/effects/fingerprint.hpp"
#include "idem/handler.hpp"
