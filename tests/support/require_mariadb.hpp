#pragma once
// IDEM_REQUIRE_MARIADB(): first statement of a TEST body, SetUp() or SetUpTestSuite() (anything
// returning void). Without mariadb-install-db and mariadbd it skips the test with the reason,
// except in CI (environment CI=true or CI=1), where a missing server is a failure, never a skip.

#include "idem/testing/mariadb_server.hpp"
#include "require_server.hpp"

#define IDEM_REQUIRE_MARIADB() IDEM_REQUIRE_SERVER(idem::testing::MariadbServer, "MariaDB")
