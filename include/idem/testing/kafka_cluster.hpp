#pragma once
/// @file
/// @brief idem::testing::KafkaCluster: a throwaway Kafka cluster for your tests, librdkafka's
/// mock cluster (rdkafka_mock.h) hosted in a process of its own. It speaks the Kafka protocol on
/// loopback ports (produce, fetch, consumer groups, offset commits), so clients in any process
/// (forked workers included) use it through its bootstrap servers. It is librdkafka's mock of a
/// broker, not Apache Kafka. POSIX/Linux; no gtest; shipped with the idem::kafka component.
///
/// @code
/// #include <idem/testing/kafka_cluster.hpp>
/// TEST(CaptureWorker, ResumesAfterACrash) {
///     idem::testing::KafkaCluster kafka{3};            // 3 brokers, before any client
///     kafka.create_topic("payments", 4);
///     auto config = idem::kafka::Config{}.bootstrap_servers(kafka.bootstrap_servers());
///     // ... fork a worker, SIGKILL it, start another ...
/// }
/// @endcode
///
///   KafkaCluster kafka{brokers};        // broker ids 1..brokers
///   kafka.create_topic(name, partitions[, replication])
///   kafka.bootstrap_servers()           // "127.0.0.1:<port>,..."
///   kafka.broker_down(id); kafka.broker_up(id)          // connections refused / accepted
///   kafka.push_request_errors(api_key, {errors...})     // the next requests of that kind fail
///   kafka.clear_request_errors(api_key)
///
/// How it runs: the constructor fork()s a host process, which creates a librdkafka handle and
/// the mock cluster on it, answers with the bootstrap servers, then serves the commands above,
/// one line each, over a socketpair. A test process that SIGKILLs its consumer processes keeps
/// the cluster; the host ends when the fixture is destroyed or when the owner dies (its end of
/// the socketpair closes; workers fork()ed from the owner hold that end too, so then when the
/// last of them is gone as well). The fork needs a process with ONE thread (librdkafka's threads
/// would not survive it): construct the cluster before any librdkafka client of the test process,
/// and fork() workers while the test process has no client open either. Only the process that
/// created it controls the cluster; in a fork()ed copy the destructor does nothing.

#include <librdkafka/rdkafka.h>
#include <librdkafka/rdkafka_mock.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "idem/config.hpp"
#include "idem/testing/process.hpp"

IDEM_BEGIN_NAMESPACE

namespace testing {

namespace detail {

/// The number of threads of this process (/proc/self/status); 0 when it cannot be read.
inline int thread_count() {
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);) {
        if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8);
    }
    return 0;
}

/// Writes all of @p text; false when the peer is gone.
inline bool write_all(int fd, const std::string& text) {
    std::size_t done = 0;
    while (done < text.size()) {
        const ssize_t n = ::send(fd, text.data() + done, text.size() - done, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return false;
        done += static_cast<std::size_t>(n);
    }
    return true;
}

/// One line (without its newline) from @p fd; false at EOF or on an error.
inline bool read_line(int fd, std::string& buffer, std::string& line) {
    for (;;) {
        const auto newline = buffer.find('\n');
        if (newline != std::string::npos) {
            line = buffer.substr(0, newline);
            buffer.erase(0, newline + 1);
            return true;
        }
        char chunk[512];
        const ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return false;
        buffer.append(chunk, static_cast<std::size_t>(n));
    }
}

/// The host process: never returns.
[[noreturn]] inline void host_mock_cluster(int fd, int brokers) noexcept {
    std::string buffer;
    try {
        char why[512] = {0};
        rd_kafka_conf_t* conf = rd_kafka_conf_new();
        rd_kafka_conf_set(conf, "log_level", "3", why, sizeof why);
        rd_kafka_t* rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, why, sizeof why);
        if (rk == nullptr) {
            write_all(fd, std::string("error rd_kafka_new: ") + why + "\n");
            ::_exit(1);
        }
        rd_kafka_mock_cluster_t* cluster = rd_kafka_mock_cluster_new(rk, brokers);
        if (cluster == nullptr) {
            write_all(fd, "error rd_kafka_mock_cluster_new failed\n");
            ::_exit(1);
        }
        write_all(fd, std::string("ready ") + rd_kafka_mock_cluster_bootstraps(cluster) + "\n");
        for (std::string line; read_line(fd, buffer, line);) {
            std::istringstream in(line);
            std::string command;
            in >> command;
            rd_kafka_resp_err_t err = RD_KAFKA_RESP_ERR_NO_ERROR;
            if (command == "topic") {
                std::string name;
                int partitions = 1;
                int replication = 1;
                in >> name >> partitions >> replication;
                err = rd_kafka_mock_topic_create(cluster, name.c_str(), partitions, replication);
            } else if (command == "down" || command == "up") {
                std::int32_t id = 0;
                in >> id;
                err = command == "down" ? rd_kafka_mock_broker_set_down(cluster, id)
                                        : rd_kafka_mock_broker_set_up(cluster, id);
            } else if (command == "errors") {
                int api_key = 0;
                in >> api_key;
                std::vector<rd_kafka_resp_err_t> errors;
                for (int code; in >> code;)
                    errors.push_back(static_cast<rd_kafka_resp_err_t>(code));
                rd_kafka_mock_push_request_errors_array(cluster, static_cast<std::int16_t>(api_key),
                                                        errors.size(), errors.data());
            } else if (command == "clear") {
                int api_key = 0;
                in >> api_key;
                rd_kafka_mock_clear_request_errors(cluster, static_cast<std::int16_t>(api_key));
            } else if (command == "quit") {
                break;
            } else {
                write_all(fd, "error unknown command '" + command + "'\n");
                continue;
            }
            write_all(fd, err == RD_KAFKA_RESP_ERR_NO_ERROR
                              ? std::string("ok\n")
                              : std::string("error ") + rd_kafka_err2str(err) + "\n");
        }
        rd_kafka_mock_cluster_destroy(cluster);
        rd_kafka_destroy(rk);
    } catch (...) {
        ::_exit(1);
    }
    ::_exit(0);
}

}  // namespace detail

class KafkaCluster {
  public:
    /// @brief Starts a mock cluster of @p brokers brokers (ids 1..brokers) in a host process.
    /// @throws std::runtime_error when this process has more than one thread (see the file's
    /// notes) or the host failed; std::system_error when socketpair or fork fails.
    explicit KafkaCluster(int brokers = 1) : brokers_(brokers) {
        if (brokers < 1) throw std::invalid_argument("KafkaCluster: at least one broker");
        if (const int threads = detail::thread_count(); threads > 1) {
            throw std::runtime_error(
                "KafkaCluster: this process has " + std::to_string(threads) +
                " threads; the mock cluster's host is fork()ed and needs a single-threaded "
                "process: construct the KafkaCluster before any librdkafka client (or thread) "
                "of the test");
        }
        int fds[2];
        if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
            throw std::system_error(errno, std::generic_category(), "socketpair");
        }
        // Signals blocked across the fork, as spawn() does: the host must not run our handlers.
        sigset_t all;
        sigfillset(&all);
        sigset_t before;
        ::pthread_sigmask(SIG_SETMASK, &all, &before);
        const pid_t pid = ::fork();
        if (pid == 0) {
            ::close(fds[0]);
            for (int sig : {SIGPIPE, SIGINT, SIGTERM, SIGQUIT, SIGHUP, SIGCHLD, SIGUSR1, SIGUSR2}) {
                ::signal(sig, SIG_DFL);
            }
            sigset_t none;
            sigemptyset(&none);
            ::sigprocmask(SIG_SETMASK, &none, nullptr);
            detail::host_mock_cluster(fds[1], brokers);
        }
        ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
        if (pid < 0) {
            const int err = errno;
            ::close(fds[0]);
            ::close(fds[1]);
            throw std::system_error(err, std::generic_category(), "fork");
        }
        ::close(fds[1]);
        fd_ = fds[0];
        pid_ = pid;
        owner_ = ::getpid();
        std::string line;
        if (!detail::read_line(fd_, buffer_, line) || line.rfind("ready ", 0) != 0) {
            stop();
            throw std::runtime_error("KafkaCluster: the mock cluster did not start: " +
                                     (line.empty() ? std::string("its host died") : line));
        }
        bootstrap_servers_ = line.substr(6);
    }

    KafkaCluster(const KafkaCluster&) = delete;
    KafkaCluster& operator=(const KafkaCluster&) = delete;
    /// Stops the host (quit, then SIGKILL after 5 s); in a fork()ed copy, nothing. Never throws.
    ~KafkaCluster() { stop(); }

    /// "127.0.0.1:<port>,..." (every broker), for Config::bootstrap_servers().
    [[nodiscard]] const std::string& bootstrap_servers() const noexcept {
        return bootstrap_servers_;
    }
    [[nodiscard]] int brokers() const noexcept { return brokers_; }
    /// The host process.
    [[nodiscard]] pid_t pid() const noexcept { return pid_; }

    /// @brief Creates @p topic with @p partitions partitions. (The mock cluster also creates
    /// a topic a client names first, with a default partition count: create the topics a test
    /// relies on here.) @throws std::runtime_error when the cluster refuses.
    void create_topic(const std::string& topic, int partitions = 1, int replication = 1) {
        command("topic " + topic + " " + std::to_string(partitions) + " " +
                std::to_string(replication));
    }

    /// @brief Broker @p id (1..brokers()) closes its connections and refuses new ones.
    void broker_down(int id) { command("down " + std::to_string(id)); }
    /// @brief Broker @p id accepts connections again.
    void broker_up(int id) { command("up " + std::to_string(id)); }

    /// @brief The next requests of kind @p api_key (RD_KAFKAP_... numbers: 0 Produce,
    /// 1 Fetch, 8 OffsetCommit, 9 OffsetFetch, 10 FindCoordinator, 11 JoinGroup, ...), one per
    /// error, are answered with @p errors in order; then the cluster answers normally again.
    void push_request_errors(int api_key, const std::vector<rd_kafka_resp_err_t>& errors) {
        std::string line = "errors " + std::to_string(api_key);
        for (const auto err : errors)
            line += " " + std::to_string(static_cast<int>(err));
        command(line);
    }
    /// @brief Drops the errors still pushed for @p api_key.
    void clear_request_errors(int api_key) { command("clear " + std::to_string(api_key)); }

  private:
    void command(const std::string& line) {
        if (fd_ < 0 || ::getpid() != owner_) {
            throw std::runtime_error("KafkaCluster: '" + line +
                                     "' from a process that does not own the cluster");
        }
        std::string answer;
        if (!detail::write_all(fd_, line + "\n") || !detail::read_line(fd_, buffer_, answer)) {
            throw std::runtime_error("KafkaCluster: '" + line + "': the host process is gone");
        }
        if (answer != "ok") throw std::runtime_error("KafkaCluster: '" + line + "': " + answer);
    }

    void stop() noexcept {
        if (pid_ <= 0) return;
        if (::getpid() != owner_) {  // a fork()ed copy: the cluster is the owner's
            if (fd_ >= 0) ::close(fd_);
            fd_ = -1;
            pid_ = -1;
            return;
        }
        if (fd_ >= 0) {
            (void)detail::write_all(fd_, "quit\n");
            ::close(fd_);
            fd_ = -1;
        }
        try {
            if (!wait_for(pid_, std::chrono::seconds(5))) {
                ::kill(pid_, SIGKILL);
                wait_for(pid_, std::chrono::seconds(5));
            }
        } catch (...) {
        }
        pid_ = -1;
    }

    int brokers_;
    int fd_ = -1;
    pid_t pid_ = -1;
    pid_t owner_ = -1;
    std::string buffer_;
    std::string bootstrap_servers_;
};

}  // namespace testing

IDEM_END_NAMESPACE
