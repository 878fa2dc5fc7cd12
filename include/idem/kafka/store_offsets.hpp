#pragma once
/// @file
/// @brief idem::kafka::StoreOffsets: the bridge between a Kafka consumer and a handler's store
/// that keeps offsets (stored_offset(), KafkaOffsets::in_store): reads where each assigned
/// partition starts, and writes a position in a transaction of its own for a record the
/// handler's commit did not move past. Link idem::kafka.

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/stored_offset.hpp"
#include "idem/kafka/message.hpp"

IDEM_BEGIN_NAMESPACE
namespace kafka {

/// @brief A handler's store as a keeper of a consumer group's offsets, captured as two calls
/// (the store's type erased); empty for a store without stored_offset() and for no store.
/// The store must outlive it. Not thread-safe: the polling thread's.
class StoreOffsets {
  public:
    /// @brief No store: empty().
    StoreOffsets() = default;

    /// @brief The offsets kept in @p store, when it has stored_offset(); otherwise empty().
    template <class Store>
    static StoreOffsets of([[maybe_unused]] Store& store) {
        StoreOffsets offsets;
        if constexpr (has_stored_offsets<Store>::value) {
            offsets.read_ = [&store](const std::string& group, const std::string& topic,
                                     std::int32_t partition) {
                return store.stored_offset(group, topic, partition);
            };
            offsets.write_ = [&store](const StoredOffset& offset) {
                auto tx = store.begin();
                CommitHook hook{offset};
                attach_commit_hook(tx, hook);
                tx.commit();
            };
        }
        return offsets;
    }

    /// @brief Whether no store keeps the offsets.
    [[nodiscard]] bool empty() const noexcept { return !read_; }

    /// @brief Writes @p offset in a transaction of its own.
    /// @throws what the store's begin() and commit() throw.
    void write(const StoredOffset& offset) const { write_(offset); }

    /// @brief The group's partitions being assigned: each one the store has an offset for
    /// starts there (@p assigned's offsets set, and kept for start_of()). A read that throws is
    /// passed to @p report and the partition starts at the group's committed offset, which is
    /// never past the stored one: what is replayed from there are duplicates, absorbed by the
    /// claims.
    void assigning(const std::string& group, TopicPartitions& assigned,
                   const std::function<void(const std::exception&)>& report) {
        for (TopicPartition& p : assigned) {
            try {
                if (auto stored = read_(group, p.topic, p.partition)) {
                    p.offset = *stored;
                    starting_[Key{p.topic, p.partition}] = *stored;
                }
            } catch (const std::exception& e) {
                report(e);
            }
        }
    }

    /// @brief Where @p topic / @p partition starts, as assigning() read it; nothing when the
    /// store had no offset for it.
    [[nodiscard]] std::optional<std::int64_t> start_of(const std::string& topic,
                                                       std::int32_t partition) const {
        const auto it = starting_.find(Key{topic, partition});
        if (it == starting_.end()) return std::nullopt;
        return it->second;
    }
    /// @brief The assignment is done: the starts read are forgotten.
    void assigned() noexcept { starting_.clear(); }

  private:
    using Key = std::pair<std::string, std::int32_t>;

    std::function<std::optional<std::int64_t>(const std::string&, const std::string&, std::int32_t)>
        read_;
    std::function<void(const StoredOffset&)> write_;  ///< in a transaction of its own
    std::map<Key, std::int64_t> starting_;            ///< stored offsets being assigned
};

}  // namespace kafka
IDEM_END_NAMESPACE
