#pragma once
/// @file
/// @brief idem::serve_metrics(): a PrometheusObserver's render() served at `GET /metrics` by a
/// small cpp-httplib server (component idem::http; Debian: libcpp-httplib-dev).
///
/// @code
/// idem::PrometheusObserver metrics;
/// auto handler = idem::make_handler(store, idem::Policy{"payments"}, effect, &metrics);
/// auto endpoint = idem::serve_metrics(metrics, 9464);  // 127.0.0.1:9464/metrics
/// // or idem::serve_metrics(metrics, "0.0.0.0:9464"); port 0: a free port, endpoint.port()
/// @endcode
///
/// The endpoint starts listening in serve_metrics() (it throws idem::error when the address
/// cannot be bound) and stops in its destructor, which never throws. It serves on its own thread;
/// render() takes only the observer's short locks, so a scrape never blocks the handlers. The
/// observer must outlive the endpoint. Any other path is a 404.

#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <thread>

#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/observers/prometheus.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief A running `GET /metrics` endpoint (see serve_metrics()). Neither copyable nor movable:
/// keep it where it was made (`auto endpoint = idem::serve_metrics(...)`).
class MetricsEndpoint {
  public:
    /// The content type of the Prometheus text exposition format 0.0.4.
    static constexpr const char* content_type = "text/plain; version=0.0.4";

    /// Binds @p host:@p port (0: a free port) and serves @p observer's render() at /metrics.
    MetricsEndpoint(const PrometheusObserver& observer, std::string host, int port)
        : host_(std::move(host)) {
        if (port < 0 || port > 65535) {
            throw usage_error("idem::serve_metrics: port " + std::to_string(port) +
                              " is not in 0..65535");
        }
        server_.Get("/metrics", [&observer](const httplib::Request&, httplib::Response& res) {
            res.set_content(observer.render(), content_type);
        });
        // SO_REUSEADDR but not httplib's default SO_REUSEPORT: a port another process (or another
        // endpoint) listens on must be an error, not a listener sharing its connections.
        server_.set_socket_options([](auto sock) {
            const int yes = 1;
            ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
        });
        if (port == 0) {
            port_ = server_.bind_to_any_port(host_);
        } else if (server_.bind_to_port(host_, port)) {
            port_ = port;
        }
        if (port_ <= 0) {
            throw error("idem::serve_metrics: cannot listen on " + host_ + ":" +
                        std::to_string(port));
        }
        thread_ = std::thread([this] {
            server_.listen_after_bind();
            done_.store(true, std::memory_order_release);
        });
        // Serving before we return: a scrape right after serve_metrics() finds the endpoint.
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (!server_.is_running() && !done_.load(std::memory_order_acquire) &&
               std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
    }

    MetricsEndpoint(const MetricsEndpoint&) = delete;
    MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;
    MetricsEndpoint(MetricsEndpoint&&) = delete;
    MetricsEndpoint& operator=(MetricsEndpoint&&) = delete;

    /// Stops listening and joins the server thread. Never throws.
    ~MetricsEndpoint() {
        try {
            // stop() is a no-op until the listen loop runs: wait for it (or for its end).
            while (!server_.is_running() && !done_.load(std::memory_order_acquire))
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
            server_.stop();
            if (thread_.joinable()) thread_.join();
        } catch (...) {
        }
    }

    /// The port it listens on (the one chosen when it was asked for port 0).
    [[nodiscard]] int port() const noexcept { return port_; }
    /// @brief The address it listens on, as given.
    [[nodiscard]] const std::string& host() const noexcept { return host_; }
    /// `http://host:port/metrics`.
    [[nodiscard]] std::string url() const {
        return "http://" + host_ + ":" + std::to_string(port_) + "/metrics";
    }

  private:
    std::string host_;
    int port_ = 0;
    httplib::Server server_;
    std::atomic<bool> done_{false};
    std::thread thread_;
};

/// @brief Serves @p observer's render() at `GET /metrics` on 127.0.0.1:@p port (0: a free port,
/// read back with port()) until the returned endpoint is destroyed.
[[nodiscard]] inline MetricsEndpoint serve_metrics(const PrometheusObserver& observer, int port) {
    return MetricsEndpoint(observer, "127.0.0.1", port);
}

/// @brief The same on @p address, `"host:port"` (`"127.0.0.1:9464"`, `"0.0.0.0:0"`) or a port
/// alone (`"9464"`: 127.0.0.1). Throws idem::usage_error on anything else.
[[nodiscard]] inline MetricsEndpoint serve_metrics(const PrometheusObserver& observer,
                                                   std::string_view address) {
    const auto colon = address.rfind(':');
    const std::string host =
        colon == std::string_view::npos ? "127.0.0.1" : std::string(address.substr(0, colon));
    const std::string_view digits =
        colon == std::string_view::npos ? address : address.substr(colon + 1);
    int port = 0;
    bool ok = !host.empty() && !digits.empty() && digits.size() <= 5;
    for (char c : digits) {
        if (c < '0' || c > '9') {
            ok = false;
            break;
        }
        port = port * 10 + (c - '0');
    }
    if (!ok || port > 65535) {
        throw usage_error("idem::serve_metrics: address '" + std::string(address) +
                          "' is not host:port or a port");
    }
    return MetricsEndpoint(observer, host, port);
}

/// Overload resolution: a string literal is an address, not a bool-ish pointer.
[[nodiscard]] inline MetricsEndpoint serve_metrics(const PrometheusObserver& observer,
                                                   const char* address) {
    return serve_metrics(observer, std::string_view(address));
}

IDEM_END_NAMESPACE
