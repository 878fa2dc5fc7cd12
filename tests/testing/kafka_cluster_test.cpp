// idem::testing::KafkaCluster: librdkafka's mock cluster in a host process of its own, used by
// clients in this process and in fork()ed ones: a consumer that committed 4 offsets is SIGKILLed
// and the next consumer of its group resumes at offset 4; the cluster outlives the killed one.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include <idem/kafka/consumer.hpp>
#include <idem/kafka/producer.hpp>
#include <idem/testing/kafka_cluster.hpp>
#include <idem/testing/process.hpp>

namespace {

using namespace std::chrono_literals;
namespace kafka = idem::kafka;
using idem::testing::KafkaCluster;

kafka::Config consumer_config(const KafkaCluster& cluster, const std::string& group) {
    return kafka::Config{}
        .bootstrap_servers(cluster.bootstrap_servers())
        .group_id(group)
        .auto_offset_reset("earliest")
        .session_timeout(3000ms)  // the mock coordinator never answers a join under ~3 s
        .set("heartbeat.interval.ms", "500");
}

void produce_values(const KafkaCluster& cluster, const std::string& topic, int count) {
    kafka::Producer producer{kafka::Config{}.bootstrap_servers(cluster.bootstrap_servers())};
    for (int i = 0; i < count; ++i) {
        producer.produce(topic, "k", "value-" + std::to_string(i), {}, 0).wait(10s);
    }
}

/// The next record within @p limit, or nullopt.
std::optional<kafka::Message> next_record(kafka::Consumer& consumer,
                                          std::chrono::milliseconds limit = 15s) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
        if (auto message = consumer.poll(100ms)) return message;
    }
    return std::nullopt;
}

TEST(KafkaCluster, StartsWithBootstrapServersOnLoopbackAndStops) {
    pid_t host = -1;
    {
        KafkaCluster cluster{3};
        host = cluster.pid();
        EXPECT_GT(host, 0);
        EXPECT_EQ(cluster.brokers(), 3);
        // One address per broker.
        const std::string& servers = cluster.bootstrap_servers();
        EXPECT_EQ(std::count(servers.begin(), servers.end(), ','), 2) << servers;
        EXPECT_NE(servers.find("127.0.0.1:"), std::string::npos) << servers;
        cluster.create_topic("t", 2);
        EXPECT_FALSE(idem::testing::process_gone(host));
    }
    EXPECT_TRUE(idem::testing::process_gone(host));
}

TEST(KafkaCluster, RefusesToForkItsHostFromAThreadedProcess) {
    // A producer's threads are running: the fork would copy a process whose librdkafka state
    // belongs to threads that do not exist in the copy.
    KafkaCluster first;
    kafka::Producer producer{kafka::Config{}.bootstrap_servers(first.bootstrap_servers())};
    try {
        KafkaCluster second;
        FAIL() << "a threaded process must be refused";
    } catch (const std::runtime_error& e) {
        EXPECT_NE(std::string(e.what()).find("single-threaded"), std::string::npos) << e.what();
    }
}

TEST(KafkaCluster, ReportsAnUnknownBrokerAsAnError) {
    KafkaCluster cluster{1};
    EXPECT_THROW(cluster.broker_down(7), std::runtime_error);
    cluster.broker_down(1);
    cluster.broker_up(1);
}

TEST(KafkaCluster, ASecondConsumerResumesAtTheOffsetsTheKilledOneCommitted) {
    KafkaCluster cluster{1};
    cluster.create_topic("orders", 1);
    produce_values(cluster, "orders", 10);  // the producer is gone (no threads) before the fork

    // A consumer in a child process reads and commits 4 records, then dies by SIGKILL.
    const auto killed = idem::testing::killed_while([&](auto die) {
        kafka::Consumer consumer{consumer_config(cluster, "billing")};
        consumer.subscribe({"orders"});
        int committed = 0;
        while (committed < 4) {
            auto message = consumer.poll(100ms);
            if (!message) continue;
            consumer.commit({message->next_position()});
            ++committed;
        }
        die("committed " + std::to_string(committed));
    });
    ASSERT_TRUE(WIFSIGNALED(killed.status)) << killed.report;
    EXPECT_EQ(WTERMSIG(killed.status), SIGKILL);
    EXPECT_EQ(killed.report, "committed 4\n");

    // The cluster survived it; the group's next member starts where the dead one committed.
    kafka::Consumer consumer{consumer_config(cluster, "billing")};
    consumer.subscribe({"orders"});
    auto first = next_record(consumer, 30s);
    ASSERT_TRUE(first.has_value()) << "no record after the killed consumer's rebalance";
    EXPECT_EQ(first->offset(), 4);
    EXPECT_EQ(first->value(), "value-4");
    const auto committed = consumer.committed({{"orders", 0}});
    ASSERT_EQ(committed.size(), 1u);
    EXPECT_EQ(committed[0].offset, 4);
}

TEST(KafkaCluster, ServesTwoProcessesOfOneGroupAtOnce) {
    KafkaCluster cluster{2};
    cluster.create_topic("events", 2);

    // A child joins the group and holds its share until told to stop (a pipe's EOF).
    int to_child[2];
    ASSERT_EQ(::pipe(to_child), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        ::close(to_child[1]);
        int code = 1;
        try {
            kafka::Consumer consumer{consumer_config(cluster, "pair")};
            consumer.subscribe({"events"});
            ::fcntl(to_child[0], F_SETFL, O_NONBLOCK);
            char byte = 0;
            for (;;) {
                consumer.poll(50ms);
                const ssize_t n = ::read(to_child[0], &byte, 1);
                if (n == 0) break;  // the parent closed its end
            }
            consumer.close();
            code = 0;
        } catch (...) {
        }
        ::_exit(code);
    }
    ::close(to_child[0]);

    kafka::Consumer consumer{consumer_config(cluster, "pair")};
    consumer.subscribe({"events"});
    // With two members, this one ends up with one of the two partitions.
    const bool shared = idem::testing::eventually(
        [&] {
            consumer.poll(50ms);
            return consumer.assignment().size() == 1;
        },
        30s);
    EXPECT_TRUE(shared) << "assignment size " << consumer.assignment().size();
    ::close(to_child[1]);
    const auto status = idem::testing::wait_for(child, 30s);
    ASSERT_TRUE(status.has_value());
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
    // The child left the group: this member gets both partitions.
    EXPECT_TRUE(idem::testing::eventually(
        [&] {
            consumer.poll(50ms);
            return consumer.assignment().size() == 2;
        },
        30s));
}

}  // namespace
