#pragma once
/// @file
/// @brief The Redis store's key layout: `<prefix>c{<scope>:<id>}` (a claim record),
/// `<prefix>d{<scope>:<id>}` (its dead letters), `<prefix>o{<scope>:<id>}` (its redrive's outbox
/// intent), `<prefix>l{<key>}` (a lock). The hash tag holds
/// the whole (scope, id), percent-escaped, so one claim's keys share a Cluster slot whatever bytes
/// the id has, and two different pairs never share a key. Link idem::redis.

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// A key part inside a hash tag: braces would end the tag early (and split one claim's keys
/// across Cluster slots), and ':' in a scope would let (a:b, c) and (a, b:c) collide.
inline void append_key_part(std::string& out, std::string_view part, bool escape_colon) {
    // The runs between characters to escape go in with one append each (ids seldom have any).
    std::size_t run = 0;
    for (std::size_t i = 0; i < part.size(); ++i) {
        const char c = part[i];
        const char* escaped = nullptr;
        switch (c) {
            case '%':
                escaped = "%25";
                break;
            case '{':
                escaped = "%7B";
                break;
            case '}':
                escaped = "%7D";
                break;
            case ':':
                if (escape_colon) escaped = "%3A";
                break;
            default:
                break;
        }
        if (escaped == nullptr) continue;
        out.append(part.data() + run, i - run).append(escaped, 3);
        run = i + 1;
    }
    out.append(part.data() + run, part.size() - run);
}

/// A literal text inside a SCAN MATCH pattern.
inline std::string glob_escape(std::string_view text) {
    std::string out;
    for (char c : text) {
        if (c == '*' || c == '?' || c == '[' || c == ']' || c == '\\') out += '\\';
        out += c;
    }
    return out;
}

/// @brief The keys of one store: its prefix (RedisOptions::key_prefix, without braces), then a
/// letter for the kind, then the hash tag.
class KeyLayout {
  public:
    /// @brief The keys under @p prefix (RedisOptions::key_prefix).
    explicit KeyLayout(std::string prefix) : prefix_(std::move(prefix)) {}

    /// The prefix every key starts with.
    [[nodiscard]] const std::string& prefix() const noexcept { return prefix_; }
    /// The record of (scope, id).
    [[nodiscard]] std::string claim(std::string_view scope, std::string_view id) const {
        return tagged('c', scope, id);
    }
    /// The dead letters of (scope, id): a stream in the claim's slot.
    [[nodiscard]] std::string dead_letter(std::string_view scope, std::string_view id) const {
        return tagged('d', scope, id);
    }
    /// The failures noted for (scope, id) (note_failure()): a hash in the claim's slot, whose kind
    /// letter the scripts put in place of the claim's or the dead letters' ('f').
    [[nodiscard]] std::string failures(std::string_view scope, std::string_view id) const {
        return tagged('f', scope, id);
    }
    /// The outbox intent that re-publishes (scope, id) after a redrive: a hash in the claim's slot.
    [[nodiscard]] std::string outbox(std::string_view scope, std::string_view id) const {
        return tagged('o', scope, id);
    }
    /// The SCAN MATCH pattern of the keys of kind @p kind ('c', 'd', 'o', ...) of @p scope (every
    /// scope when empty).
    [[nodiscard]] std::string pattern(char kind, std::string_view scope = {}) const {
        std::string out = glob();
        out.append(1, kind).append(1, '{');
        if (!scope.empty()) {
            std::string part;
            append_key_part(part, scope, true);
            out.append(glob_escape(part)).append(1, ':');
        }
        return out.append(1, '*');
    }
    /// A short-lived mark in the claim's slot: the write a duplicate's WAIT confirms (WAIT counts
    /// only the writes sent on its own connection; replication is in order, so a replica that
    /// has the mark has every record written before it).
    [[nodiscard]] std::string replication_mark(std::string_view scope, std::string_view id) const {
        return tagged('w', scope, id);
    }
    /// The lock of overlap key @p key (without_overlapping(), hold_lock()); its own hash tag.
    [[nodiscard]] std::string lock(std::string_view key) const {
        std::string out = prefix_ + "l{";
        append_key_part(out, key, false);
        out += '}';
        return out;
    }
    /// The prefix as a literal inside a SCAN MATCH pattern.
    [[nodiscard]] std::string glob() const { return glob_escape(prefix_); }

  private:
    [[nodiscard]] std::string tagged(char kind, std::string_view scope, std::string_view id) const {
        std::string out;
        out.reserve(prefix_.size() + scope.size() + id.size() + 5);
        out.append(prefix_).append(1, kind).append(1, '{');
        append_key_part(out, scope, true);
        out.append(1, ':');
        append_key_part(out, id, false);
        out.append(1, '}');
        return out;
    }

    std::string prefix_;
};

}  // namespace redis
IDEM_END_NAMESPACE
