// The AMQP field-table codec (idem/rabbitmq/table.hpp, properties.hpp) on hostile headers: the
// input is a table in wire encoding, as a delivery's headers property carries it. Contract:
//   * a table rabbitmq-c decodes is read into idem's Table (table_of()) and encoded again
//     (encode(), what Message::encoded_headers keeps) without a crash; that encoding has the
//     input's entries, its size (when the table's declared length is its entries'), and
//     re-encodes to itself, so a dead letter or a retry republishes what was received;
//   * Table → to_amqp() → encode → decode → Table is the identity (values compared bit for bit);
//   * a publish's headers (fill_properties()) are the original entries not replaced, then ours;
//   * delivery_count_of() of any headers is 1 + the non-negative prior deliveries and
//     x-delivery-count, clamped to [1, UINT32_MAX]; encode() throws only broker_error.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <variant>
#include <vector>

#include "fuzz_check.hpp"
#include "idem/broker/rabbitmq.hpp"
#include "idem/error.hpp"
#include "idem/rabbitmq/properties.hpp"
#include "idem/rabbitmq/table.hpp"

namespace {

namespace rmq = idem::rabbitmq;

bool same_value(const rmq::FieldValue& a, const rmq::FieldValue& b) {
    if (a.index() != b.index()) return false;
    if (const auto* x = std::get_if<double>(&a)) {
        const double y = std::get<double>(b);
        return std::memcmp(x, &y, sizeof y) == 0;  // NaN too: bit for bit
    }
    return a == b;
}

bool same_table(const rmq::Table& a, const rmq::Table& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i) {
        if (a[i].first != b[i].first || !same_value(a[i].second, b[i].second)) return false;
    }
    return true;
}

/// Decodes @p bytes as one table; false when rabbitmq-c refuses them.
bool decode(const std::string& bytes, rmq::detail::Pool& pool, amqp_table_t& out,
            std::size_t& used) {
    used = 0;
    return amqp_decode_table(rmq::detail::bytes_of(bytes), pool.get(), &out, &used) ==
           AMQP_STATUS_OK;
}

std::uint64_t non_negative(const rmq::Table& table, const char* name) {
    const rmq::FieldValue* v = rmq::find_field(table, name);
    const auto* i = v == nullptr ? nullptr : std::get_if<std::int64_t>(v);
    return i != nullptr && *i > 0 ? static_cast<std::uint64_t>(*i) : 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const std::string input(reinterpret_cast<const char*>(data), size);
    rmq::detail::Pool pool;
    amqp_table_t decoded{};
    std::size_t used = 0;
    if (!decode(input, pool, decoded, used)) return 0;
    const rmq::Table table = rmq::detail::table_of(decoded);

    // What Message::encoded_headers keeps: the headers as they came, byte for byte.
    std::string encoded;
    try {
        encoded = rmq::detail::encode(decoded);
    } catch (const idem::broker_error&) {
        return 0;  // over encode()'s 64 MiB bound
    }
    // What rabbitmq-c 0.11 decoded, encoded again: a boolean byte other than 0 reads as 1, and
    // a table whose last entry runs past its declared length is re-encoded with its true
    // length; so byte for byte holds for a canonical table, and the size for one whose length
    // is its entries'.
    const std::uint32_t declared = (std::uint32_t{data[0]} << 24) | (std::uint32_t{data[1]} << 16) |
                                   (std::uint32_t{data[2]} << 8) | std::uint32_t{data[3]};
    if (used == 4 + std::size_t{declared}) {
        IDEM_FUZZ_CHECK(encoded.size() == used, "the encoded headers are the size received");
    }
    rmq::detail::Pool pool2;
    amqp_table_t again{};
    std::size_t used_again = 0;
    IDEM_FUZZ_CHECK(decode(encoded, pool2, again, used_again), "the encoded headers decode");
    IDEM_FUZZ_CHECK(used_again == encoded.size(), "the encoded headers are one table");
    IDEM_FUZZ_CHECK(rmq::detail::encode(again) == encoded, "and encode to themselves");
    IDEM_FUZZ_CHECK(same_table(rmq::detail::table_of(again), table), "and read the same");

    // idem's own Table through rabbitmq-c and back.
    std::vector<amqp_table_entry_t> entries;
    const std::string ours = rmq::detail::encode(rmq::detail::to_amqp(table, entries));
    rmq::detail::Pool pool3;
    amqp_table_t back{};
    IDEM_FUZZ_CHECK(decode(ours, pool3, back, used), "an encoded Table decodes");
    IDEM_FUZZ_CHECK(same_table(rmq::detail::table_of(back), table), "a Table round-trips");

    // A republish: the original headers, then ours replacing entries of the same name.
    rmq::Publish publish;
    publish.encoded_headers = encoded;
    publish.headers = {{rmq::header_reason, std::string("poison")}};
    if (!table.empty()) publish.headers.emplace_back(table.front().first, std::int64_t{7});
    rmq::detail::Pool pool4;
    amqp_basic_properties_t props{};
    std::vector<amqp_table_entry_t> merged;
    rmq::detail::fill_properties(publish, pool4, props, merged);
    rmq::Table expected;
    for (const auto& entry : table) {
        if (rmq::find_field(publish.headers, entry.first) == nullptr) expected.push_back(entry);
    }
    expected.insert(expected.end(), publish.headers.begin(), publish.headers.end());
    IDEM_FUZZ_CHECK((props._flags & AMQP_BASIC_HEADERS_FLAG) != 0, "a publish has headers");
    const std::string sent = rmq::detail::encode(props.headers);
    rmq::detail::Pool pool5;
    amqp_table_t received{};
    IDEM_FUZZ_CHECK(decode(sent, pool5, received, used), "a publish's headers decode");
    IDEM_FUZZ_CHECK(same_table(rmq::detail::table_of(received), expected),
                    "the original headers not replaced, then ours");

    // The delivery count the consumer reads from these headers.
    rmq::Message message;
    message.headers = table;
    const std::uint64_t want = non_negative(table, rmq::header_prior_deliveries) +
                               non_negative(table, "x-delivery-count") + 1;
    const std::uint32_t count = rmq::delivery_count_of(message);
    IDEM_FUZZ_CHECK(count >= 1, "a delivery count is at least 1");
    IDEM_FUZZ_CHECK(count == (want > std::numeric_limits<std::uint32_t>::max()
                                  ? std::numeric_limits<std::uint32_t>::max()
                                  : static_cast<std::uint32_t>(want)),
                    "prior deliveries + x-delivery-count + 1, clamped");
    return 0;
}
