#pragma once
/// @file
/// @brief idem::nats::PullSubscription: a pull subscription bound to an existing durable
/// JetStream consumer, fetching batches of Messages (natsSubscription_FetchRequest) that the caller
/// acknowledges explicitly. Link idem::nats.

#include <nats/nats.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/nats/connection.hpp"
#include "idem/nats/error.hpp"
#include "idem/nats/message.hpp"

IDEM_BEGIN_NAMESPACE
namespace nats {

/// @brief Fetches from the durable pull consumer @p durable of @p stream. The subscription
/// must not outlive its Connection, and its Messages must not outlive it (their acks go through
/// it). Not thread-safe: one thread fetches; a Message may be acknowledged from another thread
/// if the two do not touch the same Message at once.
class PullSubscription {
  public:
    /// @throws nats::not_found when the stream or the consumer does not exist, nats::error when
    /// the consumer is not a pull consumer, nats::unavailable / timeout.
    PullSubscription(Connection& connection, std::string stream, std::string durable)
        : connection_(&connection), stream_(std::move(stream)), durable_(std::move(durable)) {
        jsSubOptions options;
        detail::check(jsSubOptions_Init(&options), "subscribe options");
        options.Stream = stream_.c_str();
        options.Consumer = durable_.c_str();
        options.ManualAck = true;
        jsErrCode js_code = static_cast<jsErrCode>(0);
        natsSubscription* raw = nullptr;
        const natsStatus status = js_PullSubscribe(&raw, connection.jetstream(), nullptr,
                                                   durable_.c_str(), nullptr, &options, &js_code);
        detail::check(status,
                      fmt::format("pull subscribe to consumer {} of stream {} on {}", durable_,
                                  stream_, connection.endpoint().describe()),
                      static_cast<int>(js_code));
        subscription_.reset(raw);
    }

    PullSubscription(const PullSubscription&) = delete;
    PullSubscription& operator=(const PullSubscription&) = delete;
    /// @brief Frees the subscription; the durable consumer stays on the server (it was bound,
    /// not created, so unsubscribing leaves it). First it unsubscribes and, on a live
    /// connection, waits for one PING/PONG (at most a second): the connection's reader is then
    /// past every message the server sent to this subscription (the late "request timeout"
    /// status of an expired pull request), so none is being read while it is freed. cnats
    /// before 3.6 could read such a message into a subscription being freed. Never throws.
    ~PullSubscription() {
        if (!subscription_) return;
        (void)natsSubscription_Unsubscribe(subscription_.get());
        natsConnection* connection = connection_->native();
        if (connection != nullptr &&
            natsConnection_Status(connection) == NATS_CONN_STATUS_CONNECTED) {
            const auto bound =
                std::min(connection_->endpoint().request_timeout, std::chrono::milliseconds(1000));
            (void)natsConnection_FlushTimeout(connection, bound.count());
        }
    }

    /// @brief The stream the consumer reads.
    [[nodiscard]] const std::string& stream() const noexcept { return stream_; }
    /// @brief The durable consumer it fetches from.
    [[nodiscard]] const std::string& durable() const noexcept { return durable_; }

    /// @brief Up to @p batch messages, waiting up to @p wait for the first; empty when none
    /// came (not an error). Returns as soon as one message is there: first a no-wait request
    /// for up to @p batch (what the consumer has ready now), and only when that finds nothing a
    /// waiting request for one. (natsSubscription_Fetch would instead hold a waiting request
    /// for the whole batch until it is full or @p wait has passed, so a lone message would sit
    /// in the client, its AckWait running, until then.)
    /// @throws nats::unavailable while the server is away, nats::error otherwise.
    std::vector<Message> fetch(std::size_t batch, std::chrono::milliseconds wait) {
        const auto deadline = std::chrono::steady_clock::now() + wait;
        if (batch > 1) {
            std::vector<Message> ready = request(batch, wait, /*no_wait=*/true);
            if (!ready.empty()) return ready;
        }
        // Asked again while time is left: the server's "request timeout" status of an earlier,
        // expired request can arrive during this one, and cnats then ends this one early.
        for (;;) {
            const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                deadline - std::chrono::steady_clock::now());
            if (left.count() <= 0) return {};
            std::vector<Message> first = request(1, left, /*no_wait=*/false);
            if (!first.empty()) return first;
            std::this_thread::sleep_for(std::chrono::milliseconds(1));  // never a busy loop
        }
    }

    /// The natsSubscription, for what this class does not wrap.
    [[nodiscard]] natsSubscription* native() const noexcept { return subscription_.get(); }

  private:
    std::vector<Message> request(std::size_t batch, std::chrono::milliseconds wait, bool no_wait) {
        jsFetchRequest request;
        detail::check(jsFetchRequest_Init(&request), "fetch request");
        request.Batch = static_cast<int>(batch);
        request.Expires = std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::max(std::chrono::milliseconds(1), wait))
                              .count();
        request.NoWait = no_wait;
        natsMsgList list{};
        const natsStatus status =
            natsSubscription_FetchRequest(&list, subscription_.get(), &request);
        std::unique_ptr<natsMsgList, ListFree> owned{&list};
        std::vector<Message> out;
        if (list.Count == 0) {
            // NOT_FOUND: a no-wait request found nothing; TIMEOUT: nothing came within `wait`.
            if (status == NATS_OK || status == NATS_NOT_FOUND || status == NATS_TIMEOUT) return out;
            detail::raise(status, 0,
                          fmt::format("fetch from consumer {} of stream {}", durable_, stream_));
        }
        out.reserve(static_cast<std::size_t>(list.Count));
        for (int i = 0; i < list.Count; ++i) {
            natsMsg* msg = list.Msgs[i];
            list.Msgs[i] = nullptr;  // ours now; natsMsgList_Destroy skips it
            if (msg != nullptr) out.emplace_back(msg, connection_->endpoint().request_timeout);
        }
        return out;
    }

    struct SubscriptionFree {
        void operator()(natsSubscription* s) const noexcept { natsSubscription_Destroy(s); }
    };
    struct ListFree {
        void operator()(natsMsgList* l) const noexcept { natsMsgList_Destroy(l); }
    };

    Connection* connection_;
    std::string stream_;
    std::string durable_;
    std::unique_ptr<natsSubscription, SubscriptionFree> subscription_;
};

}  // namespace nats
IDEM_END_NAMESPACE
