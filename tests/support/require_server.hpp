#pragma once
// IDEM_REQUIRE_SERVER(Server, "Name"): what IDEM_REQUIRE_POSTGRES(), IDEM_REQUIRE_REDIS() and
// IDEM_REQUIRE_MARIADB() expand to. First statement of a TEST body, SetUp() or SetUpTestSuite()
// (anything returning void). When Server::available(&why) is false it skips the test with the
// reason, except in CI (environment CI=true or CI=1), where a missing server is a failure, never
// a skip.

#include <gtest/gtest.h>

#include <string>

#include "idem/testing/process.hpp"  // running_in_ci()

#define IDEM_REQUIRE_SERVER(Server, name)                                                          \
    do {                                                                                           \
        std::string idem_require_server_why_;                                                      \
        if (!Server::available(&idem_require_server_why_)) {                                       \
            if (idem::testing::running_in_ci()) {                                                  \
                GTEST_FAIL() << name " is required in CI (CI=true): " << idem_require_server_why_; \
            }                                                                                      \
            GTEST_SKIP() << name " not available (set CI=true to make this a failure): "           \
                         << idem_require_server_why_;                                              \
        }                                                                                          \
    } while (0)
