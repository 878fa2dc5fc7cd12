#pragma once
/// @file
/// @brief Decoding what a SQL store keeps in `idem_claims.outcome`: the Disposition a finished
/// run recorded, or 'claimed' (committed without one, by a transaction used without a handler).

#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/store.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE
namespace sql {

/// The stored outcome text as a Disposition ('claimed' → in_progress).
/// @throws store_error when the outcome is not one idem writes.
inline Disposition stored_disposition(std::string_view outcome, std::string_view store_name) {
    Disposition disposition = Disposition::processed;
    if (outcome == "claimed") return Disposition::in_progress;  // no outcome recorded yet
    if (!from_string(outcome, disposition)) {
        throw store_error(fmt::format("idem {}: unknown outcome '{}' stored in idem_claims",
                                      store_name, outcome));
    }
    return disposition;
}

/// A SQL store's answer for an id already in its claims table: a duplicate with the stored
/// outcome and the fingerprint of the first claim.
/// @throws store_error when the outcome is not one idem writes.
inline ClaimResult stored_duplicate(std::string_view outcome, std::string fingerprint,
                                    std::string_view store_name) {
    ClaimResult claim;
    claim.status = ClaimStatus::duplicate;
    claim.fingerprint = std::move(fingerprint);
    claim.recorded = stored_disposition(outcome, store_name);
    return claim;
}

}  // namespace sql
IDEM_END_NAMESPACE
