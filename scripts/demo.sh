#!/usr/bin/env bash
# Builds and runs the payment_capture demo (examples/payment_capture): 2,000 captures through a
# simulated at-least-once broker on the embedded SQLite store. Arguments go to the demo.
# Installs missing Debian packages first (scripts/deps.sh). Build output goes to stderr, so stdout
# is the demo's own output (its last line is one JSON object).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

./scripts/deps.sh >&2

if [[ ! -f examples/payment_capture/main.cpp ]]; then
    echo "demo.sh: examples/payment_capture/main.cpp does not exist" >&2
    exit 1
fi

# IDEM_WERROR=OFF: a compiler's new warning must not keep a newcomer from seeing the demo
# (scripts/test.sh keeps -Werror). The demo needs the SQLite component only.
{
    cmake -S . -B build/demo -G Ninja \
        -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CXX_COMPILER=g++ \
        -DIDEM_BUILD_TESTS=OFF \
        -DIDEM_BUILD_EXAMPLES=ON \
        -DIDEM_WITH_SQLITE=ON \
        -DIDEM_WITH_POSTGRES=OFF \
        -DIDEM_WITH_REDIS=OFF \
        -DIDEM_WITH_MYSQL=OFF \
        -DIDEM_WITH_RABBITMQ=OFF \
        -DIDEM_WITH_NATS=OFF \
        -DIDEM_WITH_SPDLOG=OFF \
        -DIDEM_WITH_HTTP=OFF \
        -DIDEM_WERROR=OFF
    cmake --build build/demo -j 2 --target payment_capture
} >&2

exec build/demo/examples/payment_capture "$@"
