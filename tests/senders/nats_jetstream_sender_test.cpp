// idem::JetStreamSender against a real nats-server with JetStream (the process's shared one): a
// Relay over an SqliteStore ships intents that an idem::JetStreamConsumer claims under their
// Nats-Msg-Id; inside the stream's duplicate window a resend is dropped by the stream, after it
// the copy reaches the consumer and its claim drops it; a redrive inside the window of its
// original is stored and keeps its id; the server down leaves the row unsent and retried;
// fan-out children apply once; a message over max_payload parks.

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "idem/broker/nats_jetstream.hpp"
#include "idem/nats/admin.hpp"
#include "idem/senders/nats_jetstream.hpp"
#include "idem/testing/nats_server.hpp"
#include "support/chain_env.hpp"
#include "support/require_nats.hpp"

namespace {

using namespace std::chrono_literals;
namespace nats = idem::nats;
using idem::JetStreamMessage;
using idem_test::chain::Hop;
using idem_test::chain::Ledger;
using idem_test::chain::Upstream;

/// The stream's duplicate window here: short, so a test can outlive it.
constexpr auto window = 300ms;
const auto outlive_window = [] { std::this_thread::sleep_for(window + 200ms); };

class JetStreamSenderTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_NATS();
        server_ = &idem::testing::shared_nats();
        endpoint_ = nats::Endpoint{server_->url()};
        admin_ = std::make_unique<nats::Connection>(endpoint_);
        stream_ = ::testing::UnitTest::GetInstance()->current_test_info()->name();
        for (const auto& name : {stream_, stream_ + "_dead"})
            nats::delete_stream(*admin_, name);
        nats::StreamSpec spec{stream_, {stream_ + ".>"}};
        spec.duplicate_window = window;
        nats::ensure_stream(*admin_, spec);
        nats::ensure_stream(*admin_, {stream_ + "_dead", {"dead." + stream_}});
        sender_ = std::make_unique<idem::JetStreamSender>(endpoint_);
        idem::JetStreamConsumerOptions options{stream_, "downstream"};
        options.dead_letter = "dead." + stream_;
        options.visibility_timeout = 1000ms;
        options.poll_wait = 100ms;
        options.redelivery_backoff = idem::RedeliveryBackoff::none();
        consumer_ =
            std::make_unique<idem::JetStreamConsumer>(endpoint_, options, ledger_.handler());
    }
    void TearDown() override {
        consumer_.reset();
        if (!admin_) return;
        for (const auto& name : {stream_, stream_ + "_dead"})
            nats::delete_stream(*admin_, name);
    }

    std::string subject() const { return stream_ + ".payments"; }

    Hop hop() {
        return idem_test::chain::hop_of([this](const idem::OutboxRow& row) { (*sender_)(row); },
                                        [this] { consumer_->poll_once(); });
    }

    idem::testing::NatsServer* server_ = nullptr;
    nats::Endpoint endpoint_;
    std::unique_ptr<nats::Connection> admin_;
    std::string stream_;
    Upstream up_;
    Ledger<JetStreamMessage> ledger_{[](const JetStreamMessage& m) { return m.data; }};
    std::unique_ptr<idem::JetStreamSender> sender_;
    std::unique_ptr<idem::JetStreamConsumer> consumer_;
};

TEST_F(JetStreamSenderTest, RelayShipsIntentsTheConsumerClaimsUnderTheirMsgIds) {
    idem_test::chain::relay_ships_keys_as_message_ids(up_, ledger_, hop(), subject());
}

TEST_F(JetStreamSenderTest, AResendWithinTheWindowIsDroppedByTheStream) {
    up_.add(subject(), "wire-3", "three");
    const auto row = *up_.row("wire-3");
    const nats::PubAck first = (*sender_)(row);
    const nats::PubAck second = (*sender_)(row);
    EXPECT_FALSE(first.duplicate);
    EXPECT_TRUE(second.duplicate);
    EXPECT_EQ(second.sequence, first.sequence);
    EXPECT_EQ(nats::stream_state(*admin_, stream_).messages, 1u);
}

// A redrive re-publishes a parked message under its id while the stream still remembers the
// original's Nats-Msg-Id: the stream must store it, not drop it as a duplicate, and a consumer
// must claim it by the original's id; the relay's resend of that intent is still dropped.
TEST_F(JetStreamSenderTest, ARedriveWithinTheWindowOfItsOriginalIsStoredAndKeepsItsId) {
    nats::delete_stream(*admin_, stream_);
    nats::StreamSpec spec{stream_, {stream_ + ".>"}};
    spec.duplicate_window = 10min;  // the original is surely inside it
    nats::ensure_stream(*admin_, spec);
    const nats::PubAck original = admin_->publish(subject(), "order 7", {}, "order-7");
    ASSERT_FALSE(original.duplicate);

    up_.add(subject(), "order-7", "order 7, fixed");  // the redrive's intent
    const auto row = *up_.row("order-7");
    const nats::PubAck redriven = (*sender_)(row);
    EXPECT_FALSE(redriven.duplicate);
    EXPECT_NE(redriven.sequence, original.sequence);
    const nats::PubAck resent = (*sender_)(row);  // the relay died before its mark
    EXPECT_TRUE(resent.duplicate);
    EXPECT_EQ(resent.sequence, redriven.sequence);
    EXPECT_EQ(nats::stream_state(*admin_, stream_).messages, 2u);
    const auto stored = nats::stream_message(*admin_, stream_, redriven.sequence);
    ASSERT_TRUE(stored.has_value());
    EXPECT_EQ(stored->data, "order 7, fixed");
    EXPECT_EQ(stored->header(nats::message_id_header), std::optional<std::string_view>("order-7"));

    std::vector<std::pair<std::string, std::string>> seen;  // (message id, data)
    idem::JetStreamConsumerOptions options{stream_, "redrive-reader"};
    options.dead_letter = "dead." + stream_;
    options.poll_wait = 100ms;
    idem::JetStreamConsumer reader{
        endpoint_, options, [&](const idem::Delivery& delivery, const JetStreamMessage& message) {
            seen.emplace_back(delivery.message_id, message.data);
            return idem::Outcome{idem::Disposition::processed, {}};
        }};
    for (int i = 0; i < 20 && seen.size() < 2; ++i)
        reader.poll_once();
    const std::vector<std::pair<std::string, std::string>> expected{{"order-7", "order 7"},
                                                                    {"order-7", "order 7, fixed"}};
    EXPECT_EQ(seen, expected);
}

TEST_F(JetStreamSenderTest, AResendAfterTheWindowIsStoredAgainAndIsADuplicateDownstream) {
    idem_test::chain::resend_is_a_duplicate(up_, ledger_, hop(), subject(), outlive_window);
    EXPECT_EQ(nats::stream_state(*admin_, stream_).messages, 2u);  // the window had passed
}

TEST_F(JetStreamSenderTest, ServerDownLeavesTheRowUnsentUntilARetryDeliversIt) {
    idem_test::chain::outage_is_retried_then_delivered(
        up_, ledger_, hop(), subject(), [this] { server_->kill9(); }, [this] { server_->start(); });
}

TEST_F(JetStreamSenderTest, FanOutChildrenOfARedeliveredParentApplyOnce) {
    idem_test::chain::fan_out_children_apply_once(up_, ledger_, hop(), subject(), 4,
                                                  outlive_window);
}

TEST_F(JetStreamSenderTest, AMessageOverTheMaxPayloadIsParkedAtOnceWithTheReason) {
    idem_test::chain::expect_parked_at_once(up_, *sender_, subject(), "wire-big",
                                            std::string(2 * 1024 * 1024, 'x'),  // max_payload: 1 MB
                                            "refused for good");
}

TEST_F(JetStreamSenderTest, NoStreamForTheSubjectIsRetriedLater) {
    idem_test::chain::expect_retried_later(up_, *sender_, "nowhere.payments", "wire-lost",
                                           "No responders");
}

}  // namespace
