// The end-to-end driver (timed by hand, not Google Benchmark: each sample drains a stream filled
// beforehand), the RSS run and the --profile loops.
//   e2e_stream_sqlite    RedisStreamConsumer + IdempotentHandler on SQLite draining N entries  vs
//                        XREADGROUP + the same INSERTs by hand + XACK
//   e2e_stream_postgres  the same with PostgresStore / libpq
//   rss_flat             1,000,000 messages through handle_batch on SQLite (batch 100), RSS
//                        sampled every 100,000

#include <malloc.h>
#include <sqlite3.h>

#include <charconv>
#include <chrono>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "bench.hpp"
#include "idem/broker/redis_streams.hpp"
#include "idem/idem.hpp"
#include "idem/observers/prometheus.hpp"
#include "idem/store/memory.hpp"
#include "idem/store/postgres.hpp"
#include "idem/store/redis.hpp"
#include "idem/store/sqlite.hpp"

namespace idem_bench {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// The consumer's batch mode (reads feed handle_batch, one XACK per batch), when this version of
// RedisStreamConsumerOptions has it; until then each entry is its own handle() and XACK.
template <class T, class = void>
struct has_batch_mode : std::false_type {};
template <class T>
struct has_batch_mode<T, std::void_t<decltype(std::declval<T&>().handle_in_batches)>>
    : std::true_type {};
constexpr bool consumer_batches = has_batch_mode<idem::RedisStreamConsumerOptions>::value;

constexpr const char* group = "bench";
constexpr const char* consumer_name = "c1";
constexpr int read_count = 100;
constexpr auto drain_deadline = 300s;

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

std::int64_t parse_amount(std::string_view text) {
    std::int64_t value = 0;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (error != std::errc{} || end != text.data() + text.size()) {
        throw std::runtime_error("bad amount '" + std::string(text) + "'");
    }
    return value;
}

/// N entries {order: <prefix><k>, amount: <k>} and the consumer group, untimed.
void fill(RawRedis& redis, const std::string& stream, const std::string& prefix, std::size_t n) {
    redis.command({"DEL", stream});
    std::vector<std::vector<std::string>> commands;
    for (std::size_t k = 1; k <= n; ++k) {
        commands.push_back({"XADD", stream, "*", "order", prefix + std::to_string(k), "amount",
                            std::to_string(k)});
        if (commands.size() == 1000 || k == n) {
            redis.pipeline(commands);
            commands.clear();
        }
    }
    redis.command({"XGROUP", "CREATE", stream, group, "0"});
}

struct Entry {
    std::string id;
    std::string order;
    std::int64_t amount = 0;
};

/// XREADGROUP ... COUNT read_count STREAMS <stream> >; empty when the stream is drained.
std::vector<Entry> read_entries(RawRedis& redis, const std::string& stream) {
    auto reply = redis.command({"XREADGROUP", "GROUP", group, consumer_name, "COUNT",
                                std::to_string(read_count), "STREAMS", stream, ">"});
    std::vector<Entry> entries;
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements == 0) return entries;
    const redisReply* items = reply->element[0]->element[1];
    entries.reserve(items->elements);
    for (std::size_t i = 0; i < items->elements; ++i) {
        const redisReply* item = items->element[i];
        Entry entry;
        entry.id.assign(item->element[0]->str, item->element[0]->len);
        const redisReply* fields = item->element[1];
        for (std::size_t f = 0; f + 1 < fields->elements; f += 2) {
            const std::string_view name(fields->element[f]->str, fields->element[f]->len);
            const std::string_view value(fields->element[f + 1]->str, fields->element[f + 1]->len);
            if (name == "order") entry.order = std::string(value);
            if (name == "amount") entry.amount = parse_amount(value);
        }
        entries.push_back(std::move(entry));
    }
    return entries;
}

/// The raw twin of the consumer: read, write by hand, ack. Returns messages per second.
template <class Raw>
double drain_raw(Raw& raw, RawRedis& redis, const std::string& stream, std::size_t n) {
    const auto start = Clock::now();
    std::size_t done = 0;
    while (done < n) {
        const std::vector<Entry> entries = read_entries(redis, stream);
        if (entries.empty()) throw std::runtime_error("raw: the stream ran dry early");
        if (consumer_batches) {
            raw.begin();
            for (const auto& entry : entries) {
                raw.insert_claim(scope, entry.order);
                raw.insert_effect(entry.order, entry.amount);
            }
            raw.commit();
            std::vector<std::string> ack{"XACK", stream, group};
            for (const auto& entry : entries)
                ack.push_back(entry.id);
            redis.command(ack);
        } else {
            for (const auto& entry : entries) {
                raw.begin();
                raw.insert_claim(scope, entry.order);
                raw.insert_effect(entry.order, entry.amount);
                raw.commit();
                redis.command({"XACK", stream, group, entry.id});
            }
        }
        done += entries.size();
        if (Clock::now() - start > drain_deadline) throw std::runtime_error("raw: too slow");
    }
    return static_cast<double>(n) / seconds_since(start);
}

/// RedisStreamConsumer + the idem handler draining the stream. Returns messages per second.
template <class Handler>
double drain_idem(Handler& handler, const std::string& stream, std::size_t n) {
    idem::RedisStreamConsumerOptions options;
    options.stream = stream;
    options.group = group;
    options.consumer = consumer_name;
    options.id_field = "order";
    options.batch_size = read_count;
    options.poll_wait = 100ms;
    if constexpr (consumer_batches) options.handle_in_batches = true;
    idem::RedisStreamConsumer consumer{redis_endpoint(), options, handler};
    const auto start = Clock::now();
    std::size_t handled = 0;
    while (handled < n) {
        handled += consumer.poll_once();
        if (Clock::now() - start > drain_deadline) throw std::runtime_error("idem: too slow");
    }
    const double rate = static_cast<double>(n) / seconds_since(start);
    const auto stats = consumer.stats();
    if (stats.acked != n || stats.not_acked != 0 || stats.dead_lettered != 0) {
        throw std::runtime_error(fmt::format("idem: {} entries, {} acked, {} not acked, {} dead", n,
                                             stats.acked, stats.not_acked, stats.dead_lettered));
    }
    return rate;
}

/// Round trips of the idem store (PostgreSQL), or nothing.
template <class Store>
std::optional<std::uint64_t> store_round_trips(Store& store) {
    if constexpr (std::is_same_v<Store, idem::PostgresStore>) {
        return store.round_trips();
    } else {
        return std::nullopt;
    }
}
template <class Raw>
std::optional<std::uint64_t> raw_round_trips(Raw& raw) {
    if constexpr (std::is_same_v<Raw, RawPostgres>) {
        return raw.round_trips();
    } else {
        return std::nullopt;
    }
}

template <class Handler, class Raw>
void e2e_case(const std::string& bench, const std::string& store_name, Handler& handler, Raw& raw,
              std::size_t n, pid_t backend) {
    auto& server = redis_server();
    RawRedis redis{server.host(), server.port()};
    PinScope pin;
    std::vector<double> idem_rates;
    std::vector<double> raw_rates;
    std::optional<std::uint64_t> idem_trips;  // of the store (the last sample)
    std::optional<std::uint64_t> raw_trips;
    static int streams = 0;
    for (int round = 0; round < config().rounds; ++round) {
        const bool idem_first = round % 2 == 0;
        for (int k = 0; k < 2; ++k) {
            const bool is_idem = (k == 0) == idem_first;
            const int number = ++streams;
            const std::string stream = fmt::format("e2e:{}:{}", store_name, number);
            fill(redis, stream, fmt::format("{}-{}-", is_idem ? "i" : "r", number), n);
            if (is_idem) {
                const auto before = store_round_trips(handler.store());
                idem_rates.push_back(drain_idem(handler, stream, n));
                if (before) idem_trips = *store_round_trips(handler.store()) - *before;
            } else {
                const auto before = raw_round_trips(raw);
                raw_rates.push_back(drain_raw(raw, redis, stream, n));
                if (before) raw_trips = *raw_round_trips(raw) - *before;
            }
            redis.command({"DEL", stream});
        }
    }
    const double idem_rate = median(idem_rates);
    const double raw_rate = median(raw_rates);
    Json line;
    line.str("bench", bench)
        .str("store", store_name)
        .integer("batch", consumer_batches ? read_count : 1)
        .num("idem_msgs_per_s", idem_rate)
        .num("raw_msgs_per_s", raw_rate)
        .num("ratio", idem_rate / raw_rate, 3)
        .num("paired_ratio", paired_ratio(idem_rates, raw_rates), 3)
        .num("idem_ns_per_msg", 1e9 / idem_rate)
        .num("raw_ns_per_msg", 1e9 / raw_rate)
        .nums("idem_samples", idem_rates, 0)
        .nums("raw_samples", raw_rates, 0)
        .integer("rounds", config().rounds)
        .integer("messages", static_cast<long long>(n))
        .str("mode", consumer_batches ? "batch: handle_batch per read, one XACK per read"
                                      : "per_entry: poll_once(), handle() and XACK per entry")
        .integer("read_count", read_count);
    if (idem_trips && raw_trips) {
        line.num("idem_db_round_trips_per_msg", static_cast<double>(*idem_trips) / n, 3)
            .num("raw_db_round_trips_per_msg", static_cast<double>(*raw_trips) / n, 3);
    }
    add_pinning(line, pin.active(), server.pid());
    if (backend > 0) line.str("postgres_cpus", process_cpus(backend));
    emit(line);
}

Order order_of(const idem::StreamEntry& entry) {
    const auto order = entry.field("order");
    const auto amount = entry.field("amount");
    if (!order || !amount) throw idem::malformed_message("no order or amount field");
    return Order{std::string(*order), parse_amount(*amount)};
}

}  // namespace

// ---------------------------------------------------------------------------------------------

void run_e2e_cases() {
    if (selected("e2e_stream_sqlite")) {
        note("e2e_stream_sqlite");
        idem::SqliteOptions options;
        options.synchronous = idem::Synchronous::normal;
        idem::SqliteStore store{(config().sqlite_dir / "e2e_idem.db").string(), options};
        create_sqlite_effects(store.db(), "effects");
        RawSqlite raw{config().sqlite_dir / "e2e_raw.db"};
        auto handler = idem::make_handler(
            store, idem::Policy{scope}, [](auto& tx, const idem::StreamEntry& entry) {
                const Order o = order_of(entry);
                tx.execute("INSERT INTO effects(order_id, amount) VALUES (?1, ?2)", o.order_id,
                           o.amount);
            });
        try {
            e2e_case("e2e_stream_sqlite", "sqlite", handler, raw, config().e2e_messages, 0);
        } catch (const std::exception& e) {
            emit(Json()
                     .str("bench", "e2e_stream_sqlite")
                     .str("store", "sqlite")
                     .str("error", e.what()));
        }
    }
    if (selected("e2e_stream_postgres")) {
        note("e2e_stream_postgres");
        try {
            auto& server = postgres_server();
            const std::string conninfo = server.conninfo();
            idem::PostgresStore store{conninfo};
            create_postgres_effects(conninfo, "e2e_idem_effects");
            RawPostgres raw{conninfo, "e2e_raw_effects"};
            auto handler = idem::make_handler(
                store, idem::Policy{scope}, [](auto& tx, const idem::StreamEntry& entry) {
                    const Order o = order_of(entry);
                    tx.execute("INSERT INTO e2e_idem_effects(order_id, amount) VALUES ($1, $2)",
                               o.order_id, o.amount);
                });
            e2e_case("e2e_stream_postgres", "postgres", handler, raw, config().e2e_pg_messages,
                     PQbackendPID(store.conn()));
        } catch (const std::exception& e) {
            emit(Json()
                     .str("bench", "e2e_stream_postgres")
                     .str("store", "postgres")
                     .str("error", e.what()));
        }
    }
}

// ---------------------------------------------------------------------------------------------

void run_rss_case() {
    if (!selected("rss_flat")) return;
    note(fmt::format("rss_flat ({} messages)", config().rss_messages));
    idem::SqliteOptions options;
    options.synchronous = idem::Synchronous::normal;
    idem::SqliteStore store{(config().sqlite_dir / "rss.db").string(), options};
    create_sqlite_effects(store.db(), "effects");
    auto handler = idem::make_handler(store, idem::Policy{scope}, sqlite_effect);
    const std::size_t total = config().rss_messages;
    const std::size_t every = config().rss_every;
    std::vector<long long> rss;
    std::vector<long long> sqlite_heap;
    std::vector<long long> heap;  // bytes in use in malloc (glibc mallinfo2), all of the process
    std::vector<idem::Delivery> deliveries;
    std::vector<Order> bodies;
    std::uint64_t seq = 0;
    const long long rss_before = rss_kb();
    const auto start = Clock::now();
    while (seq < total) {
        next_batch(seq, deliveries, bodies);
        for (const auto& outcome : handler.handle_batch(deliveries, bodies)) {
            if (outcome.disposition != idem::Disposition::processed) {
                emit(Json()
                         .str("bench", "rss_flat")
                         .str("store", "sqlite")
                         .str("error", outcome.reason));
                return;
            }
        }
        if (seq % every == 0) {
            rss.push_back(rss_kb());
            sqlite_heap.push_back(sqlite3_memory_used() / 1024);
            const struct mallinfo2 info = mallinfo2();
            heap.push_back(static_cast<long long>((info.uordblks + info.hblkhd) / 1024));
        }
    }
    const double elapsed = seconds_since(start);
    const auto cache_size = store.query_int("PRAGMA cache_size");
    Json line;
    line.str("bench", "rss_flat")
        .str("store", "sqlite")
        .integer("batch", batch_size)
        .integer("messages", static_cast<long long>(total))
        .integer("sample_every", static_cast<long long>(every))
        .ints("rss_kb", rss)
        .integer("growth_kb", rss.empty() ? 0 : rss.back() - rss.front())
        .integer("rss_before_kb", rss_before)
        .ints("malloc_in_use_kb", heap)
        .integer("malloc_growth_kb", heap.empty() ? 0 : heap.back() - heap.front())
        .ints("sqlite_heap_kb", sqlite_heap)
        .integer("sqlite_heap_growth_kb",
                 sqlite_heap.empty() ? 0 : sqlite_heap.back() - sqlite_heap.front())
        .integer("sqlite_cache_size", cache_size.value_or(0))
        .num("idem_msgs_per_s", static_cast<double>(total) / elapsed)
        .str("growth_is",
             "last sample minus the first (taken after the first 'sample_every' "
             "messages, the warm-up)");
    emit(line);
}

// ---------------------------------------------------------------------------------------------
// --profile: one side of a case alone, for callgrind (--toggle-collect='*profiled_loop*')

namespace {

/// The raw twins, for the same instruction counts without idem.
void loop_raw_memory(idem::MemoryStore& store, std::uint64_t& seq, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
        const std::string id = message_id(++seq);
        auto tx = store.begin();
        if (tx.claim(scope, id).status != idem::ClaimStatus::claimed) {
            throw std::runtime_error("profile: claim refused");
        }
        tx.record_outcome(scope, id, idem::Disposition::processed, {});
        tx.commit();
    }
}

void loop_raw_sqlite(RawSqlite& raw, std::uint64_t& seq, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i)
        raw_single(raw, seq);
}

void loop_raw_sqlite_batch(RawSqlite& raw, std::uint64_t& seq, std::size_t n) {
    for (std::size_t i = 0; i < n; i += batch_size)
        raw_batch(raw, seq);
}

}  // namespace

int run_profile(const std::string& name, std::size_t messages) {
    if (name == "memory_single") {
        idem::MemoryStore store;
        auto handler = idem::make_handler(store, idem::Policy{scope},
                                          [](idem::MemoryStore::Transaction&, const Order&) {});
        return profile_with(loop_single, handler, name, messages);
    }
    if (name == "memory_observed") {  // memory_single with a PrometheusObserver
        idem::MemoryStore store;
        idem::PrometheusObserver metrics;
        auto handler = idem::make_handler(
            store, idem::Policy{scope}, [](idem::MemoryStore::Transaction&, const Order&) {},
            &metrics);
        return profile_with(loop_single, handler, name, messages);
    }
    if (name == "sqlite_single" || name == "sqlite_batch") {
        idem::SqliteOptions options;
        options.synchronous = idem::Synchronous::normal;
        idem::SqliteStore store{(config().sqlite_dir / "profile.db").string(), options};
        create_sqlite_effects(store.db(), "effects");
        auto handler = idem::make_handler(store, idem::Policy{scope}, sqlite_effect);
        if (name == "sqlite_single") {
            return profile_with(loop_single, handler, name, messages);
        }
        return profile_with(loop_batch, handler, name, messages);
    }
    if (name == "memory_single_raw") {
        idem::MemoryStore store;
        return profile_with(loop_raw_memory, store, name, messages);
    }
    if (name == "sqlite_single_raw" || name == "sqlite_batch_raw") {
        RawSqlite raw{config().sqlite_dir / "profile_raw.db"};
        return profile_with(name == "sqlite_single_raw" ? loop_raw_sqlite : loop_raw_sqlite_batch,
                            raw, name, messages);
    }
    if (name == "redis_single") {
        idem::RedisStore store{redis_endpoint()};
        auto handler = idem::make_handler(store, idem::Policy{scope}, redis_claim_only_effect);
        return profile_with(loop_single, handler, name, messages);
    }
    if (name == "redis_single_local") {
        idem::RedisStore store{redis_endpoint()};
        store.warm_up();
        auto handler =
            idem::make_handler(store, idem::Policy{scope}, idem::local_effect(redis_write_effect));
        return profile_with(loop_single, handler, name, messages);
    }
    if (name == "redis_loop_local_one_step" || name == "redis_loop_local_pipelined") {
        // redis_single_local's effect through a PipelinedLoop: the one-step path (the loop's
        // default for a local effect) or the pipelined two-step path. Twin:
        // redis_single_local_raw.
        idem::RedisStore store{redis_endpoint()};
        store.warm_up();
        auto handler =
            idem::make_handler(store, idem::Policy{scope}, idem::local_effect(redis_write_effect));
        const auto path = name == "redis_loop_local_one_step"
                              ? idem::LocalEffectPath::claim_and_commit
                              : idem::LocalEffectPath::pipelined;
        auto loop = idem::pipelined_loop<std::uint64_t>(handler, path);
        auto each = [](auto& l, std::uint64_t& seq, std::size_t n) {
            for (std::size_t i = 0; i < n; ++i) {
                std::string id = message_id(++seq);
                const Order order{id, static_cast<std::int64_t>(seq)};
                for (const auto& settled : l.handle(idem::Delivery{std::move(id), 1u}, order, seq))
                    require_processed(settled.outcome, "profile");
            }
            for (const auto& settled : l.flush())
                require_processed(settled.outcome, "profile");
        };
        return profile_with(each, loop, name, messages);
    }
    if (name == "redis_single_write") {
        idem::RedisStore store{redis_endpoint()};
        auto handler = idem::make_handler(store, idem::Policy{scope}, redis_write_effect);
        return profile_with(loop_single, handler, name, messages);
    }
    if (name == "redis_single_raw" || name == "redis_single_local_raw") {
        // The raw twins: one SET NX; SET NX and the effect's SET pipelined.
        auto& server = redis_server();
        RawRedis raw{server.host(), server.port()};
        const bool with_write = name == "redis_single_local_raw";
        auto loop = [with_write](RawRedis& r, std::uint64_t& seq, std::size_t n) {
            std::vector<std::vector<std::string>> both(2);
            for (std::size_t i = 0; i < n; ++i) {
                const std::string id = message_id(++seq) + "-raw";
                if (!with_write) {
                    (void)r.set_nx("raw:" + id);
                    continue;
                }
                both[0] = {"SET", "raw:" + id, "1", "NX"};
                both[1] = {"SET", "rawfx:" + id, "1"};
                r.pipeline(both);
            }
        };
        return profile_with(loop, raw, name, messages);
    }
    if (name == "redis_stream_consumer") {
        // The RedisStreamConsumer's own loop: every entry added before the collected part, then
        // poll_once() until all are handled (100 a poll, each commit with the next claim and the
        // entry's XACK in the commit). Its twin is redis_single_raw (one SET NX a message).
        auto& server = redis_server();
        idem::RedisStore store{redis_endpoint()};
        store.warm_up();
        auto handler =
            idem::make_handler(store, idem::Policy{scope}, [](auto&, const idem::StreamEntry&) {});
        const std::string stream = "profile:consumer";
        RawRedis feeder{server.host(), server.port()};
        feeder.command({"DEL", stream});
        auto fill = [&](std::uint64_t first, std::size_t n) {
            std::vector<std::vector<std::string>> adds;
            for (std::size_t i = 0; i < n; ++i)
                adds.push_back({"XADD", stream, "*", "order", "s" + message_id(first + i)});
            feeder.pipeline(adds);
        };
        idem::RedisStreamConsumerOptions options;
        options.stream = stream;
        options.group = "g";
        options.consumer = "c";
        options.batch_size = 100;
        options.poll_wait = std::chrono::milliseconds(100);
        options.id_field = "order";
        idem::RedisStreamConsumer consumer{store.endpoint(), options, handler};
        auto loop = [](auto& c, std::uint64_t& seq, std::size_t n) {
            for (std::size_t done = 0; done < n;) {
                const std::size_t handled = c.poll_once();
                if (handled == 0) throw std::runtime_error("profile: poll_once() handled nothing");
                done += handled;
                seq += handled;
            }
        };
        fill(1, 1000);
        fill(1001, messages);
        std::uint64_t seq = 0;
        loop(consumer, seq, 1000);  // warm-up
        const auto start = Clock::now();
        profiled_loop(loop, consumer, seq, messages);
        if (consumer.stats().acked_in_commit != seq) {
            throw std::runtime_error("profile: an entry was not acked in its commit");
        }
        emit(Json()
                 .str("profile", name)
                 .integer("messages", static_cast<long long>(messages))
                 .num("seconds", seconds_since(start), 3));
        return 0;
    }
    if (name == "redis_batch") {
        idem::RedisStore store{redis_endpoint()};
        auto handler = idem::make_handler(store, idem::Policy{scope}, redis_claim_only_effect);
        return profile_with(loop_batch, handler, name, messages);
    }
    if (name == "redis_batch_raw") {  // 100 SET NX, pipelined
        auto& server = redis_server();
        RawRedis raw{server.host(), server.port()};
        auto loop = [](RawRedis& r, std::uint64_t& seq, std::size_t n) {
            std::vector<std::string> keys;
            for (std::size_t i = 0; i < n; i += batch_size) {
                keys.clear();
                for (int k = 0; k < batch_size; ++k)
                    keys.push_back("raw:" + message_id(++seq));
                if (r.set_nx_pipelined(keys) != keys.size()) {
                    throw std::runtime_error("profile: SET NX refused a new key");
                }
            }
        };
        return profile_with(loop, raw, name, messages);
    }
    if (name == "redis_replicas_to_ack") {  // twin: redis_single (the same, no WAIT)
        const auto replica = synced_replica(redis_server());
        idem::RedisOptions options;
        options.replicas_to_ack = 1;
        options.replicas_timeout = std::chrono::milliseconds(1000);
        idem::RedisStore store{redis_endpoint(), options};
        auto handler = idem::make_handler(store, idem::Policy{scope}, redis_claim_only_effect);
        return profile_with(loop_single, handler, name, messages);
    }
    if (name == "redis_stream_pipelined") {
        // As the case: XREADGROUP COUNT 100 on a connection of its own (entries added before),
        // each entry through a PipelinedLoop with its XACK as the commit hook. Twin:
        // redis_single_raw.
        auto& server = redis_server();
        idem::RedisStore store{redis_endpoint()};
        store.warm_up();
        auto handler = idem::make_handler(store, idem::Policy{scope}, redis_claim_only_effect);
        const std::string stream = "profile:pipelined";
        RawRedis reader{server.host(), server.port()};
        reader.command({"DEL", stream});
        reader.command({"XGROUP", "CREATE", stream, "g", "0", "MKSTREAM"});
        for (std::uint64_t first = 1; first <= 1000 + messages; first += 100) {
            std::vector<std::vector<std::string>> adds;
            for (std::uint64_t i = first; i < first + 100; ++i)
                adds.push_back({"XADD", stream, "*", "order", message_id(i)});
            reader.pipeline(adds);
        }
        auto pipelined = idem::pipelined_loop(handler);
        auto check = [](const auto& settled) {
            for (const auto& s : settled) {
                if (s.outcome.disposition != idem::Disposition::processed || !s.acked_in_commit)
                    throw std::runtime_error("profile: an entry was not processed and acked");
            }
        };
        auto loop = [&](auto& l, std::uint64_t& seq, std::size_t n) {
            for (std::size_t done = 0; done < n;) {
                auto reply = reader.command(
                    {"XREADGROUP", "GROUP", "g", "c", "COUNT", "100", "STREAMS", stream, ">"});
                const redisReply* items = reply->element[0]->element[1];
                for (std::size_t i = 0; i < items->elements; ++i) {
                    const redisReply* item = items->element[i];
                    const redisReply* fields = item->element[1];
                    std::string entry_id(item->element[0]->str, item->element[0]->len);
                    std::string id(fields->element[1]->str, fields->element[1]->len);
                    ++seq;
                    idem::CommitHook hook{
                        idem::redis::StreamAck{store.endpoint(), stream, "g", entry_id}};
                    check(l.handle(idem::Delivery{id, 1u}, Order{id, 1}, std::move(entry_id),
                                   std::move(hook)));
                }
                check(l.flush());  // before the next read, as a loop does
                done += items->elements;
                if (items->elements == 0) throw std::runtime_error("profile: the stream ran dry");
            }
        };
        return profile_with(loop, pipelined, name, messages);
    }
    if (name.rfind("redis_cluster_", 0) == 0) return run_cluster_profile(name, messages);
    if (name == "postgres_single") {
        const std::string conninfo = postgres_server().conninfo();
        idem::PostgresStore store{conninfo};
        create_postgres_effects(conninfo, "idem_effects");
        auto handler = idem::make_handler(store, idem::Policy{scope}, postgres_effect);
        return profile_with(loop_single, handler, name, messages);
    }
    note(
        "--profile: one of memory_single, memory_observed, sqlite_single, sqlite_batch, "
        "redis_single, redis_single_write, redis_single_local, redis_stream_consumer, "
        "redis_stream_pipelined, redis_batch, redis_replicas_to_ack, "
        "redis_loop_local_one_step, redis_loop_local_pipelined, redis_cluster_single, "
        "redis_cluster_batch, postgres_single, or "
        "memory_single_raw, sqlite_single_raw, sqlite_batch_raw, redis_single_raw, "
        "redis_single_local_raw, redis_batch_raw, redis_cluster_single_raw, "
        "redis_cluster_batch_raw");
    return 2;
}

}  // namespace idem_bench
