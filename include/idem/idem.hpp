#pragma once
/// @file
/// @brief Umbrella header of the idem core (standard library and fmt only). Stores live under
/// idem/store/ and are included separately.

#include "idem/config.hpp"
#include "idem/delivery.hpp"
#include "idem/effects/gateway_key.hpp"
#include "idem/error.hpp"
#include "idem/fingerprint.hpp"
#include "idem/handler.hpp"
#include "idem/key.hpp"
#include "idem/observer.hpp"
#include "idem/outbox.hpp"
#include "idem/outcome.hpp"
#include "idem/overlap.hpp"
#include "idem/payload.hpp"
#include "idem/policy.hpp"
#include "idem/reconcile.hpp"
#include "idem/state_machine.hpp"
#include "idem/store.hpp"
