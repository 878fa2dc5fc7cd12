// What the Redis client reads from a server (idem/redis/reply.hpp and its readers): the bytes go
// through hiredis' reply reader (redisReader, as Connection::read_reply() gets them) and
// copy_reply(), then through the pure readers of a reply: parse_int(), the stream entry of an
// XREADGROUP / XCLAIM reply and the time its id says, a commit script's verdict, a claim's
// recorded outcome, READONLY and ROLE. Contract: a reply copied out is the reply hiredis read
// (types, bytes, integers, elements, recursively); no reader throws anything but store_error (a
// commit verdict naming a claim that is not there) or overflows.
//
// hiredis 0.14 allocates an array's element pointers when it reads the array's header, before
// its elements arrive; a header over the input's size cannot be a complete reply here, so such
// an input is skipped (it would only measure calloc). Deeper than hiredis' 7 levels is its
// protocol error.
#include <hiredis/hiredis.h>
#include <hiredis/read.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_check.hpp"
#include "idem/broker/redis_streams.hpp"
#include "idem/error.hpp"
#include "idem/redis/reply.hpp"
#include "idem/redis/sentinel.hpp"
#include "idem/store/redis/commit.hpp"
#include "idem/store/redis/context.hpp"

namespace {

using idem::redis::Reply;

bool same(const redisReply* raw, const Reply& copy) {
    switch (raw->type) {
        case REDIS_REPLY_STRING:
        case REDIS_REPLY_STATUS:
        case REDIS_REPLY_ERROR: {
            const Reply::Type want = raw->type == REDIS_REPLY_STRING   ? Reply::Type::string
                                     : raw->type == REDIS_REPLY_STATUS ? Reply::Type::status
                                                                       : Reply::Type::error;
            return copy.type == want && copy.str == std::string_view(raw->str, raw->len) &&
                   copy.elements.empty();
        }
        case REDIS_REPLY_INTEGER:
            return copy.type == Reply::Type::integer && copy.integer == raw->integer &&
                   copy.text() == std::to_string(raw->integer);
        case REDIS_REPLY_ARRAY:
            if (copy.type != Reply::Type::array || copy.elements.size() != raw->elements) {
                return false;
            }
            for (std::size_t i = 0; i < raw->elements; ++i) {
                if (!same(raw->element[i], copy.elements[i])) return false;
            }
            return true;
        default:
            return copy.is_nil();
    }
}

/// A well-formed decimal (what the server writes for a number) reads back as itself.
void check_parse_int(const std::string& text) {
    const std::int64_t value = idem::redis::parse_int(text);
    const bool negative = !text.empty() && text[0] == '-';
    const std::string digits = text.substr(negative ? 1 : 0);
    if (digits.empty() || digits.size() > 18 ||
        digits.find_first_not_of("0123456789") != std::string::npos) {
        return;
    }
    const std::size_t first = digits.find_first_not_of('0');
    const std::string canonical = first == std::string::npos ? "0" : digits.substr(first);
    const std::string expected = negative && canonical != "0" ? "-" + canonical : canonical;
    IDEM_FUZZ_CHECK(std::to_string(value) == expected, "a decimal reads back as itself");
}

void read_reply(const Reply& reply, int depth) {
    check_parse_int(reply.str);
    (void)idem::redis::disposition_from(reply.str);
    (void)idem::redis::is_readonly_error(reply);
    (void)idem::redis::is_master_role(reply);
    (void)idem::detail::stream_enqueued_at(reply.str);
    if (auto entry = idem::detail::parse_stream_entry(reply, "s")) {
        IDEM_FUZZ_CHECK(entry->id == reply.elements[0].str, "an entry's id");
        IDEM_FUZZ_CHECK(entry->fields.size() == reply.elements[1].elements.size() / 2,
                        "an entry's fields, in pairs");
    }
    // A commit script's reply, read against a transaction of two claims.
    const std::vector<idem::redis::HeldClaim> claims(2);
    try {
        const auto verdict = idem::redis::read_commit_reply(
            reply,
            [&](std::size_t i) -> const idem::redis::HeldClaim& {
                if (i >= claims.size()) throw idem::store_error("no such claim");
                return claims[i];
            },
            "nothing");
        IDEM_FUZZ_CHECK((verdict.kind == idem::redis::CommitVerdict::Kind::committed) ==
                            verdict.problem.empty(),
                        "a verdict says why unless committed");
    } catch (const idem::store_error&) {
    }
    if (depth < 8) {
        for (const Reply& element : reply.elements)
            read_reply(element, depth + 1);
    }
}

/// Whether an array header declares more elements than @p size bytes could hold.
bool oversized_array(const char* data, std::size_t size) {
    for (std::size_t i = 0; i < size; ++i) {
        if (data[i] != '*') continue;
        const std::int64_t n = idem::redis::parse_int(std::string_view(data + i + 1, size - i - 1));
        if (n > static_cast<std::int64_t>(size)) return true;
    }
    return false;
}

struct ReaderFree {
    void operator()(redisReader* r) const noexcept { redisReaderFree(r); }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const auto* bytes = reinterpret_cast<const char*>(data);
    if (oversized_array(bytes, size)) return 0;
    std::unique_ptr<redisReader, ReaderFree> reader(redisReaderCreate());
    // Fed in two pieces, as replies arrive from a socket.
    const std::size_t cut = size == 0 ? 0 : data[0] % (size + 1);
    if (redisReaderFeed(reader.get(), bytes, cut) != REDIS_OK) return 0;
    if (redisReaderFeed(reader.get(), bytes + cut, size - cut) != REDIS_OK) return 0;
    for (;;) {
        void* raw = nullptr;
        if (redisReaderGetReply(reader.get(), &raw) != REDIS_OK || raw == nullptr) break;
        const Reply copy = idem::redis::copy_reply(static_cast<redisReply*>(raw));
        const bool copied = same(static_cast<redisReply*>(raw), copy);
        freeReplyObject(raw);
        IDEM_FUZZ_CHECK(copied, "copy_reply() copies the reply hiredis read");
        read_reply(copy, 0);
    }
    return 0;
}
