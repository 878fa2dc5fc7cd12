# cmake -P driver of ctest install.deb_package (tests/CMakeLists.txt): the Debian package as a
# user gets it, checked without installing it into this machine.
#   1. configure idem (IDEM_SOURCE_DIR) in a fresh build directory with every component of
#      PACKAGE_COMPONENTS ON, tests and examples OFF, and `cmake --build <dir> --target package`
#   2. the one .deb it wrote is libidem-dev_<PACKAGE_VERSION>_all.deb; `dpkg-deb -f`: Package,
#      Version, Architecture all, Depends libfmt-dev, the components' client libraries in
#      Recommends (libsqlite3-dev) or Suggests (the others), each once
#   3. `dpkg-deb -c`: every path under /usr; the umbrella header, idemConfig.cmake and its
#      version file, idem-<component>-targets.cmake and idem-<component>.pc per component
#   4. `dpkg-deb -x` into a temporary root; every .pc says prefix=/usr, and no installed file
#      names the build or CPack staging directory
#   5. tests/consumer built against <root>/usr (CMAKE_PREFIX_PATH) with
#      find_package(idem COMPONENTS sqlite), and run; idem_DIR must be inside <root>
#   6. tests/consumer_pkgconfig built with `pkg-config --define-variable=prefix=<root>/usr`
#      (PKG_CONFIG_PATH = <root>/usr/share/pkgconfig), and its SQLite program run
# Inputs (-D): IDEM_SOURCE_DIR PACKAGE_WORK_DIR PACKAGE_VERSION PACKAGE_COMPONENTS
#   (name=debian-package,... of every component) PACKAGE_GENERATOR PACKAGE_MAKE_PROGRAM
#   PACKAGE_CXX_COMPILER PACKAGE_CXX_STANDARD PACKAGE_CXX_FLAGS PACKAGE_DPKG_DEB
#   PACKAGE_GNU_MAKE PACKAGE_PKG_CONFIG
cmake_minimum_required(VERSION 3.18)

foreach(var IN ITEMS IDEM_SOURCE_DIR PACKAGE_WORK_DIR PACKAGE_VERSION PACKAGE_COMPONENTS
                     PACKAGE_GENERATOR PACKAGE_CXX_COMPILER PACKAGE_DPKG_DEB PACKAGE_GNU_MAKE
                     PACKAGE_PKG_CONFIG)
    if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
        message(FATAL_ERROR "IdemRunPackageTest: -D${var}=... is required")
    endif()
endforeach()

function(run_step what)
    message(STATUS "[package] ${what}: ${ARGN}")
    execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    if(NOT rc EQUAL 0)
        message(FATAL_ERROR "[package] ${what} failed (${rc}):\n${out}\n${err}")
    endif()
    string(STRIP "${out}" out)
    set(step_output "${out}" PARENT_SCOPE)
endfunction()

function(expect what value expected)
    if(NOT "${value}" STREQUAL "${expected}")
        message(FATAL_ERROR "[package] ${what} is '${value}'; expected '${expected}'")
    endif()
    message(STATUS "[package] ${what}: ${value}")
endfunction()

set(build "${PACKAGE_WORK_DIR}/idem-build")
set(root "${PACKAGE_WORK_DIR}/root")
file(REMOVE_RECURSE "${PACKAGE_WORK_DIR}")
file(MAKE_DIRECTORY "${PACKAGE_WORK_DIR}")

# 1. The package, from a build of its own with every component.
string(REPLACE "," ";" components "${PACKAGE_COMPONENTS}")
set(component_names "")
set(idem_args -G "${PACKAGE_GENERATOR}" "-DCMAKE_CXX_COMPILER=${PACKAGE_CXX_COMPILER}"
              -DIDEM_BUILD_TESTS=OFF -DIDEM_BUILD_EXAMPLES=OFF)
if(PACKAGE_MAKE_PROGRAM)
    list(APPEND idem_args "-DCMAKE_MAKE_PROGRAM=${PACKAGE_MAKE_PROGRAM}")
endif()
set(recommends "")
set(suggests "")
foreach(entry IN LISTS components)
    string(REGEX REPLACE "=.*" "" name "${entry}")
    string(REGEX REPLACE ".*=" "" package "${entry}")
    list(APPEND component_names "${name}")
    string(TOUPPER "${name}" upper)
    list(APPEND idem_args "-DIDEM_WITH_${upper}=ON")
    if(name STREQUAL "sqlite")
        list(APPEND recommends "${package}")
    else()
        list(APPEND suggests "${package}")
    endif()
endforeach()
run_step("configure idem" "${CMAKE_COMMAND}" ${idem_args} -S "${IDEM_SOURCE_DIR}" -B "${build}")
run_step("package" "${CMAKE_COMMAND}" --build "${build}" --target package)

# 2. Its name and control fields.
file(GLOB debs "${build}/packages/*.deb")
set(expected_deb "${build}/packages/libidem-dev_${PACKAGE_VERSION}_all.deb")
expect("the packages written" "${debs}" "${expected_deb}")
set(deb "${expected_deb}")
run_step("dpkg-deb -I" "${PACKAGE_DPKG_DEB}" -I "${deb}")
message(STATUS "[package] dpkg-deb -I:\n${step_output}")
foreach(field IN ITEMS Package Version Architecture Depends Recommends Suggests)
    run_step("dpkg-deb -f ${field}" "${PACKAGE_DPKG_DEB}" -f "${deb}" ${field})
    set(control_${field} "${step_output}")
endforeach()
expect("Package" "${control_Package}" "libidem-dev")
expect("Version" "${control_Version}" "${PACKAGE_VERSION}")
expect("Architecture" "${control_Architecture}" "all")
expect("Depends" "${control_Depends}" "libfmt-dev")
list(JOIN recommends ", " recommends)
list(JOIN suggests ", " suggests)
expect("Recommends" "${control_Recommends}" "${recommends}")
expect("Suggests" "${control_Suggests}" "${suggests}")

# 3. Its contents.
run_step("dpkg-deb -c" "${PACKAGE_DPKG_DEB}" -c "${deb}")
set(listing "${step_output}")
set(expected_paths ./usr/include/idem/idem.hpp ./usr/include/idem/config.hpp
    ./usr/share/cmake/idem/idemConfig.cmake ./usr/share/cmake/idem/idemConfigVersion.cmake
    ./usr/share/cmake/idem/idem-targets.cmake ./usr/share/pkgconfig/idem.pc)
foreach(name IN LISTS component_names)
    list(APPEND expected_paths ./usr/share/cmake/idem/idem-${name}-targets.cmake
                               ./usr/share/pkgconfig/idem-${name}.pc)
endforeach()
foreach(path IN LISTS expected_paths)
    string(FIND "${listing}" " ${path}\n" at)
    if(at EQUAL -1)
        string(FIND "${listing}" " ${path}" at_end)  # the listing's last line
        if(at_end EQUAL -1)
            message(FATAL_ERROR "[package] ${path} is not in the package:\n${listing}")
        endif()
    endif()
endforeach()
string(REGEX MATCHALL " \\./[^\n]*" paths "${listing}")
foreach(path IN LISTS paths)
    if(NOT path MATCHES "^ \\./(usr/.*)?$")
        message(FATAL_ERROR "[package] a path outside /usr:${path}")
    endif()
endforeach()
list(LENGTH expected_paths checked)
message(STATUS "[package] contents: ${checked} expected paths present, every path under /usr")

# 4. Extracted into a throwaway root (dpkg-deb -x: the files, no maintainer scripts to run).
run_step("dpkg-deb -x" "${PACKAGE_DPKG_DEB}" -x "${deb}" "${root}")
file(GLOB pcs "${root}/usr/share/pkgconfig/*.pc")
foreach(pc IN LISTS pcs)
    file(STRINGS "${pc}" prefix_line REGEX "^prefix=")
    expect("the prefix of ${pc}" "${prefix_line}" "prefix=/usr")
endforeach()
string(REGEX REPLACE "([][+.*()^$?|\\])" "\\\\\\1" work_dir_re "${PACKAGE_WORK_DIR}")
file(GLOB_RECURSE installed_files "${root}/*")
foreach(file IN LISTS installed_files)
    file(STRINGS "${file}" staged REGEX "_CPack_Packages|${work_dir_re}")
    if(staged)
        message(FATAL_ERROR "[package] ${file} names a build directory: ${staged}")
    endif()
endforeach()

# 5. find_package(idem COMPONENTS sqlite) against <root>/usr.
set(consumer_args -G "${PACKAGE_GENERATOR}" "-DCMAKE_CXX_COMPILER=${PACKAGE_CXX_COMPILER}"
                  "-DCMAKE_PREFIX_PATH=${root}/usr" -DIDEM_CONSUMER_COMPONENTS=sqlite)
if(PACKAGE_MAKE_PROGRAM)
    list(APPEND consumer_args "-DCMAKE_MAKE_PROGRAM=${PACKAGE_MAKE_PROGRAM}")
endif()
if(PACKAGE_CXX_STANDARD)
    list(APPEND consumer_args "-DCMAKE_CXX_STANDARD=${PACKAGE_CXX_STANDARD}")
endif()
if(PACKAGE_CXX_FLAGS)
    list(APPEND consumer_args "-DCMAKE_CXX_FLAGS=${PACKAGE_CXX_FLAGS}")
endif()
set(consumer "${PACKAGE_WORK_DIR}/consumer")
run_step("configure the consumer" "${CMAKE_COMMAND}" ${consumer_args}
         -S "${IDEM_SOURCE_DIR}/tests/consumer" -B "${consumer}")
string(REGEX MATCH "idem-consumer: found idem [^\n]*" found "${step_output}")
message(STATUS "[package] ${found}")
string(FIND "${found}" "found idem ${PACKAGE_VERSION} in ${root}/usr/share/cmake/idem " at)
if(at EQUAL -1)
    message(FATAL_ERROR "[package] find_package(idem) did not find the extracted package:\n"
                        "${step_output}")
endif()
run_step("build the consumer" "${CMAKE_COMMAND}" --build "${consumer}" --target idem_consumer)
run_step("run the consumer" "${consumer}/idem_consumer")
message(STATUS "[package] idem_consumer: ${step_output}")
if(NOT step_output MATCHES "idem-consumer ok")
    message(FATAL_ERROR "[package] idem_consumer did not report success")
endif()

# 6. pkg-config idem-sqlite; the .pc's prefix (/usr) moved to the root by --define-variable.
set(pc_env "${CMAKE_COMMAND}" -E env "PKG_CONFIG_PATH=${root}/usr/share/pkgconfig")
set(pkg_config "${PACKAGE_PKG_CONFIG}" "--define-variable=prefix=${root}/usr")
run_step("pkg-config --modversion" ${pc_env} ${pkg_config} --modversion idem idem-sqlite)
string(REPLACE "\n" " " versions "${step_output}")
expect("pkg-config --modversion idem idem-sqlite" "${versions}"
       "${PACKAGE_VERSION} ${PACKAGE_VERSION}")
run_step("pkg-config --cflags" ${pc_env} ${pkg_config} --cflags idem-sqlite)
string(FIND "${step_output}" "-I${root}/usr/include" at)
if(at EQUAL -1)
    message(FATAL_ERROR "[package] pkg-config --cflags idem-sqlite does not name "
                        "${root}/usr/include: ${step_output}")
endif()
set(standard 17)
if(PACKAGE_CXX_STANDARD)
    set(standard "${PACKAGE_CXX_STANDARD}")
endif()
set(pc_build "${PACKAGE_WORK_DIR}/consumer_pkgconfig")
file(MAKE_DIRECTORY "${pc_build}")
list(JOIN pkg_config " " pkg_config_command)
run_step("make" ${pc_env} "${PACKAGE_GNU_MAKE}"
         -f "${IDEM_SOURCE_DIR}/tests/consumer_pkgconfig/Makefile"
         "SRC=${IDEM_SOURCE_DIR}/tests/consumer_pkgconfig" "OUT=${pc_build}"
         "CXX=${PACKAGE_CXX_COMPILER}" "CXXFLAGS=-std=c++${standard} ${PACKAGE_CXX_FLAGS}"
         "PKG_CONFIG=${pkg_config_command}" "${pc_build}/idem_pkgconfig_sqlite")
run_step("run the pkg-config consumer" "${pc_build}/idem_pkgconfig_sqlite")
message(STATUS "[package] idem_pkgconfig_sqlite: ${step_output}")
if(NOT step_output MATCHES "idem-pkgconfig sqlite ok")
    message(FATAL_ERROR "[package] idem_pkgconfig_sqlite did not report success")
endif()
message(STATUS "[package] ${deb}: control fields, contents, find_package and pkg-config ok")
