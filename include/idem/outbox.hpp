#pragma once
/// @file
/// @brief The transactional outbox: effects that leave the database (a wire to a payment rail, a
/// follow-up message) are written as intents in the claim's transaction, and a Relay ships them
/// later with their idempotency key. See docs/outbox.md.
///
/// @code
/// auto settle = idem::make_handler(store, idem::Policy{"settle-payment"},
///     [](auto& tx, const Payment& p) {
///         tx.execute("INSERT INTO ledger(payment_id, account, amount) VALUES (?, ?, ?) "
///                    "ON CONFLICT(payment_id, account) DO NOTHING", p.id, p.account, p.amount);
///         idem::outbox(tx, "rail", idem::key("wire", p.id), p.wire_json());  // same commit
///     });
///
/// idem::Relay relay(store, [&](const idem::OutboxRow& row) {
///     rail.send(row.payload, row.idempotency_key);  // throws on failure; the rail dedupes
/// });
/// relay.run(stop, std::chrono::seconds(1));
/// @endcode
///
/// Delivery is at least once: a relay killed (or a store failing) between a send and its mark
/// sends the intent again, with the same key, so the receiver must dedupe on the key.
///
/// A sender says "retry later" by throwing any exception, and "park now" (the broker refused
/// the intent for good: retrying cannot help) by throwing idem::send_refused. The ready senders
/// of each broker are in include/idem/senders/ (docs/chain.md).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/store.hpp"
#include "idem/error.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief Thrown by a Relay's sender when the receiver refused the intent for good (a message
/// too large, a destination the broker says does not exist): the Relay parks it at once, with
/// this text as its last error, instead of retrying it until max_attempts. Any other exception
/// means "retry later".
class send_refused : public error {
  public:
    using error::error;
};

namespace detail {

template <class Sender>
constexpr bool check_sender() {
    static_assert(std::is_invocable_v<Sender&, const OutboxRow&>,
                  "idem::Relay: the sender must be callable as sender(const idem::OutboxRow&) "
                  "and throw when the send fails");
    return true;
}

}  // namespace detail

/// @brief Adds an outbox intent (destination, idempotency key, payload) in the claim's
/// transaction, so it commits (or rolls back) with the claim and the effect's rows.
/// @return true when added; false when an intent with this idempotency key already exists (a
/// producer retry under a new message id: the intent is deduped at the source).
/// @throws usage_error when the destination or the key is empty; store_error from the store.
template <class Tx>
bool outbox(Tx& tx, std::string_view destination, std::string_view idempotency_key,
            std::string_view payload) {
    constexpr bool fits = has_add_outbox<Tx>::value;
    static_assert(fits,
                  "idem::outbox: this store's transaction has no add_outbox(const "
                  "idem::OutboxIntent&) returning bool; use a store with an outbox (MemoryStore, "
                  "SqliteStore, PostgresStore, MysqlStore)");
    if (destination.empty()) throw usage_error("idem::outbox: the destination is empty");
    if (idempotency_key.empty()) {
        throw usage_error(
            "idem::outbox: the idempotency key is empty; derive it from a stable business id "
            "(idem::key(\"wire\", payment_id)) or idem::child_id(message_id, step)");
    }
    if constexpr (fits) {
        return static_cast<bool>(tx.add_outbox(OutboxIntent{
            std::string(destination), std::string(idempotency_key), std::string(payload)}));
    } else {
        return false;
    }
}

/// @brief How a Relay leases, retries and parks.
struct RelayOptions {
    /// Most intents leased (and shipped) per run_once().
    std::size_t batch = 100;
    /// How long a leased batch is withheld from other relays. Make it longer than a batch takes
    /// to send: a relay stops shipping its batch once the lease has passed.
    std::chrono::milliseconds lease = std::chrono::seconds(30);
    /// Failed sends after which an intent is parked (never retried; a human looks at it).
    std::uint32_t max_attempts = 10;
    /// Retry delay after the n-th failure: backoff_base * 2^(n-1), at most backoff_max.
    std::chrono::milliseconds backoff_base = std::chrono::seconds(1);
    std::chrono::milliseconds backoff_max = std::chrono::minutes(5);  ///< the longest delay
    /// Time source for retry times and the lease check; empty = system_clock::now. Use the
    /// store's clock.
    Clock clock{};
};

/// @brief What one run_once() (or run()) did.
struct RelayResult {
    std::size_t sent = 0;    ///< shipped and marked sent
    std::size_t failed = 0;  ///< the sender threw; scheduled for a retry after the backoff
    /// the sender threw for the max_attempts-th time, or threw send_refused; parked
    std::size_t parked = 0;
    /// Leased but not attempted because the lease ran out; shipped by a later run.
    std::size_t lease_expired = 0;

    /// Every intent the run leased: sent + failed + parked + lease_expired.
    [[nodiscard]] std::size_t total() const noexcept {
        return sent + failed + parked + lease_expired;
    }
    /// Adds @p other's counts (to sum the runs of a loop).
    RelayResult& operator+=(const RelayResult& other) noexcept {
        sent += other.sent;
        failed += other.failed;
        parked += other.parked;
        lease_expired += other.lease_expired;
        return *this;
    }
};

/// @brief Running totals of a Relay.
struct RelayCounters {
    std::uint64_t sent = 0;          ///< intents shipped and marked sent
    std::uint64_t failed = 0;        ///< failures that were scheduled for a retry
    std::uint64_t parked = 0;        ///< intents parked (max_attempts reached, or send_refused)
    std::uint64_t store_errors = 0;  ///< run_once() calls that ended in a store_error
};

/// @brief Ships outbox intents: leases a batch, calls the sender for each in id order, and marks
/// it sent, or failed with an exponential backoff, or parked after max_attempts failures, or
/// parked at once when the sender throws idem::send_refused.
///
/// At least once: when the relay dies, or the store fails, between a send and its mark, the
/// intent's lease passes and it is sent again with the same idempotency key, so the receiver
/// must dedupe on the key. A failing intent does not hold up later ones (they ship, it is
/// retried later), so receivers must not rely on order across failures.
///
/// Several relays (threads or processes, each with its own store connection) may run on one
/// database: a leased intent is not handed to another relay while its lease lives. One Relay
/// object may be shared by threads when the store and the sender are thread-safe.
template <class Store, class Sender>
class Relay {
    static_assert(check_relay_store<Store>(), "idem::Relay: Store does not fit");
    static_assert(detail::check_sender<Sender>(), "idem::Relay: Sender does not fit");

  public:
    /// @throws usage_error for options that cannot work (batch 0, lease <= 0, max_attempts 0,
    /// a negative backoff, backoff_max < backoff_base).
    Relay(Store& store, Sender sender, RelayOptions options = {})
        : store_(store), sender_(std::move(sender)), options_(std::move(options)) {
        if (options_.batch == 0) throw usage_error("idem::Relay: batch must be at least 1");
        if (options_.lease.count() <= 0) throw usage_error("idem::Relay: lease must be positive");
        if (options_.max_attempts == 0) {
            throw usage_error("idem::Relay: max_attempts must be at least 1");
        }
        if (options_.backoff_base.count() < 0 || options_.backoff_max < options_.backoff_base) {
            throw usage_error(fmt::format(
                "idem::Relay: backoff needs 0 <= backoff_base <= backoff_max (got {} ms, {} ms)",
                options_.backoff_base.count(), options_.backoff_max.count()));
        }
    }

    /// @brief Leases one batch and ships it in id order.
    /// @return what it did; all zero when nothing was due.
    /// @throws store_error when the store fails to lease or to mark. Nothing is lost: the
    /// intents of the batch that were not marked are leased again once the lease passes, and
    /// one that was already sent is sent again with the same key.
    RelayResult run_once() {
        RelayResult result;
        const auto leased_at = now();
        std::vector<OutboxRow> rows;
        try {
            rows = store_.lease_outbox(options_.batch, options_.lease);
        } catch (const store_error&) {
            counters_.store_errors.fetch_add(1, std::memory_order_relaxed);
            throw;
        }
        if (!std::is_sorted(rows.begin(), rows.end(), by_id)) {
            std::stable_sort(rows.begin(), rows.end(), by_id);
        }
        const auto lease_end = leased_at + options_.lease;
        for (std::size_t i = 0; i < rows.size(); ++i) {
            if (now() >= lease_end) {  // another relay may have them now
                result.lease_expired = rows.size() - i;
                break;
            }
            try {
                ship(rows[i], result);
            } catch (const store_error&) {
                // Stop here: the rest stay leased until the lease passes, then are shipped.
                counters_.store_errors.fetch_add(1, std::memory_order_relaxed);
                throw;
            }
        }
        return result;
    }

    /// @brief Calls run_once() until @p stop is true, waiting @p idle_wait when a batch was not
    /// full (nothing more is due) or the store failed (see last_store_error()).
    /// @return the sum of the batches' results (a batch ended by a store error shows only in
    /// counters()).
    RelayResult run(const std::atomic<bool>& stop, std::chrono::milliseconds idle_wait) {
        RelayResult total;
        while (!stop.load(std::memory_order_acquire)) {
            bool idle = true;
            try {
                const RelayResult batch = run_once();
                total += batch;
                idle = batch.total() < options_.batch;
            } catch (const store_error& e) {
                std::lock_guard<std::mutex> lock(error_mutex_);
                last_store_error_ = e.what();
            }
            if (idle) wait(stop, idle_wait);
        }
        return total;
    }

    /// @brief Totals since construction (atomic; readable from any thread).
    [[nodiscard]] RelayCounters counters() const noexcept {
        RelayCounters c;
        c.sent = counters_.sent.load(std::memory_order_relaxed);
        c.failed = counters_.failed.load(std::memory_order_relaxed);
        c.parked = counters_.parked.load(std::memory_order_relaxed);
        c.store_errors = counters_.store_errors.load(std::memory_order_relaxed);
        return c;
    }

    /// @brief The message of the last store_error run() absorbed (empty if none).
    [[nodiscard]] std::string last_store_error() const {
        std::lock_guard<std::mutex> lock(error_mutex_);
        return last_store_error_;
    }

    /// @brief The retry delay after an intent's @p failures -th failure (1 = first).
    [[nodiscard]] std::chrono::milliseconds backoff(std::uint32_t failures) const noexcept {
        auto delay = options_.backoff_base;
        for (std::uint32_t i = 1; i < failures && delay < options_.backoff_max; ++i) {
            delay = delay > options_.backoff_max / 2 ? options_.backoff_max : delay * 2;
        }
        return std::min(delay, options_.backoff_max);
    }

    /// The options the relay was made with.
    [[nodiscard]] const RelayOptions& options() const noexcept { return options_; }
    /// The store the intents are read from.
    [[nodiscard]] Store& store() noexcept { return store_; }

  private:
    struct AtomicRelayCounters {
        std::atomic<std::uint64_t> sent{0};
        std::atomic<std::uint64_t> failed{0};
        std::atomic<std::uint64_t> parked{0};
        std::atomic<std::uint64_t> store_errors{0};
    };

    static bool by_id(const OutboxRow& a, const OutboxRow& b) noexcept { return a.id < b.id; }

    [[nodiscard]] std::chrono::system_clock::time_point now() const {
        return options_.clock ? options_.clock() : std::chrono::system_clock::now();
    }

    /// Sends one intent and marks it; a store_error from the mark propagates.
    void ship(const OutboxRow& row, RelayResult& result) {
        std::string error;
        bool refused = false;
        try {
            std::invoke(sender_, row);
        } catch (const send_refused& e) {
            refused = true;
            error = e.what();
            if (error.empty()) error = "sender refused the intent (send_refused, empty message)";
        } catch (const std::exception& e) {
            error = e.what();
            if (error.empty()) error = "sender threw an exception with an empty message";
        } catch (...) {
            error = "sender threw a non-standard exception";
        }
        if (error.empty()) {
            store_.mark_outbox_sent(row.id);
            ++result.sent;
            counters_.sent.fetch_add(1, std::memory_order_relaxed);
            return;
        }
        constexpr auto most = std::numeric_limits<std::uint32_t>::max();
        const std::uint32_t failures = row.attempts == most ? most : row.attempts + 1;
        const bool park = refused || failures >= options_.max_attempts;
        const auto retry_at = park ? now() : now() + backoff(failures);
        store_.mark_outbox_failed(row.id, error, retry_at, park);
        if (park) {
            ++result.parked;
            counters_.parked.fetch_add(1, std::memory_order_relaxed);
        } else {
            ++result.failed;
            counters_.failed.fetch_add(1, std::memory_order_relaxed);
        }
    }

    /// Sleeps @p duration in short slices, returning early once @p stop is set.
    static void wait(const std::atomic<bool>& stop, std::chrono::milliseconds duration) {
        const auto until = std::chrono::steady_clock::now() + duration;
        constexpr auto slice = std::chrono::milliseconds(20);
        while (!stop.load(std::memory_order_acquire)) {
            const auto left = until - std::chrono::steady_clock::now();
            if (left <= std::chrono::steady_clock::duration::zero()) return;
            std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(left, slice));
        }
    }

    Store& store_;
    Sender sender_;
    RelayOptions options_;
    AtomicRelayCounters counters_;
    mutable std::mutex error_mutex_;
    std::string last_store_error_;
};

/// @brief Builds a Relay, deducing the store and sender types (CTAD works as well).
template <class Store, class Sender>
Relay<Store, std::decay_t<Sender>> make_relay(Store& store, Sender&& sender,
                                              RelayOptions options = {}) {
    return Relay<Store, std::decay_t<Sender>>(store, std::forward<Sender>(sender),
                                              std::move(options));
}

IDEM_END_NAMESPACE
