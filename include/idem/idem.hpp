#pragma once
/// @file
/// @brief Umbrella header of the idem core (standard library and fmt only). Stores live under
/// idem/store/ and are included separately; the store contract a store of your own implements
/// is idem/contract/ (included here), its conformance suite idem/testing/conformance.hpp (not
/// included: it needs GoogleTest).

#include "idem/broker/pipeline.hpp"
#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/records.hpp"
#include "idem/contract/redrive.hpp"
#include "idem/contract/store.hpp"
#include "idem/contract/time.hpp"
#include "idem/count_ahead.hpp"
#include "idem/delivery.hpp"
#include "idem/effects/fingerprint.hpp"
#include "idem/effects/gateway_key.hpp"
#include "idem/effects/local.hpp"
#include "idem/effects/overlap.hpp"
#include "idem/effects/reconcile.hpp"
#include "idem/error.hpp"
#include "idem/handler.hpp"
#include "idem/key.hpp"
#include "idem/observer.hpp"
#include "idem/outbox.hpp"
#include "idem/outcome.hpp"
#include "idem/payload.hpp"
#include "idem/policy.hpp"
#include "idem/purger.hpp"
#include "idem/state_machine.hpp"
