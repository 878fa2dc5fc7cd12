#pragma once
/// @file
/// @brief broker::Dispatch: how a consumer calls its handler with a broker's message type (a
/// plain function, an IdempotentHandler, its batch form, its pipelined sequence), and
/// broker::check_lease_fits, the lease check against the broker's redelivery timeout. Includes
/// no store and no client library.

#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/broker/pipeline.hpp"
#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/store.hpp"
#include "idem/count_ahead.hpp"
#include "idem/delivery.hpp"
#include "idem/error.hpp"
#include "idem/handler.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE
namespace broker {

/// @brief A message a pipelined sequence settled (Dispatch::in_sequence(), flush_sequence()):
/// the PipelinedLoop's own Settled, tagged with the delivery's position in the poll.
using Settled = idem::Settled<std::size_t>;

/// @brief How a consumer calls its handler with a broker's message type: the plain form (the
/// outcome decides the settlement), or an IdempotentHandler (with a commit hook when the store
/// settles the delivery in its commit, and a batch form). A handler that throws gives a failed
/// outcome, never an ack.
template <class Message>
class Dispatch {
  public:
    /// A plain handler: the outcome it returns decides the settlement.
    using Handler = std::function<Outcome(const Delivery&, const Message&)>;
    /// One delivery to the handler, with the commit hook the store may do and the count ahead
    /// (each null when none).
    using One = std::function<Outcome(const Delivery&, const Message&, CommitHook*, CountAhead*)>;
    /// A poll's deliveries to the handler at once, with their commit hooks (null when none).
    using Many = std::function<std::vector<Outcome>(
        const std::vector<Delivery>&, const std::vector<Message>&, std::vector<CommitHook>*)>;

    /// @throws usage_error for an empty handler (@p who names the consumer).
    static Dispatch plain(Handler handler, std::string_view who) {
        if (!handler) throw usage_error(fmt::format("{}: the handler is empty", who));
        Dispatch d;
        d.one_ = [handler = std::move(handler)](const Delivery& delivery, const Message& message,
                                                CommitHook*,
                                                CountAhead*) { return handler(delivery, message); };
        return d;
    }

    /// The handler must outlive the consumer (it is referenced, not copied).
    template <class Store, class Effect>
    static Dispatch idempotent(IdempotentHandler<Store, Effect>& handler) {
        Dispatch d;
        d.one_ = [&handler](const Delivery& delivery, const Message& message, CommitHook* hook,
                            CountAhead* ahead) -> Outcome {
            if (ahead != nullptr) {
                if (hook != nullptr) return handler.handle(delivery, message, *hook, *ahead);
                return handler.handle(delivery, message, *ahead);
            }
            if (hook != nullptr) return handler.handle(delivery, message, *hook);
            return handler.handle(delivery, message);
        };
        d.many_ = [&handler](const std::vector<Delivery>& deliveries,
                             const std::vector<Message>& messages, std::vector<CommitHook>* hooks) {
            if (hooks != nullptr) return handler.handle_batch(deliveries, messages, *hooks);
            return handler.handle_batch(deliveries, messages);
        };
        using Loop = PipelinedLoop<IdempotentHandler<Store, Effect>, std::size_t>;
        if constexpr (Loop::pipelines) {
            d.sequence_ = std::make_shared<SequenceOf<Loop>>(handler);
        }
        d.scope_ = std::string(handler.policy().scope());
        d.probe_ = [&handler] { probe_store(handler.store()); };
        if (handler.policy().options().redact_payload) {
            d.redact_ = [&handler](std::string_view text) { return handler.policy().redact(text); };
        }
        return d;
    }

    /// The handler's outcome for one delivery; one that throws counts as failed. @p ahead: the
    /// consumer's CountAhead, naming the delivery it hands out next (null: none).
    [[nodiscard]] Outcome call(const Delivery& delivery, const Message& message, CommitHook* hook,
                               CountAhead* ahead = nullptr) const {
        try {
            return one_(delivery, message, hook, ahead);
        } catch (const std::exception& e) {
            return failed_outcome(fmt::format("handler threw: {}", e.what()), failure_cause_of(e));
        } catch (...) {
            return failed_outcome("handler threw a non-standard exception", FailureCause::other);
        }
    }

    /// True for an IdempotentHandler (handle_batch: one transaction for many deliveries).
    [[nodiscard]] bool batches() const noexcept { return static_cast<bool>(many_); }

    /// One outcome per delivery from handle_batch; a batch that throws (or answers with the
    /// wrong number of outcomes) fails every delivery in it. Requires batches().
    [[nodiscard]] std::vector<Outcome> call_batch(const std::vector<Delivery>& deliveries,
                                                  const std::vector<Message>& messages,
                                                  std::vector<CommitHook>* hooks) const {
        std::vector<Outcome> outcomes;
        try {
            outcomes = many_(deliveries, messages, hooks);
            if (outcomes.size() != messages.size()) {
                throw store_error(fmt::format("handle_batch returned {} outcomes for {} messages",
                                              outcomes.size(), messages.size()));
            }
        } catch (const std::exception& e) {
            outcomes.assign(messages.size(),
                            failed_outcome(fmt::format("batch handler threw: {}", e.what()),
                                           failure_cause_of(e)));
        } catch (...) {
            outcomes.assign(messages.size(),
                            failed_outcome("batch handler threw a non-standard exception",
                                           FailureCause::other));
        }
        return outcomes;
    }

    /// True for an IdempotentHandler whose store sends a commit with the next claim (a
    /// RedisStore): in_sequence() then pipelines (idem::PipelinedLoop).
    [[nodiscard]] bool sequences() const noexcept { return static_cast<bool>(sequence_); }

    /// @brief The next delivery of a sequence handled one at a time: its claim goes with the
    /// held commit of the one before (PipelinedLoop::handle). Appends to @p out what settled,
    /// in order — the one before once its commit's reply came, this one when it needed no
    /// commit; what the handler's commit has not yet confirmed is not in it. A delivery whose
    /// handling threw settles failed at once. Requires sequences().
    void in_sequence(const Delivery& delivery, const Message& message, std::size_t tag,
                     CommitHook* hook, std::vector<Settled>& out) const {
        try {
            sequence_->handle(delivery, message, tag, hook, out);
        } catch (const std::exception& e) {
            out.push_back(Settled{
                tag, delivery,
                failed_outcome(fmt::format("handler threw: {}", e.what()), failure_cause_of(e)),
                false});
        }
    }
    /// @brief Sends the sequence's held commit alone and appends its message, settled, to
    /// @p out (nothing when none is held). Call it before the consumer waits for more
    /// deliveries, and before it stops: a held message keeps its lease until its commit goes.
    void flush_sequence(std::vector<Settled>& out) const {
        if (sequence_) sequence_->flush(out);
    }

    /// True when the handler's policy redacts payloads (PolicyOptions::redact_payload): the
    /// consumer's own copy of a dead letter (the message's body or fields) goes through
    /// redact(). Not its reason: the handler has redacted the texts it puts in reasons already
    /// (a redactor need not be idempotent).
    [[nodiscard]] bool redacts() const noexcept { return static_cast<bool>(redact_); }
    /// @p text as the policy's redactor leaves it (unchanged without one).
    /// @throws redaction_failed when the redactor throws: the dead letter is then not published
    /// and the delivery not acked.
    [[nodiscard]] std::string redact(std::string_view text) const {
        return redact_ ? redact_(text) : std::string(text);
    }

    /// The handler's policy scope (dead letters name it); empty for a plain handler.
    [[nodiscard]] const std::string& scope() const noexcept { return scope_; }
    /// Probes the IdempotentHandler's store (its ping(), or a transaction begun and rolled
    /// back); empty for a plain handler.
    [[nodiscard]] const std::function<void()>& store_probe() const noexcept { return probe_; }

  private:
    /// The type-erased PipelinedLoop of in_sequence().
    class Sequence {
      public:
        virtual ~Sequence() = default;
        virtual void handle(const Delivery& delivery, const Message& message, std::size_t tag,
                            CommitHook* hook, std::vector<Settled>& out) = 0;
        virtual void flush(std::vector<Settled>& out) = 0;
    };
    template <class Loop>
    class SequenceOf final : public Sequence {
      public:
        template <class Handler>
        explicit SequenceOf(Handler& handler) : loop_(handler) {}
        void handle(const Delivery& delivery, const Message& message, std::size_t tag,
                    CommitHook* hook, std::vector<Settled>& out) override {
            append(hook != nullptr ? loop_.handle(delivery, message, tag, *hook)
                                   : loop_.handle(delivery, message, tag),
                   out);
        }
        void flush(std::vector<Settled>& out) override { append(loop_.flush(), out); }

      private:
        static void append(std::vector<Settled> from, std::vector<Settled>& out) {
            out.insert(out.end(), std::make_move_iterator(from.begin()),
                       std::make_move_iterator(from.end()));
        }
        Loop loop_;
    };

    One one_;
    Many many_;
    std::shared_ptr<Sequence> sequence_;
    std::string scope_;
    std::function<void()> probe_;
    std::function<std::string(std::string_view)> redact_;
};

/// @brief Refuses a lease store's handler whose lease outlasts the broker's redelivery timeout
/// (visibility timeout, AckWait, consumer timeout): a worker that dies holding the lease would
/// block its message across redeliveries. @p who names the consumer and its queue.
/// @throws usage_error when the lease is longer.
template <class Store, class Effect>
void check_lease_fits(IdempotentHandler<Store, Effect>& handler,
                      std::chrono::milliseconds redelivery_timeout, std::string_view timeout_name,
                      std::string_view who) {
    if constexpr (has_default_lease<Store>::value) {
        const std::chrono::milliseconds lease = handler.effective_lease();
        if (lease > redelivery_timeout) {
            throw usage_error(fmt::format(
                "{}: the handler \"{}\" holds its claims for {} ms, longer than the {} ({} ms): a "
                "worker that dies holding the lease would block its message across redeliveries. "
                "Make the {} longer than the handler's p99 and the lease (PolicyOptions::lease or "
                "the store's lease option) equal to it or just under.",
                who, handler.policy().scope(), lease.count(), timeout_name,
                redelivery_timeout.count(), timeout_name));
        }
    } else {
        (void)handler;
        (void)redelivery_timeout;
        (void)timeout_name;
        (void)who;
    }
}

}  // namespace broker
IDEM_END_NAMESPACE
