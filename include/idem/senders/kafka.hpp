#pragma once
/// @file
/// @brief idem::KafkaSender: an idem::Relay sender that produces each outbox intent to the Kafka
/// topic named by its destination with the idempotent producer, the idempotency key in the
/// record header idem::kafka::message_id_header ("idem-message-id") and, by default, as the
/// record key; it waits for the delivery report. Link idem::kafka. See docs/chain.md.
///
/// @code
/// idem::Relay relay(store, idem::KafkaSender{idem::kafka::Config{}.bootstrap_servers(servers)});
/// @endcode

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/records.hpp"
#include "idem/error.hpp"
#include "idem/kafka/config.hpp"
#include "idem/kafka/error.hpp"
#include "idem/kafka/message.hpp"
#include "idem/kafka/producer.hpp"
#include "idem/outbox.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief How a KafkaSender keys its records and how long it waits.
struct KafkaSenderOptions {
    /// The record key (it picks the partition, so it orders records of one key); empty: the
    /// intent's idempotency key.
    std::function<std::string(const OutboxRow&)> record_key{};
    /// How long a send waits for the delivery report. Keep it above the producer's
    /// message.timeout.ms (300 s by default), or a record still being retried counts as failed
    /// and is resent (a duplicate for the consumer's claim, never a loss).
    std::chrono::milliseconds delivery_timeout = std::chrono::seconds(330);
};

/// @brief Produces an outbox intent and waits for its delivery report (Pending::wait()).
///
/// The producer is idempotent (Config::idempotent() is set on the config given): librdkafka's
/// own retries of a record are not duplicated in the log. A resend by the relay (it died between
/// the send and the mark, or the report did not come in time) is a new record with the same
/// key in its idem-message-id header: the consumer's claim drops it.
///
/// Failures (the reason is in the exception's text): no broker reachable, a timeout, a record
/// expired undelivered, a leader moving, an unknown topic (it may be created later) → retry
/// later. A record too large (for the producer's message.max.bytes or the broker's), an invalid
/// record or topic, or a topic the client is not authorized to write → idem::send_refused:
/// parked at once. A fatal error of the idempotent producer → retry later with a new producer.
///
/// One Relay thread at a time; movable.
class KafkaSender {
  public:
    /// @param config the producer's configuration (bootstrap.servers, ...); idempotence is set.
    /// @throws usage_error when librdkafka refuses the configuration.
    explicit KafkaSender(kafka::Config config, KafkaSenderOptions options = {})
        : config_(std::move(config.idempotent())),
          options_(std::move(options)),
          producer_(std::make_unique<kafka::Producer>(config_)) {}

    /// @brief Produces @p row and waits for its delivery report.
    /// @return where it was stored.
    /// @throws idem::send_refused (park), kafka::error / unavailable / timeout (retry later).
    kafka::Delivered operator()(const OutboxRow& row) {
        if (!producer_) producer_ = std::make_unique<kafka::Producer>(config_);
        const std::string key =
            options_.record_key ? options_.record_key(row) : row.idempotency_key;
        const kafka::Headers headers{{kafka::message_id_header, row.idempotency_key}};
        try {
            return producer_->produce(row.destination, key, row.payload, headers)
                .wait(options_.delivery_timeout);
        } catch (const kafka::error& e) {
            if (e.fatal()) producer_.reset();  // unusable: the next send makes a new one
            if (refused_for_good(e.code())) {
                throw send_refused(fmt::format(
                    "idem::KafkaSender: the record '{}' to topic '{}' is refused for good: {}",
                    row.idempotency_key, row.destination, e.what()));
            }
            throw;
        }
    }

  private:
    static bool refused_for_good(rd_kafka_resp_err_t code) noexcept {
        switch (code) {
            case RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE:
            case RD_KAFKA_RESP_ERR_RECORD_LIST_TOO_LARGE:
            case RD_KAFKA_RESP_ERR_INVALID_RECORD:
            case RD_KAFKA_RESP_ERR_TOPIC_EXCEPTION:
            case RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED:
                return true;
            default:
                return false;
        }
    }

    kafka::Config config_;
    KafkaSenderOptions options_;
    std::unique_ptr<kafka::Producer> producer_;
};

IDEM_END_NAMESPACE
