#pragma once
/// @file
/// @brief MemoryStore: a transactional in-process store for users' unit tests, with fault
/// injection so failure paths can be tested. Not durable; one process.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/redrive.hpp"
#include "idem/contract/store.hpp"
#include "idem/contract/stored_offset.hpp"
#include "idem/detail/offset_hooks.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief Store operations MemoryStore::inject() can make fail.
enum class Fault {
    begin,   ///< begin() throws injected_fault (store unreachable)
    claim,   ///< claim() throws injected_fault
    commit,  ///< commit() rolls back and throws commit_failed
};

/// @brief What a MemoryStore is made with.
struct MemoryStoreOptions {
    /// Time source for claimed_at (empty: system clock); set it to test retention.
    Clock clock;
};

/// @brief In-memory store: transactions really roll back, serialised by one mutex (like SQLite's
/// BEGIN IMMEDIATE), so it is thread-safe. The effect's writes to simple collections through the
/// transaction (put/get/erase/count) commit or roll back with the claim. It keeps stored offsets
/// (contract/stored_offset.hpp) as the SQL stores do.
///
/// @code
/// idem::MemoryStore store;
/// store.inject(idem::Fault::commit);   // the next commit fails
/// @endcode
class MemoryStore {
    using ClaimKey = std::pair<std::string, std::string>;  ///< scope, id
    /// Orders by id first (the scope is usually the same: comparing it first compares equal
    /// bytes at every node); finds by string_views without copying them.
    struct ClaimOrder {
        using is_transparent = void;
        template <class A, class B>
        bool operator()(const A& a, const B& b) const noexcept {
            const int by_id = std::string_view(a.second).compare(std::string_view(b.second));
            if (by_id != 0) return by_id < 0;
            return std::string_view(a.first) < std::string_view(b.first);
        }
    };
    using ClaimView = std::pair<std::string_view, std::string_view>;
    using Collection = std::map<std::string, std::string, std::less<>>;

    struct HeldLock {
        std::string owner;
        std::chrono::system_clock::time_point expires_at;
    };
    struct OutboxEntry {
        OutboxRow row;
        std::optional<std::chrono::system_clock::time_point> lease_until;
    };

    /// One entry of the undo log; rollback replays them backwards.
    struct Undo {
        enum class Kind {
            claim_inserted,
            claim_changed,
            dead_letter_added,
            value_changed,
            outbox_added
        };
        Kind kind;
        ClaimKey claim_key;
        ClaimRecord previous_claim;
        std::string collection;
        std::string key;
        std::optional<std::string> previous_value;

        static Undo value(std::string_view collection, std::string_view key,
                          std::optional<std::string> previous) {
            return Undo{Kind::value_changed, {}, {}, std::string(collection), std::string(key),
                        std::move(previous)};
        }
    };

  public:
    /// An empty store.
    explicit MemoryStore(MemoryStoreOptions options = {}) : options_(std::move(options)) {}
    MemoryStore(const MemoryStore&) = delete;
    MemoryStore& operator=(const MemoryStore&) = delete;

    /// @brief A serialised transaction; rolls back in its destructor unless committed.
    class Transaction {
      public:
        /// Takes over @p other's transaction (@p other then holds none).
        Transaction(Transaction&& other) noexcept
            : store_(std::exchange(other.store_, nullptr)),
              lock_(std::move(other.lock_)),
              undo_(std::move(other.undo_)),
              savepoints_(std::move(other.savepoints_)),
              offsets_(std::move(other.offsets_)) {}
        Transaction& operator=(Transaction&&) = delete;
        Transaction(const Transaction&) = delete;
        Transaction& operator=(const Transaction&) = delete;
        ~Transaction() { rollback(); }

        /// @brief Claims (@p scope, @p id) in this transaction: new, or the duplicate with its
        /// recorded outcome (and whether @p fingerprint matches the stored one).
        ClaimResult claim(std::string_view scope, std::string_view id,
                          std::string_view fingerprint = {}) {
            active();
            store_->take_fault(Fault::claim);
            offsets_.claimed(scope, id);
            auto it = store_->claims_.find(ClaimView{scope, id});
            if (it != store_->claims_.end()) {
                ClaimResult duplicate;
                duplicate.status = ClaimStatus::duplicate;
                duplicate.recorded = it->second.disposition;
                duplicate.fingerprint = it->second.fingerprint;
                return duplicate;
            }
            ClaimKey key{std::string(scope), std::string(id)};
            ClaimRecord record;
            record.scope = key.first;
            record.message_id = key.second;
            record.disposition = Disposition::in_progress;
            record.claimed_at = store_->now();
            record.fingerprint = std::string(fingerprint);
            if (undo_.empty()) undo_.reserve(4);
            store_->claims_.emplace(key, std::move(record));
            undo_.push_back(Undo{Undo::Kind::claim_inserted, std::move(key), {}, {}, {}, {}});
            return ClaimResult{};
        }

        /// Records the claim's outcome (processed, rejected, ...) and its reason.
        void record_outcome(std::string_view scope, std::string_view id, Disposition disposition,
                            std::string_view reason) {
            active();
            auto it = store_->claims_.find(ClaimView{scope, id});
            if (it == store_->claims_.end()) return;
            // A claim this transaction made since its latest savepoint goes away with whatever
            // undoes this change: no copy of the record needed.
            if (!inserted_since_savepoint(it->first)) {
                undo_.push_back(Undo{Undo::Kind::claim_changed, it->first, it->second, {}, {}, {}});
            }
            it->second.disposition = disposition;
            it->second.reason = std::string(reason);
        }

        /// Stores @p letter (created_at set to now when empty) with the transaction.
        void dead_letter(const DeadLetter& letter) {
            active();
            offsets_.dead_lettered(letter.scope, letter.message_id);
            DeadLetter stored = letter;
            if (stored.created_at == std::chrono::system_clock::time_point{}) {
                stored.created_at = store_->now();
            }
            auto failed = store_->attempts_.find(ClaimView{letter.scope, letter.message_id});
            if (failed != store_->attempts_.end() && failed->second.failed)
                stored.take(*failed->second.failed);      // its failures, as recorded
            stored.id = ++store_->dead_letter_sequence_;  // as the SQL stores: the row's own
            stored.redrive_count = 0;
            stored.redriven_at.reset();
            store_->dead_letters_.push_back(std::move(stored));
            undo_.push_back(Undo{Undo::Kind::dead_letter_added, {}, {}, {}, {}, {}});
        }

        /// Marks a savepoint (they nest).
        void savepoint() {
            active();
            savepoints_.push_back(undo_.size());
            offsets_.savepoint();
        }
        /// Undoes what followed the latest savepoint, and drops it. @throws usage_error without
        /// one.
        void rollback_to_savepoint() {
            active();
            if (savepoints_.empty())
                throw usage_error("idem::MemoryStore: no savepoint to roll back to");
            undo_to(savepoints_.back());
            savepoints_.pop_back();
            offsets_.rollback_to_savepoint();
        }
        /// Drops the latest savepoint, keeping what followed it. @throws usage_error without one.
        void release_savepoint() {
            active();
            if (savepoints_.empty())
                throw usage_error("idem::MemoryStore: no savepoint to release");
            savepoints_.pop_back();
            offsets_.release_savepoint();
        }

        /// @brief Stored offsets (contract/stored_offset.hpp): true for a StoredOffset hook; its
        /// commit stores the offset (the greatest wins) and sets acked_in_commit, as the SQL
        /// stores do, except for a message this transaction parks, claims as a duplicate or
        /// rolls back to a savepoint. @p hook must outlive the transaction.
        bool attach(CommitHook& hook) {
            active();
            return offsets_.attach(hook);
        }

        /// @throws commit_failed when a commit fault was injected (everything is rolled back).
        void commit() {
            active();
            if (store_->fault_pending(Fault::commit)) {
                rollback();
                throw commit_failed("idem::MemoryStore: injected commit failure");
            }
            const detail::OffsetHooks::Plan offsets =
                offsets_.plan([this](std::string_view scope, std::string_view id) {
                    return settled_here(ClaimKey{std::string(scope), std::string(id)});
                });
            for (const StoredOffset& offset : offsets.offsets)
                store_->store_offset(offset);
            undo_.clear();
            savepoints_.clear();
            finish();
            detail::OffsetHooks::acknowledge(offsets);
        }

        /// Undoes everything; a no-op after commit or rollback. Never throws.
        void rollback() noexcept {
            if (store_ == nullptr) return;
            undo_to(0);
            finish();
        }

        /// @brief Overlap lock for the rest of this transaction: transactions never overlap, so
        /// only a lock held with MemoryStore::hold_lock() can refuse it.
        bool try_lock(std::string_view key, std::chrono::milliseconds /*expire_after*/) {
            active();
            return !store_->lock_held_by_other(key, {});
        }

        /// @brief Adds an outbox intent; false when its idempotency key is already there.
        bool add_outbox(const OutboxIntent& intent) {
            active();
            if (store_->outbox_keys_.count(intent.idempotency_key) != 0) return false;
            OutboxRow row;
            row.id = ++store_->outbox_sequence_;
            row.destination = intent.destination;
            row.idempotency_key = intent.idempotency_key;
            row.payload = intent.payload;
            row.created_at = row.next_attempt_at = store_->now();
            for (const Undo& u : undo_) {  // whose effect runs now: the first claim in progress
                auto claim = store_->claims_.find(u.claim_key);  // (a claim given back: gone)
                if (u.kind != Undo::Kind::claim_inserted || claim == store_->claims_.end() ||
                    claim->second.disposition != Disposition::in_progress) {
                    continue;
                }
                std::tie(row.scope, row.message_id) = u.claim_key;
                break;
            }
            store_->outbox_keys_.insert(row.idempotency_key);
            store_->outbox_.push_back(OutboxEntry{std::move(row), {}});
            undo_.push_back(Undo{Undo::Kind::outbox_added, {}, {}, {}, {}, {}});
            return true;
        }

        // --- the effect's own data, committed or rolled back with the claim ---

        /// Sets collection[key] = value.
        void put(std::string_view collection, std::string_view key, std::string_view value) {
            active();
            auto& values = store_->collections_[std::string(collection)];
            auto it = values.find(key);
            std::optional<std::string> previous;
            if (it != values.end()) previous = std::exchange(it->second, std::string(value));
            if (!previous) values.emplace(std::string(key), std::string(value));
            undo_.push_back(Undo::value(collection, key, std::move(previous)));
        }
        /// Removes collection[key] if present; returns whether it was.
        bool erase(std::string_view collection, std::string_view key) {
            active();
            auto& values = store_->collections_[std::string(collection)];
            auto it = values.find(key);
            if (it == values.end()) return false;
            undo_.push_back(Undo::value(collection, key, it->second));
            values.erase(it);
            return true;
        }
        /// collection[key] as this transaction sees it (its own writes included).
        [[nodiscard]] std::optional<std::string> get(std::string_view collection,
                                                     std::string_view key) const {
            active();
            return store_->get_locked(collection, key);
        }
        /// The number of keys in @p collection, as this transaction sees it.
        [[nodiscard]] std::size_t count(std::string_view collection) const {
            active();
            return store_->count_locked(collection);
        }

      private:
        friend class MemoryStore;
        Transaction(MemoryStore& store, std::unique_lock<std::mutex> lock)
            : store_(&store), lock_(std::move(lock)) {}

        void active() const {
            if (store_ == nullptr) {
                throw usage_error(
                    "idem::MemoryStore: the transaction is already committed or rolled back");
            }
        }

        /// Looks at the last few entries only: a miss merely keeps a copy not needed.
        bool inserted_since_savepoint(const ClaimKey& key) const noexcept {
            const std::size_t mark = savepoints_.empty() ? 0 : savepoints_.back();
            const std::size_t floor = undo_.size() > 8 ? std::max(mark, undo_.size() - 8) : mark;
            for (std::size_t i = undo_.size(); i > floor; --i) {
                const Undo& u = undo_[i - 1];
                if (u.kind == Undo::Kind::claim_inserted && u.claim_key == key) return true;
            }
            return false;
        }

        void undo_to(std::size_t mark) noexcept {
            while (undo_.size() > mark) {
                Undo& u = undo_.back();
                switch (u.kind) {
                    case Undo::Kind::claim_inserted:
                        store_->claims_.erase(u.claim_key);
                        break;
                    case Undo::Kind::claim_changed:
                        store_->claims_[u.claim_key] = std::move(u.previous_claim);
                        break;
                    case Undo::Kind::dead_letter_added:
                        store_->dead_letters_.pop_back();
                        break;
                    case Undo::Kind::outbox_added:
                        store_->outbox_keys_.erase(store_->outbox_.back().row.idempotency_key);
                        store_->outbox_.pop_back();
                        break;
                    case Undo::Kind::value_changed: {
                        auto& values = store_->collections_[u.collection];
                        if (u.previous_value) {
                            values[u.key] = std::move(*u.previous_value);
                        } else {
                            values.erase(u.key);
                        }
                        break;
                    }
                }
                undo_.pop_back();
            }
        }

        /// This transaction inserted the claim of @p key and recorded an outcome on it.
        bool settled_here(const ClaimKey& key) const {
            auto it = store_->claims_.find(key);
            if (it == store_->claims_.end() || it->second.disposition == Disposition::in_progress)
                return false;
            return std::any_of(undo_.begin(), undo_.end(), [&key](const Undo& u) {
                return u.kind == Undo::Kind::claim_inserted && u.claim_key == key;
            });
        }

        void finish() noexcept {
            offsets_.clear();
            store_->owner_.store(std::thread::id{}, std::memory_order_relaxed);
            store_ = nullptr;
            lock_ = {};
        }

        MemoryStore* store_;
        std::unique_lock<std::mutex> lock_;
        std::vector<Undo> undo_;
        std::vector<std::size_t> savepoints_;
        detail::OffsetHooks offsets_;
    };

    /// @brief Starts a transaction; blocks while another thread holds one. @throws usage_error
    /// on a thread holding one already (it would deadlock); injected_fault for a begin fault.
    Transaction begin() {
        if (owner_.load(std::memory_order_relaxed) == std::this_thread::get_id()) {
            throw usage_error(
                "idem::MemoryStore: begin() while this thread already holds a transaction on "
                "this store (nested handle() inside an effect?)");
        }
        std::unique_lock<std::mutex> lock(mutex_);
        owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
        Transaction tx(*this, std::move(lock));
        take_fault(Fault::begin);  // tx's destructor releases the lock if this throws
        return tx;
    }

    /// @brief Makes the next `times` operations of this kind fail (see Fault).
    void inject(Fault fault, int times = 1) {
        std::lock_guard<std::mutex> lock(fault_mutex_);
        faults_[static_cast<std::size_t>(fault)] += times;
    }
    /// @brief Forgets the injected faults not used yet (of one kind): the "server" is back.
    void clear_faults(Fault fault) {
        std::lock_guard<std::mutex> lock(fault_mutex_);
        faults_[static_cast<std::size_t>(fault)] = 0;
    }

    /// @brief Deletes claims, sent intents and attempt counters older than clock() - @p older_than
    /// and the expired held locks; dead letters, unsent and parked intents and stored offsets
    /// stay. One step (nothing to pace in memory), unless options.should_stop says stop.
    PurgeResult purge(std::chrono::system_clock::duration older_than,
                      const PurgeOptions& options = {}) {
        if (older_than.count() < 0)
            throw usage_error("idem::MemoryStore: purge() needs a non-negative age");
        options.validate("idem::MemoryStore: purge()");
        PurgeResult result;
        result.complete = !(options.should_stop && options.should_stop());
        if (!result.complete) return result;
        std::lock_guard<std::mutex> lock(mutex_);
        const auto at = now();
        const auto cutoff = at - older_than;
        result.claims = erase_where(claims_, [&](const auto& c) { return c.claimed_at < cutoff; });
        // No transaction is open (we hold its mutex), so no undo entry points into outbox_.
        const auto sent_before_cutoff = [&](const OutboxEntry& entry) {
            return entry.row.sent_at && *entry.row.sent_at < cutoff && !entry.row.parked;
        };
        for (const auto& entry : outbox_)
            if (sent_before_cutoff(entry)) outbox_keys_.erase(entry.row.idempotency_key);
        const auto kept = std::remove_if(outbox_.begin(), outbox_.end(), sent_before_cutoff);
        result.sent_intents = static_cast<std::size_t>(outbox_.end() - kept);
        outbox_.erase(kept, outbox_.end());
        result.expired_locks =
            erase_where(held_locks_, [&](const HeldLock& l) { return l.expires_at < at; });
        result.attempt_counts =
            erase_where(attempts_, [&](const AttemptCount& a) { return a.counted_at < cutoff; });
        result.batches = 1;
        if (options.on_batch) options.on_batch(result);
        return result;
    }

    /// @brief Counts one more attempt at (@p scope, @p id) and returns the count, this one
    /// included; a transaction rolled back afterwards leaves it (as the SQL stores' short commit
    /// does). @throws usage_error on a thread that holds a transaction of this store.
    std::uint32_t count_attempt(std::string_view scope, std::string_view id) {
        if (owner_.load(std::memory_order_relaxed) == std::this_thread::get_id()) {
            throw usage_error(
                "idem::MemoryStore: count_attempt() while this thread holds a transaction on "
                "this store; count before begin()");
        }
        std::lock_guard<std::mutex> lock(mutex_);
        AttemptCount& count = attempts_[ClaimKey{std::string(scope), std::string(id)}];
        if (count.attempts < std::numeric_limits<std::uint32_t>::max()) ++count.attempts;
        count.counted_at = now();
        return count.attempts;
    }

    /// @brief Records a failure of the effect of (@p scope, @p id) for its later dead letter
    /// (@p keep_for: for stores that expire it); skipped on a thread holding a transaction.
    void note_failure(std::string_view scope, std::string_view id, std::string_view failure,
                      std::chrono::seconds /*keep_for*/) {
        if (owner_.load(std::memory_order_relaxed) == std::this_thread::get_id()) return;
        // The record is the attempt count's: purged with it, cleared by a redrive.
        std::lock_guard<std::mutex> lock(mutex_);
        AttemptCount& count = attempts_[ClaimKey{std::string(scope), std::string(id)}];
        count.counted_at = now();
        if (!count.failed) count.failed = NotedFailure{{}, count.counted_at, {}};
        count.failed->last = count.counted_at;
        count.failed->text = std::string(failure);
    }

    /// @brief What note_failure() recorded for (@p scope, @p id); nothing on a thread that holds
    /// a transaction of this store.
    [[nodiscard]] std::optional<NotedFailure> noted_failure(std::string_view scope,
                                                            std::string_view id) {
        if (owner_.load(std::memory_order_relaxed) == std::this_thread::get_id()) return {};
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = attempts_.find(ClaimView{scope, id});
        return it == attempts_.end() ? std::nullopt : it->second.failed;
    }

    /// @brief The attempts count_attempt() counted for (@p scope, @p id); 0 when none.
    [[nodiscard]] std::uint32_t attempts(std::string_view scope, std::string_view id) {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = attempts_.find(ClaimView{scope, id});
        return it == attempts_.end() ? 0 : it->second.attempts;
    }

    /// @brief The next offset to read a commit stored for (@p group, @p topic, @p partition).
    [[nodiscard]] std::optional<std::int64_t> stored_offset(std::string_view group,
                                                            std::string_view topic,
                                                            std::int32_t partition) {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = offsets_.find(OffsetKey{std::string(group), std::string(topic), partition});
        return it == offsets_.end() ? std::nullopt : std::optional<std::int64_t>(it->second);
    }

    /// @brief Whether this store's transactions do @p hook in their commit: a StoredOffset.
    [[nodiscard]] bool accepts_commit_hook(const CommitHook& hook) const noexcept {
        return hook.request_as<StoredOffset>() != nullptr;
    }

    /// The committed claim of (@p scope, @p id), if any.
    [[nodiscard]] std::optional<ClaimRecord> find_claim(std::string_view scope,
                                                        std::string_view id) {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = claims_.find(ClaimView{scope, id});
        return it == claims_.end() ? std::nullopt : std::optional<ClaimRecord>(it->second);
    }

    /// Every committed dead letter, oldest first (redriven entries too: redriven_at is set).
    [[nodiscard]] std::vector<DeadLetter> dead_letters() { return dead_letters({}); }

    /// The committed dead letters @p selection takes, oldest first (contract/redrive.hpp).
    [[nodiscard]] std::vector<DeadLetter> dead_letters(const DeadLetterSelection& selection) {
        std::lock_guard<std::mutex> lock(mutex_);
        std::vector<DeadLetter> letters;
        for (const DeadLetter& letter : dead_letters_) {
            if (selection.full(letters.size())) break;
            if (selection.matches(letter)) letters.push_back(letter);
        }
        return letters;
    }

    /// @brief Brings the selected dead letters back, each exactly once, as the SQL stores do:
    /// per entry, the entry marked redriven, the claim still dead_lettered removed with its
    /// attempt count, an outbox intent re-publishing the payload under the message id. An
    /// injected Fault::commit or Fault::begin fails the entry with nothing changed.
    RedriveReport redrive(const DeadLetterSelection& selection, const RedriveOptions& options) {
        options.validate("idem::MemoryStore: redrive()");
        return detail::run_redrive(
            dead_letters(selection), options,
            [this](const std::string& scope, const std::string& id) {
                return find_claim(scope, id);
            },
            [this](std::int64_t id) -> std::optional<DeadLetter> {
                std::lock_guard<std::mutex> lock(mutex_);
                for (const DeadLetter& letter : dead_letters_)
                    if (letter.id == id) return letter;
                return std::nullopt;
            },
            [&](const DeadLetter& letter) { return redrive_one(letter, options); });
    }

    /// @brief Deletes the dead letters @p selection takes, as the SQL stores do (their claims
    /// stay); a dry run deletes nothing. @return the entries deleted (or that would be).
    std::vector<DeadLetter> purge_dead_letters(const DeadLetterSelection& selection,
                                               bool dry_run = false) {
        std::lock_guard<std::mutex> lock(mutex_);
        std::vector<DeadLetter> letters;
        const auto taken = [&](const DeadLetter& letter) {
            if (selection.full(letters.size()) || !selection.matches(letter)) return false;
            letters.push_back(letter);
            return !dry_run;
        };
        dead_letters_.erase(std::remove_if(dead_letters_.begin(), dead_letters_.end(), taken),
                            dead_letters_.end());
        return letters;
    }

    /// @brief Takes (or renews) a lock held outside any transaction, by `owner`, until
    /// `expire_after` passes or release_lock(); false when another owner holds it.
    bool hold_lock(std::string_view key, std::string_view owner,
                   std::chrono::milliseconds expire_after) {
        if (owner.empty()) throw usage_error("idem::MemoryStore: hold_lock(): empty owner");
        std::lock_guard<std::mutex> lock(mutex_);
        if (lock_held_by_other(key, owner)) return false;
        held_locks_[std::string(key)] = HeldLock{std::string(owner), now() + expire_after};
        return true;
    }

    /// @brief Releases a lock taken with hold_lock(); false when `owner` does not hold it.
    bool release_lock(std::string_view key, std::string_view owner) {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = held_locks_.find(key);
        if (it == held_locks_.end() || it->second.owner != owner) return false;
        held_locks_.erase(it);
        return true;
    }

    /// @brief Leases up to `limit` unsent, unparked intents that are due, oldest first; a leased
    /// intent is not handed out again until the lease passes or it is marked.
    std::vector<OutboxRow> lease_outbox(std::size_t limit, std::chrono::milliseconds lease) {
        std::lock_guard<std::mutex> lock(mutex_);
        const auto at = now();
        std::vector<OutboxRow> rows;
        for (auto& entry : outbox_) {
            if (rows.size() >= limit) break;
            const OutboxRow& row = entry.row;
            if (row.sent_at || row.parked || row.next_attempt_at > at) continue;
            if (entry.lease_until && *entry.lease_until > at) continue;
            entry.lease_until = at + lease;
            rows.push_back(row);
        }
        return rows;
    }

    /// Marks outbox intent @p id sent (for a Relay). @throws usage_error for an unknown id.
    void mark_outbox_sent(std::int64_t id) {
        std::lock_guard<std::mutex> lock(mutex_);
        OutboxEntry& entry = outbox_entry(id);
        entry.row.sent_at = now();
        entry.lease_until.reset();
    }

    /// @brief Counts a failed send of intent @p id, with @p error, retried at @p retry_at or
    /// parked (@p park). @throws usage_error for an unknown id.
    void mark_outbox_failed(std::int64_t id, std::string_view error,
                            std::chrono::system_clock::time_point retry_at, bool park) {
        std::lock_guard<std::mutex> lock(mutex_);
        OutboxEntry& entry = outbox_entry(id);
        ++entry.row.attempts;
        entry.row.last_error = std::string(error);
        entry.row.next_attempt_at = retry_at;
        entry.row.parked = park;
        entry.lease_until.reset();
    }

    /// Every committed outbox intent, oldest first.
    [[nodiscard]] std::vector<OutboxRow> outbox_rows() {
        std::lock_guard<std::mutex> lock(mutex_);
        std::vector<OutboxRow> rows;
        for (const auto& entry : outbox_)
            rows.push_back(entry.row);
        return rows;
    }
    /// @brief The intents the attempts of message (@p scope, @p id) wrote, oldest first.
    [[nodiscard]] std::vector<OutboxRow> outbox_rows(std::string_view scope, std::string_view id) {
        std::lock_guard<std::mutex> lock(mutex_);
        std::vector<OutboxRow> rows;
        for (const auto& entry : outbox_)
            if (entry.row.scope == scope && entry.row.message_id == id) rows.push_back(entry.row);
        return rows;
    }

    /// The number of committed claims.
    [[nodiscard]] std::size_t claim_count() {
        std::lock_guard<std::mutex> lock(mutex_);
        return claims_.size();
    }

    /// Committed value of collection[key].
    [[nodiscard]] std::optional<std::string> get(std::string_view collection,
                                                 std::string_view key) {
        std::lock_guard<std::mutex> lock(mutex_);
        return get_locked(collection, key);
    }

    /// Committed number of entries in a collection.
    [[nodiscard]] std::size_t count(std::string_view collection) {
        std::lock_guard<std::mutex> lock(mutex_);
        return count_locked(collection);
    }

  private:
    /// One entry's redrive, in a transaction (which it leaves to roll back an empty undo log:
    /// every change is made once all is checked, the injected commit fault included).
    bool redrive_one(const DeadLetter& letter, const RedriveOptions& options) {
        Transaction tx = begin();
        auto entry = std::find_if(dead_letters_.begin(), dead_letters_.end(),
                                  [&](const DeadLetter& l) { return l.id == letter.id; });
        if (entry == dead_letters_.end() || entry->redriven_at) return false;
        const ClaimView key{letter.scope, letter.message_id};
        auto claim = claims_.find(key);
        if (claim == claims_.end() || claim->second.disposition != Disposition::dead_lettered) {
            return false;
        }
        if (fault_pending(Fault::commit)) {
            throw commit_failed("idem::MemoryStore: injected commit failure (redrive)");
        }
        std::uint32_t before = 0;
        for (const DeadLetter& l : dead_letters_) {
            if (l.scope == letter.scope && l.message_id == letter.message_id) {
                before = std::max(before, l.redrive_count);
            }
        }
        claims_.erase(claim);
        auto counted = attempts_.find(key);
        if (counted != attempts_.end()) attempts_.erase(counted);
        entry->redrive_count = before + 1;
        entry->redriven_at = now();
        const OutboxIntent intent = redrive_intent(letter, redrive_destination(letter, options));
        if (outbox_keys_.count(intent.idempotency_key) == 0) {
            tx.add_outbox(intent);
            std::tie(outbox_.back().row.scope, outbox_.back().row.message_id) = key;
            tx.undo_.clear();  // kept: the redrive's change, as the rest
            return true;
        }
        for (auto& out : outbox_) {
            if (out.row.idempotency_key != intent.idempotency_key) continue;
            out.row.destination = intent.destination;
            out.row.payload = intent.payload;
            out.row.sent_at.reset();
            out.row.attempts = 0;
            out.row.last_error.clear();
            out.row.created_at = out.row.next_attempt_at = now();  // written anew: a new mark
            out.row.parked = false;
            out.lease_until.reset();
        }
        return true;
    }

    using OffsetKey =
        std::tuple<std::string, std::string, std::int32_t>;  ///< group, topic, partition

    /// Caller holds a transaction. The greatest offset wins.
    void store_offset(const StoredOffset& offset) {
        auto [it, added] = offsets_.try_emplace(
            OffsetKey{offset.group, offset.topic, offset.partition}, offset.next_offset);
        if (!added) it->second = std::max(it->second, offset.next_offset);
    }

    std::chrono::system_clock::time_point now() const {
        return options_.clock ? options_.clock() : std::chrono::system_clock::now();
    }

    bool fault_pending(Fault fault) {
        std::lock_guard<std::mutex> lock(fault_mutex_);
        int& left = faults_[static_cast<std::size_t>(fault)];
        if (left <= 0) return false;
        --left;
        return true;
    }

    void take_fault(Fault fault) {
        if (!fault_pending(fault)) return;
        throw injected_fault(fmt::format("idem::MemoryStore: injected failure in {}()",
                                         fault == Fault::begin ? "begin" : "claim"));
    }

    std::optional<std::string> get_locked(std::string_view collection, std::string_view key) const {
        auto c = collections_.find(collection);
        if (c == collections_.end()) return std::nullopt;
        auto it = c->second.find(key);
        if (it == c->second.end()) return std::nullopt;
        return it->second;
    }

    /// Caller holds mutex_ (or a transaction, which holds it).
    bool lock_held_by_other(std::string_view key, std::string_view owner) const {
        auto it = held_locks_.find(key);
        if (it == held_locks_.end()) return false;
        return it->second.owner != owner && it->second.expires_at > now();
    }

    OutboxEntry& outbox_entry(std::int64_t id) {
        for (auto& entry : outbox_) {
            if (entry.row.id == id) return entry;
        }
        throw usage_error(fmt::format("idem::MemoryStore: no outbox intent with id {}", id));
    }

    /// Erases the entries of @p map whose value @p expired says so; answers how many.
    template <class Map, class Expired>
    static std::size_t erase_where(Map& map, Expired&& expired) {
        std::size_t erased = 0;
        for (auto it = map.begin(); it != map.end();)
            it = expired(it->second) ? (++erased, map.erase(it)) : std::next(it);
        return erased;
    }

    std::size_t count_locked(std::string_view collection) const {
        auto c = collections_.find(collection);
        return c == collections_.end() ? 0 : c->second.size();
    }

    MemoryStoreOptions options_;
    std::mutex mutex_;
    std::atomic<std::thread::id> owner_{};
    std::map<ClaimKey, ClaimRecord, ClaimOrder> claims_;
    struct AttemptCount {
        std::uint32_t attempts = 0;
        std::chrono::system_clock::time_point counted_at{};
        std::optional<NotedFailure> failed{};  ///< what note_failure() recorded
    };
    std::map<ClaimKey, AttemptCount, ClaimOrder> attempts_;
    std::vector<DeadLetter> dead_letters_;
    std::int64_t dead_letter_sequence_ = 0;
    std::map<std::string, Collection, std::less<>> collections_;
    std::mutex fault_mutex_;
    int faults_[3] = {0, 0, 0};
    std::map<std::string, HeldLock, std::less<>> held_locks_;
    std::vector<OutboxEntry> outbox_;
    std::set<std::string> outbox_keys_;
    std::int64_t outbox_sequence_ = 0;
    std::map<OffsetKey, std::int64_t> offsets_;  ///< next offset, by group, topic, partition
};

IDEM_END_NAMESPACE
