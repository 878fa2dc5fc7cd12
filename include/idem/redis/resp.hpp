#pragma once
/// @file
/// @brief RESP encoding: idem::redis::Args (command arguments encoded as they are added),
/// RespBuffer, Decimal. Link idem::redis.

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/blob.hpp"
#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace redis {

/// One command argument as bytes: text, bytes (idem::Blob) or an integer.
template <class T>
std::string to_arg(const T& value) {
    if constexpr (std::is_same_v<T, Blob>) {
        return std::string(value.bytes);
    } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
        return std::string(std::string_view(value));
    } else if constexpr (std::is_integral_v<T>) {
        return std::to_string(value);
    } else {
        static_assert(std::is_integral_v<T>,
                      "idem: a Redis command argument must be text, idem::Blob or an integer");
        return {};
    }
}

/// A command as one std::string per argument (for the vector overloads of Connection).
template <class... Args>
std::vector<std::string> to_command(const Args&... args) {
    std::vector<std::string> out;
    out.reserve(sizeof...(Args));
    (out.push_back(to_arg(args)), ...);
    return out;
}

/// An integer as decimal text, in a buffer of its own (no allocation).
class Decimal {
  public:
    template <class Int>
    /// The decimal text of @p value.
    explicit Decimal(Int value) noexcept
        : size_(static_cast<std::size_t>(
              std::to_chars(digits_, digits_ + sizeof digits_, value).ptr - digits_)) {}
    /// The text, valid while the Decimal lives.
    [[nodiscard]] std::string_view view() const noexcept { return {digits_, size_}; }

  private:
    char digits_[24];
    std::size_t size_;
};

/// Appends @p value's decimal text to @p out.
inline void append_decimal(std::string& out, long long value) {
    out.append(Decimal(value).view());
}

/// The bytes of commands being encoded. Every argument of every command is appended here, so it
/// grows without std::string's per-append cost (a call into the library, a zero-fill on resize):
/// a plain heap block, `capacity_` bytes of it allocated and `size_` in use.
class RespBuffer {
  public:
    RespBuffer() = default;
    /// A copy of @p other's bytes.
    RespBuffer(const RespBuffer& other) { append(other.view()); }
    /// Takes @p other's block; @p other is left empty.
    RespBuffer(RespBuffer&& other) noexcept
        : bytes_(std::move(other.bytes_)),
          capacity_(std::exchange(other.capacity_, 0)),
          size_(std::exchange(other.size_, 0)) {}
    /// Replaces the bytes with a copy of @p other's.
    RespBuffer& operator=(const RespBuffer& other) {
        if (this != &other) {
            clear();
            append(other.view());
        }
        return *this;
    }
    /// Takes @p other's block (this one's is freed); @p other is left empty.
    RespBuffer& operator=(RespBuffer&& other) noexcept {
        bytes_ = std::move(other.bytes_);
        capacity_ = std::exchange(other.capacity_, 0);
        size_ = std::exchange(other.size_, 0);
        return *this;
    }
    ~RespBuffer() = default;

    /// Appends @p n bytes from @p data, growing the block when needed.
    void append(const char* data, std::size_t n) {
        if (n == 0) return;
        if (size_ + n > capacity_) grow(size_ + n);
        std::memcpy(bytes_.get() + size_, data, n);
        size_ += n;
    }
    /// Appends @p text's bytes.
    void append(std::string_view text) { append(text.data(), text.size()); }
    /// Appends @p value's decimal text.
    void append_decimal(long long value) { append(Decimal(value).view()); }
    /// One RESP bulk string: `$<length>\r\n<bytes>\r\n`.
    void append_bulk(std::string_view value) {
        append_bulk_head(value.size());
        append(value);
        append("\r\n", 2);
    }
    /// The head of a bulk string of @p length bytes (`$<length>\r\n`); the caller appends the
    /// bytes and then `\r\n` (a value written in parts, with no string of its own).
    void append_bulk_head(std::size_t length) {
        char head[24];
        head[0] = '$';
        char* end = std::to_chars(head + 1, head + sizeof head - 2, length).ptr;
        *end++ = '\r';
        *end++ = '\n';
        append(head, static_cast<std::size_t>(end - head));
    }
    /// Makes room for @p bytes in all, without changing the contents.
    void reserve(std::size_t bytes) {
        if (bytes > capacity_) grow(bytes);
    }
    /// Keeps the first @p size bytes (no-op when there are fewer).
    void truncate(std::size_t size) noexcept { size_ = std::min(size_, size); }
    /// Drops the contents, keeping the block.
    void clear() noexcept { size_ = 0; }
    /// The bytes in use.
    [[nodiscard]] std::size_t size() const noexcept { return size_; }
    /// The bytes, valid until the next change.
    [[nodiscard]] std::string_view view() const noexcept { return {bytes_.get(), size_}; }

  private:
    void grow(std::size_t need) {
        // 256 bytes hold a claim or a commit: most buffers never grow twice. Not zero-filled.
        const std::size_t capacity = std::max({need, 2 * capacity_, std::size_t{256}});
        std::unique_ptr<char[]> bytes(new char[capacity]);
        if (size_ > 0) std::memcpy(bytes.get(), bytes_.get(), size_);
        bytes_ = std::move(bytes);
        capacity_ = capacity;
    }

    std::unique_ptr<char[]> bytes_;
    std::size_t capacity_ = 0;
    std::size_t size_ = 0;
};

/// @brief Command arguments encoded as RESP bulk strings as they are added, then sent as they are
/// (redisAppendFormattedCommand): no std::string per argument and no hiredis formatting, which
/// was 40 % of the client's instructions per message for a claim and a commit. Binary-safe:
/// text, idem::Blob (bytes) and integers (their decimal).
class Args {
  public:
    /// Appends @p value as one bulk string: text or Blob as its bytes, an integer as its decimal.
    template <class T>
    Args& add(const T& value) {
        if constexpr (std::is_same_v<T, Blob>) {
            resp_.append_bulk(value.bytes);
        } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
            resp_.append_bulk(std::string_view(value));
        } else if constexpr (std::is_integral_v<T>) {
            resp_.append_bulk(Decimal(value).view());
        } else {
            static_assert(std::is_integral_v<T>,
                          "idem: a Redis command argument must be text, idem::Blob or an integer");
        }
        ++count_;
        return *this;
    }
    /// One argument made of @p parts back to back (no string of its own is built).
    Args& add_parts(std::initializer_list<std::string_view> parts) {
        std::size_t length = 0;
        for (std::string_view part : parts)
            length += part.size();
        resp_.append_bulk_head(length);
        for (std::string_view part : parts)
            resp_.append(part);
        resp_.append("\r\n", 2);
        ++count_;
        return *this;
    }
    /// Every argument of @p more, after these.
    Args& append(const Args& more) {
        resp_.append(more.resp_.view());
        count_ += more.count_;
        return *this;
    }

    /// @p count arguments already encoded as RESP (a slice of another Args' resp()).
    Args& append_encoded(std::string_view resp, std::size_t count) {
        resp_.append(resp);
        count_ += count;
        return *this;
    }

    /// How many arguments there are.
    [[nodiscard]] std::size_t count() const noexcept { return count_; }
    /// True when there is no argument.
    [[nodiscard]] bool empty() const noexcept { return count_ == 0; }
    /// The arguments as RESP, without the command's `*<count>` header.
    [[nodiscard]] std::string_view resp() const noexcept { return resp_.view(); }

    /// Where the arguments end now; truncate() drops what was added after it (savepoints).
    struct Mark {
        /// The argument count then.
        std::size_t count = 0;
        /// The encoding's size then.
        std::size_t bytes = 0;
    };
    /// Where the arguments end now (for truncate()).
    [[nodiscard]] Mark mark() const noexcept { return Mark{count_, resp_.size()}; }
    /// Drops the arguments added after @p mark.
    void truncate(Mark mark) {
        resp_.truncate(mark.bytes);
        count_ = std::min(count_, mark.count);
    }
    /// Drops every argument, keeping the buffer.
    void clear() noexcept {
        resp_.clear();
        count_ = 0;
    }
    /// Makes room for @p bytes of encoding.
    void reserve(std::size_t bytes) { resp_.reserve(bytes); }

  private:
    RespBuffer resp_;
    std::size_t count_ = 0;
};

}  // namespace redis
IDEM_END_NAMESPACE
