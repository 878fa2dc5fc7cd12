#pragma once
/// @file
/// @brief Redis Cluster's hash slots: idem::redis::slot_count, crc16() and hash_slot() (a key's
/// slot, of its hash tag when it has one). Plain functions, no client. Link idem::redis.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace detail {
/// CRC16-CCITT (XMODEM) of each byte value: one lookup per byte instead of eight shifts (a
/// Cluster store hashes every queued write's key).
struct Crc16Table {
    std::uint16_t of[256];
};
constexpr Crc16Table make_crc16_table() noexcept {
    Crc16Table table{};
    for (unsigned byte = 0; byte < 256; ++byte) {
        auto crc = static_cast<std::uint16_t>(byte << 8);
        for (int bit = 0; bit < 8; ++bit) {
            crc = (crc & 0x8000) != 0 ? static_cast<std::uint16_t>((crc << 1) ^ 0x1021)
                                      : static_cast<std::uint16_t>(crc << 1);
        }
        table.of[byte] = crc;
    }
    return table;
}
inline constexpr Crc16Table crc16_table = make_crc16_table();
}  // namespace detail

namespace redis {

/// Hash slots of a Redis Cluster.
inline constexpr std::uint16_t slot_count = 16384;

/// CRC16-CCITT (XMODEM), the checksum Redis Cluster hashes keys with.
inline std::uint16_t crc16(std::string_view bytes) noexcept {
    std::uint16_t crc = 0;
    for (char c : bytes) {
        const auto index =
            static_cast<unsigned>(((crc >> 8) ^ static_cast<unsigned char>(c)) & 0xff);
        crc = static_cast<std::uint16_t>((crc << 8) ^ detail::crc16_table.of[index]);
    }
    return crc;
}

/// The hash slot of @p key: of its hash tag (the text between the first `{` and the next `}`,
/// when not empty), else of the whole key.
inline std::uint16_t hash_slot(std::string_view key) noexcept {
    const std::size_t open = key.find('{');
    if (open != std::string_view::npos) {
        const std::size_t close = key.find('}', open + 1);
        if (close != std::string_view::npos && close > open + 1) {
            key = key.substr(open + 1, close - open - 1);
        }
    }
    return static_cast<std::uint16_t>(crc16(key) % slot_count);
}

}  // namespace redis
IDEM_END_NAMESPACE
