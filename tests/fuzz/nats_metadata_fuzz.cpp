// A JetStream message's metadata and headers, and the Delivery a JetStreamConsumer makes of
// them. The input is a hostile ack subject
// `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>` (tokens of any bytes, or
// any string) and header block. The subject is parsed as natsMsg_GetMetaData() parses it
// (cnats' js_getMetaData(); natsMsg_GetMetaData() itself wants a message bound to a
// subscription, i.e. a server) and read by nats::detail::metadata_of() (what nats::Message
// keeps); the headers are parsed by cnats from a message made as a received one is
// (natsMsg_create()) and read by nats::detail::headers_of() and first_header(); then
// detail::jetstream_delivery() (idem/broker/nats_jetstream.hpp) makes the Delivery. Contract:
// headers are read or refused with nats::error (nothing else); a well-formed subject's numbers
// are read exactly; the Delivery never throws: its id is the id header's first value or
// `<stream>:<sseq>`, its count the delivered token (0, dead-lettered as malformed, past
// UINT32_MAX).
//
// js_getMetaData() and natsMsg_create() are exported by cnats 3 but not declared in nats.h:
// declared here with the signatures of its js.h and msg.h.
#include <fuzzer/FuzzedDataProvider.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "fuzz_check.hpp"
#include "idem/broker/nats_jetstream.hpp"
#include "idem/nats/message.hpp"

extern "C" natsStatus natsMsg_create(natsMsg** newMsg, const char* subject, int subjLen,
                                     const char* reply, int replyLen, const char* buf, int bufLen,
                                     int hdrLen);
extern "C" natsStatus js_getMetaData(const char* reply, char** domain, char** stream,
                                     char** consumer, std::uint64_t* numDelivered,
                                     std::uint64_t* sseq, std::uint64_t* dseq, std::int64_t* tm,
                                     std::uint64_t* numPending, int asked);

namespace {

/// A token of decimal digits, as the server writes it: its value, when it has 1-18 digits.
std::optional<std::uint64_t> number(const std::string& token) {
    if (token.empty() || token.size() > 18) return std::nullopt;
    std::uint64_t value = 0;
    for (const char c : token) {
        if (c < '0' || c > '9') return std::nullopt;
        value = value * 10 + static_cast<std::uint64_t>(c - '0');
    }
    return value;
}

std::string token(FuzzedDataProvider& in) {
    switch (in.ConsumeIntegralInRange<int>(0, 3)) {
        case 0:
            return std::to_string(in.ConsumeIntegral<std::uint64_t>());
        case 1:
            return std::to_string(in.ConsumeIntegralInRange<std::uint32_t>(0, 100));
        default:
            return in.ConsumeRandomLengthString(24);
    }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    nats_Open(-1);
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    FuzzedDataProvider in(data, size);
    std::vector<std::string> tokens;
    std::string reply;
    if (in.ConsumeBool()) {  // an ack subject of 9 tokens (some of them numbers)
        tokens = {"$JS", "ACK"};
        for (int i = 0; i < 7; ++i)
            tokens.push_back(token(in));
        for (std::size_t i = 0; i < tokens.size(); ++i)
            reply += (i ? "." : "") + tokens[i];
    } else {
        reply = in.ConsumeRandomLengthString(200);
    }
    std::string headers;
    if (in.ConsumeBool()) {
        headers = "NATS/1.0\r\n";
        const int lines = in.ConsumeIntegralInRange<int>(0, 4);
        for (int i = 0; i < lines; ++i) {
            headers +=
                in.ConsumeBool() ? std::string("Nats-Msg-Id") : in.ConsumeRandomLengthString(16);
            headers += ": " + in.ConsumeRandomLengthString(40) + "\r\n";
        }
        headers += "\r\n";
    } else if (in.ConsumeBool()) {
        headers = in.ConsumeRandomLengthString(100);
    }
    const std::string buffer = headers + in.ConsumeRemainingBytesAsString();

    // The metadata, as natsMsg_GetMetaData() reads it.
    static constexpr std::string_view prefix = "$JS.ACK.";
    if (reply.compare(0, prefix.size(), prefix) != 0) return 0;
    std::unique_ptr<jsMsgMetaData, void (*)(jsMsgMetaData*)> parsed(
        static_cast<jsMsgMetaData*>(std::calloc(1, sizeof(jsMsgMetaData))), jsMsgMetaData_Destroy);
    jsMsgMetaData& m = *parsed;
    if (js_getMetaData(reply.c_str() + prefix.size(), &m.Domain, &m.Stream, &m.Consumer,
                       &m.NumDelivered, &m.Sequence.Stream, &m.Sequence.Consumer, &m.Timestamp,
                       &m.NumPending, 8) != NATS_OK) {
        return 0;
    }
    const idem::nats::Metadata meta = idem::nats::detail::metadata_of(m);
    // A subject of 9 tokens, its numbers well formed: read exactly.
    if (tokens.size() == 9 && reply.find('\0') == std::string::npos) {
        const auto delivered = number(tokens[4]), sseq = number(tokens[5]),
                   cseq = number(tokens[6]), ts = number(tokens[7]), pending = number(tokens[8]);
        bool plain = true;
        for (std::size_t i = 2; i < 9; ++i)
            plain = plain && tokens[i].find('.') == std::string::npos;
        if (plain && delivered && sseq && cseq && ts && pending) {
            IDEM_FUZZ_CHECK(meta.stream == tokens[2] && meta.consumer == tokens[3],
                            "stream and consumer");
            IDEM_FUZZ_CHECK(meta.num_delivered == *delivered && meta.stream_sequence == *sseq &&
                                meta.consumer_sequence == *cseq && meta.num_pending == *pending &&
                                meta.timestamp_ns == static_cast<std::int64_t>(*ts),
                            "the numbers of the subject");
        }
    }

    // The headers, as cnats parses a received message's and nats::Message reads them.
    natsMsg* raw = nullptr;
    if (natsMsg_create(&raw, "orders", 6, reply.data(), static_cast<int>(reply.size()),
                       buffer.data(), static_cast<int>(buffer.size()),
                       static_cast<int>(headers.size())) != NATS_OK) {
        return 0;
    }
    const idem::nats::detail::MsgPtr msg(raw);
    idem::nats::Headers read;
    try {
        read = idem::nats::detail::headers_of(msg.get());
    } catch (const idem::nats::error&) {
        return 0;  // headers cnats refuses
    }
    const std::optional<std::string_view> id =
        idem::nats::detail::first_header(read, "Nats-Msg-Id");
    for (const bool sequence : {true, false}) {
        const idem::Delivery d =
            idem::detail::jetstream_delivery(meta, id, "Nats-Msg-Id", sequence);
        if (id) {
            IDEM_FUZZ_CHECK(d.message_id == *id, "the id header's value");
        } else if (sequence) {
            IDEM_FUZZ_CHECK(d.message_id == fmt::format("{}:{}", meta.stream, meta.stream_sequence),
                            "<stream>:<sequence>");
        } else {
            IDEM_FUZZ_CHECK(d.message_id.empty(), "no id: empty, dead-lettered as malformed");
        }
        IDEM_FUZZ_CHECK(
            d.delivery_count.value() ==
                (meta.num_delivered <= UINT32_MAX ? meta.num_delivered : std::uint64_t{0}),
            "the delivered count, 0 past UINT32_MAX");
    }
    const idem::Delivery by_sequence = idem::detail::jetstream_delivery(meta, id, "", false);
    IDEM_FUZZ_CHECK(
        by_sequence.message_id == fmt::format("{}:{}", meta.stream, meta.stream_sequence),
        "without id_field the id is <stream>:<sequence>");
    return 0;
}
