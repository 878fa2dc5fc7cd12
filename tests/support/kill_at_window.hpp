#pragma once
// Crash-window tests: run some work in a forked child, let it say when it reached the window
// under test, and kill it there with SIGKILL — what the kernel leaves behind after kill -9 is what
// the next worker finds.

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>

namespace idem_test {

/// Forks; the child runs `child(reached)`, where calling `reached()` tells the parent the child
/// is at its window and then blocks until it is killed. The parent waits for that signal and
/// kills the child with SIGKILL. Fails if the child ended (or threw) before reaching the window.
/// Nothing of SQLite may be open across the fork: the child opens its own connections.
inline ::testing::AssertionResult kill_at_window(
    const std::function<void(const std::function<void()>& reached)>& child) {
    int ready[2];
    if (pipe(ready) != 0) return ::testing::AssertionFailure() << "pipe() failed";
    const pid_t pid = fork();
    if (pid < 0) return ::testing::AssertionFailure() << "fork() failed";
    if (pid == 0) {
        close(ready[0]);
        const std::function<void()> reached = [fd = ready[1]] {
            const char byte = 'x';
            if (write(fd, &byte, 1) != 1) _exit(2);
            for (;;)
                pause();
        };
        try {
            child(reached);
        } catch (...) {
            _exit(4);
        }
        _exit(3);
    }
    close(ready[1]);
    char byte = 0;
    const bool at_window = read(ready[0], &byte, 1) == 1;
    close(ready[0]);
    if (at_window) kill(pid, SIGKILL);
    int status = 0;
    if (waitpid(pid, &status, 0) != pid) return ::testing::AssertionFailure() << "waitpid() failed";
    if (!at_window) {
        return ::testing::AssertionFailure()
               << "the child ended before reaching its window (exit status "
               << (WIFEXITED(status) ? WEXITSTATUS(status) : -1) << ")";
    }
    if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGKILL) {
        return ::testing::AssertionFailure() << "the child did not die from SIGKILL";
    }
    return ::testing::AssertionSuccess();
}

}  // namespace idem_test
