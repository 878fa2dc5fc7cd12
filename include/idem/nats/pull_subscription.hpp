#pragma once
/// @file
/// @brief idem::nats::PullSubscription: a pull subscription bound to an existing durable
/// JetStream consumer, fetching batches of Messages (natsSubscription_Fetch) that the caller
/// acknowledges explicitly. Link idem::nats.

#include <nats/nats.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
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
    /// Frees the subscription; the durable consumer stays on the server (cnats >= 3.4).
    ~PullSubscription() = default;

    [[nodiscard]] const std::string& stream() const noexcept { return stream_; }
    [[nodiscard]] const std::string& durable() const noexcept { return durable_; }

    /// @brief Up to @p batch messages, waiting up to @p wait for the first; empty when none
    /// came (not an error).
    /// @throws nats::unavailable while the server is away, nats::error otherwise.
    std::vector<Message> fetch(std::size_t batch, std::chrono::milliseconds wait) {
        natsMsgList list{};
        jsErrCode js_code = static_cast<jsErrCode>(0);
        const natsStatus status =
            natsSubscription_Fetch(&list, subscription_.get(), static_cast<int>(batch),
                                   std::max<std::int64_t>(1, wait.count()), &js_code);
        std::unique_ptr<natsMsgList, ListFree> owned{&list};
        std::vector<Message> out;
        if (status == NATS_TIMEOUT && list.Count == 0) return out;  // nothing within `wait`
        if (status != NATS_OK && list.Count == 0) {
            detail::raise(status, static_cast<int>(js_code),
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

    /// The natsSubscription, for what this class does not wrap.
    [[nodiscard]] natsSubscription* native() const noexcept { return subscription_.get(); }

  private:
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
