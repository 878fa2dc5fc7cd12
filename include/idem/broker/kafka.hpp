#pragma once
/// @file
/// @brief KafkaConsumer: reads Kafka topics as a member of a consumer group (librdkafka) and
/// hands each record to a handler as an idem::Delivery, so the handler's claim, poison limit
/// and outcome decide what happens to the partition's offset: committed after the store's
/// commit (or stored in the commit itself), retried in place, or moved past a dead letter
/// produced to `<topic>.DLT` and confirmed. Its parts are in idem/kafka/ (consumer_options,
/// group_member, offset_ledger, store_offsets). Link idem::kafka.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/broker/consumer.hpp"
#include "idem/broker/consumer_health.hpp"
#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/contract/dead_letter_envelope.hpp"
#include "idem/contract/store.hpp"
#include "idem/contract/stored_offset.hpp"
#include "idem/delivery.hpp"
#include "idem/error.hpp"
#include "idem/handler.hpp"
#include "idem/kafka/config.hpp"
#include "idem/kafka/consumer.hpp"
#include "idem/kafka/consumer_options.hpp"
#include "idem/kafka/error.hpp"
#include "idem/kafka/group_member.hpp"
#include "idem/kafka/message.hpp"
#include "idem/kafka/offset_ledger.hpp"
#include "idem/kafka/producer.hpp"
#include "idem/kafka/store_offsets.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

namespace detail {
struct KafkaConsumerProbe;  ///< defined by tests only

/// A record as a KafkaConsumer polled it: the librdkafka message and the copy the handler sees.
struct KafkaItem {
    kafka::Message record;
    KafkaMessage body;  ///< moved out in batch mode: the position below stays
    std::string topic;
    std::int32_t partition = 0;
    std::int64_t offset = 0;
    std::uint32_t tries = 1;  ///< this consumer's attempts at this offset, this one included
};
}  // namespace detail

/// @brief Reads Kafka topics in a consumer group and hands each record to a handler, keeping
/// per-partition order: a record whose outcome does not settle it (failed, deferred,
/// in_progress) is tried again in place (its partition paused, sought back, resumed after the
/// backoff or the outcome's retry_after), and the records after it wait. Kafka keeps no
/// delivery count, so the handler counts attempts in its store before each one
/// (DeliveryCounter::store): a record that kills every worker is parked after max_deliveries.
///
/// After the handler: an acking outcome moves the partition's position past the record
/// (committed to Kafka after the poll, or stored in the handler's commit with
/// KafkaOffsets::in_store); a dead letter (a poison or malformed record, or a duplicate of
/// one) is first produced to the dead-letter topic with headers idem-reason, idem-scope,
/// idem-message-id, idem-original-topic, idem-original-partition, idem-original-offset and the
/// original headers, and the position moves only once its delivery report confirmed it.
/// Nothing moves past a record whose outcome is unknown.
///
/// Rebalances: librdkafka runs the group's callbacks inside this consumer's own polls, so a
/// record in the handler's hands is never revoked under it. On revocation (eager: every
/// partition; cooperative-sticky: those that move) the positions reached are committed
/// synchronously and the records read but not handled are dropped for the next owner; on a
/// lost assignment nothing is committed. While the handler's store is unreachable (the circuit
/// breaker) every assigned partition is paused and the group's callbacks are still served.
///
/// @code
/// idem::SqliteStore store{"orders.db"};
/// auto handler = idem::make_handler(store, idem::Policy{"capture"},
///     [&](auto& tx, const idem::KafkaMessage& m) { /* ... */ });
/// idem::KafkaConsumer consumer{idem::kafka::Config{}.bootstrap_servers("127.0.0.1:9092"),
///                              {{"payments"}, "capture-worker"}, handler};
/// std::thread worker([&] { consumer.run(); });   // ... consumer.request_stop(); worker.join();
/// @endcode
///
/// Written on broker::ConsumerBase; poll_once() and run() belong to one thread at a time.
class KafkaConsumer final : public broker::ConsumerBase<KafkaConsumer, KafkaConsumerOptions,
                                                        detail::KafkaItem, KafkaMessage> {
    using Base =
        broker::ConsumerBase<KafkaConsumer, KafkaConsumerOptions, detail::KafkaItem, KafkaMessage>;
    friend Base;

  public:
    /// The handler of the plain form: the outcome decides the settlement.
    using Handler = std::function<Outcome(const Delivery&, const KafkaMessage&)>;

    /// @brief A consumer calling @p handler for each record. Joins the group on the first poll.
    /// @throws usage_error for an invalid option (KafkaOffsets::in_store needs an
    /// IdempotentHandler on a store that keeps offsets).
    KafkaConsumer(kafka::Config config, KafkaConsumerOptions options, Handler handler)
        : KafkaConsumer(
              Private{}, std::move(config), validated(std::move(options), false),
              broker::Dispatch<KafkaMessage>::plain(std::move(handler), "idem::KafkaConsumer"),
              {}) {}

    /// @brief A consumer calling @p handler.handle(delivery, record) (or, with
    /// handle_in_batches, handler.handle_batch() once per poll, for one partition's records).
    /// @p handler (and its store) must outlive the consumer. The store must count attempts
    /// (count_attempt(), or leases); KafkaOffsets::in_store needs one with stored_offset().
    /// @throws usage_error for an invalid option.
    template <class Store, class Effect>
    KafkaConsumer(kafka::Config config, KafkaConsumerOptions options,
                  IdempotentHandler<Store, Effect>& handler)
        : KafkaConsumer(Private{}, std::move(config),
                        validated(std::move(options), has_stored_offsets<Store>::value),
                        broker::Dispatch<KafkaMessage>::idempotent(handler),
                        kafka::StoreOffsets::of(handler.store())) {
        static_assert(has_count_attempt<Store>::value || has_default_lease<Store>::value,
                      "idem::KafkaConsumer: Kafka keeps no delivery count, so the store must "
                      "count attempts (count_attempt(), or a lease store's claims) for the "
                      "poison limit");
    }

    ~KafkaConsumer() { close_noexcept(); }

    /// @brief Leaves the group: the positions reached are committed (synchronously; in the
    /// store already with KafkaOffsets::in_store), the partitions revoked, the client closed.
    /// Call it after run() returned; the destructor does it too, reporting instead of throwing.
    /// @throws kafka::error when the final commit or the close fails.
    void close() {
        if (!member_.joined()) return;
        try {
            member_.leave();
        } catch (...) {
            held_.clear();
            throw;
        }
        held_.clear();
    }

    /// @brief Records tried again in place (of stats().not_acked).
    [[nodiscard]] std::size_t retried_in_place() const noexcept {
        return retried_.load(std::memory_order_relaxed);
    }
    /// @brief Rebalances this member went through (assignments and revocations).
    [[nodiscard]] std::size_t rebalances() const noexcept { return member_.rebalances(); }
    /// @brief The partitions assigned now, with the next offset this consumer will read in each
    /// (RD_KAFKA_OFFSET_INVALID before its first record). Polling thread only.
    [[nodiscard]] kafka::TopicPartitions assignment() const { return member_.ledger().positions(); }
    /// @brief "<group>": how health reports and errors name this consumer.
    [[nodiscard]] const std::string& name() const noexcept { return options_.group; }

  private:
    friend struct detail::KafkaConsumerProbe;  // tests: fault injection
    struct Private {};
    using PartitionKey = std::pair<std::string, std::int32_t>;

    /// @p options are validated already; copied into the base, so that the commit-hook flag
    /// reads them whatever the order the arguments are evaluated in.
    KafkaConsumer(Private, kafka::Config config, const KafkaConsumerOptions& options,
                  broker::Dispatch<KafkaMessage> dispatch, kafka::StoreOffsets store_offsets)
        : Base(options, std::move(dispatch),
               /*acks_in_commit=*/options.offsets == KafkaOffsets::in_store),
          member_(std::move(config), options_.group, options_.topics, options_.visibility_timeout,
                  options_.offsets == KafkaOffsets::in_store, std::move(store_offsets),
                  {[this](const std::exception& e) { report(e); },
                   [this] {
                       if (store_paused_) pause_all();
                   },
                   [this] { drop_unowned(); }}) {}
    /// The options checked; @p store_keeps_offsets: an IdempotentHandler whose store has
    /// stored_offset().
    static KafkaConsumerOptions validated(KafkaConsumerOptions options, bool store_keeps_offsets) {
        const std::string who = fmt::format("idem::KafkaConsumer(\"{}\")", options.group);
        kafka::detail::check_topics(options, who);
        broker::validate_consumer_options(options, who);
        kafka::detail::check_offsets(options, store_keeps_offsets, who);
        return options;
    }

    // -----------------------------------------------------------------------------------------
    // The group (kafka::GroupMember: the client, rebalances, commits, the offset ledger)

    kafka::Consumer& client() noexcept { return member_.client(); }
    kafka::OffsetLedger& ledger() noexcept { return member_.ledger(); }
    const kafka::OffsetLedger& ledger() const noexcept { return member_.ledger(); }

    /// Held records of partitions revoked or lost are dropped: their next owner reads them.
    void drop_unowned() {
        held_.erase(std::remove_if(held_.begin(), held_.end(),
                                   [this](const detail::KafkaItem& item) { return !owned(item); }),
                    held_.end());
    }

    [[nodiscard]] bool owned(const detail::KafkaItem& item) const {
        return member_.ledger().owns(item.topic, item.partition);
    }

    // -----------------------------------------------------------------------------------------
    // Reading

    std::vector<detail::KafkaItem> read() {
        member_.join();
        member_.commit(kafka::CommitMode::async);  // what the last poll settled
        if (store_paused_) resume_after_store();
        rewind_unsettled();
        resume_due();
        const std::size_t want = options_.batch_size;
        std::chrono::milliseconds wait =
            held_.empty() ? options_.poll_wait : std::chrono::milliseconds(0);
        while (held_.size() < want) {
            std::optional<kafka::Message> record = client().poll(wait);
            if (!record) break;
            wait = std::chrono::milliseconds(0);
            detail::KafkaItem item{std::move(*record), {}, {}, 0, 0, 1};
            item.body = kafka::detail::copy_of(item.record);
            item.topic = item.body.topic;
            item.partition = item.body.partition;
            item.offset = item.body.offset;
            if (!owned(item)) continue;  // revoked meanwhile
            // Its position is past records to read again (a failed seek): read from there
            // once a seek succeeds, not from here.
            if (ledger().must_rewind(item.topic, item.partition)) continue;
            held_.push_back(std::move(item));
        }
        return take_held();
    }

    /// The held records to hand out now: all of them, or with handle_in_batches the first
    /// partition's (the others wait for the next poll). Each is noted as outstanding.
    std::vector<detail::KafkaItem> take_held() {
        std::vector<detail::KafkaItem> batch;
        if (held_.empty()) return batch;
        const PartitionKey first{held_.front().topic, held_.front().partition};
        std::deque<detail::KafkaItem> rest;
        for (detail::KafkaItem& item : held_) {
            if (options_.handle_in_batches && PartitionKey{item.topic, item.partition} != first) {
                rest.push_back(std::move(item));
                continue;
            }
            const auto tries = ledger().hand_out(item.topic, item.partition, item.offset);
            if (!tries) continue;  // revoked, or settled or handed out already
            item.tries = *tries;
            batch.push_back(std::move(item));
        }
        held_ = std::move(rest);
        return batch;
    }

    /// Partitions with records handed out but not settled (a retry, a stop, an error, the
    /// store away) or read and dropped: sought back to the first of them, so they are read
    /// again, in order. The records are forgotten only once the seek succeeded; a seek that
    /// fails (its outcome unknown) is reported and tried again by the next read, and until
    /// then nothing of the partition is handed out, so its position cannot pass them.
    void rewind_unsettled() {
        for (const kafka::TopicPartition& position : ledger().rewinds()) {
            // Its held records come after the position: read again from there.
            held_.erase(std::remove_if(held_.begin(), held_.end(),
                                       [&](const detail::KafkaItem& item) {
                                           return item.topic == position.topic &&
                                                  item.partition == position.partition;
                                       }),
                        held_.end());
            try {
                seek(position);
            } catch (const broker_error& e) {
                report(e);  // still due: tried again by the next read
                continue;
            }
            ledger().rewound(position);
        }
    }

    void seek(const kafka::TopicPartition& position) {
        if (seek_fault_) seek_fault_(position);
        client().seek(position);
    }

    /// Records read and not handed out, dropped: each partition reads again from its first.
    void drop_held() {
        for (const detail::KafkaItem& item : held_)
            ledger().rewind_at_most(item.topic, item.partition, item.offset);
        held_.clear();
    }

    void resume_due() {
        const kafka::TopicPartitions due = ledger().take_due(std::chrono::steady_clock::now());
        if (!due.empty()) client().resume(due);
    }
    static const KafkaMessage& message_of(const detail::KafkaItem& item) noexcept {
        return item.body;
    }
    static KafkaMessage message_of(detail::KafkaItem&& item) noexcept {
        return std::move(item.body);
    }

    Delivery delivery_of(const detail::KafkaItem& item) const {
        return kafka::detail::kafka_delivery(item.body, item.tries, options_.id_field);
    }

    /// A partition being retried holds back the records after the retried one.
    bool blocked(const detail::KafkaItem& item) const {
        return ledger().blocked(item.topic, item.partition, item.offset);
    }
    /// What a stop or an open breaker left: sought back by the next read (rewind_unsettled).
    void unhandled(std::vector<detail::KafkaItem>&, std::size_t) {}

    CommitHook commit_hook_of(const detail::KafkaItem& item, const Delivery&) const {
        return CommitHook{
            StoredOffset{options_.group, item.topic, item.partition, item.offset + 1}};
    }
    [[nodiscard]] bool commit_publishes_dead_letters() const noexcept { return false; }

    void acked_in_commit(detail::KafkaItem& item, const Outcome&) { mark_done(item); }

    // -----------------------------------------------------------------------------------------
    // Settlement

    broker::Settlement::Kind settle(detail::KafkaItem& item, const KafkaMessage& body,
                                    const Delivery& delivery, const Outcome& outcome,
                                    const broker::Settlement& settlement) {
        switch (settlement.kind) {
            case broker::Settlement::Kind::redeliver:
                retry_in_place(item, settlement.delay);
                break;
            case broker::Settlement::Kind::dead_letter_then_ack:
                produce_dead_letter(delivery, body, outcome);
                store_position(item);
                mark_done(item);
                break;
            case broker::Settlement::Kind::ack:
                store_position(item);
                mark_done(item);
                break;
        }
        return settlement.kind;
    }

    /// With KafkaOffsets::in_store, a record the commit did not move past (a duplicate, a dead
    /// letter now confirmed) is moved past in a transaction of its own.
    void store_position(const detail::KafkaItem& item) {
        if (options_.offsets != KafkaOffsets::in_store) return;
        member_.store_offsets().write(
            StoredOffset{options_.group, item.topic, item.partition, item.offset + 1});
    }

    void mark_done(const detail::KafkaItem& item) {
        ledger().settle(item.topic, item.partition, item.offset);
    }

    /// Pauses the partition until the delay is over; the next read seeks back to the record.
    void retry_in_place(const detail::KafkaItem& item,
                        std::optional<std::chrono::milliseconds> delay) {
        // Not assigned: revoked, the next owner reads it.
        if (!ledger().retry(item.topic, item.partition, item.offset, item.tries)) return;
        retried_.fetch_add(1, std::memory_order_relaxed);
        if (delay && delay->count() > 0 && !ledger().paused(item.topic, item.partition)) {
            client().pause({kafka::TopicPartition{item.topic, item.partition}});
            ledger().paused_until(item.topic, item.partition,
                                  std::chrono::steady_clock::now() + *delay);
        }
    }
    /// Produces the copy and waits for its delivery report; throws (the record stays
    /// unsettled, read again) when the cluster does not confirm it.
    void produce_dead_letter(const Delivery& delivery, const KafkaMessage& body,
                             const Outcome& outcome) {
        if (!producer_) {
            kafka::Config config = options_.dead_letter_producer.value_or(kafka::Config{});
            if (!options_.dead_letter_producer) {
                config.bootstrap_servers(member_.config().get("bootstrap.servers").value_or(""));
                config.idempotent();
            }
            producer_.emplace(config);
        }
        // The value and every original header value through the policy's redactor, when it has
        // one (a redactor that throws leaves the record unsettled); the reason is the handler's.
        // The count the handler judged (broker::as_judged): the store's attempts, since Kafka
        // keeps no count.
        kafka::Headers headers = envelope::fields_of(outcome, delivery, dispatch().scope());
        headers.emplace_back(envelope::original_topic, body.topic);
        headers.emplace_back(envelope::original_partition, std::to_string(body.partition));
        headers.emplace_back(envelope::original_offset, std::to_string(body.offset));
        for (const auto& [name, value] : body.headers)
            headers.emplace_back(name, dispatch().redact(value));
        const std::string topic =
            options_.dead_letter.empty() ? body.topic + ".DLT" : options_.dead_letter;
        producer_->produce(topic, body.key, dispatch().redact(body.value), headers)
            .wait(options_.dead_letter_timeout);
    }

    // -----------------------------------------------------------------------------------------
    // The store away (the circuit breaker): every partition paused, the group still served

    void idle(std::chrono::milliseconds duration) {
        if (!member_.joined()) {
            sleep_unless_stopped(duration);
            return;
        }
        if (!store_paused_) {
            store_paused_ = true;
            pause_all();
        }
        const auto until = std::chrono::steady_clock::now() + duration;
        while (!stop_requested() && std::chrono::steady_clock::now() < until) {
            try {
                // Paused: no record comes; one fetched before the pause is dropped here and
                // read again after it (resume_after_store, rewind_unsettled).
                if (std::optional<kafka::Message> record =
                        client().poll(std::chrono::milliseconds(50))) {
                    ledger().rewind_at_most(std::string(record->topic()), record->partition(),
                                            record->offset());
                }
            } catch (const std::exception& e) {
                report(e);
                sleep_unless_stopped(std::chrono::milliseconds(50));
            }
        }
    }

    void pause_all() {
        const kafka::TopicPartitions all = ledger().partitions();
        if (!all.empty()) client().pause(all);
    }

    /// The breaker closed: every partition reads again from its first record not settled
    /// (what was held or fetched meanwhile included; rewind_unsettled() seeks), and those
    /// not waiting for a retry are resumed.
    void resume_after_store() {
        store_paused_ = false;
        drop_held();
        ledger().rewind_all_to_done();
        const kafka::TopicPartitions ready = ledger().unpaused();
        if (!ready.empty()) client().resume(ready);
    }

    // -----------------------------------------------------------------------------------------
    // Health

    ConsumerHealth health() {
        ConsumerHealth health;
        health.consumer = options_.group;
        dead_letter_name_ = options_.dead_letter.empty() && !options_.topics.empty()
                                ? options_.topics.front() + ".DLT"
                                : options_.dead_letter;
        health.dead_letter_destination = dead_letter_name_;
        if (!member_.joined()) return health;
        std::uint64_t lag = 0;
        for (const kafka::TopicPartition& p : ledger().positions()) {
            const auto marks = client().watermarks(kafka::TopicPartition{p.topic, p.partition});
            if (!marks) return health;  // not known yet: unknown
            const std::int64_t from = p.offset >= 0 ? p.offset : marks->first;
            lag += static_cast<std::uint64_t>(std::max<std::int64_t>(0, marks->second - from));
        }
        health.pending = lag;
        return health;
    }

    void close_noexcept() noexcept {
        try {
            close();
        } catch (const std::exception& e) {
            report(e);
        } catch (...) {
        }
    }

    kafka::GroupMember member_;  ///< the client, its rebalances and commits, the offset ledger
    std::optional<kafka::Producer> producer_;  ///< the dead letters', made on first use
    std::deque<detail::KafkaItem> held_;       ///< polled, not handed out yet
    bool store_paused_ = false;                ///< every partition paused for the circuit breaker
    /// Tests only (through detail::KafkaConsumerProbe): runs before each seek and may throw,
    /// as a seek that timed out does.
    std::function<void(const kafka::TopicPartition&)> seek_fault_;
    std::string dead_letter_name_;
    std::atomic<std::size_t> retried_{0};
};

IDEM_END_NAMESPACE
