#pragma once
// journal::JournalStore: an idem store over one append-only file, written only against idem's
// installed public headers (the contract, the records, the errors). What it shows a store author:
//
// * a commit is one journal record (length, CRC-32, the transaction's operations) appended with
//   write() and made durable with fdatasync() before commit() returns; a torn record left by a
//   crash fails its length or CRC check and is cut off when the file is next locked, so a
//   transaction is in the file entirely or not at all;
// * the file is replayed on open, and claims, dead letters, locks and the effect's rows survive a
//   reopen;
// * flock() serialises transactions across processes (a transaction holds the lock from begin()
//   to its end, and first replays what other processes appended), a mutex across threads;
// * the journal refuses to grow past JournalOptions::max_bytes: a commit that would is
//   commit_failed, with nothing written;
// * ping(), the circuit breaker's probe (idem::probe_store): the file lock within a bounded
//   wait, since begin() would wait for it without limit while another process holds it.
//
// Not done here (a production store would): compaction of the journal, the outbox, batch claims
// (the handler then claims message by message), fork safety. Integers are in the host's byte
// order: the file is not portable between architectures.

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <idem/contract/records.hpp>
#include <idem/contract/store.hpp>
#include <idem/contract/time.hpp>
#include <idem/error.hpp>
#include <idem/outcome.hpp>

namespace journal {

struct JournalOptions {
    /// Time source for claims, dead letters and locks (empty: the system clock).
    idem::Clock clock{};
    /// The largest the journal may grow; a commit past it is refused (commit_failed).
    std::uintmax_t max_bytes = std::uintmax_t{1} << 30;
    /// How long ping() waits for the file lock another process holds (begin() waits for ever).
    std::chrono::milliseconds lock_wait{5000};
};

namespace detail {

/// CRC-32 (IEEE, reflected), to tell a whole record from a torn one.
inline std::uint32_t crc32(std::string_view bytes) {
    static const auto table = [] {
        std::array<std::uint32_t, 256> t{};
        for (std::uint32_t i = 0; i < 256; ++i) {
            std::uint32_t c = i;
            for (int k = 0; k < 8; ++k)
                c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            t[i] = c;
        }
        return t;
    }();
    std::uint32_t c = 0xFFFFFFFFu;
    for (unsigned char b : bytes)
        c = table[(c ^ b) & 0xFFu] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

/// One change a transaction makes; a commit writes them in order, a replay applies them.
struct Op {
    enum class Kind : std::uint8_t {
        claim_put,
        claim_erase,
        dead_letter,
        lock_put,
        lock_erase,
        row_put
    };
    Kind kind{};
    std::string a, b, c, d, e;  // claim: scope, id, reason, fingerprint; row: table, key, value
    std::int64_t time = 0;      // claimed_at, created_at or expires_at (unix ms)
    std::uint32_t number = 0;   // disposition or delivery count
};

inline void put_u32(std::string& out, std::uint32_t v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof v);
}
inline void put_i64(std::string& out, std::int64_t v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof v);
}
inline void put_text(std::string& out, std::string_view s) {
    put_u32(out, static_cast<std::uint32_t>(s.size()));
    out.append(s);
}

inline std::string encode(const std::vector<Op>& ops) {
    std::string out;
    for (const Op& op : ops) {
        out.push_back(static_cast<char>(op.kind));
        for (const std::string* s : {&op.a, &op.b, &op.c, &op.d, &op.e})
            put_text(out, *s);
        put_i64(out, op.time);
        put_u32(out, op.number);
    }
    return out;
}

/// Reads what encode() wrote; false when the bytes are not a whole list of operations.
class Reader {
  public:
    explicit Reader(std::string_view bytes) : rest_(bytes) {}
    bool done() const { return rest_.empty(); }
    bool op(Op& out) {
        if (rest_.empty()) return false;
        out.kind = static_cast<Op::Kind>(rest_[0]);
        rest_.remove_prefix(1);
        for (std::string* s : {&out.a, &out.b, &out.c, &out.d, &out.e})
            if (!text(*s)) return false;
        return raw(&out.time, sizeof out.time) && raw(&out.number, sizeof out.number);
    }

  private:
    bool raw(void* to, std::size_t n) {
        if (rest_.size() < n) return false;
        std::memcpy(to, rest_.data(), n);
        rest_.remove_prefix(n);
        return true;
    }
    bool text(std::string& s) {
        std::uint32_t n = 0;
        if (!raw(&n, sizeof n) || rest_.size() < n) return false;
        s.assign(rest_.data(), n);
        rest_.remove_prefix(n);
        return true;
    }
    std::string_view rest_;
};

[[noreturn]] inline void io_failure(const std::string& what) {
    throw idem::store_unavailable("journal: " + what + ": " + std::strerror(errno));
}

}  // namespace detail

class JournalStore {
    using ClaimKey = std::pair<std::string, std::string>;  // scope, message id
    struct HeldLock {
        std::string owner;
        std::chrono::system_clock::time_point expires_at;
    };
    /// The record header: length of the operations, then their CRC-32.
    static constexpr std::size_t header_size = 8;

  public:
    explicit JournalStore(std::string path, JournalOptions options = {})
        : path_(std::move(path)), options_(std::move(options)) {
        fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
        if (fd_ < 0) detail::io_failure("open " + path_);
        FileLock lock(fd_);
        catch_up();
    }
    JournalStore(const JournalStore&) = delete;
    JournalStore& operator=(const JournalStore&) = delete;
    ~JournalStore() { ::close(fd_); }

    /// A transaction: holds the store (threads) and the file (processes) until it ends; its
    /// changes are kept aside and written as one record by commit().
    class Transaction {
      public:
        static constexpr bool cheap_savepoints = true;  // a savepoint is a mark in a vector

        Transaction(Transaction&& other) noexcept
            : store_(std::exchange(other.store_, nullptr)),
              guard_(std::move(other.guard_)),
              file_(std::exchange(other.file_, -1)),
              ops_(std::move(other.ops_)),
              savepoints_(std::move(other.savepoints_)) {}
        Transaction& operator=(Transaction&&) = delete;
        ~Transaction() { rollback(); }

        idem::ClaimResult claim(std::string_view scope, std::string_view id,
                                std::string_view fingerprint = {}) {
            active();
            if (auto found = find(scope, id)) {
                idem::ClaimResult duplicate;
                duplicate.status = idem::ClaimStatus::duplicate;
                duplicate.recorded = found->disposition;
                duplicate.fingerprint = found->fingerprint;
                return duplicate;
            }
            idem::ClaimRecord record;
            record.scope = std::string(scope);
            record.message_id = std::string(id);
            record.disposition = idem::Disposition::in_progress;
            record.claimed_at = store_->now();
            record.fingerprint = std::string(fingerprint);
            ops_.push_back(claim_op(record));
            return idem::ClaimResult{};
        }

        void record_outcome(std::string_view scope, std::string_view id,
                            idem::Disposition disposition, std::string_view reason) {
            active();
            auto found = find(scope, id);
            if (!found) return;
            found->disposition = disposition;
            found->reason = std::string(reason);
            ops_.push_back(claim_op(*found));
        }

        void dead_letter(const idem::DeadLetter& letter) {
            active();
            detail::Op op{
                detail::Op::Kind::dead_letter,
                letter.scope,
                letter.message_id,
                letter.reason,
                letter.payload,
                {},
                idem::to_unix_ms(letter.created_at == std::chrono::system_clock::time_point{}
                                     ? store_->now()
                                     : letter.created_at),
                letter.delivery_count};
            ops_.push_back(std::move(op));
        }

        void savepoint() {
            active();
            savepoints_.push_back(ops_.size());
        }
        void rollback_to_savepoint() {
            active();
            if (savepoints_.empty()) throw idem::usage_error("journal: no savepoint");
            ops_.resize(savepoints_.back());
            savepoints_.pop_back();
        }
        void release_savepoint() {
            active();
            if (savepoints_.empty()) throw idem::usage_error("journal: no savepoint");
            savepoints_.pop_back();
        }

        /// Appends the transaction as one record and syncs it; then applies it in memory.
        /// @throws idem::commit_failed when the journal would pass max_bytes or the write or
        /// sync fails (the record is cut off again: nothing of the transaction stays).
        void commit() {
            active();
            if (!ops_.empty()) store_->append(ops_);
            ops_.clear();
            finish();
        }

        void rollback() noexcept {
            if (store_ == nullptr) return;
            ops_.clear();
            finish();
        }

        /// The overlap lock: transactions never overlap, so only a lock held with
        /// JournalStore::hold_lock() by someone else refuses it.
        bool try_lock(std::string_view key, std::chrono::milliseconds /*expire_after*/) {
            active();
            return !store_->held_by_other(key, {});
        }

        // The effect's own rows, committed or rolled back with the claim.
        void put(std::string_view table, std::string_view key, std::string_view value) {
            active();
            ops_.push_back(detail::Op{detail::Op::Kind::row_put,
                                      std::string(table),
                                      std::string(key),
                                      std::string(value),
                                      {},
                                      {},
                                      0,
                                      0});
        }
        [[nodiscard]] std::optional<std::string> get(std::string_view table,
                                                     std::string_view key) const {
            active();
            for (auto it = ops_.rbegin(); it != ops_.rend(); ++it) {
                if (it->kind == detail::Op::Kind::row_put && it->a == table && it->b == key)
                    return it->c;
            }
            return store_->row(table, key);
        }

      private:
        friend class JournalStore;
        Transaction(JournalStore& store, std::unique_lock<std::mutex> guard)
            : store_(&store), guard_(std::move(guard)) {
            file_ = store.fd_;
            if (::flock(file_, LOCK_EX) != 0) {
                store_ = nullptr;
                detail::io_failure("flock");
            }
            store.owner_.store(std::this_thread::get_id());
            try {
                store.catch_up();
            } catch (...) {
                finish();
                throw;
            }
        }

        void active() const {
            if (store_ == nullptr)
                throw idem::usage_error("journal: the transaction is already over");
        }

        /// The claim as this transaction sees it: its own latest change, else the store's.
        std::optional<idem::ClaimRecord> find(std::string_view scope, std::string_view id) const {
            for (auto it = ops_.rbegin(); it != ops_.rend(); ++it) {
                if (it->a != scope || it->b != id) continue;
                if (it->kind == detail::Op::Kind::claim_put) return JournalStore::record_of(*it);
                if (it->kind == detail::Op::Kind::claim_erase) return std::nullopt;
            }
            return store_->claim_of(scope, id);
        }

        static detail::Op claim_op(const idem::ClaimRecord& r) {
            return detail::Op{detail::Op::Kind::claim_put,
                              r.scope,
                              r.message_id,
                              r.reason,
                              r.fingerprint,
                              {},
                              idem::to_unix_ms(r.claimed_at),
                              static_cast<std::uint32_t>(r.disposition)};
        }

        void finish() noexcept {
            store_->owner_.store(std::thread::id{});
            ::flock(file_, LOCK_UN);
            store_ = nullptr;
            guard_ = {};
            savepoints_.clear();
        }

        JournalStore* store_;
        std::unique_lock<std::mutex> guard_;
        int file_ = -1;
        std::vector<detail::Op> ops_;
        std::vector<std::size_t> savepoints_;
    };

    /// @brief Whether the journal can be written now: its file lock taken and given back, waiting
    /// at most JournalOptions::lock_wait for another process that holds it (idem::probe_store
    /// calls this; begin() would wait without limit).
    /// @throws idem::store_timeout when the lock stayed held; store_unavailable when the file
    /// cannot be locked; usage_error inside this thread's own transaction.
    void ping() {
        if (owner_.load() == std::this_thread::get_id())
            throw idem::usage_error("journal: ping() inside this thread's own transaction");
        std::lock_guard<std::mutex> guard(mutex_);  // no transaction of this process holds it
        const auto deadline = std::chrono::steady_clock::now() + options_.lock_wait;
        while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
            if (errno != EWOULDBLOCK) detail::io_failure("flock");
            if (std::chrono::steady_clock::now() >= deadline) {
                throw idem::store_timeout("journal: another process held the lock of " + path_ +
                                          " for longer than lock_wait");
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        ::flock(fd_, LOCK_UN);
    }

    /// @throws idem::usage_error when this thread already holds a transaction here.
    Transaction begin() {
        if (owner_.load() == std::this_thread::get_id())
            throw idem::usage_error("journal: begin() inside this thread's own transaction");
        return Transaction(*this, std::unique_lock<std::mutex>(mutex_));
    }

    // ---- maintenance and inspection, each in a transaction of its own ----

    idem::PurgeResult purge(std::chrono::system_clock::duration older_than) {
        if (older_than.count() < 0) throw idem::usage_error("journal: purge(): negative age");
        auto tx = begin();
        const auto at = now();
        const std::int64_t cutoff = idem::to_unix_ms(at - older_than);
        idem::PurgeResult result;
        for (const auto& [key, op] : claims_) {
            if (op.time < cutoff) {
                tx.ops_.push_back(detail::Op{
                    detail::Op::Kind::claim_erase, key.first, key.second, {}, {}, {}, 0, 0});
                ++result.claims;
            }
        }
        for (const auto& [key, lock] : locks_) {
            if (lock.expires_at < at) {
                tx.ops_.push_back(
                    detail::Op{detail::Op::Kind::lock_erase, key, {}, {}, {}, {}, 0, 0});
                ++result.expired_locks;
            }
        }
        tx.commit();
        return result;
    }

    std::optional<idem::ClaimRecord> find_claim(std::string_view scope, std::string_view id) {
        auto tx = begin();
        return claim_of(scope, id);
    }

    std::vector<idem::DeadLetter> dead_letters() {
        auto tx = begin();
        return dead_letters_;
    }

    /// A lock held outside any transaction, by `owner`, until `expire_after` passes or
    /// release_lock(); false when another owner holds it.
    bool hold_lock(std::string_view key, std::string_view owner,
                   std::chrono::milliseconds expire_after) {
        if (owner.empty()) throw idem::usage_error("journal: hold_lock(): empty owner");
        auto tx = begin();
        if (held_by_other(key, owner)) return false;
        tx.ops_.push_back(detail::Op{detail::Op::Kind::lock_put,
                                     std::string(key),
                                     std::string(owner),
                                     {},
                                     {},
                                     {},
                                     idem::to_unix_ms(now() + expire_after),
                                     0});
        tx.commit();
        return true;
    }

    bool release_lock(std::string_view key, std::string_view owner) {
        auto tx = begin();
        auto it = locks_.find(std::string(key));
        if (it == locks_.end() || it->second.owner != owner) return false;
        tx.ops_.push_back(
            detail::Op{detail::Op::Kind::lock_erase, std::string(key), {}, {}, {}, {}, 0, 0});
        tx.commit();
        return true;
    }

    /// The effect's committed rows.
    std::optional<std::string> get(std::string_view table, std::string_view key) {
        auto tx = begin();
        return row(table, key);
    }
    std::size_t count(std::string_view table) {
        auto tx = begin();
        auto it = rows_.find(std::string(table));
        return it == rows_.end() ? 0 : it->second.size();
    }

  private:
    /// Holds the file lock for a scope (the constructor's replay).
    struct FileLock {
        explicit FileLock(int fd) : fd_(fd) {
            if (::flock(fd_, LOCK_EX) != 0) detail::io_failure("flock");
        }
        ~FileLock() { ::flock(fd_, LOCK_UN); }
        int fd_;
    };

    std::chrono::system_clock::time_point now() const {
        return options_.clock ? options_.clock() : std::chrono::system_clock::now();
    }

    static idem::ClaimRecord record_of(const detail::Op& op) {
        idem::ClaimRecord r;
        r.scope = op.a;
        r.message_id = op.b;
        r.reason = op.c;
        r.fingerprint = op.d;
        r.claimed_at = idem::from_unix_ms(op.time);
        r.disposition = static_cast<idem::Disposition>(op.number);
        return r;
    }

    std::optional<idem::ClaimRecord> claim_of(std::string_view scope, std::string_view id) const {
        auto it = claims_.find(ClaimKey{std::string(scope), std::string(id)});
        if (it == claims_.end()) return std::nullopt;
        return record_of(it->second);
    }

    std::optional<std::string> row(std::string_view table, std::string_view key) const {
        auto t = rows_.find(std::string(table));
        if (t == rows_.end()) return std::nullopt;
        auto it = t->second.find(std::string(key));
        if (it == t->second.end()) return std::nullopt;
        return it->second;
    }

    bool held_by_other(std::string_view key, std::string_view owner) const {
        auto it = locks_.find(std::string(key));
        return it != locks_.end() && it->second.owner != owner && it->second.expires_at > now();
    }

    void apply(const detail::Op& op) {
        using Kind = detail::Op::Kind;
        switch (op.kind) {
            case Kind::claim_put:
                claims_[ClaimKey{op.a, op.b}] = op;
                break;
            case Kind::claim_erase:
                claims_.erase(ClaimKey{op.a, op.b});
                break;
            case Kind::dead_letter: {
                idem::DeadLetter letter;
                letter.scope = op.a;
                letter.message_id = op.b;
                letter.reason = op.c;
                letter.payload = op.d;
                letter.created_at = idem::from_unix_ms(op.time);
                letter.delivery_count = op.number;
                dead_letters_.push_back(std::move(letter));
                break;
            }
            case Kind::lock_put:
                locks_[op.a] = HeldLock{op.b, idem::from_unix_ms(op.time)};
                break;
            case Kind::lock_erase:
                locks_.erase(op.a);
                break;
            case Kind::row_put:
                rows_[op.a][op.b] = op.c;
                break;
        }
    }

    /// Replays what was appended since this store last looked (by other processes, or all of
    /// it on open), under the file lock. A torn last record is a writer that died mid-commit:
    /// it is cut off, since no one else can be writing while we hold the lock.
    void catch_up() {
        struct stat st {};
        if (::fstat(fd_, &st) != 0) detail::io_failure("fstat " + path_);
        const auto size = static_cast<std::uintmax_t>(st.st_size);
        if (size == applied_) return;
        if (size < applied_) {
            throw idem::store_unavailable("journal: " + path_ + " shrank under the store");
        }
        std::string bytes(size - applied_, '\0');
        std::size_t got = 0;
        while (got < bytes.size()) {
            const ssize_t n = ::pread(fd_, bytes.data() + got, bytes.size() - got,
                                      static_cast<off_t>(applied_ + got));
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) detail::io_failure("read " + path_);
            got += static_cast<std::size_t>(n);
        }
        std::string_view rest(bytes);
        while (rest.size() >= header_size) {
            std::uint32_t length = 0, crc = 0;
            std::memcpy(&length, rest.data(), 4);
            std::memcpy(&crc, rest.data() + 4, 4);
            if (rest.size() - header_size < length) break;
            const std::string_view body = rest.substr(header_size, length);
            if (detail::crc32(body) != crc) break;
            std::vector<detail::Op> ops;
            detail::Reader reader(body);
            detail::Op op;
            while (!reader.done() && reader.op(op))
                ops.push_back(op);
            if (!reader.done()) break;  // a whole record that does not decode: treat as torn
            for (const auto& each : ops)
                apply(each);
            applied_ += header_size + length;
            rest.remove_prefix(header_size + length);
        }
        if (applied_ != size && ::ftruncate(fd_, static_cast<off_t>(applied_)) != 0) {
            detail::io_failure("truncate the torn tail of " + path_);
        }
    }

    /// Writes one record and syncs it, under the file lock (the caller's transaction).
    void append(const std::vector<detail::Op>& ops) {
        const std::string body = detail::encode(ops);
        std::string record;
        detail::put_u32(record, static_cast<std::uint32_t>(body.size()));
        detail::put_u32(record, detail::crc32(body));
        record += body;
        if (applied_ + record.size() > options_.max_bytes) {
            throw idem::commit_failed("journal: " + path_ + " would pass its " +
                                      std::to_string(options_.max_bytes) + "-byte limit");
        }
        std::size_t put = 0;
        while (put < record.size()) {
            const ssize_t n = ::write(fd_, record.data() + put, record.size() - put);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break;
            put += static_cast<std::size_t>(n);
        }
        if (put != record.size() || ::fdatasync(fd_) != 0) {
            const std::string why = std::strerror(errno);
            (void)::ftruncate(fd_, static_cast<off_t>(applied_));  // best effort; replay cuts it
            throw idem::commit_failed("journal: writing " + path_ + " failed: " + why);
        }
        for (const auto& op : ops)
            apply(op);
        applied_ += record.size();
    }

    std::string path_;
    JournalOptions options_;
    int fd_ = -1;
    std::mutex mutex_;
    std::atomic<std::thread::id> owner_{};  // the thread whose transaction holds mutex_
    std::uintmax_t applied_ = 0;            // bytes of the journal replayed into the maps below
    std::map<ClaimKey, detail::Op> claims_;
    std::vector<idem::DeadLetter> dead_letters_;
    std::map<std::string, HeldLock> locks_;
    std::map<std::string, std::map<std::string, std::string>> rows_;
};

static_assert(idem::check_store<JournalStore>());

}  // namespace journal
