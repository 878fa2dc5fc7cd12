// Kafka record headers → the message id (idem/broker/kafka.hpp: KafkaMessage::header() and the
// KafkaConsumer's delivery_of(), reached through detail::KafkaConsumerProbe, the seam the header
// leaves to tests). A record with hostile headers: names repeated, empty, with NULs; values
// binary, empty or absent. Contract: header(name) is the LAST value of exactly that name; with
// id_field the id is that header's value (empty, so dead-lettered as malformed, when there is
// none), without it `<topic>/<partition>/<offset>`; the count is the consumer's tries, counted
// by the store; the enqueue time is the record's; malformed_reason() refuses exactly an empty
// or over-long id. No broker is needed: a KafkaConsumer joins its group on its first poll only.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "fuzz_check.hpp"
#include "idem/broker/kafka.hpp"

IDEM_BEGIN_NAMESPACE
namespace detail {
struct KafkaConsumerProbe {
    static Delivery delivery_of(const KafkaConsumer& consumer, const KafkaItem& item) {
        return consumer.delivery_of(item);
    }
};
}  // namespace detail
IDEM_END_NAMESPACE

namespace {

std::unique_ptr<idem::KafkaConsumer> consumer_with(std::string id_field) {
    idem::kafka::Config config;
    config.set("bootstrap.servers", "127.0.0.1:9");  // never polled: never connects
    idem::KafkaConsumerOptions options({"payments"}, "fuzz");
    options.id_field = std::move(id_field);
    return std::make_unique<idem::KafkaConsumer>(
        std::move(config), std::move(options),
        [](const idem::Delivery&, const idem::KafkaMessage&) { return idem::Outcome{}; });
}

std::optional<std::string> last_header(const idem::KafkaMessage& m, const std::string& name) {
    std::optional<std::string> found;
    for (const auto& [key, value] : m.headers) {
        if (key == name) found = value;
    }
    return found;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    static const std::unique_ptr<idem::KafkaConsumer> by_header =
        consumer_with(idem::kafka::message_id_header);
    static const std::unique_ptr<idem::KafkaConsumer> by_offset = consumer_with("");

    FuzzedDataProvider in(data, size);
    idem::detail::KafkaItem item{idem::kafka::Message(nullptr), {}, {}, 0, 0, 1};
    idem::KafkaMessage& body = item.body;
    body.topic = in.ConsumeRandomLengthString(32);
    body.partition = in.ConsumeIntegral<std::int32_t>();
    body.offset = in.ConsumeIntegral<std::int64_t>();
    item.tries = in.ConsumeIntegral<std::uint32_t>();
    if (in.ConsumeBool()) {
        body.timestamp = std::chrono::system_clock::time_point(
            std::chrono::milliseconds(in.ConsumeIntegralInRange<std::int64_t>(0, 1LL << 42)));
    }
    const std::size_t headers = in.ConsumeIntegralInRange<std::size_t>(0, 12);
    for (std::size_t i = 0; i < headers; ++i) {
        std::string name = in.ConsumeBool() ? std::string(idem::kafka::message_id_header)
                                            : in.ConsumeRandomLengthString(20);
        body.headers.emplace_back(std::move(name), in.ConsumeRandomLengthString(700));
    }
    const std::string probe = in.ConsumeRemainingBytesAsString();

    const auto got = body.header(probe);
    const auto want = last_header(body, probe);
    IDEM_FUZZ_CHECK(got.has_value() == want.has_value() && (!got || *got == *want),
                    "header(name) is the last value of exactly that name");

    const idem::Delivery d = idem::detail::KafkaConsumerProbe::delivery_of(*by_header, item);
    const auto id = last_header(body, idem::kafka::message_id_header);
    IDEM_FUZZ_CHECK(d.message_id == id.value_or(""), "the id is the id header's last value");
    IDEM_FUZZ_CHECK(
        d.delivery_count.value() == item.tries && d.counted_by == idem::DeliveryCounter::store,
        "the consumer's tries, counted by the store");
    IDEM_FUZZ_CHECK(d.enqueued_at == body.timestamp, "the record's time");
    const bool usable = !d.message_id.empty() && d.message_id.size() <= idem::max_message_id_bytes;
    IDEM_FUZZ_CHECK(idem::unclaimable_reason(d).has_value() == !usable,
                    "an empty or over-long id is refused, any other is claimed");

    const idem::Delivery o = idem::detail::KafkaConsumerProbe::delivery_of(*by_offset, item);
    IDEM_FUZZ_CHECK(
        o.message_id == fmt::format("{}/{}/{}", body.topic, body.partition, body.offset),
        "without id_field the id is <topic>/<partition>/<offset>");
    return 0;
}
