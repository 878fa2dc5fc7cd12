// The store cases, each an idem benchmark and its raw twin (Google Benchmark), run alternately:
//   memory_single    handler.handle on MemoryStore (trivial effect)  vs  begin/claim/record/commit
//   sqlite_single    handler.handle, one transaction per message      vs  BEGIN IMMEDIATE; INSERT
//                                                                          claim; INSERT effect;
//                                                                          COMMIT (prepared)
//   sqlite_batch     handle_batch of 100                              vs  the same 200 INSERTs in
//                                                                          one transaction
//   postgres_single  handler.handle on PostgresStore                  vs  BEGIN, INSERT claim,
//                                                                          INSERT effect, COMMIT
//   postgres_batch   handle_batch of 100                              vs  BEGIN, 200 INSERTs,
//                                                                          COMMIT
//   redis_single     handler.handle on RedisStore, effect tx.write    vs  one SET NX (hiredis)
//   redis_batch      handle_batch of 100                              vs  100 SET NX pipelined

#include <benchmark/benchmark.h>

#include <cctype>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "bench.hpp"
#include "idem/idem.hpp"
#include "idem/store/memory.hpp"
#include "idem/store/postgres.hpp"
#include "idem/store/redis.hpp"
#include "idem/store/sqlite.hpp"

namespace idem_bench {
namespace {

constexpr std::uint64_t memory_reset_every = 10'000;

/// A sample runs for config().min_time, or exactly @p iterations when given.
template <class Fn>
void add(const std::string& name, Fn&& fn, benchmark::IterationCount iterations = 0) {
    auto* bench = benchmark::RegisterBenchmark(name.c_str(), std::forward<Fn>(fn))
                      ->UseRealTime()
                      ->Unit(benchmark::kMicrosecond);
    if (iterations > 0) {
        bench->Iterations(iterations);
    } else {
        bench->MinTime(config().min_time);
    }
}

bool processed(benchmark::State& state, const idem::Outcome& outcome) {
    if (outcome.disposition == idem::Disposition::processed) return true;
    state.SkipWithError(
        fmt::format("outcome {}: {}", idem::to_string(outcome.disposition), outcome.reason)
            .c_str());
    return false;
}

bool all_processed(benchmark::State& state, const std::vector<idem::Outcome>& outcomes) {
    for (const auto& outcome : outcomes) {
        if (!processed(state, outcome)) return false;
    }
    return true;
}

/// The "met" of a ratio target.
void ratio_target(Json& line, const Alternated& result, double at_least) {
    if (!result.error.empty()) return;
    line.str("target", fmt::format("ratio >= {:.2f}", at_least))
        .boolean("met", result.idem_rate() / result.raw_rate() >= at_least);
}

/// The "times idem single" of a batch case; nullopt when the single case did not run.
std::optional<double> versus(const Alternated& batch, const std::optional<Alternated>& single) {
    if (!batch.error.empty() || !single || !single->error.empty()) return std::nullopt;
    return batch.idem_rate() / single->idem_rate();
}

}  // namespace

// ---------------------------------------------------------------------------------------------

void run_memory_cases() {
    if (!selected("memory_single")) return;
    note("memory_single");
    // A fresh store every memory_reset_every messages (untimed), on both sides: the claims map
    // stays the size of a unit test's (a std::map that grows without bound would measure cache
    // misses of its own nodes, not the handler).
    add("memory_single/idem", [](benchmark::State& state) {
        std::uint64_t effects = 0;
        auto effect = [&effects](idem::MemoryStore::Transaction&, const Order&) { ++effects; };
        using Handler = idem::IdempotentHandler<idem::MemoryStore, decltype(effect)>;
        auto store = std::make_unique<idem::MemoryStore>();
        std::optional<Handler> handler;
        handler.emplace(*store, idem::Policy{scope}, effect);
        const Order order{"o", 1};
        std::uint64_t seq = 0;
        for (auto _ : state) {
            if (seq % memory_reset_every == memory_reset_every - 1) {
                state.PauseTiming();
                handler.reset();
                store = std::make_unique<idem::MemoryStore>();
                handler.emplace(*store, idem::Policy{scope}, effect);
                state.ResumeTiming();
            }
            const idem::Delivery delivery{message_id(++seq), 1};
            if (!processed(state, handler->handle(delivery, order))) break;
        }
        benchmark::DoNotOptimize(effects);
        state.counters["msgs"] = static_cast<double>(seq);
    });
    add("memory_single/raw", [](benchmark::State& state) {
        auto store = std::make_unique<idem::MemoryStore>();
        std::uint64_t effects = 0;
        std::uint64_t seq = 0;
        for (auto _ : state) {
            if (seq % memory_reset_every == memory_reset_every - 1) {
                state.PauseTiming();
                store = std::make_unique<idem::MemoryStore>();
                state.ResumeTiming();
            }
            const std::string id = message_id(++seq);
            auto tx = store->begin();
            if (tx.claim(scope, id).status != idem::ClaimStatus::claimed) {
                state.SkipWithError("claim refused");
                break;
            }
            ++effects;
            tx.record_outcome(scope, id, idem::Disposition::processed, {});
            tx.commit();
        }
        benchmark::DoNotOptimize(effects);
        state.counters["msgs"] = static_cast<double>(seq);
    });

    const Alternated result = alternate("memory_single/idem", "memory_single/raw");
    Json line;
    add_rates(line, "memory_single", "memory", 1, result);
    if (result.error.empty()) {
        const double idem_ns = result.idem_ns();
        const double overhead = idem_ns - result.raw_ns();
        // "met" is the strict reading: a whole message through handler.handle on MemoryStore.
        // The handler's own share (idem minus the same store calls by hand) is met_overhead.
        line.num("ns_per_msg", idem_ns)
            .integer("store_reset_every", static_cast<long long>(memory_reset_every))
            .num("overhead_ns_per_msg", overhead)
            .str("target", "idem ns_per_msg < 1000 (met); idem - raw < 1000 (met_overhead)")
            .boolean("met", idem_ns < 1000)
            .boolean("met_overhead", overhead < 1000);
    }
    emit(line);
    benchmark::ClearRegisteredBenchmarks();
}

// ---------------------------------------------------------------------------------------------

void run_sqlite_cases() {
    const bool single = selected("sqlite_single");
    const bool batch = selected("sqlite_batch");
    if (!single && !batch) return;

    idem::SqliteOptions options;
    options.wal = true;
    options.synchronous = idem::Synchronous::normal;
    idem::SqliteStore store{(config().sqlite_dir / "idem.db").string(), options};
    create_sqlite_effects(store.db(), "effects");
    RawSqlite raw{config().sqlite_dir / "raw.db"};
    auto handler = idem::make_handler(store, idem::Policy{scope}, [](auto& tx, const Order& o) {
        tx.execute("INSERT INTO effects(order_id, amount) VALUES (?1, ?2)", o.order_id, o.amount);
    });
    std::uint64_t idem_seq = 0;
    std::uint64_t raw_seq = 0;

    add("sqlite_single/idem", [&](benchmark::State& state) {
        const std::uint64_t first = idem_seq;
        for (auto _ : state) {
            std::string id = message_id(++idem_seq);
            const Order order{id, static_cast<std::int64_t>(idem_seq)};
            if (!processed(state, handler.handle(idem::Delivery{std::move(id), 1}, order))) break;
        }
        state.counters["msgs"] = static_cast<double>(idem_seq - first);
    });
    add("sqlite_single/raw", [&](benchmark::State& state) {
        const std::uint64_t first = raw_seq;
        for (auto _ : state) {
            const std::string id = message_id(++raw_seq);
            raw.begin();
            raw.insert_claim(scope, id);
            raw.insert_effect(id, static_cast<std::int64_t>(raw_seq));
            raw.commit();
        }
        state.counters["msgs"] = static_cast<double>(raw_seq - first);
    });
    add("sqlite_batch/idem", [&](benchmark::State& state) {
        const std::uint64_t first = idem_seq;
        std::vector<idem::Delivery> deliveries;
        std::vector<Order> bodies;
        for (auto _ : state) {
            next_batch(idem_seq, deliveries, bodies);
            if (!all_processed(state, handler.handle_batch(deliveries, bodies))) break;
        }
        state.counters["msgs"] = static_cast<double>(idem_seq - first);
    });
    add("sqlite_batch/raw", [&](benchmark::State& state) {
        const std::uint64_t first = raw_seq;
        for (auto _ : state) {
            raw.begin();
            for (int i = 0; i < batch_size; ++i) {
                const std::string id = message_id(++raw_seq);
                raw.insert_claim(scope, id);
                raw.insert_effect(id, static_cast<std::int64_t>(raw_seq));
            }
            raw.commit();
        }
        state.counters["msgs"] = static_cast<double>(raw_seq - first);
    });

    std::optional<Alternated> single_result;
    if (single) {
        note("sqlite_single");
        single_result = alternate("sqlite_single/idem", "sqlite_single/raw");
        Json line;
        add_rates(line, "sqlite_single", "sqlite", 1, *single_result);
        line.str("sqlite", "WAL, synchronous=NORMAL");
        ratio_target(line, *single_result, 0.90);
        emit(line);
    }
    if (batch) {
        note("sqlite_batch");
        const Alternated result = alternate("sqlite_batch/idem", "sqlite_batch/raw");
        Json line;
        add_rates(line, "sqlite_batch", "sqlite", batch_size, result);
        line.str("sqlite", "WAL, synchronous=NORMAL");
        if (result.error.empty()) {
            const bool ratio_met = result.idem_rate() / result.raw_rate() >= 0.70;
            const auto times = versus(result, single_result);
            if (times) {
                line.num("x_idem_single", *times, 2);
            } else {
                line.null("x_idem_single");
            }
            std::optional<bool> times_met;
            if (times) times_met = *times >= 10;
            std::optional<bool> met = times_met;  // undecided when sqlite_single did not run
            if (!ratio_met) met = false;
            line.str("target", "ratio >= 0.70 and idem >= 10x sqlite_single idem")
                .boolean("met_ratio", ratio_met)
                .maybe("met_x_single", times_met)
                .maybe("met", met);
        }
        emit(line);
    }
    benchmark::ClearRegisteredBenchmarks();
}

// ---------------------------------------------------------------------------------------------

namespace {

/// What each statement of idem's PostgreSQL transaction costs: the raw transaction (BEGIN,
/// INSERT claim, INSERT effect, COMMIT; a round trip each) with one of idem's extra statements
/// added at a time, then all of them, then idem itself (the same statements, pipelined into 3
/// round trips). Wall time, client CPU and the backend's CPU per message; medians of 3 rounds.
template <class Handler>
Json postgres_statement_costs(RawPostgres& raw, Handler& handler, std::uint64_t& idem_seq,
                              std::uint64_t& raw_seq, pid_t idem_backend, pid_t raw_backend) {
    struct Variant {
        const char* name;
        RawPostgres::Extras extras;
        bool idem;
        std::vector<double> wall, client, server;
    };
    std::vector<Variant> variants{
        {"raw", {}, false, {}, {}, {}},
        {"plus_set_local", {true, false, false, false}, false, {}, {}, {}},
        {"plus_claim_cte", {false, true, false, false}, false, {}, {}, {}},
        {"plus_savepoint_release", {false, false, true, false}, false, {}, {}, {}},
        {"plus_update_outcome", {false, false, false, true}, false, {}, {}, {}},
        {"plus_all_four", {true, true, true, true}, false, {}, {}, {}},
        {"idem_pipelined", {}, true, {}, {}, {}},
    };
    const int n = config().quick ? 200 : 1000;
    for (int round = 0; round < 3; ++round) {
        for (auto& v : variants) {
            const pid_t backend = v.idem ? idem_backend : raw_backend;
            const std::uint64_t server0 = task_cpu_ns(backend);
            const std::uint64_t client0 = thread_cpu_ns();
            const auto start = std::chrono::steady_clock::now();
            for (int i = 0; i < n; ++i) {
                if (v.idem) {
                    std::string id = message_id(++idem_seq);
                    const Order order{id, static_cast<std::int64_t>(idem_seq)};
                    const auto outcome = handler.handle(idem::Delivery{std::move(id), 1}, order);
                    if (outcome.disposition != idem::Disposition::processed) {
                        throw std::runtime_error("postgres_statement_costs: " + outcome.reason);
                    }
                } else {
                    const std::string id = message_id(++raw_seq);
                    raw.message(v.extras, scope, id, static_cast<std::int64_t>(raw_seq));
                }
            }
            const double wall =
                std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
                    .count();
            v.wall.push_back(wall / n);
            v.client.push_back(static_cast<double>(thread_cpu_ns() - client0) / 1000 / n);
            v.server.push_back(static_cast<double>(task_cpu_ns(backend) - server0) / 1000 / n);
        }
    }
    Json line;
    line.str("bench", "postgres_statement_costs")
        .str("store", "postgres")
        .str("unit", "us per message: wall, client CPU, server (backend) CPU; medians of 3 rounds")
        .integer("messages_per_sample", n);
    for (const auto& v : variants) {
        line.nums(v.name, {median(v.wall), median(v.client), median(v.server)}, 1);
    }
    return line;
}

}  // namespace

void run_postgres_cases() {
    const bool single = selected("postgres_single");
    const bool batch = selected("postgres_batch");
    if (!single && !batch) return;

    auto& server = postgres_server();
    PinScope pin;
    const std::string conninfo = server.conninfo();
    idem::PostgresStore store{conninfo};
    pg_exec(conninfo,
            "CREATE TABLE IF NOT EXISTS idem_effects(id BIGSERIAL PRIMARY KEY, order_id TEXT NOT "
            "NULL, amount BIGINT NOT NULL)");
    RawPostgres raw{conninfo, "raw_effects"};
    auto handler = idem::make_handler(store, idem::Policy{scope}, [](auto& tx, const Order& o) {
        tx.execute("INSERT INTO idem_effects(order_id, amount) VALUES ($1, $2)", o.order_id,
                   o.amount);
    });
    std::uint64_t idem_seq = 0;
    std::uint64_t raw_seq = 0;
    const pid_t idem_backend = PQbackendPID(store.conn());
    const pid_t raw_backend = PQbackendPID(raw.conn());

    add("postgres_single/idem", [&](benchmark::State& state) {
        const std::uint64_t server_cpu = task_cpu_ns(idem_backend);
        const std::uint64_t first = idem_seq;
        const auto trips = store.round_trips();
        for (auto _ : state) {
            std::string id = message_id(++idem_seq);
            const Order order{id, static_cast<std::int64_t>(idem_seq)};
            if (!processed(state, handler.handle(idem::Delivery{std::move(id), 1}, order))) break;
        }
        state.counters["msgs"] = static_cast<double>(idem_seq - first);
        state.counters["round_trips"] = static_cast<double>(store.round_trips() - trips);
        state.counters["server_cpu_ns"] =
            static_cast<double>(task_cpu_ns(idem_backend) - server_cpu);
    });
    add("postgres_single/raw", [&](benchmark::State& state) {
        const std::uint64_t server_cpu = task_cpu_ns(raw_backend);
        const std::uint64_t first = raw_seq;
        const auto trips = raw.round_trips();
        for (auto _ : state) {
            const std::string id = message_id(++raw_seq);
            raw.begin();
            raw.insert_claim(scope, id);
            raw.insert_effect(id, static_cast<std::int64_t>(raw_seq));
            raw.commit();
        }
        state.counters["msgs"] = static_cast<double>(raw_seq - first);
        state.counters["round_trips"] = static_cast<double>(raw.round_trips() - trips);
        state.counters["server_cpu_ns"] =
            static_cast<double>(task_cpu_ns(raw_backend) - server_cpu);
    });
    add("postgres_batch/idem", [&](benchmark::State& state) {
        const std::uint64_t server_cpu = task_cpu_ns(idem_backend);
        const std::uint64_t first = idem_seq;
        const auto trips = store.round_trips();
        std::vector<idem::Delivery> deliveries;
        std::vector<Order> bodies;
        for (auto _ : state) {
            next_batch(idem_seq, deliveries, bodies);
            if (!all_processed(state, handler.handle_batch(deliveries, bodies))) break;
        }
        state.counters["msgs"] = static_cast<double>(idem_seq - first);
        state.counters["round_trips"] = static_cast<double>(store.round_trips() - trips);
        state.counters["server_cpu_ns"] =
            static_cast<double>(task_cpu_ns(idem_backend) - server_cpu);
    });
    add("postgres_batch/raw", [&](benchmark::State& state) {
        const std::uint64_t server_cpu = task_cpu_ns(raw_backend);
        const std::uint64_t first = raw_seq;
        const auto trips = raw.round_trips();
        for (auto _ : state) {
            raw.begin();
            for (int i = 0; i < batch_size; ++i) {
                const std::string id = message_id(++raw_seq);
                raw.insert_claim(scope, id);
                raw.insert_effect(id, static_cast<std::int64_t>(raw_seq));
            }
            raw.commit();
        }
        state.counters["msgs"] = static_cast<double>(raw_seq - first);
        state.counters["round_trips"] = static_cast<double>(raw.round_trips() - trips);
        state.counters["server_cpu_ns"] =
            static_cast<double>(task_cpu_ns(raw_backend) - server_cpu);
    });

    if (single) {
        note("postgres_single");
        const Alternated result = alternate("postgres_single/idem", "postgres_single/raw");
        Json line;
        add_rates(line, "postgres_single", "postgres", 1, result);
        add_pinning(line, pin.active(), idem_backend);
        ratio_target(line, result, 0.90);
        emit(line);
    }
    if (batch) {
        note("postgres_batch");
        const Alternated result = alternate("postgres_batch/idem", "postgres_batch/raw");
        Json line;
        add_rates(line, "postgres_batch", "postgres", batch_size, result);
        add_pinning(line, pin.active(), idem_backend);
        emit(line);
    }
    if (single) {
        note("postgres_statement_costs");
        Json line =
            postgres_statement_costs(raw, handler, idem_seq, raw_seq, idem_backend, raw_backend);
        add_pinning(line, pin.active(), idem_backend);
        emit(line);
    }
    benchmark::ClearRegisteredBenchmarks();
}

// ---------------------------------------------------------------------------------------------

namespace {

/// Where a Redis message's server time goes: SLOWLOG with a 0 µs threshold records how long
/// each command ran inside redis-server (without reading, writing or the AOF fsync), for a few
/// hundred messages of each kind; medians per command kind.
template <class Handler>
Json redis_server_time(RawRedis& raw, Handler& handler, std::uint64_t& idem_seq,
                       std::uint64_t& raw_seq, pid_t server_pid) {
    constexpr int singles = 500;
    constexpr int batches = 10;
    raw.command({"CONFIG", "SET", "slowlog-max-len", "100000"});
    raw.command({"CONFIG", "SET", "slowlog-log-slower-than", "0"});
    raw.command({"SLOWLOG", "RESET"});
    const std::uint64_t cpu_before = task_cpu_ns(server_pid);
    for (int i = 0; i < singles; ++i) {
        std::string id = message_id(++idem_seq);
        const Order order{id, static_cast<std::int64_t>(idem_seq)};
        const auto outcome = handler.handle(idem::Delivery{std::move(id), 1}, order);
        if (outcome.disposition != idem::Disposition::processed) {
            throw std::runtime_error("redis_server_time: " + outcome.reason);
        }
        raw.set_nx("raw:" + message_id(++raw_seq));
    }
    std::vector<idem::Delivery> deliveries;
    std::vector<Order> bodies;
    std::vector<std::string> keys;
    for (int b = 0; b < batches; ++b) {
        next_batch(idem_seq, deliveries, bodies);
        (void)handler.handle_batch(deliveries, bodies);
        keys.clear();
        for (int i = 0; i < batch_size; ++i)
            keys.push_back("raw:" + message_id(++raw_seq));
        raw.set_nx_pipelined(keys);
    }
    const std::uint64_t cpu_ns = task_cpu_ns(server_pid) - cpu_before;
    raw.command({"CONFIG", "SET", "slowlog-log-slower-than", "10000"});
    auto log = raw.command({"SLOWLOG", "GET", "-1"});
    std::vector<double> claim, commit, commit_batch, set_nx;
    for (std::size_t i = 0; i < log->elements; ++i) {
        const redisReply* entry = log->element[i];
        if (entry->elements < 4) continue;
        const double us = static_cast<double>(entry->element[2]->integer);
        const redisReply* args = entry->element[3];
        if (args->elements < 3) continue;
        std::string name(args->element[0]->str, args->element[0]->len);
        for (auto& c : name)
            c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
        const std::string keys_arg(args->element[2]->str, args->element[2]->len);
        if (name == "EVALSHA") {
            if (keys_arg == "1") {
                claim.push_back(us);
            } else if (keys_arg == "2") {
                commit.push_back(us);
            } else {
                commit_batch.push_back(us);
            }
        } else if (name == "SET" &&
                   std::string_view(args->element[1]->str, args->element[1]->len).substr(0, 4) ==
                       "raw:") {
            set_nx.push_back(us);  // (commands a script runs are logged too: the effect's SET)
        }
    }
    Json line;
    line.str("bench", "redis_server_time")
        .str("store", "redis")
        .str("source",
             "SLOWLOG at 0 us: time each command ran inside redis-server, without I/O and AOF "
             "fsync; medians")
        .num("claim_script_us", median(claim), 1)
        .num("commit_script_us", median(commit), 1)
        .num("commit_script_batch100_us", median(commit_batch), 1)
        .num("set_nx_us", median(set_nx), 1)
        .integer("claims_logged", static_cast<long long>(claim.size()))
        .integer("commits_logged", static_cast<long long>(commit.size() + commit_batch.size()))
        .integer("set_nx_logged", static_cast<long long>(set_nx.size()))
        .num("server_cpu_us_total", static_cast<double>(cpu_ns) / 1000, 0)
        .integer("messages_each_side", singles + batches * batch_size);
    return line;
}

}  // namespace

void run_redis_cases() {
    const bool single = selected("redis_single");
    const bool batch = selected("redis_batch");
    if (!single && !batch) return;

    auto& server = redis_server();
    PinScope pin;
    idem::RedisStore store{redis_endpoint()};
    RawRedis raw{server.host(), server.port()};
    auto handler = idem::make_handler(store, idem::Policy{scope}, [](auto& tx, const Order& o) {
        tx.write("SET", "fx:" + o.order_id, "1");
    });
    std::uint64_t idem_seq = 0;
    std::uint64_t raw_seq = 0;
    const pid_t server_pid = server.pid();

    add("redis_single/idem", [&](benchmark::State& state) {
        const std::uint64_t server_cpu = task_cpu_ns(server_pid);
        const std::uint64_t first = idem_seq;
        const auto trips = store.round_trips();
        for (auto _ : state) {
            std::string id = message_id(++idem_seq);
            const Order order{id, static_cast<std::int64_t>(idem_seq)};
            if (!processed(state, handler.handle(idem::Delivery{std::move(id), 1}, order))) break;
        }
        state.counters["msgs"] = static_cast<double>(idem_seq - first);
        state.counters["round_trips"] = static_cast<double>(store.round_trips() - trips);
        state.counters["server_cpu_ns"] = static_cast<double>(task_cpu_ns(server_pid) - server_cpu);
    });
    add("redis_single/raw", [&](benchmark::State& state) {
        const std::uint64_t server_cpu = task_cpu_ns(server_pid);
        const std::uint64_t first = raw_seq;
        for (auto _ : state) {
            if (!raw.set_nx("raw:" + message_id(++raw_seq))) {
                state.SkipWithError("SET NX refused a new key");
                break;
            }
        }
        state.counters["msgs"] = static_cast<double>(raw_seq - first);
        state.counters["round_trips"] = static_cast<double>(raw_seq - first);
        state.counters["server_cpu_ns"] = static_cast<double>(task_cpu_ns(server_pid) - server_cpu);
    });
    add("redis_batch/idem", [&](benchmark::State& state) {
        const std::uint64_t server_cpu = task_cpu_ns(server_pid);
        const std::uint64_t first = idem_seq;
        const auto trips = store.round_trips();
        std::vector<idem::Delivery> deliveries;
        std::vector<Order> bodies;
        for (auto _ : state) {
            next_batch(idem_seq, deliveries, bodies);
            if (!all_processed(state, handler.handle_batch(deliveries, bodies))) break;
        }
        state.counters["msgs"] = static_cast<double>(idem_seq - first);
        state.counters["round_trips"] = static_cast<double>(store.round_trips() - trips);
        state.counters["server_cpu_ns"] = static_cast<double>(task_cpu_ns(server_pid) - server_cpu);
    });
    add("redis_batch/raw", [&](benchmark::State& state) {
        const std::uint64_t server_cpu = task_cpu_ns(server_pid);
        const std::uint64_t first = raw_seq;
        std::uint64_t batches = 0;
        std::vector<std::string> keys;
        for (auto _ : state) {
            keys.clear();
            for (int i = 0; i < batch_size; ++i)
                keys.push_back("raw:" + message_id(++raw_seq));
            ++batches;
            if (raw.set_nx_pipelined(keys) != keys.size()) {
                state.SkipWithError("SET NX refused a new key");
                break;
            }
        }
        state.counters["msgs"] = static_cast<double>(raw_seq - first);
        state.counters["round_trips"] = static_cast<double>(batches);
        state.counters["server_cpu_ns"] = static_cast<double>(task_cpu_ns(server_pid) - server_cpu);
    });

    std::optional<Alternated> single_result;
    if (single) {
        note("redis_single");
        single_result = alternate("redis_single/idem", "redis_single/raw");
        Json line;
        add_rates(line, "redis_single", "redis", 1, *single_result);
        add_pinning(line, pin.active(), server_pid);
        line.str("redis", "appendonly yes, appendfsync always (fixture), data dir on tmpfs");
        ratio_target(line, *single_result, 0.40);
        emit(line);
    }
    if (batch) {
        note("redis_batch");
        const Alternated result = alternate("redis_batch/idem", "redis_batch/raw");
        Json line;
        add_rates(line, "redis_batch", "redis", batch_size, result);
        add_pinning(line, pin.active(), server_pid);
        line.str("redis", "appendonly yes, appendfsync always (fixture), data dir on tmpfs");
        if (result.error.empty()) {
            const auto times = versus(result, single_result);
            if (times) {
                line.num("x_idem_single", *times, 2);
            } else {
                line.null("x_idem_single");
            }
            line.str("target", "idem >= 5x redis_single idem");
            line.maybe("met", times ? std::optional<bool>(*times >= 5) : std::nullopt);
        }
        emit(line);
    }
    note("redis_server_time");
    emit(redis_server_time(raw, handler, idem_seq, raw_seq, server_pid));
    benchmark::ClearRegisteredBenchmarks();
}

}  // namespace idem_bench
