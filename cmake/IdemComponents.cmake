# idem's optional components (backends): one idem_add_backend() call declares one.
#
#   idem_add_backend(<name>
#       DESCRIPTION <text>          what it provides (the option's help, idem-<name>.pc)
#       HEADERS <header>...         its public headers, relative to include/ (idem/store/x.hpp)
#       DEBIAN_PACKAGE <package>    the Debian package of its client library (libsqlite3-dev)
#       FIND_PACKAGE <Package> LINK <target>...   its client library: a CMake package, or
#       PKG_CONFIG <module> LIBRARY_HEADER <hdr>  a pkg-config module (target idem::<module>)
#       [PC_REQUIRES <module>...])  the pkg-config Requires of idem-<name>.pc (default: <module>)
#
# It declares the cache variable IDEM_WITH_<NAME>, one of
#   AUTO  (the default) the component is built when its client library is found, and left out
#         (a "not found" row in the summary) when it is not;
#   ON    the component is required: configure fails, naming <package>, when it is not found;
#   OFF   the component is left out; its client library is not looked for.
# (TRUE/YES/1 mean ON, FALSE/NO/0 mean OFF.) A parent project's set(IDEM_WITH_<NAME> ...) before
# add_subdirectory(idem) counts as well. When the component is built, idem_add_backend():
#   * adds the INTERFACE target idem_<name> (EXPORT_NAME <name>) and its alias idem::<name>,
#     linking idem::idem and the client library (find_package(<Package>), or the pkg-config
#     module through idem_find_pkgconfig_library());
#   * generates idem-<name>-dependencies.cmake (find_dependency(<Package>), or the pkg-config
#     lookup), which idemConfig.cmake includes only when the component is requested;
#   * registers the component for IdemInstall.cmake: its own export set
#     (idem-<name>-targets.cmake), the dependency file, idem-<name>.pc, and
#     find_package(idem COMPONENTS <name>).
# Every backend is a known component, whether it is built or not (idemConfig.cmake tells
# "unknown component" from "component not built in this install").
#
# idem_report_components(), called once after the last idem_add_backend(), prints the summary
# table (component, IDEM_WITH_<NAME>, found / not found / off, Debian package) and then fails if
# a component set to ON was not found, naming the package of each.
#
# A component whose HEADERS are not all in include/ yet (a backend being written) still gets its
# target in this build, but is not installed: no export, no .pc, and find_package(idem
# COMPONENTS <name>) says it is not part of the installation.
#
# Global properties read by IdemInstall.cmake and tests/: IDEM_KNOWN_COMPONENTS,
# IDEM_COMPONENTS (built here), IDEM_INSTALLED_COMPONENTS (built and installed); for every known
# component IDEM_COMPONENT_DEBIAN_PACKAGE_<name>, IDEM_COMPONENT_FIND_PACKAGE_<name> (its CMake
# package, empty for a pkg-config one), IDEM_COMPONENT_MODE_<name> (AUTO, ON or OFF),
# IDEM_COMPONENT_STATUS_<name> (found, not found or off) and IDEM_COMPONENT_WHY_<name> (why not
# found); for a built one IDEM_COMPONENT_TARGET_<name>, IDEM_COMPONENT_PC_REQUIRES_<name>,
# IDEM_COMPONENT_DESCRIPTION_<name>, IDEM_COMPONENT_DEPENDENCIES_<name> (the generated file) and
# IDEM_COMPONENT_HELPERS_<name> (cmake files the dependency file includes).

include_guard(GLOBAL)
include("${CMAKE_CURRENT_LIST_DIR}/IdemFindPkgConfigLibrary.cmake")

function(idem_add_backend name)
    cmake_parse_arguments(PARSE_ARGV 1 arg ""
                          "DESCRIPTION;DEBIAN_PACKAGE;FIND_PACKAGE;PKG_CONFIG;LIBRARY_HEADER"
                          "HEADERS;LINK;PC_REQUIRES")
    set(where "idem_add_backend(${name})")
    if(arg_UNPARSED_ARGUMENTS)
        message(FATAL_ERROR "${where}: unknown arguments ${arg_UNPARSED_ARGUMENTS}")
    endif()
    if(NOT arg_DESCRIPTION OR NOT arg_HEADERS OR NOT arg_DEBIAN_PACKAGE)
        message(FATAL_ERROR "${where}: DESCRIPTION, HEADERS and DEBIAN_PACKAGE are required")
    endif()
    if((arg_FIND_PACKAGE AND arg_PKG_CONFIG) OR (NOT arg_FIND_PACKAGE AND NOT arg_PKG_CONFIG))
        message(FATAL_ERROR "${where}: give exactly one of FIND_PACKAGE and PKG_CONFIG")
    endif()
    if(arg_FIND_PACKAGE AND (NOT arg_LINK OR NOT arg_PC_REQUIRES))
        message(FATAL_ERROR "${where}: FIND_PACKAGE needs LINK <its imported target> and "
                            "PC_REQUIRES <pkg-config module>")
    endif()
    if(arg_PKG_CONFIG AND NOT arg_LIBRARY_HEADER)
        message(FATAL_ERROR "${where}: PKG_CONFIG needs LIBRARY_HEADER <how idem includes it>")
    endif()
    get_property(known GLOBAL PROPERTY IDEM_KNOWN_COMPONENTS)
    if(name IN_LIST known)
        message(FATAL_ERROR "${where}: declared twice")
    endif()
    set_property(GLOBAL APPEND PROPERTY IDEM_KNOWN_COMPONENTS ${name})
    set_property(GLOBAL PROPERTY IDEM_COMPONENT_DEBIAN_PACKAGE_${name} "${arg_DEBIAN_PACKAGE}")
    set_property(GLOBAL PROPERTY IDEM_COMPONENT_FIND_PACKAGE_${name} "${arg_FIND_PACKAGE}")

    # IDEM_WITH_<NAME>: AUTO, ON or OFF. The value is read before set(CACHE) so that a normal
    # variable (a parent project's set()) wins over the cache, as it does for option().
    string(TOUPPER "${name}" upper)
    set(option IDEM_WITH_${upper})
    if(arg_FIND_PACKAGE)
        set(needs "CMake package ${arg_FIND_PACKAGE}")
    else()
        set(needs "pkg-config module ${arg_PKG_CONFIG}")
    endif()
    set(mode AUTO)
    if(DEFINED ${option})
        string(TOUPPER "${${option}}" mode)
    endif()
    string(CONCAT help "idem::${name}, ${arg_DESCRIPTION}: AUTO (built when ${needs} is found; "
                  "Debian: ${arg_DEBIAN_PACKAGE}), ON (required) or OFF")
    set(${option} "${mode}" CACHE STRING "${help}")
    set_property(CACHE ${option} PROPERTY STRINGS AUTO ON OFF)
    if(mode MATCHES "^(ON|TRUE|YES|Y|1)$")
        set(mode ON)
    elseif(mode MATCHES "^(OFF|FALSE|NO|N|0)$")
        set(mode OFF)
    elseif(NOT mode STREQUAL "AUTO")
        message(FATAL_ERROR "idem: ${option} is '${${option}}'; it must be AUTO, ON or OFF")
    endif()
    set_property(GLOBAL PROPERTY IDEM_COMPONENT_MODE_${name} ${mode})
    if(mode STREQUAL "OFF")
        set_property(GLOBAL PROPERTY IDEM_COMPONENT_STATUS_${name} "off")
        return()
    endif()

    # The client library.
    set(why "")
    if(arg_FIND_PACKAGE)
        find_package(${arg_FIND_PACKAGE} QUIET)
        if(NOT ${arg_FIND_PACKAGE}_FOUND)
            set(why "CMake package ${arg_FIND_PACKAGE} not found")
        else()
            foreach(target IN LISTS arg_LINK)
                if(NOT TARGET ${target})
                    set(why "CMake package ${arg_FIND_PACKAGE} found without its target ${target}")
                endif()
            endforeach()
        endif()
        set(link ${arg_LINK})
    else()
        string(MAKE_C_IDENTIFIER "${arg_PKG_CONFIG}" library)
        set(link idem::${library})
        idem_find_pkgconfig_library(${link} MODULE ${arg_PKG_CONFIG} HEADER ${arg_LIBRARY_HEADER}
                                    RESULT found REASON why)
    endif()
    if(why)
        set_property(GLOBAL PROPERTY IDEM_COMPONENT_STATUS_${name} "not found")
        set_property(GLOBAL PROPERTY IDEM_COMPONENT_WHY_${name} "${why}")
        return()
    endif()
    set_property(GLOBAL PROPERTY IDEM_COMPONENT_STATUS_${name} "found")

    # Its dependency file, for an installed idem.
    set(deps_file "${PROJECT_BINARY_DIR}/cmake/idem-${name}-dependencies.cmake")
    set(helpers "")
    string(CONCAT deps_text "# Generated by idem_add_backend(${name}) (cmake/IdemComponents.cmake). Included by\n"
                  "# idemConfig.cmake only when the ${name} component is requested; on failure it sets\n"
                  "# idem_FOUND to FALSE (with idem_NOT_FOUND_MESSAGE) and returns from this file.\n")
    if(arg_FIND_PACKAGE)
        string(APPEND deps_text "find_dependency(${arg_FIND_PACKAGE})\n")
        set(pc_requires "${arg_PC_REQUIRES}")
    else()
        set(helpers "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/IdemFindPkgConfigLibrary.cmake")
        string(APPEND deps_text
            "include(\"\${CMAKE_CURRENT_LIST_DIR}/IdemFindPkgConfigLibrary.cmake\")\n"
            "idem_find_pkgconfig_library(${link} MODULE ${arg_PKG_CONFIG} HEADER ${arg_LIBRARY_HEADER}\n"
            "                            RESULT _idem_${library}_found)\n"
            "if(NOT _idem_${library}_found)\n"
            "    set(idem_FOUND FALSE)\n"
            "    set(idem_NOT_FOUND_MESSAGE \"idem::${name} needs pkg-config module '${arg_PKG_CONFIG}' "
            "and <${arg_LIBRARY_HEADER}> (Debian: ${arg_DEBIAN_PACKAGE})\")\n"
            "    return()\n"
            "endif()\n")
        set(pc_requires "${arg_PC_REQUIRES}")
        if(NOT pc_requires)
            set(pc_requires "${arg_PKG_CONFIG}")
        endif()
    endif()
    file(CONFIGURE OUTPUT "${deps_file}" CONTENT "${deps_text}" @ONLY)

    # The target.
    add_library(idem_${name} INTERFACE)
    add_library(idem::${name} ALIAS idem_${name})
    set_target_properties(idem_${name} PROPERTIES EXPORT_NAME ${name})
    target_link_libraries(idem_${name} INTERFACE idem::idem ${link})
    set_property(GLOBAL APPEND PROPERTY IDEM_COMPONENTS ${name})
    set_property(GLOBAL PROPERTY IDEM_COMPONENT_TARGET_${name} idem_${name})
    list(JOIN pc_requires ", " pc_requires)
    set_property(GLOBAL PROPERTY IDEM_COMPONENT_PC_REQUIRES_${name} "${pc_requires}")
    set_property(GLOBAL PROPERTY IDEM_COMPONENT_DESCRIPTION_${name} "${arg_DESCRIPTION}")
    set_property(GLOBAL PROPERTY IDEM_COMPONENT_DEPENDENCIES_${name} "${deps_file}")
    set_property(GLOBAL PROPERTY IDEM_COMPONENT_HELPERS_${name} "${helpers}")

    # Installed only once its headers are there.
    set(missing "")
    foreach(header IN LISTS arg_HEADERS)
        if(NOT EXISTS "${PROJECT_SOURCE_DIR}/include/${header}")
            list(APPEND missing "include/${header}")
        endif()
    endforeach()
    if(missing)
        message(STATUS "idem: idem::${name} is built but not installed (no ${missing} yet)")
    else()
        set_property(GLOBAL APPEND PROPERTY IDEM_INSTALLED_COMPONENTS ${name})
    endif()
endfunction()

# _idem_pad(<out> <text> <width>): <text> padded with spaces to <width> characters.
function(_idem_pad out text width)
    string(LENGTH "${text}" length)
    while(length LESS width)
        string(APPEND text " ")
        math(EXPR length "${length} + 1")
    endwhile()
    set(${out} "${text}" PARENT_SCOPE)
endfunction()

# idem_report_components(): the summary table of every known component, then one fatal error
# that lists each component set to ON whose client library was not found, with its package.
function(idem_report_components)
    get_property(known GLOBAL PROPERTY IDEM_KNOWN_COMPONENTS)
    set(required_missing "")
    message(STATUS "idem components (IDEM_WITH_<NAME>: AUTO builds it when its library is found, "
                   "ON requires it, OFF leaves it out):")
    message(STATUS "  component  IDEM_WITH  status     Debian package")
    foreach(name IN LISTS known)
        get_property(mode GLOBAL PROPERTY IDEM_COMPONENT_MODE_${name})
        get_property(status GLOBAL PROPERTY IDEM_COMPONENT_STATUS_${name})
        get_property(package GLOBAL PROPERTY IDEM_COMPONENT_DEBIAN_PACKAGE_${name})
        get_property(why GLOBAL PROPERTY IDEM_COMPONENT_WHY_${name})
        _idem_pad(name_cell "${name}" 9)
        _idem_pad(mode_cell "${mode}" 9)
        _idem_pad(status_cell "${status}" 9)
        set(row "${name_cell}  ${mode_cell}  ${status_cell}  ${package}")
        if(status STREQUAL "not found")
            _idem_pad(row "${row}" 54)
            string(APPEND row "(${why})")
            if(mode STREQUAL "ON")
                string(TOUPPER "${name}" upper)
                string(APPEND required_missing "\n  ${name} (IDEM_WITH_${upper}=ON): ${why}. "
                       "Install ${package} (Debian), or configure with -DIDEM_WITH_${upper}=AUTO "
                       "(built only when found) or -DIDEM_WITH_${upper}=OFF.")
            endif()
        endif()
        message(STATUS "  ${row}")
    endforeach()
    if(required_missing)
        message(FATAL_ERROR "idem: components set to ON whose client library was not found:"
                            "${required_missing}")
    endif()
endfunction()
