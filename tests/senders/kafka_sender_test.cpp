// idem::KafkaSender against librdkafka's mock cluster (idem::testing::KafkaCluster, started
// once for this binary, before any client: it must fork a one-threaded process). A Relay over
// an SqliteStore ships intents with the idempotent producer; the downstream idem::KafkaConsumer
// claims each record under its idem-message-id header (KafkaConsumerOptions::id_field). A
// resend is a duplicate downstream; a broker down leaves the row unsent and retried; fan-out
// children apply once; a record over message.max.bytes parks.

#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "idem/broker/kafka.hpp"
#include "idem/senders/kafka.hpp"
#include "idem/testing/kafka_cluster.hpp"
#include "support/chain_env.hpp"

namespace {

using namespace std::chrono_literals;
namespace kafka = idem::kafka;
using idem::testing::KafkaCluster;
using idem_test::chain::Hop;
using idem_test::chain::Ledger;
using idem_test::chain::Upstream;

KafkaCluster& cluster() {
    static KafkaCluster instance{1};
    return instance;
}

/// Starts the cluster before any test makes a librdkafka client (threads).
class ClusterFirst : public ::testing::Environment {
  public:
    void SetUp() override { (void)cluster(); }
};
[[maybe_unused]] ::testing::Environment* const cluster_first =
    ::testing::AddGlobalTestEnvironment(new ClusterFirst);

kafka::Config producer_config() {
    return kafka::Config{}
        .bootstrap_servers(cluster().bootstrap_servers())
        .set("message.timeout.ms", "1500");
}

/// The last record the downstream applied, as it was on the wire.
struct Seen {
    std::string key;
    std::optional<std::string> message_id;
};

class KafkaSenderTest : public ::testing::Test {
  protected:
    void SetUp() override {
        topic_ = ::testing::UnitTest::GetInstance()->current_test_info()->name();
        cluster().create_topic(topic_, 1);
        idem::KafkaSenderOptions options;
        options.delivery_timeout = 10s;
        sender_ = std::make_unique<idem::KafkaSender>(producer_config(), options);
        idem::KafkaConsumerOptions consumer_options{{topic_}, "downstream-" + topic_};
        consumer_options.id_field = kafka::message_id_header;
        consumer_options.poll_wait = 50ms;
        consumer_options.redelivery_backoff = idem::RedeliveryBackoff::none();
        consumer_ = std::make_unique<idem::KafkaConsumer>(
            kafka::Config{}
                .bootstrap_servers(cluster().bootstrap_servers())
                .auto_offset_reset("earliest")
                .session_timeout(3000ms)
                .set("heartbeat.interval.ms", "500"),
            consumer_options, ledger_.handler());
        // Joined before the test starts (a broker outage while joining delays the join).
        ASSERT_TRUE(idem_test::wait_within(30s, [&] {
            consumer_->poll_once();
            return !consumer_->assignment().empty();
        }));
    }

    Hop hop() {
        return idem_test::chain::hop_of([this](const idem::OutboxRow& row) { (*sender_)(row); },
                                        [this] { consumer_->poll_once(); });
    }

    std::string topic_;
    Upstream up_;
    Seen seen_;
    Ledger<idem::KafkaMessage> ledger_{[this](const idem::KafkaMessage& m) {
        seen_.key = m.key;
        const auto id = m.header(kafka::message_id_header);
        seen_.message_id = id ? std::optional<std::string>(std::string(*id)) : std::nullopt;
        return m.value;
    }};
    std::unique_ptr<idem::KafkaSender> sender_;
    std::unique_ptr<idem::KafkaConsumer> consumer_;
};

TEST_F(KafkaSenderTest, RelayShipsIntentsTheConsumerClaimsUnderTheirHeader) {
    idem_test::chain::relay_ships_keys_as_message_ids(up_, ledger_, hop(), topic_);
}

TEST_F(KafkaSenderTest, TheKeyIsTheHeaderAndByDefaultTheRecordKey) {
    up_.add(topic_, "wire-5", "five");
    EXPECT_EQ(idem_test::chain::relay_all(up_.store(), *sender_).sent, 1u);
    ASSERT_TRUE(idem_test::chain::poll_until(hop(), [&] { return seen_.message_id.has_value(); }));
    EXPECT_EQ(std::string(kafka::message_id_header), "idem-message-id");
    EXPECT_EQ(seen_.message_id, std::optional<std::string>("wire-5"));
    EXPECT_EQ(ledger_.effects("wire-5"), 1);  // claimed under the header
    EXPECT_EQ(seen_.key, "wire-5");
}

TEST_F(KafkaSenderTest, AnOptionChoosesAnotherRecordKey) {
    idem::KafkaSenderOptions options;
    options.record_key = [](const idem::OutboxRow& row) { return "account-" + row.payload; };
    idem::KafkaSender sender{producer_config(), options};
    up_.add(topic_, "wire-6", "77");
    EXPECT_EQ(idem_test::chain::relay_all(up_.store(), sender).sent, 1u);
    ASSERT_TRUE(idem_test::chain::poll_until(hop(), [&] { return seen_.message_id.has_value(); }));
    EXPECT_EQ(seen_.message_id, std::optional<std::string>("wire-6"));
    EXPECT_EQ(ledger_.effects("wire-6"), 1);
    EXPECT_EQ(seen_.key, "account-77");
}

TEST_F(KafkaSenderTest, ASecondSendOfTheSameIntentIsADuplicateDownstream) {
    idem_test::chain::resend_is_a_duplicate(up_, ledger_, hop(), topic_);
}

TEST_F(KafkaSenderTest, BrokerDownLeavesTheRowUnsentUntilARetryDeliversIt) {
    idem_test::chain::outage_is_retried_then_delivered(
        up_, ledger_, hop(), topic_, [] { cluster().broker_down(1); },
        [] { cluster().broker_up(1); });
}

TEST_F(KafkaSenderTest, FanOutChildrenOfARedeliveredParentApplyOnce) {
    idem_test::chain::fan_out_children_apply_once(up_, ledger_, hop(), topic_, 4);
}

TEST_F(KafkaSenderTest, ARecordOverMessageMaxBytesIsParkedAtOnceWithTheReason) {
    idem::KafkaSender sender{producer_config().set("message.max.bytes", "2000")};
    idem_test::chain::expect_parked_at_once(up_, sender, topic_, "wire-big", std::string(8000, 'x'),
                                            "SIZE_TOO_LARGE");
}

}  // namespace
