#pragma once
// A forked child for the fork tests (a pre-fork worker pool in miniature): it runs a body and
// reports lines to the parent on a pipe; the parent reads them with a deadline, waits for the
// exit status, or SIGKILLs it. Test-only; POSIX; no gtest here.

#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

namespace idem_test {

/// A forked child that runs a body and reports lines on a pipe; SIGKILLed (if still running) and
/// reaped by the destructor.
class ForkedChild {
  public:
    /// @p body gets a function that sends one line to the parent; the child _exit()s after it.
    explicit ForkedChild(
        const std::function<void(const std::function<void(const std::string&)>&)>& body) {
        int fds[2];
        if (::pipe(fds) != 0) throw std::runtime_error("pipe");
        pid_ = ::fork();
        if (pid_ < 0) throw std::runtime_error("fork");
        if (pid_ == 0) {
            ::close(fds[0]);
            const int out = fds[1];
            auto send = [out](const std::string& line) {
                const std::string text = line + "\n";
                std::size_t done = 0;
                while (done < text.size()) {
                    const ssize_t n = ::write(out, text.data() + done, text.size() - done);
                    if (n <= 0) ::_exit(3);
                    done += static_cast<std::size_t>(n);
                }
            };
            try {
                body(send);
            } catch (const std::exception& e) {
                send(std::string("exception: ") + e.what());
                ::_exit(2);
            }
            ::_exit(0);
        }
        ::close(fds[1]);
        in_ = fds[0];
    }
    ForkedChild(const ForkedChild&) = delete;
    ForkedChild& operator=(const ForkedChild&) = delete;
    ~ForkedChild() {
        kill();
        ::close(in_);
    }

    [[nodiscard]] pid_t pid() const noexcept { return pid_; }

    /// The next line, or nothing when none came within @p timeout (or the child is gone).
    std::optional<std::string> line(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        for (;;) {
            const auto newline = buffer_.find('\n');
            if (newline != std::string::npos) {
                std::string out = buffer_.substr(0, newline);
                buffer_.erase(0, newline + 1);
                return out;
            }
            const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                deadline - std::chrono::steady_clock::now());
            if (left.count() <= 0) return std::nullopt;
            pollfd p{in_, POLLIN, 0};
            const int ready = ::poll(&p, 1, static_cast<int>(left.count()));
            if (ready < 0 && errno == EINTR) continue;
            if (ready <= 0) return std::nullopt;
            char chunk[256];
            const ssize_t n = ::read(in_, chunk, sizeof chunk);
            if (n <= 0) return std::nullopt;
            buffer_.append(chunk, static_cast<std::size_t>(n));
        }
    }

    /// Waits for the child to exit on its own; its exit status, or nothing after @p timeout.
    std::optional<int> wait(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        while (pid_ > 0) {
            int status = 0;
            const pid_t done = ::waitpid(pid_, &status, WNOHANG);
            if (done == pid_) {
                pid_ = -1;
                return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
            }
            if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        return std::nullopt;
    }

    /// SIGKILL, then reap.
    void kill() {
        if (pid_ <= 0) return;
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
        pid_ = -1;
    }

  private:
    pid_t pid_ = -1;
    int in_ = -1;
    std::string buffer_;
};

}  // namespace idem_test
