#pragma once
/// @file
/// @brief StreamConsumer: reads a Redis Stream through a consumer group and hands each entry to a
/// handler as an idem::Delivery with the broker's true delivery count, acking only what the
/// outcome says to ack. Link idem::redis.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/broker/consumer.hpp"
#include "idem/circuit_breaker.hpp"
#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/delivery.hpp"
#include "idem/error.hpp"
#include "idem/handler.hpp"
#include "idem/outcome.hpp"
#include "idem/redelivery_backoff.hpp"
#include "idem/redis/cluster.hpp"
#include "idem/redis/connection.hpp"
#include "idem/redis/endpoint.hpp"
#include "idem/redis/reply.hpp"
#include "idem/redis/stream_ack.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief One entry of a stream, as read. Binary-safe: names and values are bytes.
struct StreamEntry {
    std::string stream;
    std::string id;  ///< the entry id, "<ms>-<seq>"
    std::vector<std::pair<std::string, std::string>> fields;

    /// @brief The value of the first field named @p name (a stream entry may repeat a name).
    [[nodiscard]] std::optional<std::string_view> field(std::string_view name) const {
        for (const auto& [key, value] : fields) {
            if (key == name) return std::string_view(value);
        }
        return std::nullopt;
    }
};

namespace detail {

/// A JSON string of raw bytes: every byte outside printable ASCII is \u00XX, so the text is
/// plain ASCII (safe in logs and text columns) and maps back to exactly the original bytes.
inline void append_json_bytes(std::string& out, std::string_view bytes) {
    static constexpr char hex[] = "0123456789abcdef";
    out += '"';
    for (char ch : bytes) {
        const auto c = static_cast<unsigned char>(ch);
        switch (c) {
            case '"':
                out += "\\\"";
                break;
            case '\\':
                out += "\\\\";
                break;
            case '\n':
                out += "\\n";
                break;
            case '\r':
                out += "\\r";
                break;
            case '\t':
                out += "\\t";
                break;
            default:
                if (c < 0x20 || c >= 0x7F) {
                    out += "\\u00";
                    out += hex[c >> 4];
                    out += hex[c & 0x0F];
                } else {
                    out += ch;
                }
        }
    }
    out += '"';
}

}  // namespace detail

/// @brief The bytes a dead letter keeps of a stream entry (found by ADL by the handler): its
/// fields as a JSON array of [name, value] pairs, in order, e.g. `[["order","8814"]]`. An array
/// rather than an object because a stream entry may repeat a name; bytes outside printable ASCII
/// are escaped as \u00XX (one per byte), so the encoding is unambiguous and readable.
[[nodiscard]] inline std::string idem_payload(const StreamEntry& entry) {
    std::string out = "[";
    for (std::size_t i = 0; i < entry.fields.size(); ++i) {
        if (i != 0) out += ',';
        out += '[';
        detail::append_json_bytes(out, entry.fields[i].first);
        out += ',';
        detail::append_json_bytes(out, entry.fields[i].second);
        out += ']';
    }
    out += ']';
    return out;
}

/// @brief Where a StreamConsumer reads and how it paces itself.
struct StreamConsumerOptions {
    std::string stream;    ///< the stream key
    std::string group;     ///< the consumer group
    std::string consumer;  ///< this consumer's name in the group, unique per running instance
    /// Where dead-lettered entries go, with their fields. Empty: stream + ":dead-letters". On a
    /// Redis Cluster give both the same hash tag (a stream named "{orders}" does by default).
    std::string dead_letter_stream{};
    /// Empty: the entry id is the message id. Otherwise the value of this field (a producer's
    /// business id, so a message sent twice is claimed once); an entry without it gets an empty
    /// id, which an IdempotentHandler dead-letters as malformed.
    std::string id_field{};
    /// Entries reclaimed, and entries read, per poll (with handle_in_batches: at most this many
    /// in all, the reclaimed ones first).
    std::size_t batch_size = 16;
    /// How long XREADGROUP waits for new entries when nothing was reclaimed; also how long
    /// run() may take to notice request_stop(). Must be shorter than the endpoint's
    /// command_timeout.
    std::chrono::milliseconds block{1000};
    /// An entry pending this long without an ack is taken over (XCLAIM min-idle-time) and
    /// delivered again. Keep it above the handler's p99; a lease store's lease must not exceed it.
    std::chrono::milliseconds visibility_timeout{30000};
    /// How long an entry that was not acked waits before its next delivery, growing with its
    /// delivery count: an entry delivered n − 1 times is taken over only once it has been idle
    /// for the longer of visibility_timeout and redelivery_backoff.before(n) (the consumer
    /// cannot tell a failure from a slow holder, so never sooner than the visibility timeout).
    /// A message is then parked after about redelivery_backoff.horizon(max_deliveries,
    /// visibility_timeout) of failing. RedeliveryBackoff::none(): every visibility_timeout.
    RedeliveryBackoff redelivery_backoff{};
    /// Create the group (at id 0, with the stream) when it does not exist.
    bool create_group = true;
    /// Handle each poll's entries (taken over and new, up to batch_size) together: an
    /// IdempotentHandler gets them in ONE handle_batch() call (one store transaction, each
    /// message in its own savepoint), then every entry to ack is acked in ONE round trip (one
    /// XACK, pipelined with the dead-letter scripts); on a RedisStore of this database the
    /// commit itself acks the entries it completes. A plain handler is still called per entry,
    /// with its acks batched the same way. The lease and the visibility timeout must then cover
    /// a whole batch, and a stop waits for the batch in hand. Off by default: one entry at a
    /// time keeps each ack as early as possible and the failure unit small.
    bool handle_in_batches = false;
    /// One entry at a time (handle_in_batches off) on a store that sends a commit with the next
    /// claim (an IdempotentHandler on a RedisStore): entry N's commit goes with entry N+1's
    /// claim in ONE round trip (idem::PipelinedLoop), and N is acked only once that commit's
    /// reply says it committed — in the commit itself on a RedisStore of this database, else
    /// with the poll's other acks in one XACK after its last entry. The poll's last commit goes
    /// alone before the next read. A message's lease is held while the next entry's effect runs
    /// (one effect longer than without it): the lease and the visibility timeout must cover two
    /// effects. Off: each entry claimed, committed and acked before the next is read. Other
    /// stores and plain handlers are unaffected.
    bool pipeline_commits = true;
    /// Told about each error run() recovers from (connection lost, an error reply) before it
    /// backs off and retries; for logs. Exceptions it throws are ignored. Empty: only counted.
    std::function<void(const std::exception&)> on_error{};
    /// The pause while the handler's store is unreachable: after an outcome failed with
    /// FailureCause::store_unavailable or store_timeout (Outcome::store_unreachable()) the
    /// consumer stops reading — the rest of the poll stays pending — waits (from
    /// initial_backoff doubling to max_backoff, less up to `jitter` of it) and probes the store,
    /// and reads again only once a probe succeeds. So delivery counts do not grow during an
    /// outage and healthy messages are not dead-lettered when the store comes back.
    CircuitBreakerOptions circuit_breaker{};
    /// How to probe the store of a plain handler (throw while it is unreachable). Empty: no
    /// probe, one initial_backoff pause after each such outcome. An IdempotentHandler's store is
    /// probed with a transaction begun and rolled back (or its ping()).
    std::function<void()> store_probe{};
    /// Receives a ConsumerHealth report (pending entries of the group from XPENDING, the
    /// dead-letter stream's length, the breaker) after a poll, at most once per health_interval;
    /// each report costs one round trip. Empty: none. E.g. PrometheusObserver's health_sink().
    HealthSink on_health{};
    std::chrono::milliseconds health_interval{1000};
};

/// @brief What a StreamConsumer has done so far (a snapshot): `read` counts new entries
/// (XREADGROUP), `reclaimed` stuck entries taken over and delivered again (XCLAIM).
using StreamConsumerStats = broker::ConsumerStats;

namespace detail {

// KEYS[1] dead-letter stream, KEYS[2] stream. ARGV: group, entry id, then the XADD field/value
// pairs. A script rather than MULTI/EXEC: EXEC still runs the XACK when the XADD fails at run
// time (a dead-letter key of another type), which would ack an entry that was never parked.
// Here a failing XADD raises before the XACK, so nothing is acked.
inline constexpr const char* stream_dead_letter_ack_source = R"(
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
return redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
)";

inline const redis::Script& stream_dead_letter_ack_script() {
    static const redis::Script script{"stream dead letter", stream_dead_letter_ack_source};
    return script;
}

/// The millisecond part of an entry id ("1700000000000-0"), or nothing if it is not one.
inline std::optional<std::int64_t> stream_id_ms(std::string_view id) {
    const std::size_t dash = id.find('-');
    const std::string_view ms = id.substr(0, dash);
    if (ms.empty() || ms.size() > 18) return std::nullopt;
    std::int64_t value = 0;
    for (char c : ms) {
        if (c < '0' || c > '9') return std::nullopt;
        value = value * 10 + (c - '0');
    }
    return value;
}

/// An entry of an XREADGROUP / XCLAIM reply: [id, [name, value, ...]]. Nothing for an entry
/// deleted from the stream (nil, or an id with nil fields).
inline std::optional<StreamEntry> parse_stream_entry(const redis::Reply& reply,
                                                     const std::string& stream) {
    if (!reply.is_array() || reply.elements.size() < 2 || !reply.elements[1].is_array()) {
        return std::nullopt;
    }
    StreamEntry entry;
    entry.stream = stream;
    entry.id = reply.elements[0].str;
    const auto& fields = reply.elements[1].elements;
    entry.fields.reserve(fields.size() / 2);
    for (std::size_t i = 0; i + 1 < fields.size(); i += 2)
        entry.fields.emplace_back(fields[i].str, fields[i + 1].str);
    return entry;
}

}  // namespace detail

/// @brief Reads a Redis Stream through a consumer group and hands each entry to a handler as an
/// idem::Delivery, so the handler's claim, poison limit and outcome decide the ack.
///
/// Each poll_once() first takes over entries that are due again (XPENDING with their true
/// delivery counts, then XCLAIM): pending without an ack for longer than the visibility timeout
/// and than the redelivery backoff of their next delivery (StreamConsumerOptions::
/// redelivery_backoff). Then it reads new ones (XREADGROUP; delivery count 1). After the handler:
/// an acking outcome is XACKed (a dead letter is first added to the dead-letter stream with its
/// reason and fields, atomically with the ack); failed, deferred and in_progress stay pending
/// and come back once due. A handler that throws counts as failed. Nothing is acked whose
/// outcome is unknown.
///
/// Built from an IdempotentHandler whose store accepts its commit hook (idem::CommitHook carrying
/// a redis::StreamAck: a RedisStore of the same server and database), the ack (and the
/// dead-letter stream entry) is part of the handler's commit: a Redis-only effect, its claim and
/// its ack commit together. With any other store the consumer acks after the handler returns.
///
/// One at a time on a RedisStore (StreamConsumerOptions::pipeline_commits, on by default), an
/// entry's commit goes with the next entry's claim in one round trip, and the entry is acked
/// only once that commit's reply says it committed (idem::PipelinedLoop).
///
/// With StreamConsumerOptions::handle_in_batches each poll's entries go to the handler together
/// (IdempotentHandler::handle_batch: one transaction) and are acked in one round trip, or in the
/// batch's commit on a RedisStore of the same database.
///
/// @code
/// idem::RedisStore store{endpoint};           // default lease 30 s = the visibility timeout
/// auto handler = idem::make_handler(store, idem::Policy{"capture"},
///     [&](auto& tx, const idem::StreamEntry& e) { tx.write("INCR", "captures"); });
/// idem::StreamConsumer consumer{endpoint, {"orders", "capture", "worker-1"}, handler};
/// std::thread worker([&] { consumer.run(); });   // ... consumer.request_stop(); worker.join();
/// @endcode
///
/// poll_once() and run() belong to one thread at a time; request_stop(), stop_requested() and
/// stats() may be called from any thread (request_stop() also from a signal handler).
class StreamConsumer {
  public:
    /// The handler of the plain form: the outcome decides the ack.
    using Handler = std::function<Outcome(const Delivery&, const StreamEntry&)>;

    /// @brief A consumer calling @p handler for each entry.
    /// @throws usage_error for an invalid option (the message says which and why).
    StreamConsumer(RedisEndpoint endpoint, StreamConsumerOptions options, Handler handler)
        : StreamConsumer(
              Private{}, std::move(endpoint), std::move(options),
              broker::Dispatch<StreamEntry>::plain(std::move(handler), "idem::StreamConsumer"),
              false) {}

    /// @brief A consumer calling @p handler.handle(delivery, entry) — or, with
    /// handle_in_batches, handler.handle_batch(deliveries, entries) once per poll; its effect
    /// takes `const StreamEntry&` as the body. @p handler must outlive the consumer.
    ///
    /// On a lease store the handler's lease must not be longer than the visibility timeout (a
    /// dead holder's lease would outlast the redelivery). On a RedisStore of the same server and
    /// database the ack is part of the handler's commit.
    /// @throws usage_error for an invalid option or a lease longer than the visibility timeout.
    template <class Store, class Effect>
    StreamConsumer(RedisEndpoint endpoint, StreamConsumerOptions options,
                   IdempotentHandler<Store, Effect>& handler)
        // `endpoint` is copied, not moved: acks_in_commit_of() reads it in the same call.
        : StreamConsumer(Private{}, endpoint, std::move(options),
                         broker::Dispatch<StreamEntry>::idempotent(handler),
                         acks_in_commit_of(handler, endpoint)) {
        broker::check_lease_fits(handler, options_.visibility_timeout, "visibility_timeout",
                                 fmt::format("idem::StreamConsumer(\"{}\", group \"{}\")",
                                             options_.stream, options_.group));
    }

    StreamConsumer(const StreamConsumer&) = delete;
    StreamConsumer& operator=(const StreamConsumer&) = delete;
    ~StreamConsumer() = default;

    /// @brief One cycle: take over stuck entries, read new ones (waiting up to `block` only when
    /// nothing was taken over), hand each to the handler and ack what its outcome says. Returns
    /// how many entries were handled. After request_stop() it returns 0 without reading, and
    /// stops between entries: those read but not handled stay pending (taken over later). With
    /// handle_in_batches the entries go to the handler together and are acked in one round trip;
    /// a stop before the batch leaves it all pending.
    /// @throws store_unavailable / store_timeout when Redis is unreachable (counted in
    /// stats().connection_errors; the next call reconnects), store_error for an error reply.
    ///
    /// While the circuit breaker is open (the handler's store was found unreachable) it first
    /// waits and probes the store until it answers, or returns 0 on request_stop().
    std::size_t poll_once() {
        if (!loop_.ready_to_read()) return 0;
        const std::size_t handled = loop_.counting_connection_errors([this] { return poll(); });
        if (loop_.health_due()) report_health();
        return handled;
    }

    /// @brief Polls until request_stop(). Store errors (a lost connection, a restarted server)
    /// are retried after a bounded backoff (50 ms doubling to 1 s), never thrown. Returns within
    /// about `block` of the stop, once the entry in hand is finished.
    void run() {
        loop_.run([this] { poll_once(); });
    }

    /// @brief Asks run() to return. Lock-free: safe from another thread or a signal handler.
    void request_stop() noexcept { loop_.request_stop(); }
    [[nodiscard]] bool stop_requested() const noexcept { return loop_.stop_requested(); }

    [[nodiscard]] StreamConsumerStats stats() const noexcept { return loop_.stats(); }

    /// @brief The options in use (dead_letter_stream filled in).
    [[nodiscard]] const StreamConsumerOptions& options() const noexcept { return options_; }
    [[nodiscard]] const RedisEndpoint& endpoint() const noexcept { return connection_.endpoint(); }
    /// @brief True when the handler's commit acks the entry (a RedisStore on this database).
    [[nodiscard]] bool acks_in_commit() const noexcept { return acks_in_commit_; }

  private:
    struct Private {};

    struct Item {
        StreamEntry entry;
        std::uint32_t delivery_count;
    };

    StreamConsumer(Private, RedisEndpoint endpoint, StreamConsumerOptions options,
                   broker::Dispatch<StreamEntry> dispatch, bool acks_in_commit)
        : options_(validated(std::move(options), endpoint)),
          connection_(std::move(endpoint)),
          dispatch_(std::move(dispatch)),
          acks_in_commit_(acks_in_commit),
          loop_(
              broker::LoopOptions{options_.on_error, options_.circuit_breaker, options_.store_probe,
                                  options_.on_health, options_.health_interval},
              dispatch_.store_probe()) {}

    /// Whether the handler's store would do this consumer's stream acks in its commit: asked
    /// once, of the store's commit-hook capability (no store type is named here).
    template <class Store, class Effect>
    static bool acks_in_commit_of(IdempotentHandler<Store, Effect>& handler,
                                  const RedisEndpoint& endpoint) {
        redis::StreamAck ack;
        ack.endpoint = endpoint;
        return accepts_commit_hook(handler.store(), CommitHook{std::move(ack)});
    }

    static StreamConsumerOptions validated(StreamConsumerOptions options,
                                           const RedisEndpoint& endpoint) {
        auto refuse = [&](std::string_view why) {
            throw usage_error(fmt::format("idem::StreamConsumer(\"{}\"): {}", options.stream, why));
        };
        if (options.stream.empty()) refuse("options.stream is empty; name the stream to read");
        if (options.group.empty()) {
            refuse("options.group is empty; name the consumer group (one per kind of handler)");
        }
        if (options.consumer.empty()) {
            refuse(
                "options.consumer is empty; name this consumer, unique per running instance (e.g. "
                "host and pid), so the group knows who holds what");
        }
        if (options.batch_size == 0) refuse("batch_size is 0; read at least 1 entry per poll");
        if (options.block.count() <= 0) {
            refuse(
                "block must be positive (e.g. 1000 ms); 0 would make XREADGROUP wait forever and "
                "run() could not stop");
        }
        if (options.block >= endpoint.command_timeout) {
            refuse(fmt::format(
                "block ({} ms) must be shorter than the endpoint's command_timeout ({} ms), or "
                "every empty read would time out",
                options.block.count(), endpoint.command_timeout.count()));
        }
        if (options.visibility_timeout.count() <= 0) {
            refuse(
                "visibility_timeout must be positive: choose it above the handler's p99 (e.g. "
                "30000 ms)");
        }
        options.redelivery_backoff.validate(
            fmt::format("idem::StreamConsumer(\"{}\")", options.stream));
        if (options.dead_letter_stream.empty()) {
            options.dead_letter_stream = redis::default_dead_letter_stream(options.stream);
        }
        if (options.dead_letter_stream == options.stream) {
            refuse(
                "dead_letter_stream is the stream itself; dead letters would be read again as new "
                "messages");
        }
        return options;
    }

    std::size_t poll() {
        ensure_group();
        std::vector<Item> batch;
        reclaim(batch);
        if (options_.handle_in_batches) {  // at most batch_size in all, taken over ones first
            if (batch.size() < options_.batch_size) {
                read_new(batch, options_.batch_size - batch.size(), /*block=*/batch.empty());
            }
            return handle_all(std::move(batch));
        }
        read_new(batch, options_.batch_size, /*block=*/batch.empty());
        if (options_.pipeline_commits && dispatch_.sequences()) return handle_in_sequence(batch);
        std::size_t handled = 0;
        for (const Item& item : batch) {
            // The rest stays pending and is taken over later (after a stop, or once the store
            // answers again).
            if (loop_.interrupted()) break;
            handle(item);
            ++handled;
        }
        return handled;
    }

    void ensure_group() {
        if (group_ready_ || !options_.create_group) return;
        redis::Reply reply = connection_.command(
            {"XGROUP", "CREATE", options_.stream, options_.group, "0", "MKSTREAM"});
        if (reply.is_error() && reply.str.rfind("BUSYGROUP", 0) != 0) {
            throw store_error(
                fmt::format("idem::StreamConsumer: XGROUP CREATE {} {} failed on {}: {}",
                            options_.stream, options_.group, endpoint().describe(), reply.str));
        }
        group_ready_ = true;
    }

    /// Takes over the entries that are due again, with their true delivery counts: pending
    /// (unacked) and idle for at least the visibility timeout AND the backoff of their next
    /// delivery (RedeliveryBackoff). One XPENDING (IDLE filter, from where the last poll
    /// stopped), then one pipeline of XCLAIMs, each with its own min-idle-time, so an entry
    /// another consumer took meanwhile is not taken twice.
    void reclaim(std::vector<Item>& batch) {
        const std::size_t page = std::max<std::size_t>(options_.batch_size * 4, 64);
        const std::string visibility = std::to_string(options_.visibility_timeout.count());
        redis::Reply reply = checked({"XPENDING", options_.stream, options_.group, "IDLE",
                                      visibility, cursor_, "+", std::to_string(page)},
                                     "XPENDING");
        if (!reply.is_array())
            throw store_error("idem::StreamConsumer: XPENDING: unexpected reply");
        struct Due {
            std::string id;
            std::uint32_t delivery_count;  ///< this delivery's, once claimed
        };
        std::vector<Due> due;
        std::vector<std::vector<std::string>> claims;
        std::string last_seen;
        for (const redis::Reply& row : reply.elements) {
            if (!row.is_array() || row.elements.size() < 4) continue;
            if (claims.size() == options_.batch_size) break;  // the rest on a later poll
            const std::string& id = row.elements[0].str;
            last_seen = id;
            const auto delivered =
                static_cast<std::uint32_t>(std::max<long long>(0, row.elements[3].integer));
            const std::chrono::milliseconds wait = std::max(
                options_.visibility_timeout, options_.redelivery_backoff.before(delivered + 1, id));
            if (row.elements[2].integer < wait.count()) continue;  // held back: not due yet
            claims.push_back({"XCLAIM", options_.stream, options_.group, options_.consumer,
                              std::to_string(wait.count()), id});
            due.push_back(Due{id, delivered + 1});
        }
        // A full page or a full batch: resume after the last entry looked at; else from the
        // start of the pending list.
        const bool more = reply.elements.size() >= page || claims.size() == options_.batch_size;
        cursor_ = more && !last_seen.empty() ? "(" + last_seen : std::string("-");
        if (claims.empty()) return;

        const std::vector<redis::Reply> replies = connection_.pipeline(claims);
        std::vector<std::string> deleted;
        for (std::size_t i = 0; i < replies.size(); ++i) {
            if (replies[i].is_error()) throw reply_error(replies[i], "XCLAIM");
            if (!replies[i].is_array()) continue;
            for (const redis::Reply& element : replies[i].elements) {
                if (auto entry = detail::parse_stream_entry(element, options_.stream)) {
                    loop_.reclaimed.fetch_add(1, std::memory_order_relaxed);
                    batch.push_back(Item{std::move(*entry), due[i].delivery_count});
                } else {
                    // Deleted from the stream (XDEL, trimming): nothing left to deliver. Redis 7
                    // drops them from the pending list itself; Redis 6.2 returns them as nil.
                    deleted.push_back(due[i].id);
                }
            }  // empty: another consumer took it meanwhile, or it was acked
        }
        if (!deleted.empty()) {
            std::vector<std::string> ack{"XACK", options_.stream, options_.group};
            ack.insert(ack.end(), deleted.begin(), deleted.end());
            checked(ack, "XACK");
        }
    }

    void read_new(std::vector<Item>& batch, std::size_t count, bool block) {
        std::vector<std::string> command{"XREADGROUP",      "GROUP", options_.group,
                                         options_.consumer, "COUNT", std::to_string(count)};
        if (block) {
            command.emplace_back("BLOCK");
            command.push_back(std::to_string(options_.block.count()));
        }
        command.insert(command.end(), {"STREAMS", options_.stream, ">"});
        redis::Reply reply = checked(command, "XREADGROUP");
        if (reply.is_nil() || !reply.is_array()) return;  // nothing new within the block time
        for (const redis::Reply& stream : reply.elements) {
            if (!stream.is_array() || stream.elements.size() < 2) continue;
            for (const redis::Reply& element : stream.elements[1].elements) {
                if (auto entry = detail::parse_stream_entry(element, options_.stream)) {
                    loop_.read.fetch_add(1, std::memory_order_relaxed);
                    batch.push_back(Item{std::move(*entry), 1});
                }
            }
        }
    }

    Delivery delivery_of(const StreamEntry& entry, std::uint32_t delivery_count) const {
        Delivery delivery;
        if (options_.id_field.empty()) {
            delivery.message_id = entry.id;
        } else if (auto value = entry.field(options_.id_field)) {
            delivery.message_id = std::string(*value);
        }  // else empty: the handler dead-letters it as malformed
        delivery.delivery_count = delivery_count;
        if (auto ms = detail::stream_id_ms(entry.id)) {
            delivery.enqueued_at = std::chrono::system_clock::time_point{} +
                                   std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                       std::chrono::milliseconds(*ms));
        }
        return delivery;
    }

    /// The commit hook asking the store's commit to ack the entry (and park it, if
    /// dead-lettered); the handler stamps it with its scope and the message id.
    CommitHook commit_hook_of(const StreamEntry& entry, const Delivery& delivery) const {
        redis::StreamAck ack;
        ack.endpoint = endpoint();
        ack.stream = options_.stream;
        ack.group = options_.group;
        ack.entry_id = entry.id;
        ack.dead_letter_stream = options_.dead_letter_stream;
        ack.fields = redacted(entry.fields);
        ack.delivery_count = delivery.delivery_count.value();
        return CommitHook{std::move(ack)};
    }

    void handle(const Item& item) {
        const StreamEntry& entry = item.entry;
        const Delivery delivery = delivery_of(entry, item.delivery_count);
        std::optional<CommitHook> hook;
        if (acks_in_commit_) hook.emplace(commit_hook_of(entry, delivery));
        const Outcome outcome = dispatch_.call(delivery, entry, hook ? &*hook : nullptr);
        loop_.note(outcome);

        if (hook && hook->acked_in_commit) {  // the commit acked it (and parked it, if it was a
                                              // dead letter)
            loop_.count(settled_in_commit(outcome), /*in_commit=*/true);
            return;
        }
        settle(entry, delivery, outcome);
    }

    /// The pipelined form of one-at-a-time (StreamConsumerOptions::pipeline_commits): each
    /// entry through the dispatch's sequence, whose commit goes with the next entry's claim;
    /// the acks the commits did not do go in one round trip after the poll's last entry. No
    /// message stays held past the poll (its tag is its place in this poll's batch): the last
    /// commit is sent alone, also when the poll is cut short by a stop, an open breaker or an
    /// error. Returns how many entries were handled.
    std::size_t handle_in_sequence(const std::vector<Item>& batch) {
        std::vector<Delivery> deliveries;
        deliveries.reserve(batch.size());
        std::vector<StreamEntry> entries;  // the settled ones this consumer acks, in order
        std::vector<Delivery> settled_deliveries;
        std::vector<Outcome> outcomes;
        auto take = [&](std::vector<broker::Dispatch<StreamEntry>::Settled> settled) {
            for (auto& s : settled) {
                loop_.note(s.outcome);
                if (s.acked_in_commit) {
                    loop_.count(settled_in_commit(s.outcome), /*in_commit=*/true);
                    continue;
                }
                entries.push_back(batch[s.tag].entry);
                settled_deliveries.push_back(std::move(s.delivery));
                outcomes.push_back(std::move(s.outcome));
            }
        };
        try {
            for (std::size_t i = 0; i < batch.size(); ++i) {
                if (loop_.interrupted()) break;  // the rest stays pending
                deliveries.push_back(delivery_of(batch[i].entry, batch[i].delivery_count));
                std::optional<CommitHook> hook;
                if (acks_in_commit_) hook.emplace(commit_hook_of(batch[i].entry, deliveries[i]));
                take(dispatch_.in_sequence(deliveries[i], batch[i].entry, i,
                                           hook ? &*hook : nullptr));
            }
            take(dispatch_.flush_sequence());
        } catch (...) {
            take(dispatch_.flush_sequence());
            try {
                ack_all(entries, settled_deliveries, outcomes, {});
            } catch (const std::exception&) {  // left pending: their redelivery is a duplicate
            }
            throw;
        }
        ack_all(entries, settled_deliveries, outcomes, {});
        return deliveries.size();
    }

    /// Acks what @p outcome says for an entry the consumer settles (its commit did not).
    void settle(const StreamEntry& entry, const Delivery& delivery, const Outcome& outcome) {
        const broker::Settlement settlement = broker::settlement_of(outcome, acks_in_commit_);
        if (settlement == broker::Settlement::dead_letter_then_ack) {
            dead_letter_and_ack(entry, delivery, outcome.reason);
        } else if (settlement == broker::Settlement::ack) {
            checked({"XACK", options_.stream, options_.group, entry.id}, "XACK");
        }  // redeliver: stays pending; the visibility timeout brings it back
        loop_.count(settlement);
    }

    /// How a delivery the commit acked was settled: parked with its dead-letter stream entry,
    /// or acked (a duplicate of a dead letter needs no second copy: see settlement_of()).
    static broker::Settlement settled_in_commit(const Outcome& outcome) noexcept {
        return broker::settlement_of(outcome, /*commit_publishes_dead_letters=*/true);
    }

    /// Batch mode: the whole poll to the handler at once, then one round trip for the acks the
    /// commit did not already do. Returns how many entries were handled.
    std::size_t handle_all(std::vector<Item> batch) {
        if (batch.empty() || stop_requested()) return 0;  // a stop leaves the batch pending
        std::vector<Delivery> deliveries;
        std::vector<StreamEntry> entries;
        deliveries.reserve(batch.size());
        entries.reserve(batch.size());
        for (Item& item : batch) {
            deliveries.push_back(delivery_of(item.entry, item.delivery_count));
            entries.push_back(std::move(item.entry));
        }
        std::vector<CommitHook> hooks;
        if (acks_in_commit_) {
            hooks.reserve(entries.size());
            for (std::size_t i = 0; i < entries.size(); ++i)
                hooks.push_back(commit_hook_of(entries[i], deliveries[i]));
        }

        // A plain handler is called per entry (those it did not reach stay pending), its acks
        // batched below as well.
        const std::vector<Outcome> outcomes = broker::handle_together(
            dispatch_, loop_, deliveries, entries, acks_in_commit_ ? &hooks : nullptr);
        ack_all(entries, deliveries, outcomes, hooks);
        return outcomes.size();
    }

    /// Acks what the outcomes say in one round trip: one XACK for the ordinary acks, pipelined
    /// with one dead-letter script per dead letter (the ones the commit did not ack already).
    void ack_all(const std::vector<StreamEntry>& entries, const std::vector<Delivery>& deliveries,
                 const std::vector<Outcome>& outcomes, const std::vector<CommitHook>& hooks) {
        std::vector<std::vector<std::string>> commands;
        std::vector<std::string> xack{"XACK", options_.stream, options_.group};
        std::size_t plain_acks = 0;
        for (std::size_t i = 0; i < outcomes.size(); ++i) {
            const Outcome& outcome = outcomes[i];
            const broker::Settlement settlement = broker::settlement_of(outcome, acks_in_commit_);
            if (!hooks.empty() && hooks[i].acked_in_commit) {  // the commit acked (and parked) it
                loop_.count(settled_in_commit(outcome), /*in_commit=*/true);
            } else if (settlement == broker::Settlement::redeliver) {
                loop_.count(settlement);
            } else if (settlement == broker::Settlement::dead_letter_then_ack) {
                commands.push_back(dead_letter_eval(entries[i], deliveries[i], outcome.reason));
            } else {
                xack.push_back(entries[i].id);
                ++plain_acks;
            }
        }
        if (plain_acks != 0) commands.insert(commands.begin(), std::move(xack));
        if (commands.empty()) return;

        const std::vector<redis::Reply> replies = connection_.pipeline(commands);
        std::optional<store_error> error;
        for (std::size_t k = 0; k < replies.size(); ++k) {
            const bool is_xack = plain_acks != 0 && k == 0;
            if (replies[k].is_error()) {
                if (!error) {
                    error.emplace(
                        reply_error(replies[k], is_xack ? "XACK" : "dead letter (not acked)"));
                }
            } else if (is_xack) {
                for (std::size_t n = 0; n < plain_acks; ++n)
                    loop_.count(broker::Settlement::ack);
            } else {
                loop_.count(broker::Settlement::dead_letter_then_ack);
            }
        }
        if (error) throw *error;
    }

    /// The entry's fields as the dead-letter stream may keep them: each value through the
    /// policy's redactor (PolicyOptions::redact_payload), when it has one.
    std::vector<std::pair<std::string, std::string>> redacted(
        const std::vector<std::pair<std::string, std::string>>& fields) const {
        if (!dispatch_.redacts()) return fields;
        std::vector<std::pair<std::string, std::string>> out;
        out.reserve(fields.size());
        for (const auto& [name, value] : fields)
            out.emplace_back(name, dispatch_.redact(value));
        return out;
    }

    /// The dead-letter script as one command of a pipeline (EVAL: no script cache to miss).
    std::vector<std::string> dead_letter_eval(const StreamEntry& entry, const Delivery& delivery,
                                              const std::string& reason) const {
        std::vector<std::string> xadd = redis::stream_dead_letter_command(
            options_.dead_letter_stream, entry.id, redacted(entry.fields), reason,
            dispatch_.scope(), delivery.message_id, delivery.delivery_count.value());
        std::vector<std::string> command{"EVAL",
                                         detail::stream_dead_letter_ack_source,
                                         "2",
                                         options_.dead_letter_stream,
                                         options_.stream,
                                         options_.group,
                                         entry.id};
        command.insert(command.end(), std::make_move_iterator(xadd.begin() + 3),
                       std::make_move_iterator(xadd.end()));
        return command;
    }

    /// Adds the entry to the dead-letter stream and acks it, atomically: either both or neither.
    void dead_letter_and_ack(const StreamEntry& entry, const Delivery& delivery,
                             const std::string& reason) {
        std::vector<std::string> xadd = redis::stream_dead_letter_command(
            options_.dead_letter_stream, entry.id, redacted(entry.fields), reason,
            dispatch_.scope(), delivery.message_id, delivery.delivery_count.value());
        // XADD <key> * <fields...> → ARGV: group, entry id, <fields...>
        std::vector<std::string> args{options_.group, entry.id};
        args.insert(args.end(), std::make_move_iterator(xadd.begin() + 3),
                    std::make_move_iterator(xadd.end()));
        redis::Reply reply = connection_.eval(detail::stream_dead_letter_ack_script(),
                                              {options_.dead_letter_stream, options_.stream}, args);
        if (reply.is_error()) {
            throw store_error(fmt::format(
                "idem::StreamConsumer: moving entry {} of {} to {} failed on {} (not acked): {}",
                entry.id, options_.stream, options_.dead_letter_stream, endpoint().describe(),
                reply.str));
        }
    }

    /// One round trip: the group's pending count (XPENDING summary) and the dead-letter stream's
    /// length (XLEN), given to the health sink. A failure is reported, not thrown: the next poll
    /// meets the same connection trouble and deals with it.
    void report_health() noexcept {
        try {
            const std::vector<redis::Reply> replies = connection_.pipeline(
                std::vector<std::vector<std::string>>{{"XPENDING", options_.stream, options_.group},
                                                      {"XLEN", options_.dead_letter_stream}});
            const std::string consumer = options_.stream + "/" + options_.group;
            ConsumerHealth health;
            health.consumer = consumer;
            health.dead_letter_destination = options_.dead_letter_stream;
            if (replies[0].is_array() && !replies[0].elements.empty() &&
                replies[0].elements[0].type == redis::Reply::Type::integer) {
                health.pending = static_cast<std::uint64_t>(replies[0].elements[0].integer);
            }
            if (replies[1].type == redis::Reply::Type::integer) {
                health.dead_letter_depth = static_cast<std::uint64_t>(replies[1].integer);
            }
            loop_.report_health(health);
        } catch (const std::exception& e) {
            loop_.report(e);
        } catch (...) {
        }
    }

    redis::Reply checked(const std::vector<std::string>& command, std::string_view what) {
        redis::Reply reply = connection_.command(command);
        if (!reply.is_error()) return reply;
        throw reply_error(reply, what);
    }

    /// The store_error for an error reply to @p what; NOGROUP also has the group created again.
    store_error reply_error(const redis::Reply& reply, std::string_view what) {
        if (reply.str.rfind("NOGROUP", 0) == 0) {
            group_ready_ = false;  // e.g. a server restarted without persistence: create it again
            return store_error(fmt::format(
                "idem::StreamConsumer: {} on {}: {} ({})", what, endpoint().describe(), reply.str,
                options_.create_group
                    ? "the group will be created again on the next poll"
                    : "create it with XGROUP CREATE, or set StreamConsumerOptions::create_group"));
        }
        return store_error(fmt::format("idem::StreamConsumer: {} failed on {}: {}", what,
                                       endpoint().describe(), reply.str));
    }

    StreamConsumerOptions options_;
    redis::FollowingConnection connection_;  ///< follows the stream's slot on a Redis Cluster
    broker::Dispatch<StreamEntry> dispatch_;
    bool acks_in_commit_;
    broker::Loop loop_;  ///< after options_ and dispatch_: built from both
    bool group_ready_ = false;
    std::string cursor_ = "-";  ///< XPENDING resumes where the last poll stopped
};

IDEM_END_NAMESPACE
