#pragma once
/// @file
/// @brief idem::SqliteOptions: how SqliteStore sets up its connection (included by
/// idem/store/sqlite.hpp).

#include <chrono>
#include <cstdint>
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
    /// `PRAGMA mmap_size`, bytes: read the database through a memory map of up to this size
    /// (SQLite's build caps it, 2 GB on Debian) instead of read() calls; 0 leaves SQLite's
    /// default, no map. With 10M claims (a 0.9 GB file) a map over the whole file cut the p99
    /// of a claim + commit by about a third at the same throughput (docs/performance.md). The
    /// map is address space; its pages are the OS page cache's. SQLite's caveat: an I/O error
    /// on a mapped page arrives as SIGBUS, not as an error code.
    std::int64_t mmap_size = 0;
    /// Time source for claimed_at / created_at / purge(); empty = system_clock::now.
    Clock clock{};
};

IDEM_END_NAMESPACE
