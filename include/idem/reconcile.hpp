#pragma once
/// @file
/// @brief Forwards to idem/effects/reconcile.hpp (reconcile_expired(): messages older than the
/// gateway's idempotency-key lifetime). As before, it also brings idem/handler.hpp, so code that
/// included only this header keeps compiling.

#include "idem/effects/reconcile.hpp"
#include "idem/handler.hpp"
