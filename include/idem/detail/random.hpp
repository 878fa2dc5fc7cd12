#pragma once
/// @file
/// @brief Random bytes from the operating system, for every value that must be unique per
/// process and per call (lease tokens, lock owners, attempt keys). No generator state lives in
/// the process, so a fork()ed child never repeats its parent's values (a seeded generator copied
/// by fork() would: two workers with one token take each other's leases as their own). Tokens
/// drawn once per transaction come from a per-thread buffer of kernel bytes, owned by the
/// process that read it (pooled_random_bytes).

#include <fcntl.h>
#include <unistd.h>

#if defined(__linux__)
#include <sys/random.h>
#endif

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <system_error>

#include "idem/config.hpp"
#include "idem/detail/process_id.hpp"

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

/// @brief @p size bytes of the kernel's, handed out from a buffer of this thread's that reads
/// 256 at a time: a lease token then costs a copy, not a system call (getrandom(2) is about 1 µs
/// on a virtual machine, once per Redis transaction). Every byte is handed out once and wiped.
/// The buffer belongs to the process that filled it: in a child fork() made, the thread finds
/// another process id (ProcessId) and reads its own, so no two processes hand out the same
/// bytes. A child made without fork()'s handlers (_Fork(2), a raw clone(2)) keeps its parent's
/// id, and must use no store it inherited (as for the stores' connections).
/// @throws std::system_error as os_random_bytes().
inline void pooled_random_bytes(void* out, std::size_t size) {
    struct Pool {
        unsigned char bytes[256];
        std::size_t used = sizeof bytes;
        pid_t owner = 0;
    };
    thread_local Pool pool;
    if (size > sizeof pool.bytes) return os_random_bytes(out, size);
    const pid_t self = current_pid();
    if (pool.owner != self || sizeof pool.bytes - pool.used < size) {
        pool.used = sizeof pool.bytes;  // a failed read leaves nothing to hand out
        os_random_bytes(pool.bytes, sizeof pool.bytes);
        pool.used = 0;
        pool.owner = self;
    }
    std::memcpy(out, pool.bytes + pool.used, size);
    std::memset(pool.bytes + pool.used, 0, size);
    pool.used += size;
}

/// @brief @p bytes random bytes (pooled_random_bytes: the kernel's, read ahead per thread) as
/// lowercase hex (2 * @p bytes characters).
inline std::string os_random_hex(std::size_t bytes) {
    static constexpr char digits[] = "0123456789abcdef";
    unsigned char raw[64];
    std::string out(2 * bytes, '0');
    char* next = out.data();  // written in place: no push_back per digit
    while (bytes > 0) {
        const std::size_t n = bytes < sizeof raw ? bytes : sizeof raw;
        pooled_random_bytes(raw, n);
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
