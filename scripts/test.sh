#!/usr/bin/env bash
# Runs every idem test: the whole CI matrix, each configuration in its own build/<name> directory.
#
#   scripts/test.sh                  all configurations, in this order:
#     gcc17    g++ C++17, Debug: every test, and the doc tests (every C++ block of README.md and
#              docs/ compiled, tests/doctest/; only here: about 80 CPU seconds), the API reference
#              (label docs: Doxygen over docs/Doxyfile and docs/Doxyfile.core, any warning fails,
#              an undocumented entity of the reference too; only here)
#              and the Debian package (ctest install.deb_package, label package; only here)
#     core     g++ C++17, Debug, every component OFF (IDEM_WITH_<NAME>=OFF for each
#              idem_add_backend() of CMakeLists.txt): the core tests build and pass without SQLite,
#              libpq, hiredis, libmariadb, rabbitmq-c, cnats, librdkafka, spdlog or cpp-httplib
#     asan     clang++ C++20, AddressSanitizer + UndefinedBehaviorSanitizer: every test but the
#              chaos runs (not even built, IDEM_BUILD_CHAOS=OFF: the driver kills workers on a
#              clock, and in a build 3-4x slower most of them die before they handle anything,
#              so runs time out undrained or park messages at the poison limit through kills
#              alone; gcc17 runs them all, and
#              the crash, fork and outage tests run here), the Debian package's test (label
#              package) and the install and configure tests (labels install, configure: they
#              configure, build and install projects with CMake; nothing a sanitizer looks at,
#              and gcc17 runs them); and the only run of
#              the libFuzzer targets (IDEM_BUILD_FUZZERS=ON, tests/fuzz/): fuzz.<parser>, label
#              fuzz, each IDEM_FUZZ_SECONDS (15) over its seed corpus, about 2 CPU minutes in
#              all. The gcc configurations do not register them. This is also the C++20 and the
#              clang build of every test: a configuration of its own for them only repeated these
#              minutes. Its build starts in the background at the lowest priority once gcc17's
#              build is done, on the CPU gcc17's tests (which mostly wait) leave idle
#     tsan     clang++ C++17, ThreadSanitizer: the tests labelled `concurrency`
#     format   clang-format --dry-run -Werror over include/ tests/ examples/ bench/ tools/
#   scripts/test.sh --quick          gcc17 only
#   scripts/test.sh --config NAME    one configuration (NAME as above, or a..e)
#
# Every configuration but core passes IDEM_WITH_<NAME>=ON for every component: a client library
# missing here is a configure error naming its package, never a component silently left out.
#
# Installs missing Debian packages first (scripts/deps.sh). Stops at the first failure with a
# non-zero status; prints one summary line per configuration at the end.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"

ALL_CONFIGS=(gcc17 core asan tsan format)
JOBS=2
export CTEST_PARALLEL_LEVEL=$JOBS
export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | grep '^#' | sed 's/^# \{0,1\}//'; }

# The components, as CMakeLists.txt declares them (idem_add_backend(<name>), one a line).
mapfile -t COMPONENTS < <(sed -n 's/^idem_add_backend(\([a-z0-9_]*\).*/\1/p' "$ROOT/CMakeLists.txt")
((${#COMPONENTS[@]})) || { echo "test.sh: no idem_add_backend() in CMakeLists.txt" >&2; exit 1; }
# with_components ON|OFF: -DIDEM_WITH_<NAME>=ON|OFF for every component
with_components() {
    local component
    for component in "${COMPONENTS[@]}"; do printf -- '-DIDEM_WITH_%s=%s\n' "${component^^}" "$1"; done
}

configs=("${ALL_CONFIGS[@]}")
while (($#)); do
    case "$1" in
        --quick) configs=(gcc17) ;;
        --config)
            [[ $# -ge 2 ]] || { echo "test.sh: --config needs a name" >&2; exit 2; }
            case "$2" in
                a) configs=(gcc17) ;; b) configs=(asan) ;; c) configs=(tsan) ;;
                d) configs=(format) ;; e) configs=(core) ;;
                gcc17 | core | asan | tsan | format) configs=("$2") ;;
                *) echo "test.sh: unknown config '$2' (one of: ${ALL_CONFIGS[*]})" >&2; exit 2 ;;
            esac
            shift ;;
        --config=*) set -- --config "${1#--config=}" "${@:2}"; continue ;;
        --asan-build-only) configs=(asan_build) ;;  # start_asan_prebuild's background build
        -h | --help) usage; exit 0 ;;
        *) echo "test.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

# The background asan build has what it needs: the run that started it installed it.
[[ "${configs[*]}" == asan_build ]] || "$ROOT/scripts/deps.sh"

# ---------------------------------------------------------------------------------------------
if [[ -t 1 ]]; then
    say() { printf '\n\033[1m[test.sh] %s\033[0m\n' "$*"; }
else
    say() { printf '\n[test.sh] %s\n' "$*"; }
fi

# configure_and_build NAME CXX STD [extra cmake args...] -- [build targets...]
configure_and_build() {
    local name="$1" cxx="$2" std="$3"
    shift 3
    local cmake_args=() targets=()
    while (($#)) && [[ "$1" != "--" ]]; do cmake_args+=("$1"); shift; done
    (($#)) && shift
    targets=("$@")
    local dir="$ROOT/build/$name"
    # Every component required, unless the configuration says otherwise (core: OFF); later -D win.
    local with_args=()
    mapfile -t with_args < <(with_components ON)
    say "$name: configure ($cxx, C++$std) in build/$name"
    cmake -S "$ROOT" -B "$dir" -G Ninja \
        "${with_args[@]}" \
        -DCMAKE_BUILD_TYPE=Debug \
        -DCMAKE_CXX_COMPILER="$cxx" \
        -DCMAKE_CXX_STANDARD="$std" \
        -DCMAKE_CXX_STANDARD_REQUIRED=ON \
        -DCMAKE_CXX_EXTENSIONS=OFF \
        "${cmake_args[@]}"
    say "$name: build"
    if ((${#targets[@]})); then
        cmake --build "$dir" -j "$JOBS" --target "${targets[@]}"
    else
        cmake --build "$dir" -j "$JOBS"
    fi
}

# run_ctest NAME [wrapper...] -- [ctest args...]; keeps the log for the summary line
run_ctest() {
    local name="$1"
    shift
    local wrapper=()
    while (($#)) && [[ "$1" != "--" ]]; do wrapper+=("$1"); shift; done
    (($#)) && shift
    local dir="$ROOT/build/$name"
    say "$name: ctest $*"
    local rc=0
    (cd "$dir" && "${wrapper[@]}" ctest --output-on-failure -j "$JOBS" "$@") 2>&1 |
        tee "$dir/ctest.log" || rc=$?
    slowest "$name" || true
    return "$rc"
}

# slowest NAME: the 15 slowest tests of the configuration's last ctest run, and the seconds all
# of them took together (where CI's time goes; ctest prints "Test #N: name ... Passed  1.23 sec")
slowest() {
    local log="$ROOT/build/$1/ctest.log" times
    [[ -f "$log" ]] || return 0
    times="$(awk '/Test +#[0-9]+: / { for (i = 1; i <= NF; ++i) if ($i == "sec") t = $(i - 1);
                 for (j = 1; j <= NF; ++j) if ($j ~ /^#[0-9]+:$/) name = $(j + 1);
                 printf "%10.2f  %s\n", t, name }' "$log")"
    [[ -n "$times" ]] || return 0
    sort -rn <<<"$times" | head -n 15 | sed "s/^/[test.sh] $1 slowest: /"
    awk '{ total += $1 } END { printf "[test.sh] %s: %.0f test-seconds in all\n", name, total }' \
        name="$1" <<<"$times"
}

run_gcc17() {
    # -g0: no test reads debug info, and it is an eighth of the compile time (a Debug build is
    # still -O0 with assertions); the asan configuration keeps line tables for its reports.
    configure_and_build gcc17 g++ 17 -DCMAKE_CXX_FLAGS_DEBUG=-g0 -DIDEM_BUILD_DOCTESTS=ON \
        -DIDEM_BUILD_DOCS=ON
    # The Kafka chaos runs (label chaos_kafka) spend their minutes waiting on the mock cluster's
    # group rebalances, at about 6% of one core: they run one after another in a ctest of their
    # own, beside the ctest of every other test (two at a time, as everywhere), so their ten
    # minutes no longer queue behind the other chaos runs' lock.
    local dir="$ROOT/build/gcc17" rc=0 kafka_rc=0 kafka_pid
    start_asan_prebuild
    # The GoogleTest binaries list their tests when ctest starts (DISCOVERY_MODE PRE_TEST), into
    # one file per binary: listed once here, first, or the two ctests would both write them at
    # once, and a file written twice registers every test of its binary twice.
    (cd "$dir" && ctest -N >/dev/null)
    (cd "$dir" && ctest --output-on-failure -j 1 -L chaos_kafka) >"$dir/ctest-kafka.log" 2>&1 &
    kafka_pid=$!
    run_ctest gcc17 -- -LE chaos_kafka || rc=$?
    wait "$kafka_pid" || kafka_rc=$?
    say "gcc17: ctest -L chaos_kafka (ran beside the other tests)"
    cat "$dir/ctest-kafka.log"
    cat "$dir/ctest-kafka.log" >>"$dir/ctest.log"
    slowest gcc17 || true
    ((rc == 0)) && ((kafka_rc == 0))
}

run_core() {
    # --no-tests=error: the core tests must be there even with every component off.
    local off=()
    mapfile -t off < <(with_components OFF)
    configure_and_build core g++ 17 "${off[@]}"
    run_ctest core -- --no-tests=error
}

configure_and_build_asan() {
    local flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
    # Line tables only: a sanitizer's report names file and line, and the build is faster.
    configure_and_build asan clang++ 20 -DCMAKE_CXX_FLAGS="$flags" \
        -DCMAKE_CXX_FLAGS_DEBUG=-gline-tables-only -DIDEM_BUILD_FUZZERS=ON -DIDEM_BUILD_CHAOS=OFF
}

# The asan build, started in the background at the lowest priority (nice 19, its own process
# group) once gcc17's build is done, when asan is to run: gcc17's tests mostly wait on servers
# and brokers, and the build takes the CPU they leave idle instead of as many minutes of its
# own after them. run_asan waits for it, then builds in the foreground (nothing left to do, or
# the rest, and any error shown there).
ASAN_PREBUILD="$ROOT/build/asan-prebuild"
start_asan_prebuild() {
    [[ " ${configs[*]} " == *" asan "* ]] || return 0
    rm -f "$ASAN_PREBUILD.rc"
    setsid bash -c 'renice -n 19 -p $$ >/dev/null; exec "$@"' prebuild \
        "$ROOT/scripts/test.sh" --asan-build-only >"$ASAN_PREBUILD.log" 2>&1 &
    echo $! >"$ASAN_PREBUILD.pid"
}
wait_asan_prebuild() {
    [[ -f "$ASAN_PREBUILD.pid" ]] || return 0
    local pid
    pid="$(cat "$ASAN_PREBUILD.pid")"
    while kill -0 "$pid" 2>/dev/null; do sleep 2; done
    rm -f "$ASAN_PREBUILD.pid"
    say "asan: the build started beside gcc17's tests ended: $(tail -n 1 "$ASAN_PREBUILD.log")"
}
stop_asan_prebuild() {
    [[ -f "$ASAN_PREBUILD.pid" ]] || return 0
    kill -- "-$(cat "$ASAN_PREBUILD.pid")" 2>/dev/null || true
    rm -f "$ASAN_PREBUILD.pid"
}

run_asan_build() { configure_and_build_asan; }

run_asan() {
    wait_asan_prebuild
    configure_and_build_asan
    export ASAN_OPTIONS="detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
    run_ctest asan -- -LE 'chaos|package|install|configure'
}

run_tsan() {
    # Only the concurrency tests run under TSan, so only they are built (idem_concurrency_tests).
    configure_and_build tsan clang++ 17 -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
        -DIDEM_BUILD_EXAMPLES=OFF -- idem_concurrency_tests
    export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"
    # TSan of gcc 12 / clang 14 dies at startup ("FATAL: ThreadSanitizer: unexpected memory
    # mapping") on kernels with high mmap ASLR entropy; setarch -R turns ASLR off for ctest and
    # every test it starts. Skipped where the sandbox forbids personality(ADDR_NO_RANDOMIZE).
    local wrapper=()
    if setarch "$(uname -m)" -R true >/dev/null 2>&1; then
        wrapper=(setarch "$(uname -m)" -R)
    else
        echo "[test.sh] tsan: setarch -R is not permitted here; running with ASLR on" >&2
    fi
    # --no-tests=error: a TSan job that found nothing to run must not pass.
    run_ctest tsan "${wrapper[@]}" -- -L concurrency --no-tests=error
}

run_format() {
    local cf=clang-format
    command -v clang-format-14 >/dev/null 2>&1 && cf=clang-format-14
    say "format: $("$cf" --version | head -n1)"
    local files=()
    mapfile -t files < <(find include tests examples bench tools -type f \( -name '*.hpp' -o -name '*.cpp' \) | sort)
    if ((${#files[@]} == 0)); then
        echo "format: no files"
        return 0
    fi
    "$cf" --dry-run -Werror "${files[@]}"
    echo "format: ${#files[@]} files are clang-formatted"
}

# ---------------------------------------------------------------------------------------------
summary=()
fmt_time() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

print_summary() {
    printf '\n[test.sh] summary\n'
    local line
    for line in "${summary[@]}"; do printf '  %s\n' "$line"; done
}

mkdir -p "$ROOT/build"
total_start=$SECONDS
for config in "${configs[@]}"; do
    start=$SECONDS
    rm -f "$ROOT/build/$config/ctest.log"
    set +e
    (
        set -euo pipefail
        "run_$config"
    )
    rc=$?
    set -e
    elapsed=$(fmt_time $((SECONDS - start)))
    detail=""
    if [[ "$config" != format && -f "$ROOT/build/$config/ctest.log" ]]; then
        # one line per ctest the configuration ran (gcc17 runs two side by side)
        detail="$(grep -E 'tests passed|No tests were found' "$ROOT/build/$config/ctest.log" |
            paste -sd ';' - || true)"
    fi
    if ((rc != 0)); then
        summary+=("$(printf '%-8s FAILED  %8s  %s' "$config" "$elapsed" "$detail")")
        print_summary
        stop_asan_prebuild
        echo "[test.sh] FAILED in configuration '$config' (exit $rc); rerun it with: scripts/test.sh --config $config"
        exit 1
    fi
    summary+=("$(printf '%-8s passed  %8s  %s' "$config" "$elapsed" "$detail")")
done
print_summary
echo "[test.sh] all ${#configs[@]} configuration(s) passed in $(fmt_time $((SECONDS - total_start)))"
