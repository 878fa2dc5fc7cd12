# Warnings for idem's OWN test and example targets. Never linked by idem::idem / idem::sqlite and
# never installed or exported: consumers' flags are their business.
include_guard(GLOBAL)

if(NOT TARGET idem_test_warnings)
    add_library(idem_test_warnings INTERFACE)
    if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
        target_compile_options(idem_test_warnings INTERFACE -Wall -Wextra -Wpedantic)
        if(IDEM_WERROR)
            target_compile_options(idem_test_warnings INTERFACE -Werror)
        endif()
    elseif(MSVC)
        target_compile_options(idem_test_warnings INTERFACE /W4 $<$<BOOL:${IDEM_WERROR}>:/WX>)
    endif()
endif()
