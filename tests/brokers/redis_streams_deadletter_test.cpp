// idem::RedisStreamConsumer's dead letters against a real redis-server: true delivery counts
// through XAUTOCLAIM + XPENDING, poison and malformed entries, hostile fields, and a store
// outage that must not dead-letter healthy messages.

#include "support/redis_streams_test_env.hpp"

namespace idem_test::redis_streams {
namespace {

// ---------------------------------------------------------------------------------------------
// 1. Delivery counts

TEST_F(StreamConsumerTest, ReclaimedEntryCarriesTheTrueDeliveryCount) {
    std::vector<std::uint32_t> seen;
    RedisStreamConsumer consumer{endpoint(), fast_options("orders"),
                                 [&](const Delivery& d, const StreamEntry&) {
                                     seen.push_back(d.delivery_count.value());
                                     return Outcome{Disposition::failed, "not yet"};
                                 }};
    const std::string id = xadd("orders", {{"order", "1"}});
    ASSERT_TRUE(poll_until(consumer, [&] { return seen.size() >= 4; }));
    EXPECT_EQ(seen, (std::vector<std::uint32_t>{1, 2, 3, 4}));
    const auto stats = consumer.stats();
    EXPECT_EQ(stats.read, 1u);
    EXPECT_EQ(stats.redelivered, 3u);
    EXPECT_EQ(stats.not_acked, 4u);
    EXPECT_EQ(stats.acked, 0u);
    EXPECT_EQ(pending("orders"), 1);  // failed: never acked
}

TEST_F(StreamConsumerTest, PoisonReachesTheDeadLetterStreamAtMaxDeliveriesAndIsAcked) {
    idem::testing::TempDir dir;
    idem::SqliteStore store{dir.file("idem.db")};
    idem::PolicyOptions policy;
    policy.max_deliveries = 5;
    std::vector<std::uint32_t> effect_counts;
    auto handler = idem::make_handler(store, idem::Policy{"capture", policy},
                                      [&](auto&, const StreamEntry&, const Delivery& d) {
                                          effect_counts.push_back(d.delivery_count.value());
                                          throw std::runtime_error("gateway down");
                                      });
    RedisStreamConsumer consumer{endpoint(), fast_options("orders"), handler};
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
                   {"idem-original-stream", "orders"},
                   {"idem-original-entry-id", id},
                   {"idem-delivery-count", "5"}},
                  fields);

    const auto stored = store.dead_letters();  // the store keeps its own copy
    ASSERT_EQ(stored.size(), 1u);
    EXPECT_EQ(stored[0].payload, R"([["order","42"],["amount","12.50"]])");
    expect_same_failures(letters[0], stored[0], "gateway down");
}

// The copy the RedisStore's commit writes (the commit hook) says how the effect failed, as the
// store's own entry does.
TEST_F(StreamConsumerTest, TheCommitsDeadLetterCopySaysHowTheEffectFailed) {
    idem::RedisStore store{endpoint(), store_options(100ms)};
    idem::PolicyOptions policy;
    policy.max_deliveries = 3;
    auto handler = idem::make_handler(
        store, idem::Policy{"capture", policy},
        [&](auto&, const StreamEntry&) -> void { throw std::runtime_error("gateway 503"); });
    RedisStreamConsumer consumer{endpoint(), fast_options("orders"), handler};
    ASSERT_TRUE(consumer.acks_in_commit());
    const Fields fields{{"order", "9"}};
    xadd("orders", fields);
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().dead_lettered == 1; }));
    EXPECT_EQ(consumer.stats().acked_in_commit, 1u);
    const auto letters = dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    const auto stored = store.dead_letters();
    ASSERT_EQ(stored.size(), 1u);
    expect_same_failures(letters[0], stored[0], "gateway 503");
}

TEST_F(StreamConsumerTest, HealthReportsPendingEntriesAndTheDeadLetterDepth) {
    idem::MemoryStore store;
    idem::PolicyOptions policy;
    policy.max_deliveries = 2;
    auto handler = idem::make_handler(store, idem::Policy{"capture", policy},
                                      [&](auto&, const StreamEntry& e) {
                                          if (e.field("poison")) throw std::runtime_error("bad");
                                      });
    std::vector<std::pair<std::uint64_t, std::uint64_t>> reports;  // (pending, depth)
    std::string named;
    bool circuit_open = true;
    auto options = fast_options("orders");
    options.health_interval = std::chrono::milliseconds(0);
    options.on_health = [&](const idem::ConsumerHealth& h) {
        named = std::string(h.consumer) + " -> " + std::string(h.dead_letter_destination);
        circuit_open = h.circuit_open;
        reports.emplace_back(h.pending.value_or(999), h.dead_letter_depth.value_or(999));
    };
    RedisStreamConsumer consumer{endpoint(), options, handler};
    xadd("orders", {{"poison", "1"}});
    ASSERT_TRUE(poll_until(consumer, [&] { return !reports.empty(); }));
    EXPECT_EQ(reports.front(),
              std::make_pair(std::uint64_t{1}, std::uint64_t{0}));  // held, 0 parked
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().dead_lettered == 1; }));
    consumer.poll_once();
    EXPECT_EQ(reports.back(), std::make_pair(std::uint64_t{0}, std::uint64_t{1}));  // parked
    EXPECT_EQ(named, "orders/" + options.group + " -> orders.dead-letters");
    EXPECT_FALSE(circuit_open);
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
    RedisStreamConsumer consumer{endpoint(), options, handler};
    const Fields fields{{"customer", "9"}, {"amount", "3"}};
    const std::string id = xadd("orders", fields);
    xadd("orders", {{"order", "10"}});
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 2; }));
    EXPECT_EQ(effect_runs, 1);
    EXPECT_EQ(consumer.stats().dead_lettered, 1u);
    EXPECT_EQ(pending("orders"), 0);

    const auto letters = dead_letters();
    ASSERT_EQ(letters.size(), 1u);
    expect_letter(letters[0], "empty message id",
                  {{"idem-message-id", ""}, {"idem-original-entry-id", id}}, fields);
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
    RedisStreamConsumer consumer{endpoint(), fast_options("orders"),
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
    RedisStreamConsumer consumer{endpoint(), fast_options("orders"), handler};
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

// The consumer's own dead-letter copy goes through the policy's redactor like the store's: on a
// store whose consumer writes the dead-letter stream (memory) and on one whose commit does
// (RedisStore, the commit hook).
TEST_F(StreamConsumerTest, TheDeadLetterStreamKeepsOnlyTheRedactedFields) {
    const Fields fields{{"order", "7"}, {"card", "4111 1111 1111 1111"}};
    idem::PolicyOptions policy;
    policy.redact_payload = idem::mask_card_numbers;
    auto reject = [](auto&, const StreamEntry& e) -> void {
        throw idem::malformed_message("card " + std::string(*e.field("card")) + " refused");
    };
    auto check = [&](const std::string& where) {
        const auto letters = dead_letters();
        ASSERT_EQ(letters.size(), 1u) << where;
        const std::string reason = letters[0].meta.at("idem-reason");
        EXPECT_EQ(reason.find("4111 1111 1111 1111"), std::string::npos) << where << ": " << reason;
        EXPECT_NE(reason.find("card **** **** **** 1111 refused"), std::string::npos)
            << where << ": " << reason;  // redacted once
        ASSERT_EQ(letters[0].original.size(), 2u) << where;
        EXPECT_EQ(letters[0].original[0], fields[0]) << where;
        EXPECT_EQ(letters[0].original[1].second.find("1111 1111"), std::string::npos)
            << where << ": " << letters[0].original[1].second;
    };
    {
        idem::MemoryStore store;
        auto handler = idem::make_handler(store, idem::Policy{"capture", policy}, reject);
        RedisStreamConsumer consumer{endpoint(), fast_options("orders"), handler};
        xadd("orders", fields);
        ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().dead_lettered == 1; }));
        EXPECT_EQ(consumer.stats().acked_in_commit, 0u);
        check("memory store, the consumer's copy");
    }
    server_->flushall();
    {
        idem::RedisStore store{endpoint(), store_options(100ms)};
        auto handler = idem::make_handler(store, idem::Policy{"capture", policy}, reject);
        RedisStreamConsumer consumer{endpoint(), fast_options("orders"), handler};
        xadd("orders", fields);
        ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().dead_lettered == 1; }));
        EXPECT_EQ(consumer.stats().acked_in_commit, 1u);
        check("RedisStore, the commit's copy");
    }
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
    idem::testing::TempDir dir;
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
    options.poll_wait = 20ms;
    options.circuit_breaker.initial_backoff = 20ms;
    options.circuit_breaker.max_backoff = 100ms;
    options.handle_in_batches = in_batches;
    constexpr int messages = 6;
    for (int i = 0; i < messages; ++i)
        xadd("orders", {{"order", std::to_string(i)}});

    auto lock = std::make_unique<SqliteWriteLock>(path);  // the store is down
    RedisStreamConsumer consumer{endpoint(), options, handler};
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
    RedisStreamConsumer consumer{endpoint(), options, [&](const Delivery&, const StreamEntry&) {
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
    idem::testing::TempDir dir;
    idem::SqliteStore store{dir.file("idem.db")};
    idem::PolicyOptions policy;
    policy.max_deliveries = 2;
    int runs = 0;
    auto handler = idem::make_handler(store, idem::Policy{"capture", policy},
                                      [&](auto&, const StreamEntry&) { ++runs; });
    auto options = fast_options("orders");
    RedisStreamConsumer consumer{endpoint(), options, handler};
    ASSERT_FALSE(consumer.acks_in_commit());
    const Fields fields{{"order", "42"}};
    const std::string id = xadd("orders", fields);

    // The crash window: a worker read the entry (pending), its handler committed the park ...
    idem::redis::Connection connection{endpoint()};
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
    expect_letter(
        letters[0], "dead_lettered",
        {{"idem-scope", "capture"}, {"idem-message-id", id}, {"idem-original-entry-id", id}},
        fields);
    EXPECT_EQ(runs, 0);
    EXPECT_EQ(store.dead_letters().size(), 1u);
}

}  // namespace
}  // namespace idem_test::redis_streams
