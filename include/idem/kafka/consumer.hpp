#pragma once
/// @file
/// @brief idem::kafka::Consumer: a librdkafka high-level (group) consumer, move-only RAII. It
/// subscribes with a rebalance callback that serves eager and cooperative assignment alike,
/// polls, pauses and resumes partitions, seeks, commits offsets per partition (synchronously or
/// asynchronously) and reads its assignment and the committed offsets. Link idem::kafka.
///
/// @code
/// idem::kafka::Consumer consumer{idem::kafka::Config{}
///                                    .bootstrap_servers(servers)
///                                    .group_id("capture-worker")
///                                    .auto_offset_reset("earliest")};
/// consumer.on_revoked = [&](const idem::kafka::TopicPartitions& lost) { /* finish, commit */ };
/// consumer.subscribe({"payments"});
/// while (running) {
///     if (auto message = consumer.poll(std::chrono::milliseconds(100))) {
///         // ... handle it, then:
///         consumer.commit({message->next_position()});
///     }
/// }
/// @endcode
///
/// Offsets are committed only by commit(): the consumer sets enable.auto.commit and
/// enable.auto.offset.store to false, whatever the Config says (an automatic commit could move
/// past a message whose effect has not committed). The callbacks run inside poll(), commit()
/// and close(), on the calling thread; one thread uses a Consumer at a time.

#include <librdkafka/rdkafka.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/kafka/config.hpp"
#include "idem/kafka/error.hpp"
#include "idem/kafka/message.hpp"

IDEM_BEGIN_NAMESPACE
namespace kafka {

/// @brief How commit() sends the offsets.
enum class CommitMode {
    sync,   ///< waits for the coordinator's answer; throws when it refuses
    async,  ///< returns at once; on_committed says how it went (inside a later poll())
};

/// @brief A Kafka group consumer.
class Consumer {
  public:
    /// @brief Told a list of partitions (on_assigned, on_revoked, on_lost).
    using PartitionsCallback = std::function<void(const TopicPartitions&)>;
    /// @brief Told the partitions about to be assigned, whose offsets it may change (on_assigning).
    using PositionsCallback = std::function<void(TopicPartitions&)>;
    /// @brief Told a commit's result: the error (RD_KAFKA_RESP_ERR_NO_ERROR when it went through)
    /// and the offsets, each with its own error (on_committed).
    using CommittedCallback = std::function<void(rd_kafka_resp_err_t, const TopicPartitions&)>;
    /// @brief Told a non-fatal client error: its code and librdkafka's reason (on_error).
    using ErrorCallback = std::function<void(rd_kafka_resp_err_t, std::string_view reason)>;

    /// Called BEFORE partitions are assigned to this member: may set where each starts (its
    /// offset; RD_KAFKA_OFFSET_INVALID, as given: the group's committed offset, else
    /// auto.offset.reset). What it throws is rethrown by the call that ran the rebalance, and
    /// the partitions are assigned from the committed offsets.
    PositionsCallback on_assigning;
    /// Called after partitions were assigned to this member (eager: the whole new assignment;
    /// cooperative: only the added partitions).
    PartitionsCallback on_assigned;
    /// Called BEFORE partitions are taken away (eager: all of them; cooperative: only those
    /// that move): the last moment to commit their offsets.
    PartitionsCallback on_revoked;
    /// Called instead of on_revoked when the partitions were already lost (the session timed
    /// out, the member was fenced): another member may own them now; do not commit for them.
    PartitionsCallback on_lost;
    /// The result of each asynchronous commit (and of synchronous ones too).
    CommittedCallback on_committed;
    /// librdkafka's non-fatal errors (a broker connection dropped, all brokers down); the
    /// client retries by itself. A fatal error is thrown by the next poll() instead.
    ErrorCallback on_error;

    /// @brief Creates the consumer (no connection yet: subscribe() and poll() make them).
    /// @throws usage_error without group.id, or when librdkafka refuses the configuration.
    explicit Consumer(const Config& config) : state_(std::make_unique<State>()) {
        Config own = config;
        const auto group = own.get("group.id");
        if (!group || group->empty()) {
            throw usage_error("idem::kafka::Consumer: the Config has no group_id()");
        }
        own.set("enable.auto.commit", "false");
        own.set("enable.auto.offset.store", "false");
        detail::ConfPtr conf = own.duplicate();
        rd_kafka_conf_set_opaque(conf.get(), this_state());
        rd_kafka_conf_set_rebalance_cb(conf.get(), &Consumer::rebalance_trampoline);
        rd_kafka_conf_set_offset_commit_cb(conf.get(), &Consumer::commit_trampoline);
        rd_kafka_conf_set_error_cb(conf.get(), &Consumer::error_trampoline);
        char why[512] = {0};
        rd_kafka_t* handle = rd_kafka_new(RD_KAFKA_CONSUMER, conf.get(), why, sizeof why);
        if (handle == nullptr) {
            throw usage_error(fmt::format("idem::kafka::Consumer: {}", why));
        }
        conf.release();  // rd_kafka_new took it
        state_->handle = handle;
        state_->owner = this;
        rd_kafka_poll_set_consumer(handle);
    }

    /// @brief Takes @p other's handle and group membership; @p other is left without one. The
    /// callbacks (on_assigning, ...) are NOT moved: set them again on this object.
    Consumer(Consumer&& other) noexcept : state_(std::move(other.state_)) {
        if (state_) state_->owner = this;
    }
    /// @brief Closes this consumer (leaves the group, never throws), then takes @p other's handle.
    /// This object's callbacks stay as they were; @p other's are not moved.
    Consumer& operator=(Consumer&& other) noexcept {
        if (this != &other) {
            destroy_noexcept();
            state_ = std::move(other.state_);
            if (state_) state_->owner = this;
        }
        return *this;
    }
    Consumer(const Consumer&) = delete;
    Consumer& operator=(const Consumer&) = delete;
    /// Leaves the group (close()) and frees the handle; never throws.
    ~Consumer() { destroy_noexcept(); }

    /// @brief Subscribes to @p topics (replacing any earlier subscription).
    /// @throws kafka::error when librdkafka refuses (an invalid topic name).
    void subscribe(const std::vector<std::string>& topics) {
        detail::PartitionListPtr list(
            rd_kafka_topic_partition_list_new(static_cast<int>(topics.size())));
        for (const auto& topic : topics) {
            rd_kafka_topic_partition_list_add(list.get(), topic.c_str(), RD_KAFKA_PARTITION_UA);
        }
        detail::check(rd_kafka_subscribe(handle("subscribe()"), list.get()), "subscribe");
    }

    /// @brief Waits up to @p timeout for the next record (serving the callbacks meanwhile).
    /// @return nullopt when none came (or the end of a partition was reached).
    /// @throws kafka::error for a consumer error record (an unknown topic or partition, an
    /// offset out of range) or a fatal error of the handle; whatever a callback threw.
    std::optional<Message> poll(std::chrono::milliseconds timeout) {
        rd_kafka_t* rk = handle("poll()");
        rd_kafka_message_t* raw = rd_kafka_consumer_poll(rk, static_cast<int>(timeout.count()));
        rethrow_pending();
        if (state_->fatal) detail::raise_fatal(rk, "poll");
        if (raw == nullptr) return std::nullopt;
        Message message(raw);
        if (raw->err == RD_KAFKA_RESP_ERR__PARTITION_EOF) return std::nullopt;
        if (raw->err != RD_KAFKA_RESP_ERR_NO_ERROR) {
            if (raw->err == RD_KAFKA_RESP_ERR__FATAL) detail::raise_fatal(rk, "poll");
            detail::raise(raw->err, "poll", rd_kafka_message_errstr(raw), false, false);
        }
        return message;
    }

    /// @brief Stops fetching from @p partitions (poll() serves the others and the callbacks).
    void pause(const TopicPartitions& partitions) {
        auto list = detail::to_list(partitions);
        detail::check(rd_kafka_pause_partitions(handle("pause()"), list.get()), "pause");
        check_elements(list.get(), "pause");
    }

    /// @brief Fetches from @p partitions again.
    void resume(const TopicPartitions& partitions) {
        auto list = detail::to_list(partitions);
        detail::check(rd_kafka_resume_partitions(handle("resume()"), list.get()), "resume");
        check_elements(list.get(), "resume");
    }

    /// @brief The next poll() of @p position's partition returns the record at its offset (the
    /// partition must be assigned; a paused one stays paused).
    void seek(const TopicPartition& position,
              std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
        auto list = detail::to_list({position});
        detail::check(rd_kafka_seek_partitions(handle("seek()"), list.get(),
                                               static_cast<int>(timeout.count())),
                      "seek");
        check_elements(list.get(), "seek");
    }

    /// @brief Commits @p offsets (each the NEXT offset to read in its partition). Nothing to
    /// do for an empty list.
    /// @throws kafka::error (or unavailable / timeout) when a sync commit is refused for any
    /// partition: the group is rebalancing, the member was fenced, the coordinator is away.
    void commit(const TopicPartitions& offsets, CommitMode mode = CommitMode::sync) {
        if (offsets.empty()) return;
        rd_kafka_t* rk = handle("commit()");
        auto list = detail::to_list(offsets);
        const rd_kafka_resp_err_t err = rd_kafka_commit(rk, list.get(), mode == CommitMode::async);
        rethrow_pending();
        // The partition's own error first: it names the partition.
        if (mode == CommitMode::sync) check_elements(list.get(), "commit");
        detail::check(err, "commit");
    }

    /// @brief The offsets the group committed for @p partitions (RD_KAFKA_OFFSET_INVALID where
    /// it committed none), asked of the coordinator.
    [[nodiscard]] TopicPartitions committed(
        const TopicPartitions& partitions,
        std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
        auto list = detail::to_list(partitions);
        detail::check(rd_kafka_committed(handle("committed()"), list.get(),
                                         static_cast<int>(timeout.count())),
                      "committed");
        check_elements(list.get(), "committed");
        return detail::from_list(list.get());
    }

    /// @brief Where the next poll() of each of @p partitions would read (the last record it
    /// returned + 1; RD_KAFKA_OFFSET_INVALID before the first), from the client's own state.
    [[nodiscard]] TopicPartitions position(const TopicPartitions& partitions) {
        auto list = detail::to_list(partitions);
        detail::check(rd_kafka_position(handle("position()"), list.get()), "position");
        return detail::from_list(list.get());
    }

    /// @brief The low and high watermarks of @p partition as the client last saw them (no
    /// request): the high one is the offset the next produced record gets. nullopt when unknown.
    [[nodiscard]] std::optional<std::pair<std::int64_t, std::int64_t>> watermarks(
        const TopicPartition& partition) {
        std::int64_t low = RD_KAFKA_OFFSET_INVALID;
        std::int64_t high = RD_KAFKA_OFFSET_INVALID;
        if (rd_kafka_get_watermark_offsets(handle("watermarks()"), partition.topic.c_str(),
                                           partition.partition, &low,
                                           &high) != RD_KAFKA_RESP_ERR_NO_ERROR ||
            high < 0) {
            return std::nullopt;
        }
        return std::make_pair(low, high);
    }

    /// @brief The partitions assigned to this member now.
    [[nodiscard]] TopicPartitions assignment() {
        rd_kafka_topic_partition_list_t* raw = nullptr;
        detail::check(rd_kafka_assignment(handle("assignment()"), &raw), "assignment");
        detail::PartitionListPtr list(raw);
        return detail::from_list(list.get());
    }

    /// @brief The group's rebalance protocol now: "EAGER", "COOPERATIVE", or "NONE" before the
    /// first assignment.
    [[nodiscard]] std::string rebalance_protocol() {
        const char* protocol = rd_kafka_rebalance_protocol(handle("rebalance_protocol()"));
        return protocol == nullptr ? "NONE" : protocol;
    }

    /// @brief Leaves the group: revokes the assignment (on_revoked runs: the last moment to
    /// commit) and closes. The Consumer can then only be destroyed.
    void close() {
        rd_kafka_t* rk = handle("close()", true);
        if (state_->closed) return;
        // Marked closed only afterwards: on_revoked, run inside, may still commit.
        const rd_kafka_resp_err_t err = rd_kafka_consumer_close(rk);
        state_->closed = true;
        rethrow_pending();
        detail::check(err, "close");
    }

    /// The librdkafka handle (still owned).
    [[nodiscard]] rd_kafka_t* raw() const noexcept { return state_ ? state_->handle : nullptr; }

  private:
    /// Kept on the heap so that librdkafka's opaque pointer stays valid when the Consumer moves.
    struct State {
        rd_kafka_t* handle = nullptr;
        Consumer* owner = nullptr;
        bool closed = false;
        bool fatal = false;
        std::exception_ptr pending;  ///< thrown in a callback; rethrown by the call that ran it
    };

    State* this_state() noexcept { return state_.get(); }

    rd_kafka_t* handle(std::string_view what, bool after_close_too = false) const {
        if (!state_) {
            throw usage_error(
                fmt::format("idem::kafka::Consumer: {} on a moved-from consumer", what));
        }
        if (state_->closed && !after_close_too) {
            throw usage_error(fmt::format("idem::kafka::Consumer: {} after close()", what));
        }
        return state_->handle;
    }

    void rethrow_pending() {
        if (state_->pending) std::rethrow_exception(std::exchange(state_->pending, nullptr));
    }

    static void check_elements(const rd_kafka_topic_partition_list_t* list, std::string_view what) {
        for (int i = 0; i < list->cnt; ++i) {
            const auto& e = list->elems[i];
            if (e.err != RD_KAFKA_RESP_ERR_NO_ERROR) {
                detail::raise(e.err, fmt::format("{} {}[{}]", what, e.topic, e.partition), {},
                              false, false);
            }
        }
    }

    static void rebalance_trampoline(rd_kafka_t* rk, rd_kafka_resp_err_t err,
                                     rd_kafka_topic_partition_list_t* partitions,
                                     void* opaque) noexcept {
        auto* state = static_cast<State*>(opaque);
        const char* protocol = rd_kafka_rebalance_protocol(rk);
        const bool cooperative = protocol != nullptr && std::string_view(protocol) == "COOPERATIVE";
        try {
            const TopicPartitions list = detail::from_list(partitions);
            if (err == RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS) {
                if (state->owner->on_assigning) {
                    try {
                        TopicPartitions positions = list;
                        state->owner->on_assigning(positions);
                        for (const TopicPartition& p : positions) {
                            rd_kafka_topic_partition_t* e = rd_kafka_topic_partition_list_find(
                                partitions, p.topic.c_str(), p.partition);
                            if (e != nullptr) e->offset = p.offset;
                        }
                    } catch (...) {
                        if (!state->pending) state->pending = std::current_exception();
                    }
                }
                if (cooperative) {
                    detail::check(rd_kafka_incremental_assign(rk, partitions), "assign");
                } else {
                    detail::check(rd_kafka_assign(rk, partitions), "assign");
                }
                if (state->owner->on_assigned) state->owner->on_assigned(list);
                return;
            }
            // Revoked (or an error: treated as a revocation of everything, as librdkafka
            // advises). The callback runs before the partitions go, so it can still commit.
            try {
                if (rd_kafka_assignment_lost(rk)) {
                    if (state->owner->on_lost) state->owner->on_lost(list);
                } else if (state->owner->on_revoked) {
                    state->owner->on_revoked(list);
                }
            } catch (...) {
                if (!state->pending) state->pending = std::current_exception();
            }
            if (cooperative) {
                detail::check(rd_kafka_incremental_unassign(rk, partitions), "unassign");
            } else {
                detail::check(rd_kafka_assign(rk, nullptr), "unassign");
            }
        } catch (...) {
            if (!state->pending) state->pending = std::current_exception();
        }
    }

    static void commit_trampoline(rd_kafka_t*, rd_kafka_resp_err_t err,
                                  rd_kafka_topic_partition_list_t* offsets, void* opaque) noexcept {
        auto* state = static_cast<State*>(opaque);
        if (!state->owner->on_committed) return;
        try {
            state->owner->on_committed(err, detail::from_list(offsets));
        } catch (...) {
            if (!state->pending) state->pending = std::current_exception();
        }
    }

    static void error_trampoline(rd_kafka_t*, int err, const char* reason, void* opaque) noexcept {
        auto* state = static_cast<State*>(opaque);
        const auto code = static_cast<rd_kafka_resp_err_t>(err);
        if (code == RD_KAFKA_RESP_ERR__FATAL) {
            state->fatal = true;
            return;
        }
        if (!state->owner->on_error) return;
        try {
            state->owner->on_error(code, reason == nullptr ? "" : reason);
        } catch (...) {
            if (!state->pending) state->pending = std::current_exception();
        }
    }

    void destroy_noexcept() noexcept {
        if (!state_ || state_->handle == nullptr) return;
        if (!state_->closed) {
            (void)rd_kafka_consumer_close(state_->handle);
            state_->closed = true;
        }
        rd_kafka_destroy(state_->handle);
        state_->handle = nullptr;
        state_.reset();
    }

    std::unique_ptr<State> state_;
};

}  // namespace kafka
IDEM_END_NAMESPACE
