// broker::ConsumerBase driven through a fake adapter: no server, every hook. The adapter reads
// from a deque, records each hook the base calls, and settles by recording; the store is the
// MemoryStore, its fault injection standing in for an outage (SQLite where a transaction counts
// the next delivery's attempt).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "idem/broker/consumer.hpp"
#include "idem/handler.hpp"
#include "idem/store/memory.hpp"
#if IDEM_HAS_SQLITE
#include "idem/store/sqlite.hpp"
#include "idem/testing/temp_dir.hpp"
#endif

namespace {

using idem::Delivery;
using idem::Disposition;
using idem::Outcome;
using idem::broker::Settlement;
using namespace std::chrono_literals;

/// One delivery as the fake broker holds it.
struct FakeRaw {
    std::string id;
    std::uint32_t count = 1;
    std::string body;
    bool blocked = false;        ///< the adapter's blocked() says so
    bool store_counted = false;  ///< a broker without a count (Kafka's way): the store counts
};

struct FakeOptions : idem::broker::ConsumerOptions {};

/// What settle() was asked to do with one delivery.
struct SettledCall {
    std::string id;
    std::uint32_t count;  ///< the delivery count settle() was given
    Disposition disposition;
    Settlement::Kind kind;
    std::optional<std::chrono::milliseconds> delay;
};

class FakeConsumer final
    : public idem::broker::ConsumerBase<FakeConsumer, FakeOptions, FakeRaw, std::string> {
    using Base = idem::broker::ConsumerBase<FakeConsumer, FakeOptions, FakeRaw, std::string>;
    friend Base;

  public:
    template <class Store, class Effect>
    FakeConsumer(FakeOptions options, idem::IdempotentHandler<Store, Effect>& handler,
                 bool acks_in_commit = false)
        : Base(validated(std::move(options)),
               idem::broker::Dispatch<std::string>::idempotent(handler), acks_in_commit) {}
    FakeConsumer(FakeOptions options, idem::broker::Dispatch<std::string>::Handler handler)
        : Base(validated(std::move(options)),
               idem::broker::Dispatch<std::string>::plain(std::move(handler), "FakeConsumer")) {}

    std::deque<FakeRaw> queue;  ///< what read() hands out, batch_size at a time

    // What the base called.
    std::vector<SettledCall> settled;
    std::size_t reads = 0;
    std::size_t settle_all_calls = 0;
    std::size_t handling_calls = 0;
    std::size_t handled_calls = 0;
    std::vector<std::size_t> unhandled_from;
    std::vector<std::string> acked_in_commit_ids;
    std::vector<std::chrono::milliseconds> idles;
    mutable std::size_t commit_hooks_asked = 0;  // commit_hook_of() is const
    std::size_t health_calls = 0;

    // How the optional hooks answer.
    bool pipeline_answer = false;
    std::optional<std::chrono::milliseconds> in_progress_answer;
    bool commit_publishes_answer = true;
    std::function<void(const std::string&)> after_settle;  ///< e.g. request_stop()
    std::function<void(const FakeRaw&)> on_handling;       ///< before one delivery's handler

  private:
    static FakeOptions validated(FakeOptions options) {
        idem::broker::validate_consumer_options(options, "FakeConsumer");
        return options;
    }

    // The required hooks.
    std::vector<FakeRaw> read() {
        ++reads;
        std::vector<FakeRaw> batch;
        while (!queue.empty() && batch.size() < options_.batch_size) {
            batch.push_back(std::move(queue.front()));
            queue.pop_front();
        }
        return batch;
    }
    Delivery delivery_of(const FakeRaw& raw) const {
        Delivery delivery;
        delivery.message_id = raw.id;
        delivery.delivery_count = raw.count;
        if (raw.store_counted) delivery.counted_by = idem::DeliveryCounter::store;
        return delivery;
    }
    static const std::string& message_of(const FakeRaw& raw) noexcept { return raw.body; }
    Settlement::Kind settle(FakeRaw& raw, const std::string&, const Delivery& delivery,
                            const Outcome& outcome, const Settlement& settlement) {
        settled.push_back(SettledCall{raw.id, delivery.delivery_count.value(), outcome.disposition,
                                      settlement.kind, settlement.delay});
        if (after_settle) after_settle(raw.id);
        return settlement.kind;
    }
    idem::ConsumerHealth health() {
        ++health_calls;
        idem::ConsumerHealth health;
        health.consumer = "fake";
        health.pending = queue.size();
        return health;
    }

    // Every optional hook, recording.
    idem::CommitHook commit_hook_of(const FakeRaw& raw, const Delivery&) const {
        ++commit_hooks_asked;
        return idem::CommitHook{idem::StoredOffset{"fake-group", "fake-topic", 0,
                                                   static_cast<std::int64_t>(raw.count)}};
    }
    void settle_all(std::vector<FakeRaw>& batch,
                    std::vector<idem::broker::ToSettle<std::string>>& settling) {
        ++settle_all_calls;
        Base::settle_all(batch, settling);
    }
    void unhandled(std::vector<FakeRaw>&, std::size_t from) { unhandled_from.push_back(from); }
    void handling(FakeRaw* first, std::size_t count) {
        ++handling_calls;
        if (on_handling && count == 1) on_handling(*first);
    }
    void handled() { ++handled_calls; }
    [[nodiscard]] bool pipelines() const noexcept { return pipeline_answer; }
    [[nodiscard]] std::optional<std::chrono::milliseconds> in_progress_delay() const noexcept {
        return in_progress_answer;
    }
    [[nodiscard]] bool blocked(const FakeRaw& raw) const noexcept { return raw.blocked; }
    void acked_in_commit(FakeRaw& raw, const Outcome&) { acked_in_commit_ids.push_back(raw.id); }
    [[nodiscard]] bool commit_publishes_dead_letters() const noexcept {
        return commit_publishes_answer;
    }
    void idle(std::chrono::milliseconds duration) { idles.push_back(duration); }
};

FakeOptions fast_options() {
    FakeOptions options;
    options.poll_wait = 10ms;
    options.batch_size = 8;
    options.circuit_breaker.initial_backoff = 1ms;
    options.circuit_breaker.max_backoff = 2ms;
    return options;
}

idem::Policy policy_of(std::uint32_t max_deliveries) {
    idem::PolicyOptions options;
    options.max_deliveries = max_deliveries;
    return idem::Policy{"fake", options};
}

/// A handler whose effect counts its runs per body, and fails for a body "fail".
struct Counting {
    std::map<std::string, int> runs;
    auto effect() {
        return [this](auto&, const std::string& body) {
            ++runs[body];
            if (body == "fail") throw std::runtime_error("gateway says no");
        };
    }
};

TEST(ConsumerBase, OneAtATimeEachOutcomeIsSettledAsItsSettlementSays) {
    idem::MemoryStore store;
    Counting counting;
    auto handler = idem::make_handler(store, policy_of(3), counting.effect());
    FakeOptions options = fast_options();
    std::vector<std::string> health_of;
    options.on_health = [&](const idem::ConsumerHealth& h) { health_of.emplace_back(h.consumer); };
    options.health_interval = 0ms;
    FakeConsumer consumer{options, handler};
    consumer.queue = {
        {"m-1", 1, "a"}, {"m-1", 2, "a"}, {"m-2", 1, "fail"}, {"m-3", 3, "c"}, {"", 1, "no id"}};
    EXPECT_EQ(consumer.poll_once(), 5u);

    ASSERT_EQ(consumer.settled.size(), 5u);
    EXPECT_EQ(consumer.settled[0].kind, Settlement::Kind::ack);          // processed
    EXPECT_EQ(consumer.settled[1].disposition, Disposition::duplicate);  // its redelivery
    EXPECT_EQ(consumer.settled[1].kind, Settlement::Kind::ack);
    EXPECT_EQ(consumer.settled[2].disposition, Disposition::failed);  // the effect threw
    EXPECT_EQ(consumer.settled[2].kind, Settlement::Kind::redeliver);
    ASSERT_TRUE(consumer.settled[2].delay) << "the default redelivery backoff";
    EXPECT_EQ(consumer.settled[3].disposition, Disposition::dead_lettered);  // count 3 of 3
    EXPECT_EQ(consumer.settled[3].kind, Settlement::Kind::dead_letter_then_ack);
    EXPECT_EQ(consumer.settled[3].count, 3u) << "the count the poison limit judged";
    EXPECT_EQ(consumer.settled[4].disposition, Disposition::dead_lettered);  // malformed
    EXPECT_EQ(counting.runs["a"], 1);
    EXPECT_EQ(counting.runs.count("c"), 0u) << "parked before its effect";

    const auto stats = consumer.stats();
    EXPECT_EQ(stats.read, 3u);  // count 1: m-1, m-2 and the one without an id
    EXPECT_EQ(stats.redelivered, 2u);
    EXPECT_EQ(stats.acked, 4u);
    EXPECT_EQ(stats.dead_lettered, 2u);
    EXPECT_EQ(stats.not_acked, 1u);
    EXPECT_EQ(consumer.handling_calls, 5u);
    EXPECT_EQ(consumer.handled_calls, 5u);
    EXPECT_EQ(consumer.commit_hooks_asked, 0u) << "not built with acks_in_commit";
    EXPECT_EQ(consumer.health_calls, 1u);
    EXPECT_EQ(health_of, std::vector<std::string>{"fake"});
}

TEST(ConsumerBase, BatchModeHandsThePollToOneHandleBatchAndSettlesItInOneCall) {
    idem::MemoryStore store;
    Counting counting;
    auto handler = idem::make_handler(store, policy_of(5), counting.effect());
    FakeOptions options = fast_options();
    options.handle_in_batches = true;
    FakeConsumer consumer{options, handler};
    consumer.queue = {{"b-1", 1, "x"}, {"b-2", 1, "y"}, {"b-1", 2, "x"}, {"b-3", 1, "fail"}};
    EXPECT_EQ(consumer.poll_once(), 4u);
    EXPECT_EQ(consumer.settle_all_calls, 1u);
    EXPECT_EQ(consumer.handling_calls, 1u) << "one call for the whole batch";
    ASSERT_EQ(consumer.settled.size(), 4u);
    EXPECT_EQ(consumer.settled[0].disposition, Disposition::processed);
    EXPECT_EQ(consumer.settled[1].disposition, Disposition::processed);
    EXPECT_EQ(consumer.settled[2].disposition, Disposition::duplicate);
    EXPECT_EQ(consumer.settled[3].kind, Settlement::Kind::redeliver);
    EXPECT_EQ(counting.runs["x"], 1);
}

TEST(ConsumerBase, ABlockedDeliveryIsNeitherHandledNorSettledNorCounted) {
    idem::MemoryStore store;
    Counting counting;
    auto handler = idem::make_handler(store, policy_of(5), counting.effect());
    FakeConsumer consumer{fast_options(), handler};
    consumer.queue = {{"k-1", 1, "p"}, {"k-2", 1, "q", /*blocked=*/true}, {"k-3", 1, "r"}};
    EXPECT_EQ(consumer.poll_once(), 2u);
    ASSERT_EQ(consumer.settled.size(), 2u);
    EXPECT_EQ(consumer.settled[0].id, "k-1");
    EXPECT_EQ(consumer.settled[1].id, "k-3");
    EXPECT_EQ(counting.runs.count("q"), 0u);
    EXPECT_EQ(consumer.stats().read, 2u);
}

TEST(ConsumerBase, AStopBetweenDeliveriesLeavesTheRestToTheAdaptersUnhandledHook) {
    idem::MemoryStore store;
    Counting counting;
    auto handler = idem::make_handler(store, policy_of(5), counting.effect());
    FakeConsumer consumer{fast_options(), handler};
    consumer.queue = {{"s-1", 1, "1"}, {"s-2", 1, "2"}, {"s-3", 1, "3"}};
    consumer.after_settle = [&](const std::string& id) {
        if (id == "s-1") consumer.request_stop();
    };
    EXPECT_EQ(consumer.poll_once(), 1u);
    EXPECT_EQ(consumer.unhandled_from, std::vector<std::size_t>{1});
    EXPECT_EQ(consumer.settled.size(), 1u);
    EXPECT_EQ(consumer.poll_once(), 0u) << "nothing is read after a stop";
    EXPECT_EQ(consumer.reads, 1u);
}

TEST(ConsumerBase, AnUnreachableStoreOpensTheBreakerWhichIdlesAndProbesUntilTheStoreAnswers) {
    idem::MemoryStore store;
    Counting counting;
    auto handler = idem::make_handler(store, policy_of(5), counting.effect());
    FakeConsumer consumer{fast_options(), handler};
    consumer.queue = {{"o-1", 1, "1"}, {"o-2", 1, "2"}};
    // The first begin() fails (o-1), then two probes; the third probe reaches the store.
    store.inject(idem::Fault::begin, 3);
    EXPECT_EQ(consumer.poll_once(), 1u);
    EXPECT_EQ(consumer.unhandled_from, std::vector<std::size_t>{1}) << "o-2 stays unread";
    ASSERT_EQ(consumer.settled.size(), 1u);
    EXPECT_EQ(consumer.settled[0].disposition, Disposition::failed);
    EXPECT_EQ(consumer.settled[0].kind, Settlement::Kind::redeliver);

    consumer.queue = {{"o-2", 2, "2"}};
    EXPECT_EQ(consumer.poll_once(), 1u) << "the breaker closed once a probe succeeded";
    EXPECT_EQ(consumer.idles.size(), 3u) << "one wait before each probe, in the adapter's idle()";
    const auto stats = consumer.stats();
    EXPECT_EQ(stats.circuit_opened, 1u);
    EXPECT_EQ(stats.store_probes, 3u);
    EXPECT_EQ(consumer.settled.back().disposition, Disposition::processed);
    EXPECT_EQ(counting.runs["2"], 1);
}

TEST(ConsumerBase, WithAcksInCommitTheStoresCommitSettlesAndTheAdapterIsToldOnly) {
    idem::MemoryStore store;
    Counting counting;
    auto handler = idem::make_handler(store, policy_of(5), counting.effect());
    FakeConsumer consumer{fast_options(), handler, /*acks_in_commit=*/true};
    consumer.commit_publishes_answer = false;  // the adapter publishes dead-letter copies
    consumer.queue = {{"c-1", 1, "1"}, {"c-2", 5, "2"}};
    EXPECT_EQ(consumer.poll_once(), 2u);
    EXPECT_EQ(consumer.commit_hooks_asked, 2u);
    EXPECT_EQ(consumer.acked_in_commit_ids, std::vector<std::string>{"c-1"});
    ASSERT_EQ(consumer.settled.size(), 1u) << "the processed one was settled by the commit";
    EXPECT_EQ(consumer.settled[0].id, "c-2");
    EXPECT_EQ(consumer.settled[0].kind, Settlement::Kind::dead_letter_then_ack)
        << "the commit stored the offset, the adapter still publishes the copy";
    EXPECT_EQ(consumer.stats().acked_in_commit, 1u);
    EXPECT_EQ(store.stored_offset("fake-group", "fake-topic", 0).value_or(-1), 1);
}

TEST(ConsumerBase, APlainHandlersInProgressWaitsTheAdaptersDelay) {
    FakeOptions options = fast_options();
    FakeConsumer consumer{options, [](const Delivery&, const std::string&) {
                              return Outcome{Disposition::in_progress, "held elsewhere"};
                          }};
    consumer.in_progress_answer = 250ms;
    consumer.pipeline_answer = true;  // a plain handler has no sequence: one at a time
    consumer.queue = {{"p-1", 1, "1"}};
    EXPECT_EQ(consumer.poll_once(), 1u);
    ASSERT_EQ(consumer.settled.size(), 1u);
    EXPECT_EQ(consumer.settled[0].kind, Settlement::Kind::redeliver);
    EXPECT_EQ(consumer.settled[0].delay, std::optional<std::chrono::milliseconds>(250ms));
    EXPECT_EQ(consumer.stats().not_acked, 1u);
}

TEST(ConsumerBase, ADeadLetterOfAStoreCountedDeliveryCarriesTheStoresCount) {
    idem::MemoryStore store;
    Counting counting;
    auto handler = idem::make_handler(store, policy_of(3), counting.effect());
    FakeConsumer consumer{fast_options(), handler};
    // Each delivery says count 1; the store counts the attempts: the third one is parked.
    for (int attempt = 1; attempt <= 3; ++attempt) {
        consumer.queue = {{"k-1", 1, "fail", false, /*store_counted=*/true}};
        EXPECT_EQ(consumer.poll_once(), 1u);
    }
    ASSERT_EQ(consumer.settled.size(), 3u);
    EXPECT_EQ(consumer.settled[1].disposition, Disposition::failed);
    EXPECT_EQ(consumer.settled[1].count, 1u) << "a redelivery keeps the broker's count";
    EXPECT_EQ(consumer.settled[2].disposition, Disposition::dead_lettered);
    EXPECT_EQ(consumer.settled[2].count, 3u) << "the dead letter carries the store's count";
    EXPECT_EQ(counting.runs["fail"], 2);
    const auto letters = store.dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_EQ(letters[0].delivery_count, 3u) << "the same count in the store";
}

#if IDEM_HAS_SQLITE
// A broker without a count (Kafka's way), one at a time: each delivery's commit counts the
// attempt of the next one the base hands out (a blocked one is passed over), so that count is on
// record before the next handler call begins, and that call does not count again.
TEST(ConsumerBase, AStoreCountedDeliverysCommitCountsTheNextOnesAttempt) {
    idem::testing::TempDir dir;
    idem::SqliteStore store{dir.file("ahead.db")};
    Counting counting;
    auto handler = idem::make_handler(store, policy_of(3), counting.effect());
    FakeConsumer consumer{fast_options(), handler};
    std::vector<std::uint32_t> on_record;  // at handling(): what the store has counted for it
    consumer.on_handling = [&](const FakeRaw& raw) {
        on_record.push_back(store.attempts("fake", raw.id));
    };
    consumer.queue = {{"a", 1, "a", false, true},
                      {"b", 1, "b", /*blocked=*/true, true},
                      {"c", 1, "c", false, true},
                      {"d", 1, "d", false, true}};
    EXPECT_EQ(consumer.poll_once(), 3u);
    EXPECT_EQ(on_record, (std::vector<std::uint32_t>{0, 1, 1}))
        << "a counts itself; c is counted in a's commit, d in c's";
    for (const char* id : {"a", "c", "d"})
        EXPECT_EQ(store.attempts("fake", id), 1u) << id;
    EXPECT_EQ(store.attempts("fake", "b"), 0u) << "a blocked delivery is not counted";
}
#endif

}  // namespace
