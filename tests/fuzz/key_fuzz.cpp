// Key derivation from hostile ids (idem/key.hpp, effects/gateway_key.hpp): key(),
// key_with_limit() and child_id() of any bytes. Contract:
//   * usage_error (and nothing else) exactly when the prefix, a string part or the parent id is
//     empty;
//   * deterministic: the same parts give the same key;
//   * within its bound (the limit, 255 for key(), max_message_id_bytes for child_id());
//   * only [A-Za-z0-9._~%-] in it;
//   * a key that fits is the escaped parts joined by '-': unescaping gives the parts back (so two
//     part lists never share a key); a longer one is a readable start of that text, "--" and the
//     SHA-256 of the whole of it;
//   * with_gateway_key() hands the observer exactly what key_of() returns.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_check.hpp"
#include "idem/detail/sha256.hpp"
#include "idem/effects/gateway_key.hpp"
#include "idem/error.hpp"
#include "idem/key.hpp"

namespace {

/// The escaped form key() writes of one part (the reference: byte by byte, as documented).
std::string escaped(std::string_view text) {
    static const char hex[] = "0123456789ABCDEF";
    std::string out;
    for (const char ch : text) {
        const auto c = static_cast<unsigned char>(ch);
        const bool unreserved = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') ||
                                (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '~';
        if (unreserved) {
            out.push_back(ch);
        } else {
            out += '%';
            out += hex[c >> 4];
            out += hex[c & 0x0f];
        }
    }
    return out;
}

std::string joined(const std::vector<std::string>& parts) {
    std::string out;
    for (std::size_t i = 0; i < parts.size(); ++i) {
        if (i > 0) out += '-';
        out += escaped(parts[i]);
    }
    return out;
}

/// Unescapes a key that fit back into its parts.
std::vector<std::string> split(const std::string& key) {
    std::vector<std::string> parts(1);
    for (std::size_t i = 0; i < key.size(); ++i) {
        if (key[i] == '-') {
            parts.emplace_back();
        } else if (key[i] == '%') {
            IDEM_FUZZ_CHECK(i + 2 < key.size(), "an escape has two hex digits");
            parts.back() += static_cast<char>(std::stoi(key.substr(i + 1, 2), nullptr, 16));
            i += 2;
        } else {
            parts.back() += key[i];
        }
    }
    return parts;
}

/// The contract of one derived key of @p parts (prefix or parent first), within @p limit.
void check_key(const std::string& key, const std::vector<std::string>& parts, std::size_t limit) {
    IDEM_FUZZ_CHECK(key.size() <= limit, "a key is within its bound");
    for (const char c : key) {
        IDEM_FUZZ_CHECK(c == '-' || c == '%' || escaped(std::string(1, c)).size() == 1,
                        "only unreserved characters, '%' and '-'");
    }
    const std::string full = joined(parts);
    if (full.size() <= limit) {
        IDEM_FUZZ_CHECK(key == full, "a key that fits is the escaped parts joined by '-'");
        IDEM_FUZZ_CHECK(split(key) == parts, "a key gives its parts back");
        return;
    }
    const std::string digest = idem::detail::sha256_hex(full);
    IDEM_FUZZ_CHECK(key.size() > 2 + digest.size(), "a shortened key keeps a readable start");
    const std::size_t start = key.size() - 2 - digest.size();
    IDEM_FUZZ_CHECK(key.compare(start, std::string::npos, "--" + digest) == 0,
                    "a shortened key ends with -- and the digest of the whole key");
    IDEM_FUZZ_CHECK(full.compare(0, start, key, 0, start) == 0,
                    "a shortened key starts as the whole key does");
    IDEM_FUZZ_CHECK(key.find("--") == start, "\"--\" appears only before the digest");
    const std::size_t percent = key.rfind('%', start - 1);
    IDEM_FUZZ_CHECK(percent == std::string::npos || percent + 2 < start, "no %XX escape is split");
}

template <class... Parts>
void derive(std::size_t limit, const std::string& prefix, const Parts&... parts) {
    const std::vector<std::string> texts{prefix, std::string(parts)...};
    bool empty = false;
    for (const std::string& text : texts)
        empty = empty || text.empty();
    try {
        const std::string k = idem::key_with_limit(limit, prefix, parts...);
        IDEM_FUZZ_CHECK(!empty, "an empty prefix or part is refused");
        IDEM_FUZZ_CHECK(k == idem::key_with_limit(limit, prefix, parts...), "deterministic");
        check_key(k, texts, limit);
        const std::string d = idem::key(prefix, parts...);
        IDEM_FUZZ_CHECK(d == idem::key_with_limit(idem::default_key_limit, prefix, parts...),
                        "key() is key_with_limit(255)");
        check_key(d, texts, idem::default_key_limit);
    } catch (const idem::usage_error&) {
        IDEM_FUZZ_CHECK(empty, "only an empty prefix or part is refused");
    }
}

struct Body {
    std::string id;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    FuzzedDataProvider in(data, size);
    const std::size_t limit = in.ConsumeIntegralInRange<std::size_t>(idem::min_key_limit, 600);
    const std::string prefix = in.ConsumeRandomLengthString(100);
    const std::string a = in.ConsumeRandomLengthString(400);
    const std::string b = in.ConsumeRandomLengthString(400);
    const std::int64_t number = in.ConsumeIntegral<std::int64_t>();
    derive(limit, prefix, a);
    derive(limit, prefix, a, b);
    derive(limit, prefix, std::string_view(a), b.c_str());  // a C string stops at a NUL

    // An integer part is its decimal.
    if (!prefix.empty()) {
        const std::string k = idem::key(prefix, number);
        check_key(k, {prefix, std::to_string(number)}, idem::default_key_limit);
    }

    // child_id(parent, step): a string step or an integer one.
    try {
        const std::string child = idem::child_id(a, b);
        IDEM_FUZZ_CHECK(!a.empty() && !b.empty(), "an empty parent or step is refused");
        IDEM_FUZZ_CHECK(child == idem::child_id(a, b), "deterministic");
        check_key(child, {a, b}, idem::max_message_id_bytes);
    } catch (const idem::usage_error&) {
        IDEM_FUZZ_CHECK(a.empty() || b.empty(), "only an empty parent or step is refused");
    }
    if (!a.empty()) {
        check_key(idem::child_id(a, number), {a, std::to_string(number)},
                  idem::max_message_id_bytes);
    }

    // with_gateway_key(): the key the observer sees is key_of(body).
    if (!a.empty()) {
        auto key_of = [](const Body& body) { return idem::key("capture", body.id); };
        auto effect = idem::with_gateway_key(key_of, [](auto&, const Body&) {});
        IDEM_FUZZ_CHECK(effect.gateway_key(Body{a}) == key_of(Body{a}), "the key sent is logged");
    }
    return 0;
}
