#pragma once
/// @file
/// @brief idem::redis::StreamAck (idem::StreamAck): the request of an idem::CommitHook asking a
/// RedisStore's commit to ack a stream entry, and the dead-letter stream entry of a stream
/// message. Shared by RedisStore's commit and the Redis Streams consumer. Link idem::redis.

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/redis/endpoint.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// @brief What a Redis Streams consumer asks a RedisStore's commit to do for one entry, carried
/// as the request of an idem::CommitHook (idem/contract/commit_hook.hpp): XACK the entry (and,
/// when the commit parks the message as a dead letter, first XADD it to the dead-letter stream),
/// atomically with the claim and the effect's writes. A RedisStore honours it only when
/// `endpoint` is its own server and database (Endpoint::same_database); otherwise the hook is
/// ignored and the consumer acks after the commit.
///
/// @code
/// idem::CommitHook hook{idem::redis::StreamAck{endpoint, "orders", "capture", entry_id}};
/// auto outcome = handler.handle(delivery, body, hook);
/// if (!hook.acked_in_commit && idem::should_ack(outcome)) xack(entry_id);
/// @endcode
struct StreamAck {
    Endpoint endpoint{};  ///< the server and database the stream is on
    std::string stream{};
    std::string group{};
    std::string entry_id{};
    /// Where a dead letter of this entry also goes, with the entry's fields; empty: nowhere.
    std::string dead_letter_stream{};
    std::vector<std::pair<std::string, std::string>> fields{};
    std::uint32_t delivery_count = 0;
};

/// The dead-letter stream entry of a stream message: why, where from, then its own fields.
inline std::vector<std::string> stream_dead_letter_command(
    const std::string& dead_letter_stream, const std::string& entry_id,
    const std::vector<std::pair<std::string, std::string>>& fields, std::string_view reason,
    std::string_view scope, std::string_view message_id, std::uint32_t delivery_count) {
    std::vector<std::string> command{"XADD",
                                     dead_letter_stream,
                                     "*",
                                     "idem-reason",
                                     std::string(reason),
                                     "idem-scope",
                                     std::string(scope),
                                     "idem-message-id",
                                     std::string(message_id),
                                     "idem-delivery-count",
                                     std::to_string(delivery_count),
                                     "idem-entry-id",
                                     entry_id};
    for (const auto& [name, value] : fields) {
        command.push_back(name);
        command.push_back(value);
    }
    return command;
}

}  // namespace redis
IDEM_END_NAMESPACE
