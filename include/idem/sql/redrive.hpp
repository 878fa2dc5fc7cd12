#pragma once
/// @file
/// @brief The SQL stores' dead letters brought back, written once (sql::redrive_core):
/// basic_store::dead_letters(selection) and redrive() (sql/store.hpp) over the statements of
/// sql/statements.hpp (the same in every dialect but for MySQL's hashed keys). Each entry is
/// redriven in one transaction of its own: the entry is marked redriven (only if it was not:
/// the row lock makes a concurrent redrive wait, then find it done), the claim is deleted only
/// if it still records dead_lettered (a claim processed meanwhile is left alone), the message's
/// attempt count goes (a fresh poison limit), and the outbox intent that re-publishes the
/// payload under the message id is written, or re-armed when that key is there from an earlier
/// redrive. All of it commits, or none of it.

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/blob.hpp"
#include "idem/config.hpp"
#include "idem/contract/records.hpp"
#include "idem/contract/redrive.hpp"
#include "idem/contract/time.hpp"
#include "idem/error.hpp"
#include "idem/sql/driver.hpp"
#include "idem/sql/statements.hpp"
#include "idem/sql/support.hpp"

IDEM_BEGIN_NAMESPACE
namespace sql {

/// Reads the dead-letter columns (sql::dead_letter_columns) of one row.
template <class Row>
DeadLetter read_dead_letter(const Row& row) {
    DeadLetter letter;
    letter.id = row.int64(0);
    letter.scope = row.bytes(1);
    letter.message_id = row.bytes(2);
    letter.delivery_count = to_count(row.int64(3));
    letter.reason = row.bytes(4);
    letter.payload = row.bytes(5);
    letter.created_at = from_unix_ms(row.int64(6));
    letter.redrive_count = to_count(row.int64(7));
    if (!row.is_null(8)) letter.redriven_at = from_unix_ms(row.int64(8));
    if (!row.is_null(9)) letter.origin = row.bytes(9);  // NULL: a MySQL row of version 4
    if (!row.is_null(10)) letter.origin_position = row.bytes(10);
    if (!row.is_null(11)) letter.failure = row.bytes(11);
    if (!row.is_null(12)) letter.first_failed_at = from_unix_ms(row.int64(12));
    if (!row.is_null(13)) letter.last_failed_at = from_unix_ms(row.int64(13));
    return letter;
}

/// The dead letters' listing and redrive of basic_store<Driver> (its friend: it takes the
/// store's lock and runs the driver's statements).
struct redrive_core {
    /// basic_store::outbox_rows(): the outbox columns @p statement selects with @p args.
    template <class Store, class... Args>
    static std::vector<OutboxRow> outbox_rows(Store& store, stmt statement, const Args&... args) {
        typename Store::Lock lock(store, "outbox_rows()");
        std::vector<OutboxRow> rows;
        store.driver_.run(
            statement, "outbox_rows", access::read,
            [&](const auto& row) { rows.push_back(read_outbox_row(row)); }, args...);
        return rows;
    }

    /// One more attempt at (@p scope, @p id), the count returned (this one included): on its own,
    /// committed at once (@p tx null: basic_store::count_attempt), or inside @p tx, committed with
    /// it (basic_transaction::count_attempt: CountAhead). A dialect without RETURNING answers the
    /// upsert with no row, and the count is read back on the same connection.
    template <class Driver, class Tx>
    static std::uint32_t count_attempt(Driver& driver, Tx* tx, std::string_view scope,
                                       std::string_view id, std::int64_t now_ms) {
        std::optional<std::int64_t> count;
        const auto take = [&](const auto& row) { count = row.int64(0); };
        const auto ask = [&](stmt which, const auto&... args) {
            if (tx != nullptr) {
                driver.query(which, "count_attempt", take, args...);
            } else {
                driver.run(which, "count_attempt",
                           which == stmt::attempt_count ? access::write : access::read, take,
                           args...);
            }
        };
        ask(stmt::attempt_count, Blob{scope}, Blob{id}, now_ms);
        if (!count) ask(stmt::attempt_count_read);
        if (!count || *count < 1) {
            throw store_unavailable(
                fmt::format("idem {}: count_attempt(): the count was not returned", Driver::name));
        }
        return to_count(*count);
    }

    /// The attempt row of (scope, id): its count (0 when none) and the failures noted in it.
    template <class Store>
    static std::pair<std::uint32_t, std::optional<NotedFailure>> attempt_row(Store& store,
                                                                             std::string_view scope,
                                                                             std::string_view id) {
        std::pair<std::uint32_t, std::optional<NotedFailure>> found{0, std::nullopt};
        typename Store::Lock lock(store, "the attempt row");
        store.driver_.run(
            stmt::attempt_find, "attempts", access::read,
            [&](const auto& row) {
                found.first = to_count(row.int64(0));
                if (row.is_null(3)) return;  // no failure noted
                const auto last = from_unix_ms(row.int64(3));
                found.second =
                    NotedFailure{row.is_null(1) ? std::string() : row.bytes(1),
                                 row.is_null(2) ? last : from_unix_ms(row.int64(2)), last};
            },
            Blob{scope}, Blob{id});
        return found;
    }

    /// basic_store::dead_letters(selection): the selected entries, oldest first. Read in pages
    /// of @p page_rows by id (each page under the store's lock, so consumers get their turn);
    /// the scope and the time range are filtered by the database, the ids and the reason here;
    /// the reading stops once the limit is reached.
    template <class Store>
    static std::vector<DeadLetter> list(Store& store, const DeadLetterSelection& selection,
                                        std::int64_t page_rows = 256) {
        constexpr auto lowest = std::numeric_limits<std::int64_t>::min();
        constexpr auto highest = std::numeric_limits<std::int64_t>::max();
        const std::int64_t from =
            selection.created_from ? to_unix_ms(*selection.created_from) : lowest;
        const std::int64_t before =
            selection.created_before ? to_unix_ms(*selection.created_before) : highest;
        std::vector<DeadLetter> letters;
        std::int64_t after = lowest;
        while (!selection.full(letters.size())) {
            std::int64_t rows = 0;
            typename Store::Lock lock(store, "dead_letters()");
            store.driver_.run(
                stmt::dead_letter_page, "dead_letters", access::read,
                [&](const auto& row) {
                    ++rows;
                    DeadLetter letter = read_dead_letter(row);
                    after = letter.id;
                    if (!selection.full(letters.size()) && selection.matches(letter)) {
                        letters.push_back(std::move(letter));
                    }
                },
                after, static_cast<std::int64_t>(selection.scope.empty() ? 1 : 0),
                Blob{selection.scope}, from, before, page_rows);
            if (rows < page_rows) break;
        }
        return letters;
    }

    /// basic_store::redrive(): see its documentation.
    template <class Store>
    static RedriveReport redrive(Store& store, const DeadLetterSelection& selection,
                                 const RedriveOptions& options) {
        using Driver = typename Store::driver_type;
        options.validate(fmt::format("idem {}: redrive()", Driver::name));
        // A destination given is the same for every intent: refused (usage_error) before any
        // change. An origin is checked with its entry (a refused one fails that entry alone).
        if (!options.destination.empty())
            Driver::check_outbox(redrive_intent(DeadLetter{}, options.destination));
        const std::vector<DeadLetter> letters = list(store, selection);
        return detail::run_redrive(
            letters, options,
            [&](const std::string& scope, const std::string& id) {
                return store.find_claim(scope, id);
            },
            [&](std::int64_t id) { return find(store, id); },
            [&](const DeadLetter& letter) { return step(store, letter, options); });
    }

    /// basic_store::purge_dead_letters(): the selected entries, each deleted on its own
    /// (committed at once, under the store's lock, so consumers get their turn between them).
    template <class Store>
    static std::vector<DeadLetter> purge(Store& store, const DeadLetterSelection& selection,
                                         bool dry_run) {
        std::vector<DeadLetter> letters = list(store, selection);
        if (dry_run) return letters;
        std::vector<DeadLetter> purged;
        purged.reserve(letters.size());
        for (DeadLetter& letter : letters) {
            typename Store::Lock lock(store, "purge_dead_letters()");
            if (store.driver_.run(stmt::dead_letter_delete, "purge_dead_letters", access::write,
                                  no_rows{}, letter.id) == 1) {
                purged.push_back(std::move(letter));
            }
        }
        return purged;
    }

  private:
    template <class Store>
    static std::optional<DeadLetter> find(Store& store, std::int64_t id) {
        typename Store::Lock lock(store, "redrive()");
        std::optional<DeadLetter> found;
        store.driver_.run(
            stmt::dead_letter_find, "redrive", access::read,
            [&](const auto& row) { found = read_dead_letter(row); }, id);
        return found;
    }

    /// One entry's transaction; true when it redrove it, false when there was nothing to do
    /// (rolled back).
    template <class Store>
    static bool step(Store& store, const DeadLetter& letter, const RedriveOptions& options) {
        using Driver = typename Store::driver_type;
        if (options.destination.empty())
            Driver::check_outbox(redrive_intent(letter, letter.origin));
        typename Store::Lock lock(store, "redrive()");
        Driver& driver = store.driver_;
        driver.begin("redrive()");
        try {
            const bool done = redrive_in(driver, letter, options, store.now_ms());
            if (done) {
                driver.commit();
            } else if (!driver.rollback_noexcept()) {
                throw store_unavailable(fmt::format("idem {}: redrive(): rollback failed: {}",
                                                    Driver::name, driver.last_error()));
            }
            driver.end_transaction();
            return done;
        } catch (...) {
            driver.rollback_noexcept();
            driver.end_transaction();
            throw;
        }
    }

    template <class Driver>
    static bool redrive_in(Driver& driver, const DeadLetter& letter, const RedriveOptions& options,
                           std::int64_t now_ms) {
        const Blob scope{letter.scope};
        const Blob id{letter.message_id};
        std::int64_t before = 0;
        driver.query(
            stmt::dead_letter_redrives, "redrive", [&](const auto& row) { before = row.int64(0); },
            scope, id);
        // The entry first: its row lock orders concurrent redrives of it.
        if (driver.query(stmt::dead_letter_redrive, "redrive", no_rows{}, letter.id, now_ms,
                         before + 1) != 1) {
            return false;
        }
        if (driver.query(stmt::claim_release_parked, "redrive", no_rows{}, scope, id) != 1) {
            return false;
        }
        driver.query(stmt::attempt_delete, "redrive", no_rows{}, scope, id);
        const OutboxIntent intent = redrive_intent(letter, redrive_destination(letter, options));
        if (driver.query(stmt::outbox_insert, "redrive", no_rows{}, intent.destination,
                         Blob{intent.idempotency_key}, Blob{intent.payload}, now_ms, scope,
                         id) != 1) {
            driver.query(stmt::outbox_rearm, "redrive", no_rows{}, intent.destination,
                         Blob{intent.idempotency_key}, Blob{intent.payload}, now_ms);
        }
        return true;
    }
};

}  // namespace sql
IDEM_END_NAMESPACE
