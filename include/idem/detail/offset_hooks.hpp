#pragma once
/// @file
/// @brief idem::detail::OffsetHooks: a transaction's attached StoredOffset commit hooks
/// (contract/stored_offset.hpp) and what its commit writes for them, written once for the stores
/// that keep offsets (MemoryStore and the SQL stores). Core header: the standard library only.
///
/// The transaction tells it which messages it claimed (claimed(): a claim was asked for, new or
/// duplicate) and which it parked as dead letters (dead_lettered(), undone by a rollback to a
/// savepoint). At commit, plan() keeps a hook when its message (CommitHook::scope, message_id)
/// was not parked in this transaction, and either was not claimed in it at all (a transaction
/// holding only the hook) or holds a claim of this transaction with a recorded outcome (asked
/// of the store: `settled(scope, id)`); a duplicate, or a batch message whose claim was rolled
/// back or given back, is left out. The kept offsets are merged per (group, topic, partition),
/// the greatest winning; the store upserts them (greatest wins again against the stored one)
/// before its commit, and acknowledge() sets acked_in_commit on the kept hooks after it.
///
/// Claims and dead letters are only noted while a hook is attached: attach hooks right after
/// begin(), as the handler does.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/stored_offset.hpp"

IDEM_BEGIN_NAMESPACE
namespace detail {

class OffsetHooks {
  public:
    /// What a commit writes: one offset per (group, topic, partition), and the hooks it honours.
    struct Plan {
        std::vector<StoredOffset> offsets;
        std::vector<CommitHook*> hooks;
    };

    /// @brief Keeps @p hook when its request is a StoredOffset (and clears acked_in_commit).
    /// @return whether it was kept.
    bool attach(CommitHook& hook) {
        if (hook.request_as<StoredOffset>() == nullptr) return false;
        hook.acked_in_commit = false;
        hooks_.push_back(&hook);
        return true;
    }

    [[nodiscard]] bool empty() const noexcept { return hooks_.empty(); }

    /// A claim of (scope, id) was asked for (whatever its answer).
    void claimed(std::string_view scope, std::string_view id) {
        if (!hooks_.empty()) claimed_.emplace_back(std::string(scope), std::string(id));
    }

    /// (scope, id) was parked as a dead letter.
    void dead_lettered(std::string_view scope, std::string_view id) {
        if (!hooks_.empty()) parked_.emplace_back(std::string(scope), std::string(id));
    }

    void savepoint() { marks_.push_back(parked_.size()); }
    /// Dead letters parked since the latest savepoint are gone with it.
    void rollback_to_savepoint() {
        if (marks_.empty()) return;
        parked_.resize(std::min(parked_.size(), marks_.back()));
        marks_.pop_back();
    }
    void release_savepoint() {
        if (!marks_.empty()) marks_.pop_back();
    }

    /// @brief The offsets to write at commit and their hooks (see the file comment).
    /// @p settled(scope, id): this transaction holds a claim of it with a recorded outcome.
    template <class Settled>
    [[nodiscard]] Plan plan(Settled&& settled) const {
        Plan plan;
        if (hooks_.empty()) return plan;
        std::vector<Key> claimed = claimed_;
        std::vector<Key> parked = parked_;
        std::sort(claimed.begin(), claimed.end());
        std::sort(parked.begin(), parked.end());
        const auto holds = [](const std::vector<Key>& keys, const CommitHook& hook) {
            return std::binary_search(keys.begin(), keys.end(), Key{hook.scope, hook.message_id});
        };
        for (CommitHook* hook : hooks_) {
            const StoredOffset* offset = hook->request_as<StoredOffset>();
            if (offset == nullptr || holds(parked, *hook)) continue;
            if (holds(claimed, *hook) && !settled(hook->scope, hook->message_id)) continue;
            plan.hooks.push_back(hook);
            auto same = std::find_if(
                plan.offsets.begin(), plan.offsets.end(), [offset](const StoredOffset& o) {
                    return o.partition == offset->partition && o.topic == offset->topic &&
                           o.group == offset->group;
                });
            if (same == plan.offsets.end()) {
                plan.offsets.push_back(*offset);
            } else {
                same->next_offset = std::max(same->next_offset, offset->next_offset);
            }
        }
        return plan;
    }

    /// After the commit succeeded: its hooks were done in it.
    static void acknowledge(const Plan& plan) noexcept {
        for (CommitHook* hook : plan.hooks)
            hook->acked_in_commit = true;
    }

    void clear() noexcept {
        hooks_.clear();
        claimed_.clear();
        parked_.clear();
        marks_.clear();
    }

  private:
    using Key = std::pair<std::string, std::string>;  ///< scope, message id

    std::vector<CommitHook*> hooks_;
    std::vector<Key> claimed_;
    std::vector<Key> parked_;
    std::vector<std::size_t> marks_;  ///< parked_.size() at each open savepoint
};

}  // namespace detail
IDEM_END_NAMESPACE
