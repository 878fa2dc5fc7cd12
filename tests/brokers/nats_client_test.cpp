// idem::nats, the cnats layer, against a real nats-server with JetStream (started once for the
// binary): publish with headers and a pub ack, fetch, the metadata's delivery count growing
// through real redeliveries (nak, nak with a delay, AckWait expiry), AckSync, Term, +WPI holding
// off a redelivery, and the typed errors.

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "idem/nats/admin.hpp"
#include "idem/nats/connection.hpp"
#include "idem/nats/message.hpp"
#include "idem/nats/pull_subscription.hpp"
#include "idem/testing/nats_server.hpp"
#include "support/require_nats.hpp"

namespace {

using namespace std::chrono_literals;
namespace nats = idem::nats;

class NatsClientTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_NATS();
        connection_.emplace(nats::Endpoint{idem::testing::shared_nats().url()});
        stream_ = ::testing::UnitTest::GetInstance()->current_test_info()->name();
        nats::delete_stream(*connection_, stream_);
        nats::ensure_stream(*connection_, {stream_, {stream_ + ".>"}});
    }
    void TearDown() override {
        if (connection_) nats::delete_stream(*connection_, stream_);
    }

    nats::Connection& connection() { return *connection_; }

    nats::PullSubscription consumer(std::chrono::milliseconds ack_wait = 30s) {
        nats::ConsumerSpec spec;
        spec.stream = stream_;
        spec.durable = "workers";
        spec.ack_wait = ack_wait;
        nats::ensure_pull_consumer(connection(), spec);
        return nats::PullSubscription{connection(), stream_, "workers"};
    }

    /// The one message a fetch returns (waiting up to 5 s).
    static nats::Message fetch_one(nats::PullSubscription& sub) {
        auto batch = sub.fetch(1, 5s);
        if (batch.size() != 1) throw std::runtime_error("expected one message");
        return std::move(batch.front());
    }

    std::optional<nats::Connection> connection_;
    std::string stream_;
};

TEST(NatsSubjects, WildcardsMatchAsTheServerDoes) {
    EXPECT_TRUE(nats::subject_matches("orders.>", "orders.eu.1"));
    EXPECT_TRUE(nats::subject_matches("orders.*", "orders.eu"));
    EXPECT_FALSE(nats::subject_matches("orders.*", "orders.eu.1"));
    EXPECT_FALSE(nats::subject_matches("orders.>", "orders"));
    EXPECT_TRUE(nats::subject_matches("orders", "orders"));
    EXPECT_FALSE(nats::subject_matches("orders", "orders.dead"));
    EXPECT_TRUE(nats::subject_matches(">", "idem.dead.orders"));
    EXPECT_TRUE(nats::subject_matches("*.dead.*", "idem.dead.orders"));
    EXPECT_FALSE(nats::subject_matches("idem.dead", "idem.deadx"));
}

TEST_F(NatsClientTest, PublishedHeadersAndDataArriveWithTheStreamSequence) {
    auto sub = consumer();
    const nats::PubAck ack =
        connection().publish(stream_ + ".new", std::string("a\0b", 3),
                             {{"Order", "8814"}, {"Tag", "x"}, {"Tag", "y"}}, "order-8814");
    EXPECT_EQ(ack.stream, stream_);
    EXPECT_EQ(ack.sequence, 1u);
    EXPECT_FALSE(ack.duplicate);
    // The same Nats-Msg-Id again: the stream drops it and says so.
    EXPECT_TRUE(connection().publish(stream_ + ".new", "again", {}, "order-8814").duplicate);

    nats::Message msg = fetch_one(sub);
    EXPECT_EQ(msg.subject(), stream_ + ".new");
    EXPECT_EQ(msg.data(), std::string("a\0b", 3));
    EXPECT_EQ(msg.header("Order"), "8814");
    EXPECT_EQ(msg.header("Nats-Msg-Id"), "order-8814");
    int tags = 0;
    for (const auto& [name, value] : msg.headers())
        tags += name == "Tag" ? 1 : 0;
    EXPECT_EQ(tags, 2);
    EXPECT_EQ(msg.metadata().stream, stream_);
    EXPECT_EQ(msg.metadata().consumer, "workers");
    EXPECT_EQ(msg.metadata().stream_sequence, 1u);
    EXPECT_EQ(msg.metadata().num_delivered, 1u);
    EXPECT_GT(msg.metadata().timestamp_ns, 0);
    msg.ack_sync();
    EXPECT_TRUE(sub.fetch(1, 100ms).empty());  // acked, and the duplicate was never stored
    EXPECT_EQ(nats::consumer_state(connection(), stream_, "workers").num_ack_pending, 0);
}

TEST_F(NatsClientTest, DeliveryCountGrowsThroughNakNakWithDelayAndAckWaitExpiry) {
    auto sub = consumer(/*ack_wait=*/300ms);
    connection().publish(stream_ + ".new", "m");

    nats::Message first = fetch_one(sub);
    EXPECT_EQ(first.metadata().num_delivered, 1u);
    first.nak();

    nats::Message second = fetch_one(sub);
    EXPECT_EQ(second.metadata().num_delivered, 2u);
    EXPECT_EQ(second.metadata().stream_sequence, first.metadata().stream_sequence);
    second.nak_with_delay(200ms);
    EXPECT_TRUE(sub.fetch(1, 50ms).empty()) << "the delay holds it back";

    nats::Message third = fetch_one(sub);
    EXPECT_EQ(third.metadata().num_delivered, 3u);
    // Not acked at all: AckWait (300 ms) expires and the server delivers it again.
    nats::Message fourth = fetch_one(sub);
    EXPECT_EQ(fourth.metadata().num_delivered, 4u);
    EXPECT_EQ(fourth.metadata().stream_sequence, first.metadata().stream_sequence);
    fourth.ack_sync();
    third.ack_sync();  // a stale delivery's ack: harmless
    EXPECT_TRUE(sub.fetch(1, 400ms).empty());
}

TEST_F(NatsClientTest, TermEndsRedeliveryAndInProgressHoldsItOff) {
    auto sub = consumer(/*ack_wait=*/600ms);
    connection().publish(stream_ + ".new", "poison");
    connection().publish(stream_ + ".new", "slow");

    auto batch = sub.fetch(2, 5s);
    ASSERT_EQ(batch.size(), 2u);
    batch[0].term();
    // +WPI every 150 ms for ~900 ms (half again the AckWait): never redelivered meanwhile.
    for (int i = 0; i < 6; ++i) {
        std::this_thread::sleep_for(150ms);
        batch[1].in_progress();
        EXPECT_TRUE(sub.fetch(1, 1ms).empty());
    }
    batch[1].ack_sync();
    EXPECT_TRUE(sub.fetch(1, 700ms).empty()) << "terminated and acked: nothing comes back";
    const nats::ConsumerState state = nats::consumer_state(connection(), stream_, "workers");
    EXPECT_EQ(state.num_ack_pending, 0);
    EXPECT_EQ(state.num_redelivered, 0);
    EXPECT_TRUE(state.pull);
    EXPECT_TRUE(state.explicit_ack);
    EXPECT_EQ(state.ack_wait, 600ms);
}

TEST_F(NatsClientTest, ErrorsAreTyped) {
    EXPECT_THROW(nats::PullSubscription(connection(), stream_, "nobody"), nats::not_found);
    EXPECT_THROW(nats::consumer_state(connection(), "no-such-stream", "x"), nats::not_found);
    // No stream captures the subject: nobody answers the publish.
    EXPECT_THROW(connection().publish("nobody.listens", "x"), nats::unavailable);
    nats::Endpoint nowhere{"nats://127.0.0.1:" + std::to_string(idem::testing::probe_free_port())};
    nowhere.connect_timeout = 200ms;
    EXPECT_THROW(nats::Connection{nowhere}, nats::unavailable);
}

}  // namespace
