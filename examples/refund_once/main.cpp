// refund_once: the fourth field note's story on the embedded SQLite store.
//
// A refund must happen once, whatever the broker does:
//  1. a slow instance A is still working when the visibility timeout passes and the broker
//     hands the message to instance B. On SQLite, B cannot even claim it while A's transaction
//     is open: it waits for the write lock, gives up (failed, not acked) and the next
//     redelivery finds A's claim (duplicate);
//  2. an instance makes a refund (another shop's order 93: another key) and dies before saving
//     the refund record; the redelivery sends the same key and the processor answers with the
//     first refund;
//  3. the producer sends the first refund again under a new message id: a new claim, the same
//     key, and the unique (shop, order) save is a no-op treated as success.
// The processor gets the key refund-<shop>-<order> and, like Stripe, answers a repeated key
// with the first result and refuses a key still in flight (the race a lease store can meet).
// The last line is one JSON object; the exit status is non-zero on any divergence.

#include <sqlite3.h>
#include <stdlib.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "idem/idem.hpp"
#include "idem/store/sqlite.hpp"

namespace {

using namespace std::chrono_literals;

struct RefundRequested {
    std::string shop;
    long order = 0;
    long amount = 0;
};

std::string idem_payload(const RefundRequested& m) {
    return fmt::format("{{\"shop\":\"{}\",\"order\":{},\"amount\":{}}}", m.shop, m.order, m.amount);
}

/// A payment processor with Stripe-like idempotency keys.
class Processor {
  public:
    struct InFlight : std::runtime_error {
        using std::runtime_error::runtime_error;
    };

    std::string refund(const std::string& key, long amount, std::chrono::milliseconds latency) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            ++requests_;
            if (auto it = done_.find(key); it != done_.end()) return it->second;
            if (!in_flight_.insert(key).second) {
                throw InFlight("409: a request with key " + key + " is still in flight");
            }
        }
        std::this_thread::sleep_for(latency);
        std::lock_guard<std::mutex> lock(mutex_);
        in_flight_.erase(key);
        std::string reference = fmt::format("re_{:04}", done_.size() + 1);
        done_.emplace(key, reference);
        refunded_amount_ += amount;
        return reference;
    }
    long requests() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return requests_;
    }
    long refunds_made() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return static_cast<long>(done_.size());
    }
    long refunded_amount() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return refunded_amount_;
    }

  private:
    mutable std::mutex mutex_;
    long requests_ = 0;
    long refunded_amount_ = 0;
    std::map<std::string, std::string> done_;
    std::set<std::string> in_flight_;
};

struct SimulatedCrash : std::runtime_error {
    using std::runtime_error::runtime_error;
};

/// One instance of the payment service: its own connection to the shared database.
class Instance {
  public:
    Instance(const std::string& db_path, Processor& processor, std::string name,
             std::chrono::milliseconds busy_timeout)
        : store_(db_path, options(busy_timeout)),
          processor_(processor),
          name_(std::move(name)),
          handler_(store_, idem::Policy{"refund"},
                   [this](idem::SqliteStore::Transaction& tx, const RefundRequested& m) {
                       refund(tx, m);
                   }) {}

    idem::Outcome handle(const std::string& message_id, std::uint32_t count,
                         const RefundRequested& message) {
        ++deliveries;
        auto outcome = handler_.handle(idem::Delivery{message_id, count}, message);
        std::printf("  %-10s %s delivery %u -> %s%s%s\n", name_.c_str(), message_id.c_str(), count,
                    std::string(idem::to_string(outcome.disposition)).c_str(),
                    outcome.reason.empty() ? "" : ": ", outcome.reason.c_str());
        return outcome;
    }

    std::chrono::milliseconds latency = 10ms;
    bool crash_after_refund = false;
    long deliveries = 0;

  private:
    static idem::SqliteOptions options(std::chrono::milliseconds busy_timeout) {
        idem::SqliteOptions o;
        o.busy_timeout = busy_timeout;
        return o;
    }

    template <class Tx>
    void refund(Tx& tx, const RefundRequested& m) {
        const std::string reference =
            processor_.refund(idem::key("refund", m.shop, m.order), m.amount, latency);
        if (crash_after_refund) {
            crash_after_refund = false;
            throw SimulatedCrash(name_ + " died after the refund, before saving the record");
        }
        // The unique (shop, order) index: a second save is a no-op, treated as success.
        tx.execute(
            "INSERT INTO refunds(shop, order_id, reference) VALUES (?, ?, ?) "
            "ON CONFLICT(shop, order_id) DO NOTHING",
            m.shop, m.order, reference);
    }

    idem::SqliteStore store_;
    Processor& processor_;
    std::string name_;
    using Effect = std::function<void(idem::SqliteStore::Transaction&, const RefundRequested&)>;
    idem::IdempotentHandler<idem::SqliteStore, Effect> handler_;
};

}  // namespace

int main() try {
    std::string pattern = (std::filesystem::temp_directory_path() / "idem-refund-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    const std::filesystem::path dir = pattern;
    const std::string db_path = (dir / "payments.db").string();
    {
        idem::SqliteStore setup(db_path);
        setup.execute(
            "CREATE TABLE refunds(shop TEXT NOT NULL, order_id INTEGER NOT NULL, "
            "reference TEXT NOT NULL, UNIQUE(shop, order_id))");
    }
    Processor processor;
    const RefundRequested mugshop_93{"mugshop", 93, 1800};
    const RefundRequested teashop_93{"teashop", 93, 2400};

    std::puts("1. instance A is slower than the 100 ms visibility timeout; B gets the message");
    Instance a(db_path, processor, "instance A", 5000ms);
    Instance b(db_path, processor, "instance B", 50ms);
    a.latency = 300ms;
    std::thread slow([&] { a.handle("msg-93", 1, mugshop_93); });
    std::this_thread::sleep_for(100ms);  // the visibility timeout passes, the broker redelivers
    auto b_first = b.handle("msg-93", 2, mugshop_93);
    slow.join();
    if (!idem::should_ack(b_first)) b.handle("msg-93", 3, mugshop_93);  // redelivered again

    std::puts("2. instance B refunds teashop 93 and dies before saving the record");
    b.latency = 10ms;
    b.crash_after_refund = true;
    b.handle("msg-t93", 1, teashop_93);
    a.latency = 10ms;
    a.handle("msg-t93", 2, teashop_93);

    std::puts("3. the producer sends the mugshop refund again under a new message id");
    a.handle("msg-93-resent", 1, mugshop_93);

    // Verification.
    idem::SqliteStore check(db_path);
    const long records = check.query_int("SELECT count(*) FROM refunds").value_or(-1);
    const long mug =
        check.query_int("SELECT count(*) FROM refunds WHERE shop = 'mugshop'").value_or(-1);
    const long tea =
        check.query_int("SELECT count(*) FROM refunds WHERE shop = 'teashop'").value_or(-1);
    const long divergences = (mug != 1) + (tea != 1) + (processor.refunds_made() != 2) +
                             (processor.refunded_amount() != 1800 + 2400);
    std::printf(
        "{\"store\":\"sqlite\",\"refund_messages\":3,\"deliveries\":%ld,\"processor_requests\":%ld,"
        "\"refunds_made\":%ld,\"refund_records\":%ld,\"refunded_amount\":%ld,\"divergences\":%ld}"
        "\n",
        a.deliveries + b.deliveries, processor.requests(), processor.refunds_made(), records,
        processor.refunded_amount(), divergences);
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
    return divergences == 0 ? 0 : 1;
} catch (const std::exception& e) {
    std::fprintf(stderr, "refund_once: %s\n", e.what());
    return 2;
}
