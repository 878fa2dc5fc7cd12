# cmake -P driver for the configure tests registered in tests/CMakeLists.txt (ctest -L configure).
# Each configures idem in a fresh build directory (a configure only, nothing is built) on what
# looks like a machine where no component's client library is installed: the CMake packages of
# the FIND_PACKAGE components are disabled (CMAKE_DISABLE_FIND_PACKAGE_<Package>=ON) and
# pkg-config searches an empty directory (PKG_CONFIG_LIBDIR, no PKG_CONFIG_PATH, nor the
# CMAKE_PREFIX_PATH).
#
# CONFIGURE_MODE:
#   bare_machine        the configure line of README.md's Install section succeeds and its
#                       summary has a "not found" row, with the Debian package, per component
#   bare_machine_tests  the same with idem's tests and examples ON (every place that uses a
#                       component must do without it)
#   required_missing    with -DIDEM_WITH_<CONFIGURE_REQUIRED>=ON the configure fails, naming that
#                       component's Debian package
#   readme              no configure: README.md's Install section has a table row per component
#                       with its Debian package, CMake target and .pc file, and names its option
# Inputs (-D): IDEM_SOURCE_DIR CONFIGURE_MODE CONFIGURE_WORK_DIR CONFIGURE_GENERATOR
#   CONFIGURE_CXX_COMPILER [CONFIGURE_MAKE_PROGRAM] CONFIGURE_COMPONENTS (<name>=<Debian
#   package>,... for every known component) CONFIGURE_HIDDEN_PACKAGES (the CMake packages to
#   disable, comma-separated) [CONFIGURE_REQUIRED (a component name, for required_missing)]
cmake_minimum_required(VERSION 3.18)

foreach(var IN ITEMS IDEM_SOURCE_DIR CONFIGURE_MODE CONFIGURE_COMPONENTS)
    if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
        message(FATAL_ERROR "IdemRunConfigureTest: -D${var}=... is required")
    endif()
endforeach()

string(REPLACE "," ";" components "${CONFIGURE_COMPONENTS}")
set(names "")
foreach(pair IN LISTS components)
    if(NOT pair MATCHES "^([a-z0-9_]+)=(.+)$")
        message(FATAL_ERROR "IdemRunConfigureTest: bad CONFIGURE_COMPONENTS entry '${pair}'")
    endif()
    list(APPEND names "${CMAKE_MATCH_1}")
    set(package_${CMAKE_MATCH_1} "${CMAKE_MATCH_2}")
endforeach()

# README.md's Install section (from its heading to the next one).
file(READ "${IDEM_SOURCE_DIR}/README.md" readme)
string(FIND "${readme}" "\n## Install\n" at)
if(at EQUAL -1)
    message(FATAL_ERROR "README.md has no '## Install' section")
endif()
string(SUBSTRING "${readme}" ${at} -1 install)
string(SUBSTRING "${install}" 1 -1 install)
string(FIND "${install}" "\n## " next)
if(NOT next EQUAL -1)
    string(SUBSTRING "${install}" 0 ${next} install)
endif()

# regex_escape(<out> <text>): <text> as a regular expression that matches it literally.
function(regex_escape out text)
    string(REGEX REPLACE "([][.*+?^$()|\\])" "\\\\\\1" text "${text}")
    set(${out} "${text}" PARENT_SCOPE)
endfunction()

if(CONFIGURE_MODE STREQUAL "readme")
    # A table row `| <component> | <provides> | <package> | <target> | <.pc> |` per component.
    set(problems "")
    set(rows "(core)|libfmt-dev|idem|idem")
    foreach(name IN LISTS names)
        list(APPEND rows "`${name}`|${package_${name}}|${name}|idem-${name}")
    endforeach()
    foreach(row IN LISTS rows)
        string(REPLACE "|" ";" cells "${row}")
        list(GET cells 0 first)
        list(GET cells 1 package)
        list(GET cells 2 target)
        list(GET cells 3 pc)
        regex_escape(start "| ${first} |")
        regex_escape(end "| `${package}` | `idem::${target}` | `${pc}.pc` |")
        if(NOT install MATCHES "\n${start}[^\n]*${end}\n")
            string(APPEND problems "\n  no row '| ${first} | ... | `${package}` | "
                   "`idem::${target}` | `${pc}.pc` |'")
        endif()
    endforeach()
    foreach(name IN LISTS names)
        string(TOUPPER "${name}" upper)
        string(FIND "${install}" "`IDEM_WITH_${upper}`" named)
        if(named EQUAL -1)
            string(APPEND problems "\n  `IDEM_WITH_${upper}` is not named")
        endif()
    endforeach()
    if(problems)
        message(FATAL_ERROR "README.md's Install section does not match the components "
                            "CMakeLists.txt declares:${problems}")
    endif()
    message(STATUS "[configure:readme] README.md lists every component: ${names}")
    return()
endif()

foreach(var IN ITEMS CONFIGURE_WORK_DIR CONFIGURE_GENERATOR CONFIGURE_CXX_COMPILER)
    if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
        message(FATAL_ERROR "IdemRunConfigureTest: -D${var}=... is required")
    endif()
endforeach()

# The configure line of the Install section, as written: `cmake -S . -B build <arguments>`.
if(NOT install MATCHES "\ncmake -S \\. -B build( [^\n]*)?\n")
    message(FATAL_ERROR "README.md's Install section has no line 'cmake -S . -B build ...'")
endif()
separate_arguments(readme_args UNIX_COMMAND "${CMAKE_MATCH_1}")

set(build "${CONFIGURE_WORK_DIR}/build")
set(no_pkgconfig "${CONFIGURE_WORK_DIR}/no-pkgconfig")
file(REMOVE_RECURSE "${CONFIGURE_WORK_DIR}")
file(MAKE_DIRECTORY "${no_pkgconfig}")

set(args -S "${IDEM_SOURCE_DIR}" -B "${build}" -G "${CONFIGURE_GENERATOR}"
         "-DCMAKE_CXX_COMPILER=${CONFIGURE_CXX_COMPILER}" -DPKG_CONFIG_USE_CMAKE_PREFIX_PATH=OFF)
if(CONFIGURE_MAKE_PROGRAM)
    list(APPEND args "-DCMAKE_MAKE_PROGRAM=${CONFIGURE_MAKE_PROGRAM}")
endif()
string(REPLACE "," ";" hidden "${CONFIGURE_HIDDEN_PACKAGES}")
foreach(package IN LISTS hidden)
    list(APPEND args "-DCMAKE_DISABLE_FIND_PACKAGE_${package}=ON")
endforeach()
list(APPEND args ${readme_args})

set(expect_success TRUE)
if(CONFIGURE_MODE STREQUAL "bare_machine")
elseif(CONFIGURE_MODE STREQUAL "bare_machine_tests")
    list(APPEND args -DIDEM_BUILD_TESTS=ON -DIDEM_BUILD_EXAMPLES=ON)
elseif(CONFIGURE_MODE STREQUAL "required_missing")
    if(NOT CONFIGURE_REQUIRED OR NOT CONFIGURE_REQUIRED IN_LIST names)
        message(FATAL_ERROR "IdemRunConfigureTest: -DCONFIGURE_REQUIRED=<a known component>")
    endif()
    string(TOUPPER "${CONFIGURE_REQUIRED}" required_upper)
    list(APPEND args "-DIDEM_WITH_${required_upper}=ON")
    set(expect_success FALSE)
else()
    message(FATAL_ERROR "unknown CONFIGURE_MODE '${CONFIGURE_MODE}'")
endif()

message(STATUS "[configure:${CONFIGURE_MODE}] cmake ${args}")
execute_process(
    COMMAND "${CMAKE_COMMAND}" -E env --unset=PKG_CONFIG_PATH "PKG_CONFIG_LIBDIR=${no_pkgconfig}"
            "${CMAKE_COMMAND}" ${args}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message(STATUS "[configure:${CONFIGURE_MODE}] exit status ${rc}; output:\n${out}")

if(expect_success AND NOT rc EQUAL 0)
    message(FATAL_ERROR "the configure failed without the client libraries")
elseif(NOT expect_success AND rc EQUAL 0)
    message(FATAL_ERROR "the configure succeeded with IDEM_WITH_${required_upper}=ON and no "
                        "${package_${CONFIGURE_REQUIRED}}")
endif()

# The summary: one "not found" row per component, naming its Debian package (also when the
# configure then fails: the table comes first).
if(NOT out MATCHES "-- idem components \\(IDEM_WITH_<NAME>:")
    message(FATAL_ERROR "no summary table ('-- idem components (IDEM_WITH_<NAME>: ...')")
endif()
foreach(name IN LISTS names)
    set(mode AUTO)
    if(NOT expect_success AND name STREQUAL CONFIGURE_REQUIRED)
        set(mode ON)
    endif()
    regex_escape(package_re "${package_${name}}")
    if(NOT out MATCHES "\n--   ${name} +${mode} +not found +${package_re} +\\([^\n]+\\)\n")
        message(FATAL_ERROR "no summary row '${name}  ${mode}  not found  ${package_${name}}  (...)'")
    endif()
endforeach()

if(NOT expect_success)
    set(package "${package_${CONFIGURE_REQUIRED}}")
    regex_escape(package_re "${package}")
    set(error_re "CMake Error[^\n]*\n[^\n]*components set to ON whose client library was not found")
    set(row_re "\n +${CONFIGURE_REQUIRED} \\(IDEM_WITH_${required_upper}=ON\\): [^\n]*")
    if(NOT out MATCHES "${error_re}" OR NOT out MATCHES "${row_re}Install ${package_re} ")
        message(FATAL_ERROR "the configure failed, but not with the error that names ${package}")
    endif()
    message(STATUS "[configure:${CONFIGURE_MODE}] failed as expected, naming ${package}")
else()
    message(STATUS "[configure:${CONFIGURE_MODE}] configured, every component not found")
endif()
