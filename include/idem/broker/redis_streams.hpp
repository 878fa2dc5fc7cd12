#pragma once
/// @file
/// @brief RedisStreamConsumer: reads a Redis Stream through a consumer group and hands each entry
/// to a handler as an idem::Delivery with the broker's true delivery count, acking only what the
/// outcome says to ack. Link idem::redis.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/broker/consumer.hpp"
#include "idem/config.hpp"
#include "idem/contract/commit_hook.hpp"
#include "idem/delivery.hpp"
#include "idem/error.hpp"
#include "idem/handler.hpp"
#include "idem/outcome.hpp"
#include "idem/redis/connection.hpp"
#include "idem/redis/endpoint.hpp"
#include "idem/redis/following_connection.hpp"
#include "idem/redis/reply.hpp"
#include "idem/redis/stream_ack.hpp"
#include "idem/redis/stream_consumer_options.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief Reads a Redis Stream through a consumer group and hands each entry to a handler as an
/// idem::Delivery, so the handler's claim, poison limit and outcome decide the ack (the loop is
/// broker::ConsumerBase's). Each poll first takes over entries due again (XPENDING with their
/// true delivery counts, then XCLAIM): pending without an ack for longer than the visibility
/// timeout and the redelivery backoff of their next delivery. Then it reads new ones
/// (XREADGROUP; delivery count 1). After the handler: an acking outcome is XACKed (a dead letter
/// is first added to the dead-letter stream with its reason and fields, atomically with the
/// ack); failed, deferred and in_progress stay pending and come back once due; a handler that
/// throws counts as failed. Nothing is acked whose outcome is unknown.
///
/// Built from an IdempotentHandler whose store accepts its commit hook (idem::CommitHook carrying
/// a redis::StreamAck: a RedisStore of the same server and database), the ack (and the
/// dead-letter stream entry) is part of the handler's commit: a Redis-only effect, its claim and
/// its ack commit together. With any other store the consumer acks after the handler returns.
///
/// One at a time on a RedisStore (RedisStreamConsumerOptions::pipeline_commits, on by default), an
/// entry's commit goes with the next entry's claim in one round trip, and the entry is acked
/// only once that commit's reply says it committed (idem::PipelinedLoop).
///
/// @code
/// idem::RedisStore store{endpoint};           // default lease 30 s = the visibility timeout
/// auto handler = idem::make_handler(store, idem::Policy{"capture"},
///     [&](auto& tx, const idem::StreamEntry& e) { tx.write("INCR", "captures"); });
/// idem::RedisStreamConsumer consumer{endpoint, {"orders", "capture", "worker-1"}, handler};
/// std::thread worker([&] { consumer.run(); });   // ... consumer.request_stop(); worker.join();
/// @endcode
class RedisStreamConsumer final
    : public broker::ConsumerBase<RedisStreamConsumer, RedisStreamConsumerOptions,
                                  detail::StreamItem, StreamEntry> {
    using Base = broker::ConsumerBase<RedisStreamConsumer, RedisStreamConsumerOptions,
                                      detail::StreamItem, StreamEntry>;
    friend Base;

  public:
    /// The handler of the plain form: the outcome decides the ack.
    using Handler = std::function<Outcome(const Delivery&, const StreamEntry&)>;

    /// @brief A consumer calling @p handler for each entry.
    /// @throws usage_error for an invalid option (the message says which and why).
    RedisStreamConsumer(RedisEndpoint endpoint, RedisStreamConsumerOptions options, Handler handler)
        : RedisStreamConsumer(
              Private{}, std::move(endpoint), std::move(options),
              broker::Dispatch<StreamEntry>::plain(std::move(handler), "idem::RedisStreamConsumer"),
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
    RedisStreamConsumer(RedisEndpoint endpoint, RedisStreamConsumerOptions options,
                        IdempotentHandler<Store, Effect>& handler)
        // `endpoint` is copied, not moved: acks_in_commit_of() reads it in the same call.
        : RedisStreamConsumer(Private{}, endpoint, std::move(options),
                              broker::Dispatch<StreamEntry>::idempotent(handler),
                              acks_in_commit_of(handler, endpoint)) {
        broker::check_lease_fits(handler, options_.visibility_timeout, "visibility_timeout",
                                 fmt::format("idem::RedisStreamConsumer(\"{}\", group \"{}\")",
                                             options_.stream, options_.group));
    }

    /// @brief The Redis server this consumer reads from (and acks on).
    [[nodiscard]] const RedisEndpoint& endpoint() const noexcept { return connection_.endpoint(); }
    /// @brief "<stream>/<group>": how health reports name this consumer.
    [[nodiscard]] const std::string& name() const noexcept { return name_; }

  private:
    struct Private {};
    using Item = detail::StreamItem;

    RedisStreamConsumer(Private, RedisEndpoint endpoint, RedisStreamConsumerOptions options,
                        broker::Dispatch<StreamEntry> dispatch, bool acks_in_commit)
        : Base(validated(std::move(options), endpoint), std::move(dispatch), acks_in_commit),
          connection_(std::move(endpoint)),
          name_(options_.stream + "/" + options_.group) {}

    /// Whether the handler's store would do this consumer's stream acks in its commit: asked
    /// once, of the store's commit-hook capability (no store type is named here).
    template <class Store, class Effect>
    static bool acks_in_commit_of(IdempotentHandler<Store, Effect>& handler,
                                  const RedisEndpoint& endpoint) {
        redis::StreamAck ack;
        ack.endpoint = endpoint;
        return accepts_commit_hook(handler.store(), CommitHook{std::move(ack)});
    }

    static RedisStreamConsumerOptions validated(RedisStreamConsumerOptions options,
                                                const RedisEndpoint& endpoint) {
        const std::string who = fmt::format("idem::RedisStreamConsumer(\"{}\")", options.stream);
        auto refuse = [&](std::string_view why) {
            throw usage_error(fmt::format("{}: {}", who, why));
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
        broker::validate_consumer_options(options, who);
        if (options.poll_wait >= endpoint.command_timeout) {
            refuse(fmt::format(
                "poll_wait ({} ms) must be shorter than the endpoint's command_timeout ({} ms), or "
                "every empty read would time out",
                options.poll_wait.count(), endpoint.command_timeout.count()));
        }
        if (options.dead_letter.empty()) {
            options.dead_letter = redis::default_dead_letter_stream(options.stream);
        }
        if (options.dead_letter == options.stream) {
            refuse(
                "dead_letter is the stream itself; dead letters would be read again as new "
                "messages");
        }
        return options;
    }

    // -----------------------------------------------------------------------------------------
    // The adapter's hooks (broker::ConsumerBase)

    std::vector<Item> read() {
        ensure_group();
        std::vector<Item> batch;
        reclaim(batch);
        std::size_t count = options_.batch_size;
        if (options_.handle_in_batches) {  // at most batch_size in all, taken-over ones first
            if (batch.size() >= options_.batch_size) return batch;
            count -= batch.size();
        }
        read_new(batch, count, /*block=*/batch.empty());
        return batch;
    }
    bool pipelines() const noexcept { return options_.pipeline_commits; }

    Delivery delivery_of(const Item& item) const {
        Delivery delivery;
        if (options_.id_field.empty()) {
            delivery.message_id = item.entry.id;
        } else if (auto value = item.entry.field(options_.id_field)) {
            delivery.message_id = std::string(*value);
        }  // else empty: the handler dead-letters it as malformed
        delivery.delivery_count = item.delivery_count;
        delivery.enqueued_at = detail::stream_enqueued_at(item.entry.id);
        delivery.origin = options_.stream;
        delivery.origin_position = item.entry.id;
        return delivery;
    }

    static const StreamEntry& message_of(const Item& item) noexcept { return item.entry; }
    static StreamEntry message_of(Item&& item) noexcept { return std::move(item.entry); }

    /// The commit hook asking the store's commit to ack the entry (and park it, if
    /// dead-lettered); the handler stamps it with its scope and the message id.
    CommitHook commit_hook_of(const Item& item, const Delivery& delivery) const {
        redis::StreamAck ack;
        ack.endpoint = endpoint();
        ack.stream = options_.stream;
        ack.group = options_.group;
        ack.entry_id = item.entry.id;
        ack.dead_letter_stream = options_.dead_letter;
        ack.fields = redacted(item.entry.fields);
        ack.delivery_count = delivery.delivery_count.value();
        return CommitHook{std::move(ack)};
    }

    /// Acks what the settlement says; redeliver: stays pending, the next take-over brings it
    /// back, after the settlement's delay where that is shorter than the visibility timeout
    /// (due_after()), else after the longer of the two.
    broker::Settlement::Kind settle(Item&, const StreamEntry& entry, const Delivery& delivery,
                                    const Outcome& outcome, const broker::Settlement& settlement) {
        if (settlement.kind == broker::Settlement::Kind::dead_letter_then_ack) {
            dead_letter_and_ack(entry, delivery, outcome);
        } else if (settlement.kind == broker::Settlement::Kind::ack) {
            checked({"XACK", options_.stream, options_.group, entry.id}, "XACK");
        } else if (auto command = due_after(entry, settlement)) {
            try {
                connection_.command(*command);
            } catch (const std::exception&) {
                // Still pending: it comes back after the visibility timeout instead; the next
                // poll meets the connection's trouble and reports it.
            }
        }
        return settlement.kind;
    }

    /// A failed (or deferred) entry the consumer still holds is due again after the settlement's
    /// delay, not after the visibility timeout, when the delay is the shorter: XCLAIM to itself
    /// with JUSTID (its delivery count unchanged) and IDLE visibility − delay, so the take-over's
    /// min-idle-time (the visibility timeout) is reached once the delay has passed. Nothing when
    /// there is no delay or it is not shorter (the take-over waits the longer already).
    std::optional<std::vector<std::string>> due_after(const StreamEntry& entry,
                                                      const broker::Settlement& settlement) const {
        if (settlement.kind != broker::Settlement::Kind::redeliver || !settlement.delay ||
            *settlement.delay >= options_.visibility_timeout) {
            return std::nullopt;
        }
        const std::chrono::milliseconds idle = options_.visibility_timeout - *settlement.delay;
        return std::vector<std::string>{
            "XCLAIM", options_.stream, options_.group, options_.consumer,
            "0",      entry.id,        "IDLE",         std::to_string(idle.count()),
            "JUSTID"};
    }

    /// Settles in one round trip: one XACK for the ordinary acks, pipelined with one
    /// dead-letter script per dead letter.
    void settle_all(std::vector<Item>&, std::vector<broker::ToSettle<StreamEntry>>& settling) {
        std::vector<std::vector<std::string>> commands;
        std::vector<std::string> xack{"XACK", options_.stream, options_.group};
        std::size_t plain_acks = 0;
        std::vector<std::vector<std::string>> due;  // failed entries due before the timeout
        for (const broker::ToSettle<StreamEntry>& s : settling) {
            switch (s.settlement.kind) {
                case broker::Settlement::Kind::redeliver:
                    count(s.settlement.kind);
                    if (auto command = due_after(*s.message, s.settlement)) {
                        due.push_back(std::move(*command));
                    }
                    break;
                case broker::Settlement::Kind::dead_letter_then_ack:
                    commands.push_back(dead_letter_eval(*s.message, s.delivery, s.outcome));
                    break;
                case broker::Settlement::Kind::ack:
                    xack.push_back(s.message->id);
                    ++plain_acks;
                    break;
            }
        }
        if (plain_acks != 0) commands.insert(commands.begin(), std::move(xack));
        const std::size_t settling_commands = commands.size();
        // Last, so a failed one (the entry then waits for the visibility timeout) is ignored.
        for (std::vector<std::string>& command : due)
            commands.push_back(std::move(command));
        if (commands.empty()) return;

        const std::vector<redis::Reply> replies = connection_.pipeline(commands);
        std::exception_ptr error;
        for (std::size_t k = 0; k < settling_commands; ++k) {
            const bool is_xack = plain_acks != 0 && k == 0;
            if (replies[k].is_error()) {
                if (!error) {
                    error = reply_error(replies[k], is_xack ? "XACK" : "dead letter (not acked)");
                }
            } else if (is_xack) {
                for (std::size_t n = 0; n < plain_acks; ++n)
                    count(broker::Settlement::Kind::ack);
            } else {
                count(broker::Settlement::Kind::dead_letter_then_ack);
            }
        }
        if (error) std::rethrow_exception(error);
    }

    /// One round trip: the group's pending count (XPENDING summary) and the dead-letter stream's
    /// length (XLEN). A failure is thrown (reported, no report this time): the next poll meets
    /// the same connection trouble and deals with it.
    ConsumerHealth health() {
        const std::vector<redis::Reply> replies =
            connection_.pipeline(std::vector<std::vector<std::string>>{
                {"XPENDING", options_.stream, options_.group}, {"XLEN", options_.dead_letter}});
        ConsumerHealth health;
        health.consumer = name_;
        health.dead_letter_destination = options_.dead_letter;
        if (replies[0].is_array() && !replies[0].elements.empty() &&
            replies[0].elements[0].type == redis::Reply::Type::integer) {
            health.pending = static_cast<std::uint64_t>(replies[0].elements[0].integer);
        }
        if (replies[1].type == redis::Reply::Type::integer) {
            health.dead_letter_depth = static_cast<std::uint64_t>(replies[1].integer);
        }
        return health;
    }

    // -----------------------------------------------------------------------------------------
    // Reading

    void ensure_group() {
        if (group_ready_ || !options_.declare) return;
        redis::Reply reply = connection_.command(
            {"XGROUP", "CREATE", options_.stream, options_.group, "0", "MKSTREAM"});
        if (reply.is_error() && reply.str.rfind("BUSYGROUP", 0) != 0) {
            redis::throw_reply_error(
                reply,
                fmt::format("idem::RedisStreamConsumer: XGROUP CREATE {} {} failed on {}: {}",
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
            throw store_error("idem::RedisStreamConsumer: XPENDING: unexpected reply");
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
            if (replies[i].is_error()) std::rethrow_exception(reply_error(replies[i], "XCLAIM"));
            if (!replies[i].is_array()) continue;
            for (const redis::Reply& element : replies[i].elements) {
                if (auto entry = detail::parse_stream_entry(element, options_.stream)) {
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
            command.push_back(std::to_string(options_.poll_wait.count()));
        }
        command.insert(command.end(), {"STREAMS", options_.stream, ">"});
        redis::Reply reply = checked(command, "XREADGROUP");
        if (reply.is_nil() || !reply.is_array()) return;  // nothing new within the block time
        for (const redis::Reply& stream : reply.elements) {
            if (!stream.is_array() || stream.elements.size() < 2) continue;
            for (const redis::Reply& element : stream.elements[1].elements) {
                if (auto entry = detail::parse_stream_entry(element, options_.stream)) {
                    batch.push_back(Item{std::move(*entry), 1});
                }
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Dead letters and errors

    /// The entry's fields as the dead-letter stream may keep them: each value through the
    /// policy's redactor (PolicyOptions::redact_payload), when it has one.
    std::vector<std::pair<std::string, std::string>> redacted(
        const std::vector<std::pair<std::string, std::string>>& fields) const {
        if (!dispatch().redacts()) return fields;
        std::vector<std::pair<std::string, std::string>> out;
        out.reserve(fields.size());
        for (const auto& [name, value] : fields)
            out.emplace_back(name, dispatch().redact(value));
        return out;
    }

    /// The dead-letter script's ARGV for the entry: group, entry id, then the copy's fields.
    std::vector<std::string> dead_letter_args(const StreamEntry& entry, const Delivery& delivery,
                                              const Outcome& outcome) const {
        std::vector<std::string> xadd = redis::stream_dead_letter_command(
            options_.dead_letter, options_.stream, entry.id, redacted(entry.fields), outcome.reason,
            dispatch().scope(), delivery.message_id, delivery.delivery_count.value(),
            outcome.noted_failure);
        xadd.erase(xadd.begin());  // XADD <key> * <fields...> → group, entry id, <fields...>
        xadd[0] = options_.group;
        xadd[1] = entry.id;
        return xadd;
    }

    /// The dead-letter script as one command of a pipeline (EVAL: no script cache to miss).
    std::vector<std::string> dead_letter_eval(const StreamEntry& entry, const Delivery& delivery,
                                              const Outcome& outcome) const {
        std::vector<std::string> command{"EVAL", redis::stream_dead_letter_ack_source, "2",
                                         options_.dead_letter, options_.stream};
        for (std::string& arg : dead_letter_args(entry, delivery, outcome))
            command.push_back(std::move(arg));
        return command;
    }

    /// Adds the entry to the dead-letter stream and acks it, atomically: either both or neither.
    void dead_letter_and_ack(const StreamEntry& entry, const Delivery& delivery,
                             const Outcome& outcome) {
        const std::vector<std::string> args = dead_letter_args(entry, delivery, outcome);
        redis::Reply reply = connection_.eval(redis::stream_dead_letter_ack_script(),
                                              {options_.dead_letter, options_.stream}, args);
        if (reply.is_error()) {
            redis::throw_reply_error(
                reply, fmt::format("idem::RedisStreamConsumer: moving entry {} of {} to "
                                   "{} failed on {} (not acked): {}",
                                   entry.id, options_.stream, options_.dead_letter,
                                   endpoint().describe(), reply.str));
        }
    }

    redis::Reply checked(const std::vector<std::string>& command, std::string_view what) {
        redis::Reply reply = connection_.command(command);
        if (!reply.is_error()) return reply;
        std::rethrow_exception(reply_error(reply, what));
    }

    /// The error for an error reply to @p what: store_unavailable for a server that cannot serve
    /// now (redis::is_unavailable_error(): LOADING, MASTERDOWN, ...), else store_error; NOGROUP
    /// also has the group created again.
    std::exception_ptr reply_error(const redis::Reply& reply, std::string_view what) {
        if (reply.str.rfind("NOGROUP", 0) == 0) {
            group_ready_ = false;  // e.g. a server restarted without persistence: create it again
            return std::make_exception_ptr(store_error(fmt::format(
                "idem::RedisStreamConsumer: {} on {}: {} ({})", what, endpoint().describe(),
                reply.str,
                options_.declare
                    ? "the group will be created again on the next poll"
                    : "create it with XGROUP CREATE, or set RedisStreamConsumerOptions::declare")));
        }
        const std::string message = fmt::format("idem::RedisStreamConsumer: {} failed on {}: {}",
                                                what, endpoint().describe(), reply.str);
        if (redis::is_unavailable_error(reply)) {
            return std::make_exception_ptr(store_unavailable(message));
        }
        return std::make_exception_ptr(store_error(message));
    }

    redis::FollowingConnection connection_;  ///< follows the stream's slot on a Redis Cluster
    std::string name_;
    bool group_ready_ = false;
    std::string cursor_ = "-";  ///< XPENDING resumes where the last poll stopped
};

IDEM_END_NAMESPACE
