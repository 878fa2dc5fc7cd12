#!/usr/bin/env bash
# Runs the redis_stream_consumer example against a throwaway redis-server
# (the ctest test example.redis_stream_consumer).
#
#   run_with_redis.sh EXAMPLE_BINARY [more example arguments...]
#
# Starts redis-server on a free 127.0.0.1 port in a temp dir (no persistence), runs
#   EXAMPLE_BINARY --redis 127.0.0.1:PORT --db TMPDIR/redis_stream_consumer.db --produce 200 ARGS...
# then stops the server and removes the dir, and exits with the example's status. Without a
# redis-server binary it exits 77 (ctest: skipped), or 1 when CI is true (CI=true or CI=1).
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 EXAMPLE_BINARY [ARGS...]" >&2
    exit 2
fi
example=$1
shift

# Like the tests (include/idem/testing/redis_server.hpp): IDEM_TEST_REDIS_SERVER names the binary, else
# redis-server in PATH, /usr/bin, /usr/sbin or /usr/local/bin.
server=""
why=""
if [[ -n "${IDEM_TEST_REDIS_SERVER:-}" ]]; then
    if [[ -x "$IDEM_TEST_REDIS_SERVER" && -f "$IDEM_TEST_REDIS_SERVER" ]]; then
        server=$IDEM_TEST_REDIS_SERVER
    else
        why="IDEM_TEST_REDIS_SERVER=$IDEM_TEST_REDIS_SERVER is not an executable file"
    fi
else
    server=$(command -v redis-server || true)
    for candidate in /usr/bin/redis-server /usr/sbin/redis-server /usr/local/bin/redis-server; do
        if [[ -z "$server" && -x "$candidate" ]]; then server=$candidate; fi
    done
    why="redis-server not found in PATH, /usr/bin, /usr/sbin or /usr/local/bin"
    why+=" (Debian: apt-get install redis-server, or scripts/deps.sh)"
fi
if [[ -z "$server" ]]; then
    echo "run_with_redis.sh: $why" >&2
    if [[ "${CI:-}" == true || "${CI:-}" == 1 ]]; then
        echo "run_with_redis.sh: CI=$CI: a missing redis-server is a failure" >&2
        exit 1
    fi
    echo "run_with_redis.sh: skipping (set CI=true to make this a failure)" >&2
    exit 77
fi

dir=$(mktemp -d "${TMPDIR:-/tmp}/idem-example-redis.XXXXXX")
server_pid=""
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
    if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
        kill -TERM "$server_pid" 2>/dev/null || true
        for _ in $(seq 50); do
            kill -0 "$server_pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# A port nobody listens on now: one that refuses a connection. (Another process may still take
# it before redis binds; then redis-server exits and we try another port.)
port_is_free() {
    ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

answers() {
    if command -v redis-cli >/dev/null 2>&1; then
        [[ "$(redis-cli -h 127.0.0.1 -p "$1" ping 2>/dev/null)" == "PONG" ]]
    else
        # No redis-cli: send an inline PING over bash's /dev/tcp and read the reply line.
        local reply=""
        { exec 3<>"/dev/tcp/127.0.0.1/$1"; } 2>/dev/null || return 1
        printf 'PING\r\n' >&3
        IFS= read -r -t 1 reply <&3 || true
        exec 3<&- 3>&-
        [[ "$reply" == "+PONG"* ]]
    fi
}

port=""
for attempt in $(seq 20); do
    candidate=$((20000 + RANDOM % 40000))
    port_is_free "$candidate" || continue
    "$server" --port "$candidate" --bind 127.0.0.1 --save "" --appendonly no --daemonize no \
        --dir "$dir" --logfile "$dir/redis.log" >"$dir/redis.out" 2>&1 &
    server_pid=$!
    for _ in $(seq 100); do  # up to 10 s
        if answers "$candidate"; then port=$candidate; break; fi
        kill -0 "$server_pid" 2>/dev/null || break  # exited: the port was taken, or worse
        sleep 0.1
    done
    [[ -n "$port" ]] && break
    kill -KILL "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=""
    if ! cat "$dir/redis.out" "$dir/redis.log" 2>/dev/null | grep -q "Address already in use"; then
        echo "run_with_redis.sh: redis-server did not start (attempt $attempt):" >&2
        cat "$dir/redis.out" "$dir/redis.log" 2>/dev/null | tail -n 20 >&2 || true
    fi
done
if [[ -z "$port" ]]; then
    echo "run_with_redis.sh: could not start redis-server on a free port" >&2
    exit 1
fi

status=0
"$example" --redis "127.0.0.1:$port" --db "$dir/redis_stream_consumer.db" --produce 200 "$@" \
    || status=$?
exit "$status"
