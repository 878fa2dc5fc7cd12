#pragma once
/// @file
/// @brief idem::sqlite::Claims: how idem's SQLite driver claims message ids inside its
/// transaction: one id (INSERT OR IGNORE, the stored outcome read when the row exists) or a batch
/// in multi-row INSERTs of up to 64 rows (RETURNING, when some were there, to tell which went
/// in). Mixed into sqlite::Driver (sqlite/driver.hpp), whose prepared statements it steps. Link
/// idem::sqlite.

#include <sqlite3.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "idem/blob.hpp"
#include "idem/config.hpp"
#include "idem/contract/store.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"
#include "idem/sql/own_claims.hpp"
#include "idem/sql/statements.hpp"
#include "idem/sql/stored_outcome.hpp"
#include "idem/sqlite/statement.hpp"

IDEM_BEGIN_NAMESPACE
namespace sqlite {

/// @brief The claims of sqlite::Driver @p D (a base of it, which it befriends): claim() and
/// claim_many() of the SQL driver contract (sql/driver.hpp).
template <class D>
class Claims {
  public:
    /// INSERT OR IGNORE of the claim: claimed when the row went in (added to @p own), else the
    /// stored duplicate. Under BEGIN IMMEDIATE no other writer is running, so there is no
    /// in_progress. @throws store_unavailable for a SQLite error (store_timeout when busy).
    ClaimResult claim(sql::OwnClaims& own, std::string_view scope, std::string_view id,
                      std::string_view fingerprint, std::int64_t now_ms) {
        D& d = driver();
        if (d.step_own(sql::stmt::claim_insert, "claim", Blob{scope}, Blob{id}, now_ms,
                       Blob{fingerprint}) == 1) {
            own.add(scope, id, fingerprint);
            return ClaimResult{};  // claimed
        }
        // The row exists and was committed by another transaction.
        sqlite3_stmt* stmt = d.prepared(sql::stmt::claim_outcome);
        StatementUse use(stmt, false);
        d.bind_all(stmt, d.statements_[sql::stmt::claim_outcome], D::Kind::idem, Blob{scope},
                   Blob{id});
        const int rc = sqlite3_step(stmt);
        if (rc == SQLITE_DONE) {
            throw store_unavailable(
                "idem sqlite: claim: INSERT OR IGNORE inserted no row, yet no claim exists for "
                "this id (a trigger or constraint on idem_claims?)");
        }
        if (rc != SQLITE_ROW) d.fail(rc, "claim (reading the recorded outcome)", D::Kind::idem);
        return sql::stored_duplicate(column_string(stmt, 0), column_string(stmt, 1), D::name);
    }

    /// The claims of @p ids in order, as claim() one by one would answer them.
    std::vector<ClaimResult> claim_many(sql::OwnClaims& own, std::string_view scope,
                                        const std::vector<std::string_view>& ids,
                                        const std::vector<std::string>& fingerprints,
                                        std::int64_t now);

  private:
    D& driver() noexcept { return static_cast<D&>(*this); }
};

template <class D>
std::vector<ClaimResult> Claims<D>::claim_many(sql::OwnClaims& own_claims_, std::string_view scope,
                                               const std::vector<std::string_view>& ids,
                                               const std::vector<std::string>& fingerprints,
                                               std::int64_t now) {
    D& d = driver();
    auto fingerprint = [&](std::size_t i) {
        return fingerprints.empty() ? std::string_view() : std::string_view(fingerprints[i]);
    };
    std::vector<ClaimResult> results(ids.size());
    std::vector<bool> decided(ids.size(), false);
    const std::size_t claimed_before_call = own_claims_.size();
    auto run = [&](std::size_t start, std::size_t rows, bool returning, auto&& on_row) {
        sqlite3_stmt* stmt = d.claim_rows_statement(rows, returning);
        StatementUse use(stmt, false);
        int rc = bind_value(stmt, 1, Blob{scope});
        if (rc == SQLITE_OK) rc = bind_value(stmt, 2, now);
        for (std::size_t i = 0; i < rows && rc == SQLITE_OK; ++i) {
            rc = bind_value(stmt, static_cast<int>(3 + 2 * i), Blob{ids[start + i]});
            if (rc == SQLITE_OK)
                rc = bind_value(stmt, static_cast<int>(4 + 2 * i), Blob{fingerprint(start + i)});
        }
        if (rc != SQLITE_OK) d.fail(rc, "claim_many (binding)", D::Kind::idem);
        while ((rc = sqlite3_step(stmt)) == SQLITE_ROW)
            on_row(stmt);
        if (rc != SQLITE_DONE) d.fail(rc, "claim_many", D::Kind::idem);
        return static_cast<std::size_t>(sqlite3_changes(d.db_));
    };
    auto claimed = [&](std::size_t i) {
        own_claims_.add(scope, ids[i], fingerprint(i));
        results[i].status = ClaimStatus::claimed;
        decided[i] = true;
    };
    for (std::size_t start = 0; start < ids.size(); start += D::claim_rows_max) {
        const std::size_t rows = std::min(D::claim_rows_max, ids.size() - start);
        // The common chunk, all of it new: a plain INSERT, and every row went in. Otherwise it
        // is undone and the RETURNING form says which rows did (this transaction holds the write
        // lock, so nothing else inserts in between).
        if (claimed_before_call == 0) {
            d.step_own(sql::stmt::savepoint, "claim_many (savepoint)");
            const std::size_t inserted = run(start, rows, false, [](sqlite3_stmt*) {});
            if (inserted == rows) {
                d.step_own(sql::stmt::release_savepoint, "claim_many (release)");
                for (std::size_t i = start; i < start + rows; ++i)
                    claimed(i);
                continue;
            }
            d.step_own(sql::stmt::rollback_to_savepoint, "claim_many (rollback to savepoint)");
            d.step_own(sql::stmt::release_savepoint, "claim_many (release)");
        }
        // Each inserted id is claimed by its first copy in this chunk; later copies, and ids
        // claimed earlier in this transaction, are its own duplicates (RETURNING's row order is
        // not promised, so each row is matched with the first undecided copy of its id).
        run(start, rows, true, [&](sqlite3_stmt* stmt) {
            const auto* bytes = static_cast<const char*>(sqlite3_column_blob(stmt, 0));
            const std::string_view id(bytes == nullptr ? "" : bytes,
                                      static_cast<std::size_t>(sqlite3_column_bytes(stmt, 0)));
            for (std::size_t i = start; i < start + rows; ++i) {
                if (!decided[i] && ids[i] == id) {
                    claimed(i);
                    return;
                }
            }
        });
        for (std::size_t i = start; i < start + rows; ++i) {
            if (decided[i]) continue;
            if (const auto* own = own_claims_.find(scope, ids[i])) {
                results[i] = sql::OwnClaims::duplicate_of(*own);
                decided[i] = true;
            }
        }
    }
    // The rest were committed before: read their outcome like claim() does.
    for (std::size_t i = 0; i < ids.size(); ++i) {
        if (decided[i]) continue;
        if (const auto* mine = own_claims_.find(scope, ids[i])) {
            results[i] = sql::OwnClaims::duplicate_of(*mine);
        } else {
            results[i] = claim(own_claims_, scope, ids[i], fingerprint(i), now);
        }
    }
    return results;
}

}  // namespace sqlite
IDEM_END_NAMESPACE
