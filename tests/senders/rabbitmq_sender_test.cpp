// idem::RabbitMqSender against a real RabbitMQ broker (started once for this binary, which runs
// as one ctest test): a Relay over an SqliteStore ships intents, persistent and confirmed, that
// an idem::RabbitMqConsumer claims under their message_id; a resend is a duplicate downstream;
// the broker down leaves the row unsent and retried; fan-out children apply once; an
// unroutable intent is retried, a missing exchange and a message over max_message_size park.

#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "idem/broker/rabbitmq.hpp"
#include "idem/senders/rabbitmq.hpp"
#include "idem/testing/rabbitmq_server.hpp"
#include "support/chain_env.hpp"
#include "support/rabbitmq_broker.hpp"
#include "support/require_rabbitmq.hpp"

namespace {

using namespace std::chrono_literals;
using idem::RabbitMessage;
using idem_test::chain::Hop;
using idem_test::chain::Ledger;
using idem_test::chain::Upstream;

constexpr std::size_t max_message_size = 65536;

idem::testing::RabbitmqServer& broker() {
    idem::testing::RabbitmqOptions options;
    options.extra_config = {"max_message_size = " + std::to_string(max_message_size)};
    return idem_test::rabbitmq_broker(options);
}

class RabbitMqSenderTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_RABBITMQ();
        queue_ = ::testing::UnitTest::GetInstance()->current_test_info()->name();
        sender_ = std::make_unique<idem::RabbitMqSender>(broker().endpoint());
        idem::RabbitMqConsumerOptions options{queue_};
        options.poll_wait = 50ms;
        options.redelivery_backoff = idem::RedeliveryBackoff::none();
        consumer_ = std::make_unique<idem::RabbitMqConsumer>(broker().endpoint(), options,
                                                             ledger_.handler());
        consumer_->poll_once();  // declares the queue
    }

    Hop hop() {
        return idem_test::chain::hop_of([this](const idem::OutboxRow& row) { (*sender_)(row); },
                                        [this] { consumer_->poll_once(); });
    }

    std::string queue_;
    Upstream up_;
    Ledger<RabbitMessage> ledger_{[](const RabbitMessage& m) { return m.body; }};
    std::unique_ptr<idem::RabbitMqSender> sender_;
    std::unique_ptr<idem::RabbitMqConsumer> consumer_;
};

/// What the consumer's handler saw of the last message: persistent, the key as message_id.
struct SeenProperties {
    std::optional<std::string> message_id;
    std::optional<std::uint8_t> delivery_mode;
};

TEST_F(RabbitMqSenderTest, RelayShipsIntentsTheConsumerClaimsUnderTheirMessageIds) {
    idem_test::chain::relay_ships_keys_as_message_ids(up_, ledger_, hop(), queue_);
}

TEST_F(RabbitMqSenderTest, MessagesArePersistentWithTheKeyAsMessageId) {
    SeenProperties seen;
    idem::RabbitMqConsumerOptions options{queue_ + ".props"};
    options.poll_wait = 50ms;
    idem::RabbitMqConsumer reader{broker().endpoint(), options,
                                  [&](const idem::Delivery& d, const RabbitMessage& m) {
                                      seen.message_id = d.message_id;
                                      seen.delivery_mode = m.properties.delivery_mode;
                                      return idem::Outcome{idem::Disposition::processed, ""};
                                  }};
    reader.poll_once();  // declares its queue
    idem::OutboxRow row;
    row.destination = queue_ + ".props";
    row.idempotency_key = "wire-props";
    row.payload = "p";
    (*sender_)(row);
    ASSERT_TRUE(idem_test::poll_within(
        20s, [&] { reader.poll_once(); }, [&] { return seen.message_id.has_value(); }));
    EXPECT_EQ(seen.message_id, std::optional<std::string>("wire-props"));
    EXPECT_EQ(seen.delivery_mode, std::optional<std::uint8_t>(2));
}

TEST_F(RabbitMqSenderTest, ASecondSendOfTheSameIntentIsADuplicateDownstream) {
    idem_test::chain::resend_is_a_duplicate(up_, ledger_, hop(), queue_);
}

TEST_F(RabbitMqSenderTest, FanOutChildrenOfARedeliveredParentApplyOnce) {
    idem_test::chain::fan_out_children_apply_once(up_, ledger_, hop(), queue_, 4);
}

TEST_F(RabbitMqSenderTest, AnUnroutableIntentIsRetriedLaterWithTheReason) {
    idem_test::chain::expect_retried_later(up_, *sender_, "no-such-queue", "wire-lost", "returned");
}

TEST_F(RabbitMqSenderTest, AMissingExchangeIsParkedAtOnceWithTheReason) {
    idem::RabbitMqSenderOptions options;
    options.exchange = "no-such-exchange";
    idem::RabbitMqSender sender{broker().endpoint(), options};
    idem_test::chain::expect_parked_at_once(up_, sender, queue_, "wire-1", "one", "404");
    // The sender reopens its channel: the next intent goes out.
    up_.add(queue_, "wire-2", "two");
    EXPECT_EQ(idem_test::chain::relay_all(up_.store(), *sender_).sent, 1u);
}

TEST_F(RabbitMqSenderTest, AMessageOverMaxMessageSizeIsParkedAtOnceWithTheReason) {
    idem_test::chain::expect_parked_at_once(up_, *sender_, queue_, "wire-big",
                                            std::string(2 * max_message_size, 'x'), "406");
    up_.add(queue_, "wire-small", "small");  // the sender reopens its channel for the next one
    EXPECT_EQ(idem_test::chain::relay_all(up_.store(), *sender_).sent, 1u);
}

// Last: it restarts the broker (seconds).
TEST_F(RabbitMqSenderTest, ZBrokerDownLeavesTheRowUnsentUntilARetryDeliversIt) {
    idem_test::chain::outage_is_retried_then_delivered(
        up_, ledger_, hop(), queue_, [] { broker().kill9(); }, [] { broker().start(); });
}

}  // namespace
