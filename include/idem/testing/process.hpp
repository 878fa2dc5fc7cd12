#pragma once
/// @file
/// @brief idem::testing: the process, port and temp-dir helpers the throwaway server fixtures
/// (redis_server.hpp, postgres_server.hpp, mariadb_server.hpp) are built on. POSIX/Linux; no
/// gtest; needs only the standard library (part of idem::idem).
///
/// @code
/// #include <idem/testing/process.hpp>
/// namespace t = idem::testing;
/// const auto found = t::find_program("redis-server", "MY_REDIS_SERVER", "Debian: redis-server");
/// if (found.path.empty()) GTEST_SKIP() << found.why;   // or fail when t::running_in_ci()
/// const int port = t::probe_free_port();
/// ASSERT_TRUE(t::eventually([&] { return server_answers(port); }, std::chrono::seconds(5)));
/// @endcode
///
///   find_program(name, env, hint)  $env (a full path), else name in PATH and the usual bin dirs
///   spawn(Spawn{...})      fork + exec with an exact argv/environment, no inherited descriptors
///   wait_for(pid, 5s)      waitpid with a deadline;  process_gone(pid)  gone or a zombie
///   probe_free_port()      a port the kernel just gave out on 127.0.0.1
///   temp_base(...)         where a server's temp dir goes (/dev/shm when it is a roomy tmpfs)
///   Watchdog               stops a server and removes its dir if the test process dies abruptly
///   running_in_ci()        CI=true or CI=1
///   eventually(pred, 15s)  polls pred until true or the deadline
///   killed_while(hold)     a fork()ed child reports what it holds, then dies by SIGKILL

#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE

namespace testing {

/// CI=true (any case) or CI=1: a missing server is then a failure, never a skip.
inline bool running_in_ci() {
    const char* ci = std::getenv("CI");
    if (ci == nullptr) return false;
    std::string value = ci;
    for (auto& c : value)
        c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return value == "true" || value == "1";
}

inline bool is_executable(const std::filesystem::path& p) {
    return ::access(p.c_str(), X_OK) == 0 && std::filesystem::is_regular_file(p);
}

/// Without trailing newlines, carriage returns and spaces.
inline std::string trim(std::string s) {
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' '))
        s.pop_back();
    return s;
}

/// The whole file; empty when it cannot be read.
inline std::string read_text(const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::ostringstream out;
    out << in.rdbuf();
    return out.str();
}

inline std::string tail(const std::string& text, std::size_t max_chars = 2000) {
    return text.size() <= max_chars ? text : "..." + text.substr(text.size() - max_chars);
}

/// An executable found by find_program().
struct Program {
    std::filesystem::path path;  // empty when not found
    std::string why;             // reason when not found
};

/// $@p env_var (a full path) if set; else @p name in PATH, /usr/bin, /usr/sbin, /usr/local/bin.
/// Not found: why says where it looked and ends with @p install_hint ("Debian: redis-server").
inline Program find_program(const std::string& name, const char* env_var,
                            const std::string& install_hint) {
    if (const char* env = std::getenv(env_var); env != nullptr && *env != '\0') {
        if (is_executable(env)) return {env, {}};
        return {{}, std::string(env_var) + "=" + env + " is not an executable file"};
    }
    std::vector<std::string> dirs;
    if (const char* path = std::getenv("PATH"); path != nullptr) {
        std::string list = path;
        for (std::size_t start = 0; start <= list.size();) {
            const std::size_t end = std::min(list.find(':', start), list.size());
            if (end > start) dirs.push_back(list.substr(start, end - start));
            start = end + 1;
        }
    }
    for (const char* dir : {"/usr/bin", "/usr/sbin", "/usr/local/bin"})
        dirs.emplace_back(dir);
    std::string looked;
    for (const auto& dir : dirs) {
        const auto candidate = std::filesystem::path(dir) / name;
        if (is_executable(candidate)) return {candidate, {}};
        looked += " " + dir;
    }
    return {{},
            name + " not found; looked in:" + looked + ". Install it with scripts/deps.sh (" +
                install_hint + ")"};
}

/// Who a spawned child runs as: another user (switch_user) or ourselves.
struct RunAs {
    bool switch_user = false;
    uid_t uid = 0;
    gid_t gid = 0;
    std::string why;  // non-empty: impossible
};

struct Spawn {
    std::vector<std::string> argv;  // argv[0] is the executable's full path
    std::vector<std::string> env;   // the whole environment
    std::filesystem::path cwd;
    int stdin_fd = -1;            // -1: /dev/null
    int out_fd = -1;              // stdout and stderr; -1: /dev/null
    const RunAs* user = nullptr;  // switch to it if switch_user
    bool new_process_group = false;
    bool new_session = false;
};

namespace detail {

[[noreturn]] inline void child_fail(const char* what) noexcept {
    // Async-signal-safe only: no strerror, no allocation.
    char digits[16];
    int n = 0;
    for (int e = errno; n < 15 && (n == 0 || e > 0); e /= 10)
        digits[n++] = static_cast<char>('0' + e % 10);
    char text[16];
    for (int i = 0; i < n; ++i)
        text[i] = digits[n - 1 - i];
    (void)!::write(2, "idem test fixture: ", 19);
    (void)!::write(2, what, std::strlen(what));
    (void)!::write(2, " failed, errno ", 15);
    (void)!::write(2, text, static_cast<std::size_t>(n));
    (void)!::write(2, "\n", 1);
    ::_exit(127);
}

/// Whether the user a server runs as can reach dir (as another user: every ancestor searchable
/// by others).
inline bool reachable(const std::filesystem::path& dir, bool switch_user) {
    std::error_code ec;
    if (!std::filesystem::is_directory(dir, ec)) return false;
    if (!switch_user) return ::access(dir.c_str(), W_OK | X_OK) == 0;
    for (auto p = std::filesystem::absolute(dir, ec); !p.empty(); p = p.parent_path()) {
        struct stat st {};
        if (::stat(p.c_str(), &st) != 0 || (st.st_mode & S_IXOTH) == 0) return false;
        if (p == p.root_path()) break;
    }
    return true;
}

}  // namespace detail

/// fork + exec. Everything the child touches is prepared before fork (only async-signal-safe
/// calls between fork and exec: the test process may have threads). Signals are blocked across
/// the fork: until the child has reset its handlers, a signal sent to it (a SIGTERM right after
/// the spawn) would run the PARENT's handler in the child and be lost, and the child would exec
/// and never see it. Blocked, it stays pending and reaches the child with the default action.
inline pid_t spawn(const Spawn& s) {
    std::vector<char*> argv;
    for (const auto& a : s.argv)
        argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    std::vector<char*> envp;
    for (const auto& e : s.env)
        envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
    const std::string cwd = s.cwd.string();
    const bool switch_user = s.user != nullptr && s.user->switch_user;
    const uid_t uid = switch_user ? s.user->uid : 0;
    const gid_t gid = switch_user ? s.user->gid : 0;
    const int devnull = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    if (devnull < 0) throw std::system_error(errno, std::generic_category(), "open /dev/null");
    const int in_fd = s.stdin_fd >= 0 ? s.stdin_fd : devnull;
    const int out_fd = s.out_fd >= 0 ? s.out_fd : devnull;
    sigset_t empty;
    sigemptyset(&empty);
    sigset_t all;
    sigfillset(&all);
    sigset_t before;
    ::pthread_sigmask(SIG_SETMASK, &all, &before);

    const pid_t pid = ::fork();
    if (pid != 0) ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
    if (pid < 0) {
        const int err = errno;
        ::close(devnull);
        throw std::system_error(err, std::generic_category(), "fork");
    }
    if (pid == 0) {
        using detail::child_fail;
        if (s.new_session) {
            if (::setsid() < 0) child_fail("setsid");
        } else if (s.new_process_group) {
            if (::setpgid(0, 0) < 0) child_fail("setpgid");
        }
        if (::dup2(in_fd, 0) < 0 || ::dup2(out_fd, 1) < 0 || ::dup2(out_fd, 2) < 0) {
            child_fail("dup2");
        }
        // Close everything else (the test's sockets, files, client connections).
        if (::syscall(SYS_close_range, 3U, ~0U, 0U) != 0) {
            for (int fd = 3; fd < 65536; ++fd)
                ::close(fd);
        }
        // Default handlers first, then unblock: a signal already pending now acts as it would
        // on the program the child becomes.
        for (int sig : {SIGPIPE, SIGINT, SIGTERM, SIGQUIT, SIGHUP, SIGCHLD, SIGUSR1, SIGUSR2}) {
            ::signal(sig, SIG_DFL);
        }
        ::sigprocmask(SIG_SETMASK, &empty, nullptr);
        if (switch_user) {
            if (::setgroups(1, &gid) != 0) child_fail("setgroups");
            if (::setgid(gid) != 0) child_fail("setgid");
            if (::setuid(uid) != 0) child_fail("setuid");
        }
        if (!cwd.empty() && ::chdir(cwd.c_str()) != 0) child_fail("chdir");
        ::execve(argv[0], argv.data(), envp.data());
        child_fail(argv[0]);
    }
    ::close(devnull);
    return pid;
}

/// spawn(), then closes @p fd (a file the child inherited, e.g. its log) in this process,
/// whether the spawn worked or not.
inline pid_t spawn_handing_over(const Spawn& s, int fd) {
    pid_t pid = -1;
    try {
        pid = spawn(s);
    } catch (...) {
        ::close(fd);
        throw;
    }
    ::close(fd);
    return pid;
}

/// waitpid with a deadline. Returns the wait status, or nullopt on timeout (child still there).
inline std::optional<int> wait_for(pid_t pid, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        int status = 0;
        const pid_t r = ::waitpid(pid, &status, WNOHANG);
        if (r == pid) return status;
        if (r < 0 && errno != EINTR) return -1;  // not our child (anymore): treat as gone
        if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
}

/// A process is gone when it does not exist or is a zombie (PID 1 may not reap orphans).
inline bool process_gone(pid_t pid) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    if (!stat) return true;
    std::string content((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const auto close_paren = content.rfind(')');
    if (close_paren == std::string::npos || close_paren + 2 >= content.size()) return true;
    const char state = content[close_paren + 2];
    return state == 'Z' || state == 'X';
}

/// Polls @p pred every 20 ms until it is true or @p timeout has passed; then its last answer.
template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout = std::chrono::seconds(15)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
        if (pred()) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return pred();
}

/// What killed_while() saw of its child.
struct KilledChild {
    int status = 0;      ///< the child's wait status
    std::string report;  ///< what it wrote: @p hold's report and "\n", or "error <what>\n"
};

/// A process that dies holding something, with no destructor running (the owner of a server
/// killed by SIGKILL): runs @p hold(die) in a fork()ed child, where hold starts what it holds
/// and calls die(report), which sends us the report and raises SIGKILL. An exception from
/// @p hold is reported as "error <what>" and the child exits 1. Throws std::system_error when
/// the pipe, fork or waitpid fails.
template <class Hold>
KilledChild killed_while(Hold hold) {
    int fds[2];
    if (::pipe(fds) != 0) throw std::system_error(errno, std::generic_category(), "pipe");
    const pid_t child = ::fork();
    if (child < 0) {
        const int err = errno;
        ::close(fds[0]);
        ::close(fds[1]);
        throw std::system_error(err, std::generic_category(), "fork");
    }
    if (child == 0) {
        ::close(fds[0]);
        auto say = [&](const std::string& text) {
            (void)!::write(fds[1], text.data(), text.size());
        };
        try {
            hold([&](const std::string& report) {
                say(report + "\n");
                ::raise(SIGKILL);  // die holding it: no destructor runs
            });
        } catch (const std::exception& e) {
            say(std::string("error ") + e.what() + "\n");
        }
        ::_exit(1);
    }
    ::close(fds[1]);
    KilledChild out;
    char buf[256];
    for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;)
        out.report.append(buf, static_cast<std::size_t>(n));
    ::close(fds[0]);
    if (::waitpid(child, &out.status, 0) != child) {
        throw std::system_error(errno, std::generic_category(), "waitpid");
    }
    return out;
}

/// Binds @p fd to a free port on 127.0.0.1 and returns the port; on failure closes @p fd and
/// throws.
inline int bind_loopback(int fd) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof addr;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
        const int err = errno;
        ::close(fd);
        throw std::system_error(err, std::generic_category(), "binding a free loopback port");
    }
    return ntohs(addr.sin_port);
}

/// Binds port 0 on 127.0.0.1 and returns the port the kernel chose (then releases it).
inline int probe_free_port() {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw std::system_error(errno, std::generic_category(), "socket");
    const int port = bind_loopback(fd);
    ::close(fd);
    return port;
}

/// Where a server's temp dir goes: $env_var if set; else /dev/shm when it is a tmpfs with at
/// least 1 GiB free (servers that fsync are I/O-bound: initdb takes ~0.7 s there against
/// 1.5-2 s on a busy ext4 /tmp; Docker's default 64 MB /dev/shm is skipped); else TMPDIR; else
/// /tmp. @p switch_user: the server runs as another user, who must be able to reach the dir.
inline std::filesystem::path temp_base(const char* env_var, bool switch_user = false) {
    if (const char* env = std::getenv(env_var); env != nullptr && *env != '\0') return env;
    struct statfs fs {};
    constexpr long tmpfs_magic = 0x01021994;
    if (::statfs("/dev/shm", &fs) == 0 && static_cast<long>(fs.f_type) == tmpfs_magic &&
        static_cast<unsigned long long>(fs.f_bavail) *
                static_cast<unsigned long long>(fs.f_bsize) >=
            (1ULL << 30) &&
        detail::reachable("/dev/shm", switch_user)) {
        return "/dev/shm";
    }
    std::error_code ec;
    std::filesystem::path base = std::filesystem::temp_directory_path(ec);
    if (!ec && detail::reachable(base, switch_user)) return base;
    return "/tmp";
}

/// mkdtemp under temp_base(): a fresh dir named <prefix>XXXXXX. Throws std::system_error.
inline std::filesystem::path make_temp_dir(const char* env_var, const std::string& prefix,
                                           bool switch_user = false) {
    std::string pattern = (temp_base(env_var, switch_user) / (prefix + "XXXXXX")).string();
    if (::mkdtemp(pattern.data()) == nullptr) {
        throw std::system_error(errno, std::generic_category(), "mkdtemp " + pattern);
    }
    return pattern;
}

/// Fills @p into (a directory that must not exist yet) with a copy of a data directory made
/// once per machine and @p key: initdb and mariadb-install-db are most of a test server's
/// start-up (1.5-4 s on a busy 2-core machine), and a test binary run one test per process
/// starts hundreds. @p make(dir) creates the data directory `dir` from nothing; it runs once,
/// in a staging directory under an exclusive flock, which is renamed into place only when
/// complete, so a half-made template is never copied. The copy belongs to @p owner (when it
/// switches users) and keeps the template's permission bits. The template stays under
/// temp_base() as `idem-template-<key>-<uid>`; IDEM_TEST_NO_TEMPLATE=1 makes every directory
/// from nothing instead. @p key must change with anything that changes what @p make writes.
template <class Make>
void copy_of_template(const std::string& key, const char* env_var,
                      const std::filesystem::path& into, const RunAs& owner, Make&& make) {
    namespace fs = std::filesystem;
    if (const char* off = std::getenv("IDEM_TEST_NO_TEMPLATE"); off != nullptr && *off == '1') {
        make(into);
        return;
    }
    const fs::path base = temp_base(env_var, owner.switch_user);
    const fs::path ready =
        base / ("idem-template-" + key + "-" + std::to_string(::geteuid())) / "data";
    std::error_code ec;
    if (!fs::exists(ready / ".complete", ec)) {
        const std::string lock_path = (base / ("idem-template-" + key + ".lock")).string();
        const int lock = ::open(lock_path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
        if (lock < 0) throw std::system_error(errno, std::generic_category(), "open " + lock_path);
        struct Unlock {
            int fd;
            ~Unlock() { ::close(fd); }  // closing releases the flock
        } unlock{lock};
        while (::flock(lock, LOCK_EX) != 0) {
            if (errno != EINTR) throw std::system_error(errno, std::generic_category(), "flock");
        }
        if (!fs::exists(ready / ".complete", ec)) {
            const fs::path staging =
                make_temp_dir(env_var, "idem-template-staging-", owner.switch_user);
            if (owner.switch_user && ::chown(staging.c_str(), owner.uid, owner.gid) != 0) {
                throw std::system_error(errno, std::generic_category(),
                                        "chown " + staging.string());
            }
            try {
                make(staging / "data");
                std::ofstream(staging / "data" / ".complete") << key << "\n";
                fs::remove_all(ready.parent_path(), ec);
                fs::rename(staging, ready.parent_path());
            } catch (...) {
                fs::remove_all(staging, ec);
                throw;
            }
        }
    }
    fs::copy(ready, into, fs::copy_options::recursive);
    fs::remove(into / ".complete");
    if (owner.switch_user) {
        auto own = [&](const fs::path& path) {
            if (::lchown(path.c_str(), owner.uid, owner.gid) != 0) {
                throw std::system_error(errno, std::generic_category(), "chown " + path.string());
            }
        };
        own(into);
        for (const auto& entry : fs::recursive_directory_iterator(into))
            own(entry.path());
    }
    fs::permissions(into, fs::status(ready).permissions(), fs::perm_options::replace);
}

/// Cleanup for a server whose test process dies without running destructors (crash, abort,
/// SIGKILL, ctest timeout): a `/bin/sh` in its own session holds one end of a socketpair; at EOF
/// it sends @p first_signal to the last pid it was told (SIGKILL 5 s later if still there) and
/// removes the dir. Normal exits never need it: the owner stops the server, says watch(0), and
/// stop()s the watchdog, which then only removes an already removed dir.
class Watchdog {
  public:
    Watchdog() = default;
    Watchdog(const Watchdog&) = delete;
    Watchdog& operator=(const Watchdog&) = delete;
    ~Watchdog() { stop(); }

    /// @p first_signal: a kill(1) signal name ("QUIT", "TERM"). Throws std::system_error.
    void start(const std::filesystem::path& dir, const char* first_signal) {
        int fds[2];
        if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
            throw std::system_error(errno, std::generic_category(), "socketpair");
        }
        static const char* const script =
            "trap '' HUP INT QUIT TERM PIPE USR1 USR2\n"
            "pid=0\n"
            "while IFS= read -r line; do pid=$line; done\n"
            "case $pid in ''|*[!0-9]*) pid=0 ;; esac\n"
            "if [ \"$pid\" -gt 0 ]; then\n"
            "  kill -\"$2\" \"$pid\" 2>/dev/null\n"
            "  i=0\n"
            "  alive() {\n"  // a zombie is dead: PID 1 may not reap orphans
            "    st=; read -r st < /proc/$pid/stat 2>/dev/null || return 1\n"
            "    st=${st##*') '}\n"
            "    case $st in Z*|X*|'') return 1 ;; esac\n"
            "  }\n"
            "  while alive && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done\n"
            "  kill -KILL \"$pid\" 2>/dev/null\n"
            "fi\n"
            "rm -rf -- \"$1\"\n";
        Spawn s;
        s.argv = {"/bin/sh", "-c", script, "idem-watchdog", dir.string(), first_signal};
        s.env = {"PATH=/usr/bin:/bin", "LC_ALL=C"};
        s.cwd = "/";
        s.stdin_fd = fds[1];
        s.new_session = true;
        try {
            pid_ = spawn(s);
        } catch (...) {
            ::close(fds[0]);
            ::close(fds[1]);
            throw;
        }
        ::close(fds[1]);
        fd_ = fds[0];
    }

    /// The server process to stop if we die; 0: none (it was stopped).
    void watch(pid_t pid) noexcept {
        if (fd_ < 0) return;
        const std::string line = std::to_string(pid) + "\n";
        (void)!::send(fd_, line.data(), line.size(), MSG_NOSIGNAL);
    }

    /// Closes our end (the watchdog then acts on the last pid it was told) and reaps it. In a
    /// fork()ed copy of the owner this only closes the copy's end: the owner's end stays open.
    void stop() noexcept {
        if (fd_ >= 0) {
            ::close(fd_);
            fd_ = -1;
        }
        if (pid_ > 0) {
            try {
                if (!wait_for(pid_, std::chrono::seconds(5))) {
                    ::kill(pid_, SIGKILL);
                    wait_for(pid_, std::chrono::seconds(1));
                }
            } catch (...) {
            }
            pid_ = -1;
        }
    }

    /// In a fork()ed copy of the owner: drop our end without waiting for anything.
    void abandon() noexcept {
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
        pid_ = -1;
    }

  private:
    int fd_ = -1;
    pid_t pid_ = -1;
};

}  // namespace testing

IDEM_END_NAMESPACE
