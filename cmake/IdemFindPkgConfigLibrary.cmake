# idem_find_pkgconfig_library(<target> MODULE <module> HEADER <header> RESULT <var>
#                             [REASON <var>]):
# defines the imported target <target> (e.g. idem::hiredis) from the pkg-config file of <module>,
# for client libraries that ship a pkg-config file but no CMake targets (Debian's hiredis and
# libmariadb, cpp-httplib). <header> is how idem includes the library's header (<hiredis/hiredis.h>,
# <mysql.h>): its directory becomes the target's include directory. Used by the build
# (idem_add_backend, IdemComponents.cmake) and by the generated
# idem-<component>-dependencies.cmake of an installed package. Sets the RESULT <var> to TRUE or
# FALSE in the caller, and the REASON <var> to why it was not found (empty when it was).
include_guard(GLOBAL)

function(idem_find_pkgconfig_library target)
    cmake_parse_arguments(PARSE_ARGV 1 arg "" "MODULE;HEADER;RESULT;REASON" "")
    set(${arg_RESULT} FALSE PARENT_SCOPE)
    if(arg_REASON)
        set(${arg_REASON} "" PARENT_SCOPE)
    endif()
    if(TARGET ${target})
        set(${arg_RESULT} TRUE PARENT_SCOPE)
        return()
    endif()
    string(MAKE_C_IDENTIFIER "IDEM_PC_${arg_MODULE}" prefix)
    string(TOUPPER "${prefix}" prefix)
    find_package(PkgConfig QUIET)
    if(PkgConfig_FOUND)
        pkg_check_modules(${prefix} QUIET ${arg_MODULE})
    endif()
    set(why "")
    if(NOT PkgConfig_FOUND)
        set(why "pkg-config (the program) not found, so neither is module '${arg_MODULE}'")
    elseif(NOT ${prefix}_FOUND)
        set(why "pkg-config module '${arg_MODULE}' not found")
    else()
        # The first library is the client library itself; the others (if any) come with it.
        set(other_libraries ${${prefix}_LIBRARIES})
        list(POP_FRONT other_libraries main_library)
        find_library(${prefix}_LIBRARY NAMES ${main_library} HINTS ${${prefix}_LIBRARY_DIRS})
        find_path(${prefix}_INCLUDE_DIR "${arg_HEADER}"
                  HINTS ${${prefix}_INCLUDE_DIRS} ${${prefix}_INCLUDEDIR}/..)
        if(NOT ${prefix}_LIBRARY)
            set(why "library '${main_library}' of pkg-config module '${arg_MODULE}' not found")
        elseif(NOT ${prefix}_INCLUDE_DIR)
            set(why "<${arg_HEADER}> of pkg-config module '${arg_MODULE}' not found")
        endif()
    endif()
    if(why)
        if(arg_REASON)
            set(${arg_REASON} "${why}" PARENT_SCOPE)
        endif()
        return()
    endif()
    add_library(${target} UNKNOWN IMPORTED GLOBAL)
    set_target_properties(${target} PROPERTIES
        IMPORTED_LOCATION "${${prefix}_LIBRARY}"
        INTERFACE_INCLUDE_DIRECTORIES "${${prefix}_INCLUDE_DIR}")
    if(other_libraries)
        set_property(TARGET ${target} PROPERTY INTERFACE_LINK_LIBRARIES ${other_libraries})
    endif()
    # The module's other compile flags: the -D of a library whose header depends on how it was
    # built (Debian's cpp-httplib: -DCPPHTTPLIB_OPENSSL_SUPPORT ..., which change its classes).
    if(${prefix}_CFLAGS_OTHER)
        set_property(TARGET ${target} PROPERTY INTERFACE_COMPILE_OPTIONS ${${prefix}_CFLAGS_OTHER})
    endif()
    set(${arg_RESULT} TRUE PARENT_SCOPE)
endfunction()
