#pragma once
/// @file
/// @brief The basic properties codec: what a delivery's properties say (Properties,
/// message.hpp), and the properties and headers of a publish (Publish, channel.hpp) in
/// rabbitmq-c's form. Link idem::rabbitmq.

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/rabbitmq/amqp.hpp"
#include "idem/rabbitmq/channel.hpp"
#include "idem/rabbitmq/message.hpp"
#include "idem/rabbitmq/table.hpp"

IDEM_BEGIN_NAMESPACE
namespace rabbitmq {
namespace detail {

/// The properties of a delivery (or a returned message) as idem reads them.
inline Properties properties_of(const amqp_basic_properties_t& p) {
    Properties out;
    auto text = [&](amqp_flags_t flag, amqp_bytes_t bytes, std::optional<std::string>& into) {
        if ((p._flags & flag) != 0) into = string_of(bytes);
    };
    text(AMQP_BASIC_CONTENT_TYPE_FLAG, p.content_type, out.content_type);
    text(AMQP_BASIC_CONTENT_ENCODING_FLAG, p.content_encoding, out.content_encoding);
    text(AMQP_BASIC_MESSAGE_ID_FLAG, p.message_id, out.message_id);
    text(AMQP_BASIC_CORRELATION_ID_FLAG, p.correlation_id, out.correlation_id);
    text(AMQP_BASIC_TYPE_FLAG, p.type, out.type);
    text(AMQP_BASIC_APP_ID_FLAG, p.app_id, out.app_id);
    text(AMQP_BASIC_EXPIRATION_FLAG, p.expiration, out.expiration);
    if ((p._flags & AMQP_BASIC_TIMESTAMP_FLAG) != 0) out.timestamp = p.timestamp;
    if ((p._flags & AMQP_BASIC_DELIVERY_MODE_FLAG) != 0) out.delivery_mode = p.delivery_mode;
    if ((p._flags & AMQP_BASIC_PRIORITY_FLAG) != 0) out.priority = p.priority;
    return out;
}

/// The properties of a publish (their strings point into @p what, the tables into @p pool
/// and @p entries).
inline void fill_properties(const Publish& what, Pool& pool, amqp_basic_properties_t& props,
                            std::vector<amqp_table_entry_t>& entries) {
    const Properties& p = what.properties;
    props._flags = 0;
    auto text = [&](amqp_flags_t flag, const std::optional<std::string>& value,
                    amqp_bytes_t& into) {
        if (!value) return;
        props._flags |= flag;
        into = bytes_of(*value);
    };
    text(AMQP_BASIC_CONTENT_TYPE_FLAG, p.content_type, props.content_type);
    text(AMQP_BASIC_CONTENT_ENCODING_FLAG, p.content_encoding, props.content_encoding);
    text(AMQP_BASIC_MESSAGE_ID_FLAG, p.message_id, props.message_id);
    text(AMQP_BASIC_CORRELATION_ID_FLAG, p.correlation_id, props.correlation_id);
    text(AMQP_BASIC_TYPE_FLAG, p.type, props.type);
    text(AMQP_BASIC_APP_ID_FLAG, p.app_id, props.app_id);
    text(AMQP_BASIC_EXPIRATION_FLAG, p.expiration, props.expiration);
    if (p.timestamp) {
        props._flags |= AMQP_BASIC_TIMESTAMP_FLAG;
        props.timestamp = *p.timestamp;
    }
    if (p.delivery_mode) {
        props._flags |= AMQP_BASIC_DELIVERY_MODE_FLAG;
        props.delivery_mode = *p.delivery_mode;
    }
    if (p.priority) {
        props._flags |= AMQP_BASIC_PRIORITY_FLAG;
        props.priority = *p.priority;
    }
    // Headers: the original encoded table, then ours (replacing entries of the same name).
    amqp_table_t original{};
    if (!what.encoded_headers.empty()) {
        std::size_t offset = 0;
        const int status =
            amqp_decode_table(bytes_of(what.encoded_headers), pool.get(), &original, &offset);
        if (status != AMQP_STATUS_OK) {
            throw broker_error(fmt::format("idem::rabbitmq: the encoded headers do not decode: {}",
                                           amqp_error_string2(status)));
        }
    }
    std::vector<amqp_table_entry_t> extra;
    const amqp_table_t ours = to_amqp(what.headers, extra);
    if (original.num_entries == 0 && ours.num_entries == 0) return;
    entries.clear();
    for (int i = 0; i < original.num_entries; ++i) {
        const std::string key = string_of(original.entries[i].key);
        if (find_field(what.headers, key) == nullptr) entries.push_back(original.entries[i]);
    }
    entries.insert(entries.end(), extra.begin(), extra.end());
    props._flags |= AMQP_BASIC_HEADERS_FLAG;
    props.headers.num_entries = static_cast<int>(entries.size());
    props.headers.entries = entries.data();
}

}  // namespace detail
}  // namespace rabbitmq
IDEM_END_NAMESPACE
