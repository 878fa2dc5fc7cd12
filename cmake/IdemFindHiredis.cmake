# idem_find_hiredis([REQUIRED]): defines the imported target idem::hiredis from hiredis'
# pkg-config file (Debian's libhiredis-dev ships no CMake targets). Used by the build and by
# idem-redis-dependencies.cmake in an installed package. Sets idem_hiredis_FOUND.
include_guard(GLOBAL)

function(idem_find_hiredis)
    cmake_parse_arguments(arg "REQUIRED" "" "" ${ARGN})
    if(TARGET idem::hiredis)
        set(idem_hiredis_FOUND TRUE PARENT_SCOPE)
        return()
    endif()
    find_package(PkgConfig QUIET)
    if(PkgConfig_FOUND)
        pkg_check_modules(IDEM_HIREDIS QUIET hiredis)
    endif()
    if(NOT IDEM_HIREDIS_FOUND)
        set(idem_hiredis_FOUND FALSE PARENT_SCOPE)
        if(arg_REQUIRED)
            message(FATAL_ERROR "idem: hiredis not found through pkg-config (Debian: apt-get "
                                "install libhiredis-dev pkg-config), or configure with "
                                "IDEM_WITH_REDIS=OFF")
        endif()
        return()
    endif()
    find_library(IDEM_HIREDIS_LIBRARY NAMES hiredis HINTS ${IDEM_HIREDIS_LIBRARY_DIRS})
    find_path(IDEM_HIREDIS_INCLUDE_DIR hiredis/hiredis.h
              HINTS ${IDEM_HIREDIS_INCLUDEDIR}/.. ${IDEM_HIREDIS_INCLUDE_DIRS})
    if(NOT IDEM_HIREDIS_LIBRARY OR NOT IDEM_HIREDIS_INCLUDE_DIR)
        set(idem_hiredis_FOUND FALSE PARENT_SCOPE)
        if(arg_REQUIRED)
            message(FATAL_ERROR "idem: hiredis' library or <hiredis/hiredis.h> not found")
        endif()
        return()
    endif()
    add_library(idem::hiredis UNKNOWN IMPORTED GLOBAL)
    set_target_properties(idem::hiredis PROPERTIES
        IMPORTED_LOCATION "${IDEM_HIREDIS_LIBRARY}"
        INTERFACE_INCLUDE_DIRECTORIES "${IDEM_HIREDIS_INCLUDE_DIR}")
    set(idem_hiredis_FOUND TRUE PARENT_SCOPE)
endfunction()
