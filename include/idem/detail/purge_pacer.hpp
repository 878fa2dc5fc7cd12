#pragma once
/// @file
/// @brief detail::PurgePacer: how a store's purge(older_than, options) keeps to its
/// PurgeOptions between batches (the duty cycle, the rate cap, the time budget, a stop asked
/// for). Standard library only, beside the contract's records.

#include <algorithm>
#include <chrono>
#include <thread>

#include "idem/config.hpp"
#include "idem/contract/records.hpp"

IDEM_BEGIN_NAMESPACE
namespace detail {

class PurgePacer {
  public:
    using clock = std::chrono::steady_clock;

    /// @p options validated already.
    explicit PurgePacer(const PurgeOptions& options) : options_(options), start_(clock::now()) {}

    /// Before a batch: false (and the result marked incomplete) when the run must stop.
    [[nodiscard]] bool may_go_on(PurgeResult& result) const {
        if (stopped() || over_budget(clock::now())) {
            result.complete = false;
            return false;
        }
        return true;
    }

    /// After a batch that took @p took: counts it, tells on_batch, then sleeps as long as the
    /// duty cycle and the rate cap ask (never past the budget, and not once a stop is asked).
    void after_batch(PurgeResult& result, clock::duration took) const {
        ++result.batches;
        result.elapsed = clock::now() - start_;
        if (options_.on_batch) options_.on_batch(result);
        auto until = clock::now() + std::chrono::duration_cast<clock::duration>(
                                        took * (1.0 / options_.duty_cycle - 1.0));
        if (options_.max_rows_per_second > 0) {
            const auto due =
                start_ + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(
                             static_cast<double>(result.rows()) / options_.max_rows_per_second));
            until = std::max(until, due);
        }
        if (options_.time_budget.count() > 0)
            until = std::min(until, start_ + options_.time_budget);
        while (!stopped()) {
            const auto now = clock::now();
            if (now >= until) break;
            std::this_thread::sleep_for(
                std::min<clock::duration>(until - now, std::chrono::milliseconds(10)));
        }
    }

    /// At the end of the run.
    void finish(PurgeResult& result) const { result.elapsed = clock::now() - start_; }

  private:
    [[nodiscard]] bool stopped() const { return options_.should_stop && options_.should_stop(); }
    [[nodiscard]] bool over_budget(clock::time_point now) const {
        return options_.time_budget.count() > 0 && now - start_ >= options_.time_budget;
    }

    const PurgeOptions& options_;
    clock::time_point start_;
};

}  // namespace detail
IDEM_END_NAMESPACE
