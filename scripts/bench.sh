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
#   scripts/bench.sh --instructions [N] [CASE...]  one JSON line per CASE, <CASE>_instructions:
#                                         instructions per message of the idem side and of its
#                                         raw twin (callgrind, --toggle-collect on the measured
#                                         loop, N messages each, default 5000), instr_ratio =
#                                         idem / raw, and where they go (exclusive cost per
#                                         message by group: idem_groups, raw_groups). CASEs default:
#                                         redis_single redis_single_local redis_stream_consumer.
#                                         Deterministic (instruction counts, not time); needs
#                                         valgrind; about a minute
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

twin_of() {
    case "$1" in
        redis_stream_consumer) echo redis_single_raw ;;
        redis_loop_local_*) echo redis_single_local_raw ;;
        *) echo "${1}_raw" ;;
    esac
}

# callgrind of one side of a case: its instruction count in the measured loop (profiled_loop).
collect() {  # side messages out_dir
    valgrind --tool=callgrind --toggle-collect='*profiled_loop*' \
        --callgrind-out-file="$3/$1.out" "$BIN" --profile "$1" --messages "$2" 2>"$3/$1.log" >/dev/null
    sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$3/$1.log"
}

# The exclusive cost of a callgrind file grouped by where it is spent, per message, as JSON
# members ("hiredis":1694,...). A function's inlined pieces count under the file they come from
# (basic_string.h inlined into an idem function is std::string work).
groups_json() {  # file messages
    callgrind_annotate --inclusive=no --auto=no --threshold=100 "$1" 2>/dev/null |
        grep -E '^ *[0-9,]+ \( *[0-9.]+%\)  ' | grep -v 'PROGRAM TOTALS' |
        awk -v messages="$2" '{
            n = $1; gsub(",", "", n); line = $0; g = "other"
            if (line ~ /libhiredis/) g = "hiredis"
            else if (line ~ /malloc\.c|arena\.c|operator new|operator delete/) g = "malloc_free"
            else if (line ~ /fmt::|\/fmt\//) g = "fmt"
            else if (line ~ /basic_string|char_traits|libstdc\+\+/) g = "std_string"
            else if (line ~ /stl_vector|vector\.tcc|new_allocator|stl_construct|stl_uninit/) g = "std_vector"
            else if (line ~ /\/string\/|memmove|memset|memcpy|strlen/) g = "libc_memcpy"
            else if (line ~ /resp\.hpp|charconv/) g = "resp_args_encoding"
            else if (line ~ /record\.hpp|keys\.hpp|random\.hpp/) g = "keys_records_token"
            else if (line ~ /include\/idem\/(redis|store|broker)\//) g = "idem_redis_other"
            else if (line ~ /include\/idem\//) g = "idem_handler"
            else if (line ~ /\/bench\//) g = "bench_loop"
            else if (line ~ /libc\.so/) g = "libc_other"
            sum[g] += n
        } END {
            sep = ""
            for (g in sum) { printf "%s\"%s\":%d", sep, g, sum[g] / messages; sep = "," }
        }'
}

if [[ "${1:-}" == "--instructions" ]]; then
    messages=5000
    if [[ "${2:-}" =~ ^[0-9]+$ ]]; then
        messages="$2"
        shift
    fi
    cases=("${@:2}")
    ((${#cases[@]})) || cases=(redis_single redis_single_local redis_stream_consumer)
    if ! command -v valgrind >/dev/null 2>&1; then
        echo "bench.sh: --instructions needs valgrind (Debian: apt-get install valgrind)" >&2
        exit 1
    fi
    out="$(mktemp -d "${TMPDIR:-/tmp}/idem-instructions-XXXXXX")"
    for name in "${cases[@]}"; do
        twin="$(twin_of "$name")"
        echo "bench.sh: callgrind $name and $twin, $messages messages each" >&2
        idem="$(collect "$name" "$messages" "$out")"
        raw="$(collect "$twin" "$messages" "$out")"
        if [[ -z "$idem" || -z "$raw" ]]; then
            printf '{"bench":"%s_instructions","error":"callgrind collected nothing (see %s)"}\n' \
                "$name" "$out"
            continue
        fi
        case "$name" in
            redis_single) target=1.5 ;;
            redis_single_local) target=1.2 ;;
            *) target="" ;;
        esac
        awk -v name="$name" -v twin="$twin" -v m="$messages" -v i="$idem" -v r="$raw" \
            -v target="$target" -v groups="$(groups_json "$out/$name.out" "$messages")" \
            -v raw_groups="$(groups_json "$out/$twin.out" "$messages")" 'BEGIN {
                ratio = i / r
                printf "{\"bench\":\"%s_instructions\",\"raw\":\"%s\",\"messages\":%d,", name, twin, m
                printf "\"idem_instructions_per_msg\":%d,\"raw_instructions_per_msg\":%d,", i / m, r / m
                printf "\"instr_ratio\":%.3f,", ratio
                if (target != "") printf "\"target\":\"instr_ratio <= %s\",\"met\":%s,", target, (ratio <= target + 0 ? "true" : "false")
                printf "\"idem_groups\":{%s},\"raw_groups\":{%s},", groups, raw_groups
                printf "\"measured\":\"valgrind --tool=callgrind --toggle-collect=*profiled_loop*\"}\n"
            }'
    done
    echo "bench.sh: callgrind files in $out" >&2
    exit 0
fi

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
