#include "idem/detail/sha256.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <string>

namespace {

using idem::detail::Sha256;
using idem::detail::sha256_hex;
using idem::detail::to_hex;

// 'a', 'b', ... 'z', 'a', ... of the given length; references computed with sha256sum.
std::string alphabet_run(std::size_t n) {
    std::string s;
    for (std::size_t i = 0; i < n; ++i)
        s.push_back(static_cast<char>('a' + i % 26));
    return s;
}

TEST(Sha256, NistEmpty) {
    EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(Sha256, NistAbc) {
    EXPECT_EQ(sha256_hex("abc"),
              "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Sha256, Nist448Bits) {
    EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
              "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST(Sha256, Nist896Bits) {
    const std::string message =
        "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmno"
        "ijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu";
    ASSERT_EQ(message.size(), 112u);
    EXPECT_EQ(sha256_hex(message),
              "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
}

constexpr const char* million_a_digest =
    "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0";

TEST(Sha256, NistMillionA) {
    EXPECT_EQ(sha256_hex(std::string(1000000, 'a')), million_a_digest);
}

TEST(Sha256, MillionAInUnevenChunks) {
    const std::string all(1000000, 'a');
    Sha256 h;
    std::size_t fed = 0;
    // Chunk sizes straddle the 64-byte block in every way: 0, 1, under, exactly, over, many.
    const std::size_t sizes[] = {1, 0, 63, 64, 65, 7, 127, 128, 129, 55, 56, 1000, 3};
    for (std::size_t i = 0; fed < all.size(); ++i) {
        std::size_t n = sizes[i % (sizeof(sizes) / sizeof(sizes[0]))];
        if (n > all.size() - fed) n = all.size() - fed;
        h.update(all.data() + fed, n);
        fed += n;
    }
    EXPECT_EQ(to_hex(h.finish()), million_a_digest);
}

TEST(Sha256, ByteAtATime) {
    const std::string message = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    Sha256 h;
    for (const char c : message)
        h.update(&c, 1);
    EXPECT_EQ(to_hex(h.finish()),
              "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST(Sha256, FinishResetsForTheNextMessage) {
    Sha256 h;
    h.update("something else entirely");
    (void)h.finish();
    h.update("ab");
    h.update("c");
    EXPECT_EQ(to_hex(h.finish()),
              "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

// Lengths around the padding boundary: 55 fits the length in one block, 56..63 need a second.
TEST(Sha256, PaddingBoundaries) {
    EXPECT_EQ(sha256_hex(alphabet_run(55)),
              "595615dbe4f0f407ae397d08b4c2cb870cb9b0e11937416f950c5160acf9c005");
    EXPECT_EQ(sha256_hex(alphabet_run(56)),
              "784f623b787495078e93ff28a25b581df0584055a7e71d8cd90c454716b92f51");
    EXPECT_EQ(sha256_hex(alphabet_run(63)),
              "5ca3e1ef5207490eac01a795e5cc94d59582a5118bf9534665c8668d87aa647c");
    EXPECT_EQ(sha256_hex(alphabet_run(64)),
              "2fcd5a0d60e4c941381fcc4e00a4bf8be422c3ddfafb93c809e8d1e2bfffae8e");
    EXPECT_EQ(sha256_hex(alphabet_run(65)),
              "1b3cd1877ab2f2f19f7be001722554f336cb799df0329de0bb4c118dc6abc06d");
}

TEST(Sha256, BinaryBytes) {
    // printf 'a\x00b"\xff' | sha256sum
    EXPECT_EQ(sha256_hex(std::string("a\0b\"\xff", 5)),
              "f433fddf930336861748401c0d408d71d131a0f0eaa4fa5b3df314815183760f");
}

}  // namespace
