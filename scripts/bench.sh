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
#   scripts/bench.sh --no-instructions    no callgrind pass: by default, after the timed run, each
#                                         redis row with a ratio gets both sides' client
#                                         instructions per message (idem_instructions_per_msg,
#                                         raw_instructions_per_msg, instr_ratio; 2,000 messages
#                                         a side; not with --quick)
#   scripts/bench.sh --filter 'retained|purge_under_load|expiry_under_load|_workers|rss_flat_'
#                                         the opt-in scale cases (only run when --filter names
#                                         them; --retained-10m adds the 10M-claim level, minutes
#                                         per store; --sqlite-pragma P runs PRAGMA P on their
#                                         SQLite stores; see docs/performance.md "Cost at scale")
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
#   scripts/bench.sh --against REV [--ab-runs N] [idem_bench options]
#                                         A/B: builds REV (a commit, tag or branch) in a temp dir
#                                         beside this tree's build, runs both builds' idem_bench
#                                         with the same options interleaved (REV, this tree, REV,
#                                         this tree, ... N times each, default 3), and prints one
#                                         JSON line per case: each build's median ratio and spread
#                                         (max - min over its runs) and b_vs_a, this tree's median
#                                         ratio over REV's; the load average before the run too.
#                                         Every run's own lines stay in the temp dir it names.
# Other options go to idem_bench (scripts/bench.sh --help lists them).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

BUILD=build/bench

./scripts/deps.sh >&2

# --against REV [--ab-runs N]: taken out here, the other options go to both builds' idem_bench.
AGAINST=""
AB_RUNS=3
INSTRUCTIONS=1
args=()
while (($#)); do
    case "$1" in
        --against)
            [[ $# -ge 2 ]] || { echo "bench.sh: --against needs a revision" >&2; exit 2; }
            AGAINST="$2"
            shift 2
            ;;
        --no-instructions)
            INSTRUCTIONS=0
            shift
            ;;
        --ab-runs)
            [[ $# -ge 2 && "$2" =~ ^[1-9][0-9]*$ ]] || { echo "bench.sh: --ab-runs needs a count" >&2; exit 2; }
            AB_RUNS="$2"
            shift 2
            ;;
        *) args+=("$1"); shift ;;
    esac
done
set -- "${args[@]+"${args[@]}"}"
if [[ -n "$AGAINST" ]]; then
    git rev-parse --verify --quiet "$AGAINST^{commit}" >/dev/null ||
        { echo "bench.sh: --against: '$AGAINST' is not a commit of this repository" >&2; exit 2; }
fi

# -g only adds symbols for the profiles; the code is Release (-O3 -DNDEBUG). IDEM_WERROR=OFF as in
# demo.sh: a new compiler's warning must not keep anyone from measuring. The four stores are
# required; the RabbitMQ and NATS rows are built when their libraries are found.
build_bench() {  # source_dir build_dir
    cmake -S "$1" -B "$2" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CXX_FLAGS_RELEASE="-O3 -DNDEBUG -g" \
        -DCMAKE_CXX_COMPILER=g++ \
        -DIDEM_BUILD_TESTS=OFF \
        -DIDEM_BUILD_EXAMPLES=OFF \
        -DIDEM_BUILD_BENCHMARKS=ON \
        -DIDEM_WITH_SQLITE=ON -DIDEM_WITH_POSTGRES=ON -DIDEM_WITH_REDIS=ON -DIDEM_WITH_MYSQL=ON \
        -DIDEM_INSTALL=OFF \
        -DIDEM_WERROR=OFF
    cmake --build "$2" -j 2 --target idem_bench
}
build_bench . "$BUILD" >&2

BIN="$BUILD/bench/idem_bench"

if [[ -n "$AGAINST" ]]; then
    out="$(mktemp -d "${TMPDIR:-/tmp}/idem-ab-XXXXXX")"
    rev="$(git rev-parse --short "$AGAINST")"
    echo "bench.sh: building $AGAINST ($rev) in $out/a" >&2
    mkdir -p "$out/a/src"
    git archive "$rev" | tar -x -C "$out/a/src"
    build_bench "$out/a/src" "$out/a/build" >&2
    BIN_A="$out/a/build/bench/idem_bench"
    # The builds just loaded the machine: wait (up to 3 minutes) for the 1-minute load average to
    # fall under 1 before the first run; it is reported either way.
    for ((wait = 0; wait < 36; ++wait)); do
        awk '{ exit !($1 < 1.0) }' /proc/loadavg && break
        sleep 5
    done
    load="$(cut -d' ' -f1 /proc/loadavg)"
    echo "bench.sh: load average $load before the run (run it alone: well under 1)" >&2
    for ((run = 1; run <= AB_RUNS; ++run)); do
        echo "bench.sh: run $run of $AB_RUNS: $rev" >&2
        "$BIN_A" "$@" >"$out/a.$run.jsonl"
        echo "bench.sh: run $run of $AB_RUNS: this tree" >&2
        "$BIN" "$@" >"$out/b.$run.jsonl"
    done
    python3 - "$out" "$AB_RUNS" "$rev" "$load" <<'PY'
import json, statistics, sys
out, runs, rev, load = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
def ratios(side):
    seen = {}
    for run in range(1, runs + 1):
        with open(f"{out}/{side}.{run}.jsonl") as f:
            for line in f:
                row = json.loads(line)
                if isinstance(row.get("ratio"), (int, float)):
                    seen.setdefault(row["bench"], []).append(row["ratio"])
    return seen
a, b = ratios("a"), ratios("b")
for name in sorted(set(a) | set(b)):
    row = {"bench": name, "against": rev, "runs": runs, "load_before": load}
    for side, seen in (("a", a), ("b", b)):
        if name in seen:
            row[f"{side}_ratio"] = round(statistics.median(seen[name]), 3)
            row[f"{side}_spread"] = round(max(seen[name]) - min(seen[name]), 3)
    if "a_ratio" in row and "b_ratio" in row and row["a_ratio"] > 0:
        row["b_vs_a"] = round(row["b_ratio"] / row["a_ratio"], 3)
        row["beyond_spread"] = abs(row["b_ratio"] - row["a_ratio"]) > max(row["a_spread"], row["b_spread"])
    print(json.dumps(row, separators=(",", ":")))
PY
    echo "bench.sh: every run's lines in $out (a = $rev, b = this tree)" >&2
    exit 0
fi

twin_of() {
    case "$1" in
        redis_stream_consumer | redis_stream_pipelined | redis_single_write) echo redis_single_raw ;;
        redis_replicas_to_ack) echo redis_single ;;  # its raw side: the same handler, no WAIT
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

# The redis rows with a ratio, each with a --profile of both sides: after the timed run (never
# during it), callgrind counts each side's client instructions per message, and the row gets
# idem_instructions_per_msg, raw_instructions_per_msg and instr_ratio (deterministic: a
# regression shows in them when the machine is busy too).
PROFILED_REDIS=(redis_single redis_single_write redis_batch redis_replicas_to_ack redis_single_local
    redis_loop_local_one_step redis_loop_local_pipelined redis_stream_pipelined redis_stream_consumer
    redis_cluster_single redis_cluster_batch)
INSTRUCTION_MESSAGES=2000
with_instructions() {
    local out line name twin idem raw
    out="$(mktemp -d "${TMPDIR:-/tmp}/idem-instructions-XXXXXX")"
    while IFS= read -r line; do
        name="$(sed -n 's/^{"bench":"\(redis_[a-z_]*\)".*"ratio":[0-9].*}$/\1/p' <<<"$line")"
        if [[ -n "$name" && " ${PROFILED_REDIS[*]} " == *" $name "* ]]; then
            twin="$(twin_of "$name")"
            echo "bench.sh: callgrind $name and $twin, $INSTRUCTION_MESSAGES messages each" >&2
            idem="$(collect "$name" "$INSTRUCTION_MESSAGES" "$out")"
            raw="$(collect "$twin" "$INSTRUCTION_MESSAGES" "$out")"
            if [[ -n "$idem" && -n "$raw" && "$raw" -gt 0 ]]; then
                line="${line%\}}$(awk -v i="$idem" -v r="$raw" -v m="$INSTRUCTION_MESSAGES" 'BEGIN {
                    printf ",\"idem_instructions_per_msg\":%d,\"raw_instructions_per_msg\":%d,", i / m, r / m
                    printf "\"instr_ratio\":%.3f,\"instructions_measured\":\"callgrind, %d messages a side\"}", i / r, m
                }')"
            else
                line="${line%\}},\"instructions_error\":\"callgrind collected nothing (see $out)\"}"
            fi
        fi
        printf '%s\n' "$line"
    done
}

quick=0
for arg in "$@"; do [[ "$arg" == --quick ]] && quick=1; done
if ((INSTRUCTIONS == 0 || quick)) || ! command -v valgrind >/dev/null 2>&1; then
    ((INSTRUCTIONS == 0 || quick)) || echo "bench.sh: no valgrind: the redis rows go without instructions" >&2
    exec "$BIN" "$@"
fi
rows="$(mktemp "${TMPDIR:-/tmp}/idem-bench-XXXXXX")"
"$BIN" "$@" >"$rows"
with_instructions <"$rows"
rm -f "$rows"
