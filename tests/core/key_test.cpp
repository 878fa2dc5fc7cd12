#include "idem/key.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "idem/delivery.hpp"
#include "idem/detail/sha256.hpp"
#include "idem/error.hpp"

namespace {

using idem::usage_error;

// The compile-time refusals, checked without a compile-fail build (see tests/compile_fail/).
enum class Color { red };
static_assert(idem::detail::is_key_part_v<std::string>);
static_assert(idem::detail::is_key_part_v<const std::string&>);
static_assert(idem::detail::is_key_part_v<std::string_view>);
static_assert(idem::detail::is_key_part_v<const char*>);
static_assert(idem::detail::is_key_part_v<char[8]>);
static_assert(idem::detail::is_key_part_v<int>);
static_assert(idem::detail::is_key_part_v<std::uint64_t>);
static_assert(idem::detail::is_key_part_v<short>);
static_assert(!idem::detail::is_key_part_v<idem::DeliveryCount>);
static_assert(!idem::detail::is_key_part_v<idem::Delivery>);
static_assert(!idem::detail::is_key_part_v<bool>);
static_assert(!idem::detail::is_key_part_v<char>);
static_assert(!idem::detail::is_key_part_v<unsigned char>);
static_assert(!idem::detail::is_key_part_v<char32_t>);
static_assert(!idem::detail::is_key_part_v<double>);
static_assert(!idem::detail::is_key_part_v<float>);
static_assert(!idem::detail::is_key_part_v<Color>);
static_assert(!idem::detail::is_key_part_v<std::nullptr_t>);
static_assert(!idem::detail::is_key_part_v<std::vector<int>>);

std::string message_of(const std::exception& e) {
    return e.what();
}

// --- examples and escaping ---------------------------------------------------------------

TEST(Key, Examples) {
    EXPECT_EQ(idem::key("capture", 8814), "capture-8814");
    EXPECT_EQ(idem::key("refund", "mugshop", 93), "refund-mugshop-93");
    EXPECT_EQ(idem::key("refund", std::string("mugshop"), std::string_view("eu"), 93u),
              "refund-mugshop-eu-93");
}

TEST(Key, IntegerTypes) {
    EXPECT_EQ(idem::key("p", static_cast<short>(7)), "p-7");
    EXPECT_EQ(idem::key("p", std::numeric_limits<std::uint64_t>::max()), "p-18446744073709551615");
    EXPECT_EQ(idem::key("p", std::numeric_limits<std::int64_t>::min()),
              "p-%2D9223372036854775808");  // the sign is escaped like any '-'
    EXPECT_EQ(idem::key("p", 0), "p-0");
    // An integer and its decimal text are the same id.
    EXPECT_EQ(idem::key("p", 42), idem::key("p", "42"));
}

TEST(Key, UnreservedBytesKept) {
    EXPECT_EQ(idem::key("A.z_9~", "Zz09._~"), "A.z_9~-Zz09._~");
}

TEST(Key, OtherBytesPercentEncodedUppercase) {
    EXPECT_EQ(idem::key("p", "a-b"), "p-a%2Db");
    EXPECT_EQ(idem::key("p", "50%"), "p-50%25");
    EXPECT_EQ(idem::key("p", "a b"), "p-a%20b");
    EXPECT_EQ(idem::key("p", std::string("a\0b", 3)), "p-a%00b");
    EXPECT_EQ(idem::key("p", "caf\xc3\xa9"), "p-caf%C3%A9");
    EXPECT_EQ(idem::key("p", "\xff/\"'"), "p-%FF%2F%22%27");
    EXPECT_EQ(idem::key("a-b", "c"), "a%2Db-c");  // the prefix is escaped too
}

TEST(Key, SeparatorIsUnambiguous) {
    EXPECT_NE(idem::key("p", "a-b", "c"), idem::key("p", "a", "b-c"));
    EXPECT_NE(idem::key("a-b", "c"), idem::key("a", "b-c"));
    EXPECT_NE(idem::key("p", "a%2Db"), idem::key("p", "a-b"));
    EXPECT_NE(idem::key("p", "a", "b"), idem::key("p", "a-b"));
}

// Random part lists drawn from an alphabet rich in separators and escape look-alikes: distinct
// lists must give distinct keys.
TEST(Key, NoCollisionsOverRandomPartLists) {
    std::mt19937 rng(20240611);  // fixed seed: a failure is reproducible
    const std::string alphabet("a-%2D0\0_~ .\xff", 12);
    auto random_part = [&] {
        std::string s(1 + rng() % 4, '\0');
        for (auto& c : s)
            c = alphabet[rng() % alphabet.size()];
        return s;
    };

    std::set<std::vector<std::string>> lists;
    std::set<std::string> keys;
    for (int i = 0; i < 50000; ++i) {
        std::vector<std::string> p;
        const std::size_t count = 2 + rng() % 3;  // the prefix and 1..3 parts
        for (std::size_t j = 0; j < count; ++j)
            p.push_back(random_part());
        std::string k;
        switch (count) {
            case 2:
                k = idem::key(p[0], p[1]);
                break;
            case 3:
                k = idem::key(p[0], p[1], p[2]);
                break;
            default:
                k = idem::key(p[0], p[1], p[2], p[3]);
                break;
        }
        lists.insert(p);
        keys.insert(k);
        ASSERT_EQ(keys.size(), lists.size()) << "collision at key " << k;
    }
    EXPECT_GT(lists.size(), 10000u);  // the generator really produced many distinct lists
}

// --- errors ------------------------------------------------------------------------------

TEST(Key, EmptyPrefixRefused) {
    EXPECT_THROW((void)idem::key("", 1), usage_error);
    try {
        (void)idem::key(std::string_view(), "x");
        FAIL();
    } catch (const usage_error& e) {
        EXPECT_NE(message_of(e).find("prefix"), std::string::npos) << e.what();
    }
}

TEST(Key, EmptyPartRefusedAndNamed) {
    try {
        (void)idem::key("refund", "mugshop", std::string(), 93);
        FAIL();
    } catch (const usage_error& e) {
        EXPECT_NE(message_of(e).find("part 2"), std::string::npos) << e.what();
        EXPECT_NE(message_of(e).find("empty"), std::string::npos) << e.what();
    }
    EXPECT_THROW((void)idem::key("p", ""), usage_error);
    EXPECT_THROW((void)idem::key("p", std::string_view()), usage_error);
}

TEST(Key, NullCStringRefused) {
    const char* missing = nullptr;
    try {
        (void)idem::key("p", 1, missing);
        FAIL();
    } catch (const usage_error& e) {
        EXPECT_NE(message_of(e).find("part 2"), std::string::npos) << e.what();
    }
}

// --- determinism and length ----------------------------------------------------------------

TEST(Key, Deterministic) {
    const std::string shop = "mug shop/eu";
    EXPECT_EQ(idem::key("refund", shop, 93), idem::key("refund", shop, 93));
    const std::string long_part(1000, '-');
    EXPECT_EQ(idem::key("refund", long_part), idem::key("refund", long_part));
    // Pinned, so a change of the algorithm is noticed: keys are stored by gateways.
    EXPECT_EQ(idem::key("refund", "mug shop/eu", 93), "refund-mug%20shop%2Feu-93");
}

TEST(Key, ExactlyAtTheLimitIsKeptWhole) {
    const std::string part(255 - 2, 'x');  // "p-" + 253
    const auto k = idem::key("p", part);
    EXPECT_EQ(k.size(), 255u);
    EXPECT_EQ(k, "p-" + part);
    const auto longer = idem::key("p", part + "x");
    EXPECT_LE(longer.size(), 255u);
    EXPECT_NE(longer, "p-" + part + "x");
}

TEST(Key, LongKeyKeepsReadablePrefixAndEndsWithDigest) {
    const std::string order(300, '7');
    const std::string full = "capture-" + order;
    const auto k = idem::key("capture", order);
    EXPECT_LE(k.size(), 255u);
    EXPECT_EQ(k.size(), 255u);  // nothing to step back over here, so the whole budget is used
    EXPECT_EQ(k.compare(0, 20, full, 0, 20), 0) << k;
    EXPECT_EQ(k.substr(k.size() - 64), idem::detail::sha256_hex(full));
    EXPECT_EQ(k.substr(k.size() - 66, 2), "--");
}

TEST(Key, LongKeysDifferingOnlyAtTheEndDiffer) {
    const std::string base(400, 'a');
    const auto k1 = idem::key("p", base + "1");
    const auto k2 = idem::key("p", base + "2");
    EXPECT_NE(k1, k2);
    EXPECT_EQ(k1.substr(0, 100), k2.substr(0, 100));  // the readable part is the same
}

// A shortened key never splits a %XX escape, for every cut position.
TEST(Key, LongKeyNeverSplitsAnEscape) {
    const std::string part = "x" + std::string(200, '-') + "y";
    const auto full = idem::key_with_limit(100000, "p", part);
    for (std::size_t limit = 80; limit < 120; ++limit) {
        const auto k = idem::key_with_limit(limit, "p", part);
        ASSERT_LE(k.size(), limit);
        const auto readable = k.substr(0, k.size() - 66);
        EXPECT_EQ(full.compare(0, readable.size(), readable), 0) << k;
        // "p-x" then whole %2D escapes; a '%' in the last two characters would be a split escape.
        EXPECT_EQ(readable.size() % 3, 0u) << "cut inside an escape: " << k;
        EXPECT_EQ(readable.find('%', readable.size() - 2), std::string::npos) << k;
        EXPECT_EQ(k.substr(k.size() - 64), idem::detail::sha256_hex(full));
    }
}

TEST(Key, ShortenedKeyCannotEqualAKeyThatFit) {
    // An attacker-chosen last part equal to the digest still does not reproduce a long key.
    const std::string long_part(300, 'z');
    const auto shortened = idem::key("p", long_part);
    const auto digest = shortened.substr(shortened.size() - 64);
    const auto readable = shortened.substr(0, shortened.size() - 66);
    // readable is "p-zzz...": rebuild the same text as a key that fits.
    const auto forged = idem::key("p", readable.substr(2), digest);
    EXPECT_NE(forged, shortened);
}

TEST(Key, LimitBelow80Refused) {
    EXPECT_THROW((void)idem::key_with_limit(79, "p", 1), usage_error);
    EXPECT_THROW((void)idem::key_with_limit(0, "p", 1), usage_error);
    EXPECT_EQ(idem::key_with_limit(80, "p", 1), "p-1");
    const auto k = idem::key_with_limit(80, "p", std::string(500, 'q'));
    EXPECT_LE(k.size(), 80u);
    EXPECT_EQ(k.substr(0, 5), "p-qqq");
}

TEST(Key, LargerLimitKeepsLongKeysWhole) {
    const std::string part(300, 'k');
    EXPECT_EQ(idem::key_with_limit(1000, "p", part), "p-" + part);
}

// --- child ids -----------------------------------------------------------------------------

TEST(ChildId, DeterministicAndReadable) {
    EXPECT_EQ(idem::child_id("msg42", "send-receipt"), idem::child_id("msg42", "send-receipt"));
    EXPECT_EQ(idem::child_id("msg42", "receipt"), "msg42-receipt");
    EXPECT_EQ(idem::child_id("msg42", 2), "msg42-2");
    EXPECT_EQ(idem::child_id("1700000000000-0", 1), "1700000000000%2D0-1");
}

TEST(ChildId, Injective) {
    EXPECT_NE(idem::child_id("a-b", "c"), idem::child_id("a", "b-c"));
    EXPECT_NE(idem::child_id("m", 1), idem::child_id("m", 2));
    EXPECT_NE(idem::child_id("m1", "x"), idem::child_id("m2", "x"));
    // A grandchild differs from a child with a composite step.
    EXPECT_NE(idem::child_id(idem::child_id("m", "a"), "b"), idem::child_id("m", "a-b"));

    std::set<std::string> ids;
    std::set<std::pair<std::string, std::string>> inputs;
    const std::string alphabet("a-%0\0", 5);
    std::mt19937 rng(7);
    for (int i = 0; i < 20000; ++i) {
        std::string parent(1 + rng() % 4, 'a'), step(1 + rng() % 4, 'a');
        for (auto& c : parent)
            c = alphabet[rng() % alphabet.size()];
        for (auto& c : step)
            c = alphabet[rng() % alphabet.size()];
        inputs.emplace(parent, step);
        ids.insert(idem::child_id(parent, step));
        ASSERT_EQ(ids.size(), inputs.size());
    }
}

TEST(ChildId, HostileBytesAreEscaped) {
    const std::string parent("id\0\"quoted\"\n\xff", 13);
    const auto id = idem::child_id(parent, "step");
    EXPECT_EQ(id, "id%00%22quoted%22%0A%FF-step");
    EXPECT_EQ(id.find('\0'), std::string::npos);
    EXPECT_NE(id, idem::child_id(std::string("id"), "step"));  // not cut at the NUL
}

TEST(ChildId, NeverLongerThanAMessageId) {
    const std::string parent(idem::max_message_id_bytes, '\xff');  // escapes to 1536 bytes
    const auto id = idem::child_id(parent, "step");
    EXPECT_LE(id.size(), idem::max_message_id_bytes);
    EXPECT_EQ(id.substr(0, 6), "%FF%FF");
    EXPECT_EQ(id, idem::child_id(parent, "step"));
    EXPECT_NE(id, idem::child_id(parent, "other"));
    const std::string plain(idem::max_message_id_bytes, 'm');
    EXPECT_LE(idem::child_id(plain, 1).size(), idem::max_message_id_bytes);
    EXPECT_NE(idem::child_id(plain, 1), idem::child_id(plain, 2));
    // A child id is itself a valid parent.
    idem::Delivery child{idem::child_id(plain, 1)};
    EXPECT_FALSE(idem::malformed_reason(child).has_value());
}

TEST(ChildId, EmptyRefused) {
    EXPECT_THROW((void)idem::child_id("", "step"), usage_error);
    EXPECT_THROW((void)idem::child_id("m", ""), usage_error);
    try {
        (void)idem::child_id("m", std::string());
        FAIL();
    } catch (const usage_error& e) {
        EXPECT_NE(message_of(e).find("step"), std::string::npos) << e.what();
    }
}

// --- attempt keys --------------------------------------------------------------------------

// Matches ^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$. Written out
// rather than with std::regex, whose libstdc++ 12 code trips -Wmaybe-uninitialized under ASan.
bool is_uuid4(std::string_view s) {
    if (s.size() != 36) return false;
    for (std::size_t i = 0; i < s.size(); ++i) {
        const char c = s[i];
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (c != '-') return false;
        } else if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) {
            return false;
        }
    }
    return s[14] == '4' && std::string_view("89ab").find(s[19]) != std::string_view::npos;
}

TEST(AttemptKey, CheckerRejectsNearMisses) {
    EXPECT_TRUE(is_uuid4("3f0c9a5e-6b1d-4c2a-9e47-0d8b5a1f2c63"));
    EXPECT_FALSE(is_uuid4("3f0c9a5e-6b1d-1c2a-9e47-0d8b5a1f2c63"));  // version 1
    EXPECT_FALSE(is_uuid4("3f0c9a5e-6b1d-4c2a-ce47-0d8b5a1f2c63"));  // variant 110x
    EXPECT_FALSE(is_uuid4("3F0C9A5E-6B1D-4C2A-9E47-0D8B5A1F2C63"));  // uppercase
    EXPECT_FALSE(is_uuid4("3f0c9a5e6b1d4c2a9e470d8b5a1f2c63"));      // no dashes
}

TEST(AttemptKey, Uuid4Format) {
    int variant_seen[4] = {0, 0, 0, 0};
    for (int i = 0; i < 2000; ++i) {
        const auto k = idem::new_attempt_key();
        ASSERT_TRUE(is_uuid4(k)) << k;
        ++variant_seen[std::string_view("89ab").find(k[19])];
    }
    // The two free variant bits are random too: each of 8, 9, a, b shows up.
    for (const int n : variant_seen)
        EXPECT_GT(n, 0);
}

TEST(AttemptKey, UniqueOver10000Calls) {
    std::unordered_set<std::string> seen;
    for (int i = 0; i < 10000; ++i)
        seen.insert(idem::new_attempt_key());
    EXPECT_EQ(seen.size(), 10000u);
}

}  // namespace
