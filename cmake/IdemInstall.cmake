# Install rules and the CMake package (find_package(idem CONFIG COMPONENTS ...)).
include_guard(GLOBAL)
include(CMakePackageConfigHelpers)

set(IDEM_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/cmake/idem"
    CACHE STRING "Where idem's CMake package files are installed (relative to the prefix)")

# The test kit (include/idem/testing/) comes with its component only (below).
install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/idem"
        DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
        FILES_MATCHING PATTERN "*.hpp"
        PATTERN "testing" EXCLUDE)

# The core: its own export set, always loaded by idemConfig.cmake.
install(TARGETS idem EXPORT idem-targets)
install(EXPORT idem-targets
        FILE idem-targets.cmake
        NAMESPACE idem::
        DESTINATION "${IDEM_INSTALL_CMAKEDIR}")

# One export set per component, loaded only when requested (idem_add_backend() registered the
# components whose headers exist).
get_property(IDEM_KNOWN_COMPONENTS GLOBAL PROPERTY IDEM_KNOWN_COMPONENTS)
get_property(IDEM_INSTALLED_COMPONENTS GLOBAL PROPERTY IDEM_INSTALLED_COMPONENTS)
# idemConfig.cmake names the Debian package of a component that was not built.
set(IDEM_CONFIG_DEBIAN_PACKAGES "")
foreach(component IN LISTS IDEM_KNOWN_COMPONENTS)
    get_property(package GLOBAL PROPERTY IDEM_COMPONENT_DEBIAN_PACKAGE_${component})
    string(APPEND IDEM_CONFIG_DEBIAN_PACKAGES
           "set(_idem_debian_package_${component} \"${package}\")\n")
endforeach()
set(idem_installed_helpers "")
foreach(component IN LISTS IDEM_INSTALLED_COMPONENTS)
    get_property(component_target GLOBAL PROPERTY IDEM_COMPONENT_TARGET_${component})
    get_property(component_deps GLOBAL PROPERTY IDEM_COMPONENT_DEPENDENCIES_${component})
    get_property(component_helpers GLOBAL PROPERTY IDEM_COMPONENT_HELPERS_${component})
    install(TARGETS ${component_target} EXPORT idem-${component}-targets)
    install(EXPORT idem-${component}-targets
            FILE idem-${component}-targets.cmake
            NAMESPACE idem::
            DESTINATION "${IDEM_INSTALL_CMAKEDIR}")
    install(FILES "${component_deps}" DESTINATION "${IDEM_INSTALL_CMAKEDIR}")
    list(APPEND idem_installed_helpers ${component_helpers})
endforeach()
if("testing" IN_LIST IDEM_INSTALLED_COMPONENTS)
    install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/idem/testing"
            DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/idem"
            FILES_MATCHING PATTERN "*.hpp")
endif()
# What the dependency files include (IdemFindPkgConfigLibrary.cmake for hiredis, libmariadb).
list(REMOVE_DUPLICATES idem_installed_helpers)
if(idem_installed_helpers)
    install(FILES ${idem_installed_helpers} DESTINATION "${IDEM_INSTALL_CMAKEDIR}")
endif()

configure_package_config_file(
    "${PROJECT_SOURCE_DIR}/cmake/idemConfig.cmake.in"
    "${PROJECT_BINARY_DIR}/idemConfig.cmake"
    INSTALL_DESTINATION "${IDEM_INSTALL_CMAKEDIR}")
write_basic_package_version_file(
    "${PROJECT_BINARY_DIR}/idemConfigVersion.cmake"
    VERSION ${PROJECT_VERSION}
    COMPATIBILITY SameMinorVersion
    ARCH_INDEPENDENT)
install(FILES "${PROJECT_BINARY_DIR}/idemConfig.cmake"
              "${PROJECT_BINARY_DIR}/idemConfigVersion.cmake"
        DESTINATION "${IDEM_INSTALL_CMAKEDIR}")
install(FILES "${PROJECT_SOURCE_DIR}/LICENSE" DESTINATION "${CMAKE_INSTALL_DATADIR}/doc/idem")

# ---------------------------------------------------------------------------------------------
# pkg-config: idem.pc (the headers + fmt) and idem-<component>.pc per installed component (idem +
# the component's client library). idem is header-only, so the files have no Libs of their own:
# the client libraries' come through Requires. They are written at install time from
# cmake/idem.pc.in, because the prefix is known only then (cmake --install --prefix ...), and
# hold absolute paths (pkg-config then filters system directories such as /usr/include).
set(IDEM_INSTALL_PKGCONFIGDIR "${CMAKE_INSTALL_DATADIR}/pkgconfig"
    CACHE STRING "Where idem's pkg-config files are installed (relative to the prefix)")
set(idem_pc_modules idem)
set(idem_pc_name_idem "idem")
set(idem_pc_description_idem
    "Exactly-once effect for C++17 message consumers under at-least-once delivery (header-only)")
set(idem_pc_requires_idem "fmt")
foreach(component IN LISTS IDEM_INSTALLED_COMPONENTS)
    get_property(idem_pc_requires_${component} GLOBAL
                 PROPERTY IDEM_COMPONENT_PC_REQUIRES_${component})
    get_property(idem_pc_description_${component} GLOBAL
                 PROPERTY IDEM_COMPONENT_DESCRIPTION_${component})
    list(APPEND idem_pc_modules idem-${component})
    set(idem_pc_name_idem-${component} "idem-${component}")
    set(idem_pc_description_idem-${component} "${idem_pc_description_${component}}")
    set(idem_pc_requires_idem-${component}
        "idem = ${PROJECT_VERSION}, ${idem_pc_requires_${component}}")
endforeach()

foreach(module IN LISTS idem_pc_modules)
    set(generated "${PROJECT_BINARY_DIR}/pkgconfig/${module}.pc")
    # Runs in the install script, where CMAKE_INSTALL_PREFIX is the install-time prefix.
    install(CODE "
        set(PROJECT_VERSION [[${PROJECT_VERSION}]])
        set(IDEM_PC_NAME [[${idem_pc_name_${module}}]])
        set(IDEM_PC_DESCRIPTION [[${idem_pc_description_${module}}]])
        set(IDEM_PC_REQUIRES [[${idem_pc_requires_${module}}]])
        set(IDEM_PC_PREFIX \"\${CMAKE_INSTALL_PREFIX}\")
        if(IS_ABSOLUTE [[${CMAKE_INSTALL_INCLUDEDIR}]])
            set(IDEM_PC_INCLUDEDIR [[${CMAKE_INSTALL_INCLUDEDIR}]])
        else()
            set(IDEM_PC_INCLUDEDIR [[\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}]])
        endif()
        configure_file([[${PROJECT_SOURCE_DIR}/cmake/idem.pc.in]] [[${generated}]] @ONLY)
    ")
    install(FILES "${generated}" DESTINATION "${IDEM_INSTALL_PKGCONFIGDIR}")
endforeach()
