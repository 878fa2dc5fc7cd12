#pragma once
/// @file
/// @brief The claims a SQL transaction inserted itself. Their rows say 'processed' from the
/// start, so the common outcome costs no UPDATE; the store remembers which got an outcome (and
/// at which savepoint depth, so a rollback to a savepoint forgets it again) and marks the others
/// 'claimed' at commit. It also answers a second claim of the same id in the transaction
/// without asking the database. SQL stores only (namespace idem::sql); it knows the core
/// contract (idem/contract/store.hpp) and nothing above it.

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "idem/config.hpp"
#include "idem/contract/records.hpp"

IDEM_BEGIN_NAMESPACE
namespace sql {

/// @brief The claims one SQL transaction inserted, with the savepoint depth each outcome was
/// recorded at (see the file comment); cleared when the transaction ends.
class OwnClaims {
  public:
    /// @brief One claim this transaction inserted.
    struct Claim {
        /// The policy scope.
        std::string scope;
        /// The message id.
        std::string id;
        /// Stored with the claim; a second claim's duplicate answers it.
        std::string fingerprint;
        int recorded_depth = -1;  ///< savepoint depth its outcome was recorded at; -1: none
    };

    /// The claim of (scope, id) this transaction made, or null. A batch records outcomes in
    /// claim order, so the search starts after the last one found.
    Claim* find(std::string_view scope, std::string_view id) noexcept {
        const std::size_t n = claims_.size();
        for (std::size_t k = 0; k < n; ++k) {
            const std::size_t i = (hint_ + k) % n;
            Claim& claim = claims_[i];
            if (claim.id == id && claim.scope == scope) {
                hint_ = i + 1;
                return &claim;
            }
        }
        return nullptr;
    }

    /// A second claim of an id this transaction holds: a duplicate still in progress.
    static ClaimResult duplicate_of(const Claim& claim) {
        ClaimResult result;
        result.status = ClaimStatus::duplicate;
        result.recorded = Disposition::in_progress;
        result.fingerprint = claim.fingerprint;
        return result;
    }

    /// Remembers a claim the transaction just inserted (its row says 'processed', no outcome
    /// recorded yet).
    void add(std::string_view scope, std::string_view id, std::string_view fingerprint) {
        claims_.push_back(Claim{std::string(scope), std::string(id), std::string(fingerprint), -1});
    }

    /// @return true when the row needs no UPDATE: ours, and the outcome is the row's own.
    bool record(std::string_view scope, std::string_view id, Disposition disposition,
                std::string_view reason, int depth) {
        Claim* claim = find(scope, id);
        if (claim == nullptr) return false;
        recorded_.push_back(Recorded{depth, static_cast<std::size_t>(claim - claims_.data()),
                                     claim->recorded_depth});
        claim->recorded_depth = depth;
        return disposition == Disposition::processed && reason.empty();
    }

    /// @return true when it was ours (the caller deletes the row).
    bool remove(std::string_view scope, std::string_view id) {
        for (std::size_t at = 0; at < claims_.size(); ++at) {
            if (claims_[at].scope != scope || claims_[at].id != id) continue;
            claims_.erase(claims_.begin() + static_cast<std::ptrdiff_t>(at));
            for (auto& mark : marks_)
                mark = std::min(mark, claims_.size());
            // Rare (a batch message that failed): fix the log's positions up.
            recorded_.erase(std::remove_if(recorded_.begin(), recorded_.end(),
                                           [at](const Recorded& r) { return r.claim == at; }),
                            recorded_.end());
            for (auto& entry : recorded_) {
                if (entry.claim > at) --entry.claim;
            }
            hint_ = 0;
            return true;
        }
        return false;
    }

    /// A savepoint opened: claims made from now on go with a rollback to it.
    void savepoint() { marks_.push_back(claims_.size()); }

    /// Claims made since the savepoint at @p depth are gone, outcomes recorded since undone.
    /// Only the log's tail is touched: what was recorded inside the savepoint sits on top.
    void rollback_to_savepoint(int depth) {
        while (!recorded_.empty() && recorded_.back().depth >= depth) {
            const Recorded& entry = recorded_.back();
            if (entry.claim < claims_.size()) claims_[entry.claim].recorded_depth = entry.before;
            recorded_.pop_back();
        }
        if (marks_.empty()) return;
        claims_.resize(std::min(claims_.size(), marks_.back()));
        marks_.pop_back();
        hint_ = 0;
    }

    /// Outcomes recorded inside the released savepoint now belong to the one around it.
    void release_savepoint(int depth) {
        if (!marks_.empty()) marks_.pop_back();
        for (auto it = recorded_.rbegin(); it != recorded_.rend() && it->depth == depth; ++it) {
            it->depth = depth - 1;
            if (claims_[it->claim].recorded_depth == depth)
                claims_[it->claim].recorded_depth = depth - 1;
        }
    }

    /// The claims, in the order they were made (commit() marks those without an outcome 'claimed').
    [[nodiscard]] const std::vector<Claim>& claims() const noexcept { return claims_; }
    /// The claim whose effect runs now: the first without an outcome (outcomes are recorded in
    /// claim order); null when there is none.
    [[nodiscard]] const Claim* current() const noexcept {
        for (const Claim& claim : claims_) {
            if (claim.recorded_depth < 0) return &claim;
        }
        return nullptr;
    }
    /// How many claims the transaction holds.
    [[nodiscard]] std::size_t size() const noexcept { return claims_.size(); }

    /// Forgets everything (the transaction ended).
    void clear() noexcept {
        claims_.clear();
        marks_.clear();
        recorded_.clear();
        hint_ = 0;
    }

  private:
    /// One record() call, so that a rollback to a savepoint can undo it: the depth it was made
    /// at (lowered as savepoints around it are released), the claim's position, and the claim's
    /// recorded_depth before it.
    struct Recorded {
        int depth;
        std::size_t claim;
        int before;
    };

    std::vector<Claim> claims_;
    std::vector<Recorded> recorded_;
    std::vector<std::size_t> marks_;  ///< claims_.size() at each open savepoint
    std::size_t hint_ = 0;
};

}  // namespace sql
IDEM_END_NAMESPACE
