#pragma once
/// @file
/// @brief idem::Blob: marks a SQL parameter to be bound as bytes (BLOB / bytea), not text.

#include <string_view>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief Marks a parameter of a SQL store's execute() / query_*() to be bound as binary-safe
/// bytes (SQLite BLOB, PostgreSQL bytea) instead of text. The bytes must outlive the call.
struct Blob {
    std::string_view bytes;  ///< the bytes to bind (not copied)
};

IDEM_END_NAMESPACE
