// idem::RabbitMqConsumer against a real RabbitMQ broker, started once for this binary (it runs as
// one ctest test: the broker takes seconds to start): options, delivery counts through real
// redeliveries, poison to the dead-letter exchange, the quorum-queue check, a delivery without
// an id, a slow but live holder on a lease store, a delayed retry, batch mode
// (handle_in_batches), the circuit breaker opening in the middle of a poll (RabbitConsumerBreaker;
// RabbitConsumerOutage: the store's own redis-server killed) and a broker crash mid-run.
//
// The broker here has consumer_timeout = 2 s, checked every 200 ms; every test settles its
// deliveries well within that.

#include <gtest/gtest.h>
#include <sqlite3.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "idem/broker/rabbitmq.hpp"
#include "idem/idem.hpp"
#include "idem/store/memory.hpp"
#include "idem/store/redis.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/redis_server.hpp"
#include "idem/testing/temp_dir.hpp"
#include "support/breaker_scenario.hpp"
#include "support/polling.hpp"
#include "support/rabbitmq_broker.hpp"
#include "support/refusing_dependency.hpp"
#include "support/require_rabbitmq.hpp"
#include "support/require_redis.hpp"

namespace {

namespace rmq = idem::rabbitmq;
using namespace std::chrono_literals;
using idem::Delivery;
using idem::Disposition;
using idem::Outcome;
using idem::RabbitMessage;
using idem::RabbitMqConsumer;
using idem::RabbitMqConsumerOptions;
using Clock = std::chrono::steady_clock;

constexpr auto deadline_limit = 30s;  // generous: a loaded 2-core CI machine

idem::testing::RabbitmqServer& broker() {
    idem::testing::RabbitmqOptions options;
    options.consumer_timeout = 2000ms;
    options.channel_tick_interval = 200ms;
    return idem_test::rabbitmq_broker(options);
}

template <class Pred>
bool wait_for(Pred done, std::chrono::milliseconds limit = deadline_limit) {
    return idem_test::wait_within(limit, done);
}

template <class Pred>
bool poll_until(RabbitMqConsumer& consumer, Pred done,
                std::chrono::milliseconds limit = deadline_limit) {
    auto poll = [&] {
        try {
            consumer.poll_once();
        } catch (const idem::broker_error&) {  // reconnects on the next poll
        }
    };
    return idem_test::poll_within(limit, poll, done);
}

RabbitMqConsumerOptions fast_options(const std::string& queue) {
    RabbitMqConsumerOptions options;
    options.queue = queue;
    options.poll_wait = 50ms;
    options.prefetch = 4;
    options.in_progress_delay = 200ms;
    // Failures: basic.nack with requeue, redelivered at once (the backoff's tests set their own).
    options.redelivery_backoff = idem::RedeliveryBackoff::none();
    return options;
}

/// The test's own connection: declares, publishes, counts and reads queues.
class Admin {
  public:
    explicit Admin(const rmq::Endpoint& endpoint) : c_(endpoint) {}

    void fresh_quorum_queue(const std::string& queue) {
        for (const std::string& q : {queue, queue + ".retry", queue + ".dead-letters"}) {
            on_channel([&] { c_.delete_queue(ch, q); });
        }
        for (const std::string& q : retry_queues(queue))
            on_channel([&] { c_.delete_queue(ch, q); });
        rmq::QueueDeclare how;
        how.arguments = {{"x-queue-type", std::string("quorum")}};
        on_channel([&] { c_.declare_queue(ch, queue, how); });
    }

    void publish(const std::string& queue, const std::string& body,
                 std::optional<std::string> message_id, rmq::Table headers = {}) {
        rmq::Publish p;
        p.routing_key = queue;
        p.properties.message_id = std::move(message_id);
        p.properties.delivery_mode = 2;
        p.headers = std::move(headers);
        on_channel([&] { c_.publish_confirmed(ch, p, body); });
    }

    /// The retry queues a RabbitMqConsumer of @p queue may declare: <queue>.retry.<T>, T a power
    /// of two (ms) up to about 17 min.
    static std::vector<std::string> retry_queues(const std::string& queue) {
        std::vector<std::string> out;
        for (std::uint64_t tier = 1; tier <= (1u << 20); tier <<= 1)
            out.push_back(queue + ".retry." + std::to_string(tier));
        return out;
    }

    /// Messages waiting in @p queue's retry queues.
    std::uint32_t retrying(const std::string& queue) {
        std::uint32_t n = 0;
        for (const std::string& q : retry_queues(queue))
            n += depth(q);
        return n;
    }

    /// Ready messages of @p queue (0 when it does not exist).
    std::uint32_t depth(const std::string& queue) {
        rmq::QueueDeclare passive;
        passive.passive = true;
        std::uint32_t n = 0;
        try {
            on_channel([&] { n = c_.declare_queue(ch, queue, passive).messages; });
        } catch (const rmq::channel_error&) {
            return 0;
        }
        return n;
    }

    /// Consumes @p count messages of @p queue (acking them), or fewer when none comes in time.
    std::vector<rmq::Message> take(const std::string& queue, std::size_t count) {
        rmq::Connection reader{c_.endpoint()};
        reader.connect();
        reader.open_channel(1);
        reader.consume(1, queue);
        std::vector<rmq::Message> out;
        while (out.size() < count) {
            auto m = reader.next_delivery(5s);
            if (!m) break;
            reader.ack(*m);
            out.push_back(std::move(*m));
        }
        return out;
    }

  private:
    static constexpr std::uint16_t ch = 1;

    template <class F>
    void on_channel(F&& f) {
        if (!c_.connected()) c_.connect();
        if (!c_.channel_open(ch)) c_.open_channel(ch);
        try {
            f();
        } catch (const rmq::channel_error&) {
            if (c_.connected()) c_.open_channel(ch);
            throw;
        }
    }

    rmq::Connection c_;
};

class RabbitConsumerTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_RABBITMQ();
        admin.emplace(broker().endpoint());
    }
    rmq::Endpoint endpoint() const { return broker().endpoint(); }

    std::optional<Admin> admin;
    idem::testing::TempDir dir;
};

std::string header_text(const rmq::Message& m, const char* name) {
    return std::string(m.header_string(name).value_or("<absent>"));
}

/// Rows of a query on @p path, through a connection of its own (the consumer's store owns
/// its connection).
long long count_rows(const std::string& path, const std::string& sql) {
    sqlite3* db = nullptr;
    if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr) != SQLITE_OK) {
        sqlite3_close(db);
        return -1;
    }
    sqlite3_busy_timeout(db, 5000);
    sqlite3_stmt* stmt = nullptr;
    long long n = -1;
    if (sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr) == SQLITE_OK &&
        sqlite3_step(stmt) == SQLITE_ROW) {
        n = sqlite3_column_int64(stmt, 0);
    }
    sqlite3_finalize(stmt);
    sqlite3_close(db);
    return n;
}

// ---------------------------------------------------------------------------------------------
// Options

TEST(RabbitMqConsumerOptions, InvalidOptionsAreRefusedWithTheReason) {
    auto handler = [](const Delivery&, const RabbitMessage&) { return Outcome{}; };
    auto refused = [&](RabbitMqConsumerOptions options, const std::string& says) {
        try {
            RabbitMqConsumer consumer{rmq::Endpoint{}, std::move(options), handler};
            ADD_FAILURE() << "accepted; expected a refusal mentioning: " << says;
        } catch (const idem::usage_error& e) {
            EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
        }
    };
    const auto base = fast_options("orders");
    auto o = base;
    o.queue.clear();
    refused(o, "options.queue is empty");
    o = base;
    o.prefetch = 0;
    refused(o, "prefetch is 0");
    o = base;
    o.batch_size = 0;
    refused(o, "batch_size is 0");
    o = base;
    o.poll_wait = 0ms;
    refused(o, "poll_wait must be positive");
    o = base;
    o.retry_queue = "orders";
    refused(o, "retry_queue is the queue itself");
    o = base;
    o.queue_arguments = {{"x-queue-type", std::string("classic")}};
    refused(o, "queue_arguments names x-queue-type");
    o = base;
    o.handle_in_batches = true;
    o.prefetch = 4;
    o.batch_size = 16;
    refused(o, "prefetch (4) below batch_size (16)");
    o.prefetch = 16;
    EXPECT_NO_THROW(RabbitMqConsumer(rmq::Endpoint{}, o, handler));

    EXPECT_THROW(RabbitMqConsumer(rmq::Endpoint{}, base, RabbitMqConsumer::Handler{}),
                 idem::usage_error);
    RabbitMqConsumer consumer{rmq::Endpoint{}, base, handler};  // nothing connects yet
    EXPECT_EQ(consumer.options().dead_letter, "orders.dead-letters");
    EXPECT_EQ(consumer.options().dead_letter_routing_key, "orders");
    EXPECT_EQ(consumer.options().retry_queue, "orders.retry");
}

TEST(RabbitMqConsumerOptions, LeaseLongerThanTheConsumerTimeoutIsRefusedNamingBoth) {
    idem::RedisStore store{idem::RedisEndpoint{}};  // default lease 30 s; nothing connects
    auto handler =
        idem::make_handler(store, idem::Policy{"capture"}, [](auto&, const RabbitMessage&) {});
    auto options = fast_options("orders");
    options.visibility_timeout = 10s;
    try {
        RabbitMqConsumer consumer{rmq::Endpoint{}, options, handler};
        FAIL() << "a 30 s lease against a 10 s consumer_timeout was accepted";
    } catch (const idem::usage_error& e) {
        const std::string text = e.what();
        EXPECT_NE(text.find("30000 ms"), std::string::npos) << text;
        EXPECT_NE(text.find("visibility_timeout (the broker's consumer_timeout) (10000 ms)"),
                  std::string::npos)
            << text;
    }
}

// ---------------------------------------------------------------------------------------------
// Counts, poison, ids

TEST(RabbitCount, IsXDeliveryCountPlusOneAndCarriesPriorDeliveries) {
    rmq::Message m;
    EXPECT_EQ(rmq::delivery_count_of(m), 1u);  // first delivery: no header
    m.headers = {{"x-delivery-count", std::int64_t{0}}};
    EXPECT_EQ(rmq::delivery_count_of(m), 1u);
    m.headers = {{"x-delivery-count", std::int64_t{4}}};
    EXPECT_EQ(rmq::delivery_count_of(m), 5u);
    m.headers = {{"x-delivery-count", std::int64_t{1}},
                 {rmq::header_prior_deliveries, std::int64_t{3}}};
    EXPECT_EQ(rmq::delivery_count_of(m), 5u);
    m.headers = {{"x-delivery-count", std::int64_t{-7}}};
    EXPECT_EQ(rmq::delivery_count_of(m), 1u);
}

TEST_F(RabbitConsumerTest, DeliveryCountsGrowThroughRealRedeliveries) {
    admin->fresh_quorum_queue("counts");
    admin->publish("counts", "order 1", "order-1");
    std::vector<std::uint32_t> counts;
    RabbitMqConsumer consumer{endpoint(), fast_options("counts"),
                              [&](const Delivery& d, const RabbitMessage& m) {
                                  EXPECT_EQ(d.message_id, "order-1");
                                  EXPECT_EQ(m.body, "order 1");
                                  counts.push_back(d.delivery_count.value());
                                  if (counts.size() < 4) {
                                      return Outcome{Disposition::failed, "not yet"};
                                  }
                                  return Outcome{Disposition::processed, ""};
                              }};
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 1; }));
    EXPECT_EQ(counts, (std::vector<std::uint32_t>{1, 2, 3, 4}));
    const auto stats = consumer.stats();
    EXPECT_EQ(stats.read, 1u);
    EXPECT_EQ(stats.redelivered, 3u);
    EXPECT_EQ(stats.not_acked, 3u);
    EXPECT_EQ(stats.dead_lettered, 0u);
    for (int i = 0; i < 5; ++i)
        consumer.poll_once();
    EXPECT_EQ(counts.size(), 4u);  // acked: it never came back
    EXPECT_EQ(admin->depth("counts"), 0u);
}

TEST_F(RabbitConsumerTest, PoisonAtTheLimitGoesToTheDeadLetterExchangeConfirmedThenIsAcked) {
    admin->fresh_quorum_queue("poison");
    idem::SqliteStore store{dir.file("poison.db")};
    idem::PolicyOptions policy;
    policy.max_deliveries = 3;
    int effect_runs = 0;
    auto handler = idem::make_handler(store, idem::Policy{"capture", policy},
                                      [&](auto&, const RabbitMessage&) {
                                          ++effect_runs;
                                          throw std::runtime_error("gateway says no");
                                      });
    RabbitMqConsumer consumer{endpoint(), fast_options("poison"), handler};
    admin->publish("poison", "bad order", "order-9",
                   {{"tenant", std::string("mugshop")}, {"attempt-key", std::int64_t{42}}});
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().dead_lettered == 1; }));
    EXPECT_EQ(effect_runs, 2);  // deliveries 1 and 2; the 3rd reaches the limit: no attempt
    EXPECT_EQ(consumer.stats().acked, 1u);
    EXPECT_EQ(consumer.stats().not_acked, 2u);
    EXPECT_EQ(consumer.stats().redelivered, 2u);

    const auto letters = admin->take("poison.dead-letters", 1);
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_EQ(admin->depth("poison.dead-letters"), 0u);  // one dead letter, not two
    const rmq::Message& letter = letters.front();
    EXPECT_EQ(letter.body, "bad order");
    EXPECT_EQ(letter.properties.message_id, std::optional<std::string>("order-9"));
    EXPECT_NE(header_text(letter, rmq::header_reason).find("max_deliveries"), std::string::npos)
        << header_text(letter, rmq::header_reason);
    EXPECT_EQ(header_text(letter, rmq::header_scope), "capture");
    EXPECT_EQ(header_text(letter, rmq::header_message_id), "order-9");
    EXPECT_EQ(letter.header_integer(rmq::header_delivery_count), std::optional<std::int64_t>(3));
    EXPECT_EQ(header_text(letter, rmq::header_queue), "poison");
    // The same envelope names as on every broker (contract/dead_letter_envelope.hpp).
    EXPECT_EQ(header_text(letter, "idem-original-queue"), "poison");
    EXPECT_EQ(header_text(letter, "idem-message-id"), "order-9");
    EXPECT_EQ(header_text(letter, "tenant"), "mugshop");  // the original headers
    EXPECT_EQ(letter.header_integer("attempt-key"), std::optional<std::int64_t>(42));

    // Acked: the original is gone, and the store parked it too.
    for (int i = 0; i < 5; ++i)
        consumer.poll_once();
    EXPECT_EQ(effect_runs, 2);
    EXPECT_EQ(admin->depth("poison"), 0u);
    const auto parked = store.dead_letters();
    ASSERT_EQ(parked.size(), 1u);
    EXPECT_EQ(parked.front().message_id, "order-9");
    EXPECT_EQ(parked.front().payload, "bad order");
    EXPECT_EQ(parked.front().origin, "poison") << "the queue: where a redrive sends it back";
    EXPECT_EQ(parked.front().origin_position, "");
    // How its effect failed, and when, as the store's entry says (times as AMQP longs).
    EXPECT_NE(parked.front().failure.find("gateway says no"), std::string::npos);
    ASSERT_TRUE(parked.front().first_failed_at && parked.front().last_failed_at);
    EXPECT_EQ(header_text(letter, "idem-failure"), parked.front().failure);
    EXPECT_EQ(letter.header_integer("idem-first-failed-at"),
              std::optional<std::int64_t>(idem::to_unix_ms(*parked.front().first_failed_at)));
    EXPECT_EQ(letter.header_integer("idem-last-failed-at"),
              std::optional<std::int64_t>(idem::to_unix_ms(*parked.front().last_failed_at)));
}

TEST_F(RabbitConsumerTest, TheDeadLetterCopyOfTheBodyGoesThroughThePolicysRedactor) {
    admin->fresh_quorum_queue("redacted");
    idem::SqliteStore store{dir.file("redacted.db")};
    idem::PolicyOptions policy;
    policy.redact_payload = [](std::string_view text) {
        std::string out(text);
        for (char& c : out)
            if (c >= '0' && c <= '9') c = '#';
        return out;
    };
    auto handler = idem::make_handler(
        store, idem::Policy{"capture", policy},
        [](auto&, const RabbitMessage&) { throw idem::malformed_message("no amount"); });
    RabbitMqConsumer consumer{endpoint(), fast_options("redacted"), handler};
    admin->publish("redacted", "card 4111111111111111", "order-r");
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().dead_lettered == 1; }));
    const auto letters = admin->take("redacted.dead-letters", 1);
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_EQ(letters.front().body, "card ################");
    ASSERT_EQ(store.dead_letters().size(), 1u);
    EXPECT_EQ(store.dead_letters().front().payload, "card ################");
}

TEST_F(RabbitConsumerTest, AClassicQueueIsRefusedAtStartNamingTheWayOut) {
    admin->fresh_quorum_queue("placeholder");  // connects the admin
    {
        rmq::Connection c{endpoint()};
        c.connect();
        c.open_channel(1);
        try {
            c.delete_queue(1, "classic-orders");
        } catch (const rmq::channel_error&) {
            c.open_channel(1);
        }
        c.declare_queue(1, "classic-orders", rmq::QueueDeclare{});  // classic: no x-queue-type
    }
    int calls = 0;
    RabbitMqConsumer consumer{endpoint(), fast_options("classic-orders"),
                              [&](const Delivery&, const RabbitMessage&) {
                                  ++calls;
                                  return Outcome{Disposition::processed, ""};
                              }};
    try {
        consumer.start();
        FAIL() << "a classic queue was accepted";
    } catch (const idem::usage_error& e) {
        const std::string text = e.what();
        EXPECT_NE(text.find("not a quorum queue"), std::string::npos) << text;
        EXPECT_NE(text.find("x-queue-type=quorum"), std::string::npos) << text;
        EXPECT_NE(text.find("store-counted fallback"), std::string::npos) << text;
    }
    // run() does not retry it as a broker hiccup: the refusal reaches the caller.
    EXPECT_THROW(consumer.run(), idem::usage_error);
    EXPECT_EQ(calls, 0);

    // A missing queue with declare off is refused too; with declare on, it is created quorum.
    auto options = fast_options("not-there-yet");
    options.declare = false;
    RabbitMqConsumer strict{endpoint(), options, [](const Delivery&, const RabbitMessage&) {
                                return Outcome{Disposition::processed, ""};
                            }};
    EXPECT_THROW(strict.start(), idem::usage_error);
}

TEST_F(RabbitConsumerTest, ADeliveryWithoutAnIdIsDeadLetteredWithTheReason) {
    admin->fresh_quorum_queue("no-id");
    idem::SqliteStore store{dir.file("no-id.db")};
    int runs = 0;
    auto handler = idem::make_handler(store, idem::Policy{"capture"},
                                      [&](auto&, const RabbitMessage&) { ++runs; });
    auto options = fast_options("no-id");
    {
        std::optional<std::uint64_t> depth;
        std::string health_of, destination;
        auto with_health = options;
        with_health.health_interval = 0ms;
        with_health.on_health = [&](const idem::ConsumerHealth& h) {
            health_of = std::string(h.consumer);
            destination = std::string(h.dead_letter_destination);
            depth = h.dead_letter_depth;
        };
        RabbitMqConsumer consumer{endpoint(), with_health, handler};
        admin->publish("no-id", "who am I", std::nullopt);
        ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().dead_lettered == 1; }));
        ASSERT_TRUE(poll_until(consumer, [&] { return depth == std::optional<std::uint64_t>(1); }))
            << depth.value_or(0);
        EXPECT_EQ(health_of, "no-id");
        EXPECT_EQ(destination, "no-id.dead-letters");
    }  // closed: the next message goes to the next consumer
    EXPECT_EQ(runs, 0);
    const auto letters = admin->take("no-id.dead-letters", 1);
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_EQ(admin->depth("no-id.dead-letters"), 0u);
    EXPECT_EQ(letters.front().body, "who am I");
    EXPECT_NE(header_text(letters.front(), rmq::header_reason).find("empty message id"),
              std::string::npos)
        << header_text(letters.front(), rmq::header_reason);
    EXPECT_EQ(admin->depth("no-id"), 0u);

    // With id_field, the header is the id (and the message_id property is not needed).
    options.id_field = "order-id";
    RabbitMqConsumer by_header{endpoint(), options, handler};
    admin->publish("no-id", "order 5", std::nullopt, {{"order-id", std::string("order-5")}});
    ASSERT_TRUE(poll_until(by_header, [&] { return by_header.stats().acked == 1; }));
    EXPECT_EQ(runs, 1);
    EXPECT_EQ(by_header.stats().dead_lettered, 0u);
    EXPECT_TRUE(store.find_claim("capture", "order-5").has_value());
}

TEST_F(RabbitConsumerTest, ADeferredRetryWaitsInTheRetryQueueAndKeepsItsCount) {
    admin->fresh_quorum_queue("later");
    std::vector<std::uint32_t> counts;
    std::vector<Clock::time_point> at;
    RabbitMqConsumer consumer{endpoint(), fast_options("later"),
                              [&](const Delivery& d, const RabbitMessage&) {
                                  counts.push_back(d.delivery_count.value());
                                  at.push_back(Clock::now());
                                  if (counts.size() == 1) {
                                      Outcome o{Disposition::deferred, "predecessor not there"};
                                      o.retry_after = 300ms;
                                      return o;
                                  }
                                  return Outcome{Disposition::processed, ""};
                              }};
    admin->publish("later", "early event", "evt-1");
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 1; }));
    ASSERT_EQ(counts.size(), 2u);
    EXPECT_EQ(counts, (std::vector<std::uint32_t>{1, 2}));  // carried across the republish
    EXPECT_GE(at[1] - at[0], 300ms);                        // not before the TTL expired
    EXPECT_EQ(consumer.stats().not_acked, 1u);
    EXPECT_EQ(admin->depth("later"), 0u);
    EXPECT_EQ(admin->retrying("later"), 0u);
}

TEST_F(RabbitConsumerTest, AFailureWaitsItsRedeliveryBackoffBeforeItComesBack) {
    admin->fresh_quorum_queue("failing");
    std::vector<std::uint32_t> counts;
    std::vector<Clock::time_point> at;
    auto options = fast_options("failing");
    options.redelivery_backoff.initial = 300ms;  // then 600 ms
    options.redelivery_backoff.jitter = 0.0;
    RabbitMqConsumer consumer{endpoint(), options, [&](const Delivery& d, const RabbitMessage&) {
                                  counts.push_back(d.delivery_count.value());
                                  at.push_back(Clock::now());
                                  if (counts.size() < 3) return Outcome{Disposition::failed, "no"};
                                  return Outcome{Disposition::processed, ""};
                              }};
    admin->publish("failing", "flaky", "flaky-1");
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 1; }));
    EXPECT_EQ(counts, (std::vector<std::uint32_t>{1, 2, 3}));
    EXPECT_GE(at[1] - at[0], 300ms);
    EXPECT_GE(at[2] - at[1], 600ms);
    EXPECT_EQ(admin->retrying("failing"), 0u);
}

// A dependency that refuses for a few seconds must not park a healthy message: with the
// default backoff its retries wait 2 s, 4 s ... (less up to 20 %). A fixed 200 ms retry delay
// would have parked it at its 4th delivery, within a second.
TEST_F(RabbitConsumerTest, ADependencyRefusingForThreeSecondsDoesNotParkTheMessage) {
    admin->fresh_quorum_queue("refusing");
    idem::testing::TempDir dir;
    idem::SqliteStore store{dir.file("idem.db")};
    idem_test::RefusingDependency gateway{3s};
    auto handler = gateway.handler<RabbitMessage>(store);
    auto options = fast_options("refusing");
    options.redelivery_backoff = idem::RedeliveryBackoff{};  // the defaults
    RabbitMqConsumer consumer{endpoint(), options, handler};
    admin->publish("refusing", "capture 1", "order-1");
    ASSERT_TRUE(poll_until(
        consumer, [&] { return consumer.stats().acked == 1; }, 30s));
    EXPECT_EQ(consumer.stats().dead_lettered, 0u);
    EXPECT_EQ(admin->depth("refusing.dead-letters"), 0u);
    ASSERT_TRUE(store.find_claim("capture", "order-1").has_value());
    EXPECT_EQ(store.find_claim("capture", "order-1")->disposition, Disposition::processed);
    gateway.expect_spaced_by_the_default_backoff();
}

// RabbitMQ expires a queue's messages only at its head: a short delay published behind a long
// one would wait for it. Each range of delays has its own retry queue, so it does not.
TEST_F(RabbitConsumerTest, AShortRetryIsNotHeldBehindALongOne) {
    admin->fresh_quorum_queue("delays");
    std::map<std::string, std::vector<Clock::time_point>> at;
    RabbitMqConsumer consumer{endpoint(), fast_options("delays"),
                              [&](const Delivery& d, const RabbitMessage& m) {
                                  at[m.body].push_back(Clock::now());
                                  if (d.delivery_count.value() > 1) {
                                      return Outcome{Disposition::processed, ""};
                                  }
                                  Outcome o{Disposition::deferred, "not yet"};
                                  o.retry_after = m.body == "long" ? 60s : 300ms;
                                  return o;
                              }};
    admin->publish("delays", "long", "evt-long");
    ASSERT_TRUE(poll_until(consumer, [&] { return at["long"].size() == 1; }));
    admin->publish("delays", "short", "evt-short");
    ASSERT_TRUE(poll_until(
        consumer, [&] { return at["short"].size() == 2; }, 20s));
    EXPECT_GE(at["short"][1] - at["short"][0], 300ms);
    EXPECT_EQ(at["long"].size(), 1u);  // still waiting its minute
    EXPECT_EQ(admin->depth("delays.retry.512"), 0u);
    EXPECT_EQ(admin->depth("delays.retry.65536"), 1u);  // 60 s: the 32.8 s … 65.5 s queue
}

TEST_F(RabbitConsumerTest, AnUnreachableStorePausesConsumingWithoutRaisingHeldCounts) {
    admin->fresh_quorum_queue("outage");
    std::map<std::string, std::vector<std::uint32_t>> counts;
    int probes_failing = 2;
    auto options = fast_options("outage");
    options.circuit_breaker.initial_backoff = 20ms;
    options.circuit_breaker.max_backoff = 50ms;
    options.store_probe = [&] {
        if (probes_failing-- > 0) throw idem::store_unavailable("still down");
    };
    bool down = true;
    RabbitMqConsumer consumer{endpoint(), options, [&](const Delivery& d, const RabbitMessage&) {
                                  counts[d.message_id].push_back(d.delivery_count.value());
                                  if (down) {
                                      down = false;
                                      return idem::failed_outcome(
                                          "store down", idem::FailureCause::store_unavailable);
                                  }
                                  return Outcome{Disposition::processed, ""};
                              }};
    admin->publish("outage", "first", "m-1");
    admin->publish("outage", "second", "m-2");
    consumer.start();
    ASSERT_TRUE(wait_for([&] { return admin->depth("outage") == 0; }));  // both sent to us
    ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 2; }));
    const auto stats = consumer.stats();
    EXPECT_EQ(stats.circuit_opened, 1u);
    EXPECT_GE(stats.store_probes, 3u);  // two failed, one answered
    EXPECT_EQ(counts["m-1"], (std::vector<std::uint32_t>{1, 2}));
    // m-2 was held while the breaker was open, not given back: still its first delivery.
    EXPECT_EQ(counts["m-2"], (std::vector<std::uint32_t>{1}));
}

// ---------------------------------------------------------------------------------------------
// A slow but live holder, on a lease store

TEST_F(RabbitConsumerTest, SlowLiveHolderRedeliveredAfterMissedHeartbeatsIsNotDeadLettered) {
    IDEM_REQUIRE_REDIS();
    auto& redis = idem::testing::shared_redis();
    idem::RedisEndpoint redis_endpoint;
    redis_endpoint.host = redis.host();
    redis_endpoint.port = redis.port();
    idem::RedisOptions store_options;
    store_options.key_prefix = "idem-rabbit:";
    store_options.lease = 10s;
    idem::RedisStore store{redis_endpoint, store_options};
    admin->fresh_quorum_queue("slow");

    idem::PolicyOptions policy;
    policy.max_deliveries = 3;
    std::atomic<int> effect_runs{0};
    std::atomic<bool> effect_started{false};
    std::atomic<bool> release{false};
    auto handler = idem::make_handler(store, idem::Policy{"slow", policy},
                                      [&](auto& tx, const RabbitMessage&) {
                                          ++effect_runs;
                                          effect_started = true;
                                          wait_for([&] { return release.load(); });
                                          tx.write("INCR", "idem-rabbit:slow-effects");
                                      });

    // A asks for a 1 s heartbeat, which rabbitmq-c answers only between handler calls: while A's
    // effect runs the broker sees two heartbeats missed, drops A's connection and redelivers
    // the message while A is still working within its lease — what a handler slower than
    // configured looks like to the broker. The typed constructor would refuse this pairing
    // (lease 10 s > twice the heartbeat), so A and B wrap the same handler in a plain function,
    // which the consumer cannot check.
    rmq::Endpoint a_endpoint = endpoint();
    a_endpoint.heartbeat = 1s;
    RabbitMqConsumer a{
        a_endpoint, fast_options("slow"),
        [&](const Delivery& d, const RabbitMessage& m) { return handler.handle(d, m); }};
    std::mutex seen_mutex;
    std::vector<std::uint32_t> b_counts;
    std::vector<Disposition> b_outcomes;
    RabbitMqConsumer b{endpoint(), fast_options("slow"),
                       [&](const Delivery& d, const RabbitMessage& m) {
                           Outcome outcome = handler.handle(d, m);
                           // in_progress carries the holder's remaining lease (retry_after), which
                           // B would wait out in the retry queue; dropped, so B's redeliveries
                           // come after in_progress_delay (fast_options) while A still works.
                           if (outcome.disposition == Disposition::in_progress) {
                               outcome.retry_after.reset();
                           }
                           std::lock_guard<std::mutex> lock(seen_mutex);
                           b_counts.push_back(d.delivery_count.value());
                           b_outcomes.push_back(outcome.disposition);
                           return outcome;
                       }};
    admin->publish("slow", "slow order", "order-s");
    std::string a_error;
    std::thread worker([&] {
        try {
            poll_until(
                a, [&] { return effect_started.load(); }, 10s);
            a.poll_once();  // sees the closed channel (or nothing)
        } catch (const std::exception& e) {
            a_error = e.what();
        }
    });
    const bool started = wait_for([&] { return effect_started.load(); });
    // B, consuming now, gets it back once the broker closes A's channel, and again and again
    // (A's lease is live: in_progress), until its count is past max_deliveries (3).
    bool redelivered = false;
    if (started) {
        b.start();
        redelivered = poll_until(b, [&] {
            std::lock_guard<std::mutex> lock(seen_mutex);
            return !b_counts.empty() && b_counts.back() > policy.max_deliveries;
        });
    }
    release = true;
    worker.join();
    ASSERT_TRUE(started);
    ASSERT_TRUE(redelivered);
    EXPECT_TRUE(a_error.empty()) << a_error;
    // A's ack went nowhere: its connection was dropped while it worked (a stale delivery tag).
    EXPECT_EQ(a.stats().acked, 0u);

    // Its next redelivery to B finds the finished claim: a duplicate, acked.
    ASSERT_TRUE(poll_until(b, [&] { return b.stats().acked == 1; }));
    for (Disposition d : b_outcomes) {
        EXPECT_TRUE(d == Disposition::in_progress || d == Disposition::duplicate)
            << static_cast<int>(d);
    }
    EXPECT_EQ(b_outcomes.back(), Disposition::duplicate);
    for (std::size_t i = 1; i < b_counts.size(); ++i) {  // one more per redelivery
        EXPECT_EQ(b_counts[i], b_counts[i - 1] + 1) << i;
    }
    EXPECT_EQ(effect_runs.load(), 1);
    EXPECT_EQ(redis.client().integer({"GET", "idem-rabbit:slow-effects"}), 1);
    EXPECT_EQ(store.attempts("slow", "order-s"), 1u);
    EXPECT_TRUE(store.dead_letters().empty());
    EXPECT_EQ(b.stats().dead_lettered, 0u);
    EXPECT_EQ(admin->depth("slow.dead-letters"), 0u);
    EXPECT_EQ(admin->depth("slow"), 0u);
    EXPECT_EQ(admin->depth("slow.retry"), 0u);
}

// ---------------------------------------------------------------------------------------------
// Batch mode (handle_in_batches)

/// Counts the commits on @p db (sqlite3_commit_hook): one per store transaction, so one per
/// handle() or handle_batch() call that stored something.
class CommitCounter {
  public:
    explicit CommitCounter(sqlite3* db) : db_(db) {
        sqlite3_commit_hook(db_, &CommitCounter::on_commit, this);
    }
    CommitCounter(const CommitCounter&) = delete;
    CommitCounter& operator=(const CommitCounter&) = delete;
    ~CommitCounter() { sqlite3_commit_hook(db_, nullptr, nullptr); }
    [[nodiscard]] int commits() const { return commits_; }

  private:
    static int on_commit(void* self) {
        ++static_cast<CommitCounter*>(self)->commits_;
        return 0;  // let it commit
    }
    sqlite3* db_;
    int commits_ = 0;
};

void create_captures(idem::SqliteStore& store) {
    ASSERT_EQ(sqlite3_exec(store.db(), "CREATE TABLE captures(order_id TEXT PRIMARY KEY)", nullptr,
                           nullptr, nullptr),
              SQLITE_OK);
}

TEST_F(RabbitConsumerTest, BatchModeHandsAPollToOneHandleBatchAndAcksEveryDelivery) {
    admin->fresh_quorum_queue("batch");
    const std::string db_path = dir.file("batch.db");
    idem::SqliteStore store{db_path};
    create_captures(store);
    int effect_runs = 0;
    auto handler =
        idem::make_handler(store, idem::Policy{"capture"}, [&](auto& tx, const RabbitMessage& m) {
            ++effect_runs;
            tx.execute("INSERT INTO captures(order_id) VALUES (?)", *m.properties.message_id);
        });
    constexpr std::size_t n = 6;
    auto options = fast_options("batch");
    options.handle_in_batches = true;
    options.prefetch = n;
    options.batch_size = n;
    {
        RabbitMqConsumer consumer{endpoint(), options, handler};
        for (std::size_t i = 0; i < n; ++i) {
            admin->publish("batch", "order " + std::to_string(i), "order-" + std::to_string(i));
        }
        consumer.start();
        // All n sent to the consumer (none left ready): the first poll finds them together.
        ASSERT_TRUE(wait_for([&] { return admin->depth("batch") == 0; }));
        CommitCounter commits{store.db()};
        EXPECT_EQ(consumer.poll_once(), n);
        EXPECT_EQ(commits.commits(), 1);  // one transaction: ONE handle_batch() call, not n
        EXPECT_EQ(effect_runs, static_cast<int>(n));
        const auto stats = consumer.stats();
        EXPECT_EQ(stats.read, n);
        EXPECT_EQ(stats.acked, n);
        EXPECT_EQ(stats.not_acked, 0u);
        EXPECT_EQ(stats.dead_lettered, 0u);
        for (int i = 0; i < 3; ++i)
            EXPECT_EQ(consumer.poll_once(), 0u);  // acked: nothing comes back
        EXPECT_EQ(commits.commits(), 1);
    }
    // The consumer closed its connection: an unacked delivery would be back in the queue.
    EXPECT_EQ(admin->depth("batch"), 0u);
    EXPECT_EQ(effect_runs, static_cast<int>(n));
    EXPECT_EQ(count_rows(db_path, "SELECT count(*) FROM captures"), static_cast<long long>(n));
}

TEST_F(RabbitConsumerTest, BatchModeDeadLettersThePoisonRedeliversTheFailureAndAcksTheRest) {
    admin->fresh_quorum_queue("batchmix");
    const std::string db_path = dir.file("batchmix.db");
    idem::SqliteStore store{db_path};
    create_captures(store);
    idem::PolicyOptions policy;
    policy.max_deliveries = 3;
    std::map<std::string, std::vector<std::uint32_t>> attempts;  // id -> delivery counts
    bool gateway_down = true;
    auto handler = idem::make_handler(
        store, idem::Policy{"capture", policy}, [&](auto& tx, const RabbitMessage& m) {
            const std::string id = *m.properties.message_id;
            attempts[id].push_back(rmq::delivery_count_of(m));
            if (id == "order-throws" && gateway_down) {
                gateway_down = false;
                throw std::runtime_error("gateway timed out");
            }
            tx.execute("INSERT INTO captures(order_id) VALUES (?)", id);
        });
    auto options = fast_options("batchmix");  // redelivery_delay 0: a failure is nacked
    options.handle_in_batches = true;
    options.prefetch = 4;
    options.batch_size = 4;
    {
        RabbitMqConsumer consumer{endpoint(), options, handler};
        admin->publish("batchmix", "order 1", "order-1");
        // Delivered twice before (a delayed retry carries that over): this, its third delivery,
        // is at the limit.
        admin->publish("batchmix", "poison order", "order-poison",
                       {{rmq::header_prior_deliveries, std::int64_t{2}}});
        admin->publish("batchmix", "order throws", "order-throws");
        admin->publish("batchmix", "order 2", "order-2");
        consumer.start();
        ASSERT_TRUE(wait_for([&] { return admin->depth("batchmix") == 0; }));
        CommitCounter commits{store.db()};
        EXPECT_EQ(consumer.poll_once(), 4u);
        // One handle_batch() call for the four, then order-throws' failure noted on its own.
        EXPECT_EQ(commits.commits(), 2);
        auto stats = consumer.stats();
        EXPECT_EQ(stats.acked, 3u);  // order-1, order-2, and the poison after its dead letter
        EXPECT_EQ(stats.dead_lettered, 1u);
        EXPECT_EQ(stats.not_acked, 1u);                 // order-throws
        EXPECT_EQ(attempts.count("order-poison"), 0u);  // at the limit: the effect never ran

        const auto letters = admin->take("batchmix.dead-letters", 1);
        ASSERT_EQ(letters.size(), 1u);
        EXPECT_EQ(letters.front().properties.message_id,
                  std::optional<std::string>("order-poison"));
        EXPECT_EQ(letters.front().body, "poison order");
        EXPECT_EQ(letters.front().header_integer(rmq::header_delivery_count),
                  std::optional<std::int64_t>(3));
        EXPECT_NE(header_text(letters.front(), rmq::header_reason).find("max_deliveries"),
                  std::string::npos)
            << header_text(letters.front(), rmq::header_reason);

        // The failure was not acked: it comes back (count 2) and succeeds; nothing else does.
        ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked == 4; }));
        for (int i = 0; i < 3; ++i)
            consumer.poll_once();
        stats = consumer.stats();
        EXPECT_EQ(stats.acked, 4u);
        EXPECT_EQ(stats.dead_lettered, 1u);
        EXPECT_EQ(stats.not_acked, 1u);
        EXPECT_EQ(stats.read, 3u);         // order-1, order-throws, order-2 at count 1
        EXPECT_EQ(stats.redelivered, 2u);  // the poison (count 3), order-throws again (count 2)
    }
    EXPECT_EQ(attempts["order-throws"], (std::vector<std::uint32_t>{1, 2}));
    EXPECT_EQ(attempts["order-1"], (std::vector<std::uint32_t>{1}));
    EXPECT_EQ(attempts["order-2"], (std::vector<std::uint32_t>{1}));
    EXPECT_EQ(admin->depth("batchmix"), 0u);
    EXPECT_EQ(admin->depth("batchmix.dead-letters"), 0u);  // one dead letter, taken above
    EXPECT_EQ(count_rows(db_path, "SELECT count(*) FROM captures"), 3);
    EXPECT_EQ(count_rows(db_path, "SELECT count(*) FROM captures WHERE order_id = 'order-poison'"),
              0);
    const auto parked = store.dead_letters();
    ASSERT_EQ(parked.size(), 1u);
    EXPECT_EQ(parked.front().message_id, "order-poison");
}

// ---------------------------------------------------------------------------------------------
// The circuit breaker and the deliveries of the prefetch window not yet handed to the handler

using idem_test::BreakerMode;

/// The MemoryStore's first begin() fails as unreachable (injected_fault, a store_unavailable),
/// with 6 messages in the queue, prefetch and batch_size 4, so the circuit breaker opens in the
/// middle of the first poll: one at a time (and a plain handler in batch mode) the first
/// delivery fails (nacked, back at once: no backoff here) and the three after it, never handed
/// to the handler, are held unacked for the next poll with their counts; with handle_batch() the
/// whole poll fails in its one transaction and all four are nacked. With 4 more published
/// after, each of the 10 is applied exactly once, none dead-lettered, and once the consumer
/// has closed nothing is back in the queue (an unacked delivery would be).
class RabbitConsumerBreaker : public RabbitConsumerTest {
  protected:
    void prefetched_deliveries_come_again(const std::string& queue, BreakerMode mode) {
        admin->fresh_quorum_queue(queue);
        idem::MemoryStore store;
        std::map<std::string, std::vector<std::uint32_t>> counts;  // id -> counts applied
        auto handler = idem::make_handler(
            store, idem::Policy{"capture"}, [&](auto& tx, const RabbitMessage&, const Delivery& d) {
                counts[d.message_id].push_back(d.delivery_count.value());
                const int before = std::stoi(tx.get("applied", d.message_id).value_or("0"));
                tx.put("applied", d.message_id, std::to_string(before + 1));
            });
        auto options = fast_options(queue);
        options.prefetch = 4;
        idem_test::breaker_options(options, mode, store);
        auto id = [](int i) { return "order-" + std::to_string(i); };
        const std::size_t handed = idem_test::handed_before_the_breaker(mode);
        {
            std::optional<RabbitMqConsumer> consumer;
            if (mode == BreakerMode::plain_batches) {
                consumer.emplace(endpoint(), options,
                                 [&](const Delivery& d, const RabbitMessage& m) {
                                     return handler.handle(d, m);
                                 });
            } else {
                consumer.emplace(endpoint(), options, handler);
            }
            for (int i = 1; i <= 6; ++i)
                admin->publish(queue, "order " + std::to_string(i), id(i));
            consumer->start();
            // The prefetch window is full: 4 sent to the consumer, 2 ready.
            ASSERT_TRUE(wait_for([&] { return admin->depth(queue) == 2; }));
            store.inject(idem::Fault::begin);
            EXPECT_EQ(consumer->poll_once(), handed);
            auto stats = consumer->stats();
            idem_test::expect_first_poll_cut_short(stats, mode, store);

            for (int i = 7; i <= 10; ++i)
                admin->publish(queue, "order " + std::to_string(i), id(i));
            ASSERT_TRUE(poll_until(*consumer, [&] { return consumer->stats().acked >= 10; }))
                << "acked " << consumer->stats().acked;
            stats = consumer->stats();
            EXPECT_EQ(stats.acked, 10u);
            EXPECT_EQ(stats.dead_lettered, 0u);
            EXPECT_EQ(stats.not_acked, handed);
            EXPECT_EQ(stats.circuit_opened, 1u);
            EXPECT_GE(stats.store_probes, 1u);
            EXPECT_EQ(stats.read + stats.redelivered, stats.acked + stats.not_acked);
        }
        // The consumer closed its connection: an unacked delivery would be back in the queue.
        EXPECT_EQ(admin->depth(queue), 0u);
        EXPECT_EQ(admin->depth(queue + ".dead-letters"), 0u);
        EXPECT_TRUE(store.dead_letters().empty());
        for (int i = 1; i <= 10; ++i) {
            EXPECT_EQ(store.get("applied", id(i)), std::optional<std::string>("1")) << i;
            const auto claim = store.find_claim("capture", id(i));
            ASSERT_TRUE(claim.has_value()) << i;
            EXPECT_EQ(claim->disposition, Disposition::processed) << i;
        }
        // The deliveries handed to the handler while the store was away were nacked: back with
        // count 2. The ones held unhandled were not given back: still their first delivery.
        for (int i = 1; i <= 4; ++i) {
            const std::uint32_t count = i <= static_cast<int>(handed) ? 2 : 1;
            EXPECT_EQ(counts[id(i)], std::vector<std::uint32_t>{count}) << i;
        }
        for (int i = 5; i <= 10; ++i)
            EXPECT_EQ(counts[id(i)], std::vector<std::uint32_t>{1}) << i;
    }
};

TEST_F(RabbitConsumerBreaker, PrefetchedDeliveriesComeAgainOneAtATime) {
    prefetched_deliveries_come_again("breaker-one", BreakerMode::one_at_a_time);
}

TEST_F(RabbitConsumerBreaker, PrefetchedDeliveriesComeAgainInBatchMode) {
    prefetched_deliveries_come_again("breaker-batch", BreakerMode::batches);
}

TEST_F(RabbitConsumerBreaker, PrefetchedDeliveriesComeAgainInBatchModeWithAPlainHandler) {
    prefetched_deliveries_come_again("breaker-plain", BreakerMode::plain_batches);
}

/// The store a RedisStore on a redis-server of its own (the broker another server), SIGKILLed
/// during order-2's effect and started again (same port, same AOF) before the next poll: its
/// commit fails as unreachable and the breaker opens. One at a time order-1 is acked, order-2
/// failed and 3 and 4 held unhandled; in batch mode the poll's one commit fails, all four with
/// it. With 4 more published after, each of the 10 is applied exactly once (an INCR in the
/// store's commit), none dead-lettered, nothing back in the queue once the consumer closed.
class RabbitConsumerOutage : public RabbitConsumerTest {
  protected:
    void store_killed_mid_poll(const std::string& queue, bool batches) {
        IDEM_REQUIRE_REDIS();
        admin->fresh_quorum_queue(queue);
        idem::testing::RedisServer own;  // the store's server: this one is killed
        idem::RedisEndpoint store_endpoint;
        store_endpoint.host = own.host();
        store_endpoint.port = own.port();
        idem::RedisOptions store_options;
        store_options.lease = 500ms;  // order-2's lease, left by the killed attempt, ends soon
        idem::RedisStore store{store_endpoint, store_options};
        store.warm_up();
        bool kill = true;
        auto handler = idem::make_handler(store, idem::Policy{"capture"},
                                          [&](auto& tx, const RabbitMessage&, const Delivery& d) {
                                              tx.write("INCR", "effects:" + d.message_id);
                                              if (kill && d.message_id == "order-2") {
                                                  kill = false;
                                                  own.kill9();
                                              }
                                          });
        auto options = fast_options(queue);
        options.prefetch = 4;
        options.batch_size = 4;
        options.handle_in_batches = batches;
        options.circuit_breaker.initial_backoff = 20ms;
        options.circuit_breaker.max_backoff = 50ms;
        auto id = [](int i) { return "order-" + std::to_string(i); };
        {
            RabbitMqConsumer consumer{endpoint(), options, handler};
            for (int i = 1; i <= 6; ++i)
                admin->publish(queue, "order " + std::to_string(i), id(i));
            consumer.start();
            ASSERT_TRUE(wait_for([&] { return admin->depth(queue) == 2; }));
            EXPECT_EQ(consumer.poll_once(), batches ? 4u : 2u);
            EXPECT_EQ(consumer.stats().circuit_opened, 1u);
            EXPECT_EQ(consumer.stats().acked, batches ? 0u : 1u);
            EXPECT_EQ(consumer.stats().not_acked, batches ? 4u : 1u);

            own.start();  // the same port and AOF: order-1's commit kept
            for (int i = 7; i <= 10; ++i)
                admin->publish(queue, "order " + std::to_string(i), id(i));
            ASSERT_TRUE(poll_until(consumer, [&] { return consumer.stats().acked >= 10; }))
                << "acked " << consumer.stats().acked;
            const auto stats = consumer.stats();
            EXPECT_EQ(stats.acked, 10u);
            EXPECT_EQ(stats.dead_lettered, 0u);
            EXPECT_EQ(stats.circuit_opened, 1u);
            EXPECT_GE(stats.store_probes, 1u);
            EXPECT_EQ(stats.read + stats.redelivered, stats.acked + stats.not_acked);
        }
        EXPECT_EQ(admin->depth(queue), 0u);
        EXPECT_EQ(admin->depth(queue + ".dead-letters"), 0u);
        EXPECT_TRUE(store.dead_letters().empty());
        auto client = own.client();
        for (int i = 1; i <= 10; ++i) {
            EXPECT_EQ(client.integer({"GET", "effects:" + id(i)}).value_or(0), 1) << i;
            const auto claim = store.find_claim("capture", id(i));
            ASSERT_TRUE(claim.has_value()) << i;
            EXPECT_EQ(claim->disposition, Disposition::processed) << i;
        }
    }
};

TEST_F(RabbitConsumerOutage, StoresRedisKilledMidPollLosesNothingOneAtATime) {
    store_killed_mid_poll("outage-one", /*batches=*/false);
}

TEST_F(RabbitConsumerOutage, StoresRedisKilledMidPollLosesNothingInBatchMode) {
    store_killed_mid_poll("outage-batch", /*batches=*/true);
}

// ---------------------------------------------------------------------------------------------
// A broker crash mid-run (last: it restarts this binary's broker)

TEST_F(RabbitConsumerTest, BrokerCrashMidRunLosesNothingAndAppliesNothingTwice) {
    admin->fresh_quorum_queue("restart");
    const std::string db_path = dir.file("restart.db");
    idem::SqliteStore store{db_path};
    {
        sqlite3* db = store.db();
        ASSERT_EQ(sqlite3_exec(db, "CREATE TABLE effects(message_id TEXT NOT NULL)", nullptr,
                               nullptr, nullptr),
                  SQLITE_OK);
    }
    auto handler =
        idem::make_handler(store, idem::Policy{"restart"}, [&](auto& tx, const RabbitMessage& m) {
            tx.execute("INSERT INTO effects(message_id) VALUES (?)", *m.properties.message_id);
        });
    constexpr int total = 300;
    for (int i = 0; i < total; ++i)
        admin->publish("restart", "order " + std::to_string(i), "order-" + std::to_string(i));

    RabbitMqConsumer consumer{endpoint(), fast_options("restart"), handler};
    std::thread worker([&] { consumer.run(); });
    const auto effects = [&] { return count_rows(db_path, "SELECT count(*) FROM effects"); };
    ASSERT_TRUE(wait_for([&] { return effects() >= 50; }));
    broker().kill9();  // mid-run: deliveries in flight, acks unsent
    broker().start();  // same node, ports and data
    const bool all = wait_for([&] { return effects() >= total; }, 90s);
    consumer.request_stop();
    worker.join();
    ASSERT_TRUE(all) << effects() << " of " << total;
    EXPECT_EQ(effects(), total);
    EXPECT_EQ(count_rows(db_path, "SELECT count(DISTINCT message_id) FROM effects"), total);
    EXPECT_GE(consumer.stats().connection_errors, 1u);
}

}  // namespace
