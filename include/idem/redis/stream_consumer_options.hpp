#pragma once
/// @file
/// @brief What a RedisStreamConsumer (broker/redis_streams.hpp) reads and is given: StreamEntry,
/// one stream entry, with idem_payload() (what a dead letter keeps of it);
/// RedisStreamConsumerOptions; and the parsing of XREADGROUP / XCLAIM replies into entries. Link
/// idem::redis.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/broker/consumer_options.hpp"
#include "idem/config.hpp"
#include "idem/detail/json.hpp"
#include "idem/redis/reply.hpp"

IDEM_BEGIN_NAMESPACE
/// @brief One entry of a stream, as read. Binary-safe: names and values are bytes.
struct StreamEntry {
    /// The stream key it was read from.
    std::string stream;
    std::string id;  ///< the entry id, "<ms>-<seq>"
    /// Its field-value pairs, in the entry's order (a name may repeat).
    std::vector<std::pair<std::string, std::string>> fields;

    /// @brief The value of the first field named @p name (a stream entry may repeat a name).
    [[nodiscard]] std::optional<std::string_view> field(std::string_view name) const {
        for (const auto& [key, value] : fields) {
            if (key == name) return std::string_view(value);
        }
        return std::nullopt;
    }
};

/// @brief The bytes a dead letter keeps of a stream entry (found by ADL by the handler): its
/// fields as a JSON array of [name, value] pairs, in order, e.g. `[["order","8814"]]`. An array
/// rather than an object because a stream entry may repeat a name; bytes outside printable ASCII
/// are escaped as `\u00XX` (one per byte), so the encoding is unambiguous and readable.
[[nodiscard]] inline std::string idem_payload(const StreamEntry& entry) {
    std::string out = "[";
    for (std::size_t i = 0; i < entry.fields.size(); ++i) {
        if (i != 0) out += ',';
        out += '[';
        detail::append_json_bytes(out, entry.fields[i].first);
        out += ',';
        detail::append_json_bytes(out, entry.fields[i].second);
        out += ']';
    }
    out += ']';
    return out;
}

/// @brief Where a RedisStreamConsumer reads and how it paces itself; the shared options
/// (broker::ConsumerOptions) under their common names. On Redis Streams:
/// - `visibility_timeout`: an entry pending this long without an ack is taken over (XCLAIM
///   min-idle-time) and delivered again;
/// - `poll_wait`: how long XREADGROUP waits for new entries when nothing was taken over; must
///   be shorter than the endpoint's command_timeout;
/// - `redelivery_backoff`: an entry delivered n − 1 times is taken over only once it has been
///   idle for the longer of visibility_timeout and redelivery_backoff.before(n) (a consumer
///   cannot tell another's failure from a slow holder). An entry whose handler failed here
///   (or deferred it with a retry_after) is due after that delay even when it is shorter than
///   the visibility timeout: the consumer moves its idle time forward (XCLAIM to itself, IDLE,
///   JUSTID: its count unchanged);
/// - `declare`: create the group (at id 0, with the stream) when it does not exist;
/// - `id_field`: the entry field carrying the message id; empty: the entry id;
/// - `dead_letter`: the dead-letter stream; empty: `<stream>.dead-letters`. On a Redis Cluster
///   give both the same hash tag (a stream named "{orders}" does by default);
/// - `batch_size`: entries taken over, and entries read, per poll (with handle_in_batches: at
///   most this many in all, the taken-over ones first);
/// - `handle_in_batches`: the acks of a batch go in ONE round trip (one XACK, pipelined with
///   the dead-letter scripts); on a RedisStore of this database the commit itself acks;
/// - `on_health`: pending entries of the group (XPENDING) and the dead-letter stream's length,
///   one round trip per report.
struct RedisStreamConsumerOptions : broker::ConsumerOptions {
    RedisStreamConsumerOptions() = default;
    /// @brief Options for consumer @p consumer_ of group @p group_ on stream @p stream_, the rest
    /// defaults.
    RedisStreamConsumerOptions(std::string stream_, std::string group_, std::string consumer_)
        : stream(std::move(stream_)), group(std::move(group_)), consumer(std::move(consumer_)) {}

    std::string stream;    ///< the stream key
    std::string group;     ///< the consumer group
    std::string consumer;  ///< this consumer's name in the group, unique per running instance
    /// One entry at a time (handle_in_batches off) on a store that sends a commit with the next
    /// claim (an IdempotentHandler on a RedisStore): entry N's commit goes with entry N+1's
    /// claim in ONE round trip (idem::PipelinedLoop), and N is acked only once that commit's
    /// reply says it committed — in the commit itself on a RedisStore of this database, else
    /// with the poll's other acks in one XACK after its last entry. The poll's last commit goes
    /// alone before the next read. A message's lease is held while the next entry's effect runs
    /// (one effect longer than without it): the lease and the visibility timeout must cover two
    /// effects. Off: each entry claimed, committed and acked before the next is read. Other
    /// stores and plain handlers are unaffected.
    bool pipeline_commits = true;
};

namespace detail {

/// The millisecond part of an entry id ("1700000000000-0"), or nothing if it is not one.
inline std::optional<std::int64_t> stream_id_ms(std::string_view id) {
    const std::size_t dash = id.find('-');
    const std::string_view ms = id.substr(0, dash);
    if (ms.empty() || ms.size() > 18) return std::nullopt;
    std::int64_t value = 0;
    for (char c : ms) {
        if (c < '0' || c > '9') return std::nullopt;
        value = value * 10 + (c - '0');
    }
    return value;
}

/// When the entry of id @p id was added (its millisecond part), or nothing if it is not an id.
/// An id past what the clock holds (an explicit XADD id, ~292 years on) reads as its latest time.
inline std::optional<std::chrono::system_clock::time_point> stream_enqueued_at(
    std::string_view id) {
    if (auto ms = stream_id_ms(id)) return from_unix_ms(*ms);
    return std::nullopt;
}

/// An entry of an XREADGROUP / XCLAIM reply: [id, [name, value, ...]]. Nothing for an entry
/// deleted from the stream (nil, or an id with nil fields).
inline std::optional<StreamEntry> parse_stream_entry(const redis::Reply& reply,
                                                     const std::string& stream) {
    if (!reply.is_array() || reply.elements.size() < 2 || !reply.elements[1].is_array()) {
        return std::nullopt;
    }
    StreamEntry entry;
    entry.stream = stream;
    entry.id = reply.elements[0].str;
    const auto& fields = reply.elements[1].elements;
    entry.fields.reserve(fields.size() / 2);
    for (std::size_t i = 0; i + 1 < fields.size(); i += 2)
        entry.fields.emplace_back(fields[i].str, fields[i + 1].str);
    return entry;
}

/// An entry of a stream as a RedisStreamConsumer read it, with the delivery count it has.
struct StreamItem {
    StreamEntry entry;
    std::uint32_t delivery_count;
};

}  // namespace detail

IDEM_END_NAMESPACE
