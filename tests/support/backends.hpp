#pragma once
// IDEM_HAS_<NAME>: 1 when this build has the backend (its idem::<name> target is linked), else 0.
// tests/CMakeLists.txt defines one per backend idem knows (idem_add_backend() in the top-level
// CMakeLists.txt) for every test. Multi-store tests compile a store's variant only under
// `#if IDEM_HAS_<NAME>`; a test that cannot do without a backend is simply not built without it.

#if !defined(IDEM_HAS_SQLITE) || !defined(IDEM_HAS_POSTGRES) || !defined(IDEM_HAS_REDIS) || \
    !defined(IDEM_HAS_MYSQL)
#error \
    "IDEM_HAS_SQLITE/POSTGRES/REDIS/MYSQL are defined by tests/CMakeLists.txt (idem_test_backends)"
#endif
