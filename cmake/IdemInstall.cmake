# Install rules and the CMake package (find_package(idem CONFIG COMPONENTS ...)).
include_guard(GLOBAL)
include(CMakePackageConfigHelpers)

set(IDEM_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/cmake/idem"
    CACHE STRING "Where idem's CMake package files are installed (relative to the prefix)")

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/idem"
        DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
        FILES_MATCHING PATTERN "*.hpp")

# The core: its own export set, always loaded by idemConfig.cmake.
install(TARGETS idem EXPORT idem-targets)
install(EXPORT idem-targets
        FILE idem-targets.cmake
        NAMESPACE idem::
        DESTINATION "${IDEM_INSTALL_CMAKEDIR}")

# One export set per component, loaded only when requested.
get_property(IDEM_INSTALLED_COMPONENTS GLOBAL PROPERTY IDEM_COMPONENTS)
foreach(component IN LISTS IDEM_INSTALLED_COMPONENTS)
    get_property(component_target GLOBAL PROPERTY IDEM_COMPONENT_TARGET_${component})
    install(TARGETS ${component_target} EXPORT idem-${component}-targets)
    install(EXPORT idem-${component}-targets
            FILE idem-${component}-targets.cmake
            NAMESPACE idem::
            DESTINATION "${IDEM_INSTALL_CMAKEDIR}")
    install(FILES "${PROJECT_SOURCE_DIR}/cmake/idem-${component}-dependencies.cmake"
            DESTINATION "${IDEM_INSTALL_CMAKEDIR}")
endforeach()
# idem-redis-dependencies.cmake builds idem::hiredis with this helper.
if("redis" IN_LIST IDEM_INSTALLED_COMPONENTS)
    install(FILES "${PROJECT_SOURCE_DIR}/cmake/IdemFindHiredis.cmake"
            DESTINATION "${IDEM_INSTALL_CMAKEDIR}")
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
