#pragma once
// Waiting in tests without fixed sleeps, written once: each test file keeps its own default
// deadline (a loaded 2-core CI machine) in a one-line wait_for / poll_until of its own.

#include <chrono>
#include <thread>

namespace idem_test {

/// Re-checks @p done every 5 ms until it holds (true) or @p limit has passed (false).
template <class Pred>
bool wait_within(std::chrono::milliseconds limit, Pred&& done) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!done()) {
        if (std::chrono::steady_clock::now() >= deadline) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return true;
}

/// Calls @p poll (a consumer's poll_once()) until @p done holds (true) or @p limit has passed
/// (false).
template <class Poll, class Pred>
bool poll_within(std::chrono::milliseconds limit, Poll&& poll, Pred&& done) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!done()) {
        if (std::chrono::steady_clock::now() >= deadline) return false;
        poll();
    }
    return true;
}

}  // namespace idem_test
