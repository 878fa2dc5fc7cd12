#pragma once
// IDEM_REQUIRE_POSTGRES(): first statement of a TEST body, SetUp() or SetUpTestSuite() (anything
// returning void). Without PostgreSQL server binaries it skips the test with the reason, except
// in CI (environment CI=true or CI=1), where a missing server is a failure, never a skip.

#include "idem/testing/postgres_server.hpp"
#include "require_server.hpp"

#define IDEM_REQUIRE_POSTGRES() IDEM_REQUIRE_SERVER(idem::testing::PostgresServer, "PostgreSQL")
