#pragma once
/// @file
/// @brief The SQL store written once: idem::sql::basic_store<Driver> and
/// basic_transaction<Driver>, over a driver that runs statements on one connection (the
/// contract: sql/driver.hpp). Claims, outcomes, dead letters, savepoints, the overlap lock, the
/// outbox, purge in batches, find_claim, the store's mutex with its owner thread, and the
/// transaction's RAII live here once; idem::SqliteStore and idem::PostgresStore are this class
/// over sqlite::Driver and postgres::Driver. The paced purge is in sql/purge.hpp, the dead
/// letters' listing and redrive in sql/redrive.hpp. Stored offsets (contract/stored_offset.hpp)
/// too: stored_offset(), and the transaction's attach() of a StoredOffset commit hook. The driver
/// is a template parameter: every call is static and inlined, so the hot paths (claim,
/// record_outcome, commit, claim_many) cost what the driver's statements cost.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/types.h>

#include <fmt/format.h>

#include "idem/blob.hpp"
#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/redrive.hpp"
#include "idem/contract/store.hpp"
#include "idem/contract/stored_offset.hpp"
#include "idem/detail/offset_hooks.hpp"
#include "idem/detail/process_id.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"
#include "idem/sql/driver.hpp"
#include "idem/sql/own_claims.hpp"
#include "idem/sql/purge.hpp"
#include "idem/sql/redrive.hpp"
#include "idem/sql/schema.hpp"
#include "idem/sql/statements.hpp"
#include "idem/sql/stored_outcome.hpp"
#include "idem/sql/support.hpp"

IDEM_BEGIN_NAMESPACE
namespace sql {

template <class Driver>
class basic_transaction;

/// @brief A SQL store over @p Driver. One connection; it may be shared by threads: every
/// operation (begin() up to the end of its transaction, purge(), find_claim(), ...) holds the
/// store's mutex, and a transaction must end on the thread that began it.
///
/// Fork: the store remembers the process that opened its connection. Its first use in a
/// fork()ed child (a pre-fork worker pool) drops the inherited connection without a word to the
/// server or the file (the parent still uses it) and opens a new one when the store opened the
/// first (a path, a conninfo); a borrowed connection cannot be reopened by the store: usage_error.
/// A transaction begun before fork() cannot go on in the child. Fork while no thread is inside
/// an operation of the store (its mutex would stay locked in the child).
template <class Driver>
class basic_store {
  public:
    /// The transaction begin() returns.
    using Transaction = basic_transaction<Driver>;
    /// The driver this store runs on (sql/driver.hpp).
    using driver_type = Driver;

    /// @brief Version of the idem tables this store creates and migrates to, recorded in its
    /// `idem_schema` table; a database with a newer one is refused (store_error naming both).
    /// IDEM_SQL_SCHEMA_VERSION (idem/config.hpp); how it moves: docs/compatibility.md.
    static constexpr int schema_version = sql::schema_version;

    basic_store(const basic_store&) = delete;
    basic_store& operator=(const basic_store&) = delete;
    basic_store(basic_store&&) = delete;
    basic_store& operator=(basic_store&&) = delete;

    /// @brief Takes the store's mutex and starts a transaction (see the driver: SQLite runs
    /// `BEGIN IMMEDIATE`, PostgreSQL queues `BEGIN` for the first statement).
    /// @throws store_timeout, store_unavailable, usage_error when the connection is already in
    /// a transaction or this thread already holds a transaction of this store.
    [[nodiscard]] Transaction begin() {
        Lock lock(*this, "begin()");
        if constexpr (has_claim_partitions<Driver>::value)
            driver_.keep_claim_partitions_ahead(now_ms());
        driver_.begin("begin()");
        return Transaction(*this, std::move(lock));
    }

    /// @brief One cheap check that the store answers now, for idem::probe_store() (the circuit
    /// breaker's probe): PostgreSQL runs `SELECT 1` (a round trip; a connection found dead is
    /// reconnected once), SQLite `BEGIN IMMEDIATE` + `ROLLBACK` (another writer holding the
    /// database past the busy timeout: store_timeout). @throws store_unavailable, usage_error.
    void ping() {
        Lock lock(*this, "ping()");
        if constexpr (has_driver_ping<Driver>::value) {
            driver_.ping("ping()");
        } else {
            driver_.begin("ping()");
            const bool ok = driver_.rollback_noexcept();
            driver_.end_transaction();
            if (!ok) {
                throw store_unavailable(fmt::format("idem {}: ping(): rollback failed: {}",
                                                    Driver::name, driver_.last_error()));
            }
        }
    }

    /// @brief Deletes claims claimed before clock() - @p older_than, intents sent before that
    /// cutoff, attempt counters last counted before it and expired hold_lock() locks, paced by
    /// @p options (sql/purge.hpp: batches of one statement each, in time order from where the
    /// last one ended; partitioned claims go a whole partition at a time). Dead letters, unsent
    /// and parked intents and stored offsets are kept. PurgeResult::complete is false when the
    /// time budget or should_stop ended the run. @throws usage_error for a negative age or a
    /// bad option; store_unavailable, store_timeout (what was deleted stays deleted).
    PurgeResult purge(std::chrono::system_clock::duration older_than,
                      const PurgeOptions& options = {}) {
        return paced_purge::run(*this, older_than, options);
    }

    /// @brief Counts one more attempt at (@p scope, @p id) and returns the count, this one
    /// included, in one statement committed on its own (an upsert: attempts + 1). For brokers
    /// without a delivery count (Kafka): call it BEFORE begin(), so a worker that dies in the
    /// effect has still counted the attempt and the poison limit ends a message that kills
    /// every worker. Racing counters of one id each get their own number; the counter stays
    /// until purge() finds it older than the retention. @throws store_unavailable,
    /// store_timeout; usage_error as begin() does (also on a thread holding a transaction).
    std::uint32_t count_attempt(std::string_view scope, std::string_view id) {
        Lock lock(*this, "count_attempt()");
        return redrive_core::count_attempt(
            driver_, static_cast<basic_transaction<Driver>*>(nullptr), scope, id, now_ms());
    }

    /// @brief Records a failure of the effect of (@p scope, @p id) in its attempt row (committed
    /// on its own; cleared by its redrive, purged with the counts): a later dead letter of it
    /// carries @p failure and when the first and last were. @throws as count_attempt().
    void note_failure(std::string_view scope, std::string_view id, std::string_view failure,
                      std::chrono::seconds /*keep_for*/) {
        Lock lock(*this, "note_failure()");
        driver_.run(stmt::attempt_failure, "note_failure", access::write, no_rows{}, Blob{scope},
                    Blob{id}, now_ms(), Blob{failure});
    }

    /// @brief The attempts count_attempt() counted for (@p scope, @p id); 0 when none.
    [[nodiscard]] std::uint32_t attempts(std::string_view scope, std::string_view id) {
        return redrive_core::attempt_row(*this, scope, id).first;
    }
    /// @brief What note_failure() recorded for (@p scope, @p id), if anything.
    [[nodiscard]] std::optional<NotedFailure> noted_failure(std::string_view scope,
                                                            std::string_view id) {
        return redrive_core::attempt_row(*this, scope, id).second;
    }

    /// @brief The committed claim of (scope, id), if any.
    [[nodiscard]] std::optional<ClaimRecord> find_claim(std::string_view scope,
                                                        std::string_view id) {
        Lock lock(*this, "find_claim()");
        std::optional<ClaimRecord> found;
        driver_.run(
            stmt::find_claim, "find_claim", access::read,
            [&](const auto& row) {
                ClaimRecord record;
                record.scope = row.bytes(0);
                record.message_id = row.bytes(1);
                record.claimed_at = from_unix_ms(row.int64(2));
                record.disposition = stored_disposition(row.bytes(3), Driver::name);
                record.reason = row.bytes(4);
                record.fingerprint = row.bytes(5);
                found = std::move(record);
            },
            Blob{scope}, Blob{id});
        return found;
    }

    /// @brief The next offset to read that a commit stored for (@p group, @p topic,
    /// @p partition) (contract/stored_offset.hpp); nullopt when none was.
    [[nodiscard]] std::optional<std::int64_t> stored_offset(std::string_view group,
                                                            std::string_view topic,
                                                            std::int32_t partition) {
        Lock lock(*this, "stored_offset()");
        std::optional<std::int64_t> next;
        driver_.run(
            stmt::offset_find, "stored_offset", access::read,
            [&](const auto& row) { next = row.int64(0); }, Blob{group}, Blob{topic},
            static_cast<std::int64_t>(partition));
        return next;
    }

    /// @brief Whether this store's transactions do @p hook in their commit: a StoredOffset
    /// request (contract/stored_offset.hpp); any other request is the broker's to do.
    [[nodiscard]] bool accepts_commit_hook(const CommitHook& hook) const noexcept {
        return hook.request_as<StoredOffset>() != nullptr;
    }

    /// @brief Every dead letter, oldest first (redriven entries too: their redriven_at is set).
    [[nodiscard]] std::vector<DeadLetter> dead_letters() { return dead_letters({}); }

    /// @brief The dead letters @p selection takes, oldest first (contract/redrive.hpp).
    [[nodiscard]] std::vector<DeadLetter> dead_letters(const DeadLetterSelection& selection) {
        return redrive_core::list(*this, selection);
    }

    /// @brief Brings the dead letters @p selection takes back, each exactly once
    /// (contract/redrive.hpp), in one transaction per entry (sql/redrive.hpp): the entry marked
    /// redriven, the claim still dead_lettered deleted with its attempt count (a fresh poison
    /// limit), an outbox intent re-publishing the payload under the message id; racing
    /// redrives redrive each entry once. @throws usage_error for a bad rate or a refused
    /// destination; a failed entry is reported (RedriveStatus::failed) and rolled back.
    RedriveReport redrive(const DeadLetterSelection& selection, const RedriveOptions& options) {
        return redrive_core::redrive(*this, selection, options);
    }

    /// @brief Deletes the dead letters @p selection takes (an empty selection takes them all:
    /// callers that purge on an operator's word should insist on one), each entry committed on
    /// its own; their claims stay as they are, so a re-published copy is still answered
    /// `duplicate`. A dry run deletes nothing.
    /// @return the entries deleted (dry run: that would be), oldest first; an entry deleted
    /// meanwhile by another purge is not among them.
    std::vector<DeadLetter> purge_dead_letters(const DeadLetterSelection& selection,
                                               bool dry_run = false) {
        return redrive_core::purge(*this, selection, dry_run);
    }

    /// @brief Takes (or renews) the lock on @p key for @p owner until clock() + @p expire_after
    /// or release_lock(), committed at once; refused while another owner's lock is live (and,
    /// PostgreSQL, while a transaction holds the key with Transaction::try_lock()).
    /// @return false when someone else holds the lock.
    bool hold_lock(std::string_view key, std::string_view owner,
                   std::chrono::milliseconds expire_after) {
        if (owner.empty()) {
            throw usage_error(
                fmt::format("idem {}: hold_lock(): the owner must not be empty", Driver::name));
        }
        Lock lock(*this, "hold_lock()");
        const std::int64_t at = now_ms();
        return driver_.hold_lock(key, owner, at + expire_after.count(), at);
    }

    /// @brief Releases a lock taken with hold_lock(); false when @p owner does not hold it.
    bool release_lock(std::string_view key, std::string_view owner) {
        Lock lock(*this, "release_lock()");
        return driver_.run(stmt::lock_release, "release_lock", access::write, no_rows{}, Blob{key},
                           Blob{owner}) >= 1;
    }

    /// @brief Leases up to @p limit unsent, unparked, due intents, lowest id first, until
    /// clock() + @p lease, in one atomic statement: relays on other threads, processes or hosts
    /// never get a row while its lease lives.
    std::vector<OutboxRow> lease_outbox(std::size_t limit, std::chrono::milliseconds lease) {
        std::vector<OutboxRow> rows;
        if (limit == 0) return rows;
        const auto max_rows = static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max());
        const auto wanted = static_cast<std::int64_t>(limit < max_rows ? limit : max_rows);
        Lock lock(*this, "lease_outbox()");
        const std::int64_t at = now_ms();
        driver_.run(
            stmt::outbox_lease, "lease_outbox", access::write,
            [&](const auto& row) { rows.push_back(read_outbox_row(row)); }, at + lease.count(), at,
            wanted);
        // The order of RETURNING rows is unspecified.
        std::sort(rows.begin(), rows.end(),
                  [](const OutboxRow& a, const OutboxRow& b) { return a.id < b.id; });
        return rows;
    }

    /// @brief Marks an intent sent (sent_at = clock()) and ends its lease.
    /// @throws usage_error when no intent has this id.
    void mark_outbox_sent(std::int64_t id) {
        Lock lock(*this, "mark_outbox_sent()");
        if (driver_.run(stmt::outbox_sent, "mark_outbox_sent", access::write, no_rows{}, id,
                        now_ms()) != 1) {
            throw no_intent(id);
        }
    }

    /// @brief Records a failed send: attempts + 1, last_error, next_attempt_at = @p retry_at,
    /// parked = @p park; ends its lease. @throws usage_error when no intent has this id.
    void mark_outbox_failed(std::int64_t id, std::string_view error,
                            std::chrono::system_clock::time_point retry_at, bool park) {
        Lock lock(*this, "mark_outbox_failed()");
        if (driver_.run(stmt::outbox_failed, "mark_outbox_failed", access::write, no_rows{}, id,
                        Driver::text(error), to_unix_ms(retry_at), park) != 1) {
            throw no_intent(id);
        }
    }

    /// @brief Every committed outbox intent, oldest first.
    [[nodiscard]] std::vector<OutboxRow> outbox_rows() {
        return redrive_core::outbox_rows(*this, stmt::outbox_all);
    }
    /// @brief The committed intents the attempts of message (@p scope, @p id) wrote (its
    /// effect's, its redrives'), oldest first. A scan of the outbox: for operators.
    [[nodiscard]] std::vector<OutboxRow> outbox_rows(std::string_view scope, std::string_view id) {
        return redrive_core::outbox_rows(*this, stmt::outbox_of, Blob{scope}, Blob{id});
    }

  protected:
    /// The store's mutex, held by a transaction until it ends; refuses re-entry from the thread
    /// that holds it (which would otherwise deadlock).
    class Lock {
      public:
        Lock() noexcept = default;
        /// Takes @p store's mutex (@p what names the call in messages). @throws usage_error when
        /// this thread holds it already; in a fork()ed child, what reopening the connection throws.
        Lock(basic_store& store, std::string_view what) : store_(&store) { store.lock(what); }
        /// Takes @p other's hold of the mutex.
        Lock(Lock&& other) noexcept : store_(std::exchange(other.store_, nullptr)) {}
        /// Releases this hold, then takes @p other's.
        Lock& operator=(Lock&& other) noexcept {
            if (this != &other) {
                unlock();
                store_ = std::exchange(other.store_, nullptr);
            }
            return *this;
        }
        Lock(const Lock&) = delete;
        Lock& operator=(const Lock&) = delete;
        ~Lock() { unlock(); }
        /// Releases the mutex now (idempotent).
        void unlock() noexcept {
            if (store_ != nullptr) std::exchange(store_, nullptr)->unlock();
        }

      private:
        basic_store* store_ = nullptr;
    };

    /// Constructs the driver from @p args (it connects), then creates or migrates the schema.
    template <class... Args>
    explicit basic_store(Clock clock, Args&&... args)
        : driver_(std::forward<Args>(args)...), clock_(std::move(clock)) {
        ensure_schema(driver_);
        if constexpr (has_claim_partitions<Driver>::value) driver_.open_claim_partitions(now_ms());
    }
    ~basic_store() {
        // In a fork()ed child that never reopened it, the connection is the parent's: dropped
        // without a word to the server or the file (no Terminate, no checkpoint).
        if (inherited()) forget_inherited();
    }

    /// The driver, for a face's backend-specific members (the connection accessor).
    [[nodiscard]] Driver& driver() noexcept { return driver_; }
    /// The driver, for a face's backend-specific members (const).
    [[nodiscard]] const Driver& driver() const noexcept { return driver_; }

    /// The store's clock: the one given at construction, else the system clock.
    [[nodiscard]] std::chrono::system_clock::time_point now() const {
        return clock_ ? clock_() : std::chrono::system_clock::now();
    }
    /// now() in milliseconds since the Unix epoch, as the tables store times.
    [[nodiscard]] std::int64_t now_ms() const { return to_unix_ms(now()); }

  private:
    friend class basic_transaction<Driver>;
    friend struct paced_purge;
    friend struct redrive_core;

    void lock(std::string_view what) {
        if (owner_.load(std::memory_order_relaxed) == std::this_thread::get_id()) {
            throw usage_error(fmt::format(
                "idem {}: {} called on a thread that holds an open transaction of this {} (it "
                "would deadlock); use that transaction, or commit / roll it back first",
                Driver::name, what, Driver::store_class));
        }
        mutex_.lock();
        owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
        const pid_t pid = this_process();
        if (pid != connection_pid_) {
            try {
                adopt_after_fork(what, pid);
            } catch (...) {
                unlock();
                throw;
            }
        }
    }

    /// First use in a fork()ed child: the inherited connection is the parent's too (a PGconn's
    /// socket would interleave two processes' protocol messages; SQLite forbids using a
    /// connection across fork()). An owned one is dropped and opened anew; a borrowed one
    /// cannot be: usage_error.
    void adopt_after_fork(std::string_view what, pid_t pid) {
        if constexpr (has_fork_hooks<Driver>::value) {
            if (!driver_.owns_connection()) {
                forget_inherited();
                throw usage_error(fmt::format(
                    "idem {}: {} in a fork()ed child (pid {}) on the connection the {} borrowed "
                    "in process {}: a connection must not be used by two processes, and the "
                    "store cannot reopen one it did not open. Open the connection (and the store) "
                    "after fork(), in the child, or let the store open it from a path / "
                    "connection string, which it then reopens in each child",
                    Driver::name, what, pid, Driver::store_class, connection_pid_));
            }
            driver_.reopen_after_fork();
            connection_pid_ = pid;
        } else {
            throw usage_error(fmt::format(
                "idem {}: {} in a fork()ed child (pid {}) on a connection opened in process {}: "
                "this driver cannot reopen it; construct the {} after fork(), in the child",
                Driver::name, what, pid, connection_pid_, Driver::store_class));
        }
    }
    void forget_inherited() noexcept {
        if constexpr (has_fork_hooks<Driver>::value) driver_.forget_inherited();
    }
    static pid_t this_process() noexcept { return idem::detail::current_pid(); }
    [[nodiscard]] bool inherited() const noexcept { return connection_pid_ != this_process(); }
    void unlock() noexcept {
        owner_.store(std::thread::id{}, std::memory_order_relaxed);
        mutex_.unlock();
    }

    static usage_error no_intent(std::int64_t id) {
        return usage_error(fmt::format("idem {}: no outbox intent with id {}", Driver::name, id));
    }

    Driver driver_;
    Clock clock_;
    std::mutex mutex_;
    std::atomic<std::thread::id> owner_{};
    pid_t connection_pid_ = this_process();  ///< the process whose connection driver_ holds
};

/// @brief One transaction on the store's connection, holding the store's mutex.
///
/// Move-only RAII: rolls back in its destructor unless committed, and never throws from it. The
/// effect's own SQL runs through execute() / query_*() (or the connection, from the driver's
/// face: SqliteStore's db(), PostgresStore's conn()) and commits or rolls back with the claim.
/// Every member throws usage_error once the transaction has ended (a second commit() included).
/// It must not outlive its store, and must end on the thread that began it.
template <class Driver>
class basic_transaction : public Driver::template transaction_face<basic_transaction<Driver>> {
  public:
    /// Each savepoint is a statement: the handler avoids them on its common path.
    static constexpr bool cheap_savepoints = false;

    /// @brief Takes @p other's open transaction (and the store's mutex with it); @p other is left
    /// ended.
    basic_transaction(basic_transaction&& other) noexcept
        : store_(std::exchange(other.store_, nullptr)),
          lock_(std::move(other.lock_)),
          state_(std::exchange(other.state_, State::rolled_back)),
          savepoints_(std::exchange(other.savepoints_, 0)),
          own_claims_(std::move(other.own_claims_)),
          offsets_(std::move(other.offsets_)) {}
    /// @brief Rolls back this transaction if it is open (never throws), then takes @p other's.
    basic_transaction& operator=(basic_transaction&& other) noexcept {
        if (this != &other) {
            end_noexcept();
            store_ = std::exchange(other.store_, nullptr);
            lock_ = std::move(other.lock_);
            state_ = std::exchange(other.state_, State::rolled_back);
            savepoints_ = std::exchange(other.savepoints_, 0);
            own_claims_ = std::move(other.own_claims_);
            offsets_ = std::move(other.offsets_);
        }
        return *this;
    }
    basic_transaction(const basic_transaction&) = delete;
    basic_transaction& operator=(const basic_transaction&) = delete;
    /// Rolls back unless committed; never throws.
    ~basic_transaction() { end_noexcept(); }

    /// @brief Inserts the claim (its row says 'processed' until another outcome is recorded,
    /// and is visible to others only after commit) with its payload @p fingerprint.
    /// @return claimed; duplicate with the outcome and fingerprint a finished run recorded
    /// (`recorded` is in_progress when this same transaction claimed the id before); or
    /// in_progress when the wait for another transaction holding the id reached the lock
    /// timeout (PostgreSQL has then aborted the transaction: roll it back, the handler does).
    ClaimResult claim(std::string_view scope, std::string_view id,
                      std::string_view fingerprint = {}) {
        Driver& driver = open("claim()");
        offsets_.claimed(scope, id);
        if (const auto* mine = own_claims_.find(scope, id)) return OwnClaims::duplicate_of(*mine);
        return driver.claim(own_claims_, scope, id, fingerprint, store_->now_ms());
    }

    /// @brief Claims @p ids as claim() would one after the other, in as few statements as the
    /// backend allows (SQLite: multi-row INSERTs of 64 rows; PostgreSQL: one INSERT … unnest).
    /// The first copy of a repeated id is claimed, later copies (and ids this transaction
    /// claimed before) are duplicates with `recorded` in_progress. Used by handle_batch.
    /// @throws usage_error when @p fingerprints is neither empty nor one per id.
    std::vector<ClaimResult> claim_many(std::string_view scope,
                                        const std::vector<std::string_view>& ids,
                                        const std::vector<std::string>& fingerprints = {}) {
        Driver& driver = open("claim_many()");
        if (!fingerprints.empty() && fingerprints.size() != ids.size()) {
            throw usage_error(
                fmt::format("idem {}: claim_many() needs one fingerprint per id", Driver::name));
        }
        if (!offsets_.empty()) {
            for (const std::string_view id : ids)
                offsets_.claimed(scope, id);
        }
        return driver.claim_many(own_claims_, scope, ids, fingerprints, store_->now_ms());
    }

    /// @brief Gives back a claim this transaction made (a batch message that failed: its
    /// savepoint came after the claim): its row is deleted. Does nothing for any other id.
    void unclaim(std::string_view scope, std::string_view id) {
        Driver& driver = open("unclaim()");
        if (own_claims_.remove(scope, id)) {
            driver.write(stmt::claim_delete, "unclaim", Blob{scope}, Blob{id});
        }
    }

    /// @brief Stores the outcome and reason on the claim; does nothing if there is no claim row.
    void record_outcome(std::string_view scope, std::string_view id, Disposition disposition,
                        std::string_view reason) {
        Driver& driver = open("record_outcome()");
        // Our own row already says 'processed' (and no reason): nothing to write.
        if (own_claims_.record(scope, id, disposition, reason, savepoints_)) return;
        driver.write(stmt::record_update, "record_outcome", Blob{scope}, Blob{id},
                     to_string(disposition), Driver::text(reason));
    }

    /// @brief count_attempt() inside this transaction: one more attempt at (@p scope, @p id),
    /// committed with it (a CountAhead's next delivery, counted with the message before).
    std::uint32_t count_attempt(std::string_view scope, std::string_view id) {
        return redrive_core::count_attempt(open("count_attempt()"), this, scope, id,
                                           store_->now_ms());
    }

    /// @brief Inserts a dead letter (created_at from the store's clock when left default).
    void dead_letter(const DeadLetter& letter) {
        Driver& driver = open("dead_letter()");
        offsets_.dead_lettered(letter.scope, letter.message_id);
        const auto created = letter.created_at == std::chrono::system_clock::time_point{}
                                 ? store_->now()
                                 : letter.created_at;
        driver.write(stmt::dead_letter_insert, "dead_letter", Blob{letter.scope},
                     Blob{letter.message_id}, static_cast<std::int64_t>(letter.delivery_count),
                     Driver::text(letter.reason), Blob{letter.payload}, to_unix_ms(created),
                     Blob{letter.origin}, Blob{letter.origin_position});
    }

    /// @brief `SAVEPOINT idem_effect` (may nest).
    void savepoint() {
        open("savepoint()").savepoint();
        own_claims_.savepoint();
        offsets_.savepoint();
        ++savepoints_;
    }

    /// @brief Undoes everything since the latest savepoint() and removes it; also recovers the
    /// transaction from a failed statement of the effect (PostgreSQL).
    void rollback_to_savepoint() {
        Driver& driver = open("rollback_to_savepoint()");
        if (savepoints_ == 0) {
            throw usage_error(fmt::format(
                "idem {}: rollback_to_savepoint() without an open savepoint()", Driver::name));
        }
        driver.rollback_to_savepoint();
        own_claims_.rollback_to_savepoint(savepoints_);
        offsets_.rollback_to_savepoint();
        --savepoints_;
    }

    /// @brief Keeps everything since the latest savepoint() and removes it.
    void release_savepoint() {
        Driver& driver = open("release_savepoint()");
        if (savepoints_ == 0) {
            throw usage_error(fmt::format(
                "idem {}: release_savepoint() without an open savepoint()", Driver::name));
        }
        driver.release_savepoint();
        own_claims_.release_savepoint(savepoints_);
        offsets_.release_savepoint();
        --savepoints_;
    }

    /// @brief Overlap lock on @p key until the transaction ends (released with it, also when
    /// the process dies, so @p expire_after is not needed). @return false when another
    /// transaction or an unexpired Store::hold_lock() holds it.
    bool try_lock(std::string_view key, std::chrono::milliseconds /*expire_after*/) {
        Driver& driver = open("try_lock()");
        return driver.try_lock(key, store_->now_ms());
    }

    /// @brief Adds an outbox intent (created_at = next_attempt_at = clock()) that commits or
    /// rolls back with this transaction. @return false when its idempotency key is already
    /// there.
    bool add_outbox(const OutboxIntent& intent) {
        Driver& driver = open("add_outbox()");
        Driver::check_outbox(intent);
        const OwnClaims::Claim none{}, *writer = own_claims_.current();  // whose effect runs now
        if (writer == nullptr) writer = &none;
        return driver.query(stmt::outbox_insert, "add_outbox", no_rows{}, intent.destination,
                            Blob{intent.idempotency_key}, Blob{intent.payload}, store_->now_ms(),
                            Blob{writer->scope}, Blob{writer->id}) == 1;
    }

    /// @brief The commit-hook capability (contract/commit_hook.hpp; called right after begin()):
    /// true for a StoredOffset hook (contract/stored_offset.hpp). The commit upserts its offset
    /// with the claims and the effect's writes (the greatest wins: it never moves back) and sets
    /// CommitHook::acked_in_commit once it succeeded; not for a message this transaction parks,
    /// claims as a duplicate, or claimed and gave back (a failed or deferred batch message). A
    /// transaction holding nothing but hooks commits them. False, nothing changed, for any other
    /// request. @p hook must outlive the transaction.
    bool attach(CommitHook& hook) {
        open("attach()");
        return offsets_.attach(hook);
    }

    /// @brief Commits. @throws commit_failed (with the server's message) when the database
    /// refuses the commit: everything is rolled back. store_unavailable when the connection is
    /// lost during COMMIT (the outcome is unknown; a redelivery finds the claim if it
    /// committed). usage_error when called twice.
    void commit() {
        Driver& driver = open("commit()", true);
        // A claim nobody recorded an outcome for is stored as claimed, not as the provisional
        // 'processed' its row was inserted with.
        for (const auto& claim : own_claims_.claims()) {
            if (claim.recorded_depth < 0) {
                driver.write(stmt::record_update, "commit", Blob{claim.scope}, Blob{claim.id},
                             "claimed", "");
            }
        }
        const detail::OffsetHooks::Plan offsets =
            offsets_.plan([this](std::string_view scope, std::string_view id) {
                const auto* mine = own_claims_.find(scope, id);
                return mine != nullptr && mine->recorded_depth >= 0;
            });
        const std::int64_t at = offsets.offsets.empty() ? 0 : store_->now_ms();
        for (const StoredOffset& offset : offsets.offsets) {
            driver.write(stmt::offset_upsert, "commit (stored offset)", Blob{offset.group},
                         Blob{offset.topic}, static_cast<std::int64_t>(offset.partition),
                         offset.next_offset, at);
        }
        try {
            driver.commit();
        } catch (...) {
            finish(State::rolled_back);
            throw;
        }
        finish(State::committed);
        detail::OffsetHooks::acknowledge(offsets);
    }

    /// @brief Rolls back now (the destructor does the same).
    void rollback() {
        if (store_ == nullptr) {
            throw usage_error(
                fmt::format("idem {}: rollback() on a moved-from transaction", Driver::name));
        }
        if (state_ == State::committed) {
            throw usage_error(fmt::format(
                "idem {}: rollback() on a transaction that was already committed", Driver::name));
        }
        if (state_ == State::rolled_back) return;
        if (store_->inherited()) {
            end_noexcept();  // begun before fork(): nothing is sent on the parent's connection
            return;
        }
        Driver& driver = store_->driver_;
        const bool ok = driver.rollback_noexcept();
        const std::string error = ok ? std::string() : driver.last_error();
        finish(State::rolled_back);
        if (!ok) {
            throw store_unavailable(
                fmt::format("idem {}: rollback failed: {}", Driver::name, error));
        }
    }

    /// @brief True until commit() or rollback().
    [[nodiscard]] bool active() const noexcept {
        return store_ != nullptr && state_ == State::active;
    }

    /// @brief Runs one statement of the effect with bound @p args (the backend's placeholders
    /// and types: see its store header). @return the affected rows.
    /// @throws store_error with the database's message and the SQL, store_timeout on a lock or
    /// busy timeout, usage_error when the argument count does not match the SQL.
    template <class... Args>
    auto execute(std::string_view sql, const Args&... args) {
        auto changed = open("execute()").execute(context::transaction, sql, args...);
        check("execute()", false, true);
        return changed;
    }
    /// @brief First column of the first row as an integer; empty when no row or NULL.
    template <class... Args>
    std::optional<std::int64_t> query_int(std::string_view sql, const Args&... args) {
        auto value = open("query_int()").query_int(context::transaction, sql, args...);
        check("query_int()", false, true);
        return value;
    }
    /// @brief First column of the first row as bytes (text, or binary decoded); empty when no
    /// row or NULL.
    template <class... Args>
    std::optional<std::string> query_text(std::string_view sql, const Args&... args) {
        auto value = open("query_text()").query_text(context::transaction, sql, args...);
        check("query_text()", false, true);
        return value;
    }

  private:
    friend class basic_store<Driver>;
    friend typename Driver::template transaction_face<basic_transaction>;
    using Lock = typename basic_store<Driver>::Lock;
    enum class State { active, committed, rolled_back };

    /// The driver, or null for a moved-from transaction (for the driver's face).
    [[nodiscard]] Driver* driver_or_null() const noexcept {
        return store_ != nullptr ? &store_->driver_ : nullptr;
    }

    basic_transaction(basic_store<Driver>& store, Lock lock) noexcept
        : store_(&store), lock_(std::move(lock)), state_(State::active) {}

    /// The driver, after checking that this transaction can still be used.
    Driver& open(std::string_view what, bool committing = false) {
        if (store_ == nullptr) {
            throw usage_error(
                fmt::format("idem {}: {} on a moved-from transaction", Driver::name, what));
        }
        if (state_ == State::active && store_->inherited()) {
            throw usage_error(fmt::format(
                "idem {}: {} in a fork()ed child on a transaction begun in the parent: it runs "
                "on the parent's connection; end transactions before fork()",
                Driver::name, what));
        }
        if (state_ != State::active) {
            throw usage_error(fmt::format(
                "idem {}: {} on a transaction that was already {}{}", Driver::name, what,
                state_ == State::committed ? "committed" : "rolled back",
                committing && state_ == State::committed ? " (a second commit() is an error)"
                                                         : ""));
        }
        check(what, committing, false);
        return store_->driver_;
    }

    void check(std::string_view what, bool committing, bool after_user_sql) {
        std::string cause;
        switch (store_->driver_.health(after_user_sql, cause)) {
            case tx_health::ok:
                return;
            case tx_health::lost: {
                finish(State::rolled_back);
                const std::string message =
                    fmt::format("idem {}: {} failed: {}", Driver::name, what, cause);
                if (committing) throw commit_failed(message);
                throw store_unavailable(message);
            }
            case tx_health::ended:
                finish(State::rolled_back);
                throw usage_error(fmt::format(
                    "idem {}: {} failed: the transaction was ended by a statement run through "
                    "the connection (COMMIT, ROLLBACK or END inside the effect?); idem ends its "
                    "own transaction",
                    Driver::name, what));
        }
    }

    void finish(State state) noexcept {
        state_ = state;
        savepoints_ = 0;
        own_claims_.clear();
        offsets_.clear();
        if (store_ != nullptr) store_->driver_.end_transaction();
        lock_.unlock();
    }

    void end_noexcept() noexcept {
        if (active() && store_->inherited()) {
            // Begun before fork(): its ROLLBACK belongs to the parent, on the parent's connection.
            state_ = State::rolled_back;
            own_claims_.clear();
            offsets_.clear();
            lock_.unlock();
            return;
        }
        if (active()) {
            store_->driver_.rollback_noexcept();
            finish(State::rolled_back);
        }
    }

    basic_store<Driver>* store_ = nullptr;
    Lock lock_;
    State state_ = State::rolled_back;
    int savepoints_ = 0;
    OwnClaims own_claims_;         ///< inserted as 'processed': see own_claims.hpp
    detail::OffsetHooks offsets_;  ///< attach()ed StoredOffset hooks, written by commit()
};

}  // namespace sql
IDEM_END_NAMESPACE
