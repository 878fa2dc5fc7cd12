// RedisStore and RedisStreamConsumer under threads (run under TSan in CI), against a real
// redis-server: 8 threads share one store (its connection pool) and deliver the same ids, also
// as batches; every effect is applied once. Consumers on threads drain one stream.

#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "idem/broker/redis_streams.hpp"
#include "idem/idem.hpp"
#include "idem/store/redis.hpp"
#include "idem/testing/redis_server.hpp"
#include "support/redis_env.hpp"
#include "support/require_redis.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;

class RedisConcurrency : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_REDIS();
        server_ = std::make_unique<idem::testing::RedisServer>();
        client_ = std::make_unique<idem::testing::RedisClient>(server_->host(), server_->port());
    }
    std::unique_ptr<idem::testing::RedisServer> server_;
    std::unique_ptr<idem::testing::RedisClient> client_;
};

TEST_F(RedisConcurrency, EightThreadsOneStoreSameIdsEachEffectOnce) {
    constexpr int kThreads = 8;
    constexpr int kIds = 300;
    idem::RedisStore store(idem_test::redis_endpoint(*server_));
    std::atomic<int> effects{0};
    auto handler =
        idem::make_handler(store, idem::Policy{"capture"}, [&](auto& tx, const std::string& id) {
            ++effects;
            tx.write("HINCRBY", "applied", id, 1);
        });
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            for (int i = 0; i < kIds; ++i) {
                const std::string id = "msg-" + std::to_string((i + t * 37) % kIds);
                auto outcome = handler.handle(Delivery{id, 1u}, id);
                // A live lease of another thread: the broker would redeliver; so do we.
                for (std::uint32_t n = 2; outcome.disposition == Disposition::in_progress; ++n) {
                    std::this_thread::yield();
                    outcome = handler.handle(Delivery{id, n}, id);
                }
                ASSERT_TRUE(idem::should_ack(outcome)) << outcome.reason;
            }
        });
    }
    for (auto& thread : threads)
        thread.join();
    EXPECT_EQ(effects.load(), kIds);
    EXPECT_EQ(client_->integer({"HLEN", "applied"}), kIds);
    for (int i = 0; i < kIds; ++i) {
        EXPECT_EQ(client_->str({"HGET", "applied", "msg-" + std::to_string(i)}), "1");
    }
}

TEST_F(RedisConcurrency, BatchesOnThreadsOverlapAndApplyEachEffectOnce) {
    constexpr int kThreads = 4;
    constexpr int kIds = 400;
    idem::RedisStore store(idem_test::redis_endpoint(*server_));
    auto handler = idem::make_handler(
        store, idem::Policy{"capture"},
        [&](auto& tx, const std::string& id) { tx.write("HINCRBY", "applied", id, 1); });
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            std::vector<int> pending;
            for (int i = 0; i < kIds; ++i)
                pending.push_back((i + t * 50) % kIds);
            std::uint32_t count = 1;
            while (!pending.empty()) {
                std::vector<int> next;
                for (std::size_t start = 0; start < pending.size(); start += 25) {
                    std::vector<Delivery> deliveries;
                    std::vector<std::string> bodies;
                    for (std::size_t k = start; k < std::min(pending.size(), start + 25); ++k) {
                        const std::string id = "msg-" + std::to_string(pending[k]);
                        deliveries.push_back(Delivery{id, count});
                        bodies.push_back(id);
                    }
                    auto outcomes = handler.handle_batch(deliveries, bodies);
                    for (std::size_t k = 0; k < outcomes.size(); ++k) {
                        if (!idem::should_ack(outcomes[k])) next.push_back(pending[start + k]);
                    }
                }
                pending = std::move(next);
                ++count;
            }
        });
    }
    for (auto& thread : threads)
        thread.join();
    EXPECT_EQ(client_->integer({"HLEN", "applied"}), kIds);
    for (int i = 0; i < kIds; ++i) {
        EXPECT_EQ(client_->str({"HGET", "applied", "msg-" + std::to_string(i)}), "1");
    }
}

TEST_F(RedisConcurrency, ConsumersOnThreadsDrainOneStreamEachEntryOnce) {
    constexpr int kEntries = 400;
    constexpr int kConsumers = 3;
    for (int i = 0; i < kEntries; ++i) {
        client_->exec({"XADD", "orders", "*", "order", std::to_string(i)});
    }
    idem::RedisStore store(idem_test::redis_endpoint(*server_));
    auto handler = idem::make_handler(
        store, idem::Policy{"capture"}, [&](auto& tx, const idem::StreamEntry& entry) {
            tx.write("HINCRBY", "applied", std::string(entry.field("order").value_or("?")), 1);
        });
    std::vector<std::unique_ptr<idem::RedisStreamConsumer>> consumers;
    for (int c = 0; c < kConsumers; ++c) {
        idem::RedisStreamConsumerOptions options;
        options.stream = "orders";
        options.group = "capture";
        options.consumer = "worker-" + std::to_string(c);
        options.id_field = "order";
        options.poll_wait = std::chrono::milliseconds(100);
        options.batch_size = 20;
        options.handle_in_batches = c % 2 == 0;
        consumers.push_back(std::make_unique<idem::RedisStreamConsumer>(
            idem_test::redis_endpoint(*server_), options, handler));
    }
    std::vector<std::thread> threads;
    for (auto& consumer : consumers)
        threads.emplace_back([&consumer] { consumer->run(); });
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (client_->integer({"HLEN", "applied"}).value_or(0) < kEntries &&
           std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    for (auto& consumer : consumers)
        consumer->request_stop();
    for (auto& thread : threads)
        thread.join();
    EXPECT_EQ(client_->integer({"HLEN", "applied"}), kEntries);
    for (int i = 0; i < kEntries; ++i) {
        EXPECT_EQ(client_->str({"HGET", "applied", std::to_string(i)}), "1") << i;
    }
    std::uint64_t acked = 0;
    for (auto& consumer : consumers)
        acked += consumer->stats().acked;
    EXPECT_EQ(acked, static_cast<std::uint64_t>(kEntries));
}

}  // namespace
