// The Redis claim record (idem/store/redis/record.hpp) from hostile bytes: what find_claim(),
// attempts() and purge read back from a key. Two inputs:
//   * any bytes as a stored value: Record::decode() answers a record or nothing, never throws;
//     a decoded record encodes back to a value that decodes to the same record; its `~<ms>`
//     times resolve without overflow;
//   * a record as a claim writes it (new_head() + fields() with a hostile fingerprint, scope and
//     id): it decodes to exactly those fields.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "fuzz_check.hpp"
#include "idem/store/redis/record.hpp"

namespace {

using idem::redis::Record;

bool same(const Record& a, const Record& b) {
    return a.state == b.state && a.token == b.token && a.outcome == b.outcome &&
           a.attempts == b.attempts && a.claimed_at == b.claimed_at && a.leased_at == b.leased_at &&
           a.lease_ms == b.lease_ms && a.fingerprint == b.fingerprint && a.scope == b.scope &&
           a.id == b.id && a.reason == b.reason && a.times_before_expiry == b.times_before_expiry;
}

void stored_value(std::string_view value, std::int64_t expiry_ms) {
    std::optional<Record> record = Record::decode(value);
    if (!record) return;
    IDEM_FUZZ_CHECK(!record->state.empty(), "a decoded record has a state");
    Record resolved = *record;
    resolved.resolve(expiry_ms);  // PEXPIRETIME's answer: must not overflow
    IDEM_FUZZ_CHECK(!resolved.times_before_expiry, "resolve() turns `~<ms>` into times");
    (void)resolved.lease_until();
    // What a takeover writes back (times as numbers) reads back the same.
    const std::optional<Record> again = Record::decode(resolved.encode());
    IDEM_FUZZ_CHECK(again.has_value(), "an encoded record decodes");
    IDEM_FUZZ_CHECK(same(*again, resolved), "decode(encode(record)) is the record");
}

void written_claim(FuzzedDataProvider& in) {
    static const char* const states[] = {"leased", "done", "free"};
    const char* state = states[in.ConsumeIntegralInRange<int>(0, 2)];
    const std::string token = in.ConsumeBool() ? idem::redis::new_lease_token() : std::string();
    const bool server_now = in.ConsumeBool();
    const long long now = in.ConsumeIntegral<std::int64_t>();
    const long long retention = in.ConsumeIntegral<std::int64_t>();
    const long long lease = in.ConsumeIntegral<std::int64_t>();
    const std::string fingerprint = in.ConsumeRandomLengthString(300);
    const std::string scope = in.ConsumeRandomLengthString(300);
    const std::string id = in.ConsumeRandomLengthString(600);
    const std::string now_text = server_now ? std::string() : std::to_string(now);
    const std::string value = Record::new_head(state, token, "", now_text, retention, lease) +
                              Record::fields(fingerprint, scope, id);
    const std::optional<Record> record = Record::decode(value);
    IDEM_FUZZ_CHECK(record.has_value(), "a record a claim writes decodes");
    IDEM_FUZZ_CHECK(record->state == state && record->token == token, "state and token");
    IDEM_FUZZ_CHECK(record->fingerprint == fingerprint && record->scope == scope &&
                        record->id == id && record->reason.empty(),
                    "a hostile fingerprint, scope or id comes back intact");
    IDEM_FUZZ_CHECK(record->attempts == 1 && record->lease_ms == lease, "attempts and lease");
    if (server_now) {
        IDEM_FUZZ_CHECK(record->times_before_expiry == retention, "`~<retention>` times");
    } else {
        IDEM_FUZZ_CHECK(record->claimed_at == now && record->leased_at == now, "times");
    }
    stored_value(value, in.ConsumeIntegral<std::int64_t>());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    if (size == 0) return 0;
    // The first byte picks the input: odd, a written claim; even, the rest as a stored value.
    if ((data[0] & 1) != 0) {
        FuzzedDataProvider in(data + 1, size - 1);
        written_claim(in);
    } else {
        const std::string_view value(reinterpret_cast<const char*>(data) + 1, size - 1);
        stored_value(value, 1'700'000'000'000);
        stored_value(value, std::numeric_limits<std::int64_t>::max());
        stored_value(value, std::numeric_limits<std::int64_t>::min());
    }
    return 0;
}
