#pragma once
/// @file
/// @brief detail::append_json_bytes: raw bytes as a JSON string that is plain ASCII and maps
/// back to exactly those bytes (a stream entry's fields kept in a dead letter; the `idem`
/// command's JSON).

#include <string>
#include <string_view>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace detail {

/// A JSON string of raw bytes: every byte outside printable ASCII is \u00XX, so the text is
/// plain ASCII (safe in logs and text columns) and maps back to exactly the original bytes.
inline void append_json_bytes(std::string& out, std::string_view bytes) {
    static constexpr char hex[] = "0123456789abcdef";
    out += '"';
    for (char ch : bytes) {
        const auto c = static_cast<unsigned char>(ch);
        switch (c) {
            case '"':
                out += "\\\"";
                break;
            case '\\':
                out += "\\\\";
                break;
            case '\n':
                out += "\\n";
                break;
            case '\r':
                out += "\\r";
                break;
            case '\t':
                out += "\\t";
                break;
            default:
                if (c < 0x20 || c >= 0x7F) {
                    out += "\\u00";
                    out += hex[c >> 4];
                    out += hex[c & 0x0F];
                } else {
                    out += ch;
                }
        }
    }
    out += '"';
}

}  // namespace detail
IDEM_END_NAMESPACE
