#pragma once
/// @file
/// @brief Random bytes from the operating system, for every value that must be unique per
/// process and per call (lease tokens, lock owners, attempt keys). No generator state lives in
/// the process, so a fork()ed child never repeats its parent's values (a seeded generator copied
/// by fork() would: two workers with one token take each other's leases as their own).

#include <fcntl.h>
#include <unistd.h>

#if defined(__linux__)
#include <sys/random.h>
#endif

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <string>
#include <system_error>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace detail {

/// @brief Fills @p out with @p size bytes from the kernel: getrandom(2) (Linux), else
/// /dev/urandom. A few microseconds for 16 bytes, next to a round trip per transaction.
/// @throws std::system_error when neither source gives bytes.
inline void os_random_bytes(void* out, std::size_t size) {
    auto* bytes = static_cast<unsigned char*>(out);
    std::size_t done = 0;
#if defined(__linux__)
    while (done < size) {
        const ssize_t n = ::getrandom(bytes + done, size - done, 0);
        if (n > 0) {
            done += static_cast<std::size_t>(n);
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else {
            break;  // ENOSYS (an old kernel) or a seccomp filter: try the device
        }
    }
#endif
    if (done == size) return;
    int fd = -1;
    do {
        fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        throw std::system_error(errno, std::generic_category(),
                                "idem: no randomness from getrandom() or /dev/urandom");
    }
    while (done < size) {
        const ssize_t n = ::read(fd, bytes + done, size - done);
        if (n > 0) {
            done += static_cast<std::size_t>(n);
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else {
            const int error = n < 0 ? errno : EIO;
            ::close(fd);
            throw std::system_error(error, std::generic_category(),
                                    "idem: reading /dev/urandom failed");
        }
    }
    ::close(fd);
}

/// @brief @p bytes random bytes from the kernel as lowercase hex (2 * @p bytes characters).
inline std::string os_random_hex(std::size_t bytes) {
    static constexpr char digits[] = "0123456789abcdef";
    unsigned char raw[64];
    std::string out(2 * bytes, '0');
    char* next = out.data();  // written in place: no push_back per digit
    while (bytes > 0) {
        const std::size_t n = bytes < sizeof raw ? bytes : sizeof raw;
        os_random_bytes(raw, n);
        for (std::size_t i = 0; i < n; ++i) {
            *next++ = digits[raw[i] >> 4];
            *next++ = digits[raw[i] & 0x0f];
        }
        bytes -= n;
    }
    return out;
}

}  // namespace detail
IDEM_END_NAMESPACE
