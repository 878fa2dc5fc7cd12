// idem::kafka's client layer (Config, Producer, Consumer, Message, the typed errors) against
// librdkafka's mock cluster (idem::testing::KafkaCluster): delivery reports per record, headers,
// eager and cooperative rebalances, pause / resume, seek, sync and async commits, broker outages
// and injected request errors.
#include <gtest/gtest.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include <idem/kafka/consumer.hpp>
#include <idem/kafka/error.hpp>
#include <idem/kafka/producer.hpp>
#include <idem/testing/kafka_cluster.hpp>
#include <idem/testing/process.hpp>

namespace {

using namespace std::chrono_literals;
namespace kafka = idem::kafka;
using idem::testing::KafkaCluster;

constexpr int produce_api = 0;        // RD_KAFKAP_Produce
constexpr int offset_commit_api = 8;  // RD_KAFKAP_OffsetCommit

kafka::Config consumer_config(const KafkaCluster& cluster, const std::string& group) {
    return kafka::Config{}
        .bootstrap_servers(cluster.bootstrap_servers())
        .group_id(group)
        .auto_offset_reset("earliest")
        .session_timeout(3000ms)
        .set("heartbeat.interval.ms", "500");
}

kafka::Config producer_config(const KafkaCluster& cluster) {
    return kafka::Config{}.bootstrap_servers(cluster.bootstrap_servers());
}

std::optional<kafka::Message> next_record(kafka::Consumer& consumer,
                                          std::chrono::milliseconds limit = 20s) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
        if (auto message = consumer.poll(100ms)) return message;
    }
    return std::nullopt;
}

/// Polls until the consumer has an assignment.
bool assigned(kafka::Consumer& consumer) {
    return idem::testing::eventually(
        [&] {
            consumer.poll(50ms);
            return !consumer.assignment().empty();
        },
        30s);
}

TEST(KafkaConfig, RefusesAnUnknownPropertyNamingIt) {
    kafka::Config config;
    try {
        config.set("no.such.property", "1");
        FAIL() << "accepted";
    } catch (const idem::usage_error& e) {
        EXPECT_NE(std::string(e.what()).find("no.such.property"), std::string::npos) << e.what();
    }
    config.idempotent().cooperative().group_id("g");
    EXPECT_EQ(config.get("enable.idempotence"), std::optional<std::string>("true"));
    EXPECT_EQ(config.get("partition.assignment.strategy"),
              std::optional<std::string>("cooperative-sticky"));
    const kafka::Config copy = config;  // a copy is independent of the original
    config.group_id("other");
    EXPECT_EQ(copy.get("group.id"), std::optional<std::string>("g"));
}

TEST(KafkaConsumer, NeedsAGroup) {
    EXPECT_THROW(kafka::Consumer{kafka::Config{}.bootstrap_servers("127.0.0.1:9")},
                 idem::usage_error);
}

TEST(KafkaProducer, WaitsForEachRecordsDeliveryReportAndKeepsHeaders) {
    KafkaCluster cluster{3};
    cluster.create_topic("payments", 3);
    {
        kafka::Producer producer{producer_config(cluster).idempotent()};
        std::vector<kafka::Pending> pending;
        for (int i = 0; i < 6; ++i) {
            pending.push_back(producer.produce("payments", "order-" + std::to_string(i % 2),
                                               "body-" + std::to_string(i),
                                               {{"idem-id", "m-" + std::to_string(i)}}, 1));
        }
        for (int i = 0; i < 6; ++i) {
            const auto where = pending[static_cast<std::size_t>(i)].wait(10s);
            EXPECT_EQ(where.topic, "payments");
            EXPECT_EQ(where.partition, 1);
            EXPECT_EQ(where.offset, i);  // one partition, in order
        }
        EXPECT_EQ(producer.in_flight(), 0);
    }
    kafka::Consumer consumer{consumer_config(cluster, "reader")};
    consumer.subscribe({"payments"});
    for (int i = 0; i < 6; ++i) {
        auto message = next_record(consumer);
        ASSERT_TRUE(message.has_value()) << "record " << i;
        EXPECT_EQ(message->topic(), "payments");
        EXPECT_EQ(message->partition(), 1);
        EXPECT_EQ(message->offset(), i);
        EXPECT_EQ(message->key(), "order-" + std::to_string(i % 2));
        EXPECT_EQ(message->value(), "body-" + std::to_string(i));
        EXPECT_EQ(message->header("idem-id"),
                  std::optional<std::string_view>("m-" + std::to_string(i)));
        EXPECT_FALSE(message->header("absent").has_value());
        const auto headers = message->headers();
        ASSERT_EQ(headers.size(), 1u);
        EXPECT_EQ(headers[0].first, "idem-id");
        EXPECT_TRUE(message->timestamp().has_value());
        EXPECT_EQ(message->next_position(), (kafka::TopicPartition{"payments", 1, i + 1}));
    }
}

TEST(KafkaProducer, RetriesTransientProduceErrorsAndReportsPermanentOnes) {
    KafkaCluster cluster{1};
    cluster.create_topic("t", 1);
    kafka::Producer producer{producer_config(cluster).idempotent()};
    producer.produce("t", "", "warm-up").wait(10s);
    // Two retriable refusals: librdkafka retries, the idempotent producer keeps one copy.
    cluster.push_request_errors(produce_api, {RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
                                              RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS});
    EXPECT_EQ(producer.produce("t", "", "retried").wait(10s).offset, 1);
    EXPECT_EQ(producer.produce("t", "", "next").wait(10s).offset, 2);

    kafka::Producer plain{producer_config(cluster)};
    cluster.push_request_errors(produce_api, {RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE});
    try {
        plain.produce("t", "", "refused").wait(10s);
        FAIL() << "a refused record was reported delivered";
    } catch (const kafka::error& e) {
        EXPECT_EQ(e.code(), RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE) << e.what();
        EXPECT_FALSE(e.retriable());
        EXPECT_FALSE(e.fatal());
    }
}

TEST(KafkaProducer, ABrokerDownIsUnavailableThenDeliveredWhenItIsBack) {
    KafkaCluster cluster{1};
    cluster.create_topic("t", 1);
    kafka::Producer producer{producer_config(cluster).set("message.timeout.ms", "1500")};
    producer.produce("t", "", "before").wait(10s);
    cluster.broker_down(1);
    try {
        producer.produce("t", "", "lost").wait(10s);
        FAIL() << "delivered to a broker that is down";
    } catch (const kafka::unavailable& e) {  // kafka::timeout: message.timeout.ms expired
        EXPECT_TRUE(e.retriable()) << e.what();
    }
    cluster.broker_up(1);
    kafka::Producer again{producer_config(cluster)};
    EXPECT_GE(again.produce("t", "", "after").wait(15s).offset, 1);
}

TEST(KafkaProducer, WaitTimesOutWithoutAReport) {
    KafkaCluster cluster{1};
    cluster.create_topic("t", 1);
    kafka::Producer producer{producer_config(cluster)};
    producer.produce("t", "", "first").wait(10s);
    cluster.broker_down(1);
    auto pending = producer.produce("t", "", "stuck");
    EXPECT_THROW(pending.wait(300ms), kafka::timeout);
    EXPECT_FALSE(pending.done());
    EXPECT_THROW(producer.flush(200ms), kafka::timeout);
    cluster.broker_up(1);
    EXPECT_EQ(pending.wait(15s).offset, 1);
}

class KafkaRebalance : public ::testing::TestWithParam<bool> {};

TEST_P(KafkaRebalance, AssignsAndRevokesThroughTheCallbacks) {
    const bool cooperative = GetParam();
    KafkaCluster cluster{1};
    cluster.create_topic("t", 4);
    auto config = consumer_config(cluster, "g");
    if (cooperative) config.cooperative();
    kafka::Consumer consumer{config};
    kafka::TopicPartitions assigned_now;
    kafka::TopicPartitions revoked;
    consumer.on_assigned = [&](const kafka::TopicPartitions& p) {
        assigned_now.insert(assigned_now.end(), p.begin(), p.end());
    };
    consumer.on_revoked = [&](const kafka::TopicPartitions& p) {
        // Still assigned while the callback runs: the moment to commit for them.
        EXPECT_EQ(consumer.assignment().size(), p.size());
        revoked.insert(revoked.end(), p.begin(), p.end());
    };
    consumer.subscribe({"t"});
    ASSERT_TRUE(assigned(consumer));
    EXPECT_EQ(assigned_now.size(), 4u);
    EXPECT_EQ(consumer.assignment().size(), 4u);
    EXPECT_EQ(consumer.rebalance_protocol(), cooperative ? "COOPERATIVE" : "EAGER");
    consumer.close();
    EXPECT_EQ(revoked.size(), 4u);
    EXPECT_THROW(consumer.poll(10ms), idem::usage_error);
}

INSTANTIATE_TEST_SUITE_P(EagerAndCooperative, KafkaRebalance, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "cooperative" : "eager"; });

TEST(KafkaConsumer, PausesResumesAndSeeksBackToRetryInPlace) {
    KafkaCluster cluster{1};
    cluster.create_topic("t", 1);
    {
        kafka::Producer producer{producer_config(cluster)};
        for (int i = 0; i < 3; ++i)
            producer.produce("t", "", "v" + std::to_string(i)).wait(10s);
    }
    kafka::Consumer consumer{consumer_config(cluster, "g")};
    consumer.subscribe({"t"});
    auto first = next_record(consumer);
    ASSERT_TRUE(first.has_value());
    EXPECT_EQ(first->offset(), 0);

    // A retry in place: pause the partition, seek back to the failed record, resume later.
    const kafka::TopicPartitions partition{{"t", 0}};
    consumer.pause(partition);
    consumer.seek({"t", 0, 0});
    const auto paused_until = std::chrono::steady_clock::now() + 1500ms;
    while (std::chrono::steady_clock::now() < paused_until) {
        EXPECT_FALSE(consumer.poll(100ms).has_value()) << "a record from a paused partition";
    }
    consumer.resume(partition);
    for (int expected = 0; expected < 3; ++expected) {
        auto message = next_record(consumer);
        ASSERT_TRUE(message.has_value()) << "offset " << expected;
        EXPECT_EQ(message->offset(), expected);
    }
}

TEST(KafkaConsumer, CommitsSyncAndAsyncPerPartition) {
    KafkaCluster cluster{1};
    cluster.create_topic("t", 2);
    {
        kafka::Producer producer{producer_config(cluster)};
        for (int i = 0; i < 4; ++i)
            producer.produce("t", "", "v", {}, i % 2).wait(10s);
    }
    kafka::Consumer consumer{consumer_config(cluster, "g")};
    std::vector<std::pair<rd_kafka_resp_err_t, kafka::TopicPartitions>> reports;
    consumer.on_committed = [&](rd_kafka_resp_err_t err, const kafka::TopicPartitions& offsets) {
        reports.emplace_back(err, offsets);
    };
    consumer.subscribe({"t"});
    ASSERT_TRUE(assigned(consumer));
    consumer.commit({{"t", 0, 2}});  // sync
    EXPECT_EQ(consumer.committed({{"t", 0}, {"t", 1}}),
              (kafka::TopicPartitions{{"t", 0, 2}, {"t", 1, RD_KAFKA_OFFSET_INVALID}}));
    consumer.commit({{"t", 1, 1}}, kafka::CommitMode::async);
    ASSERT_TRUE(idem::testing::eventually(
        [&] {
            consumer.poll(50ms);
            for (const auto& [err, offsets] : reports) {
                if (err == RD_KAFKA_RESP_ERR_NO_ERROR &&
                    offsets == kafka::TopicPartitions{{"t", 1, 1}}) {
                    return true;
                }
            }
            return false;
        },
        10s));
    EXPECT_EQ(consumer.committed({{"t", 1}}), (kafka::TopicPartitions{{"t", 1, 1}}));
}

TEST(KafkaConsumer, ARefusedCommitIsATypedErrorAndTheNextOneSucceeds) {
    KafkaCluster cluster{1};
    cluster.create_topic("t", 1);
    kafka::Consumer consumer{consumer_config(cluster, "g")};
    consumer.subscribe({"t"});
    ASSERT_TRUE(assigned(consumer));
    cluster.push_request_errors(offset_commit_api, {RD_KAFKA_RESP_ERR_OFFSET_METADATA_TOO_LARGE});
    try {
        consumer.commit({{"t", 0, 5}});
        FAIL() << "the refused commit was reported done";
    } catch (const kafka::error& e) {
        EXPECT_EQ(e.code(), RD_KAFKA_RESP_ERR_OFFSET_METADATA_TOO_LARGE) << e.what();
        EXPECT_FALSE(e.retriable());
        EXPECT_NE(std::string(e.what()).find("idem::kafka: commit"), std::string::npos) << e.what();
    }
    consumer.commit({{"t", 0, 5}});
    EXPECT_EQ(consumer.committed({{"t", 0}}), (kafka::TopicPartitions{{"t", 0, 5}}));
}

TEST(KafkaConsumer, ACallbackThatThrowsSurfacesFromPoll) {
    KafkaCluster cluster{1};
    cluster.create_topic("t", 1);
    kafka::Consumer consumer{consumer_config(cluster, "g")};
    consumer.on_assigned = [](const kafka::TopicPartitions&) {
        throw std::runtime_error("from the callback");
    };
    consumer.subscribe({"t"});
    bool thrown = false;
    idem::testing::eventually(
        [&] {
            try {
                consumer.poll(50ms);
            } catch (const std::runtime_error& e) {
                thrown = std::string(e.what()) == "from the callback";
            }
            return thrown;
        },
        30s);
    EXPECT_TRUE(thrown);
}

TEST(KafkaErrors, ClassifiesCodes) {
    using kafka::detail::raise;
    EXPECT_THROW(raise(RD_KAFKA_RESP_ERR__TIMED_OUT, "x", {}, false, false), kafka::timeout);
    EXPECT_THROW(raise(RD_KAFKA_RESP_ERR__TRANSPORT, "x", {}, false, false), kafka::unavailable);
    try {
        raise(RD_KAFKA_RESP_ERR_NOT_COORDINATOR, "commit", "moved", false, false);
    } catch (const kafka::error& e) {
        EXPECT_TRUE(e.retriable());
        EXPECT_FALSE(e.fatal());
        EXPECT_NE(std::string(e.what()).find("idem::kafka: commit: NOT_COORDINATOR"),
                  std::string::npos)
            << e.what();
    }
    try {
        raise(RD_KAFKA_RESP_ERR_PRODUCER_FENCED, "produce", {}, false, true);
    } catch (const kafka::error& e) {
        EXPECT_TRUE(e.fatal());
        EXPECT_FALSE(e.retriable());
    }
    // Every one is an idem::broker_error.
    EXPECT_THROW(raise(RD_KAFKA_RESP_ERR_UNKNOWN, "x", {}, false, false), idem::broker_error);
}

}  // namespace
