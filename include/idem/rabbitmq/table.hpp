#pragma once
/// @file
/// @brief The AMQP field-table codec: rabbitmq-c's decoded tables to idem's Table (message.hpp)
/// and back, and a table's wire encoding (what Message::encoded_headers holds). Link
/// idem::rabbitmq.

#include <cstddef>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/rabbitmq/amqp.hpp"
#include "idem/rabbitmq/message.hpp"

IDEM_BEGIN_NAMESPACE
namespace rabbitmq {
namespace detail {

/// Owns an amqp_pool_t (the memory decoded tables live in).
class Pool {
  public:
    Pool() { init_amqp_pool(&pool_, 4096); }
    ~Pool() { empty_amqp_pool(&pool_); }
    Pool(const Pool&) = delete;
    Pool& operator=(const Pool&) = delete;
    amqp_pool_t* get() noexcept { return &pool_; }

  private:
    amqp_pool_t pool_{};
};

inline FieldValue field_value_of(const amqp_field_value_t& v) {
    switch (v.kind) {
        case AMQP_FIELD_KIND_BOOLEAN:
            return v.value.boolean != 0;
        case AMQP_FIELD_KIND_I8:
            return std::int64_t{v.value.i8};
        case AMQP_FIELD_KIND_U8:
            return std::int64_t{v.value.u8};
        case AMQP_FIELD_KIND_I16:
            return std::int64_t{v.value.i16};
        case AMQP_FIELD_KIND_U16:
            return std::int64_t{v.value.u16};
        case AMQP_FIELD_KIND_I32:
            return std::int64_t{v.value.i32};
        case AMQP_FIELD_KIND_U32:
            return std::int64_t{v.value.u32};
        case AMQP_FIELD_KIND_I64:
            return std::int64_t{v.value.i64};
        case AMQP_FIELD_KIND_U64:
        case AMQP_FIELD_KIND_TIMESTAMP:
            return static_cast<std::int64_t>(v.value.u64);
        case AMQP_FIELD_KIND_F32:
            return static_cast<double>(v.value.f32);
        case AMQP_FIELD_KIND_F64:
            return v.value.f64;
        case AMQP_FIELD_KIND_UTF8:
        case AMQP_FIELD_KIND_BYTES:
            return string_of(v.value.bytes);
        default:
            return std::monostate{};
    }
}

inline Table table_of(const amqp_table_t& t) {
    Table out;
    out.reserve(static_cast<std::size_t>(t.num_entries));
    for (int i = 0; i < t.num_entries; ++i) {
        out.emplace_back(string_of(t.entries[i].key), field_value_of(t.entries[i].value));
    }
    return out;
}

/// An amqp_table_t pointing into @p table's strings (valid while @p table and @p entries live).
inline amqp_table_t to_amqp(const Table& table, std::vector<amqp_table_entry_t>& entries) {
    entries.clear();
    entries.reserve(table.size());
    for (const auto& [key, value] : table) {
        amqp_table_entry_t e{};
        e.key = bytes_of(key);
        if (std::holds_alternative<bool>(value)) {
            e.value.kind = AMQP_FIELD_KIND_BOOLEAN;
            e.value.value.boolean = std::get<bool>(value) ? 1 : 0;
        } else if (std::holds_alternative<std::int64_t>(value)) {
            e.value.kind = AMQP_FIELD_KIND_I64;
            e.value.value.i64 = std::get<std::int64_t>(value);
        } else if (std::holds_alternative<double>(value)) {
            e.value.kind = AMQP_FIELD_KIND_F64;
            e.value.value.f64 = std::get<double>(value);
        } else if (std::holds_alternative<std::string>(value)) {
            e.value.kind = AMQP_FIELD_KIND_UTF8;
            e.value.value.bytes = bytes_of(std::get<std::string>(value));
        } else {
            e.value.kind = AMQP_FIELD_KIND_VOID;
        }
        entries.push_back(e);
    }
    amqp_table_t t;
    t.num_entries = static_cast<int>(entries.size());
    t.entries = entries.empty() ? nullptr : entries.data();
    return t;
}

/// @p table in AMQP wire encoding (what Message::encoded_headers holds).
inline std::string encode(amqp_table_t table) {
    std::string buffer(4096, '\0');
    for (;;) {
        std::size_t offset = 0;
        const int status = amqp_encode_table(bytes_of(buffer), &table, &offset);
        if (status == AMQP_STATUS_OK) {
            buffer.resize(offset);
            return buffer;
        }
        if (status != AMQP_STATUS_TABLE_TOO_BIG || buffer.size() > (64u << 20)) {
            throw broker_error(fmt::format("idem::rabbitmq: encoding a header table failed: {}",
                                           amqp_error_string2(status)));
        }
        buffer.assign(buffer.size() * 2, '\0');
    }
}

}  // namespace detail
}  // namespace rabbitmq
IDEM_END_NAMESPACE
