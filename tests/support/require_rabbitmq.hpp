#pragma once
// IDEM_REQUIRE_RABBITMQ(): first statement of a TEST body, SetUp() or SetUpTestSuite() (anything
// returning void). Without rabbitmq-server (and epmd) it skips the test with the reason, except
// in CI (environment CI=true or CI=1), where a missing server is a failure, never a skip.

#include "idem/testing/rabbitmq_server.hpp"
#include "require_server.hpp"

#define IDEM_REQUIRE_RABBITMQ() IDEM_REQUIRE_SERVER(idem::testing::RabbitmqServer, "RabbitMQ")
