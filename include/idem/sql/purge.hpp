#pragma once
/// @file
/// @brief The SQL stores' paced purge, written once (sql::paced_purge): basic_store::purge()
/// (sql/store.hpp) deletes each table's expired rows in batches, one statement and one
/// transaction each, over a time-ordered cursor, pacing itself beside live consumers
/// (detail::PurgePacer, PurgeOptions). Claims kept in partitions (a driver with claim partitions:
/// PostgreSQL's, postgres/partitions.hpp) go instead a whole expired partition per batch.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/records.hpp"
#include "idem/detail/purge_pacer.hpp"
#include "idem/error.hpp"
#include "idem/sql/driver.hpp"
#include "idem/sql/statements.hpp"
#include "idem/sql/support.hpp"

IDEM_BEGIN_NAMESPACE
namespace sql {

/// Whether a driver has after_purge_batch() (SQLite: a checkpoint after each batch).
template <class Driver, class = void>
struct has_after_purge_batch : std::false_type {};
template <class Driver>
struct has_after_purge_batch<Driver,
                             std::void_t<decltype(std::declval<Driver&>().after_purge_batch())>>
    : std::true_type {};

/// The purge of basic_store<Driver> (its friend: it takes the store's lock and runs the
/// driver's statements).
struct paced_purge {
    /// basic_store::purge(): claims and attempt counters before clock() - @p older_than, sent
    /// intents before it, expired held locks; see its documentation.
    template <class Store>
    static PurgeResult run(Store& store, std::chrono::system_clock::duration older_than,
                           const PurgeOptions& options) {
        using Driver = typename Store::driver_type;
        const std::string who = fmt::format("idem {}: purge()", Driver::name);
        if (older_than.count() < 0) throw usage_error(who + " needs a non-negative age");
        options.validate(who);
        const std::int64_t at = store.now_ms();
        const std::int64_t cutoff =
            at - std::chrono::duration_cast<std::chrono::milliseconds>(older_than).count();
        PurgeResult result;
        const detail::PurgePacer pacer(options);
        const auto table = [&](stmt bound, stmt range, std::string_view what, std::int64_t before,
                               std::size_t& counter) {
            in_batches(store, bound, range, what, before, options.batch_rows, pacer, result,
                       counter);
        };
        bool by_partition = false;
        if constexpr (has_claim_partitions<Driver>::value)
            by_partition = drop_partitions(store, at, cutoff, pacer, result);
        if (!by_partition) {
            table(stmt::purge_claims_bound, stmt::purge_claims, "purge (claims)", cutoff,
                  result.claims);
        }
        table(stmt::purge_outbox_bound, stmt::purge_outbox, "purge (sent outbox intents)", cutoff,
              result.sent_intents);
        table(stmt::purge_locks_bound, stmt::purge_locks, "purge (expired locks)", at,
              result.expired_locks);
        table(stmt::purge_attempts_bound, stmt::purge_attempts, "purge (attempt counts)", cutoff,
              result.attempt_counts);
        pacer.finish(result);
        return result;
    }

  private:
    /// Claims kept in partitions: drops each partition whose every claim is before @p cutoff,
    /// one batch each. @return false when the driver's claims are one table.
    template <class Store>
    static bool drop_partitions(Store& store, std::int64_t at, std::int64_t cutoff,
                                const detail::PurgePacer& pacer, PurgeResult& result) {
        using Partitions = decltype(store.driver_.expired_claim_partitions(at, cutoff));
        Partitions expired;
        {
            typename Store::Lock lock(store, "purge()");
            if (!store.driver_.claims_partitioned()) return false;
            expired = store.driver_.expired_claim_partitions(at, cutoff);
        }
        for (const auto& partition : expired) {
            if (!pacer.may_go_on(result)) return true;
            const auto started = detail::PurgePacer::clock::now();
            std::size_t claims = 0;
            {
                typename Store::Lock lock(store, "purge()");
                claims = store.driver_.drop_claim_partition(partition);
            }
            result.claims += claims;
            ++result.partitions_dropped;
            pacer.after_batch(result, detail::PurgePacer::clock::now() - started);
        }
        return true;
    }

    /// Deletes one table's rows whose time is before @p before, @p batch_rows at a time: each
    /// batch first finds the time of its last row (from the cursor, in time order), then deletes
    /// [cursor, that time] in a statement committed on its own; the cursor moves past it. Rows
    /// sharing the last time all go in that batch. Adds what it deleted to @p counter.
    template <class Store>
    static void in_batches(Store& store, stmt bound, stmt range, std::string_view what,
                           std::int64_t before, std::size_t batch_rows,
                           const detail::PurgePacer& pacer, PurgeResult& result,
                           std::size_t& counter) {
        std::int64_t from = std::numeric_limits<std::int64_t>::min();
        while (result.complete && from < before) {
            if (!pacer.may_go_on(result)) return;
            const auto started = detail::PurgePacer::clock::now();
            std::optional<std::int64_t> last;
            std::int64_t deleted = 0;
            {
                typename Store::Lock lock(store, "purge()");
                store.driver_.run(
                    bound, what, access::read, [&](const auto& row) { last = row.int64(0); }, from,
                    before, static_cast<std::int64_t>(batch_rows - 1));
                const std::int64_t through = last ? *last : before - 1;
                deleted = store.driver_.run(range, what, access::write, no_rows{}, from, through);
                if constexpr (has_after_purge_batch<typename Store::driver_type>::value)
                    store.driver_.after_purge_batch();
            }
            counter += static_cast<std::size_t>(deleted);
            pacer.after_batch(result, detail::PurgePacer::clock::now() - started);
            if (!last) return;  // fewer than a batch were left: all deleted
            from = *last + 1;
        }
    }
};

}  // namespace sql
IDEM_END_NAMESPACE
