// MysqlStore against a real MariaDB server (idem/testing/mariadb_server.hpp): both isolation
// levels, the wait on a concurrent claim (innodb_lock_wait_timeout → in_progress), deadlocks and
// lock waits in the effect (1213 / 1205 → store_timeout, failed, never acked), a lost
// connection and the reconnect, the server killed and restarted mid-run (each message applied
// once), a borrowed MYSQL*, the effect's writes sharing the claim's commit, binary ids, and the
// schema.

#include <gtest/gtest.h>
#include <mysql.h>

#include <chrono>
#include <future>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/store/mysql.hpp"
#include "idem/testing/mariadb_server.hpp"
#include "support/mysql_env.hpp"
#include "support/require_mariadb.hpp"
#include "support/stored_offsets.hpp"

namespace {

using idem::ClaimStatus;
using idem::Delivery;
using idem::Disposition;
using idem::FailureCause;
using idem::MysqlStore;
using idem::testing::MariadbClient;
using namespace std::chrono_literals;

class MysqlStoreTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_MARIADB();
        database_ = idem_test::fresh_mariadb_database();
        client().exec(
            "CREATE TABLE captures(order_id BIGINT NOT NULL, reference VARCHAR(64) NOT NULL, "
            "UNIQUE KEY(order_id)) ENGINE=InnoDB;"
            "CREATE TABLE rows_to_lock(id INT PRIMARY KEY) ENGINE=InnoDB;"
            "INSERT INTO rows_to_lock VALUES (1), (2)");
    }
    void TearDown() override {
        if (database_.empty()) return;
        try {
            idem::testing::shared_mariadb().client("").exec("DROP DATABASE IF EXISTS " + database_);
        } catch (...) {
        }
    }

    [[nodiscard]] MariadbClient client() const {
        return idem::testing::shared_mariadb().client(database_);
    }
    [[nodiscard]] idem::MysqlEndpoint endpoint() const {
        return idem_test::mariadb_endpoint(database_);
    }
    std::unique_ptr<MysqlStore> store(idem::MysqlOptions options = {}) const {
        return std::make_unique<MysqlStore>(endpoint(), options);
    }
    long long count(const std::string& sql) {
        return std::stoll(client().value(sql).value_or("-1"));
    }

    /// The capture consumer: one row in the user's table through the claim's transaction.
    static auto capture(MysqlStore& store, bool fail_after_write = false) {
        return idem::make_handler(store, idem::Policy{"capture-payment"},
                                  [fail_after_write](auto& tx, const std::string& order) {
                                      tx.execute(
                                          "INSERT INTO captures(order_id, reference) VALUES (?, ?)",
                                          std::stoll(order), "ch_" + order);
                                      if (fail_after_write) throw std::runtime_error("gateway 503");
                                  });
    }

    std::string database_;
};

TEST_F(MysqlStoreTest, TablesAreInnoDbAndTheSchemaIsVersioned) {
    auto s = store();
    EXPECT_EQ(count("SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = "
                    "DATABASE() AND table_name LIKE 'idem\\_%' AND engine = 'InnoDB'"),
              7);  // claims, dead letters, locks, outbox, attempts, offsets, schema
    EXPECT_EQ(count("SELECT MAX(version) FROM idem_schema"), MysqlStore::schema_version);
    // A second store on the same database opens the existing schema.
    EXPECT_NO_THROW(store());
    client().exec("UPDATE idem_schema SET version = 99");
    try {
        store();
        ADD_FAILURE() << "a newer schema was accepted";
    } catch (const idem::store_error& e) {
        EXPECT_NE(std::string(e.what()).find("version 99"), std::string::npos) << e.what();
    }
}

TEST_F(MysqlStoreTest, VersionTwoSchemaIsMigratedToStoredOffsets) {
    {
        auto created = store();
        auto handler = capture(*created);
        ASSERT_EQ(handler.handle(idem::Delivery{"m-1", 1u}, std::string("1")).disposition,
                  idem::Disposition::processed);
    }
    client().exec("DROP TABLE idem_offsets");  // what idem schema version 2 left
    client().exec(                             // nor version 4's redrive columns
        "ALTER TABLE idem_dead_letters DROP KEY idem_dead_letters_message, "
        "DROP COLUMN redrive_count, DROP COLUMN redriven_at");
    client().exec("UPDATE idem_schema SET version = 2");
    auto migrated = store();
    EXPECT_EQ(count("SELECT MAX(version) FROM idem_schema"), idem::MysqlStore::schema_version);
    EXPECT_EQ(count("SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = "
                    "DATABASE() AND table_name = 'idem_offsets'"),
              1);
    EXPECT_TRUE(migrated->find_claim("capture-payment", "m-1").has_value());
    EXPECT_TRUE(idem_test::commit_offset(*migrated, "g", "t", 0, 12));
    EXPECT_EQ(migrated->stored_offset("g", "t", 0), std::optional<std::int64_t>(12));
}

TEST_F(MysqlStoreTest, BothIsolationLevelsSeeAClaimCommittedWhileTheInsertWaited) {
    for (const auto level :
         {idem::MysqlIsolation::repeatable_read, idem::MysqlIsolation::read_committed}) {
        SCOPED_TRACE(level == idem::MysqlIsolation::read_committed ? "READ COMMITTED"
                                                                   : "REPEATABLE READ");
        idem::MysqlOptions options;
        options.isolation = level;
        auto first = store(options);
        auto second = store(options);
        const std::string id = level == idem::MysqlIsolation::read_committed ? "rc-id" : "rr-id";
        {
            auto tx = second->begin();
            EXPECT_EQ(tx.query_text("SELECT @@tx_isolation"),
                      level == idem::MysqlIsolation::read_committed ? "READ-COMMITTED"
                                                                    : "REPEATABLE-READ");
        }
        auto holder = first->begin();
        ASSERT_EQ(holder.claim("iso", id).status, ClaimStatus::claimed);
        // The second transaction has read before (REPEATABLE READ: its snapshot is taken),
        // then claims the id the first one holds: it waits, and sees the committed claim.
        auto fut = std::async(std::launch::async, [&] {
            auto tx = second->begin();
            (void)tx.query_int("SELECT COUNT(*) FROM captures");
            return tx.claim("iso", id);
        });
        std::this_thread::sleep_for(300ms);
        holder.record_outcome("iso", id, Disposition::processed, "");
        holder.commit();
        const auto result = fut.get();
        EXPECT_EQ(result.status, ClaimStatus::duplicate);
        EXPECT_EQ(result.recorded, Disposition::processed);
    }
}

TEST_F(MysqlStoreTest, AClaimHeldByAnotherOpenTransactionWaitsThenAnswersInProgress) {
    idem::MysqlOptions options;
    options.lock_wait_timeout = 1s;
    auto holder_store = store(options);
    auto waiter_store = store(options);
    auto holder = holder_store->begin();
    ASSERT_EQ(holder.claim("capture-payment", "m-held").status, ClaimStatus::claimed);

    auto handler = capture(*waiter_store);
    const auto t0 = std::chrono::steady_clock::now();
    auto outcome = handler.handle(Delivery{"m-held", 1u}, std::string("7"));
    const auto waited = std::chrono::steady_clock::now() - t0;
    EXPECT_EQ(outcome.disposition, Disposition::in_progress) << outcome.reason;
    EXPECT_FALSE(idem::should_ack(outcome));
    EXPECT_GE(waited, 900ms);
    EXPECT_LT(waited, 5s);

    // The claim's own statement was undone; the transaction stays usable for other ids.
    {
        auto tx = waiter_store->begin();
        EXPECT_EQ(tx.claim("capture-payment", "m-held").status, ClaimStatus::in_progress);
        EXPECT_EQ(tx.claim("capture-payment", "m-other").status, ClaimStatus::claimed);
        tx.commit();
    }
    holder.record_outcome("capture-payment", "m-held", Disposition::processed, "");
    holder.commit();
    outcome = handler.handle(Delivery{"m-held", 2u}, std::string("7"));
    EXPECT_EQ(outcome.disposition, Disposition::duplicate) << outcome.reason;
    EXPECT_EQ(count("SELECT COUNT(*) FROM captures"), 0);  // the holder wrote no capture
}

TEST_F(MysqlStoreTest, ALockWaitInTheEffectIsAStoreTimeoutAndNothingIsStored) {
    idem::MysqlOptions options;
    options.lock_wait_timeout = 1s;
    auto s = store(options);
    auto other = client();
    other.exec("START TRANSACTION; SELECT id FROM rows_to_lock WHERE id = 1 FOR UPDATE");
    auto handler =
        idem::make_handler(*s, idem::Policy{"lock-wait"}, [](auto& tx, const std::string& order) {
            tx.execute("INSERT INTO captures VALUES (?, 'x')", std::stoll(order));
            tx.execute("UPDATE rows_to_lock SET id = 1 WHERE id = 1");
        });
    auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("1"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_EQ(outcome.cause, FailureCause::store_timeout) << outcome.reason;
    EXPECT_NE(outcome.reason.find("1205"), std::string::npos) << outcome.reason;
    other.exec("ROLLBACK");
    EXPECT_EQ(count("SELECT COUNT(*) FROM captures"), 0);
    EXPECT_FALSE(s->find_claim("lock-wait", "m-1").has_value());
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("1")).disposition,
              Disposition::processed);
}

TEST_F(MysqlStoreTest, ADeadlockInTheEffectIsAStoreTimeoutNeverAnAck) {
    idem_test::MysqlEnv env;  // its make_commit_fail() stages a real deadlock
    auto handler = idem::make_handler(*env.store, idem::Policy{"deadlock"},
                                      [&](auto& tx, const std::string& body) {
                                          idem_test::MysqlEnv::write_effect(tx, body);
                                          env.make_commit_fail(tx);  // swallows the 1213
                                          // The transaction is gone: nothing more may run
                                          // (it would autocommit without the claim).
                                          idem_test::MysqlEnv::write_effect(tx, body + "-after");
                                      });
    auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("row"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_FALSE(idem::should_ack(outcome));
    EXPECT_EQ(outcome.cause, FailureCause::store_timeout) << outcome.reason;
    EXPECT_NE(outcome.reason.find("1213"), std::string::npos) << outcome.reason;
    EXPECT_EQ(env.effect_rows(), 0u);
    EXPECT_FALSE(env.store->find_claim("deadlock", "m-1").has_value());
}

TEST_F(MysqlStoreTest, TheEffectsWritesShareTheClaimsCommit) {
    auto s = store();
    auto failing = capture(*s, true);
    auto outcome = failing.handle(Delivery{"m-42", 1u}, std::string("42"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_EQ(count("SELECT COUNT(*) FROM captures"), 0);  // rolled back with the claim
    EXPECT_FALSE(s->find_claim("capture-payment", "m-42").has_value());

    auto handler = capture(*s);
    EXPECT_EQ(handler.handle(Delivery{"m-42", 2u}, std::string("42")).disposition,
              Disposition::processed);
    EXPECT_EQ(handler.handle(Delivery{"m-42", 3u}, std::string("42")).disposition,
              Disposition::duplicate);
    EXPECT_EQ(count("SELECT COUNT(*) FROM captures WHERE order_id = 42"), 1);
    EXPECT_EQ(client().value("SELECT reference FROM captures"), "ch_42");
}

// MySQL replaces a savepoint of the same name where PostgreSQL stacks them: nested savepoints
// are named per depth, and a release sends nothing (the marker stays until the same depth's next
// SAVEPOINT or the transaction's end).
TEST_F(MysqlStoreTest, NestedSavepointsUndoOnlyTheirOwnWrites) {
    auto s = store();
    auto tx = s->begin();
    tx.execute("INSERT INTO captures VALUES (1, 'outer')");
    tx.savepoint();
    tx.execute("INSERT INTO captures VALUES (2, 'first')");
    tx.savepoint();
    tx.execute("INSERT INTO captures VALUES (3, 'inner')");
    tx.rollback_to_savepoint();  // 3 gone
    tx.savepoint();
    tx.execute("INSERT INTO captures VALUES (4, 'kept')");
    tx.release_savepoint();      // 4 kept
    tx.rollback_to_savepoint();  // 2 and 4 gone
    tx.savepoint();
    tx.execute("INSERT INTO captures VALUES (5, 'again')");
    tx.savepoint();
    tx.execute("INSERT INTO captures VALUES (6, 'deeper')");
    tx.release_savepoint();
    tx.release_savepoint();  // 5 and 6 kept
    tx.savepoint();
    tx.execute("INSERT INTO captures VALUES (7, 'last')");
    tx.rollback_to_savepoint();  // 7 gone; 5 and 6 stay (released, not rolled back)
    tx.commit();
    EXPECT_EQ(client().value("SELECT GROUP_CONCAT(order_id ORDER BY order_id) FROM captures"),
              "1,5,6");
}

TEST_F(MysqlStoreTest, DdlOrCommitInsideTheEffectIsRefused) {
    auto s = store();
    auto handler = idem::make_handler(*s, idem::Policy{"ddl"},
                                      [](auto& tx, const std::string&) { tx.execute("COMMIT"); });
    auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("x"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_NE(outcome.reason.find("ended by a statement"), std::string::npos) << outcome.reason;
    // The store is usable afterwards.
    EXPECT_EQ(capture(*s).handle(Delivery{"m-2", 1u}, std::string("2")).disposition,
              Disposition::processed);
}

TEST_F(MysqlStoreTest, BinaryIdsAndLongScopesRoundTrip) {
    auto s = store();
    std::string id(idem::max_message_id_bytes, '\0');
    for (std::size_t i = 0; i < id.size(); ++i)
        id[i] = static_cast<char>(i * 7);
    const std::string scope(idem::max_scope_bytes, '\xff');
    const std::string other_id = id.substr(0, 511) + '\x01';
    {
        auto tx = s->begin();
        EXPECT_EQ(tx.claim(scope, id, std::string("fp\0x", 4)).status, ClaimStatus::claimed);
        EXPECT_EQ(tx.claim(scope, other_id).status, ClaimStatus::claimed);
        tx.record_outcome(scope, id, Disposition::rejected, std::string("bad\xc3(", 5));
        tx.commit();
    }
    const auto found = s->find_claim(scope, id);
    ASSERT_TRUE(found.has_value());
    EXPECT_EQ(found->message_id, id);
    EXPECT_EQ(found->scope, scope);
    EXPECT_EQ(found->disposition, Disposition::rejected);
    EXPECT_EQ(found->reason, std::string("bad\xc3(", 5));
    EXPECT_EQ(found->fingerprint, std::string("fp\0x", 4));
    auto tx = s->begin();
    const auto again = tx.claim(scope, id);
    EXPECT_EQ(again.status, ClaimStatus::duplicate);
    EXPECT_EQ(again.fingerprint, std::string("fp\0x", 4));
    // Quotes, backslashes and placeholders in the effect's text values.
    EXPECT_EQ(tx.execute("INSERT INTO captures VALUES (?, ?)", 1, "it's a \\ ? '--"), 1);
    EXPECT_EQ(tx.query_text("SELECT reference FROM captures WHERE order_id = ? AND '?' = '?'", 1),
              "it's a \\ ? '--");
    EXPECT_THROW(tx.execute("SELECT ?, ?", 1), idem::usage_error);
}

TEST_F(MysqlStoreTest, ABorrowedConnectionIsUsedAndNeverClosed) {
    idem::testing::detail::library_init();
    MYSQL* conn = mysql_init(nullptr);
    ASSERT_NE(conn, nullptr);
    auto& server = idem::testing::shared_mariadb();
    ASSERT_NE(
        mysql_real_connect(conn, server.host().c_str(), server.user().c_str(), "",
                           database_.c_str(), static_cast<unsigned>(server.port()), nullptr, 0),
        nullptr)
        << mysql_error(conn);
    {
        MysqlStore s{conn};
        EXPECT_EQ(s.conn(), conn);
        auto handler = capture(s);
        EXPECT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("1")).disposition,
                  Disposition::processed);
        // The effect may use the connection itself: it is the same transaction.
        auto with_conn =
            idem::make_handler(s, idem::Policy{"raw"}, [conn](auto& tx, const std::string&) {
                EXPECT_EQ(tx.conn(), conn);
                ASSERT_EQ(mysql_query(tx.conn(), "INSERT INTO captures VALUES (2, 'raw')"), 0);
            });
        EXPECT_EQ(with_conn.handle(Delivery{"m-2", 1u}, std::string("2")).disposition,
                  Disposition::processed);
    }
    EXPECT_EQ(mysql_query(conn, "SELECT COUNT(*) FROM captures"), 0) << mysql_error(conn);
    MYSQL_RES* result = mysql_store_result(conn);
    ASSERT_NE(result, nullptr);
    EXPECT_STREQ(mysql_fetch_row(result)[0], "2");
    mysql_free_result(result);

    // Refused: inside a transaction; CLIENT_FOUND_ROWS.
    ASSERT_EQ(mysql_query(conn, "START TRANSACTION"), 0);
    EXPECT_THROW(MysqlStore{conn}, idem::usage_error);
    ASSERT_EQ(mysql_query(conn, "ROLLBACK"), 0);
    mysql_close(conn);
    MYSQL* found_rows = mysql_init(nullptr);
    ASSERT_NE(mysql_real_connect(found_rows, server.host().c_str(), server.user().c_str(), "",
                                 database_.c_str(), static_cast<unsigned>(server.port()), nullptr,
                                 CLIENT_FOUND_ROWS),
              nullptr);
    EXPECT_THROW(MysqlStore{found_rows}, idem::usage_error);
    mysql_close(found_rows);
    EXPECT_THROW(MysqlStore{static_cast<MYSQL*>(nullptr)}, idem::usage_error);
}

TEST_F(MysqlStoreTest, AKilledConnectionFailsTheMessageAndTheNextBeginReconnects) {
    auto s = store();
    const auto thread_id = std::to_string(mysql_thread_id(s->conn()));
    auto handler =
        idem::make_handler(*s, idem::Policy{"killed"}, [&](auto& tx, const std::string& order) {
            tx.execute("INSERT INTO captures VALUES (?, 'k')", std::stoll(order));
            client().exec("KILL CONNECTION " + thread_id);
            tx.execute("INSERT INTO captures VALUES (?, 'k')", std::stoll(order) + 1);
        });
    auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("10"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_EQ(outcome.cause, FailureCause::store_unavailable) << outcome.reason;
    EXPECT_TRUE(outcome.store_unreachable());
    EXPECT_EQ(count("SELECT COUNT(*) FROM captures"), 0);
    EXPECT_EQ(s->sessions(), 1u);
    EXPECT_EQ(capture(*s).handle(Delivery{"m-2", 1u}, std::string("20")).disposition,
              Disposition::processed);
    EXPECT_EQ(s->sessions(), 2u);
    EXPECT_EQ(count("SELECT @@innodb_lock_wait_timeout"), 50);  // others keep the default
    auto tx = s->begin();
    EXPECT_EQ(tx.query_int("SELECT @@innodb_lock_wait_timeout"), 5);  // set again
}

// The server is SIGKILLed and restarted while messages flow: every message ends applied once.
TEST(MysqlStoreCrash, ServerKilledAndRestartedMidRunAppliesEachMessageOnce) {
    IDEM_REQUIRE_MARIADB();
    idem::testing::MariadbServer server;
    server.client().exec("CREATE TABLE captures(order_id BIGINT PRIMARY KEY) ENGINE=InnoDB");
    idem::MysqlEndpoint endpoint;
    endpoint.host = server.host();
    endpoint.port = static_cast<unsigned>(server.port());
    endpoint.user = server.user();
    endpoint.database = "idem_test";
    MysqlStore store{endpoint};
    int effects = 0;
    int kill_in_effect_at = -1;  // the server dies inside this message's transaction
    auto handler =
        idem::make_handler(store, idem::Policy{"capture"}, [&](auto& tx, const std::string& order) {
            ++effects;
            tx.execute("INSERT INTO captures VALUES (?)", std::stoll(order));
            if (std::stoi(order) == kill_in_effect_at) {
                kill_in_effect_at = -1;
                server.kill9();
            }
        });
    constexpr int messages = 120;
    std::vector<std::uint32_t> deliveries(messages, 0);
    int failed = 0;
    for (int round = 0; round < 6; ++round) {
        for (int i = 0; i < messages; ++i) {
            if (i == 40 * (round + 1) && round < 2) {
                server.kill9();  // between messages: the next begin() reconnects
                server.start();
            }
            if (i == 25 && round < 2) kill_in_effect_at = i;  // before the COMMIT
            const std::string id = "m-" + std::to_string(i);
            auto outcome = handler.handle(
                Delivery{id, idem::DeliveryCount::from(++deliveries[static_cast<std::size_t>(i)])},
                std::to_string(i));
            if (outcome.disposition == Disposition::failed) {
                ++failed;
                if (!server.running()) server.start();
                EXPECT_TRUE(outcome.store_unreachable()) << outcome.reason;
            } else {
                EXPECT_TRUE(outcome.disposition == Disposition::processed ||
                            outcome.disposition == Disposition::duplicate)
                    << outcome.reason;
            }
        }
    }
    EXPECT_GE(failed, 1);  // the kills were seen
    EXPECT_EQ(server.client().value("SELECT COUNT(*) FROM captures"), std::to_string(messages));
    EXPECT_EQ(server.client().value("SELECT COUNT(*) FROM idem_claims"), std::to_string(messages));
    EXPECT_GE(store.sessions(), 3u);
    EXPECT_LE(effects, messages + failed);
}

TEST_F(MysqlStoreTest, PurgeAndLocks) {
    auto now = idem_test::test_epoch();
    idem::MysqlOptions options;
    options.clock = [&] { return now; };
    auto s = store(options);
    {
        auto tx = s->begin();
        for (int i = 0; i < 30; ++i)
            ASSERT_EQ(tx.claim("purge", "m-" + std::to_string(i)).status, ClaimStatus::claimed);
        tx.commit();
    }
    now += idem::days(15);
    EXPECT_EQ(s->purge(idem::days(14)).claims, 30u);
    // try_lock in an open transaction refuses hold_lock at once, and the other way round.
    auto other = store(options);
    auto tx = s->begin();
    ASSERT_TRUE(tx.try_lock("invoice-9", 1min));
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_FALSE(other->hold_lock("invoice-9", "batch", 1min));
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
    {
        auto second = other->begin();
        EXPECT_FALSE(second.try_lock("invoice-9", 1min));
    }
    tx.commit();
    EXPECT_TRUE(other->hold_lock("invoice-9", "batch", 1min));
    EXPECT_TRUE(other->hold_lock("invoice-9", "batch", 1min));  // renewed, same expiry
    auto third = s->begin();
    EXPECT_FALSE(third.try_lock("invoice-9", 1min));
}

}  // namespace
