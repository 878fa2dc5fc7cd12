// idem::RedisStreamConsumer's batch mode against a real redis-server: one handle_batch per poll
// and one round trip for the acks, with SQLite and Redis stores; and the circuit breaker opening
// in the middle of a poll, one at a time and in batch mode (RedisStreamsBreaker).

#include "support/breaker_scenario.hpp"
#include "support/redis_streams_test_env.hpp"

namespace idem_test::redis_streams {
namespace {

// ---------------------------------------------------------------------------------------------
// 6. Batch mode: one handle_batch per poll, one round trip for the acks

/// The first batch of the batch-mode scenarios: orders 1 and 2 process, 3 throws on its first
/// attempt only, 4 always throws (poison at max_deliveries 3), order 1 again (a duplicate in the
/// same batch) and an entry without the id field (malformed).
struct FirstBatch {
    std::string one, two, flaky, poison, one_again, malformed;
};

const Fields poison_fields{{"order", "4"}, {"kind", "poison"}};
const Fields malformed_fields{{"customer", "9"}};

RedisStreamConsumerOptions batch_options(std::chrono::milliseconds visibility_timeout) {
    auto options = fast_options("orders");
    options.id_field = "order";
    options.handle_in_batches = true;
    options.visibility_timeout = visibility_timeout;
    return options;
}

/// The effect's rule for an entry, shared by the batch scenarios.
void misbehave(const StreamEntry& e, int& flaky_runs) {
    if (e.field("kind") == std::string_view("poison")) throw std::runtime_error("cannot parse");
    if (e.field("kind") == std::string_view("flaky") && ++flaky_runs == 1) {
        throw std::runtime_error("gateway timeout");
    }
}

class StreamBatchTest : public StreamConsumerTest {
  protected:
    /// Connects the store's pooled connection and loads its claim, commit and failure-note
    /// scripts, so the round trips counted next are the batch's own.
    static void warm_up(idem::RedisStore& store) {
        auto warm =
            idem::make_handler(store, idem::Policy{"warm-up"}, [](auto&, const std::string&) {});
        const auto outcomes = warm.handle_batch(std::vector<Delivery>{Delivery{"w", 1u}},
                                                std::vector<std::string>{"x"});
        ASSERT_EQ(outcomes.at(0).disposition, Disposition::processed);
        store.note_failure("warm-up", "w", "x", std::chrono::seconds(1));
    }

    FirstBatch add_first_batch() {
        FirstBatch b;
        b.one = xadd("orders", {{"order", "1"}});
        b.two = xadd("orders", {{"order", "2"}});
        b.flaky = xadd("orders", {{"order", "3"}, {"kind", "flaky"}});
        b.poison = xadd("orders", poison_fields);
        b.one_again = xadd("orders", {{"order", "1"}});
        b.malformed = xadd("orders", malformed_fields);
        return b;
    }

    /// After the first batch's poll: 6 read; 1, 2, the duplicate and the malformed entry acked
    /// (that one dead-lettered), the flaky and the poison entry pending; @p in_commit of the
    /// acks made in the store's commit.
    void expect_first_batch_done(const RedisStreamConsumer& consumer, const FirstBatch& b,
                                 std::size_t in_commit) {
        EXPECT_EQ(pending_ids("orders"), (std::vector<std::string>{b.flaky, b.poison}));
        const auto stats = consumer.stats();
        EXPECT_EQ(stats.read, 6u);
        EXPECT_EQ(stats.acked, 4u);
        EXPECT_EQ(stats.dead_lettered, 1u);
        EXPECT_EQ(stats.not_acked, 2u);
        EXPECT_EQ(stats.acked_in_commit, in_commit);
    }

    /// The second batch: order 2 again (a duplicate across batches) and a new order 5.
    void add_second_batch() {
        xadd("orders", {{"order", "2"}});
        xadd("orders", {{"order", "5"}});
    }

    /// After the second batch is acked: 8 read, 3 reclaimed once and 4 twice (parked on its
    /// third delivery), nothing pending; @p in_commit acks in the store's commit in all.
    void expect_second_batch_done(const RedisStreamConsumer& consumer, std::size_t in_commit) {
        const auto stats = consumer.stats();
        EXPECT_EQ(stats.read, 8u);
        EXPECT_EQ(stats.redelivered, 3u);  // 3 once, 4 twice
        EXPECT_EQ(stats.dead_lettered, 2u);
        EXPECT_EQ(stats.not_acked, 3u);
        EXPECT_EQ(stats.acked_in_commit, in_commit);
        EXPECT_TRUE(pending_ids("orders").empty());
    }

    /// The dead-letter stream at the end: the malformed entry, then the poison one.
    void expect_dead_letters(const FirstBatch& b, const std::string& scope) {
        const auto letters = dead_letters();
        ASSERT_EQ(letters.size(), 2u);
        expect_letter(letters[0], "empty message id",
                      {{"idem-scope", scope},
                       {"idem-message-id", ""},
                       {"idem-original-entry-id", b.malformed},
                       {"idem-delivery-count", "1"}},
                      malformed_fields);
        expect_letter(letters[1], "max_deliveries",
                      {{"idem-scope", scope},
                       {"idem-message-id", "4"},
                       {"idem-original-entry-id", b.poison},
                       {"idem-delivery-count", "3"}},
                      poison_fields);
    }
};

TEST_F(StreamBatchTest, SqliteBatchIsOneHandleBatchAndTheConsumerAcksWithOneXack) {
    idem::testing::TempDir dir;
    idem::SqliteStore store{dir.file("idem.db")};
    store.execute("CREATE TABLE effects(order_id TEXT NOT NULL)");
    idem::PolicyOptions policy;
    policy.max_deliveries = 3;
    int flaky_runs = 0;
    int effect_runs = 0;
    auto handler = idem::make_handler(
        store, idem::Policy{"capture", policy}, [&](auto& tx, const StreamEntry& e) {
            ++effect_runs;
            misbehave(e, flaky_runs);
            tx.execute("INSERT INTO effects(order_id) VALUES (?)", std::string(*e.field("order")));
        });
    RedisStreamConsumer consumer{endpoint(), batch_options(100ms), handler};
    ASSERT_FALSE(consumer.acks_in_commit());
    auto effects = [&](const std::string& order) {
        return store.query_int("SELECT count(*) FROM effects WHERE order_id = ?", order).value();
    };

    const FirstBatch b = add_first_batch();
    client_->exec({"CONFIG", "RESETSTAT"});
    EXPECT_EQ(consumer.poll_once(), 6u);
    // One XACK for 1, 2 and the duplicate, pipelined with one dead-letter script (whose own XACK
    // the server counts too) for the malformed entry.
    EXPECT_EQ(command_calls("xack"), 2);
    EXPECT_EQ(command_calls("eval"), 1);
    expect_first_batch_done(consumer, b, 0);
    EXPECT_EQ(effects("1"), 1);
    EXPECT_EQ(effects("2"), 1);
    EXPECT_EQ(effects("3"), 0);  // its savepoint rolled back alone
    EXPECT_EQ(effect_runs, 4);   // 1, 2, 3, 4: the duplicate and the malformed entry never ran

    // Order 2 again (a duplicate across batches) and a new order 5; 3 and 4 come back after the
    // visibility timeout: 3 processes, 4 fails again and is parked on its third delivery.
    add_second_batch();
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 8; }));
    expect_second_batch_done(consumer, 0);
    for (const char* order : {"1", "2", "3", "5"})
        EXPECT_EQ(effects(order), 1) << "order " << order;
    EXPECT_EQ(effects("4"), 0);
    EXPECT_EQ(flaky_runs, 2);
    expect_dead_letters(b, "capture");
    EXPECT_EQ(store.dead_letters().size(), 2u);
}

TEST_F(StreamBatchTest, RedisStoreBatchCommitAcksWhatItCompletesAndParksItsDeadLetters) {
    idem::RedisStore store{endpoint(), store_options(300ms)};
    idem::PolicyOptions policy;
    policy.max_deliveries = 3;
    int flaky_runs = 0;
    int effect_runs = 0;
    auto handler = idem::make_handler(store, idem::Policy{"count", policy},
                                      [&](auto& tx, const StreamEntry& e) {
                                          ++effect_runs;
                                          misbehave(e, flaky_runs);
                                          count_order(tx, e);
                                      });
    RedisStreamConsumer consumer{endpoint(), batch_options(300ms), handler};
    ASSERT_TRUE(consumer.acks_in_commit());

    warm_up(store);
    const FirstBatch b = add_first_batch();
    const std::size_t before = store.round_trips();
    EXPECT_EQ(consumer.poll_once(), 6u);
    // Failures and all: the claims pipelined, then one commit (the failed claims are freed in
    // it), then one note of each failed effect's failure (the flaky and the poison entry).
    EXPECT_EQ(store.round_trips() - before, 2u + 2u);
    // 1, 2 and the malformed entry acked in the commit; the second copy of order 1 is a
    // duplicate, acked by the consumer.
    expect_first_batch_done(consumer, b, 3);
    EXPECT_EQ(counter("effects:1"), 1);
    EXPECT_EQ(counter("effects:2"), 1);
    EXPECT_EQ(counter("effects:3"), 0);
    EXPECT_EQ(effect_runs, 4);
    EXPECT_EQ(store.attempts("count", "3"), 1u);  // its lease was given back, the attempt kept
    EXPECT_FALSE(store.find_claim("count", "3"));

    add_second_batch();
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 8; }));
    // + 3 (second attempt), 4 (poison, parked in the commit) and 5 acked in the commit; the
    // second order 2 is a duplicate the consumer acks.
    expect_second_batch_done(consumer, 6);
    for (const char* order : {"1", "2", "3", "5"})
        EXPECT_EQ(counter(std::string("effects:") + order), 1) << "order " << order;
    EXPECT_EQ(counter("effects:4"), 0);
    EXPECT_EQ(flaky_runs, 2);
    expect_dead_letters(b, "count");
    EXPECT_EQ(store.dead_letters().size(), 2u);
    auto poison = store.find_claim("count", "4");
    ASSERT_TRUE(poison);
    EXPECT_EQ(poison->disposition, Disposition::dead_lettered);
}

TEST_F(StreamBatchTest, RedisStoreBatchOfNFreshEntriesCostsTwoStoreRoundTrips) {
    idem::RedisStore store{endpoint(), store_options(1s)};
    auto handler = idem::make_handler(store, idem::Policy{"count"}, count_order);
    auto options = batch_options(1s);
    options.batch_size = 32;
    RedisStreamConsumer consumer{endpoint(), options, handler};

    warm_up(store);

    constexpr int n = 20;
    for (int i = 0; i < n; ++i)
        xadd("orders", {{"order", std::to_string(i)}});
    std::size_t before = store.round_trips();
    ASSERT_EQ(consumer.poll_once(), std::size_t{n});
    EXPECT_EQ(store.round_trips() - before, 2u);  // the claims pipelined, then the commit
    EXPECT_EQ(consumer.stats().acked_in_commit, std::size_t{n});
    EXPECT_EQ(consumer.stats().acked, std::size_t{n});
    EXPECT_EQ(pending("orders"), 0);
    for (int i = 0; i < n; ++i)
        EXPECT_EQ(counter("effects:" + std::to_string(i)), 1);

    // The same orders again: all duplicates. One round trip of claims, no commit; the consumer
    // acks them all with one XACK.
    for (int i = 0; i < n; ++i)
        xadd("orders", {{"order", std::to_string(i)}});
    before = store.round_trips();
    client_->exec({"CONFIG", "RESETSTAT"});
    ASSERT_EQ(consumer.poll_once(), std::size_t{n});
    EXPECT_EQ(store.round_trips() - before, 1u);
    EXPECT_EQ(command_calls("xack"), 1);
    EXPECT_EQ(consumer.stats().acked_in_commit, std::size_t{n});
    EXPECT_EQ(consumer.stats().acked, std::size_t{2 * n});
    EXPECT_EQ(pending("orders"), 0);
    for (int i = 0; i < n; ++i)
        EXPECT_EQ(counter("effects:" + std::to_string(i)), 1);
}

TEST_F(StreamBatchTest, RedisStoreBatchCommitParksEveryMalformedEntryOfTheBatch) {
    idem::RedisStore store{endpoint(), store_options(1s)};
    auto handler = idem::make_handler(store, idem::Policy{"count"}, count_order);
    RedisStreamConsumer consumer{endpoint(), batch_options(1s), handler};
    // Entries without the id field all have the empty message id: the commit pairs its dead
    // letters with them in order.
    const std::string first = xadd("orders", {{"customer", "1"}});
    xadd("orders", {{"order", "1"}});
    const std::string second = xadd("orders", {{"customer", "2"}});
    ASSERT_EQ(consumer.poll_once(), 3u);
    EXPECT_EQ(consumer.stats().acked_in_commit, 3u);
    EXPECT_EQ(consumer.stats().dead_lettered, 2u);
    EXPECT_EQ(pending("orders"), 0);
    EXPECT_EQ(counter("effects:1"), 1);
    const auto letters = dead_letters();
    ASSERT_EQ(letters.size(), 2u);
    EXPECT_EQ(letters[0].meta.at("idem-original-entry-id"), first);
    EXPECT_EQ(letters[0].original, (Fields{{"customer", "1"}}));
    EXPECT_EQ(letters[1].meta.at("idem-original-entry-id"), second);
    EXPECT_EQ(letters[1].original, (Fields{{"customer", "2"}}));
}

TEST_F(StreamBatchTest, PlainHandlerIsCalledPerEntryAndItsAcksGoInOneRoundTrip) {
    std::vector<std::string> seen;
    auto options = fast_options("orders");
    options.handle_in_batches = true;
    RedisStreamConsumer consumer{endpoint(), options, [&](const Delivery&, const StreamEntry& e) {
                                     const std::string order(*e.field("order"));
                                     seen.push_back(order);
                                     if (order == "bad")
                                         return Outcome{Disposition::dead_lettered, "bad"};
                                     if (order == "later")
                                         return Outcome{Disposition::deferred, "later"};
                                     if (order == "boom") throw std::runtime_error("boom");
                                     return Outcome{Disposition::processed, {}};
                                 }};
    xadd("orders", {{"order", "1"}});
    const std::string later = xadd("orders", {{"order", "later"}});
    xadd("orders", {{"order", "bad"}});
    const std::string boom = xadd("orders", {{"order", "boom"}});
    xadd("orders", {{"order", "2"}});
    client_->exec({"CONFIG", "RESETSTAT"});
    EXPECT_EQ(consumer.poll_once(), 5u);
    EXPECT_EQ(seen, (std::vector<std::string>{"1", "later", "bad", "boom", "2"}));
    EXPECT_EQ(command_calls("xack"), 2);  // 1 and 2 together; the dead letter's script
    EXPECT_EQ(command_calls("eval"), 1);
    EXPECT_EQ(pending_ids("orders"), (std::vector<std::string>{later, boom}));
    const auto stats = consumer.stats();
    EXPECT_EQ(stats.acked, 3u);
    EXPECT_EQ(stats.dead_lettered, 1u);
    EXPECT_EQ(stats.not_acked, 2u);
    const auto letters = dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_EQ(letters[0].meta.at("idem-reason"), "bad");
}

TEST_F(StreamBatchTest, BatchSizeBoundsTheWholeBatch) {
    std::vector<std::string> seen;
    auto options = fast_options("orders");
    options.handle_in_batches = true;
    options.batch_size = 3;
    RedisStreamConsumer consumer{endpoint(), options, [&](const Delivery&, const StreamEntry& e) {
                                     seen.emplace_back(*e.field("order"));
                                     return Outcome{Disposition::processed, {}};
                                 }};
    for (int i = 1; i <= 5; ++i)
        xadd("orders", {{"order", std::to_string(i)}});
    EXPECT_EQ(consumer.poll_once(), 3u);
    EXPECT_EQ(consumer.poll_once(), 2u);
    EXPECT_EQ(seen, (std::vector<std::string>{"1", "2", "3", "4", "5"}));
    EXPECT_EQ(pending("orders"), 0);
}

TEST_F(StreamBatchTest, StopBeforeTheBatchLeavesItPending) {
    int calls = 0;
    auto options = fast_options("orders");
    options.handle_in_batches = true;
    RedisStreamConsumer consumer{endpoint(), options, [&](const Delivery&, const StreamEntry&) {
                                     ++calls;
                                     return Outcome{Disposition::processed, {}};
                                 }};
    xadd("orders", {{"order", "1"}});
    consumer.request_stop();
    EXPECT_EQ(consumer.poll_once(), 0u);
    EXPECT_EQ(calls, 0);
    EXPECT_EQ(consumer.stats().read, 0u);
}

// ---------------------------------------------------------------------------------------------
// 7. The circuit breaker and the entries of a poll not yet handed to the handler

using idem_test::BreakerMode;

/// The MemoryStore's first begin() fails as unreachable (injected_fault, a store_unavailable),
/// with 6 entries in the stream and batch_size 4, so the circuit breaker opens in the middle of
/// the first poll's entries: one at a time (and a plain handler in batch mode) the first entry
/// fails and the three after it are never handed to the handler; with handle_batch() the whole
/// poll fails in its one transaction. None of the four may be acked then, all must come again
/// (taken over once idle for the visibility timeout), and with 4 more entries added after, each
/// of the 10 is applied exactly once, none dead-lettered, nothing left pending.
class RedisStreamsBreaker : public StreamConsumerTest {
  protected:
    void prefetched_entries_come_again(BreakerMode mode) {
        idem::MemoryStore store;
        std::map<std::string, std::vector<std::uint32_t>> counts;  // order -> counts applied
        auto handler = idem::make_handler(
            store, idem::Policy{"capture"}, [&](auto& tx, const StreamEntry& e, const Delivery& d) {
                const std::string order(*e.field("order"));
                counts[order].push_back(d.delivery_count.value());
                const int before = std::stoi(tx.get("applied", order).value_or("0"));
                tx.put("applied", order, std::to_string(before + 1));
            });
        auto options = fast_options("orders");
        options.id_field = "order";
        idem_test::breaker_options(options, mode, store);
        std::optional<RedisStreamConsumer> consumer;
        if (mode == BreakerMode::plain_batches) {
            consumer.emplace(endpoint(), options, [&](const Delivery& d, const StreamEntry& e) {
                return handler.handle(d, e);
            });
        } else {
            consumer.emplace(endpoint(), options, handler);
        }

        std::vector<std::string> ids;
        for (int i = 1; i <= 6; ++i)
            ids.push_back(xadd("orders", {{"order", std::to_string(i)}}));
        store.inject(idem::Fault::begin);
        const std::size_t handed = idem_test::handed_before_the_breaker(mode);
        EXPECT_EQ(consumer->poll_once(), handed);
        auto stats = consumer->stats();
        idem_test::expect_first_poll_cut_short(stats, mode, store);
        // The four read, handed or not, are all still pending: nothing acked past them.
        EXPECT_EQ(pending_ids("orders"), std::vector<std::string>(ids.begin(), ids.begin() + 4));

        for (int i = 7; i <= 10; ++i)
            xadd("orders", {{"order", std::to_string(i)}});
        ASSERT_TRUE(poll_until(*consumer, [&] { return consumer->stats().acked >= 10; }))
            << "acked " << consumer->stats().acked;
        EXPECT_EQ(pending("orders"), 0);
        for (int i = 1; i <= 10; ++i) {
            const std::string order = std::to_string(i);
            EXPECT_EQ(store.get("applied", order), std::optional<std::string>("1")) << order;
            EXPECT_EQ(counts[order].size(), 1u) << order;
            const auto claim = store.find_claim("capture", order);
            ASSERT_TRUE(claim.has_value()) << order;
            EXPECT_EQ(claim->disposition, Disposition::processed) << order;
        }
        EXPECT_TRUE(store.dead_letters().empty());
        EXPECT_TRUE(dead_letters().empty());
        stats = consumer->stats();
        EXPECT_EQ(stats.acked, 10u);
        EXPECT_EQ(stats.dead_lettered, 0u);
        EXPECT_EQ(stats.not_acked, handed);
        EXPECT_EQ(stats.circuit_opened, 1u);
        EXPECT_GE(stats.store_probes, 1u);
        EXPECT_EQ(stats.read + stats.redelivered, stats.acked + stats.not_acked);
        // Entries 1 to 4 came again; 5 to 10 were first deliveries.
        for (int i = 1; i <= 4; ++i)
            EXPECT_EQ(counts[std::to_string(i)], std::vector<std::uint32_t>{2}) << i;
        for (int i = 5; i <= 10; ++i)
            EXPECT_EQ(counts[std::to_string(i)], std::vector<std::uint32_t>{1}) << i;
    }
};

TEST_F(RedisStreamsBreaker, UnhandledEntriesComeAgainOneAtATime) {
    prefetched_entries_come_again(BreakerMode::one_at_a_time);
}

TEST_F(RedisStreamsBreaker, ThePollsEntriesComeAgainInBatchMode) {
    prefetched_entries_come_again(BreakerMode::batches);
}

TEST_F(RedisStreamsBreaker, UnhandledEntriesComeAgainInBatchModeWithAPlainHandler) {
    prefetched_entries_come_again(BreakerMode::plain_batches);
}

}  // namespace
}  // namespace idem_test::redis_streams
