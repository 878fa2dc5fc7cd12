// What a SQL store reads back from its tables (idem/sql/stored_outcome.hpp, sql/support.hpp,
// contract/time.hpp): the outcome text of idem_claims, and the integers of a claim or a dead
// letter row (a time in Unix milliseconds, a count). Contract:
//   * stored_disposition() answers a Disposition for exactly the names idem writes (and
//     'claimed': in_progress); anything else throws store_error and nothing else; the name of
//     the answer is the text read;
//   * from_unix_ms() of any int64 is defined (no overflow), keeps the order of its inputs and is
//     undone by to_unix_ms() within the clock's range;
//   * to_count() clamps to [0, UINT32_MAX].
#include <fuzzer/FuzzedDataProvider.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "fuzz_check.hpp"
#include "idem/contract/time.hpp"
#include "idem/error.hpp"
#include "idem/sql/stored_outcome.hpp"
#include "idem/sql/support.hpp"

namespace {

void outcome_text(const std::string& text) {
    bool known = text == "claimed";
    idem::Disposition named = idem::Disposition::processed;
    known = known || idem::from_string(text, named);
    try {
        const idem::Disposition d = idem::sql::stored_disposition(text, "fuzz");
        IDEM_FUZZ_CHECK(known, "only a name idem writes is a stored outcome");
        if (text == "claimed") {
            IDEM_FUZZ_CHECK(d == idem::Disposition::in_progress, "'claimed' is in_progress");
        } else {
            IDEM_FUZZ_CHECK(idem::to_string(d) == text, "the outcome is the one named");
        }
        const idem::ClaimResult claim = idem::sql::stored_duplicate(text, "fp", "fuzz");
        IDEM_FUZZ_CHECK(claim.status == idem::ClaimStatus::duplicate && claim.recorded == d &&
                            claim.fingerprint == "fp",
                        "a stored duplicate carries the outcome and the fingerprint");
    } catch (const idem::store_error&) {
        IDEM_FUZZ_CHECK(!known, "a name idem writes is never refused");
    }
}

void row_integers(std::int64_t a, std::int64_t b) {
    using std::chrono::system_clock;
    const system_clock::time_point ta = idem::from_unix_ms(a);
    const system_clock::time_point tb = idem::from_unix_ms(b);
    if (a <= b) IDEM_FUZZ_CHECK(ta <= tb, "from_unix_ms keeps the order");
    constexpr auto max_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(system_clock::duration::max())
            .count();
    constexpr auto min_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(system_clock::duration::min())
            .count();
    if (a > min_ms && a < max_ms) {
        IDEM_FUZZ_CHECK(idem::to_unix_ms(ta) == a, "to_unix_ms(from_unix_ms(ms)) is ms");
    }
    const std::uint32_t count = idem::sql::to_count(a);
    if (a < 0) IDEM_FUZZ_CHECK(count == 0, "a negative count reads as 0");
    if (a >= 0 && a <= std::numeric_limits<std::uint32_t>::max()) {
        IDEM_FUZZ_CHECK(count == static_cast<std::uint32_t>(a), "a count in range is kept");
    }
    if (a > std::numeric_limits<std::uint32_t>::max()) {
        IDEM_FUZZ_CHECK(count == std::numeric_limits<std::uint32_t>::max(), "clamped");
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    FuzzedDataProvider in(data, size);
    const std::int64_t a = in.ConsumeIntegral<std::int64_t>();
    const std::int64_t b = in.ConsumeIntegral<std::int64_t>();
    row_integers(a, b);
    row_integers(b, a);
    outcome_text(in.ConsumeRemainingBytesAsString());
    return 0;
}
