// settlement_chain: two services chained by an outbox relay over NATS JetStream (docs/chain.md).
//
// Service A (payments) receives each payment instruction at least once (here: every
// instruction twice, a redelivery). Its effect posts the payment to its own ledger and, in the
// same SQLite transaction, writes an outbox intent for the settlement service keyed
// idem::key("settle", payment id). A relay (idem::Relay + idem::JetStreamSender) ships the
// intents to the subject settle.payments; it "crashes" once between a send and its mark, so
// every intent goes out twice, the second time after the stream's duplicate window, so the copy
// reaches service B. Service B (settlement) reads with idem::JetStreamConsumer, claims the key
// (Nats-Msg-Id) as the message id and books one settlement row in its own SQLite store: the copy
// is a duplicate. The last line is one JSON object; the exit status is 0 only with no
// divergence.
//
//   settlement_chain --own-server [--payments N]   # a throwaway nats-server on a free port

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>

#include "idem/broker/nats_jetstream.hpp"
#include "idem/idem.hpp"
#include "idem/nats/admin.hpp"
#include "idem/nats/connection.hpp"
#include "idem/outbox.hpp"
#include "idem/senders/nats_jetstream.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/nats_server.hpp"
#include "idem/testing/temp_dir.hpp"

namespace {

using namespace std::chrono_literals;

constexpr const char* stream = "SETTLE";
constexpr const char* subject = "settle.payments";
constexpr const char* durable = "settlement";
constexpr auto duplicate_window = 200ms;  // short, so the relay's resend reaches service B

bool running_in_ci() {
    const char* ci = std::getenv("CI");
    return ci != nullptr && (std::string_view(ci) == "true" || std::string_view(ci) == "1");
}

/// Rows of @p table for payment @p id (1: applied once).
long rows_of(idem::SqliteStore& store, const std::string& table, long id) {
    return store.query_int("SELECT count(*) FROM " + table + " WHERE payment_id = ?", id)
        .value_or(0);
}

}  // namespace

int main(int argc, char** argv) try {
    bool own_server = false;
    long payments = 50;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--own-server") {
            own_server = true;
        } else if (arg == "--payments" && i + 1 < argc) {
            payments = std::stol(argv[++i]);
        } else {
            std::fprintf(stderr, "usage: settlement_chain --own-server [--payments N]\n");
            return 2;
        }
    }
    if (!own_server) throw std::invalid_argument("--own-server is required (see usage)");
    std::string why;
    if (!idem::testing::NatsServer::available(&why)) {
        std::fprintf(stderr, "settlement_chain: %s\n", why.c_str());
        if (running_in_ci()) return 2;  // CI=true: a missing server is a failure
        std::fprintf(stderr, "settlement_chain: skipped (set CI=true to make this a failure)\n");
        return 77;
    }
    idem::testing::NatsServer server;
    idem::nats::Connection nats{idem::nats::Endpoint{server.url()}};
    idem::nats::StreamSpec spec{stream, {subject}};
    spec.duplicate_window = duplicate_window;
    idem::nats::ensure_stream(nats, spec);

    idem::testing::TempDir dir;
    idem::SqliteStore payments_db{dir.file("payments.db")};
    idem::SqliteStore settlement_db{dir.file("settlement.db")};
    payments_db.execute("CREATE TABLE ledger(payment_id INTEGER NOT NULL, amount INTEGER)");
    settlement_db.execute("CREATE TABLE settlements(payment_id INTEGER NOT NULL, key TEXT)");

    // Service A: the ledger row and the intent commit together with the claim, or none does.
    auto post = idem::make_handler(
        payments_db, idem::Policy{"post-payment"}, [](auto& tx, const std::string& body) {
            const long id = std::stol(body);
            tx.execute("INSERT INTO ledger(payment_id, amount) VALUES (?, ?)", id, 100 + id);
            idem::outbox(tx, subject, idem::key("settle", id), body);
        });
    for (int round = 1; round <= 2; ++round) {  // every instruction delivered twice
        for (long id = 1; id <= payments; ++id) {
            const idem::Delivery delivery{idem::key("instruction", id),
                                          idem::DeliveryCount{static_cast<std::uint32_t>(round)}};
            post.handle(delivery, std::to_string(id));
        }
    }

    // The relay. First a run whose marks are lost (the relay died after each send), then the
    // restarted relay's run, once the stream has forgotten the ids: every intent is sent twice.
    idem::JetStreamSender sender{idem::nats::Endpoint{server.url()}};
    for (const idem::OutboxRow& row : payments_db.outbox_rows())
        sender(row);
    std::this_thread::sleep_for(duplicate_window + 300ms);
    idem::RelayOptions relay_options;
    relay_options.backoff_base = 50ms;
    idem::Relay relay(
        payments_db, [&](const idem::OutboxRow& row) { sender(row); }, relay_options);
    std::size_t relayed = 0;
    while (const std::size_t sent = relay.run_once().sent)
        relayed += sent;

    // Service B: the key (Nats-Msg-Id) is the message id; the settlement row commits with it.
    auto settle = idem::make_handler(
        settlement_db, idem::Policy{"settle-payment"},
        [](auto& tx, const idem::JetStreamMessage& message, const idem::Delivery& delivery) {
            tx.execute("INSERT INTO settlements(payment_id, key) VALUES (?, ?)",
                       std::stol(message.data), delivery.message_id);
        });
    idem::JetStreamConsumerOptions consumer_options;
    consumer_options.stream = stream;
    consumer_options.durable = durable;
    consumer_options.poll_wait = 200ms;
    idem::JetStreamConsumer consumer{idem::nats::Endpoint{server.url()}, consumer_options, settle};
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (std::chrono::steady_clock::now() < deadline) {
        if (consumer.poll_once() != 0) continue;
        const auto state = idem::nats::consumer_state(nats, stream, durable);
        if (state.num_pending == 0 && state.num_ack_pending == 0) break;
    }

    long divergences = 0;
    for (long id = 1; id <= payments; ++id) {
        const long in_a = rows_of(payments_db, "ledger", id);
        const long in_b = rows_of(settlement_db, "settlements", id);
        if (in_a != 1 || in_b != 1) {
            ++divergences;
            std::printf("divergence: payment %ld: %ld ledger row(s), %ld settlement row(s)\n", id,
                        in_a, in_b);
        }
    }
    const auto counters = settle.counters();
    const auto messages = idem::nats::stream_state(nats, stream).messages;
    std::printf(
        "settlement_chain: %ld payments posted once each from %ld deliveries; the relay sent every "
        "intent twice (%ld, then %zu after a lost mark); the stream holds %llu messages; "
        "service B settled %llu and dropped %llu duplicates\n",
        payments, 2 * payments, payments, relayed, static_cast<unsigned long long>(messages),
        static_cast<unsigned long long>(counters.processed),
        static_cast<unsigned long long>(counters.duplicates));
    std::printf(
        "{\"payments\":%ld,\"relay_sends\":%ld,\"stream_messages\":%llu,\"settled\":%llu,"
        "\"duplicates\":%llu,\"divergences\":%ld}\n",
        payments, payments + static_cast<long>(relayed), static_cast<unsigned long long>(messages),
        static_cast<unsigned long long>(counters.processed),
        static_cast<unsigned long long>(counters.duplicates), divergences);
    // Every resend must have reached service B and been dropped there: else it proved nothing.
    if (counters.duplicates < static_cast<std::uint64_t>(payments)) {
        std::printf("settlement_chain: the resends did not reach service B\n");
        return 1;
    }
    return divergences == 0 ? 0 : 1;
} catch (const std::exception& e) {
    std::fprintf(stderr, "settlement_chain: %s\n", e.what());
    return 2;
}
