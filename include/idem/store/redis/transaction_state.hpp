#pragma once
/// @file
/// @brief idem::redis::TransactionState: what one RedisStore transaction holds until its commit
/// (its leases, dead letters, queued writes, savepoints, locks, attached hooks), and the lookups
/// on it the other parts share. Link idem::redis.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/store.hpp"
#include "idem/redis/resp.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// One claim a transaction holds (or is taking).
struct HeldClaim {
    /// The policy scope.
    std::string scope;
    /// The message id.
    std::string id;
    /// Its claim key (KeyLayout::claim()).
    std::string key;
    /// Stored with the claim.
    std::string fingerprint;
    std::string_view outcome;  ///< a Disposition's name (static text); empty: none yet
    /// Recorded with the outcome.
    std::string reason;
};

/// Commands for a commit script, each as {argc, args...}.
struct Commands {
    /// The commands, each as {argc, args...}, encoded.
    Args args;
    /// How many commands.
    std::size_t count = 0;
    /// Appends @p command (its arguments) as {argc, args...}.
    void add(const std::vector<std::string>& command) {
        args.add(command.size());
        for (const auto& arg : command)
            args.add(arg);
        ++count;
    }
    /// Appends @p command (its arguments) as {argc, args...}.
    void add(std::initializer_list<std::string_view> command) {
        args.add(command.size());
        for (std::string_view arg : command)
            args.add(arg);
        ++count;
    }
    /// One command already encoded as {argc, args...} (@p count of them).
    void add_encoded(std::string_view resp, std::size_t arg_count) {
        args.append_encoded(resp, arg_count);
        ++count;
    }
};

/// @brief One transaction's claims and queued work.
struct TransactionState {
    /// A savepoint: how much of each list it keeps.
    struct Mark {
        /// Where the queued writes' encoding ended.
        Args::Mark commands;
        /// How many writes were queued.
        std::size_t command_count;
        /// How many dead letters.
        std::size_t letters;
        /// How many claims were held.
        std::size_t claims;
    };
    /// Where a queued write goes on a cluster: its key's slot, and the claim of its message.
    struct WritePlace {
        Args::Mark end;  ///< where its encoding ends in commands
        /// The hash slot of its key.
        std::uint16_t slot;
        std::string owner;  ///< the claim key of the message it was queued for; empty: none
    };

    /// This transaction's lease token: a lease is ours when it carries it.
    std::string token;
    /// How long its claims are leased (ClaimTerms::lease).
    std::chrono::milliseconds lease{};
    /// How long a finished claim is kept (ClaimTerms::retention).
    std::chrono::seconds retention{};
    /// The claims held, in claim order.
    std::vector<HeldClaim> claims;
    /// Dead letters to add at the commit.
    std::vector<DeadLetter> letters;
    Args commands;  ///< the queued writes, encoded for the commit script
    /// How many writes are queued in `commands`.
    std::size_t command_count = 0;
    /// The open savepoints, innermost last.
    std::vector<Mark> savepoints;
    /// Keys of the try_lock()s taken, released at the end.
    std::vector<std::string> locks;
    std::vector<std::string> released;  ///< keys of unclaim()ed leases, freed at the end
    /// Keys this transaction may hold a lease on whose effect never started (a pipelined claim
    /// whose answer was lost): released at rollback with their attempt taken back.
    std::vector<std::string> unstarted;
    std::vector<CommitHook*> hooks;        ///< attach()ed stream acks, done by the commit
    std::vector<WritePlace> write_places;  ///< on a cluster: one per queued write
    mutable std::size_t last_found = 0;    ///< find_held()'s hint

    /// `retention` in milliseconds, as the scripts take it.
    [[nodiscard]] long long retention_ms() const {
        return std::chrono::duration_cast<std::chrono::milliseconds>(retention).count();
    }

    /// The index of the claim held on (scope, id), or claims.size(). Starts after the last one
    /// found: a batch records its outcomes in claim order, so each search is one step, not a
    /// scan (which made a batch of N cost N * N / 2 comparisons).
    [[nodiscard]] std::size_t find_held(std::string_view scope, std::string_view id) const {
        const std::size_t n = claims.size();
        for (std::size_t k = 0; k < n; ++k) {
            const std::size_t i = (last_found + 1 + k) % n;
            if (claims[i].id == id && claims[i].scope == scope) {
                last_found = i;
                return i;
            }
        }
        return n;
    }

    /// A claim this transaction already holds is a duplicate, still in progress.
    [[nodiscard]] std::optional<ClaimResult> own_claim(std::string_view scope,
                                                       std::string_view id) const {
        const std::size_t index = find_held(scope, id);
        if (index == claims.size()) return std::nullopt;
        ClaimResult own;
        own.status = ClaimStatus::duplicate;
        own.recorded = Disposition::in_progress;
        own.fingerprint = claims[index].fingerprint;
        return own;
    }

    /// The claim key of the message whose effect is running: the first claim held without an
    /// outcome (claims are recorded in order); empty when there is none.
    [[nodiscard]] std::string current_owner() const {
        for (const HeldClaim& held : claims) {
            if (held.outcome.empty()) return held.key;
        }
        return {};
    }

    /// Whether every write queued so far has its key in @p slot (a write queued before the
    /// store knew it is on a cluster has no known slot: false).
    [[nodiscard]] bool writes_in(std::uint16_t slot) const {
        if (write_places.size() != command_count) return false;
        for (const WritePlace& place : write_places) {
            if (place.slot != slot) return false;
        }
        return true;
    }

    /// The hash tag (`{scope:id}`) of current_owner(); empty when there is none.
    [[nodiscard]] std::string claim_tag() const {
        const std::string owner = current_owner();
        const std::size_t open = owner.find('{');
        const std::size_t close = owner.find('}', open);
        if (open == std::string::npos || close == std::string::npos) return {};
        return owner.substr(open, close - open + 1);
    }

    /// Gives back the claim on (scope, id), if held: its lease is freed at the end.
    void unclaim(std::string_view scope, std::string_view id) {
        const std::size_t index = find_held(scope, id);
        if (index == claims.size()) return;
        released.push_back(claims[index].key);
        claims.erase(claims.begin() + static_cast<std::ptrdiff_t>(index));
        for (auto& mark : savepoints)
            mark.claims = std::min(mark.claims, claims.size());
    }

    /// Opens a savepoint: remembers how much of each list there is now.
    void savepoint() {
        savepoints.push_back(Mark{commands.mark(), command_count, letters.size(), claims.size()});
    }
    /// Drops what was queued since the latest savepoint; returns the keys of the claims taken
    /// since then, whose leases the caller frees.
    std::vector<std::string> rollback_to_savepoint() {
        const Mark mark = savepoints.back();
        savepoints.pop_back();
        commands.truncate(mark.commands);
        command_count = mark.command_count;
        if (write_places.size() > command_count) write_places.resize(command_count);
        letters.resize(mark.letters);
        std::vector<std::string> keys;
        for (std::size_t i = mark.claims; i < claims.size(); ++i)
            keys.push_back(claims[i].key);
        if (claims.size() > mark.claims) claims.resize(mark.claims);
        return keys;
    }

    /// The keys of every lease still this transaction's: unclaim()ed, then held.
    [[nodiscard]] std::vector<std::string> lease_keys() const {
        std::vector<std::string> keys = released;
        for (const auto& held : claims)
            keys.push_back(held.key);
        return keys;
    }

    /// Empties what the transaction holds (its end: committed or rolled back).
    void clear() noexcept {
        claims.clear();
        released.clear();
        unstarted.clear();
        locks.clear();
        hooks.clear();
        write_places.clear();
    }
};

}  // namespace redis
IDEM_END_NAMESPACE
