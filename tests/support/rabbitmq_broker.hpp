#pragma once
// The RabbitMQ broker of a test binary that needs its own settings (the shared one,
// idem::testing::shared_rabbitmq(), has the defaults): started once, on the first call, with
// the options of that call; later calls get the same broker. It takes seconds to start, so such
// binaries run as one ctest test (idem_tests_in_one_process in tests/CMakeLists.txt).

#include <exception>
#include <memory>
#include <stdexcept>
#include <string>

#include "idem/testing/rabbitmq_server.hpp"

namespace idem_test {

/// @throws std::runtime_error (every call) when the broker did not start.
inline idem::testing::RabbitmqServer& rabbitmq_broker(
    const idem::testing::RabbitmqOptions& options) {
    static std::string failure;
    static const std::unique_ptr<idem::testing::RabbitmqServer> server =
        [&]() -> std::unique_ptr<idem::testing::RabbitmqServer> {
        try {
            return std::make_unique<idem::testing::RabbitmqServer>(options);
        } catch (const std::exception& e) {
            failure = e.what();
            return nullptr;
        }
    }();
    if (!server) throw std::runtime_error("RabbitMQ did not start: " + failure);
    return *server;
}

}  // namespace idem_test
