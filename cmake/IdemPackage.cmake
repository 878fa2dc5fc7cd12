# CPack: `cmake --build <dir> --target package` writes libidem-dev_<version>_all.deb, one Debian
# package of everything `cmake --install` puts under /usr: the headers, the CMake package
# (share/cmake/idem) and the pkg-config files (share/pkgconfig). Included by CMakeLists.txt only
# when idem is the top-level project and IDEM_INSTALL is ON.
#
# One package, not one per component: idem is header-only, every header is installed whatever
# was built, and a component is only a CMake target and a .pc file over its client library. The
# components' client libraries are what differ, so they are the package's Recommends (SQLite, the
# embedded store of the quickstart) and Suggests (the others); the core's fmt is in Depends.
# The CMake package and .pc files cover the components built here (IDEM_WITH_<NAME>): build the
# package with every component ON (README.md's Install section) so that none is left out.
include_guard(GLOBAL)

set(IDEM_PACKAGE_CONTACT "the idem authors <maintainers@users.noreply.a-seed-4d0441c3.example>"
    CACHE STRING "The Maintainer field of the Debian package (cmake --build <dir> --target package)")

get_property(idem_package_components GLOBAL PROPERTY IDEM_INSTALLED_COMPONENTS)
set(idem_package_recommends "")
set(idem_package_suggests "")
foreach(component IN LISTS idem_package_components)
    get_property(package GLOBAL PROPERTY IDEM_COMPONENT_DEBIAN_PACKAGE_${component})
    if(component STREQUAL "sqlite")
        list(APPEND idem_package_recommends "${package}")
    else()
        list(APPEND idem_package_suggests "${package}")
    endif()
endforeach()
list(JOIN idem_package_recommends ", " idem_package_recommends)
list(JOIN idem_package_suggests ", " idem_package_suggests)
list(JOIN idem_package_components ", " idem_package_component_list)
if(NOT idem_package_component_list)
    set(idem_package_component_list "none")
endif()

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME libidem-dev)
set(CPACK_PACKAGE_VERSION "${PROJECT_VERSION}")
set(CPACK_PACKAGE_VENDOR "the idem authors")
set(CPACK_PACKAGE_CONTACT "${IDEM_PACKAGE_CONTACT}")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "exactly-once effect for C++17 message consumers (header-only)")
set(CPACK_RESOURCE_FILE_LICENSE "${PROJECT_SOURCE_DIR}/LICENSE")
set(CPACK_PACKAGE_DIRECTORY "${PROJECT_BINARY_DIR}/packages")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
# The .pc files are written by the install with CMAKE_INSTALL_PREFIX as their prefix: CPack must
# install with the prefix /usr into a DESTDIR, not with its staging directory as the prefix.
set(CPACK_SET_DESTDIR ON)
set(CPACK_INSTALL_PREFIX /usr)

set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # libidem-dev_<version>_all.deb
set(CPACK_DEBIAN_PACKAGE_ARCHITECTURE all)
set(CPACK_DEBIAN_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "libfmt-dev")
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "${idem_package_recommends}")
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "${idem_package_suggests}")
# The first line of the Description field is CPACK_PACKAGE_DESCRIPTION_SUMMARY; this is the rest.
string(CONCAT CPACK_DEBIAN_PACKAGE_DESCRIPTION
    "idem wraps the handler functions of a message consumer so that whatever the\n"
    "broker redelivers, each message has its effect once: a claim on the message id\n"
    "committed in the same transaction as the effect, gateway idempotency keys, a\n"
    "poison-message limit, a state guard and an ack only after the commit.\n"
    "This package holds the headers, the CMake package (find_package(idem\n"
    "COMPONENTS ...)) and the pkg-config files (idem, idem-<component>).\n"
    "Components built into it: ${idem_package_component_list}.\n"
    "Each component needs its client library's -dev package (Recommends, Suggests).")

include(CPack)
