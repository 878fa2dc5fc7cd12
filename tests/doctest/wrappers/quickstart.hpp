// Doc-test wrapper `quickstart` (README.md's Quickstart): the block at namespace scope, with the
// user's own types it names (a message, a gateway that honours idempotency keys, the consumer
// loop's broker); doctest_run() feeds it a redelivery and checks one capture and one charge.
#include <sqlite3.h>

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

// @use capture_types

struct Message {
    std::string message_id;
    std::uint32_t count = 1;
    CapturePayment payment;
    const std::string& id() const { return message_id; }
    std::uint32_t delivery_count() const { return count; }
    const CapturePayment& body() const { return payment; }
};

struct Consumer {
    std::deque<Message> queue;
    std::vector<std::string> acked;
    std::optional<Message> next() {
        if (queue.empty()) return std::nullopt;
        Message m = queue.front();
        queue.pop_front();
        return m;
    }
    void ack(const Message& m) { acked.push_back(m.id()); }
};

// @block

inline int rows(sqlite3* db, const char* sql) {
    sqlite3_stmt* statement = nullptr;
    sqlite3_prepare_v2(db, sql, -1, &statement, nullptr);
    const int n = sqlite3_step(statement) == SQLITE_ROW ? sqlite3_column_int(statement, 0) : -1;
    sqlite3_finalize(statement);
    return n;
}

inline void doctest_run() {
    sqlite3* db = nullptr;
    sqlite3_open(":memory:", &db);
    sqlite3_exec(db, "CREATE TABLE captures(order_id TEXT, gateway_reference TEXT)", nullptr,
                 nullptr, nullptr);
    Consumer consumer;
    consumer.queue = {Message{"m-1", 1u, {"8814", "tok", 1250}},
                      Message{"m-1", 2u, {"8814", "tok", 1250}},  // the broker redelivers
                      Message{"m-2", 1u, {"8815", "tok", 990}}};
    Gateway gateway;
    run_capture_worker(db, consumer, gateway);
    IDEM_DOCTEST_CHECK(consumer.acked == std::vector<std::string>{"m-1", "m-1", "m-2"});
    IDEM_DOCTEST_CHECK(gateway.requests == 2);  // the redelivery is a duplicate: no call
    IDEM_DOCTEST_CHECK(rows(db, "SELECT COUNT(*) FROM captures") == 2);
    sqlite3_close(db);
}
