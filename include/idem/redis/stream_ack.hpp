#pragma once
/// @file
/// @brief idem::redis::StreamAck: the request of an idem::CommitHook asking a
/// RedisStore's commit to ack a stream entry, and the dead-letter stream entry of a stream
/// message, and the script that parks and acks one. Shared by RedisStore's commit and the Redis
/// Streams consumer. Link idem::redis.

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/contract/dead_letter_envelope.hpp"
#include "idem/redis/connection.hpp"
#include "idem/redis/endpoint.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// @brief The dead-letter stream of @p stream when none is named: `<stream>.dead-letters`
/// (RedisStreamConsumerOptions::dead_letter's default too; a stream named "{orders}" keeps
/// its hash tag).
[[nodiscard]] inline std::string default_dead_letter_stream(std::string_view stream) {
    std::string name(stream);
    name += ".dead-letters";
    return name;
}

/// @brief What a Redis Streams consumer asks a RedisStore's commit to do for one entry, carried
/// as the request of an idem::CommitHook (idem/contract/commit_hook.hpp): XACK the entry (and,
/// when the commit parks the message as a dead letter, first XADD it to the dead-letter stream),
/// atomically with the claim and the effect's writes. A RedisStore honours it only when
/// `endpoint` is its own server and database (RedisEndpoint::same_database); otherwise the hook is
/// ignored and the consumer acks after the commit.
///
/// A dead letter always goes somewhere: to `dead_letter_stream`, or `<stream>.dead-letters`
/// when it is empty (as RedisStreamConsumer's), never XACKed without its copy.
///
/// @code
/// idem::CommitHook hook{idem::redis::StreamAck{endpoint, "orders", "capture", entry.id}};
/// auto outcome = handler.handle(delivery, entry, hook);   // dead letters: orders.dead-letters
/// if (!hook.acked_in_commit && idem::should_ack(outcome)) xack(entry.id);
/// @endcode
struct StreamAck {
    StreamAck() = default;
    /// @brief The ack of @p entry_id_ of @p stream_ for @p group_ on @p endpoint_; a dead letter
    /// of it also goes to @p dead_letter_stream_, by default `<stream>.dead-letters`. Set
    /// `fields` and `delivery_count` for the dead-letter copy to carry them.
    StreamAck(RedisEndpoint endpoint_, std::string stream_, std::string group_,
              std::string entry_id_, std::string dead_letter_stream_ = {})
        : endpoint(std::move(endpoint_)),
          stream(std::move(stream_)),
          group(std::move(group_)),
          entry_id(std::move(entry_id_)),
          dead_letter_stream(dead_letter_stream_.empty() ? default_dead_letter_stream(stream)
                                                         : std::move(dead_letter_stream_)) {}

    RedisEndpoint endpoint{};  ///< the server and database the stream is on
    /// The stream the entry was read from.
    std::string stream{};
    /// The consumer group that read it.
    std::string group{};
    /// The entry's id, `<ms>-<seq>`.
    std::string entry_id{};
    /// Where a dead letter of this entry also goes, with the entry's fields; empty:
    /// `<stream>.dead-letters` (dead_letter_destination()).
    std::string dead_letter_stream{};
    /// The entry's fields, copied to the dead-letter stream with a dead letter.
    std::vector<std::pair<std::string, std::string>> fields{};
    /// The entry's delivery count, written with a dead letter.
    std::uint32_t delivery_count = 0;

    /// @brief Where a dead letter of this entry goes: dead_letter_stream, or
    /// `<stream>.dead-letters` when it is empty.
    [[nodiscard]] std::string dead_letter_destination() const {
        return dead_letter_stream.empty() ? default_dead_letter_stream(stream) : dead_letter_stream;
    }
};

/// The dead-letter stream entry of a stream message: the envelope (why, whose, where from;
/// contract/dead_letter_envelope.hpp), then the entry's own fields.
inline std::vector<std::string> stream_dead_letter_command(
    const std::string& dead_letter_stream, std::string_view stream, const std::string& entry_id,
    const std::vector<std::pair<std::string, std::string>>& fields, std::string_view reason,
    std::string_view scope, std::string_view message_id, std::uint32_t delivery_count,
    const std::optional<NotedFailure>& noted) {
    std::vector<std::string> command{"XADD", dead_letter_stream, "*"};
    auto add = [&](std::string name, std::string value) {
        command.push_back(std::move(name));
        command.push_back(std::move(value));
    };
    for (auto& [name, value] :
         envelope::common_fields(reason, scope, message_id, delivery_count, noted))
        add(std::move(name), std::move(value));
    add(envelope::original_stream, std::string(stream));
    add(envelope::original_entry_id, entry_id);
    for (const auto& [name, value] : fields)
        add(name, value);
    return command;
}

/// The Redis Streams consumer's dead letter: KEYS[1] dead-letter stream, KEYS[2] stream. ARGV:
/// group, entry id, then the XADD field/value pairs. A script rather than MULTI/EXEC: EXEC still
/// runs the XACK when the XADD fails at run time (a dead-letter key of another type), which would
/// ack an entry that was never parked. Here a failing XADD raises before the XACK.
inline constexpr const char* stream_dead_letter_ack_source = R"(
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
return redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
)";
/// stream_dead_letter_ack_source as a Script (made once).
inline const Script& stream_dead_letter_ack_script() {
    static const Script script{"stream dead letter", stream_dead_letter_ack_source};
    return script;
}

}  // namespace redis
IDEM_END_NAMESPACE
