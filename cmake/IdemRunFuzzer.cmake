# cmake -P driver of the fuzz.* ctest tests (tests/fuzz/CMakeLists.txt): runs one libFuzzer
# target for SECONDS over a fresh copy of its seed corpus, so the repository's corpus is never
# written to. Every seed (each regression input among them) runs first; then libFuzzer mutates.
# A crash, a leak, a sanitizer report, a timeout of one input or an out-of-memory fails the test;
# the input that did it stays in WORK_DIR (crash-*, leak-*, timeout-*, oom-*), and the test's
# output names it.
# Inputs (-D): FUZZER (the executable) CORPUS (the seed directory) WORK_DIR SECONDS [DICT]
cmake_minimum_required(VERSION 3.18)

foreach(var IN ITEMS FUZZER CORPUS WORK_DIR SECONDS)
    if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
        message(FATAL_ERROR "IdemRunFuzzer: -D${var}=... is required")
    endif()
endforeach()
if(NOT IS_DIRECTORY "${CORPUS}")
    message(FATAL_ERROR "IdemRunFuzzer: no seed corpus at ${CORPUS}")
endif()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}/corpus")
file(GLOB seeds "${CORPUS}/*")
if(NOT seeds)
    message(FATAL_ERROR "IdemRunFuzzer: the seed corpus ${CORPUS} is empty")
endif()
file(COPY ${seeds} DESTINATION "${WORK_DIR}/corpus")

set(args -max_total_time=${SECONDS} -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
         -artifact_prefix=${WORK_DIR}/)
if(DEFINED DICT AND NOT "${DICT}" STREQUAL "")
    list(APPEND args -dict=${DICT})
endif()
message(STATUS "IdemRunFuzzer: ${FUZZER} ${args} ${WORK_DIR}/corpus")
execute_process(COMMAND "${FUZZER}" ${args} "${WORK_DIR}/corpus" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
    file(GLOB artifacts "${WORK_DIR}/crash-*" "${WORK_DIR}/leak-*" "${WORK_DIR}/timeout-*"
         "${WORK_DIR}/oom-*" "${WORK_DIR}/slow-unit-*")
    message(FATAL_ERROR "IdemRunFuzzer: ${FUZZER} failed (${rc}); the input: ${artifacts}. "
                        "Reproduce with: ${FUZZER} <input>")
endif()
