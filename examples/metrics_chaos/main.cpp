// metrics_chaos: a payment-capture consumer under the chaos workload, with its PrometheusObserver
// served at GET /metrics (idem::serve_metrics, component idem::http).
//
// The workload runs in process: a broker queue hands --messages captures to --workers workers,
// each with its own handler and its own random generator (seeded from --seed). At random a
// worker crashes before handling (the broker redelivers), its effect throws after the gateway
// call (a crash between the external effect and the commit), its commit is refused after the
// effect (a lost lease: MemoryStore's injected commit fault), it crashes after the commit and
// before the ack (the broker redelivers: a duplicate), or the broker redelivers an acked message.
// The gateway dedupes by idempotency key (idem::key("capture", order)). At the end the consumer
// reconciles the gateway's charges against the store's captures (the chaos harness's check) and
// prints one JSON line with its numbers; with --serve-seconds S it then keeps serving /metrics.
//
//   metrics_chaos [--messages N] [--workers W] [--seed S] [--port P] [--pace-ms M]
//                 [--serve-seconds S]
//   metrics_chaos --check-with-prometheus [--messages N] [--seed S]
//
// --check-with-prometheus (the ctest run, prometheus_check.cpp) starts this program as a child
// process, reads the numbers it printed, starts a real Prometheus scraping it every second, and
// checks through /api/v1/query that Prometheus has the same numbers: duplicates suppressed > 0 and
// processed == the message count. The exit status is non-zero when anything disagrees; 77 (a
// skip) when there is no prometheus binary and CI is not true.

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "idem/idem.hpp"
#include "idem/observers/http.hpp"
#include "idem/observers/prometheus.hpp"
#include "idem/store/memory.hpp"

#include "metrics_chaos.hpp"

namespace {

using metrics_chaos::Args;

/// A broker with at-least-once delivery: a queue of messages, each delivered with its count.
class Broker {
  public:
    struct Message {
        std::string id;
        std::string body;
        std::uint32_t deliveries = 0;  ///< times handed out so far
    };

    explicit Broker(unsigned messages) {
        for (unsigned i = 0; i < messages; ++i)
            queue_.push_back(Message{fmt::format("msg-{}", i),
                                     fmt::format("{}|{}", 8000 + i, 100 + i % 900), 0});
    }

    /// The next message to deliver (its count raised), or false when the queue is empty and
    /// nothing is in flight any more.
    bool receive(Message& out) {
        std::unique_lock<std::mutex> lock(mutex_);
        for (;;) {
            if (!queue_.empty()) {
                out = std::move(queue_.front());
                queue_.pop_front();
                ++out.deliveries;
                ++in_flight_;
                return true;
            }
            if (in_flight_ == 0) return false;
            lock.unlock();
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
            lock.lock();
        }
    }
    /// Not acked (a crash, a failed outcome, a visibility timeout): delivered again.
    void redeliver(Message m) {
        std::lock_guard<std::mutex> lock(mutex_);
        queue_.push_back(std::move(m));
        --in_flight_;
    }
    /// Acked; at-least-once still lets the broker deliver it once more now and then.
    void ack(Message m, bool deliver_again_anyway) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (deliver_again_anyway) queue_.push_back(std::move(m));
        --in_flight_;
    }

  private:
    std::mutex mutex_;
    std::deque<Message> queue_;
    unsigned in_flight_ = 0;
};

/// A payment gateway that dedupes by idempotency key, as real ones do: the same key returns the
/// same charge. It records every call, so the run can be reconciled against the store.
class Gateway {
  public:
    std::string capture(const std::string& key, long amount) {
        std::lock_guard<std::mutex> lock(mutex_);
        ++calls_;
        auto [it, fresh] =
            charges_.emplace(key, Charge{fmt::format("ch_{}", charges_.size()), amount, 0});
        ++it->second.calls;
        return it->second.reference;
    }
    struct Charge {
        std::string reference;
        long amount = 0;
        unsigned calls = 0;
    };
    std::map<std::string, Charge> charges() {
        std::lock_guard<std::mutex> lock(mutex_);
        return charges_;
    }
    unsigned long calls() {
        std::lock_guard<std::mutex> lock(mutex_);
        return calls_;
    }

  private:
    std::mutex mutex_;
    std::map<std::string, Charge> charges_;
    unsigned long calls_ = 0;
};

struct CrashInEffect : std::runtime_error {
    CrashInEffect() : std::runtime_error("worker crashed after the gateway call") {}
};

int run_consumer(const Args& args) {
    idem::PrometheusObserver metrics;
    auto endpoint = idem::serve_metrics(metrics, args.port);
    // The first line says where the metrics are (the check reads the port from it).
    std::printf("metrics_chaos: serving %s\n", endpoint.url().c_str());
    std::fflush(stdout);

    idem::MemoryStore store;
    Gateway gateway;
    Broker broker(args.messages);
    // Far more failures than production sees: the poison limit must not end a message that is
    // only unlucky (a message that fails this often in production is parked at 5).
    idem::PolicyOptions policy_options;
    policy_options.max_deliveries = 1000;
    const idem::Policy policy{"capture", policy_options};
    metrics_chaos::Tally tally;
    std::mutex tally_mutex;

    auto worker = [&](unsigned number) {
        std::mt19937_64 random(args.seed * 1000003u + number);
        std::uniform_real_distribution<double> chance(0.0, 1.0);
        bool crash_in_effect = false;
        auto key_of = [](const std::string& body) {
            return idem::key("capture", body.substr(0, body.find('|')));
        };
        auto handler = idem::make_handler(
            store, policy,
            idem::with_gateway_key(
                key_of,
                [&](auto& tx, const std::string& body) {
                    if (args.pace_ms > 0)  // the gateway's latency
                        std::this_thread::sleep_for(std::chrono::milliseconds(args.pace_ms));
                    const long amount = std::strtol(body.c_str() + body.find('|') + 1, nullptr, 10);
                    const std::string reference = gateway.capture(key_of(body), amount);
                    if (crash_in_effect) throw CrashInEffect();
                    tx.put("captures", body.substr(0, body.find('|')), reference);
                }),
            &metrics);

        metrics_chaos::Tally mine;
        Broker::Message m;
        while (broker.receive(m)) {
            if (chance(random) < 0.05) {  // crashed before handling it
                ++mine.crashes;
                broker.redeliver(std::move(m));
                continue;
            }
            crash_in_effect = chance(random) < 0.08;
            if (chance(random) < 0.05) store.inject(idem::Fault::commit);  // lease lost
            const idem::Outcome outcome =
                handler.handle(idem::Delivery{m.id, m.deliveries}, m.body);
            ++mine.deliveries;
            if (!idem::should_ack(outcome)) {
                broker.redeliver(std::move(m));
                continue;
            }
            if (chance(random) < 0.08) {  // crashed after the commit, before the ack
                ++mine.crashes;
                broker.redeliver(std::move(m));
                continue;
            }
            broker.ack(std::move(m), chance(random) < 0.04);
        }
        std::lock_guard<std::mutex> lock(tally_mutex);
        tally.deliveries += mine.deliveries;
        tally.crashes += mine.crashes;
    };

    const auto started = std::chrono::steady_clock::now();
    std::vector<std::thread> workers;
    for (unsigned w = 0; w < args.workers; ++w)
        workers.emplace_back(worker, w);
    for (auto& w : workers)
        w.join();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();

    // Reconciliation, as the chaos harness does it: every order charged exactly once at the
    // gateway, and the store's capture row holds that charge's reference.
    const auto charges = gateway.charges();
    unsigned long divergences = 0;
    unsigned long repeated_calls = 0;  // would have been double charges without the key
    for (unsigned i = 0; i < args.messages; ++i) {
        const std::string order = fmt::format("{}", 8000 + i);
        const auto charge = charges.find(idem::key("capture", order));
        const auto stored = store.get("captures", order);
        if (charge == charges.end() || !stored || *stored != charge->second.reference)
            ++divergences;
        if (charge != charges.end()) repeated_calls += charge->second.calls - 1;
    }
    if (charges.size() != args.messages) ++divergences;

    tally.processed = metrics.deliveries("capture", idem::Disposition::processed);
    tally.duplicates = metrics.deliveries("capture", idem::Disposition::duplicate);
    tally.failed = metrics.deliveries("capture", idem::Disposition::failed);
    tally.refused_after_effect = metrics.commits_refused_after_effect("capture");
    tally.redeliveries = metrics.redeliveries("capture");
    std::printf("%s\n",
                metrics_chaos::summary_json(args, tally, gateway.calls(), charges.size(),
                                            repeated_calls, divergences, endpoint.port(), seconds)
                    .c_str());
    std::fflush(stdout);

    if (args.serve_seconds > 0)
        std::this_thread::sleep_for(std::chrono::seconds(args.serve_seconds));
    const bool ok = divergences == 0 && tally.processed == args.messages;
    return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    const Args args = metrics_chaos::parse(argc, argv);
    if (args.check_with_prometheus) return metrics_chaos::check_with_prometheus(args);
    return run_consumer(args);
}
