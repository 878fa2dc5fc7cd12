#pragma once
/// @file
/// @brief Version and the versioned inline namespace shared by every idem header.

#define IDEM_VERSION_MAJOR 0
#define IDEM_VERSION_MINOR 1
#define IDEM_VERSION_PATCH 0

// A future ABI change becomes a new inline namespace (v1) instead of a silent break.
#define IDEM_BEGIN_NAMESPACE \
    namespace idem {         \
    inline namespace v0 {
#define IDEM_END_NAMESPACE \
    }                      \
    }

#if defined(__cpp_concepts) && __cpp_concepts >= 201907L
#define IDEM_HAS_CONCEPTS 1
#else
#define IDEM_HAS_CONCEPTS 0
#endif
