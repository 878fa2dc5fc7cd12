#!/usr/bin/env bash
# idem's benchmark suite: builds bench/ (idem_bench) in Release in build/bench and runs it. stdout
# carries one JSON object per case, e.g.
#   {"bench":"sqlite_single","store":"sqlite","batch":1,"idem_msgs_per_s":...,"raw_msgs_per_s":...,
#    "ratio":...,"target":"ratio >= 0.90","met":true,...}
# where "raw" is the same writes issued by hand without idem, measured in the same run, idem and
# raw alternating (the median of each side). Build output and progress go to stderr. The run
# starts its own redis-server and PostgreSQL on loopback in temp dirs; about 2 minutes (--quick:
# about 10 seconds). See docs/performance.md.
#
#   scripts/bench.sh                      every case
#   scripts/bench.sh --quick              a fast smoke run (2 rounds, short samples)
#   scripts/bench.sh --filter 'sqlite'    only the cases whose name matches (--list: the names)
#   scripts/bench.sh --no-pin             do not pin client and servers to one CPU
#   scripts/bench.sh --filter 'retained|purge_under_load|_workers|rss_flat_'
#                                         the opt-in scale cases (only run when --filter names
#                                         them; --retained-10m adds the 10M-claim level, minutes
#                                         per store; see docs/performance.md "Cost at scale")
#   scripts/bench.sh --profile [N] [CASE...]  callgrind profiles (instruction counts) of the hot
#                                         path of each CASE and its raw twin, N messages each
#                                         (default 20000; CASEs default: memory_single
#                                         sqlite_single sqlite_batch; also redis_single,
#                                         redis_single_local, redis_stream_consumer, whose twin
#                                         is redis_single_raw); needs valgrind
# Other options go to idem_bench (scripts/bench.sh --help lists them).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

BUILD=build/bench

./scripts/deps.sh >&2

# -g only adds symbols for the profiles; the code is Release (-O3 -DNDEBUG). IDEM_WERROR=OFF as in
# demo.sh: a new compiler's warning must not keep anyone from measuring. The four stores are
# required; the RabbitMQ and NATS rows are built when their libraries are found.
{
    cmake -S . -B "$BUILD" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CXX_FLAGS_RELEASE="-O3 -DNDEBUG -g" \
        -DCMAKE_CXX_COMPILER=g++ \
        -DIDEM_BUILD_TESTS=OFF \
        -DIDEM_BUILD_EXAMPLES=OFF \
        -DIDEM_BUILD_BENCHMARKS=ON \
        -DIDEM_WITH_SQLITE=ON -DIDEM_WITH_POSTGRES=ON -DIDEM_WITH_REDIS=ON -DIDEM_WITH_MYSQL=ON \
        -DIDEM_INSTALL=OFF \
        -DIDEM_WERROR=OFF
    cmake --build "$BUILD" -j 2 --target idem_bench
} >&2

BIN="$BUILD/bench/idem_bench"

if [[ "${1:-}" == "--profile" ]]; then
    messages="${2:-20000}"
    cases=("${@:3}")
    ((${#cases[@]})) || cases=(memory_single sqlite_single sqlite_batch)
    if ! command -v valgrind >/dev/null 2>&1; then
        echo "bench.sh: --profile needs valgrind (Debian: apt-get install valgrind)" >&2
        exit 1
    fi
    out="$(mktemp -d "${TMPDIR:-/tmp}/idem-callgrind-XXXXXX")"
    # Readable names: std::string for basic_string<...>, no inline namespace, no argument lists.
    shorten() {
        sed -e 's/std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >/std::string/g' \
            -e 's/std::basic_string_view<char, std::char_traits<char> >/std::string_view/g' \
            -e 's/idem::v0::/idem::/g' -e 's/ \[[^]]*\]$//' \
            -e 's/std::_Rb_tree<.*>::\([A-Za-z_]*\)(.*/std::_Rb_tree<...>::\1/' | cut -c1-150
    }
    twin_of() { case "$1" in redis_stream_consumer) echo redis_single_raw ;; *) echo "${1}_raw" ;; esac; }
    for name in "${cases[@]}"; do
        for side in "$name" "$(twin_of "$name")"; do
            valgrind --tool=callgrind --toggle-collect='*profiled_loop*' \
                --callgrind-out-file="$out/$side.out" "$BIN" --profile "$side" \
                --messages "$messages" 2>"$out/$side.log" >/dev/null
            total="$(sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$out/$side.log")"
            echo "== $side: $((total / messages)) instructions per message ($messages messages)"
        done
        echo "== $name (idem): top functions, exclusive"
        callgrind_annotate --inclusive=no "$out/$name.out" 2>/dev/null | sed -n '/^Ir/,$p' |
            sed -n '5,24p' | shorten || true
        echo "== $name (idem): idem and SQLite entry points, inclusive"
        callgrind_annotate --inclusive=yes "$out/$name.out" 2>/dev/null | sed -n '/^Ir/,$p' |
            shorten | grep -E '^ *[0-9,]+ \( *[0-9.]+%\)  [^ =]' |
            grep -E ':idem::[A-Za-z]*Store::[A-Za-z:]*[a-z_]+\(|sqlite3_step|sqlite3WalFrames|0x00000000000ff650' |
            awk '{ name = substr($0, index($0, "%)") + 3); sub(/^[^:]*:/, "", name); if (!seen[name]++) print }' |
            head -n 12 || true
    done
    echo "(callgrind files: $out; in Debian 12's libsqlite3 3.40.1, ???:0x...ff650 is walChecksumBytes, the WAL frame checksum)"
    exit 0
fi

exec "$BIN" "$@"
