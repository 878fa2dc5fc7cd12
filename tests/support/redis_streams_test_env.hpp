#pragma once
// Shared by the redis_streams_*_test files: StreamConsumerTest on the process's shared
// redis-server (idem/testing/redis_server.hpp), fast consumer options, deadline-bounded waits and
// dead-letter helpers. Short visibility timeouts keep reclaiming fast; waits poll for a
// condition under a deadline instead of sleeping a fixed time.

#include <gtest/gtest.h>
#include <sqlite3.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "idem/broker/redis_streams.hpp"
#include "idem/idem.hpp"
#include "idem/store/memory.hpp"
#include "idem/store/redis.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/redis_server.hpp"
#include "idem/testing/temp_dir.hpp"
#include "polling.hpp"
#include "require_redis.hpp"

namespace idem_test::redis_streams {

using namespace std::chrono_literals;
using idem::Delivery;
using idem::Disposition;
using idem::Outcome;
using idem::RedisStreamConsumer;
using idem::RedisStreamConsumerOptions;
using idem::StreamEntry;
using Fields = std::vector<std::pair<std::string, std::string>>;
using Clock = std::chrono::steady_clock;

inline constexpr auto deadline_limit = 15s;  // generous: a loaded 2-core CI machine

inline idem::RedisEndpoint endpoint_of(const idem::testing::RedisServer& server) {
    idem::RedisEndpoint endpoint;
    endpoint.host = server.host();
    endpoint.port = server.port();
    return endpoint;
}

/// Short timings so a redelivery takes ~100 ms instead of 30 s (no redelivery backoff).
inline RedisStreamConsumerOptions fast_options(const std::string& stream,
                                               const std::string& consumer = "c1") {
    RedisStreamConsumerOptions options;
    options.stream = stream;
    options.group = "workers";
    options.consumer = consumer;
    options.visibility_timeout = 100ms;
    options.poll_wait = 50ms;
    // Every visibility timeout: the tests of the backoff set it themselves.
    options.redelivery_backoff = idem::RedeliveryBackoff::none();
    return options;
}

template <class Pred>
inline bool wait_for(Pred done, std::chrono::milliseconds limit = deadline_limit) {
    return idem_test::wait_within(limit, done);
}

/// Polls until @p done or the deadline; false on timeout.
template <class Pred>
inline bool poll_until(RedisStreamConsumer& consumer, Pred done,
                       std::chrono::milliseconds limit = deadline_limit) {
    return idem_test::poll_within(
        limit, [&] { consumer.poll_once(); }, done);
}

/// A dead-letter stream entry split into the consumer's idem-* fields and the original ones.
struct DeadLetterEntry {
    std::map<std::string, std::string> meta;
    Fields original;
};

inline DeadLetterEntry split_dead_letter(const StreamEntry& entry) {
    DeadLetterEntry out;
    // The envelope: six idem-* fields, nine when it says how the effect failed.
    const bool failures = entry.fields.size() > 4 && entry.fields[4].first == "idem-failure";
    std::size_t i = 0;
    for (; i < entry.fields.size() && i < (failures ? 9u : 6u); ++i) {
        EXPECT_EQ(entry.fields[i].first.rfind("idem-", 0), 0u) << entry.fields[i].first;
        out.meta.insert(entry.fields[i]);
    }
    out.original.assign(entry.fields.begin() + static_cast<std::ptrdiff_t>(i), entry.fields.end());
    return out;
}

/// Checks a dead letter: its idem-reason contains @p reason, its other idem-* fields named in
/// @p meta have those values, and its original fields are @p original.
inline void expect_letter(const DeadLetterEntry& letter, const std::string& reason,
                          const std::map<std::string, std::string>& meta, const Fields& original) {
    EXPECT_NE(letter.meta.at("idem-reason").find(reason), std::string::npos)
        << letter.meta.at("idem-reason");
    for (const auto& [name, value] : meta)
        EXPECT_EQ(letter.meta.at(name), value) << name;
    EXPECT_EQ(letter.original, original);
}

/// The dead-letter stream's @p copy and the store's @p entry of one message say the same about
/// how its effect failed: the text (containing @p failure) and when the first and last were.
inline void expect_same_failures(const DeadLetterEntry& copy, const idem::DeadLetter& entry,
                                 const std::string& failure) {
    EXPECT_NE(entry.failure.find(failure), std::string::npos) << entry.failure;
    ASSERT_TRUE(entry.first_failed_at && entry.last_failed_at);
    EXPECT_LE(*entry.first_failed_at, *entry.last_failed_at);
    ASSERT_EQ(copy.meta.count("idem-failure"), 1u);
    EXPECT_EQ(copy.meta.at("idem-failure"), entry.failure);
    EXPECT_EQ(copy.meta.at("idem-first-failed-at"),
              std::to_string(idem::to_unix_ms(*entry.first_failed_at)));
    EXPECT_EQ(copy.meta.at("idem-last-failed-at"),
              std::to_string(idem::to_unix_ms(*entry.last_failed_at)));
}

/// The effect of the RedisStore scenarios: INCR effects:<order> in the store's commit.
inline constexpr auto count_order = [](auto& tx, const StreamEntry& e) {
    tx.write("INCR", "effects:" + std::string(*e.field("order")));
};

class StreamConsumerTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_REDIS();
        server_ = &idem::testing::shared_redis();
        server_->flushall();
        client_.emplace(server_->host(), server_->port());
    }

    idem::RedisEndpoint endpoint() const { return endpoint_of(*server_); }

    std::string xadd(const std::string& stream, const Fields& fields) {
        std::vector<std::string> command{"XADD", stream, "*"};
        for (const auto& [name, value] : fields) {
            command.push_back(name);
            command.push_back(value);
        }
        return client_->str(command).value();
    }

    /// XRANGE with nested replies (the test client reads flat arrays only).
    std::vector<StreamEntry> xrange(const std::string& stream) {
        idem::redis::Connection connection{endpoint()};
        idem::redis::Reply reply = connection.checked({"XRANGE", stream, "-", "+"}, "XRANGE");
        std::vector<StreamEntry> entries;
        for (const auto& element : reply.elements) {
            StreamEntry entry;
            entry.stream = stream;
            entry.id = element.elements.at(0).str;
            const auto& values = element.elements.at(1).elements;
            for (std::size_t i = 0; i + 1 < values.size(); i += 2)
                entry.fields.emplace_back(values[i].str, values[i + 1].str);
            entries.push_back(std::move(entry));
        }
        return entries;
    }

    /// The dead-letter stream of "orders", each entry split (split_dead_letter()).
    std::vector<DeadLetterEntry> dead_letters() {
        std::vector<DeadLetterEntry> letters;
        for (const auto& entry : xrange("orders.dead-letters"))
            letters.push_back(split_dead_letter(entry));
        return letters;
    }

    /// A RedisStore's options here: keys apart from the test's own, and a short @p lease.
    static idem::RedisOptions store_options(std::chrono::milliseconds lease) {
        idem::RedisOptions options;
        options.key_prefix = "idem-streams:";
        options.lease = lease;
        return options;
    }

    /// How many entries of the group are delivered and not acked (XPENDING summary).
    long long pending(const std::string& stream, const std::string& group = "workers") {
        idem::redis::Connection connection{endpoint()};
        idem::redis::Reply reply = connection.checked({"XPENDING", stream, group}, "XPENDING");
        return reply.elements.at(0).integer;
    }

    long long counter(const std::string& key) { return client_->integer({"GET", key}).value_or(0); }

    /// The ids of the group's entries delivered and not acked, oldest first (XPENDING extended).
    std::vector<std::string> pending_ids(const std::string& stream,
                                         const std::string& group = "workers") {
        idem::redis::Connection connection{endpoint()};
        idem::redis::Reply reply =
            connection.checked({"XPENDING", stream, group, "-", "+", "1000"}, "XPENDING");
        std::vector<std::string> ids;
        for (const auto& row : reply.elements)
            ids.push_back(row.elements.at(0).str);
        return ids;
    }

    /// How many times the server ran @p command since CONFIG RESETSTAT, including calls made by
    /// scripts (INFO commandstats).
    long long command_calls(const std::string& command) {
        const std::string info = client_->str({"INFO", "commandstats"}).value_or("");
        const std::string key = "cmdstat_" + command + ":calls=";
        const std::size_t at = info.find(key);
        if (at == std::string::npos) return 0;
        return std::stoll(info.substr(at + key.size()));
    }

    idem::testing::RedisServer* server_ = nullptr;
    std::optional<idem::testing::RedisClient> client_;
};

}  // namespace idem_test::redis_streams
