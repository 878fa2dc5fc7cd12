#pragma once
/// @file
/// @brief The values a store exchanges with the handler and its users (ClaimResult,
/// ClaimStatus, ClaimTerms, ClaimRecord, DeadLetter, the outbox records, PurgeResult). The
/// clock and the time helpers a store stamps them with are in contract/time.hpp; the
/// capabilities a store offers are in contract/store.hpp.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/time.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief Answer of Transaction::claim().
enum class ClaimStatus {
    claimed,      ///< this transaction now owns the id
    duplicate,    ///< a finished run already recorded an outcome for it
    in_progress,  ///< another live worker holds it (lease stores, lock timeouts)
};

/// @brief Answer of Transaction::claim(): whether this transaction now owns the id and, when it
/// does not, what the store knows of the claim that holds it.
struct ClaimResult {
    /// Claimed, duplicate or in_progress.
    ClaimStatus status = ClaimStatus::claimed;
    /// For a duplicate: the outcome the earlier run recorded.
    Disposition recorded = Disposition::processed;
    /// For a duplicate: the payload fingerprint stored with the first claim (empty if none).
    std::string fingerprint{};
    /// Stores that keep a claim across attempts (leases) count the times the effect started,
    /// this one included; the poison check then uses it instead of the broker's count.
    std::optional<std::uint32_t> attempts{};
    /// For in_progress on a lease store: how long the holder's lease still runs (the earliest
    /// a redelivery can take it over); unset when the store cannot tell (SQL lock timeouts).
    std::optional<std::chrono::milliseconds> retry_after{};
};

/// @brief What a handler's policy asks of the claims it makes, for stores that hold claims as
/// leases and expire them themselves (Redis).
struct ClaimTerms {
    /// How long the claim is held before another worker may take it over; unset: the store's
    /// default.
    std::optional<std::chrono::milliseconds> lease{};
    /// How long a finished claim is kept.
    std::chrono::seconds retention{};
};

/// @brief What Tx::claim_and_commit() is asked (a local effect's one step; effects/local.hpp):
/// claim (scope, message_id) and, only if it is new or its claim was released or has expired,
/// commit the transaction's queued writes with the claim recorded as `outcome`.
struct ClaimAndCommit {
    /// The handler's policy scope: with message_id, the claim's key, as claim()'s.
    std::string_view scope;
    /// The delivery's message id.
    std::string_view message_id;
    std::string_view fingerprint;  ///< stored with a new claim, as claim()'s
    /// processed or rejected, recorded with the claim (and acked by attached hooks); unset: the
    /// effect threw, so the attempt is counted, nothing is applied and the id stays free.
    std::optional<Disposition> outcome{};
    /// Recorded with `outcome` (e.g. a rejection's reason), as record_outcome()'s.
    std::string_view reason;
    /// The poison limit: a takeover whose attempt would reach it applies nothing (at_limit), so
    /// the handler takes the ordinary path, which dead-letters it.
    std::uint32_t max_attempts = 5;
};

/// @brief Answer of Tx::claim_and_commit().
enum class ClaimAndCommitStatus {
    committed,    ///< claimed and committed (or, for an unset outcome, the attempt counted)
    duplicate,    ///< a finished run recorded it: nothing applied
    in_progress,  ///< another live worker holds it: nothing applied
    at_limit,     ///< a takeover would reach max_attempts: nothing applied
    /// the store cannot do these writes in one step with the claim: nothing claimed, nothing
    /// applied; the handler takes the ordinary path and runs the effect again there. None of
    /// idem's stores answers it (a Redis Cluster write outside the claim's hash slot goes in
    /// two steps instead), so that an effect runs at most once per attempt.
    not_attempted,
};

/// @brief Answer of Tx::claim_and_commit(): what was done, and what claim() would have answered.
struct ClaimAndCommitResult {
    /// What was done (and applied).
    ClaimAndCommitStatus status = ClaimAndCommitStatus::committed;
    /// What claim() would have answered: for a duplicate its recorded outcome and fingerprint,
    /// for in_progress retry_after; attempts (this one included) when the store knows it.
    ClaimResult claim{};
};

/// @brief Answer of Tx::commit_with_next_claim(): one transaction's commit and the next
/// transaction's claim, sent in one round trip.
struct CommitAndClaimResult {
    /// Null when the commit went through; else what commit() would have thrown (commit_failed,
    /// a store error): the committing transaction is rolled back, its message is `failed`.
    std::exception_ptr commit_error{};
    /// The next transaction's claim, as claim() answers it, whatever the commit's fate: the
    /// two are different ids, so a refused commit does not touch the fresh lease.
    ClaimResult next{};
    /// Null when `next` is the claim's answer; else what claim() would have thrown (a store
    /// error in a round trip after the commit's): the commit's fate is commit_error's, and the
    /// next message is `failed` (its lease, if it was taken, is released with its transaction).
    std::exception_ptr next_error{};
};

/// @brief A stored claim, for inspection and tests.
struct ClaimRecord {
    /// The handler's policy scope the claim was made in.
    std::string scope;
    /// The claimed delivery's message id.
    std::string message_id;
    /// The outcome recorded for it.
    Disposition disposition = Disposition::processed;
    /// Recorded with the outcome; may be empty.
    std::string reason;
    /// When the claim was made, by the store's clock; purge(older_than) compares it with its
    /// cutoff.
    std::chrono::system_clock::time_point claimed_at{};
    /// Fingerprint of the payload's stable part, when the handler computes one.
    std::string fingerprint{};
};

/// @brief An effect that leaves the database, written in the claim's transaction and shipped
/// later by a Relay with its idempotency key (see outbox.hpp).
struct OutboxIntent {
    std::string destination;      ///< where the relay sends it (a rail, a queue, a topic)
    std::string idempotency_key;  ///< unique; the receiver dedupes on it
    /// The body the receiver gets, as the relay sends it.
    std::string payload;
};

/// @brief A stored outbox intent with its delivery state.
struct OutboxRow {
    std::int64_t id = 0;  ///< insertion order: the relay ships in this order
    /// As OutboxIntent::destination.
    std::string destination;
    /// As OutboxIntent::idempotency_key.
    std::string idempotency_key;
    /// As OutboxIntent::payload.
    std::string payload;
    /// When the intent was written, by the store's clock.
    std::chrono::system_clock::time_point created_at{};
    /// When the relay marked it sent; unset while it is unsent (or parked).
    std::optional<std::chrono::system_clock::time_point> sent_at{};
    std::uint32_t attempts = 0;  ///< failed sends so far
    /// The last failed send's error; empty when none.
    std::string last_error;
    /// The earliest time the relay may lease it again (a failed send's backoff).
    std::chrono::system_clock::time_point next_attempt_at{};
    bool parked = false;  ///< gave up after too many failures; a human looks at it
    /// The message whose attempt wrote it (the claim its effect ran under, or the redrive that
    /// re-publishes it): its policy scope and id; empty when written outside any (a store of
    /// an older schema, an intent added with no claim in the transaction).
    std::string scope{};
    std::string message_id{};  ///< see scope
};

/// @brief Answer of Store::purge(older_than): what it deleted. Dead letters, unsent intents and
/// parked intents are never purged: they wait for a relay or a human.
struct PurgeResult {
    std::size_t claims = 0;          ///< claims whose claimed_at is before the cutoff
    std::size_t sent_intents = 0;    ///< outbox intents sent before the cutoff
    std::size_t expired_locks = 0;   ///< locks held with hold_lock() that have expired
    std::size_t attempt_counts = 0;  ///< count_attempt() counters last counted before the cutoff
    std::size_t batches = 0;         ///< delete statements run (each its own transaction)
    /// Claim partitions dropped whole (PostgresOptions::claim_partition_span); their claims
    /// are counted in `claims`.
    std::size_t partitions_dropped = 0;
    /// False when the run stopped before it was done (its time budget, or should_stop): what
    /// is left is purged by the next run.
    bool complete = true;
    std::chrono::nanoseconds elapsed{0};  ///< the run's wall-clock time, pauses included

    /// @brief Rows deleted, all kinds together.
    [[nodiscard]] std::size_t rows() const noexcept {
        return claims + sent_intents + expired_locks + attempt_counts;
    }
    /// @brief rows() per second of elapsed().
    [[nodiscard]] double rows_per_second() const noexcept {
        const double seconds = std::chrono::duration<double>(elapsed).count();
        return seconds > 0 ? static_cast<double>(rows()) / seconds : 0.0;
    }
};

/// @brief How Store::purge(older_than, options) paces itself beside live consumers. Each batch
/// is one delete statement in a transaction of its own, over the next `batch_rows` rows in the
/// time column's order (a cursor: a batch walks only its own rows, never the ones deleted
/// before it); between two batches the purge sleeps, so the writers it shares the database with
/// get their turn. The defaults keep the purge to a tenth of the wall-clock time: beside a
/// consumer at full speed it kept 0.8 of that consumer's rate or more on SQLite, PostgreSQL,
/// MariaDB and Redis (docs/performance.md, "Purge under load").
struct PurgeOptions {
    /// Rows per delete statement (and transaction), at least 1. Smaller batches hold locks
    /// (SQLite: the single writer's) for less time each.
    std::size_t batch_rows = 1000;
    /// The share of wall-clock time the purge may spend deleting, in (0, 1]: after a batch that
    /// took t it sleeps t * (1 / duty_cycle - 1). 1: no sleep.
    double duty_cycle = 0.1;
    /// At most this many rows per second over the run (0: no cap), by sleeping between batches.
    double max_rows_per_second = 0;
    /// Stop after this long (0: no budget); PurgeResult::complete says whether it finished.
    std::chrono::milliseconds time_budget{0};
    /// Asked between batches (and during the pauses); true stops the run cleanly.
    std::function<bool()> should_stop{};
    /// Told the totals so far after each batch (progress for logs and metrics).
    std::function<void(const PurgeResult&)> on_batch{};

    /// The check every store's purge(older_than, options) makes. @throws usage_error.
    void validate(std::string_view who) const {
        if (batch_rows == 0)
            throw usage_error(fmt::format("{}: batch_rows must be at least 1", who));
        if (!(duty_cycle > 0.0 && duty_cycle <= 1.0)) {
            throw usage_error(
                fmt::format("{}: duty_cycle must be in (0, 1], not {}", who, duty_cycle));
        }
        if (max_rows_per_second < 0 || time_budget.count() < 0) {
            throw usage_error(
                fmt::format("{}: max_rows_per_second and time_budget cannot be negative", who));
        }
    }
};

/// @brief A parked message: what it was, why it was parked, and its payload, so nothing is lost.
struct DeadLetter {
    /// The policy scope of the handler that parked it.
    std::string scope;
    /// The parked delivery's message id.
    std::string message_id;
    /// The count the handler judged it by when it parked it: the store's attempt count where
    /// the store counts attempts (a lease store, DeliveryCounter::store), else the broker's.
    std::uint32_t delivery_count = 0;
    /// Why it was parked (the poison limit, a fingerprint mismatch, ...).
    std::string reason;
    /// The body's bytes through the policy's redaction hook, or empty under keep_no_payload
    /// (payload.hpp), so the message can be looked at or replayed.
    std::string payload;
    /// When it was parked, by the store's clock.
    std::chrono::system_clock::time_point created_at{};
    /// The entry's number in the store, in the order entries were written (0 until stored).
    /// A message parked again after a redrive gets a new entry; the older ones stay.
    std::int64_t id = 0;
    /// The times this message had been redriven when this entry was redriven: 0 while it is
    /// still parked; a message parked again after its first redrive and redriven again says 2.
    std::uint32_t redrive_count = 0;
    /// When this entry was redriven (contract/redrive.hpp), by the store's clock; unset while
    /// it is parked.
    std::optional<std::chrono::system_clock::time_point> redriven_at{};
    /// Where the broker held it (Delivery::origin): a destination a redrive can send it back
    /// to; empty when the delivery named none.
    std::string origin{};
    /// Where in its origin it was (Delivery::origin_position); empty when unknown.
    std::string origin_position{};
    /// How its effect last failed before it was parked (the failed outcome's reason, through
    /// the policy's redaction hook), from the store's record of its failures
    /// (Store::note_failure()); empty when none was recorded (parked at its first delivery, a
    /// worker killed in every attempt, a store that keeps no such record).
    std::string failure{};
    /// When the store recorded the first of those failures (unset when none was).
    std::optional<std::chrono::system_clock::time_point> first_failed_at{};
    /// When the store recorded the last of those failures (unset when none was).
    std::optional<std::chrono::system_clock::time_point> last_failed_at{};

    /// @brief Takes the failures the store noted (failure, first_failed_at, last_failed_at).
    void take(const NotedFailure& noted) {
        failure = noted.text;
        first_failed_at = noted.first;
        last_failed_at = noted.last;
    }
    /// @brief The failures it carries, as noted; nothing when it carries none.
    [[nodiscard]] std::optional<NotedFailure> noted() const {
        if (!last_failed_at) return std::nullopt;
        return NotedFailure{failure, first_failed_at.value_or(*last_failed_at), *last_failed_at};
    }
};

IDEM_END_NAMESPACE
