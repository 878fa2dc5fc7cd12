// RedisStreamConsumerOptions::pipeline_commits (on by default) against a real redis-server: one
// entry at a time on a RedisStore, entry N's commit goes with entry N+1's claim
// (idem::PipelinedLoop), N is acked only once that commit said so — in the commit on the stream's
// database, in one XACK after the poll's last entry elsewhere — a refused commit leaves its entry
// pending while the next one goes on, a stop mid-poll commits the held entry before it returns, and
// the store's own redis-server killed mid-poll (the circuit breaker) leaves the held entry, the
// next one and the unhandled ones pending until they come again (RedisStreamsPipelinedOutage).

#include "idem/store/redis/record.hpp"
#include "idem/testing/redis_server.hpp"
#include "support/redis_streams_test_env.hpp"

namespace idem_test::redis_streams {
namespace {

class StreamPipelinedTest : public StreamConsumerTest {
  protected:
    void add_orders(const std::string& stream, int count) {
        for (int i = 1; i <= count; ++i)
            xadd(stream, {{"order", std::to_string(i)}});
    }
    static RedisStreamConsumerOptions options_for(const std::string& stream, bool pipeline) {
        auto options = fast_options(stream);
        options.id_field = "order";
        options.batch_size = 16;
        options.pipeline_commits = pipeline;
        options.visibility_timeout = 5s;  // the store's lease here
        return options;
    }
};

TEST_F(StreamPipelinedTest, EachCommitGoesWithTheNextClaimAndCarriesItsAck) {
    idem::RedisStore store{endpoint(), store_options(5s)};
    store.warm_up();
    auto pipelined = idem::make_handler(store, idem::Policy{"count"}, count_order);
    auto one_by_one = idem::make_handler(store, idem::Policy{"count-again"}, count_order);
    auto trips_for_ten = [&](const std::string& stream, bool pipeline) {
        add_orders(stream, 10);
        auto& handler = pipeline ? pipelined : one_by_one;
        RedisStreamConsumer consumer{endpoint(), options_for(stream, pipeline), handler};
        EXPECT_TRUE(consumer.acks_in_commit());
        const std::size_t before = store.round_trips();
        EXPECT_EQ(consumer.poll_once(), 10u);
        const std::size_t trips = store.round_trips() - before;
        EXPECT_EQ(consumer.stats().acked, 10u);
        EXPECT_EQ(consumer.stats().acked_in_commit, 10u);
        EXPECT_EQ(pending(stream), 0);
        return trips;
    };
    // One claim alone, nine commits each with the next claim, the last commit alone.
    EXPECT_EQ(trips_for_ten("orders", true), 11u);
    EXPECT_EQ(trips_for_ten("orders-again", false), 20u);  // the same, one at a time
    for (int i = 1; i <= 10; ++i)
        EXPECT_EQ(counter("effects:" + std::to_string(i)), 2) << i;  // once per scope
}

TEST_F(StreamPipelinedTest, AStoreElsewhereIsAckedInOneXackAfterThePollsLastEntry) {
    idem::RedisEndpoint elsewhere = endpoint();
    elsewhere.db = 1;  // not the stream's database: the consumer acks
    idem::RedisStore store{elsewhere, store_options(5s)};
    store.warm_up();
    auto handler = idem::make_handler(store, idem::Policy{"count"}, count_order);
    RedisStreamConsumer consumer{endpoint(), options_for("orders", true), handler};
    ASSERT_FALSE(consumer.acks_in_commit());
    add_orders("orders", 6);
    client_->exec({"CONFIG", "RESETSTAT"});
    const std::size_t before = store.round_trips();
    EXPECT_EQ(consumer.poll_once(), 6u);
    EXPECT_EQ(store.round_trips() - before, 7u);
    EXPECT_EQ(command_calls("xack"), 1);
    EXPECT_EQ(consumer.stats().acked, 6u);
    EXPECT_EQ(consumer.stats().acked_in_commit, 0u);
    EXPECT_EQ(pending("orders"), 0);
}

// Order 1's lease is lost behind its back while its effect runs (released, as by another
// worker's takeover): its commit, sent with order 2's claim, is refused. Order 1 stays pending
// (failed, not acked); order 2's fresh lease stands, its effect runs and it is acked.
TEST_F(StreamPipelinedTest, ARefusedCommitLeavesItsEntryPendingAndTheNextGoesOn) {
    idem::RedisStore store{endpoint(), store_options(5s)};
    store.warm_up();
    auto handler =
        idem::make_handler(store, idem::Policy{"count"}, [&](auto& tx, const StreamEntry& e) {
            if (e.field("order") == std::string_view("1")) {
                const std::string key = store.claim_key("count", "1");
                auto record = idem::redis::Record::decode(client_->str({"GET", key}).value());
                ASSERT_TRUE(record.has_value());
                record->state = "free";
                record->token.clear();
                client_->exec({"SET", key, record->encode(), "KEEPTTL"});
            }
            count_order(tx, e);
        });
    RedisStreamConsumer consumer{endpoint(), options_for("orders", true), handler};
    const std::string first = xadd("orders", {{"order", "1"}});
    xadd("orders", {{"order", "2"}});
    EXPECT_EQ(consumer.poll_once(), 2u);
    EXPECT_EQ(consumer.stats().acked, 1u);
    EXPECT_EQ(consumer.stats().not_acked, 1u);
    EXPECT_EQ(pending_ids("orders"), std::vector<std::string>{first});
    EXPECT_EQ(counter("effects:1"), 0);
    EXPECT_EQ(counter("effects:2"), 1);
}

// A stop during order 2's effect: order 2 is held, so its commit goes alone before poll_once()
// returns (committed and acked); orders 3..5 stay pending, unread by the handler.
TEST_F(StreamPipelinedTest, AStopMidPollCommitsTheHeldEntryAndLeavesTheRestPending) {
    idem::RedisStore store{endpoint(), store_options(5s)};
    store.warm_up();
    RedisStreamConsumer* running = nullptr;
    auto handler =
        idem::make_handler(store, idem::Policy{"count"}, [&](auto& tx, const StreamEntry& e) {
            count_order(tx, e);
            if (e.field("order") == std::string_view("2")) running->request_stop();
        });
    RedisStreamConsumer consumer{endpoint(), options_for("orders", true), handler};
    running = &consumer;
    add_orders("orders", 5);
    EXPECT_EQ(consumer.poll_once(), 2u);
    EXPECT_EQ(consumer.stats().acked, 2u);
    EXPECT_EQ(counter("effects:1"), 1);
    EXPECT_EQ(counter("effects:2"), 1);
    EXPECT_EQ(counter("effects:3"), 0);
    EXPECT_EQ(pending("orders"), 3);
    EXPECT_EQ(store.find_claim("count", "2")->disposition, idem::Disposition::processed);
}

// ---------------------------------------------------------------------------------------------
// The circuit breaker: the store's own redis-server killed in the middle of a poll

/// The stream on the shared server; the store a RedisStore on a redis-server of its own,
/// SIGKILLed during order 2's effect (and started again on the same port and AOF before the
/// next poll). Orders 1 to 7 are in the stream before the first poll (batch_size 5), 8 to 10
/// are added after. Each effect is an INCR in the store's commit.
class RedisStreamsPipelinedOutage : public StreamPipelinedTest {
  protected:
    static constexpr auto lease = 500ms;

    void store_killed_mid_poll(bool batches) {
        idem::testing::RedisServer own;  // the store's server: this one is killed
        idem::RedisStore store{endpoint_of(own), store_options(lease)};
        store.warm_up();
        bool kill = true;
        auto handler =
            idem::make_handler(store, idem::Policy{"count"}, [&](auto& tx, const StreamEntry& e) {
                count_order(tx, e);
                if (kill && e.field("order") == std::string_view("2")) {
                    kill = false;
                    own.kill9();
                }
            });
        auto options = options_for("orders", /*pipeline=*/true);
        options.batch_size = 5;
        options.visibility_timeout = lease;
        options.handle_in_batches = batches;
        options.circuit_breaker.initial_backoff = 20ms;
        options.circuit_breaker.max_backoff = 50ms;
        RedisStreamConsumer consumer{endpoint(), options, handler};
        ASSERT_FALSE(consumer.acks_in_commit());  // another server: the consumer acks

        std::vector<std::string> ids;
        for (int i = 1; i <= 7; ++i)
            ids.push_back(xadd("orders", {{"order", std::to_string(i)}}));
        if (batches) {
            // One handle_batch() for 1..5: its one commit fails, so does every entry of it.
            EXPECT_EQ(consumer.poll_once(), 5u);
            EXPECT_EQ(consumer.stats().acked, 0u);
            EXPECT_EQ(consumer.stats().not_acked, 5u);
            EXPECT_EQ(pending_ids("orders"),
                      std::vector<std::string>(ids.begin(), ids.begin() + 5));
        } else {
            // Order 1's commit went with order 2's claim; order 2's commit, held, goes with
            // order 3's claim into the dead server: both failed. 4 and 5 are never handed to
            // the handler. Only order 1 is acked (after the poll, in one XACK).
            EXPECT_EQ(consumer.poll_once(), 3u);
            EXPECT_EQ(consumer.stats().acked, 1u);
            EXPECT_EQ(consumer.stats().not_acked, 2u);
            EXPECT_EQ(pending_ids("orders"),
                      std::vector<std::string>(ids.begin() + 1, ids.begin() + 5));
        }
        EXPECT_EQ(consumer.stats().circuit_opened, 1u);

        own.start();  // the same port and AOF: order 1's commit kept
        for (int i = 8; i <= 10; ++i)
            xadd("orders", {{"order", std::to_string(i)}});
        ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked >= 10; }))
            << "acked " << consumer.stats().acked;
        EXPECT_EQ(pending("orders"), 0);
        auto client = own.client();
        for (int i = 1; i <= 10; ++i) {
            const std::string order = std::to_string(i);
            EXPECT_EQ(client.integer({"GET", "effects:" + order}).value_or(0), 1) << order;
            const auto claim = store.find_claim("count", order);
            ASSERT_TRUE(claim.has_value()) << order;
            EXPECT_EQ(claim->disposition, Disposition::processed) << order;
        }
        EXPECT_TRUE(store.dead_letters().empty());
        EXPECT_TRUE(dead_letters().empty());
        const auto after = consumer.stats();
        EXPECT_EQ(after.acked, 10u);
        EXPECT_EQ(after.dead_lettered, 0u);
        EXPECT_EQ(after.circuit_opened, 1u);
        EXPECT_GE(after.store_probes, 1u);
        EXPECT_EQ(after.read + after.redelivered, after.acked + after.not_acked);
    }
};

TEST_F(RedisStreamsPipelinedOutage, TheHeldCommitTheNextEntryAndTheUnhandledOnesComeAgain) {
    store_killed_mid_poll(/*batches=*/false);
}

TEST_F(RedisStreamsPipelinedOutage, TheBatchWhoseCommitFailedComesAgainInBatchMode) {
    store_killed_mid_poll(/*batches=*/true);
}

}  // namespace
}  // namespace idem_test::redis_streams
