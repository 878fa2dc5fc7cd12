#pragma once
/// @file
/// @brief idem::kafka::Producer: a librdkafka producer, move-only RAII, whose every produce()
/// gets its own delivery report: a Pending that wait()s for the broker's acknowledgement (the
/// offset the record got) or throws why it was not stored. Config::idempotent() makes it an
/// idempotent producer. Link idem::kafka.
///
/// @code
/// idem::kafka::Producer producer{idem::kafka::Config{}.bootstrap_servers(servers).idempotent()};
/// auto stored = producer.produce("payments.DLT", key, body, {{"idem-reason", why}}).wait();
/// // stored.partition, stored.offset: where the broker put it
/// @endcode
///
/// One thread uses a Producer at a time: the delivery reports are served by wait(), poll() and
/// flush(), on the calling thread.

#include <librdkafka/rdkafka.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/kafka/config.hpp"
#include "idem/kafka/error.hpp"
#include "idem/kafka/message.hpp"

IDEM_BEGIN_NAMESPACE
namespace kafka {

/// @brief Where the broker stored a produced record.
struct Delivered {
    /// The topic it was written to.
    std::string topic;
    /// The partition the broker stored it in.
    std::int32_t partition = RD_KAFKA_PARTITION_UA;
    /// Its offset in that partition.
    std::int64_t offset = RD_KAFKA_OFFSET_INVALID;
};

namespace detail {

/// One record's delivery report, shared by the Pending and librdkafka's opaque pointer.
struct DeliveryState {
    bool done = false;
    rd_kafka_resp_err_t error = RD_KAFKA_RESP_ERR_NO_ERROR;
    bool fatal = false;
    std::string reason;
    Delivered where;
};

struct HandleFree {
    void operator()(rd_kafka_t* rk) const noexcept { rd_kafka_destroy(rk); }
};

}  // namespace detail

class Producer;

/// @brief The delivery report of one produce(), to wait for. It must not outlive its Producer.
class Pending {
  public:
    /// @brief Serves the producer's delivery reports until this record's arrives.
    /// @return where it was stored.
    /// @throws kafka::timeout when no report came within @p limit (the record may still be
    /// delivered); kafka::error / unavailable when the broker refused it or it expired
    /// (message.timeout.ms) undelivered.
    Delivered wait(std::chrono::milliseconds limit = std::chrono::seconds(30));

    /// Whether the report has arrived (served by an earlier poll, flush or wait).
    [[nodiscard]] bool done() const noexcept { return state_->done; }

  private:
    friend class Producer;
    Pending(rd_kafka_t* handle, std::shared_ptr<detail::DeliveryState> state)
        : handle_(handle), state_(std::move(state)) {}
    rd_kafka_t* handle_;
    std::shared_ptr<detail::DeliveryState> state_;
};

/// @brief A Kafka producer.
class Producer {
  public:
    /// How long the destructor waits for records still in flight before it drops them.
    std::chrono::milliseconds flush_on_destroy{5000};

    /// @throws usage_error when librdkafka refuses the configuration.
    explicit Producer(const Config& config) {
        detail::ConfPtr conf = config.duplicate();
        rd_kafka_conf_set_dr_msg_cb(conf.get(), &Producer::delivery_trampoline);
        char why[512] = {0};
        rd_kafka_t* rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf.get(), why, sizeof why);
        if (rk == nullptr) throw usage_error(fmt::format("idem::kafka::Producer: {}", why));
        conf.release();  // rd_kafka_new took it
        handle_.reset(rk);
    }
    /// @brief Takes @p other's handle and its records in flight.
    Producer(Producer&&) noexcept = default;
    /// @brief Destroys this producer as the destructor does (flushes up to flush_on_destroy, drops
    /// the rest; never throws), then takes @p other's handle.
    Producer& operator=(Producer&& other) noexcept {
        if (this != &other) {
            destroy_noexcept();
            handle_ = std::move(other.handle_);
            flush_on_destroy = other.flush_on_destroy;
        }
        return *this;
    }
    Producer(const Producer&) = delete;
    Producer& operator=(const Producer&) = delete;
    /// Flushes (up to flush_on_destroy), drops what is left and frees the handle; never throws.
    ~Producer() { destroy_noexcept(); }

    /// @brief Queues one record for @p topic (@p partition: RD_KAFKA_PARTITION_UA lets the
    /// partitioner choose by key). The bytes are copied.
    /// @throws kafka::error when it cannot even be queued (unknown partition, queue full, a
    /// fatal error of an idempotent producer).
    Pending produce(std::string_view topic, std::string_view key, std::string_view value,
                    const Headers& headers = {}, std::int32_t partition = RD_KAFKA_PARTITION_UA) {
        rd_kafka_t* rk = handle("produce()");
        rd_kafka_headers_t* hdrs = rd_kafka_headers_new(headers.size());
        for (const auto& [name, content] : headers) {
            rd_kafka_header_add(hdrs, name.data(), static_cast<ssize_t>(name.size()),
                                content.data(), static_cast<ssize_t>(content.size()));
        }
        auto state = std::make_shared<detail::DeliveryState>();
        state->where.topic = std::string(topic);
        auto* opaque = new std::shared_ptr<detail::DeliveryState>(state);
        const std::string topic_name(topic);
        // rd_kafka_produceva, not the RD_KAFKA_V_* macros (GNU statement expressions).
        rd_kafka_vu_t fields[7];
        fields[0].vtype = RD_KAFKA_VTYPE_TOPIC;
        fields[0].u.cstr = topic_name.c_str();
        fields[1].vtype = RD_KAFKA_VTYPE_PARTITION;
        fields[1].u.i32 = partition;
        fields[2].vtype = RD_KAFKA_VTYPE_MSGFLAGS;
        fields[2].u.i = RD_KAFKA_MSG_F_COPY;
        fields[3].vtype = RD_KAFKA_VTYPE_KEY;
        fields[3].u.mem.ptr = const_cast<char*>(key.data());
        fields[3].u.mem.size = key.size();
        fields[4].vtype = RD_KAFKA_VTYPE_VALUE;
        fields[4].u.mem.ptr = const_cast<char*>(value.data());
        fields[4].u.mem.size = value.size();
        fields[5].vtype = RD_KAFKA_VTYPE_HEADERS;
        fields[5].u.headers = hdrs;
        fields[6].vtype = RD_KAFKA_VTYPE_OPAQUE;
        fields[6].u.ptr = opaque;
        rd_kafka_error_t* failure = rd_kafka_produceva(rk, fields, 7);
        if (failure != nullptr) {
            // Not queued: the headers and the opaque are still ours.
            rd_kafka_headers_destroy(hdrs);
            delete opaque;
            if (rd_kafka_error_code(failure) == RD_KAFKA_RESP_ERR__FATAL) {
                rd_kafka_error_destroy(failure);
                detail::raise_fatal(rk, "produce");
            }
            detail::check(failure, fmt::format("produce to {}", topic));
        }
        return Pending(rk, std::move(state));
    }

    /// @brief Serves the delivery reports that have arrived, waiting up to @p timeout for one.
    /// @return how many were served.
    int poll(std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) {
        return rd_kafka_poll(handle("poll()"), static_cast<int>(timeout.count()));
    }

    /// @brief Waits until every queued record has its delivery report.
    /// @throws kafka::timeout when some are still in flight after @p timeout.
    void flush(std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
        detail::check(rd_kafka_flush(handle("flush()"), static_cast<int>(timeout.count())),
                      "flush");
    }

    /// Records queued or in flight, without their delivery report yet.
    [[nodiscard]] int in_flight() const { return rd_kafka_outq_len(handle("in_flight()")); }

    /// The librdkafka handle (still owned).
    [[nodiscard]] rd_kafka_t* raw() const noexcept { return handle_.get(); }

  private:
    rd_kafka_t* handle(std::string_view what) const {
        if (!handle_) {
            throw usage_error(
                fmt::format("idem::kafka::Producer: {} on a moved-from producer", what));
        }
        return handle_.get();
    }

    static void delivery_trampoline(rd_kafka_t* rk, const rd_kafka_message_t* message,
                                    void*) noexcept {
        auto* opaque = static_cast<std::shared_ptr<detail::DeliveryState>*>(message->_private);
        if (opaque == nullptr) return;
        detail::DeliveryState& state = **opaque;
        state.error = message->err;
        if (message->err != RD_KAFKA_RESP_ERR_NO_ERROR) {
            state.reason = rd_kafka_err2str(message->err);
            if (message->err == RD_KAFKA_RESP_ERR__FATAL) {
                char text[512] = {0};
                state.error = rd_kafka_fatal_error(rk, text, sizeof text);
                state.reason = text;
                state.fatal = true;
            }
        }
        state.where.partition = message->partition;
        state.where.offset = message->offset;
        state.done = true;
        delete opaque;
    }

    void destroy_noexcept() noexcept {
        if (!handle_) return;
        rd_kafka_flush(handle_.get(), static_cast<int>(flush_on_destroy.count()));
        // What is left is dropped; its (purged) reports are served, so their states are freed.
        rd_kafka_purge(handle_.get(), RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT);
        rd_kafka_flush(handle_.get(), 1000);
        handle_.reset();
    }

    std::unique_ptr<rd_kafka_t, detail::HandleFree> handle_;
};

inline Delivered Pending::wait(std::chrono::milliseconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!state_->done) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) {
            throw timeout(fmt::format("idem::kafka: produce to {}: no delivery report within {} ms",
                                      state_->where.topic, limit.count()),
                          RD_KAFKA_RESP_ERR__TIMED_OUT);
        }
        rd_kafka_poll(handle_, static_cast<int>(std::min<std::int64_t>(left.count(), 100)));
    }
    if (state_->error != RD_KAFKA_RESP_ERR_NO_ERROR) {
        detail::raise(state_->error, fmt::format("produce to {}", state_->where.topic),
                      state_->reason, false, state_->fatal);
    }
    return state_->where;
}

}  // namespace kafka
IDEM_END_NAMESPACE
