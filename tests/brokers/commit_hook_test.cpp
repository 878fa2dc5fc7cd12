// idem::CommitHook (idem/contract/commit_hook.hpp) from a user's own consumer loop, against a
// real redis-server: no RedisStreamConsumer, just a consumer group read by hand, a handler and a
// hook. On a RedisStore of the stream's database the entry is acked by the commit itself (XPENDING
// shows 0 without an XACK of ours, in the commit's round trip); a SqliteStore, or a RedisStore of
// another database, ignores the hook and the loop acks after the commit; a batch gets one hook
// per delivery and per-message results.

#include <gtest/gtest.h>

#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "idem/contract/commit_hook.hpp"
#include "idem/idem.hpp"
#include "idem/redis/connection.hpp"
#include "idem/redis/stream_ack.hpp"
#include "idem/store/redis.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/redis_server.hpp"
#include "idem/testing/temp_dir.hpp"
#include "support/require_redis.hpp"

namespace {

using idem::CommitHook;
using idem::Delivery;
using idem::Disposition;
using idem::Outcome;

class CommitHookTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_REDIS();
        server_ = &idem::testing::shared_redis();
        server_->flushall();
        redis_.emplace(endpoint());
        redis_->checked({"XGROUP", "CREATE", "orders", "workers", "0", "MKSTREAM"}, "XGROUP");
    }

    idem::RedisEndpoint endpoint() const {
        idem::RedisEndpoint endpoint;
        endpoint.host = server_->host();
        endpoint.port = server_->port();
        return endpoint;
    }

    static idem::RedisOptions store_options() {
        idem::RedisOptions options;
        options.key_prefix = "idem-hook:";
        return options;
    }

    /// Adds an entry and reads it into the group (so it is pending for "me"); returns its id.
    std::string deliver(const std::string& order) {
        const std::string id = redis_->checked({"XADD", "orders", "*", "order", order}, "XADD").str;
        redis_->checked(
            {"XREADGROUP", "GROUP", "workers", "me", "COUNT", "1", "STREAMS", "orders", ">"},
            "XREADGROUP");
        return id;
    }

    /// What the user's loop hands the handler: a stream ack for this entry on this server.
    CommitHook hook_for(const std::string& entry_id) const {
        idem::redis::StreamAck ack;
        ack.endpoint = endpoint();
        ack.stream = "orders";
        ack.group = "workers";
        ack.entry_id = entry_id;
        ack.dead_letter_stream = "orders.dead-letters";
        ack.fields = {{"order", "x"}};
        ack.delivery_count = 1;
        return CommitHook{std::move(ack)};
    }

    long long pending() {
        return redis_->checked({"XPENDING", "orders", "workers"}, "XPENDING")
            .elements.at(0)
            .integer;
    }
    long long stream_length(const std::string& stream) {
        return redis_->checked({"XLEN", stream}, "XLEN").integer;
    }
    void xack(const std::string& entry_id) {
        redis_->checked({"XACK", "orders", "workers", entry_id}, "XACK");
    }

    /// One message through a fresh handler, so the commit script is cached and the persistence
    /// check done, and one failure noted (its script cached): what follows counts only its own
    /// round trips.
    static void warm_up(idem::RedisStore& store) {
        auto warm =
            idem::make_handler(store, idem::Policy{"warm-up"}, [](auto&, const std::string&) {});
        ASSERT_EQ(warm.handle(Delivery{"w", 1u}, std::string("x")).disposition,
                  Disposition::processed);
        store.note_failure("warm-up", "w", "x", std::chrono::seconds(1));
    }

    idem::testing::RedisServer* server_ = nullptr;
    std::optional<idem::redis::Connection> redis_;
};

TEST_F(CommitHookTest, RedisStoreAcksTheEntryInItsCommitWithoutAnotherRoundTrip) {
    idem::RedisStore store{endpoint(), store_options()};
    auto handler = idem::make_handler(
        store, idem::Policy{"capture"},
        [](auto& tx, const std::string& order) { tx.write("INCR", "effects:" + order); });
    warm_up(store);

    const std::string entry = deliver("1");
    EXPECT_EQ(pending(), 1);
    CommitHook hook = hook_for(entry);
    EXPECT_TRUE(idem::accepts_commit_hook(store, hook));

    const std::size_t before = store.round_trips();
    const Outcome outcome = handler.handle(Delivery{"order-1", 1u}, std::string("1"), hook);
    EXPECT_EQ(outcome.disposition, Disposition::processed);
    EXPECT_TRUE(hook.acked_in_commit);
    EXPECT_EQ(store.round_trips() - before, 2u);  // the claim and the commit, the XACK in it
    EXPECT_EQ(pending(), 0);                      // no XACK of ours
    EXPECT_EQ(hook.scope, "capture");             // stamped by the handler
    EXPECT_EQ(hook.message_id, "order-1");

    // A redelivery of the same message: a duplicate commits nothing, so the loop acks it.
    const std::string again = deliver("1");
    CommitHook second = hook_for(again);
    const Outcome duplicate = handler.handle(Delivery{"order-1", 2u}, std::string("1"), second);
    EXPECT_EQ(duplicate.disposition, Disposition::duplicate);
    EXPECT_FALSE(second.acked_in_commit);
    EXPECT_EQ(pending(), 1);
    if (!second.acked_in_commit && idem::should_ack(duplicate)) xack(again);
    EXPECT_EQ(pending(), 0);
    EXPECT_EQ(std::stoll(redis_->checked({"GET", "effects:1"}, "GET").str), 1);
}

TEST_F(CommitHookTest, RedisStoreDeadLetterIsParkedAndAckedByTheCommit) {
    idem::RedisStore store{endpoint(), store_options()};
    auto handler = idem::make_handler(store, idem::Policy{"capture"},
                                      [](auto&, const std::string&) -> idem::EffectResult {
                                          throw idem::malformed_message("not an order");
                                      });
    const std::string entry = deliver("bad");
    CommitHook hook = hook_for(entry);
    const Outcome outcome = handler.handle(Delivery{"order-bad", 1u}, std::string("bad"), hook);
    EXPECT_EQ(outcome.disposition, Disposition::dead_lettered);
    EXPECT_TRUE(hook.acked_in_commit);
    EXPECT_EQ(pending(), 0);
    EXPECT_EQ(stream_length("orders.dead-letters"), 1);  // XADD + XACK in the commit script

    // A delivery without a usable id is parked in a transaction of its own: the hook still
    // reaches it.
    const std::string unusable = deliver("no-id");
    CommitHook no_id = hook_for(unusable);
    const Outcome parked = handler.handle(Delivery{"", 1u}, std::string("no-id"), no_id);
    EXPECT_EQ(parked.disposition, Disposition::dead_lettered);
    EXPECT_TRUE(no_id.acked_in_commit);
    EXPECT_EQ(pending(), 0);
    EXPECT_EQ(stream_length("orders.dead-letters"), 2);
}

TEST_F(CommitHookTest, AHookBuiltAsTheDocsShowParksItsDeadLetterOnTheDefaultStream) {
    // StreamAck{endpoint, stream, group, entry id}: no dead-letter stream named, so a dead
    // letter goes where RedisStreamConsumer's go, <stream>.dead-letters; it is never acked without
    // its copy. Named, it goes there.
    const idem::redis::StreamAck by_hand{endpoint(), "orders", "workers", "1-0"};
    EXPECT_EQ(by_hand.dead_letter_stream, "orders.dead-letters");
    EXPECT_EQ(idem::redis::StreamAck{}.dead_letter_destination(), ".dead-letters");
    idem::redis::StreamAck filled;
    filled.stream = "{orders}";
    EXPECT_EQ(filled.dead_letter_destination(), "{orders}.dead-letters");
    EXPECT_EQ((idem::redis::StreamAck{endpoint(), "orders", "workers", "1-0", "parked"}
                   .dead_letter_destination()),
              "parked");

    idem::RedisStore store{endpoint(), store_options()};
    auto handler = idem::make_handler(store, idem::Policy{"capture"},
                                      [](auto&, const std::string&) -> idem::EffectResult {
                                          throw idem::malformed_message("not an order");
                                      });
    const std::string bad = deliver("bad");
    CommitHook hook{idem::redis::StreamAck{endpoint(), "orders", "workers", bad}};
    const Outcome outcome = handler.handle(Delivery{"order-1", 1u}, std::string("bad"), hook);
    EXPECT_EQ(outcome.disposition, Disposition::dead_lettered);
    EXPECT_TRUE(hook.acked_in_commit);
    EXPECT_EQ(pending(), 0);
    EXPECT_EQ(stream_length("orders.dead-letters"), 1);

    // Filled in by hand, member by member, with no dead-letter stream: the same default.
    const std::string second = deliver("bad");
    idem::redis::StreamAck ack;
    ack.endpoint = endpoint();
    ack.stream = "orders";
    ack.group = "workers";
    ack.entry_id = second;
    CommitHook filled_hook{std::move(ack)};
    EXPECT_EQ(handler.handle(Delivery{"order-2", 1u}, std::string("bad"), filled_hook).disposition,
              Disposition::dead_lettered);
    EXPECT_TRUE(filled_hook.acked_in_commit);
    EXPECT_EQ(pending(), 0);
    EXPECT_EQ(stream_length("orders.dead-letters"), 2);
}

TEST_F(CommitHookTest, FailedMessageIsNotAckedByTheCommit) {
    idem::RedisStore store{endpoint(), store_options()};
    auto handler = idem::make_handler(
        store, idem::Policy{"capture"},
        [](auto&, const std::string&) { throw std::runtime_error("gateway down"); });
    const std::string entry = deliver("1");
    CommitHook hook = hook_for(entry);
    const Outcome outcome = handler.handle(Delivery{"order-1", 1u}, std::string("1"), hook);
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_FALSE(hook.acked_in_commit);
    EXPECT_EQ(pending(), 1);  // stays pending for the redelivery
}

TEST_F(CommitHookTest, SqliteStoreIgnoresTheHookAndTheLoopAcksAfterTheCommit) {
    idem::testing::TempDir dir;
    idem::SqliteStore store{dir.file("idem.db")};
    auto handler =
        idem::make_handler(store, idem::Policy{"capture"}, [](auto&, const std::string&) {});
    const std::string entry = deliver("1");
    CommitHook hook = hook_for(entry);
    EXPECT_FALSE(idem::accepts_commit_hook(store, hook));

    const Outcome outcome = handler.handle(Delivery{"order-1", 1u}, std::string("1"), hook);
    EXPECT_EQ(outcome.disposition, Disposition::processed);
    EXPECT_FALSE(hook.acked_in_commit);
    EXPECT_EQ(pending(), 1);  // the commit did not touch the stream
    if (!hook.acked_in_commit && idem::should_ack(outcome)) xack(entry);
    EXPECT_EQ(pending(), 0);
}

TEST_F(CommitHookTest, RedisStoreOfAnotherDatabaseIgnoresTheHook) {
    idem::RedisEndpoint other = endpoint();
    other.db = 1;  // the claims live elsewhere: the commit script cannot ack this stream
    idem::RedisStore store{other, store_options()};
    auto handler =
        idem::make_handler(store, idem::Policy{"capture"}, [](auto&, const std::string&) {});
    const std::string entry = deliver("1");
    CommitHook hook = hook_for(entry);
    EXPECT_FALSE(idem::accepts_commit_hook(store, hook));
    const Outcome outcome = handler.handle(Delivery{"order-1", 1u}, std::string("1"), hook);
    EXPECT_EQ(outcome.disposition, Disposition::processed);
    EXPECT_FALSE(hook.acked_in_commit);
    EXPECT_EQ(pending(), 1);

    CommitHook foreign{std::string("not a redis request")};  // another family's request
    EXPECT_FALSE(idem::accepts_commit_hook(store, foreign));
}

TEST_F(CommitHookTest, BatchGetsOneHookPerDeliveryAndPerMessageResults) {
    idem::RedisStore store{endpoint(), store_options()};
    auto handler =
        idem::make_handler(store, idem::Policy{"capture"}, [](auto& tx, const std::string& order) {
            if (order == "flaky") throw std::runtime_error("later");
            tx.write("INCR", "effects:" + order);
        });
    warm_up(store);

    const std::vector<std::string> orders{"1", "flaky", "2", "1"};  // order 1 sent twice
    std::vector<Delivery> deliveries;
    std::vector<CommitHook> hooks;
    std::vector<std::string> entries;
    for (const std::string& order : orders) {
        entries.push_back(deliver(order));
        deliveries.push_back(Delivery{"order-" + order, 1u});
        hooks.push_back(hook_for(entries.back()));
    }
    EXPECT_EQ(pending(), 4);

    const std::size_t before = store.round_trips();
    const std::vector<Outcome> outcomes = handler.handle_batch(deliveries, orders, hooks);
    // Claims pipelined, one commit with the acks, then the flaky effect's failure noted.
    EXPECT_EQ(store.round_trips() - before, 3u);
    ASSERT_EQ(outcomes.size(), 4u);
    EXPECT_EQ(outcomes[0].disposition, Disposition::processed);
    EXPECT_EQ(outcomes[1].disposition, Disposition::failed);
    EXPECT_EQ(outcomes[2].disposition, Disposition::processed);
    EXPECT_EQ(outcomes[3].disposition, Disposition::duplicate);
    EXPECT_TRUE(hooks[0].acked_in_commit);
    EXPECT_FALSE(hooks[1].acked_in_commit);  // failed: stays pending
    EXPECT_TRUE(hooks[2].acked_in_commit);
    EXPECT_FALSE(hooks[3].acked_in_commit);  // the second copy: the loop acks it
    EXPECT_EQ(pending(), 2);
    for (std::size_t i = 0; i < outcomes.size(); ++i) {
        if (!hooks[i].acked_in_commit && idem::should_ack(outcomes[i])) xack(entries[i]);
    }
    EXPECT_EQ(pending(), 1);  // the flaky one, for its redelivery

    std::vector<CommitHook> too_few(1);
    EXPECT_THROW(handler.handle_batch(deliveries, orders, too_few), idem::usage_error);
}

}  // namespace
