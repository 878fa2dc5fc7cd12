// settlement_outbox: the third field note's settlement consumer on the embedded SQLite store.
//
// Payment instructions arrive at least once. Each posts a double-entry ledger row (an upsert on
// the natural key payment_id + account) and hands a wire to the payment rail. The wire leaves the
// process, so the effect does not send it: it writes an outbox intent in the same transaction as
// the claim and the ledger rows, and a relay ships each intent with the payment id as the rail's
// idempotency key. The broker loses acks and evicts consumers mid-batch; the rail times out
// (after applying the wire, sometimes) and fails now and then. Every instruction must end with
// one ledger entry pair and one wire. The last line is one JSON object; the exit status is
// non-zero on any divergence.

#include <stdlib.h>

#include <chrono>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <map>
#include <random>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "idem/idem.hpp"
#include "idem/outbox.hpp"
#include "idem/store/sqlite.hpp"

namespace {

struct Instruction {
    long payment_id = 0;
    std::string debit_account;
    std::string credit_account;
    long amount_cents = 0;
};

std::string idem_payload(const Instruction& i) {
    return fmt::format("{{\"payment_id\":{},\"amount_cents\":{}}}", i.payment_id, i.amount_cents);
}

struct EvictedMidHandler : std::runtime_error {
    using std::runtime_error::runtime_error;
};

/// The payment rail: dedupes on the idempotency key, like a real rail.
class Rail {
  public:
    struct Timeout : std::runtime_error {
        using std::runtime_error::runtime_error;
    };
    void wire(const std::string& key, const std::string& /*payload*/) {
        ++requests_;
        ++deliveries_by_key_[key];  // applied once per key: a repeated key is recognised
    }
    long requests() const { return requests_; }
    long wires_applied() const { return static_cast<long>(deliveries_by_key_.size()); }

  private:
    long requests_ = 0;
    std::map<std::string, long> deliveries_by_key_;
};

}  // namespace

int main(int argc, char** argv) try {
    long instructions = 500;
    unsigned seed = 7;
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string arg = argv[i];
        if (arg == "--instructions") {
            instructions = std::stol(argv[i + 1]);
        } else if (arg == "--seed") {
            seed = static_cast<unsigned>(std::stoul(argv[i + 1]));
        } else {
            throw std::invalid_argument("usage: settlement_outbox [--instructions N] [--seed S]");
        }
    }

    std::string pattern =
        (std::filesystem::temp_directory_path() / "idem-settlement-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    const std::filesystem::path dir = pattern;

    // Simulated time, so relay backoffs pass without waiting.
    auto now = std::chrono::system_clock::now();
    idem::SqliteOptions options;
    options.clock = [&now] { return now; };
    idem::SqliteStore store((dir / "settlement.db").string(), options);
    store.execute(
        "CREATE TABLE ledger(payment_id INTEGER NOT NULL, account TEXT NOT NULL, "
        "amount_cents INTEGER NOT NULL, PRIMARY KEY(payment_id, account))");

    std::mt19937_64 random(seed);
    std::uniform_real_distribution<double> chance(0.0, 1.0);
    long evictions = 0, rail_timeouts = 0, rail_failures = 0;

    auto settle = idem::make_handler(
        store, idem::Policy{"settle-payment"}, [&](auto& tx, const Instruction& p) {
            // Double entry, an upsert on the natural key: a replay is a structural no-op.
            tx.execute(
                "INSERT INTO ledger(payment_id, account, amount_cents) VALUES (?, ?, ?) "
                "ON CONFLICT(payment_id, account) DO NOTHING",
                p.payment_id, p.debit_account, -p.amount_cents);
            tx.execute(
                "INSERT INTO ledger(payment_id, account, amount_cents) VALUES (?, ?, ?) "
                "ON CONFLICT(payment_id, account) DO NOTHING",
                p.payment_id, p.credit_account, p.amount_cents);
            // The wire: an intent in the same commit, keyed by the payment id.
            idem::outbox(tx, "rail", idem::key("wire", p.payment_id),
                         fmt::format("{{\"payment_id\":{},\"amount_cents\":{}}}", p.payment_id,
                                     p.amount_cents));
            if (chance(random) < 0.05) {
                ++evictions;
                throw EvictedMidHandler("pod evicted before the commit");
            }
        });

    Rail rail;
    idem::RelayOptions relay_options;
    relay_options.batch = 25;
    relay_options.clock = [&now] { return now; };
    idem::Relay relay(
        store,
        [&](const idem::OutboxRow& row) {
            if (chance(random) < 0.04) {
                ++rail_failures;
                throw std::runtime_error("rail answered 503");
            }
            rail.wire(row.idempotency_key, row.payload);
            if (chance(random) < 0.04) {  // applied, but the answer never came back
                ++rail_timeouts;
                throw Rail::Timeout("rail timed out after applying the wire");
            }
        },
        relay_options);

    // The broker: at-least-once; unacked messages come back, acks get lost.
    struct Message {
        std::string id;
        Instruction body;
        std::uint32_t count = 0;
    };
    std::deque<Message> queue;
    for (long p = 1; p <= instructions; ++p) {
        queue.push_back(Message{fmt::format("instr-{}", p),
                                Instruction{p, fmt::format("acct-{}", p % 17),
                                            fmt::format("acct-{}", 100 + p % 13), 1000 + p}});
    }
    long deliveries = 0, lost_acks = 0;
    while (!queue.empty()) {
        Message m = queue.front();
        queue.pop_front();
        ++m.count;
        ++deliveries;
        bool acked = idem::should_ack(settle.handle(idem::Delivery{m.id, m.count}, m.body));
        if (acked && chance(random) < 0.10) {
            acked = false;
            ++lost_acks;
        }
        if (!acked) queue.push_back(m);
        if (deliveries % 10 == 0) {
            relay.run_once();
            now += std::chrono::seconds(1);
        }
    }
    // Drain the outbox: retries wait out their backoff in simulated time.
    auto unsent = [&] {
        return store
            .query_int("SELECT count(*) FROM idem_outbox WHERE sent_at IS NULL AND NOT parked")
            .value_or(-1);
    };
    for (int round = 0; round < 10000 && unsent() > 0; ++round) {
        relay.run_once();
        now += std::chrono::seconds(5);
    }

    const long ledger_rows = store.query_int("SELECT count(*) FROM ledger").value_or(-1);
    const long balance = store.query_int("SELECT sum(amount_cents) FROM ledger").value_or(-1);
    const long left_unsent =
        store.query_int("SELECT count(*) FROM idem_outbox WHERE sent_at IS NULL").value_or(-1);
    const long parked =
        store.query_int("SELECT count(*) FROM idem_outbox WHERE parked").value_or(-1);
    const long divergences = (ledger_rows != 2 * instructions) + (balance != 0) +
                             (rail.wires_applied() != instructions) + (left_unsent != 0);
    std::printf(
        "evictions before commit: %ld, acks lost: %ld, rail failures: %ld, rail timeouts after "
        "applying: %ld\n",
        evictions, lost_acks, rail_failures, rail_timeouts);
    std::printf(
        "{\"store\":\"sqlite\",\"instructions\":%ld,\"deliveries\":%ld,\"redeliveries\":%ld,"
        "\"ledger_rows\":%ld,\"ledger_balance\":%ld,\"rail_requests\":%ld,\"wires_applied\":%ld,"
        "\"unsent\":%ld,\"parked\":%ld,\"divergences\":%ld}\n",
        instructions, deliveries, deliveries - instructions, ledger_rows, balance, rail.requests(),
        rail.wires_applied(), left_unsent, parked, divergences);
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
    return divergences == 0 ? 0 : 1;
} catch (const std::exception& e) {
    std::fprintf(stderr, "settlement_outbox: %s\n", e.what());
    return 2;
}
