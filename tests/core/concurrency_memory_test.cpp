// The memory store and the handler's counters and observer under threads (run under TSan in CI):
// 8 threads deliver the same ids to one shared store; each effect is applied once.

#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/store/memory.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;

TEST(MemoryConcurrency, EightThreadsSameIdsEachEffectOnce) {
    constexpr int kThreads = 8;
    constexpr int kIds = 1000;
    idem::MemoryStore store;
    idem::CountingObserver metrics;
    std::atomic<int> effects{0};
    auto handler = idem::make_handler(
        store, idem::Policy{"capture"},
        [&](auto& tx, const std::string& id) {
            ++effects;
            tx.put("captures", id, "done");
        },
        &metrics);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            for (int i = 0; i < kIds; ++i) {
                // Each thread walks the ids from a different starting point.
                const std::string id = "msg-" + std::to_string((i + t * 125) % kIds);
                auto outcome = handler.handle(Delivery{id, 1u}, id);
                ASSERT_TRUE(idem::should_ack(outcome)) << outcome.reason;
            }
        });
    }
    for (auto& thread : threads)
        thread.join();
    EXPECT_EQ(effects.load(), kIds);
    EXPECT_EQ(store.count("captures"), static_cast<std::size_t>(kIds));
    const auto counters = handler.counters();
    EXPECT_EQ(counters.processed, static_cast<std::uint64_t>(kIds));
    EXPECT_EQ(counters.duplicates, static_cast<std::uint64_t>(kIds * (kThreads - 1)));
    EXPECT_EQ(metrics.counters("capture").deliveries, static_cast<std::uint64_t>(kIds * kThreads));
}

TEST(MemoryConcurrency, InjectedFaultsUnderThreadsNeverLoseOrDoubleAnEffect) {
    constexpr int kThreads = 4;
    constexpr int kIds = 300;
    idem::MemoryStore store;
    auto handler = idem::make_handler(
        store, idem::Policy{"capture"},
        [&](auto& tx, const std::string& id) { tx.put("captures", id, "done"); });
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&] {
            int deliveries = 0;
            for (int i = 0; i < kIds; ++i) {
                const std::string id = "msg-" + std::to_string(i);
                // Redeliver until acked, as a broker would (count kept at 1: the poison limit
                // is not what this test is about).
                for (int attempt = 0; attempt < 10000; ++attempt) {
                    // Every third delivery of every thread arms a fault that whichever thread
                    // comes next will hit: commits and claims fail while others are mid-way.
                    if (++deliveries % 3 == 0) {
                        store.inject(deliveries % 2 == 0 ? idem::Fault::commit
                                                         : idem::Fault::claim);
                    }
                    if (idem::should_ack(handler.handle(Delivery{id, 1u}, id))) break;
                }
            }
        });
    }
    for (auto& thread : threads)
        thread.join();
    EXPECT_EQ(store.count("captures"), static_cast<std::size_t>(kIds));
    EXPECT_EQ(store.claim_count(), static_cast<std::size_t>(kIds));
    EXPECT_EQ(handler.counters().processed, static_cast<std::uint64_t>(kIds));
    EXPECT_GT(handler.counters().failed, 0u);  // the faults really hit
}

}  // namespace
