#pragma once
/// @file
/// @brief The Redis store's commit-with-next-claim (idem/contract/store.hpp; idem::PipelinedLoop):
/// one transaction's commit script and the next one's `SET … NX PX … GET` in ONE round trip.
/// Link idem::redis.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "idem/config.hpp"
#include "idem/store/redis/claims.hpp"
#include "idem/store/redis/commit.hpp"
#include "idem/store/redis/context.hpp"
#include "idem/store/redis/replication.hpp"
#include "idem/store/redis/transaction_state.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// @p prepared, then WAIT (with replicas_to_ack), then @p sets, on the node serving @p slot.
/// Followed where the slot's redirects say (one server: no redirect). A redirected commit ran
/// nothing, but the claim's SET may have run where the script was refused (TRYAGAIN during a
/// migration): its first real answer is kept, as eval_then() keeps it after NOSCRIPT.
inline CommitReplies commit_and_claim_round_trip(StoreContext& store,
                                                 const PreparedCommit& prepared,
                                                 const std::vector<Args>& sets,
                                                 std::uint16_t slot) {
    CommitReplies replies;
    std::optional<Reply> claim_answer;
    bool ran = false;
    replies.commit = store.router.on_slot(slot, [&](Connection& c) {
        if (ran && !claim_answer && !replies.next_claims.front().is_error()) {
            claim_answer = std::move(replies.next_claims.front());  // sent again: keep the first
        }
        ran = true;
        replies = commit_round_trip(c, store.options, prepared, sets);
        return replies.commit;
    });
    if (claim_answer) replies.next_claims.front() = std::move(*claim_answer);
    return replies;
}

/// The next transaction's claim from its pipelined `SET … NX GET` (@p replies, of set_claims()
/// of @p held); nothing when the SET wrote nothing and the claim script must decide.
inline std::optional<ClaimResult> read_next_claim(StoreContext& store, TransactionState& next,
                                                  std::vector<HeldClaim>& held,
                                                  std::vector<Reply>& replies) {
    std::vector<ClaimResult> results(1);
    std::vector<std::size_t> contested;
    if (!read_set_claims(store, next, held, replies, results, 0, contested) || !contested.empty()) {
        return std::nullopt;
    }
    confirm_duplicates(store, held, results);
    return std::move(results.front());
}

}  // namespace redis
IDEM_END_NAMESPACE
