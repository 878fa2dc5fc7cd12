// idem::RedisStreamSender against a real redis-server (the process's shared one): a Relay over
// an SqliteStore ships intents that an idem::RedisStreamConsumer (id_field = the sender's id field)
// claims under their idempotency keys; a resend is a duplicate; the server down leaves the row
// unsent and retried; fan-out children keyed child_id(parent, i) apply once; WRONGTYPE parks.

#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/broker/redis_streams.hpp"
#include "idem/senders/redis_streams.hpp"
#include "idem/testing/redis_server.hpp"
#include "support/chain_env.hpp"
#include "support/require_redis.hpp"

namespace {

using namespace std::chrono_literals;
using idem::StreamEntry;
using idem_test::chain::Hop;
using idem_test::chain::Ledger;
using idem_test::chain::Upstream;

class RedisStreamSenderTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_REDIS();
        server_ = &idem::testing::shared_redis();
        server_->flushall();
        endpoint_.host = server_->host();
        endpoint_.port = server_->port();
        sender_ = std::make_unique<idem::RedisStreamSender>(endpoint_);
        idem::RedisStreamConsumerOptions options{stream, "downstream", "c1"};
        options.id_field = sender_->options().id_field;
        options.visibility_timeout = 200ms;
        options.poll_wait = 50ms;
        options.redelivery_backoff = idem::RedeliveryBackoff::none();
        consumer_ =
            std::make_unique<idem::RedisStreamConsumer>(endpoint_, options, ledger_.handler());
    }

    /// The first entry of @p key from @p start on (XRANGE), read with idem's own connection.
    std::optional<StreamEntry> entry_at(const std::string& key, const std::string& start,
                                        const char* command = "XRANGE", const char* end = "+") {
        idem::redis::Connection c{endpoint_};
        const idem::redis::Reply reply = c.command({command, key, start, end, "COUNT", "1"});
        if (!reply.is_array() || reply.elements.empty()) return std::nullopt;
        return idem::detail::parse_stream_entry(reply.elements[0], key);
    }

    Hop hop() {
        return idem_test::chain::hop_of([this](const idem::OutboxRow& row) { (*sender_)(row); },
                                        [this] { consumer_->poll_once(); });
    }

    static constexpr const char* stream = "payments";
    idem::testing::RedisServer* server_ = nullptr;
    idem::RedisEndpoint endpoint_;
    Upstream up_;
    Ledger<StreamEntry> ledger_{
        [](const StreamEntry& e) { return std::string(e.field("payload").value_or("")); }};
    std::unique_ptr<idem::RedisStreamSender> sender_;
    std::unique_ptr<idem::RedisStreamConsumer> consumer_;
};

TEST_F(RedisStreamSenderTest, RelayShipsIntentsTheConsumerClaimsUnderTheirKeys) {
    idem_test::chain::relay_ships_keys_as_message_ids(up_, ledger_, hop(), stream);
    // The entry as written: the id field, then the payload field.
    const auto first = entry_at(stream, "-");
    ASSERT_TRUE(first.has_value());
    const std::vector<std::pair<std::string, std::string>> fields{
        {"message_id", idem::key("wire", 1)}, {"payload", "payload of " + idem::key("wire", 1)}};
    EXPECT_EQ(first->fields, fields);
}

TEST_F(RedisStreamSenderTest, ASecondSendOfTheSameIntentIsADuplicateDownstream) {
    idem_test::chain::resend_is_a_duplicate(up_, ledger_, hop(), stream);
    EXPECT_EQ(server_->client().integer({"XLEN", stream}), 2);  // both reached the stream
}

TEST_F(RedisStreamSenderTest, ServerDownLeavesTheRowUnsentUntilARetryDeliversIt) {
    idem_test::chain::outage_is_retried_then_delivered(
        up_, ledger_, hop(), stream, [this] { server_->kill9(); }, [this] { server_->start(); });
}

TEST_F(RedisStreamSenderTest, FanOutChildrenOfARedeliveredParentApplyOnce) {
    idem_test::chain::fan_out_children_apply_once(up_, ledger_, hop(), stream, 5);
}

TEST_F(RedisStreamSenderTest, FieldNamesAndMaxLengthAreOptions) {
    idem::RedisStreamSenderOptions options;
    options.id_field = "key";
    options.payload_field = "body";
    options.max_length = 2;
    idem::RedisStreamSender sender{endpoint_, options};
    for (int i = 0; i < 300; ++i) {
        idem::OutboxRow row;
        row.destination = "trimmed";
        row.idempotency_key = "k-" + std::to_string(i);
        row.payload = "p-" + std::to_string(i);
        sender(row);
    }
    // MAXLEN ~ trims whole macro nodes only (100 entries each by default): fewer than the 300
    // are kept, at least 2, the last one among them.
    const long long kept = server_->client().integer({"XLEN", "trimmed"}).value();
    EXPECT_LT(kept, 300);
    EXPECT_GE(kept, 2);
    const auto last = entry_at("trimmed", "+", "XREVRANGE", "-");
    ASSERT_TRUE(last.has_value());
    EXPECT_EQ(last->field("key"), std::optional<std::string_view>("k-299"));
    EXPECT_EQ(last->field("body"), std::optional<std::string_view>("p-299"));
}

TEST_F(RedisStreamSenderTest, AKeyThatIsNotAStreamIsParkedAtOnceWithTheReason) {
    server_->client().exec({"SET", "not-a-stream", "x"});
    idem_test::chain::expect_parked_at_once(up_, *sender_, "not-a-stream", "wire-1", "one",
                                            "WRONGTYPE");
}

TEST(RedisStreamSender, RefusesFieldNamesThatCannotWork) {
    idem::RedisStreamSenderOptions same;
    same.payload_field = same.id_field;
    EXPECT_THROW(idem::RedisStreamSender({}, same), idem::usage_error);
    idem::RedisStreamSenderOptions empty;
    empty.id_field.clear();
    EXPECT_THROW(idem::RedisStreamSender({}, empty), idem::usage_error);
    idem::RedisStreamSenderOptions zero;
    zero.max_length = 0;
    EXPECT_THROW(idem::RedisStreamSender({}, zero), idem::usage_error);
}

}  // namespace
