#pragma once
/// @file
/// @brief idem::Purger: runs a store's purge(retention, options) on a schedule, on a thread of
/// its own, beside the consumers of the same process; paced by PurgeOptions, stopped cleanly
/// (a purge in progress ends after its batch), each run reported. Core header.
///
/// @code
/// idem::SqliteStore purge_store{"orders.db"};  // a connection of its own: consumers never wait
///                                              // on the purger's store mutex
/// idem::PurgerOptions options;
/// options.retention = idem::days(14);
/// options.interval = std::chrono::minutes(10);
/// options.on_run = [&](const idem::PurgeResult& r) {
///     metrics.report_purge("orders-db", r, r.elapsed);
/// };
/// idem::Purger purger{purge_store, options};  // runs until destroyed (or stop())
/// @endcode

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "idem/config.hpp"
#include "idem/contract/records.hpp"
#include "idem/error.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief What a Purger runs and when.
struct PurgerOptions {
    /// What purge() keeps: claims younger than this (at least the broker's redelivery window).
    std::chrono::system_clock::duration retention = std::chrono::hours(24 * 14);
    /// From the end of one run to the start of the next.
    std::chrono::milliseconds interval{std::chrono::minutes(10)};
    /// Each run's pacing; its should_stop is the Purger's own (stop()).
    PurgeOptions purge{};
    /// Told each finished run (e.g. PrometheusObserver::report_purge). What it throws is ignored.
    std::function<void(const PurgeResult&)> on_run{};
    /// Told each run that failed (the store away); the next run comes after the interval.
    std::function<void(const std::exception&)> on_error{};
};

/// @brief Runs @p Store's purge(retention, options) every interval on a thread of its own,
/// from construction until stop() or destruction. The store must be usable from that thread
/// while other threads use it (the SQL stores serialize on their mutex; give the Purger a
/// store object of its own so consumers never wait on it).
template <class Store>
class Purger {
  public:
    /// @throws usage_error for a negative retention, a non-positive interval or invalid pacing.
    Purger(Store& store, PurgerOptions options) : store_(store), options_(std::move(options)) {
        if (options_.retention.count() < 0) throw usage_error("idem::Purger: negative retention");
        if (options_.interval.count() <= 0) {
            throw usage_error("idem::Purger: interval must be positive");
        }
        options_.purge.validate("idem::Purger");
        auto asked = std::move(options_.purge.should_stop);
        options_.purge.should_stop = [this, asked = std::move(asked)] {
            return stop_.load(std::memory_order_acquire) || (asked && asked());
        };
        thread_ = std::thread([this] { loop(); });
    }
    Purger(const Purger&) = delete;
    Purger& operator=(const Purger&) = delete;
    ~Purger() { stop(); }

    /// @brief Stops the schedule: a run in progress ends after its current batch. Returns once
    /// the thread has ended. Idempotent; never throws.
    void stop() noexcept {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stop_.store(true, std::memory_order_release);
        }
        wake_.notify_all();
        if (thread_.joinable()) thread_.join();
    }

    /// @brief Runs finished (complete, or ended early by the budget or a stop).
    [[nodiscard]] std::size_t runs() const noexcept {
        return runs_.load(std::memory_order_relaxed);
    }
    /// @brief Runs that threw (told to on_error).
    [[nodiscard]] std::size_t failures() const noexcept {
        return failures_.load(std::memory_order_relaxed);
    }
    /// @brief The last finished run's result, if any.
    [[nodiscard]] std::optional<PurgeResult> last() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return last_;
    }

  private:
    void loop() noexcept {
        for (;;) {
            run_once();
            std::unique_lock<std::mutex> lock(mutex_);
            if (wake_.wait_for(lock, options_.interval,
                               [this] { return stop_.load(std::memory_order_acquire); })) {
                return;
            }
        }
    }

    void run_once() noexcept {
        try {
            PurgeResult result = store_.purge(options_.retention, options_.purge);
            {
                std::lock_guard<std::mutex> lock(mutex_);
                last_ = result;
            }
            runs_.fetch_add(1, std::memory_order_relaxed);
            if (options_.on_run) {
                try {
                    options_.on_run(result);
                } catch (...) {  // reporting never stops the schedule
                }
            }
        } catch (const std::exception& e) {
            failures_.fetch_add(1, std::memory_order_relaxed);
            if (options_.on_error) {
                try {
                    options_.on_error(e);
                } catch (...) {  // reporting never stops the schedule
                }
            }
        } catch (...) {
            failures_.fetch_add(1, std::memory_order_relaxed);
        }
    }

    Store& store_;
    PurgerOptions options_;
    std::atomic<bool> stop_{false};
    std::atomic<std::size_t> runs_{0};
    std::atomic<std::size_t> failures_{0};
    mutable std::mutex mutex_;
    std::condition_variable wake_;
    std::optional<PurgeResult> last_;
    std::thread thread_;  ///< last: started once everything above is built
};

IDEM_END_NAMESPACE
