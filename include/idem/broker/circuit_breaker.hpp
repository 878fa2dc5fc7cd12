#pragma once
/// @file
/// @brief CircuitBreaker: a consumer loop's pause while the store is unreachable (bounded
/// exponential backoff with jitter, then a probe), so that deliveries the store cannot take are
/// not pulled from the broker and their delivery counts do not grow during an outage. Generic:
/// it knows no store and no broker (the probe is a callback).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/store.hpp"  // has_ping, has_rollback
#include "idem/error.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief How a CircuitBreaker waits between probes of an unreachable store.
struct CircuitBreakerOptions {
    /// Off: outcomes caused by an unreachable store are left pending like any failure and the
    /// loop reads on (their delivery counts grow during an outage).
    bool enabled = true;
    /// The first wait after the store was found unreachable, before the first probe.
    std::chrono::milliseconds initial_backoff{100};
    /// The wait doubles after each failed probe, up to this.
    std::chrono::milliseconds max_backoff{5000};
    /// Each wait is drawn uniformly from [backoff × (1 − jitter), backoff] so that many workers
    /// do not probe a recovering store in step. 0 … 1.
    double jitter = 0.2;
};

/// @brief What a CircuitBreaker has done so far.
struct CircuitBreakerStats {
    std::size_t opened = 0;         ///< times the store was found unreachable and reading paused
    std::size_t probes = 0;         ///< probes made while open
    std::size_t failed_probes = 0;  ///< of those, the ones that found the store still unreachable
};

/// @brief The pause a consumer loop makes while its store is unreachable.
///
/// After an outcome whose cause is store_unavailable or store_timeout (Outcome::
/// store_unreachable()) the loop calls open(), stops reading and calls wait_until_closed(): it
/// sleeps the backoff (exponential from initial_backoff to max_backoff, with jitter), probes the
/// store (idem::probe_store: one round trip to its server), and returns once a probe succeeds — the
/// breaker is then closed and the backoff back at initial_backoff — or when asked to stop.
///
/// @code
/// idem::CircuitBreaker breaker{{}, [&] { idem::probe_store(store); }};
/// std::atomic<bool> stop{false};  // or any callable returning true once the loop must stop
/// if (breaker.trips_on(outcome)) { breaker.open(); breaker.wait_until_closed(stop); }
/// @endcode
///
/// One loop (thread) drives a breaker; stats() and is_open() may be read from any thread.
class CircuitBreaker {
  public:
    /// Succeeds (returns) when the store is reachable; throws when it is not.
    using Probe = std::function<void()>;
    /// Sleeps about the given time; may return early (e.g. on a stop request).
    using Sleep = std::function<void(std::chrono::milliseconds)>;
    /// A uniform number in [0, 1), for the jitter.
    using Random = std::function<double()>;

    /// @throws usage_error for options that cannot work (the message says which).
    CircuitBreaker(CircuitBreakerOptions options, Probe probe, Sleep sleep = {}, Random random = {})
        : options_(validated(options)),
          probe_(std::move(probe)),
          sleep_(std::move(sleep)),
          random_(std::move(random)),
          backoff_(options_.initial_backoff) {
        if (!probe_) throw usage_error("idem::CircuitBreaker: the probe is empty");
        if (!sleep_) sleep_ = [](std::chrono::milliseconds d) { std::this_thread::sleep_for(d); };
        if (!random_) {
            random_ = [engine = std::minstd_rand(std::random_device{}())]() mutable {
                return std::uniform_real_distribution<double>(0.0, 1.0)(engine);
            };
        }
    }

    /// @brief True for an outcome that opens the breaker: failed because the store is
    /// unreachable or timed out (and the breaker is enabled).
    [[nodiscard]] bool trips_on(const Outcome& outcome) const noexcept {
        return options_.enabled && outcome.store_unreachable();
    }

    /// @brief Marks the store unreachable: the loop must not read until wait_until_closed()
    /// returns true. Opening an open breaker changes nothing.
    void open() noexcept {
        if (open_.exchange(true, std::memory_order_relaxed)) return;
        backoff_ = options_.initial_backoff;
        opened_.fetch_add(1, std::memory_order_relaxed);
    }

    /// Whether the breaker is open (the store failed and no probe has passed since).
    [[nodiscard]] bool is_open() const noexcept { return open_.load(std::memory_order_relaxed); }

    /// @brief While open: sleep the backoff, probe; a failed probe doubles the backoff (up to
    /// max_backoff), a successful one closes the breaker. Returns true once closed, false when
    /// @p stop says so first (checked before each sleep and each probe). @p stop is a callable
    /// returning true once the loop must stop, or a `std::atomic<bool>` set then (the flag
    /// Relay::run() takes).
    template <class StopRequested>
    bool wait_until_closed(StopRequested&& stop) {
        using Stop = std::remove_cv_t<std::remove_reference_t<StopRequested>>;
        if constexpr (std::is_same_v<Stop, std::atomic<bool>>) {
            return wait_until_closed([&stop] { return stop.load(std::memory_order_relaxed); });
        } else {
            static_assert(std::is_invocable_r_v<bool, StopRequested&>,
                          "idem::CircuitBreaker::wait_until_closed(stop): stop is a callable "
                          "returning bool (true: stop waiting) or a std::atomic<bool>");
            while (is_open()) {
                if (stop()) return false;
                sleep_(next_wait());
                if (stop()) return false;
                probe_once();
            }
            return true;
        }
    }

    /// @brief One probe now (after the caller's own wait); closes the breaker if it succeeds.
    /// Returns true when the store answered.
    bool probe_once() {
        probes_.fetch_add(1, std::memory_order_relaxed);
        try {
            probe_();
        } catch (...) {
            failed_probes_.fetch_add(1, std::memory_order_relaxed);
            backoff_ = std::min(backoff_ * 2, options_.max_backoff);
            return false;
        }
        open_.store(false, std::memory_order_relaxed);
        backoff_ = options_.initial_backoff;
        return true;
    }

    /// @brief The wait before the next probe: the current backoff less up to `jitter` of it.
    [[nodiscard]] std::chrono::milliseconds next_wait() {
        const double r = std::clamp(random_(), 0.0, 1.0);
        const double cut = static_cast<double>(backoff_.count()) * options_.jitter * r;
        return std::max(std::chrono::milliseconds(1),
                        backoff_ - std::chrono::milliseconds(static_cast<std::int64_t>(cut)));
    }

    /// @brief The backoff the next wait is drawn from (before jitter).
    [[nodiscard]] std::chrono::milliseconds backoff() const noexcept { return backoff_; }
    /// The options the breaker was made with.
    [[nodiscard]] const CircuitBreakerOptions& options() const noexcept { return options_; }
    /// How often it opened, probed and closed so far.
    [[nodiscard]] CircuitBreakerStats stats() const noexcept {
        CircuitBreakerStats s;
        s.opened = opened_.load(std::memory_order_relaxed);
        s.probes = probes_.load(std::memory_order_relaxed);
        s.failed_probes = failed_probes_.load(std::memory_order_relaxed);
        return s;
    }

  private:
    static CircuitBreakerOptions validated(CircuitBreakerOptions options) {
        auto refuse = [](std::string_view why) {
            throw usage_error(fmt::format("idem::CircuitBreakerOptions: {}", why));
        };
        if (options.initial_backoff.count() <= 0) {
            refuse("initial_backoff must be positive (e.g. 100 ms)");
        }
        if (options.max_backoff < options.initial_backoff) {
            refuse(fmt::format("max_backoff ({} ms) is shorter than initial_backoff ({} ms)",
                               options.max_backoff.count(), options.initial_backoff.count()));
        }
        if (!(options.jitter >= 0.0 && options.jitter <= 1.0)) {
            refuse(fmt::format("jitter is {}; it is a fraction of the backoff, 0 to 1",
                               options.jitter));
        }
        return options;
    }

    CircuitBreakerOptions options_;
    Probe probe_;
    Sleep sleep_;
    Random random_;
    std::chrono::milliseconds backoff_;
    std::atomic<bool> open_{false};
    std::atomic<std::size_t> opened_{0};
    std::atomic<std::size_t> probes_{0};
    std::atomic<std::size_t> failed_probes_{0};
};

/// @brief The cheap probe of any store: its ping() if it has one, else a transaction begun and
/// rolled back. idem's stores: PostgreSQL `SELECT 1` and MySQL/MariaDB `START TRANSACTION` +
/// `ROLLBACK` (a dead connection reconnected once), SQLite `BEGIN IMMEDIATE` + `ROLLBACK` (a
/// database another writer holds past the busy timeout: store_timeout), Redis a `PING` of the
/// server, of the master the Sentinels name or of every master of a Cluster (a server still
/// loading its data, or a cluster that is down: store_unavailable), MemoryStore begin + rollback
/// (its injected begin faults). The probe must reach the store's server: a store of your own
/// whose begin() does no I/O needs a ping(), else the probe passes while the server is down and
/// a consumer keeps pulling through the outage.
/// @throws store_unavailable or store_timeout (or what the store throws) while it is unreachable.
template <class Store>
void probe_store(Store& store) {
    if constexpr (has_ping<Store>::value) {
        store.ping();
    } else {
        auto tx = store.begin();
        if constexpr (has_rollback<decltype(tx)>::value) tx.rollback();
    }
}

IDEM_END_NAMESPACE
