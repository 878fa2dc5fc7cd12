#pragma once
// A TCP proxy in front of a real redis-server that answers one kind of command with an error
// reply instead of forwarding it: how a test meets a server that lacks a command form (Redis
// before 7.0 refuses `SET … NX … GET` with "ERR syntax error") without a second Redis version.
// Everything else is relayed byte for byte. Clients are expected to wait for their replies before
// sending a refused command (idem's store does), so the proxy's own reply cannot overtake a
// reply still coming from the server.
//
// RefusingProxy::dropping() makes one that FORWARDS the matching commands instead and then drops
// the client's connection without a reply: the server ran them, the client never hears of it (a
// connection lost mid-round-trip).

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/testing/process.hpp"

namespace idem_test {

class RefusingProxy {
  public:
    /// Refuses the commands @p refuse says yes to (arguments as sent) with @p error.
    RefusingProxy(std::string upstream_host, int upstream_port,
                  std::function<bool(const std::vector<std::string>&)> refuse, std::string error)
        : host_(std::move(upstream_host)),
          upstream_port_(upstream_port),
          refuse_(std::move(refuse)),
          error_("-" + std::move(error) + "\r\n") {
        listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (listener_ < 0) throw std::runtime_error("RefusingProxy: socket");
        port_ = idem::testing::bind_loopback(listener_);
        if (::listen(listener_, 16) != 0) {
            ::close(listener_);
            throw std::runtime_error("RefusingProxy: listen");
        }
        acceptor_ = std::thread([this] { accept_loop(); });
    }
    /// Forwards the commands @p drop says yes to, then closes the client's connection (and its
    /// own to the server) before any reply of theirs comes back.
    static std::unique_ptr<RefusingProxy> dropping(
        std::string upstream_host, int upstream_port,
        std::function<bool(const std::vector<std::string>&)> drop) {
        auto proxy = std::make_unique<RefusingProxy>(std::move(upstream_host), upstream_port,
                                                     std::move(drop), std::string());
        proxy->drop_ = true;
        return proxy;
    }
    RefusingProxy(const RefusingProxy&) = delete;
    RefusingProxy& operator=(const RefusingProxy&) = delete;
    ~RefusingProxy() {
        stop_ = true;
        ::shutdown(listener_, SHUT_RDWR);
        ::close(listener_);
        acceptor_.join();
        for (auto& t : relays_)
            t.join();
    }

    [[nodiscard]] int port() const noexcept { return port_; }
    /// How many commands were answered with the error.
    [[nodiscard]] int refused() const noexcept { return refused_.load(); }

  private:
    void accept_loop() {
        while (!stop_) {
            pollfd p{listener_, POLLIN, 0};
            if (::poll(&p, 1, 50) <= 0) continue;
            const int client = ::accept(listener_, nullptr, nullptr);
            if (client < 0) continue;
            relays_.emplace_back([this, client] { relay(client); });
        }
    }

    void relay(int client) {
        const int server = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_port = htons(static_cast<std::uint16_t>(upstream_port_));
        ::inet_pton(AF_INET, host_.c_str(), &addr.sin_addr);
        if (server < 0 || ::connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
            if (server >= 0) ::close(server);
            ::close(client);
            return;
        }
        std::string pending;  // bytes from the client not yet parsed into whole commands
        char buffer[65536];
        while (!stop_) {
            pollfd fds[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
            if (::poll(fds, 2, 50) <= 0) continue;
            if ((fds[1].revents & (POLLIN | POLLHUP)) != 0) {
                const ssize_t n = ::read(server, buffer, sizeof buffer);
                if (n <= 0 || !send_all(client, buffer, static_cast<std::size_t>(n))) break;
            }
            if ((fds[0].revents & (POLLIN | POLLHUP)) != 0) {
                const ssize_t n = ::read(client, buffer, sizeof buffer);
                if (n <= 0) break;
                pending.append(buffer, static_cast<std::size_t>(n));
                if (!forward_commands(pending, client, server)) break;
            }
        }
        ::close(server);
        ::close(client);
    }

    /// Forwards or refuses every whole command in @p pending and drops them from it.
    bool forward_commands(std::string& pending, int client, int server) {
        std::size_t used = 0;
        std::vector<std::string> args;
        while (true) {
            const std::size_t end = parse(pending, used, args);
            if (end == 0) break;
            if (refuse_(args)) {
                ++refused_;
                if (drop_) {
                    // Everything up to and with this command reaches the server; give it time
                    // to run them, then cut the client off before their replies.
                    send_all(server, pending.data() + used, end - used);
                    std::this_thread::sleep_for(std::chrono::milliseconds(100));
                    return false;
                }
                if (!send_all(client, error_.data(), error_.size())) return false;
            } else if (!send_all(server, pending.data() + used, end - used)) {
                return false;
            }
            used = end;
        }
        pending.erase(0, used);
        return true;
    }

    /// One RESP array of bulk strings starting at @p at: its arguments and where it ends, or 0
    /// when it is not all there yet.
    static std::size_t parse(const std::string& in, std::size_t at, std::vector<std::string>& out) {
        out.clear();
        auto line = [&](std::size_t from, std::size_t& value) -> std::size_t {
            const std::size_t crlf = in.find("\r\n", from);
            if (crlf == std::string::npos) return 0;
            value = std::stoul(in.substr(from + 1, crlf - from - 1));
            return crlf + 2;
        };
        if (at >= in.size() || in[at] != '*') return 0;
        std::size_t count = 0;
        std::size_t pos = line(at, count);
        if (pos == 0) return 0;
        for (std::size_t i = 0; i < count; ++i) {
            std::size_t size = 0;
            if (pos >= in.size()) return 0;
            pos = line(pos, size);
            if (pos == 0 || pos + size + 2 > in.size()) return 0;
            out.push_back(in.substr(pos, size));
            pos += size + 2;
        }
        return pos;
    }

    static bool send_all(int fd, const char* data, std::size_t size) {
        while (size > 0) {
            const ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
            if (n <= 0) return false;
            data += n;
            size -= static_cast<std::size_t>(n);
        }
        return true;
    }

    std::string host_;
    int upstream_port_;
    std::function<bool(const std::vector<std::string>&)> refuse_;
    std::string error_;
    bool drop_ = false;  ///< dropping(): forward, then cut the client off
    int listener_ = -1;
    int port_ = 0;
    std::atomic<bool> stop_{false};
    std::atomic<int> refused_{0};
    std::thread acceptor_;
    std::vector<std::thread> relays_;
};

/// Whether @p args is `SET … NX … GET` (any case): what Redis before 7.0 refuses.
inline bool is_set_nx_get(const std::vector<std::string>& args) {
    auto upper = [](std::string s) {
        std::transform(s.begin(), s.end(), s.begin(),
                       [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
        return s;
    };
    if (args.empty() || upper(args[0]) != "SET") return false;
    bool nx = false;
    bool get = false;
    for (std::size_t i = 3; i < args.size(); ++i) {
        const std::string word = upper(args[i]);
        nx = nx || word == "NX";
        get = get || word == "GET";
    }
    return nx && get;
}

}  // namespace idem_test
