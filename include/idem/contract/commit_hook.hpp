#pragma once
/// @file
/// @brief idem::CommitHook: how a broker that can ack inside the store's commit (Redis Streams
/// on the store's own Redis; later a database-backed queue) asks for it, explicitly, through the
/// handler: `handler.handle(delivery, body, hook)`. Core header: the standard library only.
///
/// The broker fills CommitHook::request with its store family's request type (for Redis:
/// idem::redis::StreamAck, idem/redis/stream_ack.hpp). The handler stamps the hook with the
/// claim it belongs to (scope and message id) and offers it to the transaction it begins. A
/// transaction that can honour it (its store has `attach(CommitHook&)` and recognises the
/// request: a RedisStore on the stream's server and database) does the ack in its commit and
/// sets `acked_in_commit`; any other store ignores it, and the broker acks after the commit
/// itself. No thread-local state: a hook is a value that travels with the call.

#include <any>
#include <string>
#include <type_traits>
#include <utility>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief One delivery's request to be acked in the store's commit, and its answer.
///
/// Written by three parties, each its own fields:
/// - the broker: `request`, in the type its store family knows (e.g. redis::StreamAck);
/// - the handler (`handle(delivery, body, hook)`, `handle_batch(deliveries, bodies, hooks)`):
///   `scope` and `message_id`, the claim the hook belongs to, and `acked_in_commit = false`;
/// - the transaction: `acked_in_commit = true` once a commit that included the request
///   succeeded. Never set by a rollback, a failed commit, or a transaction that committed
///   nothing for this message (a duplicate, a failed or deferred message of a batch).
///
/// When `acked_in_commit` is false after the handler returned, the broker acks as usual, after
/// the commit: should_ack(outcome) decides.
struct CommitHook {
    CommitHook() = default;
    /// @brief A hook carrying @p request_, the broker's request in its store family's type.
    explicit CommitHook(std::any request_) : request(std::move(request_)) {}

    /// The broker's request, opaque to the handler; a store recognises its own family's type.
    std::any request{};
    /// The handler's policy scope (set by the handler).
    std::string scope{};
    /// The delivery's message id (set by the handler); a batch commit matches hooks to its
    /// claims and dead letters by scope and message id.
    std::string message_id{};
    /// Set by the transaction: its commit did the request (e.g. XACKed the entry, and for a dead
    /// letter added it to the dead-letter stream), atomically with the claim and the effect's
    /// writes.
    bool acked_in_commit = false;

    /// The request as @p T, or null when it is not one (what a store's attach() checks).
    template <class T>
    [[nodiscard]] T* request_as() noexcept {
        return std::any_cast<T>(&request);
    }
    /// The request as @p T, or null when it is not one (the const overload).
    template <class T>
    [[nodiscard]] const T* request_as() const noexcept {
        return std::any_cast<T>(&request);
    }
};

/// A transaction that can do (some) commit hooks: `bool attach(CommitHook&)`.
template <class, class = void>
struct has_attach : std::false_type {};
template <class T>
struct has_attach<
    T, std::void_t<decltype(bool{std::declval<T&>().attach(std::declval<CommitHook&>())})>>
    : std::true_type {};

/// A store that says up front whether its transactions would honour a hook:
/// `bool accepts_commit_hook(const CommitHook&) const`.
template <class, class = void>
struct has_accepts_commit_hook : std::false_type {};
template <class S>
struct has_accepts_commit_hook<
    S, std::void_t<decltype(
           bool{std::declval<const S&>().accepts_commit_hook(std::declval<const CommitHook&>())})>>
    : std::true_type {};

/// @brief Whether @p store's transactions would do @p hook in their commit (a broker asks once,
/// e.g. to report it, or to know that a dead letter parked by such a commit is already on its
/// dead-letter stream). False for a store without the capability.
template <class Store>
[[nodiscard]] bool accepts_commit_hook(const Store& store, const CommitHook& hook) {
    if constexpr (has_accepts_commit_hook<Store>::value) {
        return store.accepts_commit_hook(hook);
    } else {
        return false;
    }
}

/// @brief Offers @p hook to @p tx (what the handler does right after begin()): true when the
/// transaction will do it in its commit, false (and nothing happens) when it cannot.
template <class Tx>
bool attach_commit_hook(Tx& tx, CommitHook& hook) {
    if constexpr (has_attach<Tx>::value) {
        return tx.attach(hook);
    } else {
        return false;
    }
}

IDEM_END_NAMESPACE
