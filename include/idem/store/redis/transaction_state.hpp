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
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/store.hpp"
#include "idem/redis/hash_slot.hpp"
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

/// @brief One transaction's claims and queued work, and the rules that keep them consistent:
/// every queued write has its place (its key's hash slot and the claim of the message it was
/// queued for) decided once, when it is queued; a savepoint trims claims, dead letters, writes
/// and their places together; a claim is held once. The parts read it through its accessors and
/// change it only through these operations.
class TransactionState {
  public:
    /// Where a queued write goes: its key's hash slot, and the claim of its message. On one
    /// server every write runs with the commit; on a Cluster, with its claim's slot group.
    struct WritePlace {
        Args::Mark end;  ///< where its encoding ends in commands()
        /// The hash slot of its key.
        std::uint16_t slot;
        std::string owner;  ///< the claim key of the message it was queued for; empty: none
    };

    TransactionState() = default;
    /// A transaction fenced by @p token, leasing its claims for @p lease and keeping finished
    /// ones for @p retention.
    TransactionState(std::string token, std::chrono::milliseconds lease,
                     std::chrono::seconds retention)
        : token_(std::move(token)), lease_(lease), retention_(retention) {}

    // --- Terms ---------------------------------------------------------------------------------
    /// This transaction's lease token: a lease is ours when it carries it.
    [[nodiscard]] const std::string& token() const noexcept { return token_; }
    /// How long its claims are leased (ClaimTerms::lease).
    [[nodiscard]] std::chrono::milliseconds lease() const noexcept { return lease_; }
    /// How long a finished claim is kept, in milliseconds, as the scripts take it.
    [[nodiscard]] long long retention_ms() const {
        return std::chrono::duration_cast<std::chrono::milliseconds>(retention_).count();
    }
    /// A policy's terms: @p lease, and @p retention unless it is zero (the store's then).
    void set_terms(std::chrono::milliseconds lease, std::chrono::seconds retention) {
        lease_ = lease;
        if (retention.count() > 0) retention_ = retention;
    }

    // --- Claims --------------------------------------------------------------------------------
    /// The claims held, in claim order.
    [[nodiscard]] const std::vector<HeldClaim>& claims() const noexcept { return claims_; }
    /// Whether the claim on (scope, id) is held.
    [[nodiscard]] bool holds(std::string_view scope, std::string_view id) const {
        return find_held(scope, id) < claims_.size();
    }
    /// The claim held on (scope, id); null when it is not held.
    [[nodiscard]] const HeldClaim* held(std::string_view scope, std::string_view id) const {
        const std::size_t index = find_held(scope, id);
        return index < claims_.size() ? &claims_[index] : nullptr;
    }
    /// A claim taken: this transaction now holds its lease.
    void hold(HeldClaim claim) { claims_.push_back(std::move(claim)); }

    /// A claim this transaction already holds is a duplicate, still in progress.
    [[nodiscard]] std::optional<ClaimResult> own_claim(std::string_view scope,
                                                       std::string_view id) const {
        const std::size_t index = find_held(scope, id);
        if (index == claims_.size()) return std::nullopt;
        ClaimResult own;
        own.status = ClaimStatus::duplicate;
        own.recorded = Disposition::in_progress;
        own.fingerprint = claims_[index].fingerprint;
        return own;
    }

    /// Records @p outcome (a Disposition's name, static text) and @p reason on the claim held on
    /// (scope, id); false when it is not held.
    bool record_outcome(std::string_view scope, std::string_view id, std::string_view outcome,
                        std::string_view reason) {
        const std::size_t index = find_held(scope, id);
        if (index == claims_.size()) return false;
        claims_[index].outcome = outcome;
        claims_[index].reason = std::string(reason);
        return true;
    }

    /// The claim key of the message whose effect is running: the first claim held without an
    /// outcome (claims are recorded in order); empty when there is none.
    [[nodiscard]] std::string current_owner() const {
        for (const HeldClaim& held : claims_) {
            if (held.outcome.empty()) return held.key;
        }
        return {};
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
        if (index == claims_.size()) return;
        released_.push_back(claims_[index].key);
        claims_.erase(claims_.begin() + static_cast<std::ptrdiff_t>(index));
        for (auto& mark : savepoints_)
            mark.claims = std::min(mark.claims, claims_.size());
    }

    /// The commit went through: no lease of it is ours any more (its claims are done, the
    /// leases it freed are free, and a claim it sent was answered in it), whatever its
    /// replicas say.
    void forget_committed() noexcept {
        claims_.clear();
        released_.clear();
        unstarted_.clear();
    }
    /// The claims held carry no lease of ours to release (the commit script parked them, or
    /// claim_and_commit() held one only to say its outcome); the freed leases still are ours.
    void forget_claims() noexcept { claims_.clear(); }
    /// A Cluster commit settled the claims of @p done (one flag per claim, in claim order);
    /// the others stay held, to be released. With @p all_done, the freed leases went too.
    void forget_done(const std::vector<bool>& done, bool all_done) {
        std::vector<HeldClaim> left;
        for (std::size_t i = 0; i < claims_.size(); ++i) {
            if (i >= done.size() || !done[i]) left.push_back(std::move(claims_[i]));
        }
        claims_ = std::move(left);
        if (all_done) released_.clear();
    }

    /// The keys of the leases unclaim()ed, freed by the commit.
    [[nodiscard]] const std::vector<std::string>& released() const noexcept { return released_; }

    /// Whether the transaction holds claims, dead letters or freed leases (a claim_and_commit()
    /// needs a transaction that holds none).
    [[nodiscard]] bool holds_anything() const noexcept {
        return !claims_.empty() || !letters_.empty() || !released_.empty();
    }

    // --- Leases whose effect never started ----------------------------------------------------
    /// Keys this transaction may hold a lease on whose effect never started (a pipelined claim
    /// whose answer was lost): released at rollback with their attempt taken back.
    [[nodiscard]] const std::vector<std::string>& unstarted() const noexcept { return unstarted_; }
    /// A claim sent whose answer is not read yet: until it is, its lease is unstarted.
    void claim_unanswered(std::string key) { unstarted_.push_back(std::move(key)); }
    /// Every claim sent was answered (a claim now held is in claims()).
    void claims_answered() noexcept { unstarted_.clear(); }

    // --- Dead letters --------------------------------------------------------------------------
    /// Dead letters to add at the commit.
    [[nodiscard]] const std::vector<DeadLetter>& letters() const noexcept { return letters_; }
    /// Queues @p letter for the commit.
    void add_letter(DeadLetter letter) { letters_.push_back(std::move(letter)); }

    // --- Writes --------------------------------------------------------------------------------
    /// Queues one write, encoded as the commit script reads it ({argc, args...}), with its place:
    /// the slot of its key (argument 1) and the claim of the message whose effect runs now.
    template <class... Parts>
    void queue_write(const Parts&... parts) {
        static_assert(sizeof...(Parts) > 0, "idem: a write needs a command");
        std::uint16_t slot = 0;
        if constexpr (sizeof...(Parts) > 1) {
            const auto& key = std::get<1>(std::tie(parts...));
            using Key = std::decay_t<decltype(key)>;
            if constexpr (std::is_same_v<Key, Blob>) {
                slot = hash_slot(std::string_view(key.bytes));
            } else if constexpr (std::is_convertible_v<const Key&, std::string_view>) {
                slot = hash_slot(std::string_view(key));  // not copied
            } else {
                slot = hash_slot(to_arg(key));
            }
        }
        commands_.add(sizeof...(Parts));
        (commands_.add(parts), ...);
        ++command_count_;
        write_places_.push_back(WritePlace{commands_.mark(), slot, current_owner()});
    }
    /// The queued writes, encoded for the commit script.
    [[nodiscard]] const Args& commands() const noexcept { return commands_; }
    /// How many writes are queued in commands().
    [[nodiscard]] std::size_t command_count() const noexcept { return command_count_; }
    /// One place per queued write, in order.
    [[nodiscard]] const std::vector<WritePlace>& write_places() const noexcept {
        return write_places_;
    }
    /// Whether every write queued so far has its key in @p slot.
    [[nodiscard]] bool writes_in(std::uint16_t slot) const {
        for (const WritePlace& place : write_places_) {
            if (place.slot != slot) return false;
        }
        return true;
    }

    // --- Hooks and locks -----------------------------------------------------------------------
    /// The attach()ed stream acks, done by the commit.
    [[nodiscard]] const std::vector<CommitHook*>& hooks() const noexcept { return hooks_; }
    /// Attaches @p hook: the commit acks its message.
    void attach(CommitHook& hook) { hooks_.push_back(&hook); }
    /// Keys of the try_lock()s taken, released at the end.
    [[nodiscard]] const std::vector<std::string>& locks() const noexcept { return locks_; }
    /// A try_lock() taken on @p key.
    void add_lock(std::string key) { locks_.push_back(std::move(key)); }

    // --- Savepoints ----------------------------------------------------------------------------
    /// Whether a savepoint is open.
    [[nodiscard]] bool has_savepoint() const noexcept { return !savepoints_.empty(); }
    /// Opens a savepoint: remembers how much of each list there is now.
    void savepoint() {
        savepoints_.push_back(
            Mark{commands_.mark(), command_count_, letters_.size(), claims_.size()});
    }
    /// Drops what was queued since the latest savepoint (writes with their places, dead letters,
    /// claims); returns the keys of the claims taken since then, whose leases the caller frees.
    std::vector<std::string> rollback_to_savepoint() {
        const Mark mark = savepoints_.back();
        savepoints_.pop_back();
        commands_.truncate(mark.commands);
        command_count_ = mark.command_count;
        write_places_.resize(command_count_);
        letters_.resize(mark.letters);
        std::vector<std::string> keys;
        for (std::size_t i = mark.claims; i < claims_.size(); ++i)
            keys.push_back(claims_[i].key);
        if (claims_.size() > mark.claims) claims_.resize(mark.claims);
        return keys;
    }
    /// Drops the latest savepoint, keeping what followed it.
    void release_savepoint() { savepoints_.pop_back(); }

    // --- The end -------------------------------------------------------------------------------
    /// The keys of every lease still this transaction's: unclaim()ed, then held.
    [[nodiscard]] std::vector<std::string> lease_keys() const {
        std::vector<std::string> keys = released_;
        for (const auto& held : claims_)
            keys.push_back(held.key);
        return keys;
    }

    /// Empties what the transaction holds (its end: committed or rolled back).
    void clear() noexcept {
        claims_.clear();
        released_.clear();
        unstarted_.clear();
        locks_.clear();
        hooks_.clear();
        write_places_.clear();
    }

  private:
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

    /// The index of the claim held on (scope, id), or claims_.size(). Starts after the last one
    /// found: a batch records its outcomes in claim order, so each search is one step, not a
    /// scan (which made a batch of N cost N * N / 2 comparisons).
    [[nodiscard]] std::size_t find_held(std::string_view scope, std::string_view id) const {
        const std::size_t n = claims_.size();
        for (std::size_t k = 0; k < n; ++k) {
            const std::size_t i = (last_found_ + 1 + k) % n;
            if (claims_[i].id == id && claims_[i].scope == scope) {
                last_found_ = i;
                return i;
            }
        }
        return n;
    }

    std::string token_;
    std::chrono::milliseconds lease_{};
    std::chrono::seconds retention_{};
    std::vector<HeldClaim> claims_;
    std::vector<DeadLetter> letters_;
    Args commands_;
    std::size_t command_count_ = 0;
    std::vector<WritePlace> write_places_;  // one per queued write: the invariant of queue_write()
    std::vector<Mark> savepoints_;          // innermost last
    std::vector<std::string> locks_;
    std::vector<std::string> released_;
    std::vector<std::string> unstarted_;
    std::vector<CommitHook*> hooks_;
    mutable std::size_t last_found_ = 0;  // find_held()'s hint
};

}  // namespace redis
IDEM_END_NAMESPACE
