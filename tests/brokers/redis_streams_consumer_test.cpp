// idem::RedisStreamConsumer against a real redis-server: options, failed handlers, deleted
// entries and streams, the ack inside a RedisStore commit, a slow but live lease holder, a
// graceful stop and a server restart.

#include "support/redis_streams_test_env.hpp"
#include "support/refusing_dependency.hpp"

namespace idem_test::redis_streams {
namespace {

// ---------------------------------------------------------------------------------------------
// Options

TEST(RedisStreamConsumerOptions, InvalidOptionsAreRefusedWithTheReason) {
    auto handler = [](const Delivery&, const StreamEntry&) { return Outcome{}; };
    auto refused = [&](RedisStreamConsumerOptions options, const std::string& says,
                       idem::RedisEndpoint endpoint = {}) {
        try {
            RedisStreamConsumer consumer{endpoint, std::move(options), handler};
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
    o.poll_wait = 0ms;
    refused(o, "poll_wait must be positive");
    o = base;
    o.visibility_timeout = 0ms;
    refused(o, "visibility_timeout must be positive");
    o = base;
    o.dead_letter = "orders";
    refused(o, "dead_letter is the stream itself");
    o = base;
    o.poll_wait = 6000ms;
    refused(o, "shorter than the endpoint's command_timeout (5000 ms)");

    EXPECT_THROW(RedisStreamConsumer(idem::RedisEndpoint{}, base, RedisStreamConsumer::Handler{}),
                 idem::usage_error);
    RedisStreamConsumer consumer{idem::RedisEndpoint{}, base, handler};
    EXPECT_EQ(consumer.options().dead_letter, "orders.dead-letters");
    EXPECT_FALSE(consumer.acks_in_commit());
}

TEST(RedisStreamConsumerOptions, LeaseLongerThanTheVisibilityTimeoutIsRefusedNamingBoth) {
    const idem::RedisEndpoint endpoint;  // nothing connects before the first poll
    idem::RedisStore store{endpoint};    // default lease 30 s
    auto handler =
        idem::make_handler(store, idem::Policy{"capture"}, [](auto&, const StreamEntry&) {});
    auto options = fast_options("orders");
    options.visibility_timeout = 200ms;
    try {
        RedisStreamConsumer consumer{endpoint, options, handler};
        FAIL() << "a 30 s lease against a 200 ms visibility timeout must be refused";
    } catch (const idem::usage_error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("30000 ms"), std::string::npos) << what;
        EXPECT_NE(what.find("200 ms"), std::string::npos) << what;
        EXPECT_NE(what.find("p99"), std::string::npos) << what;
    }
    options.visibility_timeout = 30s;
    RedisStreamConsumer consumer{endpoint, options, handler};
    EXPECT_TRUE(consumer.acks_in_commit());

    idem::RedisEndpoint other = endpoint;
    other.db = 1;  // another database: the commit cannot include the ack
    RedisStreamConsumer elsewhere{other, options, handler};
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
    RedisStreamConsumer consumer{endpoint(), fast_options("orders"),
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

// A dependency that refuses for a few seconds (a gateway's key "in flight", a service
// restarting) must not park a healthy message: with the default backoff its redeliveries wait
// 2 s, 4 s ... (less up to 20 %), so four deliveries cover about 14 s. Without it they came
// every visibility timeout (200 ms), and the 4th was parked within a second.
TEST_F(StreamConsumerTest, ADependencyRefusingForThreeSecondsDoesNotParkTheMessage) {
    idem::testing::TempDir dir;
    idem::SqliteStore store{dir.file("idem.db")};
    idem_test::RefusingDependency gateway{3s};
    auto handler = gateway.handler<StreamEntry>(store);
    auto options = fast_options("orders");
    options.visibility_timeout = 200ms;
    options.redelivery_backoff = idem::RedeliveryBackoff{};  // the defaults
    RedisStreamConsumer consumer{endpoint(), options, handler};
    xadd("orders", {{"order", "1"}});

    ASSERT_TRUE(poll_until(
        consumer, [&] { return consumer.stats().acked == 1; }, 30s));
    EXPECT_EQ(consumer.stats().dead_lettered, 0u);
    EXPECT_TRUE(dead_letters().empty());
    ASSERT_EQ(store.find_claim("capture", xrange("orders").at(0).id)->disposition,
              Disposition::processed);
    gateway.expect_spaced_by_the_default_backoff();
}

// A held-back entry is skipped, not claimed: its count does not grow while it waits, and an
// entry behind it that is due is taken over meanwhile.
TEST_F(StreamConsumerTest, AHeldBackEntryKeepsItsCountWhileAnotherIsTakenOver) {
    std::map<std::string, std::vector<std::uint32_t>> counts;
    auto options = fast_options("orders");
    options.redelivery_backoff.initial = 60s;  // "slow" waits a minute after its failure
    options.redelivery_backoff.max = 60s;
    options.redelivery_backoff.jitter = 0.0;
    RedisStreamConsumer slow_consumer{
        endpoint(), options, [&](const Delivery& d, const StreamEntry& e) {
            counts[std::string(*e.field("order"))].push_back(d.delivery_count.value());
            return Outcome{Disposition::failed, "refused"};
        }};
    xadd("orders", {{"order", "slow"}});
    ASSERT_TRUE(poll_until(slow_consumer, [&] { return counts["slow"].size() == 1; }));

    auto fast = fast_options("orders");  // another consumer of the group, without a backoff
    fast.consumer = "c2";
    RedisStreamConsumer fast_consumer{
        endpoint(), fast, [&](const Delivery& d, const StreamEntry& e) {
            counts[std::string(*e.field("order"))].push_back(d.delivery_count.value());
            return Outcome{Disposition::processed, ""};
        }};
    // The slow consumer's wait is its own: with it, "slow" stays pending, its count 1.
    const auto until = Clock::now() + 500ms;  // five visibility timeouts
    while (Clock::now() < until)
        slow_consumer.poll_once();
    EXPECT_EQ(counts["slow"], (std::vector<std::uint32_t>{1}));
    EXPECT_EQ(slow_consumer.stats().redelivered, 0u);
    EXPECT_EQ(pending("orders"), 1);
    // The other consumer, without a backoff, takes it over at once: delivery 2.
    ASSERT_TRUE(poll_until(fast_consumer, [&] { return counts["slow"].size() == 2; }));
    EXPECT_EQ(counts["slow"], (std::vector<std::uint32_t>{1, 2}));
    EXPECT_EQ(pending("orders"), 0);
}

// A failed entry is due after its backoff (300 ms), not after the visibility timeout (10 s):
// the consumer that saw it fail moves its idle time forward. One at a time and in batch mode.
void expect_failed_entry_due_after_its_backoff(const idem::RedisEndpoint& endpoint,
                                               const std::function<void()>& publish,
                                               bool in_batches) {
    auto options = fast_options("orders");
    options.visibility_timeout = 10s;
    options.handle_in_batches = in_batches;
    options.redelivery_backoff.initial = 300ms;
    options.redelivery_backoff.max = 300ms;
    options.redelivery_backoff.jitter = 0.0;
    std::vector<std::pair<std::uint32_t, Clock::time_point>> seen;
    RedisStreamConsumer consumer{endpoint, options, [&](const Delivery& d, const StreamEntry&) {
                                     seen.emplace_back(d.delivery_count.value(), Clock::now());
                                     return seen.size() == 1 ? Outcome{Disposition::failed, "503"}
                                                             : Outcome{Disposition::processed, ""};
                                 }};
    publish();
    ASSERT_TRUE(poll_until(
        consumer, [&] { return seen.size() == 2; }, 8s));
    EXPECT_EQ(seen[0].first, 1u);
    EXPECT_EQ(seen[1].first, 2u);  // the count kept (JUSTID), then the take-over's
    EXPECT_GE(seen[1].second - seen[0].second, 250ms);
    EXPECT_EQ(consumer.stats().acked, 1u);
}

TEST_F(StreamConsumerTest, AFailedEntryIsDueAfterItsBackoffNotAfterTheVisibilityTimeout) {
    expect_failed_entry_due_after_its_backoff(
        endpoint(),
        [&] {
            xadd("orders", {{"order", "1"}});
        },
        /*in_batches=*/false);
}

TEST_F(StreamConsumerTest, AFailedEntryIsDueAfterItsBackoffInBatchModeToo) {
    expect_failed_entry_due_after_its_backoff(
        endpoint(),
        [&] {
            xadd("orders", {{"order", "1"}});
        },
        /*in_batches=*/true);
}

TEST(RedeliveryBackoffOptions, AStreamConsumerRefusesABackoffThatCannotWork) {
    RedisStreamConsumerOptions options = fast_options("orders");
    options.redelivery_backoff.multiplier = 0.5;
    try {
        RedisStreamConsumer consumer{idem::RedisEndpoint{}, options,
                                     [](const Delivery&, const StreamEntry&) { return Outcome{}; }};
        FAIL() << "accepted a shrinking backoff";
    } catch (const idem::usage_error& e) {
        EXPECT_NE(std::string(e.what()).find("redelivery_backoff: multiplier"), std::string::npos)
            << e.what();
    }
}

TEST_F(StreamConsumerTest, PendingEntryDeletedFromTheStreamIsSkipped) {
    int calls = 0;
    RedisStreamConsumer consumer{endpoint(), fast_options("orders"),
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
    EXPECT_EQ(consumer.stats().redelivered, 0u);
    EXPECT_EQ(pending("orders"), 0);
}

TEST_F(StreamConsumerTest, GroupIsCreatedAgainWhenTheStreamWasDeleted) {
    std::vector<std::string> handled;
    RedisStreamConsumer consumer{endpoint(), fast_options("orders"),
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
    RedisStreamConsumer consumer{endpoint(), options, handler};
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
    expect_letter(
        letters[0],
        "attempt 2 (claims taken to run the effect, the store's count) reached max_deliveries 2",
        {{"idem-scope", "count"},
         {"idem-message-id", "8"},
         {"idem-original-entry-id", poison_id},
         {"idem-delivery-count", "2"}},
        poison);
    const auto kept = store.dead_letters();
    ASSERT_EQ(kept.size(), 1u);
    EXPECT_EQ(kept[0].origin, "orders") << "the stream: where a redrive sends it back";
    EXPECT_EQ(kept[0].origin_position, poison_id);
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
    RedisStreamConsumer a{endpoint(), a_options, handler};
    ASSERT_TRUE(a.acks_in_commit());

    // B: a peer whose visibility timeout (100 ms) is far below the lease, so it takes the entry
    // over again and again while A is still working within its lease — what a handler slower
    // than its p99, or a fleet with mismatched settings, looks like to the broker. The typed
    // constructor would refuse this pairing (lease > visibility timeout), so B wraps the same
    // handler in a plain std::function, which the consumer cannot check.
    std::vector<std::uint32_t> b_counts;
    std::vector<Disposition> b_outcomes;
    RedisStreamConsumer b{endpoint(), fast_options("orders", "b"),
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
    EXPECT_TRUE(xrange("orders.dead-letters").empty());
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
// 7. Graceful stop

TEST_F(StreamConsumerTest, RunReturnsSoonAfterRequestStop) {
    auto options = fast_options("orders");
    options.poll_wait = 300ms;
    RedisStreamConsumer consumer{endpoint(), options, [](const Delivery&, const StreamEntry&) {
                                     return Outcome{Disposition::processed, {}};
                                 }};
    std::thread worker([&] { consumer.run(); });
    std::this_thread::sleep_for(100ms);  // let it reach a blocking read
    const auto asked = Clock::now();
    consumer.request_stop();
    worker.join();
    EXPECT_TRUE(consumer.stop_requested());
    EXPECT_LT(Clock::now() - asked, options.poll_wait + 1500ms);
    EXPECT_EQ(consumer.poll_once(), 0u);  // stopped: reads nothing
}

TEST_F(StreamConsumerTest, StopFinishesTheEntryInHandAndLeavesTheRestPending) {
    std::atomic<int> calls{0};
    std::atomic<bool> in_handler{false};
    std::atomic<bool> release{false};
    RedisStreamConsumer consumer{endpoint(), fast_options("orders"),
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
    EXPECT_EQ(consumer.stats().read, 1u);  // handed to the handler: the second never was
    EXPECT_EQ(consumer.stats().acked, 1u);
    EXPECT_EQ(pending("orders"), 1);  // the second: taken over after the visibility timeout
}

// ---------------------------------------------------------------------------------------------
// 8. Redis restart

TEST(StreamConsumerRestart, NothingAckedWithoutAnOutcomeAndProcessingContinues) {
    IDEM_REQUIRE_REDIS();
    idem::testing::RedisServer server;  // its own: this test kills it
    idem::testing::RedisClient client = server.client();
    auto options = fast_options("orders");

    // poll_once(): the server dies while the handler works; the ack cannot be sent, so the entry
    // stays pending across the restart and comes back.
    std::vector<std::pair<std::string, std::uint32_t>> seen;
    RedisStreamConsumer consumer{
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
    RedisStreamConsumer runner{endpoint_of(server), fast_options("orders", "c2"),
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
    // Killed once order 2's XACK is through (appendfsync always: it survives). Killed as soon as
    // the handler returned, the XACK could still be unsent, and order 2 would rightly come back
    // after the restart: handled 1 -> 3 in one poll under a slow (sanitizer) build.
    ASSERT_TRUE(wait_for([&] { return runner.stats().acked == 1; }));
    server.kill9();
    ASSERT_TRUE(wait_for([&] { return runner.stats().connection_errors >= 2; }));
    server.start();
    client.str({"XADD", "orders", "*", "order", "3"});
    const bool continued = wait_for([&] { return handled_count() >= 2; });
    runner.request_stop();
    worker.join();
    ASSERT_TRUE(continued);
    EXPECT_EQ(handled, (std::vector<std::string>{"2", "3"}));
    EXPECT_EQ(runner.stats().acked, 2u);
    EXPECT_EQ(client.array({"XPENDING", "orders", "workers"}).at(0), "0");
}

// ---- fuzz regressions (tests/fuzz/corpus/resp_reply) -------------------------------------------
// An entry id is the server's (an explicit XADD id may be any 64-bit milliseconds): one past
// what the clock holds reads as its latest time, never a wrapped one.

TEST(StreamEntryIdFuzzRegression, AnIdPastTheClockReadsAsItsLatestTime) {
    using idem::detail::stream_enqueued_at;
    EXPECT_EQ(stream_enqueued_at("999999999999999999-0"),
              std::chrono::system_clock::time_point::max());
    EXPECT_EQ(stream_enqueued_at("1700000000000-7"), idem::from_unix_ms(1700000000000));
    EXPECT_EQ(stream_enqueued_at("0-1"), std::chrono::system_clock::time_point{});
    EXPECT_FALSE(stream_enqueued_at("x-1"));
    EXPECT_FALSE(stream_enqueued_at("9999999999999999999-0"));  // 19 digits: not an id here
}
}  // namespace
}  // namespace idem_test::redis_streams
