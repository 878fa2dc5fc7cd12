#pragma once
/// @file
/// @brief The calling process' id without a system call per use. The stores ask on every
/// statement and every command whether their connection is this process' (one inherited across
/// fork() is the parent's and must not be used), and getpid(2) is a system call: about 1 µs on a
/// virtual machine, a third of a SQLite batch's time per message when it was asked each time.

#include <pthread.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace detail {

/// The id kept: read once, then again in every child fork() makes (a pthread_atfork child
/// handler, which fork() runs before it returns in the child, and which glibc removes when a
/// library that registered it is unloaded). A child made without fork()'s handlers (_Fork(2),
/// a raw clone(2)) keeps its parent's id here: such a child may use no store it inherited.
class ProcessId {
  public:
    /// getpid(), from the copy kept.
    static pid_t current() noexcept {
        static const bool installed = install();
        (void)installed;
        return slot().load(std::memory_order_relaxed);
    }

  private:
    static std::atomic<pid_t>& slot() noexcept {
        static std::atomic<pid_t> pid{0};
        return pid;
    }
    static void refresh() noexcept { slot().store(::getpid(), std::memory_order_relaxed); }
    // The handler first: a fork() between the two still leaves the child its own id.
    static bool install() noexcept {
        ::pthread_atfork(nullptr, nullptr, &refresh);
        refresh();
        return true;
    }
};

/// getpid() without the system call: see ProcessId.
inline pid_t current_pid() noexcept {
    return ProcessId::current();
}

}  // namespace detail
IDEM_END_NAMESPACE
