#pragma once
// IDEM_REQUIRE_POSTGRES(): first statement of a TEST body, SetUp() or SetUpTestSuite() (anything
// returning void). Without PostgreSQL server binaries it skips the test with the reason, except
// in CI (environment CI=true or CI=1), where a missing server is a failure, never a skip.

#include <gtest/gtest.h>

#include <string>

#include "postgres_server.hpp"
#include "process.hpp"  // running_in_ci()

#define IDEM_REQUIRE_POSTGRES()                                                               \
    do {                                                                                      \
        std::string idem_require_postgres_why_;                                               \
        if (!::idem_test::PostgresServer::available(&idem_require_postgres_why_)) {           \
            if (::idem_test::running_in_ci()) {                                               \
                GTEST_FAIL() << "PostgreSQL is required in CI (CI=true): "                    \
                             << idem_require_postgres_why_;                                   \
            }                                                                                 \
            GTEST_SKIP() << "PostgreSQL not available (set CI=true to make this a failure): " \
                         << idem_require_postgres_why_;                                       \
        }                                                                                     \
    } while (0)
