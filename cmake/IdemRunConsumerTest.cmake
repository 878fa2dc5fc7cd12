# cmake -P driver for the consumer tests registered in tests/CMakeLists.txt.
#
# CONSUMER_MODE:
#   find_package       install IDEM_BUILD_DIR into a fresh prefix, then build and run
#                      tests/consumer against it with find_package(idem ... COMPONENTS sqlite),
#                      and the example store examples/journal_store under the installed
#                      conformance suite (idem/testing/conformance.hpp)
#   add_subdirectory   build and run tests/consumer with add_subdirectory(IDEM_SOURCE_DIR)
#   unknown_component  install, then check find_package(idem COMPONENTS <unknown>) fails cleanly
#   not_built_component  install IDEM_BUILD_DIR (a build without CONSUMER_NOT_BUILT), then check
#                      that find_package(idem COMPONENTS <it>) fails saying it was not built
#                      and naming CONSUMER_NOT_BUILT_PACKAGE, with and without REQUIRED, and
#                      that the core of the same install is found
#   pkgconfig          install, then build tests/consumer_pkgconfig with GNU make and
#                      `pkg-config --cflags --libs idem-<component>` only (PKG_CONFIG_PATH =
#                      the prefix's pkgconfig dir), and run what it built
# Inputs (-D): IDEM_SOURCE_DIR IDEM_BUILD_DIR CONSUMER_SOURCE_DIR CONSUMER_WORK_DIR
#   CONSUMER_GENERATOR CONSUMER_MAKE_PROGRAM CONSUMER_CXX_COMPILER CONSUMER_CXX_STANDARD
#   CONSUMER_CXX_FLAGS CONSUMER_BUILD_TYPE; CONSUMER_COMPONENTS (the components the consumer
#   uses, comma-separated) and CONSUMER_IDEM_OPTIONS (IDEM_WITH_<NAME>=ON|OFF,..., handed to
#   idem in add_subdirectory mode); CONSUMER_INSTALLED_COMPONENTS (comma-separated; every mode
#   that installs checks that the prefix holds the CMake targets file and .pc file of exactly
#   these components); for pkgconfig also CONSUMER_GNU_MAKE, CONSUMER_PKG_CONFIG and
#   CONSUMER_PKGCONFIG_DIR (relative to the prefix); for not_built_component also
#   CONSUMER_NOT_BUILT and CONSUMER_NOT_BUILT_PACKAGE
cmake_minimum_required(VERSION 3.18)

foreach(var IN ITEMS IDEM_SOURCE_DIR IDEM_BUILD_DIR CONSUMER_SOURCE_DIR CONSUMER_WORK_DIR
                     CONSUMER_MODE CONSUMER_GENERATOR CONSUMER_CXX_COMPILER)
    if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
        message(FATAL_ERROR "IdemRunConsumerTest: -D${var}=... is required")
    endif()
endforeach()

function(run_step what)
    message(STATUS "[consumer:${CONSUMER_MODE}] ${what}: ${ARGN}")
    execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
    if(NOT rc EQUAL 0)
        message(FATAL_ERROR "[consumer:${CONSUMER_MODE}] ${what} failed (${rc}):\n${out}")
    endif()
    set(step_output "${out}" PARENT_SCOPE)
endfunction()

set(prefix "${CONSUMER_WORK_DIR}/prefix")
set(build "${CONSUMER_WORK_DIR}/build")
file(REMOVE_RECURSE "${CONSUMER_WORK_DIR}")
file(MAKE_DIRECTORY "${CONSUMER_WORK_DIR}")

set(configure_args -G "${CONSUMER_GENERATOR}" "-DCMAKE_CXX_COMPILER=${CONSUMER_CXX_COMPILER}")
if(CONSUMER_MAKE_PROGRAM)
    list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${CONSUMER_MAKE_PROGRAM}")
endif()
if(CONSUMER_CXX_STANDARD)
    list(APPEND configure_args "-DCMAKE_CXX_STANDARD=${CONSUMER_CXX_STANDARD}")
endif()
if(CONSUMER_CXX_FLAGS)
    list(APPEND configure_args "-DCMAKE_CXX_FLAGS=${CONSUMER_CXX_FLAGS}")
endif()
if(CONSUMER_BUILD_TYPE)
    list(APPEND configure_args "-DCMAKE_BUILD_TYPE=${CONSUMER_BUILD_TYPE}")
endif()
list(APPEND configure_args "-DIDEM_CONSUMER_COMPONENTS=${CONSUMER_COMPONENTS}")

if(CONSUMER_MODE STREQUAL "find_package" OR CONSUMER_MODE STREQUAL "unknown_component"
   OR CONSUMER_MODE STREQUAL "pkgconfig" OR CONSUMER_MODE STREQUAL "not_built_component")
    set(install_args --install "${IDEM_BUILD_DIR}" --prefix "${prefix}")
    if(CONSUMER_BUILD_TYPE)
        list(APPEND install_args --config "${CONSUMER_BUILD_TYPE}")
    endif()
    run_step("install" "${CMAKE_COMMAND}" ${install_args})
    foreach(installed IN ITEMS include/idem/config.hpp include/idem/error.hpp)
        if(NOT EXISTS "${prefix}/${installed}")
            message(FATAL_ERROR "install did not produce ${prefix}/${installed}")
        endif()
    endforeach()
    # The CMake package and the pkg-config files cover exactly the components built.
    string(REPLACE "," ";" installed_components "${CONSUMER_INSTALLED_COMPONENTS}")
    set(expected_targets idem-targets.cmake)
    set(expected_pcs idem.pc)
    foreach(component IN LISTS installed_components)
        list(APPEND expected_targets idem-${component}-targets.cmake)
        list(APPEND expected_pcs idem-${component}.pc)
    endforeach()
    file(GLOB_RECURSE targets_files RELATIVE "${prefix}" "${prefix}/idem*-targets.cmake")
    file(GLOB_RECURSE pc_files RELATIVE "${prefix}" "${prefix}/idem*.pc")
    foreach(kind IN ITEMS targets pcs)
        if(kind STREQUAL "targets")
            set(found_paths ${targets_files})
        else()
            set(found_paths ${pc_files})
        endif()
        set(found "")
        foreach(path IN LISTS found_paths)
            get_filename_component(file "${path}" NAME)
            list(APPEND found "${file}")
        endforeach()
        list(SORT found)
        list(SORT expected_${kind})
        if(NOT found STREQUAL expected_${kind})
            message(FATAL_ERROR "the install holds ${found}; expected exactly ${expected_${kind}} "
                                "(components: ${installed_components})")
        endif()
    endforeach()
    list(APPEND configure_args "-DCMAKE_PREFIX_PATH=${prefix}")
elseif(CONSUMER_MODE STREQUAL "add_subdirectory")
    list(APPEND configure_args -DIDEM_CONSUMER_USE_SUBDIRECTORY=ON
                               "-DIDEM_SOURCE_DIR=${IDEM_SOURCE_DIR}")
    string(REPLACE "," ";" idem_options "${CONSUMER_IDEM_OPTIONS}")
    foreach(option IN LISTS idem_options)
        list(APPEND configure_args "-D${option}")
    endforeach()
else()
    message(FATAL_ERROR "unknown CONSUMER_MODE '${CONSUMER_MODE}'")
endif()

if(CONSUMER_MODE STREQUAL "pkgconfig")
    foreach(var IN ITEMS CONSUMER_GNU_MAKE CONSUMER_PKG_CONFIG CONSUMER_PKGCONFIG_DIR)
        if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
            message(FATAL_ERROR "IdemRunConsumerTest: -D${var}=... is required for pkgconfig")
        endif()
    endforeach()
    set(pc_dir "${prefix}/${CONSUMER_PKGCONFIG_DIR}")
    foreach(module IN ITEMS idem idem-sqlite idem-postgres idem-redis idem-mysql)
        if(NOT EXISTS "${pc_dir}/${module}.pc")
            message(FATAL_ERROR "install did not produce ${pc_dir}/${module}.pc")
        endif()
    endforeach()
    set(env "${CMAKE_COMMAND}" -E env "PKG_CONFIG_PATH=${pc_dir}")
    # The flags must point into this prefix (not at some other idem installed on the machine).
    run_step("pkg-config" ${env} "${CONSUMER_PKG_CONFIG}" --cflags idem-sqlite)
    string(FIND "${step_output}" "-I${prefix}/include" at)
    if(at EQUAL -1)
        message(FATAL_ERROR "pkg-config --cflags idem-sqlite does not name ${prefix}/include: "
                            "${step_output}")
    endif()
    run_step("pkg-config" ${env} "${CONSUMER_PKG_CONFIG}" --libs idem-postgres idem-redis)
    if(NOT step_output MATCHES "-lpq" OR NOT step_output MATCHES "-lhiredis"
       OR NOT step_output MATCHES "-lfmt")
        message(FATAL_ERROR "pkg-config --libs idem-postgres idem-redis lacks -lpq, -lhiredis "
                            "or -lfmt: ${step_output}")
    endif()
    run_step("pkg-config" ${env} "${CONSUMER_PKG_CONFIG}" --libs idem-mysql)
    if(NOT step_output MATCHES "-lmariadb")
        message(FATAL_ERROR "pkg-config --libs idem-mysql lacks -lmariadb: ${step_output}")
    endif()
    set(standard 17)
    if(CONSUMER_CXX_STANDARD)
        set(standard "${CONSUMER_CXX_STANDARD}")
    endif()
    file(MAKE_DIRECTORY "${build}")
    run_step("make" ${env} "${CONSUMER_GNU_MAKE}" -f "${CONSUMER_SOURCE_DIR}/Makefile"
             "SRC=${CONSUMER_SOURCE_DIR}" "OUT=${build}" "CXX=${CONSUMER_CXX_COMPILER}"
             "CXXFLAGS=-std=c++${standard} ${CONSUMER_CXX_FLAGS}"
             "PKG_CONFIG=${CONSUMER_PKG_CONFIG}")
    foreach(program IN ITEMS sqlite components)
        run_step("run" "${build}/idem_pkgconfig_${program}")
        message(STATUS "[consumer:${CONSUMER_MODE}] output: ${step_output}")
        if(NOT step_output MATCHES "idem-pkgconfig ${program} ok")
            message(FATAL_ERROR "idem_pkgconfig_${program} did not report success:\n${step_output}")
        endif()
    endforeach()
    return()
endif()

if(CONSUMER_MODE STREQUAL "not_built_component")
    foreach(var IN ITEMS CONSUMER_NOT_BUILT CONSUMER_NOT_BUILT_PACKAGE)
        if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
            message(FATAL_ERROR "IdemRunConsumerTest: -D${var}=... is required for "
                                "not_built_component")
        endif()
    endforeach()
    set(component "${CONSUMER_NOT_BUILT}")
    string(REPLACE "." "\\." package_re "${CONSUMER_NOT_BUILT_PACKAGE}")
    set(refusal "component '${component}' was not built in this installation of idem ")
    string(APPEND refusal "[^\n]*${package_re}")
    # Non-REQUIRED: idem_FOUND FALSE with the message, then the core of the same install.
    run_step("configure" "${CMAKE_COMMAND}" ${configure_args}
             "-DIDEM_CONSUMER_EXPECT_NOT_BUILT=${component}"
             -S "${CONSUMER_SOURCE_DIR}" -B "${build}")
    if(NOT step_output MATCHES "idem-consumer: component not built refused: [^\n]*${refusal}")
        message(FATAL_ERROR "expected idem to say that '${component}' was not built, naming "
                            "${CONSUMER_NOT_BUILT_PACKAGE}; output:\n${step_output}")
    endif()
    # REQUIRED: the configure fails with the same message.
    list(FILTER configure_args EXCLUDE REGEX "^-DIDEM_CONSUMER_COMPONENTS=")
    execute_process(COMMAND "${CMAKE_COMMAND}" ${configure_args}
                            "-DIDEM_CONSUMER_COMPONENTS=${component}"
                            -S "${CONSUMER_SOURCE_DIR}" -B "${build}-required"
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
    string(REGEX REPLACE "\n +" " " flat "${out}")
    if(rc EQUAL 0 OR NOT flat MATCHES "${refusal}")
        message(FATAL_ERROR "find_package(idem REQUIRED COMPONENTS ${component}) did not fail "
                            "saying that it was not built (${rc}):\n${out}")
    endif()
    message(STATUS "[consumer:${CONSUMER_MODE}] refused as expected: ${component} not built")
    return()
endif()

if(CONSUMER_MODE STREQUAL "unknown_component")
    # Non-REQUIRED find_package of an unknown component: must give idem_FOUND FALSE + a message.
    list(APPEND configure_args -DIDEM_CONSUMER_EXPECT_UNKNOWN_COMPONENT=ON)
    run_step("configure" "${CMAKE_COMMAND}" ${configure_args} -S "${CONSUMER_SOURCE_DIR}" -B "${build}")
    if(NOT step_output MATCHES "idem-consumer: unknown component refused: [^\n]*unknown component 'no_such_component'")
        message(FATAL_ERROR "expected idem to refuse the unknown component; output:\n${step_output}")
    endif()
    message(STATUS "[consumer:${CONSUMER_MODE}] refused as expected")
    return()
endif()

run_step("configure" "${CMAKE_COMMAND}" ${configure_args} -S "${CONSUMER_SOURCE_DIR}" -B "${build}")
run_step("build" "${CMAKE_COMMAND}" --build "${build}")
run_step("run" "${build}/idem_consumer")
message(STATUS "[consumer:${CONSUMER_MODE}] output: ${step_output}")
if(NOT step_output MATCHES "idem-consumer ok")
    message(FATAL_ERROR "the consumer did not report success:\n${step_output}")
endif()
# The example store (examples/journal_store) under the installed conformance suite (component
# testing); in find_package mode it saw only the prefix's headers. Without the test kit the
# consumer must build without it, and the prefix holds no idem/testing/.
string(REPLACE "," ";" consumer_components "${CONSUMER_COMPONENTS}")
if("testing" IN_LIST consumer_components)
    run_step("run" "${build}/journal_store_test" --gtest_brief=1)
    if(NOT step_output MATCHES "\\[  PASSED  \\] [0-9]+ tests" OR step_output MATCHES "SKIPPED|FAILED")
        message(FATAL_ERROR "journal_store_test did not pass every test:\n${step_output}")
    endif()
    string(REGEX MATCH "[0-9]+ tests from [0-9]+ test suites ran" journal_ran "${step_output}")
    message(STATUS "[consumer:${CONSUMER_MODE}] journal_store_test: ${journal_ran}, all passed")
elseif(CONSUMER_MODE STREQUAL "find_package" AND EXISTS "${prefix}/include/idem/testing")
    message(FATAL_ERROR "the test kit (include/idem/testing) was installed without its component")
endif()
