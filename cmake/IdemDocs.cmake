# The API reference (IDEM_BUILD_DOCS=ON): `cmake --build <dir> --target docs` runs Doxygen over
# docs/Doxyfile (its scope and why: the comment at its top) into <dir>/docs/html; with the tests,
# ctest docs.reference (label docs) runs it too and fails on any warning (the Doxyfile's
# WARN_AS_ERROR = FAIL_ON_WARNINGS), and ctest docs.core_documented (docs/Doxyfile.core) fails
# when an entity of the reference's headers has no doc comment. scripts/test.sh's gcc17
# configuration turns it on.
include_guard(GLOBAL)

find_program(IDEM_DOXYGEN NAMES doxygen DOC "Doxygen, for the docs target (Debian: doxygen)")
if(NOT IDEM_DOXYGEN)
    message(FATAL_ERROR "idem: IDEM_BUILD_DOCS needs Doxygen (Debian: doxygen); install it, or "
                        "configure with -DIDEM_BUILD_DOCS=OFF")
endif()
find_package(Python3 REQUIRED COMPONENTS Interpreter)  # docs/doxygen_markdown_filter.py

# docs/Doxyfile's paths are relative to the repository's root, where Doxygen runs; the build's
# copy only moves the output and names the version.
set(idem_doxyfile "${PROJECT_BINARY_DIR}/docs/Doxyfile")
file(CONFIGURE OUTPUT "${idem_doxyfile}" CONTENT [[
@INCLUDE = @PROJECT_SOURCE_DIR@/docs/Doxyfile
PROJECT_NUMBER = @PROJECT_VERSION@
OUTPUT_DIRECTORY = @PROJECT_BINARY_DIR@/docs
FILTER_PATTERNS = *.md="@Python3_EXECUTABLE@ docs/doxygen_markdown_filter.py"
]] @ONLY)

# The documented API (docs/Doxyfile.core): every entity of the reference's headers (include/idem,
# recursively, but for idem::detail and include/idem/testing/) has a comment.
set(idem_doxyfile_core "${PROJECT_BINARY_DIR}/docs/Doxyfile.core")
file(CONFIGURE OUTPUT "${idem_doxyfile_core}" CONTENT [[
@INCLUDE = @PROJECT_SOURCE_DIR@/docs/Doxyfile.core
PROJECT_NUMBER = @PROJECT_VERSION@
OUTPUT_DIRECTORY = @PROJECT_BINARY_DIR@/docs/core
]] @ONLY)

add_custom_target(docs
    COMMAND "${IDEM_DOXYGEN}" "${idem_doxyfile}"
    COMMAND ${CMAKE_COMMAND} -E echo "idem: the API reference is ${PROJECT_BINARY_DIR}/docs/html/index.html"
    WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}"
    COMMENT "Doxygen: the API reference (docs/Doxyfile)"
    VERBATIM)

if(IDEM_BUILD_TESTS)
    add_test(NAME docs.reference
        COMMAND "${IDEM_DOXYGEN}" "${idem_doxyfile}"
        WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}")
    # FAIL_ON_WARNINGS makes Doxygen's status non-zero; the regex also catches a warning that a
    # Doxygen without that setting would only print.
    set_tests_properties(docs.reference PROPERTIES
        LABELS docs TIMEOUT 300 FAIL_REGULAR_EXPRESSION "warning:|error:")
    add_test(NAME docs.core_documented
        COMMAND "${IDEM_DOXYGEN}" "${idem_doxyfile_core}"
        WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}")
    set_tests_properties(docs.core_documented PROPERTIES
        LABELS docs TIMEOUT 300 FAIL_REGULAR_EXPRESSION "warning:|error:")
endif()
