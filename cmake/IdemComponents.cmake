# Bookkeeping for idem's optional components (backends). See the top-level CMakeLists.txt.
#
# Every component <name>:
#   * is an INTERFACE target idem_<name> with EXPORT_NAME <name> and an alias idem::<name>;
#   * is registered here with idem_add_component(<name> TARGET idem_<name>);
#   * has cmake/idem-<name>-dependencies.cmake, included by idemConfig.cmake only when the
#     component is requested, which finds what the target links (find_dependency(...)).
#   * names the pkg-config module(s) of what it links in IdemInstall.cmake
#     (idem_pc_requires_<name>), for its idem-<name>.pc.
# IdemInstall.cmake then installs it in its own export set, idem-<name>-targets.cmake, and
# writes idem-<name>.pc.

include_guard(GLOBAL)

# Every component idem knows about, whether this build provides it or not. idemConfig.cmake uses
# it to tell "unknown component" from "component not built in this install".
set(IDEM_KNOWN_COMPONENTS sqlite postgres redis mysql)

function(idem_add_component name)
    cmake_parse_arguments(PARSE_ARGV 1 arg "" "TARGET" "")
    if(NOT name IN_LIST IDEM_KNOWN_COMPONENTS)
        message(FATAL_ERROR "idem: add '${name}' to IDEM_KNOWN_COMPONENTS in ${CMAKE_CURRENT_FUNCTION_LIST_FILE}")
    endif()
    if(NOT arg_TARGET OR NOT TARGET ${arg_TARGET})
        message(FATAL_ERROR "idem_add_component(${name}): TARGET '${arg_TARGET}' does not exist")
    endif()
    set(deps "${PROJECT_SOURCE_DIR}/cmake/idem-${name}-dependencies.cmake")
    if(NOT EXISTS "${deps}")
        message(FATAL_ERROR "idem_add_component(${name}): ${deps} is missing")
    endif()
    set_property(GLOBAL APPEND PROPERTY IDEM_COMPONENTS ${name})
    set_property(GLOBAL PROPERTY IDEM_COMPONENT_TARGET_${name} ${arg_TARGET})
endfunction()
