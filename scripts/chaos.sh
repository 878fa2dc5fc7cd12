#!/usr/bin/env bash
# Builds and runs the chaos run (tests/chaos, docs/testing.md): capture messages over a real Redis
# stream, worker processes killed with SIGKILL mid-handler and restarted, a gateway with
# idempotency keys; every order must end with exactly one capture and one charge. Arguments go to
# idem_chaos, e.g.
#   ./scripts/chaos.sh --store redis --messages 2000
#   ./scripts/chaos.sh --store postgres --workers 6 --seed 7
#   ./scripts/chaos.sh --store mysql --messages 2000     # its own mariadbd
#   ./scripts/chaos.sh --store redis-cluster             # a 3-master cluster; a master killed too
#   ./scripts/chaos.sh --naive            # the negative control: divergences > 0, exit status 1
#   ./scripts/chaos.sh --chain redis:nats # two services chained by an outbox relay (docs/chain.md)
#   ./scripts/chaos.sh --broker nats --batch --store-outage-ms 3000 --messages 500
#       # --batch: each poll's deliveries in one handle_batch() (handle_in_batches), any broker;
#       # --store-outage-ms MS: the store unreachable for MS every few seconds while workers are
#       # killed (postgres, mysql, redis: the server SIGSTOPped or SIGKILLed and restarted;
#       # sqlite: the driver holds BEGIN EXCLUSIVE); docs/testing.md#store-outages
#   ./scripts/chaos.sh --broker kafka --batch --store-outage-ms 3000 --kill-interval-ms 2000
#   ./scripts/chaos.sh --redrive --store postgres --broker nats
#       # one order in 20 parked until the handler is fixed, then redriven (Store::redrive) by a
#       # redriver that is killed too; with --naive re-published without the claims' reset
#   ./scripts/chaos.sh --help
# Installs missing Debian packages first (scripts/deps.sh). Build output goes to stderr, so stdout
# is the run's own output (its last line is one JSON object); the exit status is the run's.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

./scripts/deps.sh >&2

# Release, in its own build directory. IDEM_WERROR=OFF: a compiler's new warning must not keep
# anyone from running it (scripts/test.sh keeps -Werror and runs the 500-message chaos tests).
# The four stores are required (a missing client library fails the configure, naming its
# package); the brokers (--broker rabbitmq, nats) are built when their libraries are found.
{
    cmake -S . -B build/chaos -G Ninja \
        -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CXX_COMPILER=g++ \
        -DIDEM_BUILD_TESTS=ON \
        -DIDEM_BUILD_EXAMPLES=OFF \
        -DIDEM_WITH_SQLITE=ON -DIDEM_WITH_POSTGRES=ON -DIDEM_WITH_REDIS=ON -DIDEM_WITH_MYSQL=ON \
        -DIDEM_WERROR=OFF
    cmake --build build/chaos -j 2 --target idem_chaos
} >&2

exec build/chaos/tests/chaos/idem_chaos "$@"
