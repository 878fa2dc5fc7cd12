#pragma once
/// @file
/// @brief A small SHA-256 (FIPS 180-4) used to shorten over-long keys and message ids.
///
/// Kept dependency-free so the core needs no crypto library; it is not constant-time and is
/// not meant for secrets, only for a stable, collision-resistant digest.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace detail {

/// @brief Incremental SHA-256: feed bytes with update(), read the digest with finish().
///
/// @code
/// idem::detail::Sha256 h;
/// h.update("ab");
/// h.update("c");
/// auto digest = h.finish();  // SHA-256("abc"); h is ready for a new message
/// @endcode
class Sha256 {
  public:
    using digest_type = std::array<std::uint8_t, 32>;

    Sha256() noexcept { reset(); }

    /// @brief Starts a new message, discarding anything fed so far.
    void reset() noexcept {
        state_ = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                  0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
        buffered_ = 0;
        total_bytes_ = 0;
    }

    /// @brief Appends @p size bytes at @p data to the message.
    void update(const void* data, std::size_t size) noexcept {
        const auto* in = static_cast<const std::uint8_t*>(data);
        total_bytes_ += size;
        // Top up a partly filled block first; whole blocks then go straight from the input.
        if (buffered_ != 0) {
            const std::size_t take = size < 64 - buffered_ ? size : 64 - buffered_;
            copy(buffer_.data() + buffered_, in, take);
            buffered_ += take;
            in += take;
            size -= take;
            if (buffered_ < 64) return;
            compress(buffer_.data());
            buffered_ = 0;
        }
        for (; size >= 64; in += 64, size -= 64)
            compress(in);
        copy(buffer_.data(), in, size);
        buffered_ = size;
    }

    /// @brief Appends the bytes of @p bytes (embedded NULs included).
    void update(std::string_view bytes) noexcept { update(bytes.data(), bytes.size()); }

    /// @brief Pads, returns the digest of everything fed since the last reset, and resets.
    [[nodiscard]] digest_type finish() noexcept {
        // The length field counts bits modulo 2^64, as the standard specifies.
        const std::uint64_t bit_length = static_cast<std::uint64_t>(total_bytes_) * 8u;
        buffer_[buffered_++] = 0x80;
        if (buffered_ > 56) {
            fill_zero(buffered_, 64);
            compress(buffer_.data());
            buffered_ = 0;
        }
        fill_zero(buffered_, 56);
        for (int i = 0; i < 8; ++i) {
            buffer_[static_cast<std::size_t>(56 + i)] =
                static_cast<std::uint8_t>(bit_length >> (56 - 8 * i));
        }
        compress(buffer_.data());

        digest_type out{};
        for (std::size_t i = 0; i < 8; ++i) {
            out[4 * i] = static_cast<std::uint8_t>(state_[i] >> 24);
            out[4 * i + 1] = static_cast<std::uint8_t>(state_[i] >> 16);
            out[4 * i + 2] = static_cast<std::uint8_t>(state_[i] >> 8);
            out[4 * i + 3] = static_cast<std::uint8_t>(state_[i]);
        }
        reset();
        return out;
    }

  private:
    static constexpr std::uint32_t rotr(std::uint32_t x, int n) noexcept {
        return (x >> n) | (x << (32 - n));
    }

    static void copy(std::uint8_t* to, const std::uint8_t* from, std::size_t n) noexcept {
        for (std::size_t i = 0; i < n; ++i)
            to[i] = from[i];
    }

    void fill_zero(std::size_t from, std::size_t to) noexcept {
        for (std::size_t i = from; i < to; ++i)
            buffer_[i] = 0;
    }

    void compress(const std::uint8_t* block) noexcept {
        static constexpr std::array<std::uint32_t, 64> k = {
            0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u,
            0x923f82a4u, 0xab1c5ed5u, 0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u,
            0x72be5d74u, 0x80deb1feu, 0x9bdc06a7u, 0xc19bf174u, 0xe49b69c1u, 0xefbe4786u,
            0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu, 0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau,
            0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u, 0xc6e00bf3u, 0xd5a79147u,
            0x06ca6351u, 0x14292967u, 0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu, 0x53380d13u,
            0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u, 0xa2bfe8a1u, 0xa81a664bu,
            0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u,
            0x19a4c116u, 0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au,
            0x5b9cca4fu, 0x682e6ff3u, 0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u,
            0x90befffau, 0xa4506cebu, 0xbef9a3f7u, 0xc67178f2u};

        std::array<std::uint32_t, 64> w{};
        for (std::size_t i = 0; i < 16; ++i) {
            w[i] = (static_cast<std::uint32_t>(block[4 * i]) << 24) |
                   (static_cast<std::uint32_t>(block[4 * i + 1]) << 16) |
                   (static_cast<std::uint32_t>(block[4 * i + 2]) << 8) |
                   static_cast<std::uint32_t>(block[4 * i + 3]);
        }
        for (std::size_t i = 16; i < 64; ++i) {
            const std::uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
            const std::uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }

        std::uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
        std::uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
        for (std::size_t i = 0; i < 64; ++i) {
            const std::uint32_t big_s1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
            const std::uint32_t choose = (e & f) ^ (~e & g);
            const std::uint32_t t1 = h + big_s1 + choose + k[i] + w[i];
            const std::uint32_t big_s0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
            const std::uint32_t majority = (a & b) ^ (a & c) ^ (b & c);
            const std::uint32_t t2 = big_s0 + majority;
            h = g;
            g = f;
            f = e;
            e = d + t1;
            d = c;
            c = b;
            b = a;
            a = t1 + t2;
        }
        state_[0] += a;
        state_[1] += b;
        state_[2] += c;
        state_[3] += d;
        state_[4] += e;
        state_[5] += f;
        state_[6] += g;
        state_[7] += h;
    }

    std::array<std::uint32_t, 8> state_{};
    std::array<std::uint8_t, 64> buffer_{};
    std::size_t buffered_ = 0;
    std::uint64_t total_bytes_ = 0;
};

/// @brief Lowercase hex of a digest (64 characters).
[[nodiscard]] inline std::string to_hex(const Sha256::digest_type& digest) {
    static constexpr char digits[] = "0123456789abcdef";
    std::string out(2 * digest.size(), '\0');
    for (std::size_t i = 0; i < digest.size(); ++i) {
        out[2 * i] = digits[digest[i] >> 4];
        out[2 * i + 1] = digits[digest[i] & 0x0f];
    }
    return out;
}

/// @brief SHA-256 of @p bytes as 64 lowercase hex characters.
/// @code
/// idem::detail::sha256_hex("abc");  // "ba7816bf...f20015ad"
/// @endcode
[[nodiscard]] inline std::string sha256_hex(std::string_view bytes) {
    Sha256 h;
    h.update(bytes);
    return to_hex(h.finish());
}

}  // namespace detail
IDEM_END_NAMESPACE
