#pragma once
/// @file
/// @brief The Store concept: the values a store exchanges with the handler, and the checks that
/// give a readable compile error when a type does not fit.
///
/// A store provides:
/// @code
/// Transaction begin();             // move-only RAII; rolls back unless committed
/// // deletes what is older than clock() - older_than (claims, sent outbox intents) and the
/// // expired held locks; dead letters, unsent and parked intents stay
/// PurgeResult purge(std::chrono::system_clock::duration older_than);
/// std::optional<ClaimRecord> find_claim(std::string_view scope, std::string_view id);
/// std::vector<DeadLetter> dead_letters();
/// @endcode
/// and its Transaction provides:
/// @code
/// // fingerprint: stored with a new claim, returned with a duplicate
/// ClaimResult claim(std::string_view scope, std::string_view id,
///                   std::string_view fingerprint = {});
/// void record_outcome(std::string_view scope, std::string_view id, Disposition,
///                     std::string_view reason);
/// void dead_letter(const DeadLetter&);
/// void savepoint();
/// void rollback_to_savepoint();
/// void release_savepoint();
/// void commit();                   // throws store_error / commit_failed
/// @endcode
///
/// Optional capabilities, used only by the features that need them:
/// @code
/// // overlap lock (without_overlapping): held until the transaction ends;
/// // false when another holder has it
/// bool Transaction::try_lock(std::string_view key, std::chrono::milliseconds expire_after);
/// // a lock held outside any transaction (a long batch job, another system)
/// bool Store::hold_lock(std::string_view key, std::string_view owner,
///                       std::chrono::milliseconds expire_after);
/// bool Store::release_lock(std::string_view key, std::string_view owner);
/// // transactional outbox (outbox.hpp)
/// bool Transaction::add_outbox(const OutboxIntent&);  // false: key already there
/// std::vector<OutboxRow> Store::lease_outbox(std::size_t limit,
///                                            std::chrono::milliseconds lease);
/// void Store::mark_outbox_sent(std::int64_t id);
/// void Store::mark_outbox_failed(std::int64_t id, std::string_view error,
///                                std::chrono::system_clock::time_point retry_at, bool park);
/// std::vector<OutboxRow> Store::outbox_rows();        // inspection, oldest first
/// // lease stores (Redis): the handler passes its policy's lease and retention to each
/// // transaction before claiming, and checks the store's default lease against the policy
/// void Transaction::set_terms(const ClaimTerms&);
/// std::chrono::milliseconds Store::default_lease() const;
/// // stores with costly round trips: handle_batch claims the batch in one call, and gives a
/// // failed message's claim back with unclaim() (its savepoint does not cover the claim)
/// std::vector<ClaimResult> Transaction::claim_many(scope, const std::vector<std::string_view>&
///                                                  ids, const std::vector<std::string>& fps);
/// void Transaction::unclaim(scope, id);
/// @endcode

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief The time source a store stamps claims with; replaceable in tests of retention.
using Clock = std::function<std::chrono::system_clock::time_point()>;

/// @brief Answer of Transaction::claim().
enum class ClaimStatus {
    claimed,      ///< this transaction now owns the id
    duplicate,    ///< a finished run already recorded an outcome for it
    in_progress,  ///< another live worker holds it (lease stores, lock timeouts)
};

struct ClaimResult {
    ClaimStatus status = ClaimStatus::claimed;
    /// For a duplicate: the outcome the earlier run recorded.
    Disposition recorded = Disposition::processed;
    /// For a duplicate: the payload fingerprint stored with the first claim (empty if none).
    std::string fingerprint{};
    /// Stores that keep a claim across attempts (leases) count the times the effect started,
    /// this one included; the poison check then uses it instead of the broker's count.
    std::optional<std::uint32_t> attempts{};
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

/// @brief A stored claim, for inspection and tests.
struct ClaimRecord {
    std::string scope;
    std::string message_id;
    Disposition disposition = Disposition::processed;
    std::string reason;
    std::chrono::system_clock::time_point claimed_at{};
    /// Fingerprint of the payload's stable part, when the handler computes one.
    std::string fingerprint{};
};

/// @brief An effect that leaves the database, written in the claim's transaction and shipped
/// later by a Relay with its idempotency key (see outbox.hpp).
struct OutboxIntent {
    std::string destination;      ///< where the relay sends it (a rail, a queue, a topic)
    std::string idempotency_key;  ///< unique; the receiver dedupes on it
    std::string payload;
};

/// @brief A stored outbox intent with its delivery state.
struct OutboxRow {
    std::int64_t id = 0;  ///< insertion order: the relay ships in this order
    std::string destination;
    std::string idempotency_key;
    std::string payload;
    std::chrono::system_clock::time_point created_at{};
    std::optional<std::chrono::system_clock::time_point> sent_at{};
    std::uint32_t attempts = 0;  ///< failed sends so far
    std::string last_error;
    std::chrono::system_clock::time_point next_attempt_at{};
    bool parked = false;  ///< gave up after too many failures; a human looks at it
};

/// @brief Answer of Store::purge(older_than): what it deleted. Dead letters, unsent intents and
/// parked intents are never purged: they wait for a relay or a human.
struct PurgeResult {
    std::size_t claims = 0;         ///< claims whose claimed_at is before the cutoff
    std::size_t sent_intents = 0;   ///< outbox intents sent before the cutoff
    std::size_t expired_locks = 0;  ///< locks held with hold_lock() that have expired
};

/// @brief A parked message: what it was, why it was parked, and its payload, so nothing is lost.
struct DeadLetter {
    std::string scope;
    std::string message_id;
    std::uint32_t delivery_count = 0;
    std::string reason;
    std::string payload;
    std::chrono::system_clock::time_point created_at{};
};

namespace detail {

/// Milliseconds since the Unix epoch: how every store keeps its times.
inline std::int64_t to_unix_ms(std::chrono::system_clock::time_point tp) noexcept {
    return std::chrono::duration_cast<std::chrono::milliseconds>(tp.time_since_epoch()).count();
}

inline std::chrono::system_clock::time_point from_unix_ms(std::int64_t ms) noexcept {
    return std::chrono::system_clock::time_point(
        std::chrono::duration_cast<std::chrono::system_clock::duration>(
            std::chrono::milliseconds(ms)));
}

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

/// A transaction whose savepoints cost no statement (memory, Redis: undo logs and queued writes)
/// says `static constexpr bool cheap_savepoints = true;` (the default when it says nothing).
/// SQL stores say false: the handler then runs a single message's effect without a savepoint.
template <class T, class = void>
struct cheap_savepoints : std::true_type {};
template <class T>
struct cheap_savepoints<T, std::void_t<decltype(T::cheap_savepoints)>>
    : std::bool_constant<T::cheap_savepoints> {};

template <class S, bool = has_begin<S>::value>
struct transaction_of {
    using type = void;
};
template <class S>
struct transaction_of<S, true> {
    using type = std::remove_reference_t<transaction_t<S>>;
};

/// Each check names what is missing, so a misfit store fails with one readable line.
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

template <class S>
inline constexpr bool is_store_v =
    has_begin<S>::value&& has_claim<typename transaction_of<S>::type>::value&&
        has_record_outcome<typename transaction_of<S>::type>::value&&
            has_dead_letter<typename transaction_of<S>::type>::value&&
                has_savepoints<typename transaction_of<S>::type>::value&&
                    has_commit<typename transaction_of<S>::type>::value;

}  // namespace detail

#if IDEM_HAS_CONCEPTS
/// @brief C++20 concept for a store usable by IdempotentHandler.
template <class S>
concept IdempotencyStore = detail::is_store_v<S>;
#endif

IDEM_END_NAMESPACE
