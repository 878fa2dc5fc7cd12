#pragma once
/// @file
/// @brief idem::StoredOffset: the commit-hook request of a broker that reads by offset (Kafka)
/// and keeps its read position in the handler's store, written in the same transaction as the
/// claim and the effect, so a partition's next owner starts after the last message whose effect
/// committed and replays none of them. Core header: the standard library only.
///
/// The capability, for a store that has it (MemoryStore and the SQL stores):
///
///   store.stored_offset(group, topic, partition) -> std::optional<std::int64_t>
///       the next offset to read, as last stored; nullopt when none was
///   tx.attach(hook) -> true for a hook whose request is a StoredOffset
///       the commit writes it (the greatest offset wins: a stored offset never moves back),
///       then sets hook.acked_in_commit; except when the commit parks the hook's message
///       (scope, message_id) as a dead letter: the offset is then NOT written, and
///       acked_in_commit stays false, so the broker's dead-letter copy is sent and confirmed
///       before the position moves past it (in a transaction holding only the hook)
///   store.begin(), attach(hook), commit(): a transaction with nothing but offset hooks
///       commits them (what the broker does after a duplicate or a dead letter)
///
/// has_stored_offsets<Store> says whether a store has it.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The next offset to read in one partition of a topic, for one consumer group.
struct StoredOffset {
    /// The consumer group whose position it is.
    std::string group;
    /// The topic read.
    std::string topic;
    /// The topic's partition.
    std::int32_t partition = 0;
    /// The offset of the NEXT record to read (the handled record's offset + 1).
    std::int64_t next_offset = 0;
};

/// A store that keeps offsets (see the file comment).
template <class, class = void>
struct has_stored_offsets : std::false_type {};
template <class S>
struct has_stored_offsets<
    S, std::void_t<decltype(std::declval<S&>().stored_offset(
           std::declval<std::string_view>(), std::declval<std::string_view>(), std::int32_t{}))>>
    : std::is_convertible<decltype(std::declval<S&>().stored_offset(
                              std::declval<std::string_view>(), std::declval<std::string_view>(),
                              std::int32_t{})),
                          std::optional<std::int64_t>> {};

IDEM_END_NAMESPACE
