#pragma once
/// @file
/// @brief idem::postgres::Claims: how idem's PostgreSQL driver claims message ids inside its
/// transaction: one id (INSERT ... ON CONFLICT DO NOTHING, the stored outcome read when the row
/// exists) or a batch in one statement, with a savepoint around a batch's claims so that a lock
/// timeout undoes only them. Mixed into postgres::Driver (postgres/driver.hpp), whose queue of
/// commands and round trips it uses. Link idem::postgres.

#include <libpq-fe.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/blob.hpp"
#include "idem/config.hpp"
#include "idem/contract/store.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"
#include "idem/postgres/libpq.hpp"
#include "idem/sql/own_claims.hpp"
#include "idem/sql/statements.hpp"
#include "idem/sql/stored_outcome.hpp"

IDEM_BEGIN_NAMESPACE
namespace postgres {

/// @brief The claims of postgres::Driver @p D (a base of it, which it befriends): claim() and
/// claim_many() of the SQL driver contract (sql/driver.hpp).
template <class D>
class Claims {
  public:
    /// INSERT ... ON CONFLICT DO NOTHING of the claim: claimed when the row went in (added to @p
    /// claims), in_progress when another transaction holds the id past lock_timeout, else the
    /// stored duplicate.
    ClaimResult claim(sql::OwnClaims& claims, std::string_view scope, std::string_view id,
                      std::string_view fingerprint, std::int64_t now) {
        return insert_claim(claims, now, scope, id, fingerprint, false);
    }
    /// The claims of @p ids in one statement (each distinct new id once, in id order), with the
    /// results in order as claim() one by one would give them.
    std::vector<ClaimResult> claim_many(sql::OwnClaims& claims, std::string_view scope,
                                        const std::vector<std::string_view>& ids,
                                        const std::vector<std::string>& fingerprints,
                                        std::int64_t now);

  private:
    D& driver() noexcept { return static_cast<D&>(*this); }

    /// The advisory lock key of a claim of partitioned claims: the scope's length, the scope
    /// and the id hashed, so no two (scope, id) pairs are written alike.
    static std::int64_t claim_lock_key(std::string_view scope, std::string_view id) {
        std::string key = std::to_string(scope.size());
        key.push_back(':');
        key.append(scope);
        key.append(id);
        return postgres::advisory_key("idem claim", key);
    }

    /// One id not claimed by this transaction before: insert, or read the stored claim. With
    /// @p guarded, inside its own savepoint, so a lock timeout leaves the transaction usable.
    ClaimResult insert_claim(sql::OwnClaims& claims, std::int64_t now, std::string_view scope,
                             std::string_view id, std::string_view fingerprint, bool guarded);
    /// A stored claim as a duplicate: outcome and fingerprint columns of @p row.
    static ClaimResult stored_claim(const PGresult* result, int row, int outcome_column,
                                    int fingerprint_column);

    // Around claims of a batch, so a lock timeout undoes only them (not the transaction).
    std::string claim_savepoint_sql_ = "SAVEPOINT idem_claims";
    std::string claim_rollback_to_sql_ = "ROLLBACK TO SAVEPOINT idem_claims";
    std::string claim_release_sql_ = "RELEASE SAVEPOINT idem_claims";
};

template <class D>
ClaimResult Claims<D>::stored_claim(const PGresult* result, int row, int outcome_column,
                                    int fingerprint_column) {
    return sql::stored_duplicate(postgres::bytes_of(result, row, outcome_column),
                                 postgres::bytes_of(result, row, fingerprint_column), "postgres");
}

template <class D>
ClaimResult Claims<D>::insert_claim(sql::OwnClaims& claims, std::int64_t now,
                                    std::string_view scope, std::string_view id,
                                    std::string_view fingerprint, bool guarded) {
    D& d = driver();
    const auto end_guard = [&] {
        if (guarded) d.queued_.push_back(d.control(claim_release_sql_, "claim"));
    };
    // Rarely more than one pass: only when the row we waited for vanished again (purge).
    for (int attempt = 0; attempt < 3; ++attempt) {
        if (guarded) d.queued_.push_back(d.control(claim_savepoint_sql_, "claim"));
        std::vector<Command> commands;
        const bool locked = d.claims_partitioned();
        if (locked) {
            commands.push_back(d.own(sql::stmt::claim_lock, "claim", claim_lock_key(scope, id)));
        }
        commands.push_back(d.own(locked ? sql::stmt::claim_insert_locked : sql::stmt::claim_insert,
                                 "claim", Blob{scope}, Blob{id}, now, Blob{fingerprint}));
        const std::size_t last = commands.size() - 1;
        auto exchange = d.tx_exchange(std::move(commands));
        for (std::size_t k = 0; k <= last; ++k) {
            const PGresult* answer = exchange.result(k);
            if (postgres::succeeded(answer)) continue;
            if (postgres::sqlstate(answer) == "55P03") {
                // Another live transaction holds this id past lock_timeout, and PostgreSQL
                // aborted ours: back to the savepoint, or the caller rolls it back.
                ClaimResult result;
                result.status = ClaimStatus::in_progress;
                if (guarded) {
                    d.queued_.push_back(d.control(claim_rollback_to_sql_, "claim (lock timeout)"));
                    end_guard();
                    return result;
                }
                d.tx_error_ = fmt::format(
                    "idem postgres: claim waited {} ms (lock_timeout) for another transaction "
                    "holding the same id",
                    d.lock_timeout_.count());
                return result;
            }
            // 42P10: no unique index for ON CONFLICT: the claims were made partitions since.
            if (postgres::sqlstate(answer) == "42P10") d.claims_table_changed();
            d.fail(exchange.command(k), answer, "claim");
        }
        const PGresult* inserted = exchange.result(last);
        if (postgres::affected_rows(inserted) == 1) {
            claims.add(scope, id, fingerprint);
            end_guard();
            return ClaimResult{};  // claimed
        }
        // The row exists: committed before, or while we waited (a new statement sees it).
        auto again = d.tx_exchange(
            D::vec(d.own(sql::stmt::claim_outcome, "claim (reading the recorded outcome)",
                         Blob{scope}, Blob{id})));
        if (!postgres::succeeded(again.result(0))) {
            d.fail(again.command(0), again.result(0), "claim (reading the outcome)");
        }
        end_guard();
        if (PQntuples(again.result(0)) > 0) return stored_claim(again.result(0), 0, 0, 1);
    }
    throw store_unavailable(
        "idem postgres: claim: the conflicting claim kept disappearing (purged while claiming?)");
}

template <class D>
std::vector<ClaimResult> Claims<D>::claim_many(sql::OwnClaims& claims, std::string_view scope,
                                               const std::vector<std::string_view>& ids,
                                               const std::vector<std::string>& fingerprints,
                                               std::int64_t now) {
    D& d = driver();
    const auto fingerprint = [&](std::size_t i) {
        return fingerprints.empty() ? std::string_view() : std::string_view(fingerprints[i]);
    };
    std::vector<ClaimResult> results(ids.size());
    // The ids to insert: not claimed by this transaction before; each distinct id once, with
    // the index of its first copy (whose fingerprint goes with it), sorted by id.
    std::vector<std::size_t> pending;
    pending.reserve(ids.size());
    const bool had_claims = claims.size() > 0;
    for (std::size_t i = 0; i < ids.size(); ++i) {
        const auto* own = had_claims ? claims.find(scope, ids[i]) : nullptr;
        if (own != nullptr) {
            results[i] = sql::OwnClaims::duplicate_of(*own);
        } else {
            pending.push_back(i);
        }
    }
    if (pending.empty()) return results;
    std::vector<std::size_t> order = pending;
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return ids[a] < ids[b]; });
    std::vector<std::size_t> first(ids.size());  // index of the first copy of ids[i]'s id
    std::vector<std::string_view> distinct;
    std::vector<std::string_view> distinct_fingerprints;
    distinct.reserve(order.size());
    for (std::size_t k = 0; k < order.size(); ++k) {
        const std::size_t i = order[k];
        if (k > 0 && ids[order[k - 1]] == ids[i]) {
            first[i] = first[order[k - 1]];
            continue;
        }
        first[i] = i;
        distinct.push_back(ids[i]);
        if (!fingerprints.empty()) distinct_fingerprints.push_back(fingerprint(i));
    }

    // One round trip (with the queued BEGIN): the savepoint, the ids' locks when the claims are
    // partitioned, and the INSERT of every id.
    d.queued_.push_back(d.control(claim_savepoint_sql_, "claim_many"));
    std::vector<Command> commands;
    const bool locked = d.claims_partitioned();
    if (locked) {
        // In key order: two batches wait on one another in one order, never in a cycle.
        std::vector<std::int64_t> keys;
        keys.reserve(distinct.size());
        for (std::string_view id : distinct)
            keys.push_back(claim_lock_key(scope, id));
        std::sort(keys.begin(), keys.end());
        Command lock = d.own(sql::stmt::claim_locks, "claim_many");
        postgres::add_int8_array(lock, keys);
        commands.push_back(std::move(lock));
    }
    Command insert = d.own(locked ? sql::stmt::claim_rows_locked : sql::stmt::claim_rows,
                           "claim_many", Blob{scope}, now);
    postgres::add_bytea_array(insert, distinct);
    postgres::add_bytea_array(insert, distinct_fingerprints);
    commands.push_back(std::move(insert));
    const std::size_t last = commands.size() - 1;
    auto exchange = d.tx_exchange(std::move(commands));
    const PGresult* inserted = exchange.result(last);
    const PGresult* refused = nullptr;  // the first statement that failed
    for (std::size_t k = 0; k <= last && refused == nullptr; ++k) {
        if (!postgres::succeeded(exchange.result(k))) {
            refused = exchange.result(k);
            if (postgres::sqlstate(refused) == "42P10") d.claims_table_changed();
            if (postgres::sqlstate(refused) != "55P03")
                d.fail(exchange.command(k), refused, "claim_many");
        }
    }
    if (refused != nullptr) {
        // It waited past lock_timeout for an id another transaction holds; which one, the
        // error does not say. Undo the INSERT, then claim one id at a time, each in its own
        // savepoint. A repeated copy of an id held elsewhere is not waited for twice.
        d.queued_.push_back(d.control(claim_rollback_to_sql_, "claim_many (lock timeout)"));
        d.queued_.push_back(d.control(claim_release_sql_, "claim_many"));
        for (std::size_t i : pending) {
            if (first[i] != i && results[first[i]].status == ClaimStatus::in_progress) {
                results[i] = results[first[i]];
            } else if (const auto* own = claims.find(scope, ids[i])) {
                results[i] = sql::OwnClaims::duplicate_of(*own);
            } else {
                results[i] = insert_claim(claims, now, scope, ids[i], fingerprint(i), true);
            }
        }
        return results;
    }
    d.queued_.push_back(d.control(claim_release_sql_, "claim_many"));

    // Claimed: the first copy of each inserted id (added in the batch's order, the order the
    // handler records outcomes in); later copies are this transaction's duplicates.
    std::unordered_set<std::string_view> fresh;
    const int rows = PQntuples(inserted);
    fresh.reserve(static_cast<std::size_t>(rows));
    for (int row = 0; row < rows; ++row) {
        fresh.emplace(PQgetvalue(inserted, row, 0),
                      static_cast<std::size_t>(PQgetlength(inserted, row, 0)));
    }
    std::vector<std::string_view> stored;  // distinct ids that were there already
    for (std::size_t i : pending) {
        if (fresh.count(ids[i]) == 0) {
            if (first[i] == i) stored.push_back(ids[i]);
        } else if (first[i] == i) {
            claims.add(scope, ids[i], fingerprint(i));
            results[i] = ClaimResult{};  // claimed
        } else {
            results[i] = sql::OwnClaims::duplicate_of(*claims.find(scope, ids[i]));
        }
    }
    if (static_cast<std::size_t>(rows) < distinct.size()) {
        // The rest exist: read their outcomes (a new statement: it also sees claims that
        // committed while the INSERT waited).
        Command read = d.own(sql::stmt::claim_rows_outcome,
                             "claim_many (reading the recorded outcomes)", Blob{scope});
        postgres::add_bytea_array(read, stored);
        auto again = d.tx_exchange(D::vec(std::move(read)));
        const PGresult* found = again.result(0);
        if (!postgres::succeeded(found)) {
            d.fail(again.command(0), found, "claim_many (reading the outcomes)");
        }
        std::unordered_map<std::string_view, ClaimResult> recorded;
        recorded.reserve(stored.size());
        for (int row = 0; row < PQntuples(found); ++row) {
            recorded.emplace(std::string_view(PQgetvalue(found, row, 0),
                                              static_cast<std::size_t>(PQgetlength(found, row, 0))),
                             stored_claim(found, row, 1, 2));
        }
        for (std::size_t i : pending) {
            if (fresh.count(ids[i]) != 0) continue;
            const auto it = recorded.find(ids[i]);
            if (it != recorded.end()) {
                results[i] = it->second;
            } else if (const auto* own = claims.find(scope, ids[i])) {
                results[i] = sql::OwnClaims::duplicate_of(*own);
            } else {
                // Gone again since the INSERT (purged): claim it like claim() would.
                results[i] = insert_claim(claims, now, scope, ids[i], fingerprint(i), true);
            }
        }
    }
    return results;
}

}  // namespace postgres
IDEM_END_NAMESPACE
