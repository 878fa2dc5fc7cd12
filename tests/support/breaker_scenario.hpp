#pragma once
// What the adapters' circuit-breaker scenarios share (the RabbitMQ, NATS JetStream and Redis
// Streams tests of a poll cut short by an unreachable store): how the poll reaches the handler,
// the consumer options, and what the first poll must leave behind.

#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>

#include "idem/broker/circuit_breaker.hpp"
#include "idem/store/memory.hpp"

namespace idem_test {

/// How a breaker scenario hands a poll to the handler.
enum class BreakerMode {
    one_at_a_time,  ///< an IdempotentHandler, one delivery at a time
    batches,        ///< an IdempotentHandler, handle_in_batches: one handle_batch() per poll
    plain_batches,  ///< a plain handler (calling the IdempotentHandler), handle_in_batches
};

/// Deliveries the first poll hands to the handler before the breaker opens: the whole poll of
/// 4 in one handle_batch(), else the first one only.
inline std::size_t handed_before_the_breaker(BreakerMode mode) {
    return mode == BreakerMode::batches ? 4u : 1u;
}

/// A poll of 4, in batches unless one at a time, a breaker that probes @p store quickly.
template <class Options>
void breaker_options(Options& options, BreakerMode mode, idem::MemoryStore& store) {
    using namespace std::chrono_literals;
    options.batch_size = 4;
    options.handle_in_batches = mode != BreakerMode::one_at_a_time;
    options.circuit_breaker.initial_backoff = 20ms;
    options.circuit_breaker.max_backoff = 50ms;
    options.store_probe = [&store] { idem::probe_store(store); };  // the plain handler's
}

/// After the first poll: the breaker opened once, the deliveries handed were read and not
/// acked, nothing else was acked, and the store holds no claim.
template <class Stats>
void expect_first_poll_cut_short(const Stats& stats, BreakerMode mode, idem::MemoryStore& store) {
    const std::size_t handed = handed_before_the_breaker(mode);
    EXPECT_EQ(stats.circuit_opened, 1u);
    EXPECT_EQ(stats.read, handed);
    EXPECT_EQ(stats.not_acked, handed);
    EXPECT_EQ(stats.acked, 0u);
    EXPECT_EQ(store.claim_count(), 0u);
}

}  // namespace idem_test
