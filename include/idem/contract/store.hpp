#pragma once
/// @file
/// @brief The Store concept in one table: every capability a store or its transaction may
/// offer, required or optional, with the detection trait that finds it, the check that names
/// what is missing, and the C++20 concept when the compiler has concepts. The values exchanged
/// (ClaimResult, DeadLetter, ...) are in contract/records.hpp.
///
/// @code
/// capability                                             trait                   needed by
/// ---- required ----------------------------------------------------------------------------
/// Store::begin() -> Transaction (move-only RAII guard)   has_begin               handler
/// Tx::claim(scope, id[, fingerprint]) -> ClaimResult     has_claim               handler
/// Tx::record_outcome(scope, id, Disposition, reason)     has_record_outcome      handler
/// Tx::dead_letter(const DeadLetter&)                     has_dead_letter         handler
/// Tx::savepoint(), rollback_to_savepoint(),              has_savepoints          handler
///     release_savepoint()
/// Tx::commit()  (throws store_error / commit_failed;    has_commit              handler
///   partial_commit when only some claims committed)
/// ---- optional ----------------------------------------------------------------------------
/// static constexpr bool Tx::cheap_savepoints             cheap_savepoints        handle()
///     (default true; SQL says false: a single message's effect then runs without one)
/// Tx::set_terms(const ClaimTerms&)                       has_set_terms           lease stores
/// Store::default_lease() const -> milliseconds           has_default_lease       lease stores
/// Tx::claim_many(scope, ids, fingerprints)               has_claim_many          handle_batch
///     + Tx::unclaim(scope, id)  (a failed message's claim given back)
/// Tx::claim_and_commit(const ClaimAndCommit&)            has_claim_and_commit    local_effect
///     -> ClaimAndCommitResult  (claim + the queued writes in one step; Redis)
/// Tx::commit_with_next_claim(Tx& next, scope, id, fp)    has_commit_with_next_claim  PipelinedLoop
///     -> CommitAndClaimResult  (this commit + next's claim in one round trip; Redis)
/// Tx::try_lock(key, expire_after) -> bool                has_try_lock            overlap
/// Tx::add_outbox(const OutboxIntent&) -> bool            has_add_outbox          outbox()
/// Store::lease_outbox(limit, lease) -> vector<OutboxRow> has_lease_outbox        Relay
/// Store::mark_outbox_sent(std::int64_t id)               has_mark_outbox_sent    Relay
/// Store::mark_outbox_failed(id, error, retry_at, park)   has_mark_outbox_failed  Relay
/// Store::ping()                                          has_ping                probe_store
/// Store::note_failure(scope, id, failure, keep_for)      has_note_failure        dead letters'
///     (the effect's failure, committed on its own after the attempt; a later  failure history
///     dead letter of the id carries the last one and when the first and last were)
/// Store::noted_failure(scope, id)                        has_noted_failure       broker dead-
///     -> optional<NotedFailure>  (what note_failure() kept)                       letter copies
/// Store::count_attempt(scope, id) -> std::uint32_t       has_count_attempt       brokers without
///     (attempts + 1, committed on its own before begin())                         a delivery count
/// Tx::count_attempt(scope, id) -> std::uint32_t          has_tx_count_attempt    CountAhead
///     (the same count, committed with the transaction: the next delivery's)
/// Tx::rollback()                                         has_rollback            probe_store
/// Tx::attach(CommitHook&) -> bool                        has_attach              handle(.., hook)
///     (contract/commit_hook.hpp: the broker's request done in the commit)
/// Store::stored_offset(group, topic, partition)          has_stored_offsets      brokers that
///     -> optional<int64_t>  (+ attach of a StoredOffset)                          read by offset
///     (contract/stored_offset.hpp)
/// @endcode
/// The checks: check_store() (the handler's), check_relay_store() (the Relay's), each a
/// static_assert per missing capability; is_store_v and, in C++20, the IdempotencyStore concept.
/// All of it is public, in namespace idem, for store authors: a store of your own uses the same
/// traits the handler does, and idem/testing/conformance.hpp runs the suite ours pass.
///
/// Maintenance and inspection, offered by every idem store and not checked:
/// @code
/// // deletes what is older than clock() - older_than (claims, sent outbox intents) and the
/// // expired held locks; dead letters, unsent and parked intents stay
/// PurgeResult purge(std::chrono::system_clock::duration older_than);
/// std::optional<ClaimRecord> find_claim(std::string_view scope, std::string_view id);
/// std::vector<DeadLetter> dead_letters();
/// // dead letters brought back exactly once (contract/redrive.hpp; every idem store)
/// std::vector<DeadLetter> dead_letters(const DeadLetterSelection& selection);
/// RedriveReport redrive(const DeadLetterSelection& selection, const RedriveOptions& options);
/// std::vector<OutboxRow> Store::outbox_rows();        // inspection, oldest first
/// // the intents the attempts of one message wrote (its effect's, its redrives'), oldest first
/// std::vector<OutboxRow> Store::outbox_rows(std::string_view scope, std::string_view id);
/// // a lock held outside any transaction (a long batch job, another system)
/// bool Store::hold_lock(std::string_view key, std::string_view owner,
///                       std::chrono::milliseconds expire_after);
/// bool Store::release_lock(std::string_view key, std::string_view owner);
/// @endcode

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/config.hpp"
#include "idem/contract/records.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

// ---- required: the handler's store ----

/// @brief The type a store's begin() returns (its transaction; a reference for some stores).
template <class T>
using transaction_t = decltype(std::declval<T&>().begin());

template <class, class = void>
struct has_begin : std::false_type {};
template <class S>
struct has_begin<S, std::void_t<transaction_t<S>>> : std::true_type {};

template <class, class = void>
struct has_claim : std::false_type {};
template <class T>
struct has_claim<
    T, std::void_t<decltype(std::declval<T&>().claim(std::string_view{}, std::string_view{}))>>
    : std::is_convertible<
          decltype(std::declval<T&>().claim(std::string_view{}, std::string_view{})), ClaimResult> {
};

template <class, class = void>
struct has_record_outcome : std::false_type {};
template <class T>
struct has_record_outcome<
    T, std::void_t<decltype(std::declval<T&>().record_outcome(
           std::string_view{}, std::string_view{}, Disposition{}, std::string_view{}))>>
    : std::true_type {};

template <class, class = void>
struct has_dead_letter : std::false_type {};
template <class T>
struct has_dead_letter<
    T, std::void_t<decltype(std::declval<T&>().dead_letter(std::declval<const DeadLetter&>()))>>
    : std::true_type {};

template <class, class = void>
struct has_savepoints : std::false_type {};
template <class T>
struct has_savepoints<T, std::void_t<decltype(std::declval<T&>().savepoint()),
                                     decltype(std::declval<T&>().rollback_to_savepoint()),
                                     decltype(std::declval<T&>().release_savepoint())>>
    : std::true_type {};

template <class, class = void>
struct has_commit : std::false_type {};
template <class T>
struct has_commit<T, std::void_t<decltype(std::declval<T&>().commit())>> : std::true_type {};

template <class, class = void>
struct has_set_terms : std::false_type {};
template <class T>
struct has_set_terms<
    T, std::void_t<decltype(std::declval<T&>().set_terms(std::declval<const ClaimTerms&>()))>>
    : std::true_type {};

template <class, class = void>
struct has_default_lease : std::false_type {};
template <class T>
struct has_default_lease<T, std::void_t<decltype(std::declval<const T&>().default_lease())>>
    : std::true_type {};

template <class, class = void>
struct has_claim_many : std::false_type {};
template <class T>
struct has_claim_many<
    T, std::void_t<decltype(std::declval<T&>().claim_many(
                       std::string_view{}, std::declval<const std::vector<std::string_view>&>(),
                       std::declval<const std::vector<std::string>&>())),
                   decltype(std::declval<T&>().unclaim(std::string_view{}, std::string_view{}))>>
    : std::true_type {};

/// A transaction that can claim an id and commit its queued writes in one step, for local
/// effects (effects/local.hpp); without it a local effect takes the ordinary path.
template <class, class = void>
struct has_claim_and_commit : std::false_type {};
template <class T>
struct has_claim_and_commit<T, std::void_t<decltype(std::declval<T&>().claim_and_commit(
                                   std::declval<const ClaimAndCommit&>()))>>
    : std::is_convertible<decltype(std::declval<T&>().claim_and_commit(
                              std::declval<const ClaimAndCommit&>())),
                          ClaimAndCommitResult> {};

/// A transaction that can send its commit with the next transaction's claim in one round trip
/// (broker/pipeline.hpp's PipelinedLoop); without it the loop commits and claims one after the
/// other.
template <class, class = void>
struct has_commit_with_next_claim : std::false_type {};
template <class T>
struct has_commit_with_next_claim<
    T, std::void_t<decltype(std::declval<T&>().commit_with_next_claim(
           std::declval<T&>(), std::string_view{}, std::string_view{}, std::string_view{}))>>
    : std::is_convertible<decltype(std::declval<T&>().commit_with_next_claim(
                              std::declval<T&>(), std::string_view{}, std::string_view{},
                              std::string_view{})),
                          CommitAndClaimResult> {};

/// A transaction whose savepoints cost no statement (memory, Redis: undo logs and queued writes)
/// says `static constexpr bool cheap_savepoints = true;` (the default when it says nothing).
/// SQL stores say false: the handler then runs a single message's effect without a savepoint.
template <class T, class = void>
struct cheap_savepoints : std::true_type {};
template <class T>
struct cheap_savepoints<T, std::void_t<decltype(T::cheap_savepoints)>>
    : std::bool_constant<T::cheap_savepoints> {};

// ---- optional: features that need them ----

template <class Tx, class = void>
struct has_try_lock : std::false_type {};
template <class Tx>
struct has_try_lock<Tx, std::void_t<decltype(std::declval<Tx&>().try_lock(
                            std::string_view{}, std::chrono::milliseconds{}))>> : std::true_type {};

template <class, class = void>
struct has_add_outbox : std::false_type {};
template <class T>
struct has_add_outbox<
    T, std::void_t<decltype(std::declval<T&>().add_outbox(std::declval<const OutboxIntent&>()))>>
    : std::is_convertible<
          decltype(std::declval<T&>().add_outbox(std::declval<const OutboxIntent&>())), bool> {};

template <class, class = void>
struct has_lease_outbox : std::false_type {};
template <class S>
struct has_lease_outbox<S, std::void_t<decltype(std::declval<S&>().lease_outbox(
                               std::size_t{}, std::chrono::milliseconds{}))>>
    : std::is_convertible<decltype(std::declval<S&>().lease_outbox(std::size_t{},
                                                                   std::chrono::milliseconds{})),
                          std::vector<OutboxRow>> {};

template <class, class = void>
struct has_mark_outbox_sent : std::false_type {};
template <class S>
struct has_mark_outbox_sent<
    S, std::void_t<decltype(std::declval<S&>().mark_outbox_sent(std::int64_t{}))>>
    : std::true_type {};

template <class, class = void>
struct has_mark_outbox_failed : std::false_type {};
template <class S>
struct has_mark_outbox_failed<
    S, std::void_t<decltype(std::declval<S&>().mark_outbox_failed(
           std::int64_t{}, std::string_view{}, std::chrono::system_clock::time_point{}, bool{}))>>
    : std::true_type {};

template <class, class = void>
struct has_ping : std::false_type {};
template <class S>
struct has_ping<S, std::void_t<decltype(std::declval<S&>().ping())>> : std::true_type {};

/// A store that counts attempts itself, each count committed on its own (SQL stores, memory):
/// the poison limit of a broker without a delivery count (Kafka). Lease stores count the
/// effect's starts in their claim instead (ClaimResult::attempts).
template <class, class = void>
struct has_count_attempt : std::false_type {};
template <class S>
struct has_count_attempt<S, std::void_t<decltype(std::declval<S&>().count_attempt(
                                std::string_view{}, std::string_view{}))>>
    : std::is_convertible<decltype(std::declval<S&>().count_attempt(std::string_view{},
                                                                    std::string_view{})),
                          std::uint32_t> {};

/// A transaction that counts an attempt of another message in its own commit (SQL stores): the
/// attempt a CountAhead names, counted with the message before it (count_ahead.hpp).
template <class, class = void>
struct has_tx_count_attempt : std::false_type {};
template <class T>
struct has_tx_count_attempt<T, std::void_t<decltype(std::declval<T&>().count_attempt(
                                   std::string_view{}, std::string_view{}))>>
    : std::is_convertible<decltype(std::declval<T&>().count_attempt(std::string_view{},
                                                                    std::string_view{})),
                          std::uint32_t> {};

/// A store that records a message's failures (the last one's text, when the first and the last
/// were) for its dead letter, each committed on its own after the failed attempt.
template <class, class = void>
struct has_note_failure : std::false_type {};
template <class S>
struct has_note_failure<
    S, std::void_t<decltype(std::declval<S&>().note_failure(
           std::string_view{}, std::string_view{}, std::string_view{}, std::chrono::seconds{}))>>
    : std::true_type {};

/// A store that reads back what note_failure() recorded, for a broker's dead-letter copy.
template <class, class = void>
struct has_noted_failure : std::false_type {};
template <class S>
struct has_noted_failure<S, std::void_t<decltype(std::declval<S&>().noted_failure(
                                std::string_view{}, std::string_view{}))>>
    : std::is_convertible<decltype(std::declval<S&>().noted_failure(std::string_view{},
                                                                    std::string_view{})),
                          std::optional<NotedFailure>> {};

template <class, class = void>
struct has_rollback : std::false_type {};
template <class T>
struct has_rollback<T, std::void_t<decltype(std::declval<T&>().rollback())>> : std::true_type {};

// ---- the checks: each names what is missing, so a misfit store fails with one readable line ----

/// @brief The transaction type of store @p S, references removed; `void` when @p S has no begin(),
/// so the checks below report that one line instead of a cascade.
template <class S, bool = has_begin<S>::value>
struct transaction_of {
    /// No transaction: @p S has no begin().
    using type = void;
};
/// @brief transaction_of for a store that has begin().
template <class S>
struct transaction_of<S, true> {
    /// What begin() returns, references removed.
    using type = std::remove_reference_t<transaction_t<S>>;
};

/// The handler's store.
template <class S>
constexpr bool check_store() {
    using Tx = typename transaction_of<S>::type;
    static_assert(has_begin<S>::value,
                  "idem: Store must provide begin() returning a transaction object");
    static_assert(std::is_void_v<Tx> || std::is_move_constructible_v<Tx>,
                  "idem: Store's transaction type must be move-constructible (RAII guard)");
    static_assert(std::is_void_v<Tx> || has_claim<Tx>::value,
                  "idem: Store's transaction must provide claim(std::string_view scope, "
                  "std::string_view id) returning idem::ClaimResult");
    static_assert(std::is_void_v<Tx> || has_record_outcome<Tx>::value,
                  "idem: Store's transaction must provide record_outcome(scope, id, "
                  "idem::Disposition, std::string_view reason)");
    static_assert(std::is_void_v<Tx> || has_dead_letter<Tx>::value,
                  "idem: Store's transaction must provide dead_letter(const idem::DeadLetter&)");
    static_assert(std::is_void_v<Tx> || has_savepoints<Tx>::value,
                  "idem: Store's transaction must provide savepoint(), rollback_to_savepoint() "
                  "and release_savepoint()");
    static_assert(std::is_void_v<Tx> || has_commit<Tx>::value,
                  "idem: Store's transaction must provide commit()");
    return true;
}

/// @brief True when @p S has everything the handler needs of a store (begin() and a transaction
/// with claim, record_outcome, dead_letter, savepoints and commit); check_store() says what is
/// missing.
template <class S>
inline constexpr bool is_store_v =
    has_begin<S>::value&& has_claim<typename transaction_of<S>::type>::value&&
        has_record_outcome<typename transaction_of<S>::type>::value&&
            has_dead_letter<typename transaction_of<S>::type>::value&&
                has_savepoints<typename transaction_of<S>::type>::value&&
                    has_commit<typename transaction_of<S>::type>::value;

/// The Relay's store.
template <class S>
constexpr bool check_relay_store() {
    static_assert(has_lease_outbox<S>::value,
                  "idem::Relay: the store has no outbox: it must provide "
                  "lease_outbox(std::size_t limit, std::chrono::milliseconds lease) returning "
                  "std::vector<idem::OutboxRow> (MemoryStore, SqliteStore, PostgresStore and "
                  "MysqlStore do)");
    static_assert(has_mark_outbox_sent<S>::value,
                  "idem::Relay: the store must provide mark_outbox_sent(std::int64_t id)");
    static_assert(has_mark_outbox_failed<S>::value,
                  "idem::Relay: the store must provide mark_outbox_failed(std::int64_t id, "
                  "std::string_view error, std::chrono::system_clock::time_point retry_at, "
                  "bool park)");
    return true;
}

#if IDEM_HAS_CONCEPTS
/// @brief C++20 concept for a store usable by IdempotentHandler.
template <class S>
concept IdempotencyStore = is_store_v<S>;
#endif

IDEM_END_NAMESPACE
