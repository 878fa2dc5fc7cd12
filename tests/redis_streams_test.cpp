// idem::StreamConsumer against a real redis-server (tests/support/redis_server.hpp): true delivery
// counts through XAUTOCLAIM + XPENDING, dead letters to a stream with their fields, the ack inside
// a RedisStore commit, a slow but live lease holder, malformed and hostile entries, a graceful
// stop and a server restart. Short visibility timeouts keep reclaiming fast; waits poll for a
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
#include "support/redis_server.hpp"
#include "support/require_redis.hpp"
#include "support/temp_dir.hpp"

namespace {

using namespace std::chrono_literals;
using idem::Delivery;
using idem::Disposition;
using idem::Outcome;
using idem::StreamConsumer;
using idem::StreamConsumerOptions;
using idem::StreamEntry;
using Fields = std::vector<std::pair<std::string, std::string>>;
using Clock = std::chrono::steady_clock;

constexpr auto deadline_limit = 15s;  // generous: a loaded 2-core CI machine

idem::RedisEndpoint endpoint_of(const idem_test::RedisServer& server) {
    idem::RedisEndpoint endpoint;
    endpoint.host = server.host();
    endpoint.port = server.port();
    return endpoint;
}

/// Short timings so a redelivery takes ~100 ms instead of 30 s.
StreamConsumerOptions fast_options(const std::string& stream, const std::string& consumer = "c1") {
    StreamConsumerOptions options;
    options.stream = stream;
    options.group = "workers";
    options.consumer = consumer;
    options.visibility_timeout = 100ms;
    options.block = 50ms;
    return options;
}

template <class Pred>
bool wait_for(Pred done, std::chrono::milliseconds limit = deadline_limit) {
    const auto deadline = Clock::now() + limit;
    while (!done()) {
        if (Clock::now() >= deadline) return false;
        std::this_thread::sleep_for(5ms);
    }
    return true;
}

/// Polls until @p done or the deadline; false on timeout.
template <class Pred>
bool poll_until(StreamConsumer& consumer, Pred done,
                std::chrono::milliseconds limit = deadline_limit) {
    const auto deadline = Clock::now() + limit;
    while (!done()) {
        if (Clock::now() >= deadline) return false;
        consumer.poll_once();
    }
    return true;
}

/// A dead-letter stream entry split into the consumer's idem-* fields and the original ones.
struct DeadLetterEntry {
    std::map<std::string, std::string> meta;
    Fields original;
};

DeadLetterEntry split_dead_letter(const StreamEntry& entry) {
    DeadLetterEntry out;
    std::size_t i = 0;
    for (; i < entry.fields.size() && i < 5; ++i) {
        EXPECT_EQ(entry.fields[i].first.rfind("idem-", 0), 0u) << entry.fields[i].first;
        out.meta.insert(entry.fields[i]);
    }
    out.original.assign(entry.fields.begin() + static_cast<std::ptrdiff_t>(i), entry.fields.end());
    return out;
}

/// Checks a dead letter: its idem-reason contains @p reason, its other idem-* fields named in
/// @p meta have those values, and its original fields are @p original.
void expect_letter(const DeadLetterEntry& letter, const std::string& reason,
                   const std::map<std::string, std::string>& meta, const Fields& original) {
    EXPECT_NE(letter.meta.at("idem-reason").find(reason), std::string::npos)
        << letter.meta.at("idem-reason");
    for (const auto& [name, value] : meta)
        EXPECT_EQ(letter.meta.at(name), value) << name;
    EXPECT_EQ(letter.original, original);
}

/// The effect of the RedisStore scenarios: INCR effects:<order> in the store's commit.
constexpr auto count_order = [](auto& tx, const StreamEntry& e) {
    tx.write("INCR", "effects:" + std::string(*e.field("order")));
};

class StreamConsumerTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_REDIS();
        server_ = &idem_test::shared_redis();
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
        idem::RedisConnection connection{endpoint()};
        idem::RedisReply reply = connection.checked({"XRANGE", stream, "-", "+"}, "XRANGE");
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
        for (const auto& entry : xrange("orders:dead-letters"))
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
        idem::RedisConnection connection{endpoint()};
        idem::RedisReply reply = connection.checked({"XPENDING", stream, group}, "XPENDING");
        return reply.elements.at(0).integer;
    }

    long long counter(const std::string& key) { return client_->integer({"GET", key}).value_or(0); }

    /// The ids of the group's entries delivered and not acked, oldest first (XPENDING extended).
    std::vector<std::string> pending_ids(const std::string& stream,
                                         const std::string& group = "workers") {
        idem::RedisConnection connection{endpoint()};
        idem::RedisReply reply =
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

    idem_test::RedisServer* server_ = nullptr;
    std::optional<idem_test::RedisClient> client_;
};

// ---------------------------------------------------------------------------------------------
// Options

TEST(StreamConsumerOptions, InvalidOptionsAreRefusedWithTheReason) {
    auto handler = [](const Delivery&, const StreamEntry&) { return Outcome{}; };
    auto refused = [&](StreamConsumerOptions options, const std::string& says,
                       idem::RedisEndpoint endpoint = {}) {
        try {
            StreamConsumer consumer{endpoint, std::move(options), handler};
            ADD_FAILURE() << "accepted; expected a refusal mentioning: " << says;
        } catch (const idem::usage_error& e) {
            EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
        }
    };
    auto base = fast_options("orders");
    auto o = base;
    o.stream.clear();
    refused(o, "options.stream is empty");
    o = base;
    o.group.clear();
    refused(o, "options.group is empty");
    o = base;
    o.consumer.clear();
    refused(o, "options.consumer is empty");
    o = base;
    o.batch_size = 0;
    refused(o, "batch_size is 0");
    o = base;
    o.block = 0ms;
    refused(o, "block must be positive");
    o = base;
    o.visibility_timeout = 0ms;
    refused(o, "visibility_timeout must be positive");
    o = base;
    o.dead_letter_stream = "orders";
    refused(o, "dead_letter_stream is the stream itself");
    o = base;
    o.block = 6000ms;
    refused(o, "shorter than the endpoint's command_timeout (5000 ms)");

    EXPECT_THROW(StreamConsumer(idem::RedisEndpoint{}, base, StreamConsumer::Handler{}),
                 idem::usage_error);
    StreamConsumer consumer{idem::RedisEndpoint{}, base, handler};
    EXPECT_EQ(consumer.options().dead_letter_stream, "orders:dead-letters");
    EXPECT_FALSE(consumer.acks_in_commit());
}

TEST(StreamConsumerOptions, LeaseLongerThanTheVisibilityTimeoutIsRefusedNamingBoth) {
    const idem::RedisEndpoint endpoint;  // nothing connects before the first poll
    idem::RedisStore store{endpoint};    // default lease 30 s
    auto handler =
        idem::make_handler(store, idem::Policy{"capture"}, [](auto&, const StreamEntry&) {});
    auto options = fast_options("orders");
    options.visibility_timeout = 200ms;
    try {
        StreamConsumer consumer{endpoint, options, handler};
        FAIL() << "a 30 s lease against a 200 ms visibility timeout must be refused";
    } catch (const idem::usage_error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("30000 ms"), std::string::npos) << what;
        EXPECT_NE(what.find("200 ms"), std::string::npos) << what;
        EXPECT_NE(what.find("p99"), std::string::npos) << what;
    }
    options.visibility_timeout = 30s;
    StreamConsumer consumer{endpoint, options, handler};
    EXPECT_TRUE(consumer.acks_in_commit());

    idem::RedisEndpoint other = endpoint;
    other.db = 1;  // another database: the commit cannot include the ack
    StreamConsumer elsewhere{other, options, handler};
    EXPECT_FALSE(elsewhere.acks_in_commit());
}

TEST(StreamPayload, IsReadableUnambiguousAscii) {
    StreamEntry entry{"s", "1-0", {{"order", "8814"}, {"note", std::string("a\"b\\c\0\xff", 7)}}};
    EXPECT_EQ(idem::idem_payload(entry), R"([["order","8814"],["note","a\"b\\c\u0000\u00ff"]])");
    StreamEntry one{"s", "1-0", {{"a", "b\",\"c"}}};
    StreamEntry two{"s", "1-0", {{"a", "b"}, {"c", ""}}};
    EXPECT_NE(idem::idem_payload(one), idem::idem_payload(two));
    EXPECT_EQ(entry.field("order"), std::optional<std::string_view>("8814"));
    EXPECT_EQ(entry.field("missing"), std::nullopt);
}

// ---------------------------------------------------------------------------------------------
// Loop robustness

TEST_F(StreamConsumerTest, ThrowingHandlerIsFailedAndNeverEscapesTheLoop) {
    int calls = 0;
    StreamConsumer consumer{endpoint(), fast_options("orders"),
                            [&](const Delivery&, const StreamEntry&) -> Outcome {
                                ++calls;
                                throw std::runtime_error("bug in the handler");
                            }};
    xadd("orders", {{"order", "1"}});
    ASSERT_TRUE(poll_until(consumer, [&] { return calls == 2; }));  // read, then reclaimed
    EXPECT_EQ(consumer.stats().not_acked, 2u);
    EXPECT_EQ(consumer.stats().acked, 0u);
    EXPECT_EQ(pending("orders"), 1);
}

TEST_F(StreamConsumerTest, PendingEntryDeletedFromTheStreamIsSkipped) {
    int calls = 0;
    StreamConsumer consumer{endpoint(), fast_options("orders"),
                            [&](const Delivery&, const StreamEntry&) {
                                ++calls;
                                return Outcome{Disposition::failed, "not yet"};
                            }};
    const std::string id = xadd("orders", {{"order", "1"}});
    ASSERT_TRUE(poll_until(consumer, [&] { return calls == 1; }));
    client_->exec({"XDEL", "orders", id});
    const auto until = Clock::now() + 400ms;  // several visibility timeouts
    while (Clock::now() < until)
        consumer.poll_once();
    EXPECT_EQ(calls, 1);
    EXPECT_EQ(consumer.stats().reclaimed, 0u);
    EXPECT_EQ(pending("orders"), 0);
}

TEST_F(StreamConsumerTest, GroupIsCreatedAgainWhenTheStreamWasDeleted) {
    std::vector<std::string> handled;
    StreamConsumer consumer{endpoint(), fast_options("orders"),
                            [&](const Delivery&, const StreamEntry& e) {
                                handled.emplace_back(*e.field("order"));
                                return Outcome{Disposition::processed, {}};
                            }};
    xadd("orders", {{"order", "1"}});
    ASSERT_TRUE(poll_until(consumer, [&] { return handled.size() == 1; }));
    client_->exec({"DEL", "orders"});  // the group goes with the stream
    EXPECT_THROW(consumer.poll_once(), idem::store_error);
    EXPECT_EQ(consumer.stats().connection_errors, 0u);  // an error reply, not a lost connection
    xadd("orders", {{"order", "2"}});
    ASSERT_TRUE(poll_until(consumer, [&] { return handled.size() == 2; }));
    EXPECT_EQ(handled[1], "2");
    EXPECT_EQ(pending("orders"), 0);
}

// ---------------------------------------------------------------------------------------------
// 1. Delivery counts

TEST_F(StreamConsumerTest, ReclaimedEntryCarriesTheTrueDeliveryCount) {
    std::vector<std::uint32_t> seen;
    StreamConsumer consumer{endpoint(), fast_options("orders"),
                            [&](const Delivery& d, const StreamEntry&) {
                                seen.push_back(d.delivery_count.value());
                                return Outcome{Disposition::failed, "not yet"};
                            }};
    const std::string id = xadd("orders", {{"order", "1"}});
    ASSERT_TRUE(poll_until(consumer, [&] { return seen.size() >= 4; }));
    EXPECT_EQ(seen, (std::vector<std::uint32_t>{1, 2, 3, 4}));
    const auto stats = consumer.stats();
    EXPECT_EQ(stats.read, 1u);
    EXPECT_EQ(stats.reclaimed, 3u);
    EXPECT_EQ(stats.not_acked, 4u);
    EXPECT_EQ(stats.acked, 0u);
    EXPECT_EQ(pending("orders"), 1);  // failed: never acked
}

TEST_F(StreamConsumerTest, PoisonReachesTheDeadLetterStreamAtMaxDeliveriesAndIsAcked) {
    idem_test::TempDir dir;
    idem::SqliteStore store{dir.file("idem.db")};
    idem::PolicyOptions policy;
    policy.max_deliveries = 5;
    std::vector<std::uint32_t> effect_counts;
    auto handler = idem::make_handler(store, idem::Policy{"capture", policy},
                                      [&](auto&, const StreamEntry&, const Delivery& d) {
                                          effect_counts.push_back(d.delivery_count.value());
                                          throw std::runtime_error("gateway down");
                                      });
    StreamConsumer consumer{endpoint(), fast_options("orders"), handler};
    const Fields fields{{"order", "42"}, {"amount", "12.50"}};
    const std::string id = xadd("orders", fields);

    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().dead_lettered == 1; }));
    EXPECT_EQ(effect_counts, (std::vector<std::uint32_t>{1, 2, 3, 4}));  // the 5th never runs it
    EXPECT_EQ(consumer.stats().acked, 1u);
    EXPECT_EQ(consumer.stats().not_acked, 4u);
    EXPECT_EQ(consumer.stats().acked_in_commit, 0u);  // SQLite: the consumer acks
    EXPECT_EQ(pending("orders"), 0);

    const auto letters = dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    expect_letter(letters[0], "delivery count 5 (broker) reached max_deliveries 5",
                  {{"idem-scope", "capture"},
                   {"idem-message-id", id},
                   {"idem-entry-id", id},
                   {"idem-delivery-count", "5"}},
                  fields);

    const auto stored = store.dead_letters();  // the store keeps its own copy
    ASSERT_EQ(stored.size(), 1u);
    EXPECT_EQ(stored[0].payload, R"([["order","42"],["amount","12.50"]])");
}

// ---------------------------------------------------------------------------------------------
// 2. Ack inside the RedisStore commit

TEST_F(StreamConsumerTest, RedisStoreAcksInTheCommitAndParksPoisonInTheSameCommit) {
    idem::RedisStore store{endpoint(), store_options(200ms)};
    idem::PolicyOptions policy;
    policy.max_deliveries = 2;
    int effect_runs = 0;
    auto handler = idem::make_handler(store, idem::Policy{"count", policy},
                                      [&](auto& tx, const StreamEntry& e) {
                                          ++effect_runs;
                                          if (e.field("kind") == std::string_view("poison")) {
                                              throw std::runtime_error("cannot parse");
                                          }
                                          count_order(tx, e);
                                      });
    auto options = fast_options("orders");
    options.id_field = "order";
    options.visibility_timeout = 200ms;
    StreamConsumer consumer{endpoint(), options, handler};
    ASSERT_TRUE(consumer.acks_in_commit());

    xadd("orders", {{"order", "7"}});
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 1; }));
    EXPECT_EQ(consumer.stats().acked_in_commit, 1u);
    EXPECT_EQ(counter("effects:7"), 1);
    EXPECT_EQ(pending("orders"), 0);

    // The producer sends order 7 again: a duplicate, acked by the consumer, no second effect.
    xadd("orders", {{"order", "7"}});
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 2; }));
    EXPECT_EQ(consumer.stats().acked_in_commit, 1u);
    EXPECT_EQ(counter("effects:7"), 1);
    EXPECT_EQ(effect_runs, 1);
    EXPECT_EQ(pending("orders"), 0);

    const Fields poison{{"order", "8"}, {"kind", "poison"}};
    const std::string poison_id = xadd("orders", poison);
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().dead_lettered == 1; }));
    EXPECT_EQ(consumer.stats().acked_in_commit, 2u);  // the dead letter's commit acked it
    EXPECT_EQ(consumer.stats().acked, 3u);
    EXPECT_EQ(pending("orders"), 0);
    EXPECT_EQ(counter("effects:8"), 0);
    const auto letters = dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    expect_letter(letters[0], "attempt 2 (effect starts) reached max_deliveries 2",
                  {{"idem-scope", "count"},
                   {"idem-message-id", "8"},
                   {"idem-entry-id", poison_id},
                   {"idem-delivery-count", "2"}},
                  poison);
    ASSERT_EQ(store.dead_letters().size(), 1u);
}

// ---------------------------------------------------------------------------------------------
// 3. A slow but live holder

TEST_F(StreamConsumerTest, SlowLiveHolderIsNotDeadLetteredByRedeliveriesAndCompletesOnce) {
    idem::RedisStore store{endpoint(), store_options(5s)};
    idem::PolicyOptions policy;
    policy.max_deliveries = 3;
    std::atomic<int> effect_runs{0};
    std::atomic<bool> effect_started{false};
    std::atomic<bool> release{false};
    auto handler =
        idem::make_handler(store, idem::Policy{"slow", policy}, [&](auto& tx, const StreamEntry&) {
            ++effect_runs;
            effect_started = true;
            wait_for([&] { return release.load(); });
            tx.write("INCR", "slow:effects");
        });

    // A: configured as advised, lease (5 s) = visibility timeout (5 s); acks in its commit.
    auto a_options = fast_options("orders", "a");
    a_options.visibility_timeout = 5s;
    StreamConsumer a{endpoint(), a_options, handler};
    ASSERT_TRUE(a.acks_in_commit());

    // B: a peer whose visibility timeout (100 ms) is far below the lease, so it takes the entry
    // over again and again while A is still working within its lease — what a handler slower
    // than its p99, or a fleet with mismatched settings, looks like to the broker. The typed
    // constructor would refuse this pairing (lease > visibility timeout), so B wraps the same
    // handler in a plain std::function, which the consumer cannot check.
    std::vector<std::uint32_t> b_counts;
    std::vector<Disposition> b_outcomes;
    StreamConsumer b{endpoint(), fast_options("orders", "b"),
                     [&](const Delivery& d, const StreamEntry& e) {
                         Outcome outcome = handler.handle(d, e);
                         b_counts.push_back(d.delivery_count.value());
                         b_outcomes.push_back(outcome.disposition);
                         return outcome;
                     }};

    const std::string id = xadd("orders", {{"order", "1"}});
    std::atomic<bool> a_done{false};
    std::string a_error;
    std::thread worker([&] {
        try {
            a.poll_once();
        } catch (const std::exception& e) {
            a_error = e.what();
        }
        a_done = true;
    });
    ASSERT_TRUE(wait_for([&] { return effect_started.load(); }));
    // B redelivers until the broker's count is past max_deliveries (3).
    const bool redelivered =
        poll_until(b, [&] { return !b_counts.empty() && b_counts.back() > policy.max_deliveries; });
    release = true;
    worker.join();
    ASSERT_TRUE(redelivered);
    EXPECT_TRUE(a_error.empty()) << a_error;

    EXPECT_GE(b_counts.size(), 3u);
    for (Disposition d : b_outcomes)
        EXPECT_EQ(d, Disposition::in_progress);
    EXPECT_EQ(b.stats().acked, 0u);
    EXPECT_EQ(effect_runs.load(), 1);
    EXPECT_EQ(counter("slow:effects"), 1);
    EXPECT_EQ(a.stats().acked_in_commit, 1u);
    EXPECT_EQ(a.stats().dead_lettered, 0u);
    EXPECT_EQ(pending("orders"), 0);
    EXPECT_TRUE(xrange("orders:dead-letters").empty());
    EXPECT_TRUE(store.dead_letters().empty());
    EXPECT_EQ(store.attempts("slow", id), 1u);  // B's redeliveries never started the effect
    auto record = store.find_claim("slow", id);
    ASSERT_TRUE(record);
    EXPECT_EQ(record->disposition, Disposition::processed);

    // Acked: nothing comes back to B any more.
    const auto before = b_counts.size();
    const auto until = Clock::now() + 300ms;
    while (Clock::now() < until)
        b.poll_once();
    EXPECT_EQ(b_counts.size(), before);
}

// ---------------------------------------------------------------------------------------------
// 4. Malformed

TEST_F(StreamConsumerTest, EntryWithoutTheIdFieldIsDeadLetteredAsMalformedAndAcked) {
    idem::MemoryStore store;
    int effect_runs = 0;
    auto handler = idem::make_handler(store, idem::Policy{"orders"},
                                      [&](auto&, const StreamEntry&) { ++effect_runs; });
    auto options = fast_options("orders");
    options.id_field = "order";
    StreamConsumer consumer{endpoint(), options, handler};
    const Fields fields{{"customer", "9"}, {"amount", "3"}};
    const std::string id = xadd("orders", fields);
    xadd("orders", {{"order", "10"}});
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 2; }));
    EXPECT_EQ(effect_runs, 1);
    EXPECT_EQ(consumer.stats().dead_lettered, 1u);
    EXPECT_EQ(pending("orders"), 0);

    const auto letters = dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    expect_letter(letters[0], "empty message id", {{"idem-message-id", ""}, {"idem-entry-id", id}},
                  fields);
    ASSERT_EQ(store.dead_letters().size(), 1u);
}

// ---------------------------------------------------------------------------------------------
// 5. Hostile fields

Fields hostile_fields() {
    return {{std::string("nul\0name", 8), std::string("a\0b\0", 4)},
            {"quote", "say \"hi\" 'x' \\"},
            {"{braces}", "{\"json\": [1, 2]}"},
            {"with space", "  two  spaces "},
            {"bytes", std::string("\xff\xfe\x80", 3)},
            {"empty", ""},
            {"", "empty name"},
            {"quote", "a repeated name"}};
}

TEST_F(StreamConsumerTest, HostileFieldsRoundTripIntoTheHandlerAndTheDeadLetterStream) {
    const Fields fields = hostile_fields();
    std::vector<Fields> seen;
    StreamConsumer consumer{endpoint(), fast_options("orders"),
                            [&](const Delivery&, const StreamEntry& e) {
                                seen.push_back(e.fields);
                                return Outcome{Disposition::dead_lettered, "hostile"};
                            }};
    xadd("orders", fields);
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 1; }));
    ASSERT_EQ(seen.size(), 1u);
    EXPECT_EQ(seen[0], fields);
    const auto letters = dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    const auto& letter = letters[0];
    EXPECT_EQ(letter.meta.at("idem-reason"), "hostile");
    EXPECT_EQ(letter.meta.at("idem-scope"), "");  // a plain handler has no scope
    EXPECT_EQ(letter.original, fields);
    EXPECT_EQ(pending("orders"), 0);
}

TEST_F(StreamConsumerTest, HostileFieldsRoundTripThroughTheRedisStoreCommit) {
    const Fields fields = hostile_fields();
    idem::RedisStore store{endpoint(), store_options(100ms)};
    auto handler =
        idem::make_handler(store, idem::Policy{"hostile"}, [&](auto&, const StreamEntry& e) {
            EXPECT_EQ(e.fields, fields);
            throw idem::malformed_message("no schema fits");
        });
    StreamConsumer consumer{endpoint(), fast_options("orders"), handler};
    xadd("orders", fields);
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 1; }));
    EXPECT_EQ(consumer.stats().acked_in_commit, 1u);
    EXPECT_EQ(consumer.stats().dead_lettered, 1u);
    const auto letters = dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    expect_letter(letters[0], "no schema fits", {}, fields);

    const auto stored = store.dead_letters();
    ASSERT_EQ(stored.size(), 1u);
    StreamEntry entry{"orders", "", fields};
    EXPECT_EQ(stored[0].payload, idem::idem_payload(entry));
    for (char c : stored[0].payload) {  // plain ASCII whatever the bytes
        EXPECT_TRUE(static_cast<unsigned char>(c) >= 0x20 && static_cast<unsigned char>(c) < 0x7F)
            << stored[0].payload;
    }
    EXPECT_NE(stored[0].payload.find(R"(\u0000)"), std::string::npos);
    EXPECT_NE(stored[0].payload.find(R"(\u00ff)"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// 6. Batch mode: one handle_batch per poll, one round trip for the acks

/// The first batch of the batch-mode scenarios: orders 1 and 2 process, 3 throws on its first
/// attempt only, 4 always throws (poison at max_deliveries 3), order 1 again (a duplicate in the
/// same batch) and an entry without the id field (malformed).
struct FirstBatch {
    std::string one, two, flaky, poison, one_again, malformed;
};

const Fields poison_fields{{"order", "4"}, {"kind", "poison"}};
const Fields malformed_fields{{"customer", "9"}};

StreamConsumerOptions batch_options(std::chrono::milliseconds visibility_timeout) {
    auto options = fast_options("orders");
    options.id_field = "order";
    options.handle_in_batches = true;
    options.visibility_timeout = visibility_timeout;
    return options;
}

/// The effect's rule for an entry, shared by the batch scenarios.
void misbehave(const StreamEntry& e, int& flaky_runs) {
    if (e.field("kind") == std::string_view("poison")) throw std::runtime_error("cannot parse");
    if (e.field("kind") == std::string_view("flaky") && ++flaky_runs == 1) {
        throw std::runtime_error("gateway timeout");
    }
}

class StreamBatchTest : public StreamConsumerTest {
  protected:
    /// Connects the store's pooled connection and loads its claim and commit scripts, so the
    /// round trips counted next are the batch's own.
    static void warm_up(idem::RedisStore& store) {
        auto warm =
            idem::make_handler(store, idem::Policy{"warm-up"}, [](auto&, const std::string&) {});
        const auto outcomes = warm.handle_batch(std::vector<Delivery>{Delivery{"w", 1u}},
                                                std::vector<std::string>{"x"});
        ASSERT_EQ(outcomes.at(0).disposition, Disposition::processed);
    }

    FirstBatch add_first_batch() {
        FirstBatch b;
        b.one = xadd("orders", {{"order", "1"}});
        b.two = xadd("orders", {{"order", "2"}});
        b.flaky = xadd("orders", {{"order", "3"}, {"kind", "flaky"}});
        b.poison = xadd("orders", poison_fields);
        b.one_again = xadd("orders", {{"order", "1"}});
        b.malformed = xadd("orders", malformed_fields);
        return b;
    }

    /// After the first batch's poll: 6 read; 1, 2, the duplicate and the malformed entry acked
    /// (that one dead-lettered), the flaky and the poison entry pending; @p in_commit of the
    /// acks made in the store's commit.
    void expect_first_batch_done(const StreamConsumer& consumer, const FirstBatch& b,
                                 std::size_t in_commit) {
        EXPECT_EQ(pending_ids("orders"), (std::vector<std::string>{b.flaky, b.poison}));
        const auto stats = consumer.stats();
        EXPECT_EQ(stats.read, 6u);
        EXPECT_EQ(stats.acked, 4u);
        EXPECT_EQ(stats.dead_lettered, 1u);
        EXPECT_EQ(stats.not_acked, 2u);
        EXPECT_EQ(stats.acked_in_commit, in_commit);
    }

    /// The second batch: order 2 again (a duplicate across batches) and a new order 5.
    void add_second_batch() {
        xadd("orders", {{"order", "2"}});
        xadd("orders", {{"order", "5"}});
    }

    /// After the second batch is acked: 8 read, 3 reclaimed once and 4 twice (parked on its
    /// third delivery), nothing pending; @p in_commit acks in the store's commit in all.
    void expect_second_batch_done(const StreamConsumer& consumer, std::size_t in_commit) {
        const auto stats = consumer.stats();
        EXPECT_EQ(stats.read, 8u);
        EXPECT_EQ(stats.reclaimed, 3u);  // 3 once, 4 twice
        EXPECT_EQ(stats.dead_lettered, 2u);
        EXPECT_EQ(stats.not_acked, 3u);
        EXPECT_EQ(stats.acked_in_commit, in_commit);
        EXPECT_TRUE(pending_ids("orders").empty());
    }

    /// The dead-letter stream at the end: the malformed entry, then the poison one.
    void expect_dead_letters(const FirstBatch& b, const std::string& scope) {
        const auto letters = dead_letters();
        ASSERT_EQ(letters.size(), 2u);
        expect_letter(letters[0], "empty message id",
                      {{"idem-scope", scope},
                       {"idem-message-id", ""},
                       {"idem-entry-id", b.malformed},
                       {"idem-delivery-count", "1"}},
                      malformed_fields);
        expect_letter(letters[1], "max_deliveries",
                      {{"idem-scope", scope},
                       {"idem-message-id", "4"},
                       {"idem-entry-id", b.poison},
                       {"idem-delivery-count", "3"}},
                      poison_fields);
    }
};

TEST_F(StreamBatchTest, SqliteBatchIsOneHandleBatchAndTheConsumerAcksWithOneXack) {
    idem_test::TempDir dir;
    idem::SqliteStore store{dir.file("idem.db")};
    store.execute("CREATE TABLE effects(order_id TEXT NOT NULL)");
    idem::PolicyOptions policy;
    policy.max_deliveries = 3;
    int flaky_runs = 0;
    int effect_runs = 0;
    auto handler = idem::make_handler(
        store, idem::Policy{"capture", policy}, [&](auto& tx, const StreamEntry& e) {
            ++effect_runs;
            misbehave(e, flaky_runs);
            tx.execute("INSERT INTO effects(order_id) VALUES (?)", std::string(*e.field("order")));
        });
    StreamConsumer consumer{endpoint(), batch_options(100ms), handler};
    ASSERT_FALSE(consumer.acks_in_commit());
    auto effects = [&](const std::string& order) {
        return store.query_int("SELECT count(*) FROM effects WHERE order_id = ?", order).value();
    };

    const FirstBatch b = add_first_batch();
    client_->exec({"CONFIG", "RESETSTAT"});
    EXPECT_EQ(consumer.poll_once(), 6u);
    // One XACK for 1, 2 and the duplicate, pipelined with one dead-letter script (whose own XACK
    // the server counts too) for the malformed entry.
    EXPECT_EQ(command_calls("xack"), 2);
    EXPECT_EQ(command_calls("eval"), 1);
    expect_first_batch_done(consumer, b, 0);
    EXPECT_EQ(effects("1"), 1);
    EXPECT_EQ(effects("2"), 1);
    EXPECT_EQ(effects("3"), 0);  // its savepoint rolled back alone
    EXPECT_EQ(effect_runs, 4);   // 1, 2, 3, 4: the duplicate and the malformed entry never ran

    // Order 2 again (a duplicate across batches) and a new order 5; 3 and 4 come back after the
    // visibility timeout: 3 processes, 4 fails again and is parked on its third delivery.
    add_second_batch();
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 8; }));
    expect_second_batch_done(consumer, 0);
    for (const char* order : {"1", "2", "3", "5"})
        EXPECT_EQ(effects(order), 1) << "order " << order;
    EXPECT_EQ(effects("4"), 0);
    EXPECT_EQ(flaky_runs, 2);
    expect_dead_letters(b, "capture");
    EXPECT_EQ(store.dead_letters().size(), 2u);
}

TEST_F(StreamBatchTest, RedisStoreBatchCommitAcksWhatItCompletesAndParksItsDeadLetters) {
    idem::RedisStore store{endpoint(), store_options(300ms)};
    idem::PolicyOptions policy;
    policy.max_deliveries = 3;
    int flaky_runs = 0;
    int effect_runs = 0;
    auto handler = idem::make_handler(store, idem::Policy{"count", policy},
                                      [&](auto& tx, const StreamEntry& e) {
                                          ++effect_runs;
                                          misbehave(e, flaky_runs);
                                          count_order(tx, e);
                                      });
    StreamConsumer consumer{endpoint(), batch_options(300ms), handler};
    ASSERT_TRUE(consumer.acks_in_commit());

    warm_up(store);
    const FirstBatch b = add_first_batch();
    const std::size_t before = store.round_trips();
    EXPECT_EQ(consumer.poll_once(), 6u);
    // Failures and all: the claims pipelined, then one commit (the failed claims are freed in it).
    EXPECT_EQ(store.round_trips() - before, 2u);
    // 1, 2 and the malformed entry acked in the commit; the second copy of order 1 is a
    // duplicate, acked by the consumer.
    expect_first_batch_done(consumer, b, 3);
    EXPECT_EQ(counter("effects:1"), 1);
    EXPECT_EQ(counter("effects:2"), 1);
    EXPECT_EQ(counter("effects:3"), 0);
    EXPECT_EQ(effect_runs, 4);
    EXPECT_EQ(store.attempts("count", "3"), 1u);  // its lease was given back, the attempt kept
    EXPECT_FALSE(store.find_claim("count", "3"));

    add_second_batch();
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 8; }));
    // + 3 (second attempt), 4 (poison, parked in the commit) and 5 acked in the commit; the
    // second order 2 is a duplicate the consumer acks.
    expect_second_batch_done(consumer, 6);
    for (const char* order : {"1", "2", "3", "5"})
        EXPECT_EQ(counter(std::string("effects:") + order), 1) << "order " << order;
    EXPECT_EQ(counter("effects:4"), 0);
    EXPECT_EQ(flaky_runs, 2);
    expect_dead_letters(b, "count");
    EXPECT_EQ(store.dead_letters().size(), 2u);
    auto poison = store.find_claim("count", "4");
    ASSERT_TRUE(poison);
    EXPECT_EQ(poison->disposition, Disposition::dead_lettered);
}

TEST_F(StreamBatchTest, RedisStoreBatchOfNFreshEntriesCostsTwoStoreRoundTrips) {
    idem::RedisStore store{endpoint(), store_options(1s)};
    auto handler = idem::make_handler(store, idem::Policy{"count"}, count_order);
    auto options = batch_options(1s);
    options.batch_size = 32;
    StreamConsumer consumer{endpoint(), options, handler};

    warm_up(store);

    constexpr int n = 20;
    for (int i = 0; i < n; ++i)
        xadd("orders", {{"order", std::to_string(i)}});
    std::size_t before = store.round_trips();
    ASSERT_EQ(consumer.poll_once(), std::size_t{n});
    EXPECT_EQ(store.round_trips() - before, 2u);  // the claims pipelined, then the commit
    EXPECT_EQ(consumer.stats().acked_in_commit, std::size_t{n});
    EXPECT_EQ(consumer.stats().acked, std::size_t{n});
    EXPECT_EQ(pending("orders"), 0);
    for (int i = 0; i < n; ++i)
        EXPECT_EQ(counter("effects:" + std::to_string(i)), 1);

    // The same orders again: all duplicates. One round trip of claims, no commit; the consumer
    // acks them all with one XACK.
    for (int i = 0; i < n; ++i)
        xadd("orders", {{"order", std::to_string(i)}});
    before = store.round_trips();
    client_->exec({"CONFIG", "RESETSTAT"});
    ASSERT_EQ(consumer.poll_once(), std::size_t{n});
    EXPECT_EQ(store.round_trips() - before, 1u);
    EXPECT_EQ(command_calls("xack"), 1);
    EXPECT_EQ(consumer.stats().acked_in_commit, std::size_t{n});
    EXPECT_EQ(consumer.stats().acked, std::size_t{2 * n});
    EXPECT_EQ(pending("orders"), 0);
    for (int i = 0; i < n; ++i)
        EXPECT_EQ(counter("effects:" + std::to_string(i)), 1);
}

TEST_F(StreamBatchTest, RedisStoreBatchCommitParksEveryMalformedEntryOfTheBatch) {
    idem::RedisStore store{endpoint(), store_options(1s)};
    auto handler = idem::make_handler(store, idem::Policy{"count"}, count_order);
    StreamConsumer consumer{endpoint(), batch_options(1s), handler};
    // Entries without the id field all have the empty message id: the commit pairs its dead
    // letters with them in order.
    const std::string first = xadd("orders", {{"customer", "1"}});
    xadd("orders", {{"order", "1"}});
    const std::string second = xadd("orders", {{"customer", "2"}});
    ASSERT_EQ(consumer.poll_once(), 3u);
    EXPECT_EQ(consumer.stats().acked_in_commit, 3u);
    EXPECT_EQ(consumer.stats().dead_lettered, 2u);
    EXPECT_EQ(pending("orders"), 0);
    EXPECT_EQ(counter("effects:1"), 1);
    const auto letters = dead_letters();
    ASSERT_EQ(letters.size(), 2u);
    EXPECT_EQ(letters[0].meta.at("idem-entry-id"), first);
    EXPECT_EQ(letters[0].original, (Fields{{"customer", "1"}}));
    EXPECT_EQ(letters[1].meta.at("idem-entry-id"), second);
    EXPECT_EQ(letters[1].original, (Fields{{"customer", "2"}}));
}

TEST_F(StreamBatchTest, PlainHandlerIsCalledPerEntryAndItsAcksGoInOneRoundTrip) {
    std::vector<std::string> seen;
    auto options = fast_options("orders");
    options.handle_in_batches = true;
    StreamConsumer consumer{endpoint(), options, [&](const Delivery&, const StreamEntry& e) {
                                const std::string order(*e.field("order"));
                                seen.push_back(order);
                                if (order == "bad")
                                    return Outcome{Disposition::dead_lettered, "bad"};
                                if (order == "later")
                                    return Outcome{Disposition::deferred, "later"};
                                if (order == "boom") throw std::runtime_error("boom");
                                return Outcome{Disposition::processed, {}};
                            }};
    xadd("orders", {{"order", "1"}});
    const std::string later = xadd("orders", {{"order", "later"}});
    xadd("orders", {{"order", "bad"}});
    const std::string boom = xadd("orders", {{"order", "boom"}});
    xadd("orders", {{"order", "2"}});
    client_->exec({"CONFIG", "RESETSTAT"});
    EXPECT_EQ(consumer.poll_once(), 5u);
    EXPECT_EQ(seen, (std::vector<std::string>{"1", "later", "bad", "boom", "2"}));
    EXPECT_EQ(command_calls("xack"), 2);  // 1 and 2 together; the dead letter's script
    EXPECT_EQ(command_calls("eval"), 1);
    EXPECT_EQ(pending_ids("orders"), (std::vector<std::string>{later, boom}));
    const auto stats = consumer.stats();
    EXPECT_EQ(stats.acked, 3u);
    EXPECT_EQ(stats.dead_lettered, 1u);
    EXPECT_EQ(stats.not_acked, 2u);
    const auto letters = dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_EQ(letters[0].meta.at("idem-reason"), "bad");
}

TEST_F(StreamBatchTest, BatchSizeBoundsTheWholeBatch) {
    std::vector<std::string> seen;
    auto options = fast_options("orders");
    options.handle_in_batches = true;
    options.batch_size = 3;
    StreamConsumer consumer{endpoint(), options, [&](const Delivery&, const StreamEntry& e) {
                                seen.emplace_back(*e.field("order"));
                                return Outcome{Disposition::processed, {}};
                            }};
    for (int i = 1; i <= 5; ++i)
        xadd("orders", {{"order", std::to_string(i)}});
    EXPECT_EQ(consumer.poll_once(), 3u);
    EXPECT_EQ(consumer.poll_once(), 2u);
    EXPECT_EQ(seen, (std::vector<std::string>{"1", "2", "3", "4", "5"}));
    EXPECT_EQ(pending("orders"), 0);
}

TEST_F(StreamBatchTest, StopBeforeTheBatchLeavesItPending) {
    int calls = 0;
    auto options = fast_options("orders");
    options.handle_in_batches = true;
    StreamConsumer consumer{endpoint(), options, [&](const Delivery&, const StreamEntry&) {
                                ++calls;
                                return Outcome{Disposition::processed, {}};
                            }};
    xadd("orders", {{"order", "1"}});
    consumer.request_stop();
    EXPECT_EQ(consumer.poll_once(), 0u);
    EXPECT_EQ(calls, 0);
    EXPECT_EQ(consumer.stats().read, 0u);
}

// ---------------------------------------------------------------------------------------------
// 7. Graceful stop

TEST_F(StreamConsumerTest, RunReturnsSoonAfterRequestStop) {
    auto options = fast_options("orders");
    options.block = 300ms;
    StreamConsumer consumer{endpoint(), options, [](const Delivery&, const StreamEntry&) {
                                return Outcome{Disposition::processed, {}};
                            }};
    std::thread worker([&] { consumer.run(); });
    std::this_thread::sleep_for(100ms);  // let it reach a blocking read
    const auto asked = Clock::now();
    consumer.request_stop();
    worker.join();
    EXPECT_TRUE(consumer.stop_requested());
    EXPECT_LT(Clock::now() - asked, options.block + 1500ms);
    EXPECT_EQ(consumer.poll_once(), 0u);  // stopped: reads nothing
}

TEST_F(StreamConsumerTest, StopFinishesTheEntryInHandAndLeavesTheRestPending) {
    std::atomic<int> calls{0};
    std::atomic<bool> in_handler{false};
    std::atomic<bool> release{false};
    StreamConsumer consumer{endpoint(), fast_options("orders"),
                            [&](const Delivery&, const StreamEntry&) {
                                ++calls;
                                in_handler = true;
                                wait_for([&] { return release.load(); });
                                return Outcome{Disposition::processed, {}};
                            }};
    xadd("orders", {{"order", "1"}});
    xadd("orders", {{"order", "2"}});  // read in the same batch, never handled
    std::atomic<bool> returned{false};
    std::thread worker([&] {
        consumer.run();
        returned = true;
    });
    ASSERT_TRUE(wait_for([&] { return in_handler.load(); }));
    const auto asked = Clock::now();
    consumer.request_stop();
    std::this_thread::sleep_for(100ms);
    EXPECT_FALSE(returned.load()) << "run() must finish the entry in hand first";
    release = true;
    worker.join();
    EXPECT_LT(Clock::now() - asked, 2s);
    EXPECT_EQ(calls.load(), 1);
    EXPECT_EQ(consumer.stats().read, 2u);
    EXPECT_EQ(consumer.stats().acked, 1u);
    EXPECT_EQ(pending("orders"), 1);  // the second: taken over after the visibility timeout
}

// ---------------------------------------------------------------------------------------------
// 8. Redis restart

TEST(StreamConsumerRestart, NothingAckedWithoutAnOutcomeAndProcessingContinues) {
    IDEM_REQUIRE_REDIS();
    idem_test::RedisServer server;  // its own: this test kills it
    idem_test::RedisClient client = server.client();
    auto options = fast_options("orders");

    // poll_once(): the server dies while the handler works; the ack cannot be sent, so the entry
    // stays pending across the restart and comes back.
    std::vector<std::pair<std::string, std::uint32_t>> seen;
    StreamConsumer consumer{
        endpoint_of(server), options, [&](const Delivery& d, const StreamEntry& e) {
            seen.emplace_back(std::string(*e.field("order")), d.delivery_count.value());
            if (seen.size() == 1) server.kill9();
            return Outcome{Disposition::processed, {}};
        }};
    client.str({"XADD", "orders", "*", "order", "1"});
    EXPECT_THROW(consumer.poll_once(), idem::store_error);
    EXPECT_EQ(consumer.stats().connection_errors, 1u);
    EXPECT_EQ(consumer.stats().acked, 0u);
    EXPECT_THROW(consumer.poll_once(), idem::store_unavailable);  // still down
    server.start();
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 1; }));
    ASSERT_EQ(seen.size(), 2u);
    EXPECT_EQ(seen[1].first, "1");
    EXPECT_GE(seen[1].second, 2u);  // a redelivery, not a new read
    EXPECT_EQ(client.array({"XPENDING", "orders", "workers"}).at(0), "0");

    // run(): keeps going through a crash and a restart.
    std::mutex mutex;
    std::vector<std::string> handled;
    StreamConsumer runner{endpoint_of(server), fast_options("orders", "c2"),
                          [&](const Delivery&, const StreamEntry& e) {
                              std::lock_guard<std::mutex> lock(mutex);
                              handled.emplace_back(*e.field("order"));
                              return Outcome{Disposition::processed, {}};
                          }};
    auto handled_count = [&] {
        std::lock_guard<std::mutex> lock(mutex);
        return handled.size();
    };
    std::thread worker([&] { runner.run(); });
    client.str({"XADD", "orders", "*", "order", "2"});
    ASSERT_TRUE(wait_for([&] { return handled_count() == 1; }));
    server.kill9();
    ASSERT_TRUE(wait_for([&] { return runner.stats().connection_errors >= 2; }));
    server.start();
    client.str({"XADD", "orders", "*", "order", "3"});
    const bool continued = wait_for([&] { return handled_count() == 2; });
    runner.request_stop();
    worker.join();
    ASSERT_TRUE(continued);
    EXPECT_EQ(handled, (std::vector<std::string>{"2", "3"}));
    EXPECT_EQ(runner.stats().acked, 2u);
    EXPECT_EQ(client.array({"XPENDING", "orders", "workers"}).at(0), "0");
}

// ---------------------------------------------------------------------------------------------
// Issue 11: a store outage must not dead-letter healthy messages; a duplicate of a parked
// message still reaches the dead-letter stream

/// Holds SQLite's write lock from another connection (BEGIN EXCLUSIVE): every BEGIN IMMEDIATE of
/// the store fails with SQLITE_BUSY after its busy timeout (store_timeout) until release().
class SqliteWriteLock {
  public:
    explicit SqliteWriteLock(const std::string& path) {
        if (sqlite3_open(path.c_str(), &db_) != SQLITE_OK) throw std::runtime_error("open");
        exec("BEGIN EXCLUSIVE");
    }
    ~SqliteWriteLock() {
        release();
        sqlite3_close(db_);
    }
    SqliteWriteLock(const SqliteWriteLock&) = delete;
    SqliteWriteLock& operator=(const SqliteWriteLock&) = delete;
    void release() {
        if (held_) exec("ROLLBACK");
        held_ = false;
    }

  private:
    void exec(const char* sql) {
        char* error = nullptr;
        if (sqlite3_exec(db_, sql, nullptr, nullptr, &error) != SQLITE_OK) {
            const std::string what = error != nullptr ? error : "?";
            sqlite3_free(error);
            throw std::runtime_error(what);
        }
    }
    sqlite3* db_ = nullptr;
    bool held_ = true;
};

class StoreOutageTest : public StreamConsumerTest {
  protected:
    void run_outage(bool in_batches);
};

TEST_F(StoreOutageTest, DoesNotDeadLetterHealthyMessages) {
    run_outage(false);
}
TEST_F(StoreOutageTest, DoesNotDeadLetterHealthyMessagesInBatchMode) {
    run_outage(true);
}

void StoreOutageTest::run_outage(bool in_batches) {
    idem_test::TempDir dir;
    const std::string path = dir.file("idem.db");
    idem::SqliteOptions sqlite;
    sqlite.busy_timeout = 20ms;  // each attempt against the locked database fails fast
    idem::SqliteStore store{path, sqlite};
    {
        auto tx = store.begin();
        tx.execute("CREATE TABLE captures(order_id TEXT PRIMARY KEY)");
        tx.commit();
    }
    idem::PolicyOptions policy;
    policy.max_deliveries = 5;
    std::mutex mutex;
    std::uint32_t highest_count = 0;
    auto handler = idem::make_handler(
        store, idem::Policy{"capture", policy},
        [&](auto& tx, const StreamEntry& e, const Delivery& d) {
            tx.execute("INSERT INTO captures VALUES (?)", std::string(*e.field("order")));
            std::lock_guard<std::mutex> lock(mutex);
            highest_count = std::max(highest_count, d.delivery_count.value());
        });
    auto options = fast_options("orders");
    options.visibility_timeout = 20ms;  // the broker redelivers fast
    options.block = 20ms;
    options.circuit_breaker.initial_backoff = 20ms;
    options.circuit_breaker.max_backoff = 100ms;
    options.handle_in_batches = in_batches;
    constexpr int messages = 6;
    for (int i = 0; i < messages; ++i)
        xadd("orders", {{"order", std::to_string(i)}});

    auto lock = std::make_unique<SqliteWriteLock>(path);  // the store is down
    StreamConsumer consumer{endpoint(), options, handler};
    std::thread worker([&] { consumer.run(); });
    // Long enough for dozens of redeliveries at a 20 ms visibility timeout without the breaker.
    if (!wait_for([&] { return consumer.stats().not_acked >= 1; })) {
        consumer.request_stop();
        worker.join();
        FAIL() << "the locked store never failed a delivery";
    }
    std::this_thread::sleep_for(1500ms);
    const auto during = consumer.stats();
    lock->release();  // the store is back

    const bool done = wait_for([&] { return consumer.stats().acked >= messages; });
    consumer.request_stop();
    worker.join();
    ASSERT_TRUE(done) << "acked " << consumer.stats().acked;

    EXPECT_TRUE(store.dead_letters().empty());
    EXPECT_TRUE(dead_letters().empty());
    EXPECT_EQ(consumer.stats().dead_lettered, 0u);
    EXPECT_EQ(pending("orders"), 0);
    {
        auto tx = store.begin();
        EXPECT_EQ(tx.query_int("SELECT COUNT(*) FROM captures"), messages);  // each once
    }
    EXPECT_GE(during.circuit_opened, 1u);
    EXPECT_GE(during.store_probes, 1u);
    EXPECT_LE(during.not_acked, in_batches ? std::size_t{messages} : 3u)
        << "kept reading while the store was down";
    std::lock_guard<std::mutex> guard(mutex);
    EXPECT_LT(highest_count, policy.max_deliveries);
}

TEST_F(StreamConsumerTest, PlainHandlerThrowingStoreUnavailablePausesTheConsumer) {
    int calls = 0;
    int probes = 0;
    auto options = fast_options("orders");
    options.circuit_breaker.initial_backoff = 20ms;
    options.circuit_breaker.max_backoff = 20ms;
    options.store_probe = [&] {
        if (++probes < 3) throw idem::store_unavailable("still down");
    };
    StreamConsumer consumer{endpoint(), options, [&](const Delivery&, const StreamEntry&) {
                                if (++calls == 1) throw idem::store_unavailable("db down");
                                return Outcome{Disposition::processed, {}};
                            }};
    xadd("orders", {{"order", "1"}});
    xadd("orders", {{"order", "2"}});
    EXPECT_EQ(consumer.poll_once(), 1u);  // the first fails: the second stays pending
    EXPECT_EQ(consumer.stats().circuit_opened, 1u);
    EXPECT_EQ(pending("orders"), 2);
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 2; }));
    EXPECT_EQ(probes, 3);
    EXPECT_EQ(consumer.stats().store_probes, 3u);
}

TEST_F(StreamConsumerTest, DuplicateOfAParkedMessageStillReachesTheDeadLetterStream) {
    idem_test::TempDir dir;
    idem::SqliteStore store{dir.file("idem.db")};
    idem::PolicyOptions policy;
    policy.max_deliveries = 2;
    int runs = 0;
    auto handler = idem::make_handler(store, idem::Policy{"capture", policy},
                                      [&](auto&, const StreamEntry&) { ++runs; });
    auto options = fast_options("orders");
    StreamConsumer consumer{endpoint(), options, handler};
    ASSERT_FALSE(consumer.acks_in_commit());
    const Fields fields{{"order", "42"}};
    const std::string id = xadd("orders", fields);

    // The crash window: a worker read the entry (pending), its handler committed the park ...
    idem::RedisConnection connection{endpoint()};
    connection.checked({"XGROUP", "CREATE", "orders", "workers", "0", "MKSTREAM"}, "XGROUP");
    connection.checked(
        {"XREADGROUP", "GROUP", "workers", "c0", "COUNT", "1", "STREAMS", "orders", ">"},
        "XREADGROUP");
    StreamEntry entry{"orders", id, fields};
    const auto parked = handler.handle(Delivery{id, 2u}, entry);
    ASSERT_EQ(parked.disposition, Disposition::dead_lettered);
    // ... and died before its XADD to the dead-letter stream and its XACK.
    ASSERT_TRUE(dead_letters().empty());

    // The redelivery is a duplicate of the parked message: routed to dead letters, then acked.
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 1; }));
    EXPECT_EQ(pending("orders"), 0);
    EXPECT_EQ(consumer.stats().dead_lettered, 1u);
    for (int i = 0; i < 3; ++i)
        consumer.poll_once();
    const auto letters = dead_letters();
    ASSERT_EQ(letters.size(), 1u);  // exactly once
    expect_letter(letters[0], "dead_lettered",
                  {{"idem-scope", "capture"}, {"idem-message-id", id}, {"idem-entry-id", id}},
                  fields);
    EXPECT_EQ(runs, 0);
    EXPECT_EQ(store.dead_letters().size(), 1u);
}

}  // namespace
