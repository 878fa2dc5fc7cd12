#pragma once
/// @file
/// @brief idem::redis::StreamAck (idem::StreamAck): a stream entry a commit acks, and the
/// dead-letter stream entry of a stream message. Shared by RedisStore's commit and the Redis
/// Streams consumer. Link idem::redis.

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// @brief A consumer reading a stream on the same Redis asks the next transaction begun on its
/// thread to ack the entry in the commit itself (see RedisStore::AckWithNextCommit in
/// idem/store/redis.hpp), so for
/// Redis-only effects the ack is part of the transaction.
struct StreamAck {
    std::string stream;
    std::string group;
    std::string entry_id;
    /// Where a dead letter of this entry also goes, with the entry's fields; empty: nowhere.
    std::string dead_letter_stream{};
    std::vector<std::pair<std::string, std::string>> fields{};
    std::uint32_t delivery_count = 0;
    bool acked = false;  ///< set when a commit included the XACK
    /// The claim this entry is delivered as: the handler's policy scope and the message id (the
    /// entry id, or the id field's value). A batch commit matches its claims and dead letters to
    /// the entries by these; a single ack does not need them.
    std::string scope{};
    std::string message_id{};
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
