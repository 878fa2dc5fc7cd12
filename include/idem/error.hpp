#pragma once
/// @file
/// @brief The typed exceptions of idem. Expected outcomes are values (Disposition); these are
/// for misuse and for infrastructure failures, which the handler turns into `failed`.

#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief Base of every exception idem throws.
class error : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

/// @brief The library was used in a way that cannot work (a policy that would re-run effects,
/// an empty key part, a second commit). The message says what to change.
class usage_error : public error {
  public:
    using error::error;
};

/// @brief Base of infrastructure failures: the store could not do what was asked. The handler
/// reports `failed` (no ack), so the broker redelivers.
class store_error : public error {
  public:
    using error::error;
};

/// @brief The store cannot be reached or refused the operation (I/O error, closed connection).
class store_unavailable : public store_error {
  public:
    using store_error::store_error;
};

/// @brief The store did not answer in time (lock or busy timeout). Ambiguous on commit: the
/// claim may exist, so a redelivery will find it as a duplicate or claim it anew.
class store_timeout : public store_error {
  public:
    using store_error::store_error;
};

/// @brief The commit was refused; nothing the transaction wrote is visible.
class commit_failed : public store_error {
  public:
    using store_error::store_error;
};

/// @brief The commit was applied, but fewer replicas than asked confirmed it in time (Redis
/// `WAIT`, RedisOptions::replicas_to_ack): a failover before they catch up loses it. Its outcome
/// is unknown, so it is `failed` and never acked: the redelivery finds it as a duplicate if it
/// survived, or runs it again if it was lost.
class commit_unconfirmed : public store_error {
  public:
    using store_error::store_error;
};

/// @brief A commit that applied only part of its transaction: a store whose transaction spans
/// several independent units (a Redis Cluster's hash slots, each committed atomically on its
/// own) committed the claims of some messages and not of the others. committed() names the
/// (scope, message id) of every claim (and dead letter) that IS stored; everything else the
/// transaction wrote is not. The handler reports those messages' outcomes as they are and the
/// others as `failed`.
class partial_commit : public commit_failed {
  public:
    using Id = std::pair<std::string, std::string>;  ///< (scope, message id)
    /// @p committed: the (scope, message id) pairs whose claims were committed.
    partial_commit(const std::string& what, std::vector<Id> committed)
        : commit_failed(what), committed_(std::move(committed)) {}

    /// The (scope, message id) pairs whose claims (or dead letters) were committed.
    [[nodiscard]] const std::vector<Id>& committed() const noexcept { return committed_; }
    /// Whether the claim (or dead letter) of (@p scope, @p message_id) was committed.
    [[nodiscard]] bool committed(std::string_view scope, std::string_view message_id) const {
        for (const Id& id : committed_) {
            if (id.first == scope && id.second == message_id) return true;
        }
        return false;
    }

  private:
    std::vector<Id> committed_;
};

/// @brief Base of broker failures in a consumer adapter (RabbitMQ, NATS): the broker could not
/// do what was asked (a refused declare, a publish not confirmed). A consumer's run() backs off
/// and retries; nothing whose outcome is unknown is acked.
class broker_error : public error {
  public:
    using error::error;
};

/// @brief The broker cannot be reached (connection refused or lost, a closed channel).
class broker_unavailable : public broker_error {
  public:
    using broker_error::broker_error;
};

/// @brief Thrown by a store's fault injection (see MemoryStore::inject).
class injected_fault : public store_unavailable {
  public:
    using store_unavailable::store_unavailable;
};

/// @brief Thrown by an effect that finds the message itself unusable (a body that does not parse,
/// a field out of range). Retrying cannot help, so the handler dead-letters the message with this
/// reason and its payload, and acks it: nothing is lost and the queue is not blocked.
class malformed_message : public error {
  public:
    using error::error;
};

IDEM_END_NAMESPACE
