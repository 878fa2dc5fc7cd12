#pragma once
/// @file
/// @brief idem::rabbitmq::Endpoint (user-facing as idem::RabbitEndpoint): where a RabbitMQ
/// broker is, who logs in and how long to wait for it. Link idem::rabbitmq.

#include <chrono>
#include <string>

#include <fmt/format.h>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace rabbitmq {

/// @brief Where a RabbitMQ broker is (AMQP 0-9-1 over TCP) and how long to wait for it.
struct Endpoint {
    /// The broker's host name or address.
    std::string host = "127.0.0.1";
    /// Its AMQP port.
    int port = 5672;
    /// The virtual host.
    std::string vhost = "/";
    std::string user = "guest";  ///< guest/guest logs in over loopback only (RabbitMQ's default)
    /// The user's password (describe() leaves it out).
    std::string password = "guest";
    /// The AMQP heartbeat the client asks for; 0: none. rabbitmq-c answers heartbeats only
    /// inside its calls, so one handler call longer than about twice this loses the connection
    /// (its deliveries are then redelivered, never acked on the dead channel).
    std::chrono::seconds heartbeat{60};
    /// How long the TCP connect and the AMQP handshake may each take.
    std::chrono::milliseconds connect_timeout{5000};
    /// Per synchronous method (declare, qos, consume, a publisher confirm). One that times out
    /// drops the connection: its effect on the broker is unknown.
    std::chrono::milliseconds rpc_timeout{10000};

    /// @brief `amqp://user@host:port/vhost`, for messages and logs (no password).
    [[nodiscard]] std::string describe() const {
        return fmt::format("amqp://{}@{}:{}{}", user, host, port, vhost == "/" ? "/" : "/" + vhost);
    }
};

}  // namespace rabbitmq

/// @brief The user-facing name of rabbitmq::Endpoint.
using RabbitEndpoint = rabbitmq::Endpoint;

IDEM_END_NAMESPACE
