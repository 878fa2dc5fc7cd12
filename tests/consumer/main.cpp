// A user's program built against an installed idem (find_package) or add_subdirectory: it wraps
// a handler on the SQLite store (the memory store in a build without it) and checks the
// redelivery is a duplicate. IDEM_CONSUMER_HAS_<NAME>: the components it was given.
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include <idem/idem.hpp>
#include <idem/store/memory.hpp>
#if IDEM_CONSUMER_HAS_POSTGRES
#include <idem/store/postgres.hpp>
#endif
#if IDEM_CONSUMER_HAS_REDIS
#include <idem/store/redis.hpp>
#endif
#if IDEM_CONSUMER_HAS_MYSQL
#include <idem/store/mysql.hpp>
#endif
#if IDEM_CONSUMER_HAS_SQLITE
#include <idem/store/sqlite.hpp>
#endif
#if IDEM_CONSUMER_HAS_NATS
#include <idem/broker/nats_jetstream.hpp>
#if IDEM_CONSUMER_HAS_TESTING
#include <idem/testing/nats_server.hpp>
#endif
#endif
#if IDEM_CONSUMER_HAS_KAFKA
#include <idem/kafka/consumer.hpp>
#include <idem/kafka/producer.hpp>
#if IDEM_CONSUMER_HAS_TESTING
#include <idem/testing/kafka_cluster.hpp>
#endif
#endif
#if IDEM_CONSUMER_HAS_SPDLOG
#include <spdlog/sinks/null_sink.h>
#include <idem/observers/spdlog.hpp>
#endif

#if IDEM_CONSUMER_HAS_REDIS && IDEM_CONSUMER_HAS_TESTING
// redis_testing.cpp: idem/testing/redis_server.hpp compiles and links (no server is started).
bool idem_consumer_redis_testing_kit_links();
#endif

int main() {
    static_assert(IDEM_VERSION_MAJOR == 0 && IDEM_VERSION_MINOR == 1, "unexpected idem version");
#ifdef IDEM_CONSUMER_PACKAGE_VERSION_MAJOR
    static_assert(IDEM_VERSION_MAJOR == IDEM_CONSUMER_PACKAGE_VERSION_MAJOR &&
                      IDEM_VERSION_MINOR == IDEM_CONSUMER_PACKAGE_VERSION_MINOR &&
                      IDEM_VERSION_PATCH == IDEM_CONSUMER_PACKAGE_VERSION_PATCH,
                  "the CMake package's version (find_package) differs from idem/config.hpp's");
#endif
    static_assert(
        IDEM_VERSION == IDEM_VERSION_MAJOR * 10000 + IDEM_VERSION_MINOR * 100 + IDEM_VERSION_PATCH,
        "IDEM_VERSION");
#if IDEM_CONSUMER_HAS_SQLITE
    static_assert(idem::sql::schema_version == IDEM_SQL_SCHEMA_VERSION, "sql::schema_version");
    static_assert(idem::SqliteStore::schema_version == IDEM_SQL_SCHEMA_VERSION, "SqliteStore");
#endif
#if IDEM_CONSUMER_HAS_REDIS
    static_assert(idem::RedisStore::schema_version == IDEM_REDIS_SCHEMA_VERSION, "RedisStore");
#endif
    // The postgres, redis and mysql components link and their stores fit (no server is needed to
    // check that).
#if IDEM_CONSUMER_HAS_POSTGRES
    static_assert(idem::is_store_v<idem::PostgresStore>, "PostgresStore must fit");
#endif
#if IDEM_CONSUMER_HAS_REDIS
    static_assert(idem::is_store_v<idem::RedisStore>, "RedisStore must fit");
#if IDEM_CONSUMER_HAS_TESTING
    if (!idem_consumer_redis_testing_kit_links()) {
        std::printf("idem-consumer FAILED: idem::testing::RedisServer\n");
        return 1;
    }
#endif
#endif
#if IDEM_CONSUMER_HAS_MYSQL
    static_assert(idem::is_store_v<idem::MysqlStore>, "MysqlStore must fit");
    if (mysql_get_client_version() == 0) return 1;  // libmariadb links
#endif
#if IDEM_CONSUMER_HAS_NATS
    // The nats component: the consumer builds (it connects on its first poll, not here), the
    // test kit compiles, and cnats links (a function of it is called).
    {
        idem::JetStreamConsumerOptions nats_options;
        nats_options.stream = "ORDERS";
        nats_options.durable = "consumer-check";
        idem::JetStreamConsumer nats_consumer(
            idem::nats::Endpoint{}, nats_options,
            [](const idem::Delivery&, const idem::JetStreamMessage&) {
                return idem::Outcome{idem::Disposition::processed, {}};
            });
#if IDEM_CONSUMER_HAS_TESTING
        std::string why;
        (void)idem::testing::NatsServer::available(&why);
#endif
        if (natsStatus_GetText(NATS_OK) == nullptr) return 1;
    }
#endif
#if IDEM_CONSUMER_HAS_KAFKA
    // The kafka component: its configuration builder works and librdkafka links (no cluster).
    {
        const auto config = idem::kafka::Config{}.bootstrap_servers("127.0.0.1:9").group_id("g");
        if (config.get("group.id") != std::optional<std::string>("g")) return 1;
        if (rd_kafka_version() == 0) return 1;
    }
#endif
#if IDEM_CONSUMER_HAS_SPDLOG
    // The spdlog component brings spdlog (built on the same fmt) and its adapter links.
    idem::LoggingObserver logs(idem::spdlog_logger(std::make_shared<spdlog::logger>(
        "idem-consumer", std::make_shared<spdlog::sinks::null_sink_mt>())));
    logs.on_outcome("consumer-check", idem::Delivery{"m-0", 1u},
                    idem::failed_outcome("check", idem::FailureCause::other));
#endif
    int runs = 0;
#if IDEM_CONSUMER_HAS_SQLITE
    idem::SqliteStore store(":memory:");
    auto handler = idem::make_handler(store, idem::Policy{"consumer-check"},
                                      [&](auto& tx, const std::string& body) {
                                          ++runs;
                                          tx.execute("CREATE TABLE IF NOT EXISTS t(v TEXT)");
                                          tx.execute("INSERT INTO t(v) VALUES (?)", body);
                                      });
#else
    idem::MemoryStore store;
    auto handler = idem::make_handler(store, idem::Policy{"consumer-check"},
                                      [&](auto& tx, const std::string& body) {
                                          ++runs;
                                          tx.put("t", body, body);
                                      });
#endif
    auto first = handler.handle(idem::Delivery{"m-1", 1u}, std::string("hello"));
    auto second = handler.handle(idem::Delivery{"m-1", 2u}, std::string("hello"));
    if (first.disposition != idem::Disposition::processed ||
        second.disposition != idem::Disposition::duplicate || runs != 1) {
        std::printf("idem-consumer FAILED: %s / %s / runs=%d\n",
                    std::string(idem::to_string(first.disposition)).c_str(),
                    std::string(idem::to_string(second.disposition)).c_str(), runs);
        return 1;
    }
    std::printf("idem %d.%d.%d: %s then %s (%s)\n", IDEM_VERSION_MAJOR, IDEM_VERSION_MINOR,
                IDEM_VERSION_PATCH, std::string(idem::to_string(first.disposition)).c_str(),
                std::string(idem::to_string(second.disposition)).c_str(), second.reason.c_str());
    std::printf("idem-consumer ok\n");
    return 0;
}
