#pragma once
/// @file
/// @brief idem::SqliteOptions: how SqliteStore sets up its connection (included by
/// idem/store/sqlite.hpp).

#include <chrono>
#include <optional>

#include "idem/config.hpp"
#include "idem/contract/store.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief Values of `PRAGMA synchronous`.
enum class Synchronous { off, normal, full, extra };

/// @brief How SqliteStore sets up its connection.
struct SqliteOptions {
    /// How long a writer waits for another one (BEGIN IMMEDIATE) before store_timeout.
    std::chrono::milliseconds busy_timeout{5000};
    /// Switch the database to `journal_mode=WAL` (readers never block the writer).
    bool wal = true;
    /// `PRAGMA synchronous`; SQLite's default is left alone unless set.
    std::optional<Synchronous> synchronous{};
    /// Time source for claimed_at / created_at / purge(); empty = system_clock::now.
    Clock clock{};
};

IDEM_END_NAMESPACE
