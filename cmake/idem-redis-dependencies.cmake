# Dependencies of idem::redis, included by idemConfig.cmake only when the redis component is
# requested: the imported target idem::hiredis, from hiredis' pkg-config file.
include("${CMAKE_CURRENT_LIST_DIR}/IdemFindHiredis.cmake")
idem_find_hiredis()
if(NOT idem_hiredis_FOUND)
    set(idem_FOUND FALSE)
    set(idem_NOT_FOUND_MESSAGE "idem::redis needs hiredis (pkg-config module 'hiredis')")
    return()
endif()
