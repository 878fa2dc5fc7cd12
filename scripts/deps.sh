#!/usr/bin/env bash
# Installs the Debian packages idem's build, tests and demo need.
#   as root:      apt-get installs only what is missing (apt-get update once, if needed)
#   as non-root:  prints the exact `sudo apt-get install ...` line and exits 1 if something is missing
# Usage: scripts/deps.sh [--check]     (--check: never install, just report; exit 1 if missing)
set -euo pipefail

# Every package, in one list. Later issues append here (redis-server libhiredis-dev postgresql
# libpq-dev ...).
IDEM_DEB_PACKAGES=(
    g++                 # gcc 12 (its ASan/UBSan/TSan runtimes come with it)
    clang               # clang 14
    libclang-rt-14-dev  # clang's sanitizer runtimes
    cmake
    make                # GNU make: the pkg-config consumer test builds with a plain Makefile
    ninja-build
    pkg-config
    libgtest-dev
    libgmock-dev
    libfmt-dev
    libsqlite3-dev
    clang-format        # clang-format 14: the pinned formatter of the format check
    util-linux          # setarch (TSan runs with ASLR off on high-entropy kernels)
    postgresql          # PostgreSQL server (initdb, postgres): tests start their own cluster
    libpq-dev           # libpq, the PostgreSQL store's client library (pg_config)
    redis-server        # Redis server: tests start their own (AOF, appendfsync always); also the
                        # Sentinels (redis-server --sentinel: the redis-sentinel package is a link)
    redis-tools         # redis-cli: redis-cli --cluster create for the Redis Cluster fixture
    libhiredis-dev      # hiredis, the Redis store's client library
    mariadb-server      # MariaDB 10.11 (mariadb-install-db, mariadbd): tests start their own
    libmariadb-dev      # libmariadb (Connector/C, mysql.h), the MySQL/MariaDB store's client
    libbenchmark-dev    # Google Benchmark: bench/ (scripts/bench.sh)
    prometheus          # promtool, and the server the /metrics scrape test starts
    libspdlog-dev       # spdlog (built on the system fmt): the idem::spdlog logging adapter
    rabbitmq-server     # RabbitMQ 3.10 (quorum queues): tests start their own node and epmd
    librabbitmq-dev     # rabbitmq-c 0.11, idem::rabbitmq's AMQP client
    libcpp-httplib-dev  # cpp-httplib, idem::http's /metrics endpoint (and the scrape test's client)
    nats-server         # NATS server 2.9 with JetStream: the tests start their own
    libnats-dev         # cnats 3.4, idem::nats's JetStream client library
    librdkafka-dev      # librdkafka 2.0, idem::kafka's client library (and its mock cluster)
    python3             # the doc tests' extractor (tests/doctest/doctest.py)
    doxygen             # the API reference (docs/Doxyfile; ctest docs.reference in gcc17)
    valgrind            # callgrind: the instructions per message of the bench's redis rows
)

check_only=0
case "${1:-}" in
    --check) check_only=1 ;;
    "") ;;
    -h | --help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "deps.sh: unknown argument '$1'" >&2; exit 2 ;;
esac

if ! command -v dpkg-query >/dev/null 2>&1; then
    echo "deps.sh: dpkg-query not found: this script knows Debian/Ubuntu only. Install:" >&2
    echo "  ${IDEM_DEB_PACKAGES[*]}" >&2
    exit 1
fi

missing=()
for pkg in "${IDEM_DEB_PACKAGES[@]}"; do
    status="$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)"
    if [[ "$status" != "installed" ]]; then
        missing+=("$pkg")
    fi
done

if ((${#missing[@]} == 0)); then
    echo "deps.sh: all ${#IDEM_DEB_PACKAGES[@]} packages are installed"
    exit 0
fi

install_line="apt-get install -y --no-install-recommends ${missing[*]}"
if ((check_only)) || [[ "$(id -u)" -ne 0 ]]; then
    echo "deps.sh: missing Debian packages: ${missing[*]}" >&2
    echo "deps.sh: run (as root or with sudo):" >&2
    echo "  sudo apt-get update && sudo ${install_line}" >&2
    exit 1
fi

echo "deps.sh: installing ${missing[*]}"
apt-get update
DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
