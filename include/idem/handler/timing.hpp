#pragma once
/// @file
/// @brief What the handler times of a delivery for its observer: the whole call (Stopwatch),
/// the effect (EffectTimer) and the commit (timed_commit), into a Measure. Only when an
/// observer is set: a handler without one never reads the clock.

#include <chrono>
#include <cstddef>
#include <optional>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace detail {

/// What the handler measures of one delivery for its observer. Filled in as the attempt goes,
/// read by the report (reporting.hpp).
struct Measure {
    std::optional<std::chrono::nanoseconds> effect_in{};
    std::optional<std::chrono::nanoseconds> commit_in{};
    bool effect_ran = false;
};

[[nodiscard]] inline std::chrono::nanoseconds since(
    std::chrono::steady_clock::time_point start) noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                                start);
}

/// Times the effect into a Measure from construction to destruction (the effect returning or
/// throwing); does nothing when the Measure is null.
class EffectTimer {
  public:
    explicit EffectTimer(Measure* measure) noexcept : measure_(measure) {
        if (measure_ != nullptr) start_ = std::chrono::steady_clock::now();
    }
    EffectTimer(const EffectTimer&) = delete;
    EffectTimer& operator=(const EffectTimer&) = delete;
    ~EffectTimer() {
        if (measure_ != nullptr) {
            measure_->effect_in = since(start_);
            measure_->effect_ran = true;
        }
    }

  private:
    Measure* measure_;
    std::chrono::steady_clock::time_point start_{};
};

/// Times a handle() call for the observer: reads steady_clock only when @p on (an observer is
/// set), so a handler without one never touches the clock.
class Stopwatch {
  public:
    explicit Stopwatch(bool on) noexcept : on_(on) {
        if (on) start_ = std::chrono::steady_clock::now();
    }
    [[nodiscard]] bool on() const noexcept { return on_; }
    [[nodiscard]] std::chrono::nanoseconds elapsed() const noexcept {
        if (!on_) return {};
        return since(start_);
    }
    /// One message's share of a batch of @p n.
    [[nodiscard]] std::chrono::nanoseconds share(std::size_t n) const noexcept {
        const auto total = elapsed();
        return n == 0 ? total : total / static_cast<std::chrono::nanoseconds::rep>(n);
    }

  private:
    bool on_;
    std::chrono::steady_clock::time_point start_{};
};

/// tx.commit(), its duration given to @p took (also when it throws) if @p timed.
template <class Transaction, class Took>
void timed_commit(Transaction& tx, Took&& took, bool timed) {
    if (!timed) {
        tx.commit();
        return;
    }
    const auto start = std::chrono::steady_clock::now();
    try {
        tx.commit();
    } catch (...) {
        took(since(start));
        throw;
    }
    took(since(start));
}

}  // namespace detail
IDEM_END_NAMESPACE
