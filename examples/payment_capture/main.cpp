// payment_capture: the first field note's story on the embedded SQLite store, no server.
//
// 2,000 capture messages go through a simulated at-least-once broker that loses acks and a
// worker that crashes at random points (seeded). The gateway honours idempotency keys (same key,
// same charge). With idem every order ends with exactly one capture row and one charge; with
// --naive (the handler as first written) the same run shows the double charges.
//
// The last line printed is one JSON object; the exit status is non-zero if divergences != 0.

#include <sqlite3.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "idem/idem.hpp"
#include "idem/store/sqlite.hpp"

namespace {

struct CapturePayment {
    long order_id = 0;
    long amount = 0;
};

std::string idem_payload(const CapturePayment& m) {
    return fmt::format("{{\"order_id\":{},\"amount\":{}}}", m.order_id, m.amount);
}

/// A payment gateway that honours idempotency keys: a new key makes one charge, a repeated key
/// returns the first charge. A request without a key always charges.
class Gateway {
  public:
    struct Charge {
        std::string reference;
        long order_id;
    };
    Charge capture(long order_id, long /*amount*/, const std::string& idempotency_key = {}) {
        ++requests_;
        if (!idempotency_key.empty()) {
            auto it = by_key_.find(idempotency_key);
            if (it != by_key_.end()) return it->second;
        }
        Charge charge{fmt::format("ch_{:06}", charges_.size() + 1), order_id};
        charges_.push_back(charge);
        if (!idempotency_key.empty()) by_key_.emplace(idempotency_key, charge);
        return charge;
    }
    long requests() const { return requests_; }
    const std::vector<Charge>& charges() const { return charges_; }

  private:
    long requests_ = 0;
    std::vector<Charge> charges_;
    std::map<std::string, Charge> by_key_;
};

/// The worker dies here: in-process, the exception abandons the transaction exactly as a killed
/// process would (SQLite discards an uncommitted transaction). tests/testing/crash_test.cpp does
/// the same with fork and SIGKILL.
struct WorkerCrash : std::runtime_error {
    using std::runtime_error::runtime_error;
};

enum CrashPoint { before_gateway, after_gateway, after_local_write, crash_points };
const char* const crash_point_names[] = {"before the gateway call", "after the gateway call",
                                         "after the local write"};

struct Options {
    long messages = 2000;
    unsigned seed = 42;
    double crash_rate = 0.03;     // per crash point, per delivery
    double lost_ack_rate = 0.10;  // the ack never reaches the broker
    bool naive = false;
    std::string db;
};

Options parse(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
            return argv[++i];
        };
        if (arg == "--messages") {
            o.messages = std::stol(value());
        } else if (arg == "--seed") {
            o.seed = static_cast<unsigned>(std::stoul(value()));
        } else if (arg == "--crash-rate") {
            o.crash_rate = std::stod(value());
        } else if (arg == "--lost-ack-rate") {
            o.lost_ack_rate = std::stod(value());
        } else if (arg == "--db") {
            o.db = value();
        } else if (arg == "--naive") {
            o.naive = true;
        } else if (arg == "--help" || arg == "-h") {
            std::puts(
                "usage: payment_capture [--messages N] [--seed S] [--crash-rate P] "
                "[--lost-ack-rate P] [--db PATH] [--naive]");
            std::exit(0);
        } else {
            throw std::invalid_argument("unknown option " + arg + " (try --help)");
        }
    }
    if (o.messages <= 0) throw std::invalid_argument("--messages must be positive");
    return o;
}

void exec(sqlite3* db, const char* sql) {
    char* error = nullptr;
    if (sqlite3_exec(db, sql, nullptr, nullptr, &error) != SQLITE_OK) {
        std::string text = error ? error : "?";
        sqlite3_free(error);
        throw std::runtime_error(text);
    }
}

/// A scratch directory for the demo's database when --db is not given, removed at exit.
struct ScratchDir {
    std::filesystem::path path;
    ~ScratchDir() {
        std::error_code ignored;
        if (!path.empty()) std::filesystem::remove_all(path, ignored);
    }
};

struct Message {
    std::string id;
    CapturePayment body;
    std::uint32_t delivery_count = 0;
};

}  // namespace

int main(int argc, char** argv) try {
    const Options options = parse(argc, argv);
    std::string db_path = options.db;
    ScratchDir scratch;  // declared before the store, so it is removed after the store closes
    if (db_path.empty()) {
        std::string pattern =
            (std::filesystem::temp_directory_path() / "idem-demo-XXXXXX").string();
        if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
        scratch.path = pattern;
        db_path = (scratch.path / "shop.db").string();
    }

    idem::SqliteStore store(db_path);  // the consumer's own database; idem adds its tables
    exec(store.db(),
         "CREATE TABLE IF NOT EXISTS captures(order_id INTEGER NOT NULL, "
         "gateway_reference TEXT NOT NULL)");

    Gateway gateway;
    std::mt19937_64 random(options.seed);
    std::uniform_real_distribution<double> chance(0.0, 1.0);
    long crashes[crash_points] = {0, 0, 0};
    auto maybe_crash = [&](CrashPoint point) {
        if (chance(random) < options.crash_rate) {
            ++crashes[point];
            throw WorkerCrash(crash_point_names[point]);
        }
    };

    // The handler as the field note fixed it: claim in the same transaction as the capture row,
    // gateway key derived from the order id.
    auto capture = idem::make_handler(
        store, idem::Policy{"capture-payment"}, [&](auto& tx, const CapturePayment& m) {
            maybe_crash(before_gateway);
            auto charge = gateway.capture(m.order_id, m.amount, idem::key("capture", m.order_id));
            maybe_crash(after_gateway);
            tx.execute("INSERT INTO captures(order_id, gateway_reference) VALUES (?, ?)",
                       m.order_id, charge.reference);
            maybe_crash(after_local_write);
        });

    // The handler as first written: no claim, no key. Used with --naive.
    auto naive_capture = [&](const CapturePayment& m) {
        try {
            maybe_crash(before_gateway);
            auto charge = gateway.capture(m.order_id, m.amount);
            maybe_crash(after_gateway);
            exec(store.db(), "BEGIN");
            sqlite3_stmt* stmt = nullptr;
            sqlite3_prepare_v2(store.db(),
                               "INSERT INTO captures(order_id, gateway_reference) VALUES (?, ?)",
                               -1, &stmt, nullptr);
            sqlite3_bind_int64(stmt, 1, m.order_id);
            sqlite3_bind_text(stmt, 2, charge.reference.c_str(), -1, SQLITE_TRANSIENT);
            sqlite3_step(stmt);
            sqlite3_finalize(stmt);
            try {
                maybe_crash(after_local_write);
            } catch (...) {
                exec(store.db(), "ROLLBACK");
                throw;
            }
            exec(store.db(), "COMMIT");
            return true;
        } catch (const WorkerCrash&) {
            return false;
        }
    };

    // The broker: at-least-once. An unacked message goes back to the queue; an ack can be lost.
    std::deque<Message> queue;
    for (long order = 1; order <= options.messages; ++order) {
        queue.push_back(Message{fmt::format("1668421262-{}", order), {order, 1000 + order % 997}});
    }
    long delivered = 0, lost_acks = 0;
    const bool progress = isatty(STDOUT_FILENO) != 0;
    while (!queue.empty()) {
        Message message = queue.front();
        queue.pop_front();
        ++message.delivery_count;
        ++delivered;
        bool acked = false;
        if (options.naive) {
            acked = naive_capture(message.body);
        } else {
            auto outcome =
                capture.handle(idem::Delivery{message.id, message.delivery_count}, message.body);
            acked = idem::should_ack(outcome);
        }
        if (acked && chance(random) < options.lost_ack_rate) {
            acked = false;  // the worker acked, the broker never heard it: redelivery
            ++lost_acks;
        }
        if (!acked) queue.push_back(message);
        if (progress && delivered % 250 == 0) {
            std::printf("\rdelivered %ld, queue %zu", delivered, queue.size());
            std::fflush(stdout);
        }
    }
    if (progress) std::printf("\n");

    // Verification: every order has exactly one capture and one charge, and they agree.
    std::map<long, std::vector<std::string>> captures_by_order;
    {
        sqlite3_stmt* stmt = nullptr;
        sqlite3_prepare_v2(store.db(), "SELECT order_id, gateway_reference FROM captures", -1,
                           &stmt, nullptr);
        while (sqlite3_step(stmt) == SQLITE_ROW) {
            captures_by_order[sqlite3_column_int64(stmt, 0)].push_back(
                reinterpret_cast<const char*>(sqlite3_column_text(stmt, 1)));
        }
        sqlite3_finalize(stmt);
    }
    std::map<long, std::vector<std::string>> charges_by_order;
    for (const auto& charge : gateway.charges()) {
        charges_by_order[charge.order_id].push_back(charge.reference);
    }
    long captures = 0, divergences = 0;
    for (long order = 1; order <= options.messages; ++order) {
        const auto& c = captures_by_order[order];
        const auto& g = charges_by_order[order];
        captures += static_cast<long>(c.size());
        if (c.size() != 1 || g.size() != 1 || c[0] != g[0]) ++divergences;
    }
    const long dead_lettered = static_cast<long>(store.dead_letters().size());

    std::printf(
        "%s: %ld messages, %ld deliveries; worker crashes: %ld %s, %ld %s, %ld %s; "
        "%ld acks lost\n",
        options.naive ? "naive handler" : "idem handler", options.messages, delivered, crashes[0],
        crash_point_names[0], crashes[1], crash_point_names[1], crashes[2], crash_point_names[2],
        lost_acks);
    std::printf(
        "{\"store\":\"sqlite\",\"handler\":\"%s\",\"seed\":%u,\"messages\":%ld,\"delivered\":%ld,"
        "\"redeliveries\":%ld,\"captures\":%ld,\"gateway_requests\":%ld,\"gateway_calls\":%zu,"
        "\"divergences\":%ld,\"dead_lettered\":%ld}\n",
        options.naive ? "naive" : "idem", options.seed, options.messages, delivered,
        delivered - options.messages, captures, gateway.requests(), gateway.charges().size(),
        divergences, dead_lettered);
    return divergences == 0 ? 0 : 1;
} catch (const std::exception& e) {
    std::fprintf(stderr, "payment_capture: %s\n", e.what());
    return 2;
}
