# Dependencies of idem::mysql, included by idemConfig.cmake only when the mysql component is
# requested: libmariadb through its pkg-config file (Debian libmariadb-dev). On failure it sets
# idem_FOUND to FALSE and returns from this file, as find_dependency() would.
if(NOT TARGET PkgConfig::IDEM_LIBMARIADB)
    find_package(PkgConfig QUIET)
    if(PkgConfig_FOUND)
        pkg_check_modules(IDEM_LIBMARIADB QUIET IMPORTED_TARGET GLOBAL libmariadb)
    endif()
    if(NOT TARGET PkgConfig::IDEM_LIBMARIADB)
        set(idem_NOT_FOUND_MESSAGE "libmariadb not found through pkg-config (Debian: libmariadb-dev pkg-config)")
        set(idem_FOUND FALSE)
        return()
    endif()
endif()
