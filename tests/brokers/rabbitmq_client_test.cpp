// idem::rabbitmq::Connection against a real RabbitMQ broker (started once for this binary): the
// delivery-count header of quorum queues through real redeliveries, headers and properties kept
// byte for byte, publisher confirms (and a publish no queue takes), the stale-channel rule, and
// how a classic queue answers the quorum check; the test fixture's rabbitmqctl.

#include <gtest/gtest.h>

#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>
#include <variant>

#include "idem/rabbitmq/connection.hpp"
#include "support/require_rabbitmq.hpp"

namespace {

namespace rmq = idem::rabbitmq;
using namespace std::chrono_literals;

class RabbitmqClient : public ::testing::Test {
  protected:
    static constexpr std::uint16_t ch = 1;

    void SetUp() override {
        IDEM_REQUIRE_RABBITMQ();
        connection.emplace(idem::testing::shared_rabbitmq().endpoint());
        connection->connect();
        connection->open_channel(ch);
    }

    std::string fresh_quorum_queue(const std::string& name) {
        rmq::QueueDeclare how;
        how.arguments = {{"x-queue-type", std::string("quorum")}};
        connection->declare_queue(ch, name, how);
        connection->purge_queue(ch, name);
        return name;
    }

    rmq::Message next(std::chrono::milliseconds within = 10s) {
        auto m = connection->next_delivery(within);
        if (!m) throw std::runtime_error("no delivery within the time");
        return std::move(*m);
    }

    std::optional<rmq::Connection> connection;
};

TEST_F(RabbitmqClient, QuorumQueueCountsDeliveriesInXDeliveryCount) {
    const std::string queue = fresh_quorum_queue("client-counts");
    rmq::Publish p;
    p.routing_key = queue;
    p.properties.message_id = "order-1";
    connection->publish_confirmed(ch, p, "body-1");
    connection->qos(ch, 1);
    connection->consume(ch, queue);

    // The first delivery carries no x-delivery-count (or 0); each requeue adds one.
    std::vector<std::optional<std::int64_t>> seen;
    for (int i = 0; i < 3; ++i) {
        rmq::Message m = next();
        EXPECT_EQ(m.body, "body-1");
        EXPECT_EQ(m.properties.message_id, std::optional<std::string>("order-1"));
        seen.push_back(m.header_integer("x-delivery-count"));
        if (i < 2) {
            ASSERT_TRUE(connection->nack(m, /*requeue=*/true));
        } else {
            ASSERT_TRUE(connection->ack(m));
        }
    }
    EXPECT_TRUE(!seen[0] || *seen[0] == 0) << "first delivery: " << seen[0].value_or(-1);
    EXPECT_EQ(seen[1], std::optional<std::int64_t>(1));
    EXPECT_EQ(seen[2], std::optional<std::int64_t>(2));
}

TEST_F(RabbitmqClient, HeadersAndPropertiesSurviveARepublishByteForByte) {
    const std::string queue = fresh_quorum_queue("client-headers");
    // A header table with a nested table and an array, which FieldValue does not decode.
    rmq::Publish p;
    p.routing_key = queue;
    p.properties.message_id = "m-2";
    p.properties.content_type = "application/json";
    p.headers = {{"tenant", std::string("mugshop")},
                 {"attempt", std::int64_t{7}},
                 {"binary", std::string("a\0b", 3)}};
    connection->publish_confirmed(ch, p, std::string("x\0y", 3));
    connection->qos(ch, 10);
    connection->consume(ch, queue);
    rmq::Message first = next();
    EXPECT_EQ(first.body, std::string("x\0y", 3));
    EXPECT_EQ(first.header_string("tenant"), std::optional<std::string_view>("mugshop"));
    EXPECT_EQ(first.header_integer("attempt"), std::optional<std::int64_t>(7));
    EXPECT_EQ(first.header_string("binary"),
              std::optional<std::string_view>(std::string("a\0b", 3)));
    ASSERT_FALSE(first.encoded_headers.empty());

    // Republished with its encoded headers plus one more: the originals are all there, in order.
    rmq::Publish again;
    again.routing_key = queue;
    again.properties = first.properties;
    again.encoded_headers = first.encoded_headers;
    again.headers = {{"x-idem-reason", std::string("why")}};
    connection->publish_confirmed(ch, again, first.body);
    ASSERT_TRUE(connection->ack(first));
    rmq::Message second = next();
    EXPECT_EQ(second.body, first.body);
    EXPECT_EQ(second.properties.message_id, std::optional<std::string>("m-2"));
    EXPECT_EQ(second.properties.content_type, std::optional<std::string>("application/json"));
    ASSERT_EQ(second.headers.size(), 4u);
    EXPECT_EQ(second.headers[0].first, "tenant");
    EXPECT_EQ(second.headers[1].first, "attempt");
    EXPECT_EQ(second.headers[2].first, "binary");
    EXPECT_EQ(second.header_string("x-idem-reason"), std::optional<std::string_view>("why"));
    ASSERT_TRUE(connection->ack(second));
}

TEST_F(RabbitmqClient, APublishNoQueueTakesFailsItsConfirm) {
    connection->declare_exchange(ch, "client-unbound", "fanout");
    rmq::Publish p;
    p.exchange = "client-unbound";
    EXPECT_THROW(connection->publish_confirmed(ch, p, "lost?"), idem::broker_error);
    // The channel is still usable after a returned publish.
    const std::string queue = fresh_quorum_queue("client-bound");
    connection->bind_queue(ch, queue, "client-unbound", "");
    EXPECT_NO_THROW(connection->publish_confirmed(ch, p, "kept"));
    EXPECT_EQ(connection->purge_queue(ch, queue), 1u);
}

TEST_F(RabbitmqClient, ATagOfAClosedChannelIsNeverAcked) {
    const std::string queue = fresh_quorum_queue("client-stale");
    rmq::Publish p;
    p.routing_key = queue;
    connection->publish_confirmed(ch, p, "once");
    connection->qos(ch, 1);
    connection->consume(ch, queue);
    rmq::Message m = next();
    connection->close_channel(ch);  // the delivery goes back to the queue
    connection->open_channel(ch);
    EXPECT_FALSE(connection->ack(m));
    EXPECT_FALSE(connection->nack(m, true));
    connection->qos(ch, 1);
    connection->consume(ch, queue);
    rmq::Message again = next();
    EXPECT_EQ(again.body, "once");
    EXPECT_EQ(again.header_integer("x-delivery-count"), std::optional<std::int64_t>(1));
    EXPECT_TRUE(connection->ack(again));
}

TEST_F(RabbitmqClient, AClassicQueueFailsTheQuorumRedeclare) {
    rmq::QueueDeclare classic;
    connection->declare_queue(ch, "client-classic", classic);
    rmq::QueueDeclare quorum;
    quorum.arguments = {{"x-queue-type", std::string("quorum")}};
    try {
        connection->declare_queue(ch, "client-classic", quorum);
        FAIL() << "a classic queue accepted x-queue-type=quorum";
    } catch (const rmq::channel_error& e) {
        EXPECT_EQ(e.reply_code(), rmq::reply_precondition_failed);
        EXPECT_NE(std::string(e.what()).find("x-queue-type"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(connection->channel_open(ch));
}

// The test fixture's rabbitmqctl: what the chaos run asks when AMQP cannot say (unacked counts).
TEST_F(RabbitmqClient, TheFixturesCtlListsQueuesAndAFailureSaysHowItEnded) {
    fresh_quorum_queue("client-ctl");
    auto& server = idem::testing::shared_rabbitmq();
    const std::string listed = server.ctl({"list_queues", "name", "messages_ready"});
    // The counts lag behind AMQP by seconds (the chaos run waits them out); the queue is there.
    EXPECT_NE(listed.find("\nclient-ctl\t"), std::string::npos) << listed;
    try {
        server.ctl({"list_queues", "no_such_column"});
        FAIL() << "rabbitmqctl accepted an unknown column";
    } catch (const std::runtime_error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("list_queues no_such_column failed (exit code "), std::string::npos)
            << what;
        EXPECT_NE(what.find("no_such_column"), what.rfind("no_such_column")) << what;
    }
}

// ---- fuzz findings (tests/fuzz/corpus/amqp_table) -----------------------------------------------
// What Message::encoded_headers keeps is rabbitmq-c's decoding encoded again: the same entries,
// but a boolean byte other than 0 reads as 1 (corpus: noncanonical_boolean), and a table whose
// last entry runs past its declared length gets its true length (corpus: overlong_last_entry).

TEST(AmqpTableFuzzFinding, HeadersAreReencodedAsRabbitmqCDecodedThem) {
    // A table of one entry: "f" → boolean, written with the byte 0x3f.
    const std::string received(
        "\0\0\0\x04\x01"
        "ft\x3f",
        8);
    rmq::detail::Pool pool;
    amqp_table_t decoded{};
    std::size_t used = 0;
    ASSERT_EQ(amqp_decode_table(rmq::detail::bytes_of(received), pool.get(), &decoded, &used),
              AMQP_STATUS_OK);
    EXPECT_EQ(used, received.size());
    const std::string encoded = rmq::detail::encode(decoded);
    EXPECT_EQ(encoded, std::string("\0\0\0\x04\x01"
                                   "ft\x01",
                                   8));
    const rmq::Table table = rmq::detail::table_of(decoded);
    ASSERT_EQ(table.size(), 1u);
    EXPECT_EQ(std::get<bool>(table[0].second), true);

    // Declared 3 bytes, the entry takes 4: read, and re-encoded with length 4.
    const std::string overlong(
        "\0\0\0\x03\x01"
        "ft\x01",
        8);
    rmq::detail::Pool pool2;
    amqp_table_t lenient{};
    used = 0;
    ASSERT_EQ(amqp_decode_table(rmq::detail::bytes_of(overlong), pool2.get(), &lenient, &used),
              AMQP_STATUS_OK);
    EXPECT_EQ(rmq::detail::encode(lenient), std::string("\0\0\0\x04\x01"
                                                        "ft\x01",
                                                        8));
}

}  // namespace
