#pragma once
/// @file
/// @brief idem::testing: put your own handler through the crash windows in your unit tests. A
/// forked child runs your code and dies by SIGKILL at a named window; the test then redelivers
/// in the parent and checks that the effect happened exactly once.
///
/// @code
/// #include <idem/testing/crash.hpp>
/// using idem::testing::Window;
///
/// // in the effect / consumer loop of the code under test (a no-op unless armed):
/// idem::testing::crash_point(Window::after_external_call);
///
/// // in the test:
/// auto result = idem::testing::run_and_kill_at(Window::after_external_call, [&] {
///     idem::SqliteStore store(path);              // opened AFTER the fork, in the child
///     consume_one(store, idem::Delivery{"msg-1", 1u}, message);
/// });
/// ASSERT_TRUE(result.killed_at_window) << result.message;
/// idem::SqliteStore store(path);                  // the restarted worker, in the parent
/// consume_one(store, idem::Delivery{"msg-1", 2u}, message);   // the broker redelivers
/// // now: one effect row, one external call
/// @endcode
///
/// POSIX only (fork, waitpid, mmap). Not included by any other idem header: include it in your
/// tests. Fork rules (see docs/testing.md):
/// - call run_and_kill_at() before the test creates threads (only the forking thread exists in
///   the child, so a lock another thread held stays locked there forever);
/// - a database connection (`sqlite3*`, `PGconn*`, a Redis connection) must never be used on
///   both sides of a fork: open it inside the body, in the child, and (re)open it in the parent
///   after run_and_kill_at() returns — or close it before and reopen it after;
/// - only what the child leaves in files and servers survives it: a file-backed store (SQLite,
///   PostgreSQL, Redis) sees the child's commits; an idem::MemoryStore, a counter or a fake in
///   the parent's memory does not cross processes (the child changes its own copy);
/// - run_and_kill_at() runs one child at a time and waits for it; do not call it from several
///   threads at once.

#if !defined(__unix__) && !defined(__APPLE__)
#error "idem/testing/crash.hpp needs POSIX fork(), waitpid() and mmap()"
#endif

#include <signal.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"

IDEM_BEGIN_NAMESPACE

namespace testing {

/// @brief The four places where a worker dies in the at-least-once story. Put
/// crash_point(Window::...) at each one in the code under test:
/// - `after_claim`: first thing in the effect (the claim is taken, nothing else done, nothing
///   committed);
/// - `after_external_call`: in the effect, right after the call that leaves the process (a
///   gateway, another service) and before its result is written;
/// - `before_commit`: last thing in the effect (every write done, the commit not yet run);
/// - `after_commit_before_ack`: in the consumer loop, after handle() returned and before the
///   broker is acked.
enum class Window { after_claim, after_external_call, before_commit, after_commit_before_ack };

/// @brief Every Window, in the order a delivery passes them (for a loop or
/// `::testing::ValuesIn(idem::testing::all_windows)`).
inline constexpr std::array<Window, 4> all_windows{Window::after_claim, Window::after_external_call,
                                                   Window::before_commit,
                                                   Window::after_commit_before_ack};

/// @brief The window's name, e.g. "after_external_call"; crash_point("after_claim") and
/// crash_point(Window::after_claim) are the same point.
constexpr std::string_view to_string(Window window) noexcept {
    switch (window) {
        case Window::after_claim:
            return "after_claim";
        case Window::after_external_call:
            return "after_external_call";
        case Window::before_commit:
            return "before_commit";
        case Window::after_commit_before_ack:
            return "after_commit_before_ack";
    }
    return "unknown";
}

namespace detail {

/// What the child leaves for the parent, in a shared anonymous mapping: it survives SIGKILL.
struct ChildReport {
    enum State : int { running, reached_window, body_returned, body_threw };
    std::atomic<int> state{running};
    std::atomic<std::uint64_t> hits{0};  // crash_point(window) calls seen, the fatal one included
    char exception[512] = {};
};
static_assert(std::atomic<int>::is_always_lock_free &&
                  std::atomic<std::uint64_t>::is_always_lock_free,
              "idem::testing: the child report needs address-free (lock-free) atomics");

/// The current process's arming. Only a child of run_and_kill_at() is ever armed; everyone else
/// pays one relaxed load per crash_point().
struct Arming {
    std::atomic<bool> armed{false};
    const char* window = nullptr;
    std::size_t window_size = 0;
    std::uint64_t hit = 1;
    ChildReport* report = nullptr;
};
inline Arming arming;

[[noreturn]] inline void die_at_window() noexcept {
    ::raise(SIGKILL);
    ::_exit(128 + SIGKILL);  // not reached: SIGKILL cannot be caught or blocked
}

inline void crash_point_armed(std::string_view window) noexcept {
    Arming& a = arming;
    if (window != std::string_view(a.window, a.window_size)) return;
    const std::uint64_t hit = a.report->hits.fetch_add(1, std::memory_order_relaxed) + 1;
    if (hit != a.hit) return;
    a.report->state.store(ChildReport::reached_window, std::memory_order_relaxed);
    die_at_window();
}

/// Unmaps the report when the parent is done with it.
class ReportMapping {
  public:
    ReportMapping() {
        void* memory = ::mmap(nullptr, sizeof(ChildReport), PROT_READ | PROT_WRITE,
                              MAP_SHARED | MAP_ANON, -1, 0);
        if (memory == MAP_FAILED) {
            throw std::system_error(errno, std::generic_category(),
                                    "idem::testing: mmap of the child report failed");
        }
        report_ = new (memory) ChildReport();
    }
    ReportMapping(const ReportMapping&) = delete;
    ReportMapping& operator=(const ReportMapping&) = delete;
    ~ReportMapping() {
        report_->~ChildReport();
        ::munmap(report_, sizeof(ChildReport));
    }
    [[nodiscard]] ChildReport& get() const noexcept { return *report_; }

  private:
    ChildReport* report_ = nullptr;
};

inline void copy_exception_text(ChildReport& report, const char* text) noexcept {
    const std::size_t size = std::min(std::strlen(text), sizeof(report.exception) - 1);
    std::memcpy(report.exception, text, size);
    report.exception[size] = '\0';
}

/// The child's side: arm, run the body, report, _exit. Never returns.
[[noreturn]] inline void run_child(std::string_view window, std::uint64_t hit, ChildReport& report,
                                   const std::function<void()>& body) {
    Arming& a = arming;
    a.window = window.data();
    a.window_size = window.size();
    a.hit = hit;
    a.report = &report;
    a.armed.store(true, std::memory_order_relaxed);
    int status = 0;
    try {
        body();
        report.state.store(ChildReport::body_returned, std::memory_order_relaxed);
    } catch (const std::exception& e) {
        copy_exception_text(report, e.what());
        report.state.store(ChildReport::body_threw, std::memory_order_relaxed);
        status = 1;
    } catch (...) {
        copy_exception_text(report, "a non-standard exception");
        report.state.store(ChildReport::body_threw, std::memory_order_relaxed);
        status = 1;
    }
    std::fflush(nullptr);
    ::_exit(status);  // never back into the test framework: no atexit handlers, no destructors
}

inline std::string signal_name(int signal) {
    switch (signal) {
        case SIGKILL:
            return "SIGKILL";
        case SIGABRT:
            return "SIGABRT";
        case SIGSEGV:
            return "SIGSEGV";
        case SIGTERM:
            return "SIGTERM";
        case SIGBUS:
            return "SIGBUS";
        case SIGFPE:
            return "SIGFPE";
        case SIGILL:
            return "SIGILL";
        default:
            return fmt::format("signal {}", signal);
    }
}

inline void wait_blocking(pid_t pid, int& status) {
    while (::waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) {
            throw std::system_error(errno, std::generic_category(),
                                    "idem::testing: waitpid() failed");
        }
    }
}

}  // namespace detail

/// @brief Makes the current process die by SIGKILL here when it is the child of
/// run_and_kill_at() armed for @p window (and this is the armed hit); otherwise does nothing.
///
/// Unarmed it costs one relaxed atomic load, so it can stay in the fakes, test doubles and
/// consumer loops your tests share with other tests. @p window is one of the Window names or
/// any name of your own ("after_second_insert").
inline void crash_point(std::string_view window) noexcept {
    if (!detail::arming.armed.load(std::memory_order_relaxed)) return;
    detail::crash_point_armed(window);
}

/// @brief crash_point(to_string(window)).
inline void crash_point(Window window) noexcept {
    if (!detail::arming.armed.load(std::memory_order_relaxed)) return;
    detail::crash_point_armed(to_string(window));
}

/// @brief How run_and_kill_at() arms and waits for its child.
struct CrashOptions {
    /// Die at the hit-th crash_point(window) of the child, counting from 1 (a window passed in a
    /// loop, the third message of a batch, ...).
    std::uint64_t hit = 1;
    /// How long the parent waits for the child before killing it with SIGKILL and reporting
    /// timed_out; zero (or less) waits without a limit.
    std::chrono::milliseconds timeout = std::chrono::seconds(30);
};

/// @brief How the child of run_and_kill_at() ended. Converts to true only for killed_at_window.
struct CrashResult {
    /// The child died by SIGKILL at the armed crash_point: the only success.
    bool killed_at_window = false;
    /// The child reached the armed crash_point (its hit-th pass).
    bool reached = false;
    /// How many times the child passed crash_point(window), the fatal pass included.
    std::uint64_t hits = 0;
    /// The exit status, when the child exited (its body returned: 0; threw: 1).
    std::optional<int> exit_code;
    /// The signal that ended the child (SIGKILL at the window, on timeout, or any other).
    std::optional<int> signal;
    /// The parent gave up waiting (CrashOptions::timeout) and killed the child.
    bool timed_out = false;
    /// What an exception that escaped the body said (the child then exited with 1).
    std::optional<std::string> exception;
    /// One line saying what happened, for the test's failure message.
    std::string message;

    explicit operator bool() const noexcept { return killed_at_window; }
};

/// @brief Forks; the child arms itself for @p window, runs @p body and _exit()s (0 when the
/// body returned, 1 when it threw); the parent waits for it and says how it ended.
///
/// The child never returns into the caller (nor into the test framework): it dies at the
/// window or _exit()s without running atexit handlers or static destructors. stdout/stderr
/// buffers are flushed before the fork and in the child before _exit(). Read the fork rules in
/// this file's description first: no threads yet, no connection used on both sides of the fork.
///
/// @throws usage_error when @p window is empty or CrashOptions::hit is 0; std::system_error
/// when mmap(), fork() or waitpid() fail.
inline CrashResult run_and_kill_at(std::string_view window, std::function<void()> body,
                                   CrashOptions options = {}) {
    if (window.empty()) throw usage_error("idem::testing::run_and_kill_at: empty window name");
    if (options.hit == 0) {
        throw usage_error("idem::testing::run_and_kill_at: CrashOptions::hit counts from 1");
    }
    if (!body) throw usage_error("idem::testing::run_and_kill_at: empty body");

    detail::ReportMapping mapping;
    detail::ChildReport& report = mapping.get();
    const std::string name(window);  // the child uses its copy of this string, no allocation
    std::fflush(nullptr);            // or the child would write the parent's buffered output too

    const pid_t pid = ::fork();
    if (pid < 0) {
        throw std::system_error(errno, std::generic_category(), "idem::testing: fork() failed");
    }
    if (pid == 0) detail::run_child(name, options.hit, report, body);

    // The parent: poll waitpid (with a short backoff) so a timeout can be enforced.
    using clock = std::chrono::steady_clock;
    const bool limited = options.timeout > std::chrono::milliseconds::zero();
    // Clamped so that now() + timeout cannot overflow the clock (milliseconds::max()).
    const auto deadline = clock::now() + std::min<std::chrono::milliseconds>(
                                             options.timeout, std::chrono::hours(24 * 365 * 10));
    auto pause = std::chrono::microseconds(200);
    int status = 0;
    CrashResult result;
    for (;;) {
        const pid_t done = ::waitpid(pid, &status, WNOHANG);
        if (done == pid) break;
        if (done < 0) {
            if (errno == EINTR) continue;
            const int error = errno;
            ::kill(pid, SIGKILL);
            throw std::system_error(error, std::generic_category(),
                                    "idem::testing: waitpid() failed");
        }
        const auto now = clock::now();
        if (limited && now >= deadline) {
            ::kill(pid, SIGKILL);
            detail::wait_blocking(pid, status);
            result.timed_out = true;
            break;
        }
        auto nap = std::chrono::duration_cast<clock::duration>(pause);
        if (limited) nap = std::min(nap, deadline - now);
        std::this_thread::sleep_for(nap);
        pause = std::min(pause * 2, std::chrono::microseconds(10000));
    }

    const int state = report.state.load(std::memory_order_relaxed);
    result.reached = state == detail::ChildReport::reached_window;
    result.hits = report.hits.load(std::memory_order_relaxed);
    if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) result.signal = WTERMSIG(status);
    if (state == detail::ChildReport::body_threw) result.exception = std::string(report.exception);
    result.killed_at_window = result.reached && !result.timed_out && result.signal == SIGKILL;

    const std::string where = fmt::format("window '{}' (passed {} time(s), armed for pass {})",
                                          name, result.hits, options.hit);
    if (result.killed_at_window) {
        result.message =
            fmt::format("killed by SIGKILL at window '{}' (pass {})", name, options.hit);
    } else if (result.timed_out) {
        result.message = fmt::format(
            "timed out after {} ms {} {}; the child was killed with SIGKILL",
            options.timeout.count(), result.reached ? "after reaching" : "without reaching", where);
    } else if (result.reached) {
        result.message = fmt::format("reached {} but did not die by SIGKILL there (status {:#x})",
                                     where, status);
    } else if (result.exception) {
        result.message =
            fmt::format("the body threw before reaching {}: {}", where, *result.exception);
    } else if (result.exit_code) {
        result.message = fmt::format("the child exited with status {} without reaching {}",
                                     *result.exit_code, where);
    } else if (result.signal) {
        result.message = fmt::format("the child was killed by {} before reaching {}",
                                     detail::signal_name(*result.signal), where);
    } else {
        result.message =
            fmt::format("the child ended with wait status {:#x} before reaching {}", status, where);
    }
    return result;
}

/// @brief run_and_kill_at(to_string(window), body, options).
inline CrashResult run_and_kill_at(Window window, std::function<void()> body,
                                   CrashOptions options = {}) {
    return run_and_kill_at(to_string(window), std::move(body), options);
}

}  // namespace testing

IDEM_END_NAMESPACE
