#pragma once
/// @file
/// @brief idem::kafka::Config: a librdkafka configuration built by name (every librdkafka
/// property is accepted through set()), checked as it is set, with named setters for what idem's
/// consumers and producers care about. Link idem::kafka.
///
/// @code
/// auto config = idem::kafka::Config{}
///                   .bootstrap_servers("127.0.0.1:9092")
///                   .group_id("capture-worker")
///                   .cooperative();          // partition.assignment.strategy=cooperative-sticky
/// idem::kafka::Consumer consumer{std::move(config)};
/// @endcode

#include <librdkafka/rdkafka.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/error.hpp"

IDEM_BEGIN_NAMESPACE
namespace kafka {

namespace detail {
struct ConfFree {
    void operator()(rd_kafka_conf_t* conf) const noexcept { rd_kafka_conf_destroy(conf); }
};
using ConfPtr = std::unique_ptr<rd_kafka_conf_t, ConfFree>;
}  // namespace detail

/// @brief A librdkafka configuration (copyable: a copy duplicates it).
class Config {
  public:
    Config() : conf_(rd_kafka_conf_new()) {}
    /// @brief A copy: duplicates @p other's librdkafka configuration.
    Config(const Config& other) : conf_(other.duplicate()) {}
    /// @brief Replaces this configuration with a duplicate of @p other's.
    Config& operator=(const Config& other) {
        if (this != &other) conf_ = other.duplicate();
        return *this;
    }
    /// @brief Takes the other's configuration; the moved-from Config starts again from librdkafka's
    /// defaults on its next use.
    Config(Config&&) noexcept = default;
    /// @brief Frees this configuration and takes the other's.
    Config& operator=(Config&&) noexcept = default;
    ~Config() = default;

    /// @brief Sets librdkafka property @p name (CONFIGURATION.md of librdkafka lists them).
    /// @throws usage_error naming the property when librdkafka refuses the name or the value.
    Config& set(std::string_view name, std::string_view value) {
        char why[512] = {0};
        const std::string key(name);
        const std::string text(value);
        if (rd_kafka_conf_set(conf(), key.c_str(), text.c_str(), why, sizeof why) !=
            RD_KAFKA_CONF_OK) {
            throw usage_error(fmt::format("idem::kafka: config {}={}: {}", key, text, why));
        }
        return *this;
    }

    /// @brief The value of @p name (set, or librdkafka's default); nullopt when unknown.
    [[nodiscard]] std::optional<std::string> get(std::string_view name) const {
        const std::string key(name);
        std::size_t size = 0;
        if (rd_kafka_conf_get(conf(), key.c_str(), nullptr, &size) != RD_KAFKA_CONF_OK) {
            return std::nullopt;
        }
        std::string value(size, '\0');
        if (rd_kafka_conf_get(conf(), key.c_str(), value.data(), &size) != RD_KAFKA_CONF_OK) {
            return std::nullopt;
        }
        while (!value.empty() && value.back() == '\0')
            value.pop_back();
        return value;
    }

    /// `bootstrap.servers`: "host:port[,host:port...]".
    Config& bootstrap_servers(std::string_view servers) {
        return set("bootstrap.servers", servers);
    }
    /// `group.id`: the consumer group (required by kafka::Consumer).
    Config& group_id(std::string_view group) { return set("group.id", group); }
    /// `client.id`, as the brokers' logs show it.
    Config& client_id(std::string_view id) { return set("client.id", id); }
    /// `enable.idempotence`: the producer's sequence numbers make a retried produce land once
    /// per partition and keep its order (acks=all is implied).
    Config& idempotent(bool on = true) { return set("enable.idempotence", on ? "true" : "false"); }
    /// `partition.assignment.strategy=cooperative-sticky`: incremental rebalances (only the
    /// partitions that move are revoked) instead of the eager stop-the-world default.
    Config& cooperative() { return set("partition.assignment.strategy", "cooperative-sticky"); }
    /// `auto.offset.reset`: where a group without a committed offset starts ("earliest",
    /// "latest").
    Config& auto_offset_reset(std::string_view where) { return set("auto.offset.reset", where); }
    /// `session.timeout.ms`: how long the group coordinator waits for a silent member (a killed
    /// process) before its partitions move.
    Config& session_timeout(std::chrono::milliseconds timeout) {
        return set("session.timeout.ms", std::to_string(timeout.count()));
    }

    /// The librdkafka object (still owned by this Config).
    [[nodiscard]] rd_kafka_conf_t* conf() const {
        if (!conf_) conf_.reset(rd_kafka_conf_new());  // moved from: empty again
        return conf_.get();
    }
    /// A copy for rd_kafka_new(), which takes ownership of it on success.
    [[nodiscard]] detail::ConfPtr duplicate() const {
        return detail::ConfPtr(rd_kafka_conf_dup(conf()));
    }

  private:
    mutable detail::ConfPtr conf_;
};

}  // namespace kafka
IDEM_END_NAMESPACE
