#pragma once
/// @file
/// @brief Replica-acknowledged commits (RedisOptions::replicas_to_ack): the `WAIT` that follows a
/// commit, what its answer means, and the replication mark that confirms a duplicate's record
/// before it is acked. Link idem::redis.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/store.hpp"
#include "idem/error.hpp"
#include "idem/store/redis/context.hpp"
#include "idem/store/redis/transaction_state.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// `WAIT replicas_to_ack replicas_timeout`, when the store asks replicas to confirm commits.
[[nodiscard]] inline std::optional<Args> wait_command(const RedisOptions& options) {
    if (options.replicas_to_ack == 0) return std::nullopt;
    Args wait;
    wait.add("WAIT").add(options.replicas_to_ack).add(options.replicas_timeout.count());
    return wait;
}

/// Whether WAIT's reply says enough replicas have the commit.
[[nodiscard]] inline bool confirmed(const RedisOptions& options, const Reply& replicas) {
    return !replicas.is_error() && replicas.type == Reply::Type::integer &&
           replicas.integer >= options.replicas_to_ack;
}

/// Why @p what (the master @p verb) is not acked: WAIT's answer @p replicas said too few.
[[nodiscard]] inline std::string unconfirmed_text(const StoreContext& store, const Reply& replicas,
                                                  std::string_view what = "commit",
                                                  std::string_view verb = "applied it") {
    const RedisOptions& options = store.options;
    return fmt::format(
        "{} not confirmed: the master on {} {} but {} within {} ms (WAIT {} {}); "
        "a failover now would lose it, so its outcome is unknown and it must not be acked",
        what, store.endpoint().describe(), verb,
        replicas.is_error() ? fmt::format("WAIT failed ({})", replicas.str)
                            : fmt::format("only {} of {} replicas confirmed it", replicas.integer,
                                          options.replicas_to_ack),
        options.replicas_timeout.count(), options.replicas_to_ack,
        options.replicas_timeout.count());
}
/// The same for the record a duplicate's ack rests on.
[[nodiscard]] inline std::string unconfirmed_duplicate_text(const StoreContext& store,
                                                            const Reply& replicas) {
    return unconfirmed_text(store, replicas, "the record a duplicate rests on", "has it");
}

/// The replication mark of (scope, id): `SET <mark> 1 PX 1000`, the write WAIT then confirms.
[[nodiscard]] inline Args replication_mark(const StoreContext& store, std::string_view scope,
                                           std::string_view id) {
    Args mark;
    mark.add("SET").add(store.keys.replication_mark(scope, id)).add("1").add("PX").add(1000);
    return mark;
}

/// With replicas_to_ack, a duplicate is acked on the strength of a record some commit wrote,
/// maybe one whose WAIT timed out (failed, redelivered, and now found on the master): if the
/// master died before its replicas got it, the ack would lose the message. So a write of this
/// connection follows the record (a mark that expires in a second) and WAIT confirms it; the
/// replication stream is in order, so a replica that has the mark has the record. One mark
/// per hash slot (one in all on a standalone server), in a round trip of its own: only
/// duplicates pay it. @throws commit_unconfirmed when fewer replicas confirmed it.
inline void confirm_duplicates(StoreContext& store, const std::vector<HeldClaim>& held,
                               const std::vector<ClaimResult>& results) {
    const std::optional<Args> wait = wait_command(store.options);
    if (!wait) return;
    std::map<std::uint16_t, std::pair<std::string, Args>> marks;
    for (std::size_t i = 0; i < results.size(); ++i) {
        // A second copy of this transaction's own claim is not acked (in_progress).
        if (results[i].status != ClaimStatus::duplicate ||
            results[i].recorded == Disposition::in_progress) {
            continue;
        }
        std::string key = store.keys.replication_mark(held[i].scope, held[i].id);
        const std::uint16_t slot = store.slot_of(key);
        marks.emplace(slot, std::make_pair(std::move(key),
                                           replication_mark(store, held[i].scope, held[i].id)));
    }
    for (const auto& [slot, mark] : marks) {
        const std::vector<Args> barrier{mark.second, *wait};
        Reply replicas;
        const Reply written = store.router.on_key(mark.first, [&](Connection& c) {
            std::vector<Reply> replies = c.pipeline(barrier);
            replicas = std::move(replies.at(1));
            return std::move(replies.at(0));  // a redirect here sends both again elsewhere
        });
        if (written.is_error()) {
            throw_reply_error(written,
                              "idem: Redis duplicate's replication mark (SET): " + written.str);
        }
        if (!confirmed(store.options, replicas)) {
            throw commit_unconfirmed(unconfirmed_duplicate_text(store, replicas));
        }
    }
}

}  // namespace redis
IDEM_END_NAMESPACE
