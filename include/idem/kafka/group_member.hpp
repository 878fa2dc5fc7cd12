#pragma once
/// @file
/// @brief idem::kafka::GroupMember: a consumer group member as idem::KafkaConsumer keeps it: the
/// client (made on first use, subscribed), the group's rebalance callbacks (assignment, with the
/// starts a store keeps; revocation, after a synchronous commit; a lost assignment, nothing
/// committed), the offset commits, and the OffsetLedger of the partitions assigned. What the
/// consumer does with records stays in the consumer (idem/broker/kafka.hpp). Link idem::kafka.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"
#include "idem/kafka/config.hpp"
#include "idem/kafka/consumer.hpp"
#include "idem/kafka/error.hpp"
#include "idem/kafka/message.hpp"
#include "idem/kafka/offset_ledger.hpp"
#include "idem/kafka/store_offsets.hpp"

IDEM_BEGIN_NAMESPACE
namespace kafka {

/// @brief A member of one consumer group: its client, its rebalances and its offset commits.
/// Not thread-safe: the polling thread's (librdkafka runs the group's callbacks inside its
/// polls); rebalances() may be read from any thread.
class GroupMember {
  public:
    /// @brief What the member tells its owner, each called on the polling thread.
    struct Events {
        /// A failure to report (a refused commit, a client error); the member goes on.
        std::function<void(const std::exception&)> report;
        /// After partitions were assigned and noted in the ledger.
        std::function<void()> assigned;
        /// After partitions were revoked or lost and forgotten by the ledger.
        std::function<void()> forgotten;
    };

    /// @brief A member of @p group reading @p topics, not joined yet (join() does it).
    /// @p max_poll_interval: how long it may go without a poll before the group drops it
    /// (max.poll.interval.ms; at least session.timeout.ms). With @p starts_in_store, each
    /// assigned partition starts where @p store_offsets says.
    GroupMember(Config config, std::string group, std::vector<std::string> topics,
                std::chrono::milliseconds max_poll_interval, bool starts_in_store,
                StoreOffsets store_offsets, Events events)
        : config_(std::move(config)),
          group_(std::move(group)),
          topics_(std::move(topics)),
          starts_in_store_(starts_in_store),
          store_offsets_(std::move(store_offsets)),
          events_(std::move(events)) {
        config_.group_id(group_);
        // The group drops a member that does not poll within max.poll.interval.ms; librdkafka
        // wants it at least session.timeout.ms.
        std::int64_t session = 45000;
        if (auto set = config_.get("session.timeout.ms")) session = std::stoll(*set);
        config_.set("max.poll.interval.ms",
                    std::to_string(std::max<std::int64_t>(max_poll_interval.count(), session)));
    }
    GroupMember(const GroupMember&) = delete;
    GroupMember& operator=(const GroupMember&) = delete;

    /// @brief The client, made and subscribed on the first call. @throws kafka::error.
    Consumer& join() {
        if (!client_) make_client();
        return *client_;
    }
    /// @brief Whether the client is there (joined, not closed).
    [[nodiscard]] bool joined() const noexcept { return client_.has_value(); }
    /// @brief The client; joined() must be true.
    [[nodiscard]] Consumer& client() noexcept { return *client_; }
    /// @brief The client's configuration (group.id and max.poll.interval.ms set).
    [[nodiscard]] const Config& config() const noexcept { return config_; }
    /// @brief The assigned partitions' offsets.
    [[nodiscard]] OffsetLedger& ledger() noexcept { return ledger_; }
    /// @brief The assigned partitions' offsets.
    [[nodiscard]] const OffsetLedger& ledger() const noexcept { return ledger_; }
    /// @brief The store that keeps the group's offsets (empty without one).
    [[nodiscard]] const StoreOffsets& store_offsets() const noexcept { return store_offsets_; }
    /// @brief Rebalances this member went through (assignments and revocations).
    [[nodiscard]] std::size_t rebalances() const noexcept {
        return rebalances_.load(std::memory_order_relaxed);
    }

    /// @brief Commits each partition's position where it moved past what the coordinator
    /// confirmed (all of them, or those in @p only); an async commit still in flight is not
    /// sent twice. A commit that fails is reported and sent again by the next call; a sync one
    /// that fails on revocation leaves the next owner duplicates, which the claims absorb.
    void commit(CommitMode mode, const TopicPartitions* only = nullptr) {
        if (!client_) return;
        const bool async = mode == CommitMode::async;
        const TopicPartitions offsets = ledger_.to_commit(async, only);
        if (offsets.empty()) return;
        try {
            client_->commit(offsets, mode);
        } catch (const broker_error& e) {
            ledger_.note_committed(RD_KAFKA_RESP_ERR__FAIL, offsets);  // not sent: send again
            events_.report(e);
            return;
        }
        if (!async) ledger_.note_committed(RD_KAFKA_RESP_ERR_NO_ERROR, offsets);
    }

    /// @brief Leaves the group: the positions reached committed synchronously, the partitions
    /// revoked, the client closed; everything forgotten, whether it throws or not.
    /// @throws kafka::error when the final commit or the close fails.
    void leave() {
        if (!client_) return;
        try {
            commit(CommitMode::sync);
            client_->close();  // on_revoked runs inside: nothing left to commit
        } catch (...) {
            reset();
            throw;
        }
        reset();
    }
    /// @brief Drops the client and forgets every partition, without a word to the group.
    void reset() noexcept {
        client_.reset();
        ledger_.clear();
    }

  private:
    void make_client() {
        client_.emplace(config_);
        Consumer& consumer = *client_;
        consumer.on_assigning = [this](TopicPartitions& assigned) {
            if (!starts_in_store_) return;
            store_offsets_.assigning(group_, assigned, events_.report);
        };
        consumer.on_assigned = [this](const TopicPartitions& assigned) {
            rebalances_.fetch_add(1, std::memory_order_relaxed);
            // Offsets in the store: where it starts is done, and goes to Kafka's group offsets
            // with the next commit (lag tools, and a member killed before its own).
            for (const TopicPartition& p : assigned)
                ledger_.assign(p.topic, p.partition, store_offsets_.start_of(p.topic, p.partition));
            store_offsets_.assigned();
            events_.assigned();
        };
        consumer.on_revoked = [this](const TopicPartitions& revoked) {
            rebalances_.fetch_add(1, std::memory_order_relaxed);
            commit(CommitMode::sync, &revoked);
            forget(revoked);
        };
        consumer.on_lost = [this](const TopicPartitions& lost) {
            rebalances_.fetch_add(1, std::memory_order_relaxed);
            forget(lost);  // another member may own them now: nothing is committed for them
        };
        consumer.on_committed = [this](rd_kafka_resp_err_t err, const TopicPartitions& offsets) {
            ledger_.note_committed(err, offsets);
            // A commit refused (during a rebalance, the coordinator away) is sent again after
            // the next poll; if the partition moves first, its next owner starts from the last
            // one that went through and finds duplicates, absorbed by the claims.
            if (err != RD_KAFKA_RESP_ERR_NO_ERROR && err != RD_KAFKA_RESP_ERR__NO_OFFSET) {
                events_.report(
                    kafka::error(fmt::format("idem::KafkaConsumer(\"{}\"): offset commit: {}",
                                             group_, rd_kafka_err2str(err)),
                                 err, detail::retriable_code(err), false));
            }
        };
        consumer.on_error = [this](rd_kafka_resp_err_t err, std::string_view reason) {
            events_.report(kafka::unavailable(
                fmt::format("idem::KafkaConsumer(\"{}\"): {}", group_, reason), err));
        };
        consumer.subscribe(topics_);
    }

    void forget(const TopicPartitions& partitions) {
        for (const TopicPartition& p : partitions)
            ledger_.forget(p.topic, p.partition);
        events_.forgotten();
    }

    Config config_;
    std::string group_;
    std::vector<std::string> topics_;
    bool starts_in_store_ = false;
    StoreOffsets store_offsets_;
    Events events_;
    std::optional<Consumer> client_;
    OffsetLedger ledger_;
    std::atomic<std::size_t> rebalances_{0};
};

}  // namespace kafka
IDEM_END_NAMESPACE
