#pragma once
/// @file
/// @brief idem::kafka::OffsetLedger: a Kafka consumer's book of its assigned partitions: per
/// partition, the records handed out and whether each is settled, the offset reached (what is
/// committed), what the group coordinator confirmed, where the partition must be read again
/// from, the record being retried in place and its pause. Plain bookkeeping, no client calls:
/// idem::KafkaConsumer (idem/broker/kafka.hpp) asks it what to commit, seek, pause and resume,
/// and makes the calls. Link idem::kafka.

#include <librdkafka/rdkafka.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "idem/config.hpp"
#include "idem/kafka/message.hpp"

IDEM_BEGIN_NAMESPACE
namespace kafka {

/// @brief The offsets of a consumer's assigned partitions. A partition's records are handed
/// out in order and settled in any order; the position committed ("done") is the offset after
/// the last record settled with none before it unsettled, so nothing moves past a record whose
/// outcome is unknown. Not thread-safe: the polling thread's.
class OffsetLedger {
  public:
    /// @brief Starts keeping @p topic / @p partition (just assigned), forgetting what was kept
    /// of it; @p start: where it starts (offsets kept in the store), taken as done.
    void assign(const std::string& topic, std::int32_t partition,
                std::optional<std::int64_t> start = std::nullopt) {
        Partition fresh;
        if (start) fresh.done = *start;
        partitions_[Key{topic, partition}] = fresh;
    }
    /// @brief Stops keeping @p topic / @p partition (revoked or lost).
    void forget(const std::string& topic, std::int32_t partition) {
        partitions_.erase(Key{topic, partition});
    }
    /// @brief Stops keeping every partition (the client closed).
    void clear() noexcept { partitions_.clear(); }
    /// @brief Whether @p topic / @p partition is assigned.
    [[nodiscard]] bool owns(const std::string& topic, std::int32_t partition) const {
        return partitions_.count(Key{topic, partition}) != 0;
    }

    /// @brief Every assigned partition with its done offset (RD_KAFKA_OFFSET_INVALID before its
    /// first record).
    [[nodiscard]] TopicPartitions positions() const {
        TopicPartitions out;
        for (const auto& [where, state] : partitions_)
            out.push_back(TopicPartition{where.first, where.second, state.done});
        return out;
    }
    /// @brief Every assigned partition (no offset).
    [[nodiscard]] TopicPartitions partitions() const {
        TopicPartitions out;
        for (const auto& entry : partitions_)
            out.push_back(TopicPartition{entry.first.first, entry.first.second});
        return out;
    }
    /// @brief The assigned partitions not paused for a retry.
    [[nodiscard]] TopicPartitions unpaused() const {
        TopicPartitions out;
        for (const auto& [where, state] : partitions_) {
            if (!state.paused) out.push_back(TopicPartition{where.first, where.second});
        }
        return out;
    }

    // -----------------------------------------------------------------------------------------
    // Handing out and settling

    /// @brief Whether the client's position in @p topic / @p partition is past records to read
    /// again (dropped, or a seek back that failed): nothing of it is handed out until a seek
    /// back succeeded (rewound()).
    [[nodiscard]] bool must_rewind(const std::string& topic, std::int32_t partition) const {
        const Partition* state = find(topic, partition);
        return state != nullptr && state->rewind_to.has_value();
    }

    /// @brief Notes the record at @p offset as handed out, unsettled. Returns its attempt
    /// number at this offset (1, or the retry's next), or nothing when it is not to be handed
    /// out: the partition is not assigned, or the record was settled or handed out already.
    std::optional<std::uint32_t> hand_out(const std::string& topic, std::int32_t partition,
                                          std::int64_t offset) {
        Partition* state = find(topic, partition);
        if (state == nullptr) return std::nullopt;
        if (state->done >= 0 && offset < state->done) return std::nullopt;  // settled already
        if (!state->outstanding.empty() && offset <= state->outstanding.back().first)
            return std::nullopt;
        if (state->done < 0) state->done = offset;
        state->outstanding.emplace_back(offset, false);
        std::uint32_t tries = 1;
        if (state->retrying && *state->retrying == offset) {
            tries = ++state->retry_tries;
            state->retrying.reset();
        }
        return tries;
    }

    /// @brief Whether the record at @p offset waits: its partition is not assigned, or a record
    /// before it is being retried and not settled yet.
    [[nodiscard]] bool blocked(const std::string& topic, std::int32_t partition,
                               std::int64_t offset) const {
        const Partition* state = find(topic, partition);
        return state == nullptr ||
               (state->retrying && offset > *state->retrying && !state->outstanding.empty() &&
                !state->outstanding.front().second);
    }

    /// @brief The record at @p offset is settled: done moves past it and every settled record
    /// after it, up to the first unsettled one.
    void settle(const std::string& topic, std::int32_t partition, std::int64_t offset) {
        Partition* state = find(topic, partition);
        if (state == nullptr) return;
        for (auto& entry : state->outstanding) {
            if (entry.first == offset) entry.second = true;
        }
        while (!state->outstanding.empty() && state->outstanding.front().second) {
            state->done = state->outstanding.front().first + 1;
            state->outstanding.pop_front();
        }
        if (state->retrying && *state->retrying == offset) state->retrying.reset();
    }

    /// @brief The record at @p offset is tried again in place, after @p tries attempts: the
    /// records after it wait. False when the partition is not assigned (the next owner reads it).
    bool retry(const std::string& topic, std::int32_t partition, std::int64_t offset,
               std::uint32_t tries) {
        Partition* state = find(topic, partition);
        if (state == nullptr) return false;
        state->retrying = offset;
        state->retry_tries = tries;
        return true;
    }

    // -----------------------------------------------------------------------------------------
    // Pauses for a retry

    /// @brief Whether @p topic / @p partition is paused for a retry.
    [[nodiscard]] bool paused(const std::string& topic, std::int32_t partition) const {
        const Partition* state = find(topic, partition);
        return state != nullptr && state->paused;
    }
    /// @brief The partition was paused, until @p resume_at.
    void paused_until(const std::string& topic, std::int32_t partition,
                      std::chrono::steady_clock::time_point resume_at) {
        if (Partition* state = find(topic, partition)) {
            state->paused = true;
            state->resume_at = resume_at;
        }
    }
    /// @brief The paused partitions whose pause is over at @p now, noted as resumed.
    TopicPartitions take_due(std::chrono::steady_clock::time_point now) {
        TopicPartitions due;
        for (auto& [where, state] : partitions_) {
            if (state.paused && now >= state.resume_at) {
                state.paused = false;
                due.push_back(TopicPartition{where.first, where.second});
            }
        }
        return due;
    }

    // -----------------------------------------------------------------------------------------
    // Reading again

    /// @brief The record at @p offset was read and dropped without being handed out: the
    /// partition is read again from it (or from an earlier record already due), unless it was
    /// settled already.
    void rewind_at_most(const std::string& topic, std::int32_t partition, std::int64_t offset) {
        if (Partition* state = find(topic, partition)) rewind_at_most(*state, offset);
    }
    /// @brief Every partition is read again from its done offset (what was fetched after it
    /// was dropped).
    void rewind_all_to_done() {
        for (auto& entry : partitions_) {
            if (entry.second.done >= 0) rewind_at_most(entry.second, entry.second.done);
        }
    }
    /// @brief The partitions to seek back, each with the offset to read again from: the first
    /// record handed out and not settled (a retry, a stop, an error), or one read and dropped.
    /// Each stays due until rewound() says its seek succeeded.
    TopicPartitions rewinds() {
        TopicPartitions out;
        for (auto& [where, state] : partitions_) {
            if (!state.outstanding.empty()) rewind_at_most(state, state.outstanding.front().first);
            if (state.rewind_to)
                out.push_back(TopicPartition{where.first, where.second, *state.rewind_to});
        }
        return out;
    }
    /// @brief The seek back of @p position (one of rewinds()) succeeded: its records handed out
    /// are forgotten; the first is the one tried next (its tries start again, unless it was a
    /// retry already).
    void rewound(const TopicPartition& position) {
        Partition* state = find(position.topic, position.partition);
        if (state == nullptr) return;
        state->rewind_to.reset();
        state->outstanding.clear();
        if (!state->retrying) {  // not a retry: an interruption; its tries start again
            state->retrying = position.offset;
            state->retry_tries = 0;
        }
    }

    // -----------------------------------------------------------------------------------------
    // Commits

    /// @brief The positions to commit: each partition's done offset where it moved past what
    /// the coordinator confirmed (all partitions, or those in @p only). With @p async, one
    /// already in flight is left out and those returned are noted in flight.
    TopicPartitions to_commit(bool async, const TopicPartitions* only = nullptr) {
        TopicPartitions offsets;
        for (auto& entry : partitions_) {
            const Key& where = entry.first;  // named, not bound: lambdas capture it
            Partition& state = entry.second;
            if (state.done < 0 || state.done == state.committed) continue;
            if (async && state.done == state.commit_in_flight) continue;
            if (only != nullptr &&
                std::none_of(only->begin(), only->end(), [&](const TopicPartition& p) {
                    return p.topic == where.first && p.partition == where.second;
                })) {
                continue;
            }
            offsets.push_back(TopicPartition{where.first, where.second, state.done});
            if (async) state.commit_in_flight = state.done;
        }
        return offsets;
    }

    /// @brief What the coordinator answered for @p offsets (each partition's own error counts
    /// too): confirmed offsets are committed; a refused one is sent again by the next commit.
    void note_committed(rd_kafka_resp_err_t err, const TopicPartitions& offsets) {
        for (const TopicPartition& p : offsets) {
            Partition* state = find(p.topic, p.partition);
            if (state == nullptr || p.offset < 0) continue;
            if (state->commit_in_flight == p.offset)
                state->commit_in_flight = RD_KAFKA_OFFSET_INVALID;
            if (err == RD_KAFKA_RESP_ERR_NO_ERROR && p.error == RD_KAFKA_RESP_ERR_NO_ERROR)
                state->committed = std::max(state->committed, p.offset);
        }
    }

  private:
    using Key = std::pair<std::string, std::int32_t>;

    /// One assigned partition: the records handed out and not yet past, in order.
    struct Partition {
        /// The offset after the last record settled, with none before it unsettled: what is
        /// committed. RD_KAFKA_OFFSET_INVALID until the first record.
        std::int64_t done = RD_KAFKA_OFFSET_INVALID;
        /// The last offset the group coordinator confirmed: a commit refused or lost is sent
        /// again (a sent one is not taken for done).
        std::int64_t committed = RD_KAFKA_OFFSET_INVALID;
        std::int64_t commit_in_flight = RD_KAFKA_OFFSET_INVALID;  ///< an async commit sent
        /// Handed out and not yet past `done`: offset and whether it is settled.
        std::deque<std::pair<std::int64_t, bool>> outstanding;
        /// Records from this offset on were read and dropped without being handed out (held
        /// when the breaker opened, fetched while paused), or the seek back to them failed:
        /// the client's position is past them. Nothing more of the partition is handed out
        /// until a seek here succeeds.
        std::optional<std::int64_t> rewind_to;
        /// A record to try again: the records after it in this poll wait.
        std::optional<std::int64_t> retrying;
        std::uint32_t retry_tries = 0;  ///< the attempts at `retrying` so far
        bool paused = false;            ///< paused until resume_at
        std::chrono::steady_clock::time_point resume_at{};
    };

    static void rewind_at_most(Partition& state, std::int64_t offset) {
        if (state.done >= 0 && offset < state.done) return;  // settled already
        state.rewind_to = state.rewind_to ? std::min(*state.rewind_to, offset) : offset;
    }

    [[nodiscard]] Partition* find(const std::string& topic, std::int32_t partition) {
        auto it = partitions_.find(Key{topic, partition});
        return it == partitions_.end() ? nullptr : &it->second;
    }
    [[nodiscard]] const Partition* find(const std::string& topic, std::int32_t partition) const {
        auto it = partitions_.find(Key{topic, partition});
        return it == partitions_.end() ? nullptr : &it->second;
    }

    std::map<Key, Partition> partitions_;
};

}  // namespace kafka
IDEM_END_NAMESPACE
