// The Redis store's dead letters as read back (idem/store/redis/admin.hpp: dead_letter_of(), the
// decoder of one XRANGE entry of a dead-letter stream, and written_before(), their order). The
// input is a hostile entry: any shape of reply (nested arrays, integers, nil) with any fields,
// known names among them, and any values. Contract: decoding never throws and never overflows
// (a created_at of any digits); a field the commit script writes comes back as the last value
// given for it; an entry that is not [id, [fields]] is nothing; the letters sort oldest first by
// a strict weak order.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_check.hpp"
#include "idem/store/redis/admin.hpp"

namespace {

using idem::redis::Reply;

Reply any_reply(FuzzedDataProvider& in, int depth) {
    Reply r;
    switch (in.ConsumeIntegralInRange<int>(0, depth > 0 ? 3 : 2)) {
        case 0:
            r.type = Reply::Type::string;
            r.str = in.ConsumeRandomLengthString(64);
            break;
        case 1:
            r.type = Reply::Type::integer;
            r.integer = in.ConsumeIntegral<long long>();
            break;
        case 2:
            r.type = Reply::Type::nil;
            break;
        default: {
            r.type = Reply::Type::array;
            const int n = in.ConsumeIntegralInRange<int>(0, 4);
            for (int i = 0; i < n; ++i)
                r.elements.push_back(any_reply(in, depth - 1));
        }
    }
    return r;
}

Reply text(std::string s) {
    Reply r;
    r.type = Reply::Type::string;
    r.str = std::move(s);
    return r;
}

/// An entry as XRANGE answers it: [id, [name, value, ...]], names mostly the script's.
Reply entry(FuzzedDataProvider& in) {
    static const char* const names[] = {"scope",   "id",         "delivery_count", "reason",
                                        "payload", "created_at", "order_us"};
    Reply fields;
    fields.type = Reply::Type::array;
    const int n = in.ConsumeIntegralInRange<int>(0, 16);
    for (int i = 0; i < n; ++i) {
        if (in.ConsumeBool()) {
            fields.elements.push_back(text(names[in.ConsumeIntegralInRange<int>(0, 6)]));
        } else {
            fields.elements.push_back(any_reply(in, 1));
        }
        fields.elements.push_back(in.ConsumeBool() ? text(in.ConsumeRandomLengthString(40))
                                                   : any_reply(in, 1));
    }
    Reply e;
    e.type = Reply::Type::array;
    e.elements.push_back(text(in.ConsumeRandomLengthString(24)));
    e.elements.push_back(std::move(fields));
    return e;
}

/// The last value written for @p name, as dead_letter_of() should read it.
const std::string* last(const Reply& entry, const std::string& name) {
    const std::string* found = nullptr;
    const auto& fields = entry.elements[1].elements;
    for (std::size_t i = 0; i + 1 < fields.size(); i += 2) {
        if (fields[i].str == name) found = &fields[i + 1].str;
    }
    return found;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    FuzzedDataProvider in(data, size);
    std::vector<idem::redis::StoredDeadLetter> letters;
    while (in.remaining_bytes() > 0 && letters.size() < 32) {
        const bool shaped = in.ConsumeBool();
        const Reply e = shaped ? entry(in) : any_reply(in, 3);
        const auto letter = idem::redis::dead_letter_of(e);
        IDEM_FUZZ_CHECK(letter.has_value() == (e.elements.size() >= 2),
                        "an entry is a letter exactly when it has an id and fields");
        if (!letter) continue;
        if (shaped) {
            const auto& l = letter->letter;
            const std::string* v = nullptr;
            if ((v = last(e, "scope"))) IDEM_FUZZ_CHECK(l.scope == *v, "scope");
            if ((v = last(e, "id"))) IDEM_FUZZ_CHECK(l.message_id == *v, "id");
            if ((v = last(e, "reason"))) IDEM_FUZZ_CHECK(l.reason == *v, "reason");
            if ((v = last(e, "payload"))) IDEM_FUZZ_CHECK(l.payload == *v, "payload");
            if ((v = last(e, "order_us"))) IDEM_FUZZ_CHECK(letter->order == *v, "order_us");
            if ((v = last(e, "created_at"))) {
                IDEM_FUZZ_CHECK(l.created_at == idem::from_unix_ms(idem::redis::parse_int(*v)),
                                "created_at");
            }
        }
        letters.push_back(*letter);
    }
    for (const auto& a : letters) {
        IDEM_FUZZ_CHECK(!idem::redis::written_before(a, a), "the order is irreflexive");
    }
    std::sort(letters.begin(), letters.end(), idem::redis::written_before);
    IDEM_FUZZ_CHECK(std::is_sorted(letters.begin(), letters.end(), idem::redis::written_before),
                    "oldest first");
    return 0;
}
