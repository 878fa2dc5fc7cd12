// PostgresStore's connection against a real PostgreSQL server: killed sessions, server
// restarts, commit failures, misuse, borrowed connections, notices and prepared statements.

#include "support/postgres_test_env.hpp"

namespace idem_test::postgres_store {
namespace {

// ---- failures ------------------------------------------------------------------------------

TEST_F(PostgresStoreTest, AKilledSessionFailsTheDeliveryAndTheStoreReconnects) {
    auto s = store();
    {
        auto tx = s->begin();
        ASSERT_EQ(tx.claim("capture", "m-0").status, ClaimStatus::claimed);
        terminate(PQbackendPID(s->conn()));
        EXPECT_THROW(tx.execute("INSERT INTO effects(message_id) VALUES ($1)", idem::Blob{"x"}),
                     idem::store_unavailable);
    }
    bool kill = true;
    auto handler =
        idem::make_handler(*s, idem::Policy{"capture"}, [&](auto& tx, const std::string& body) {
            if (kill) terminate(PQbackendPID(tx.conn()));
            tx.execute("INSERT INTO effects(message_id) VALUES ($1)", idem::Blob{body});
        });
    auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("m-1"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_NE(outcome.reason.find("connection"), std::string::npos) << outcome.reason;
    kill = false;
    const int old_pid = PQbackendPID(s->conn());
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("m-1")).disposition,
              Disposition::processed);
    EXPECT_NE(PQbackendPID(s->conn()), old_pid);  // a new session
    EXPECT_EQ(count("SELECT count(*) FROM effects"), 1);
    EXPECT_EQ(count("SELECT count(*) FROM idem_claims"), 1);
}

TEST_F(PostgresStoreTest, AServerRestartFailsDeliveriesUntilItIsBack) {
    idem::testing::PostgresServer own;  // this one we may stop
    own.exec("CREATE TABLE effects(message_id BYTEA NOT NULL)");
    PostgresStore s(own.conninfo() + " connect_timeout=5");
    auto handler = idem::make_handler(s, idem::Policy{"capture"}, writer());
    ASSERT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
              Disposition::processed);
    own.stop();
    auto down = handler.handle(Delivery{"m-2", 1u}, std::string("m-2"));
    EXPECT_EQ(down.disposition, Disposition::failed);
    auto still_down = handler.handle(Delivery{"m-2", 2u}, std::string("m-2"));
    EXPECT_EQ(still_down.disposition, Disposition::failed);
    EXPECT_NE(still_down.reason.find("reconnecting failed"), std::string::npos)
        << still_down.reason;
    own.start();
    EXPECT_EQ(handler.handle(Delivery{"m-2", 3u}, std::string("m-2")).disposition,
              Disposition::processed);
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("m-1")).disposition,
              Disposition::duplicate);
    own.kill9();  // a crash this time
    EXPECT_EQ(handler.handle(Delivery{"m-3", 1u}, std::string("m-3")).disposition,
              Disposition::failed);
    own.start();
    EXPECT_EQ(handler.handle(Delivery{"m-3", 2u}, std::string("m-3")).disposition,
              Disposition::processed);
    EXPECT_EQ(std::stoll(own.query_value("SELECT count(*) FROM effects").value_or("-1")), 3);
}

TEST_F(PostgresStoreTest, DeferredConstraintFailsTheCommitAndNothingIsStored) {
    auto s = store();
    {
        auto tx = s->begin();
        ASSERT_EQ(tx.claim("capture", "m-1").status, ClaimStatus::claimed);
        tx.execute("INSERT INTO children(parent_id) VALUES ($1)", 4242);
        tx.record_outcome("capture", "m-1", Disposition::processed, "");
        try {
            tx.commit();
            FAIL() << "the deferred foreign key must refuse the commit";
        } catch (const idem::commit_failed& e) {
            EXPECT_NE(std::string(e.what()).find("foreign key"), std::string::npos) << e.what();
        }
        EXPECT_FALSE(tx.active());
        EXPECT_THROW(tx.commit(), idem::usage_error);
    }
    EXPECT_FALSE(s->find_claim("capture", "m-1").has_value());
    EXPECT_EQ(count("SELECT count(*) FROM children"), 0);
}

TEST_F(PostgresStoreTest, ConnectionLostDuringCommitIsFailedAndTheRedeliveryDecides) {
    // A deferred constraint trigger that ends its own session while COMMIT runs.
    exec(
        "CREATE TABLE doomed(x INTEGER);"
        "CREATE FUNCTION die() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "  PERFORM pg_terminate_backend(pg_backend_pid()); PERFORM pg_sleep(1); RETURN NULL; "
        "END $$;"
        "CREATE CONSTRAINT TRIGGER die_at_commit AFTER INSERT ON doomed "
        "  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION die();");
    auto s = store();
    bool doom = true;
    auto handler =
        idem::make_handler(*s, idem::Policy{"capture"}, [&](auto& tx, const std::string& body) {
            tx.execute("INSERT INTO effects(message_id) VALUES ($1)", idem::Blob{body});
            if (doom) tx.execute("INSERT INTO doomed VALUES (1)");
        });
    auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("m-1"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_NE(outcome.reason.find("outcome is unknown"), std::string::npos) << outcome.reason;
    EXPECT_FALSE(idem::should_ack(outcome));
    doom = false;
    // Here the session died before the commit record: the redelivery does the work once.
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("m-1")).disposition,
              Disposition::processed);
    EXPECT_EQ(count("SELECT count(*) FROM effects"), 1);
}

TEST_F(PostgresStoreTest, AFailedEffectStatementIsReportedWithTheSqlAndRolledBack) {
    auto s = store();
    auto handler =
        idem::make_handler(*s, idem::Policy{"capture"}, [](auto& tx, const std::string&) {
            tx.execute("INSERT INTO no_such_table VALUES (?)", 1);
        });
    auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("x"));
    EXPECT_EQ(outcome.disposition, Disposition::failed);
    EXPECT_NE(outcome.reason.find("no_such_table"), std::string::npos) << outcome.reason;
    EXPECT_NE(outcome.reason.find("$1"), std::string::npos) << outcome.reason;  // ? hint
    EXPECT_FALSE(s->find_claim("capture", "m-1").has_value());
}

TEST_F(PostgresStoreTest, MalformedAfterAFailedStatementStillDeadLettersThroughTheSavepoint) {
    auto s = store();
    auto handler =
        idem::make_handler(*s, idem::Policy{"capture"}, [](auto& tx, const std::string& body) {
            try {
                tx.execute("INSERT INTO children(parent_id) VALUES ('not a number')");
            } catch (const idem::store_error&) {
                throw idem::malformed_message("body " + body + " has no usable parent");
            }
        });
    auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("b"));
    EXPECT_EQ(outcome.disposition, Disposition::dead_lettered) << outcome.reason;
    ASSERT_EQ(s->dead_letters().size(), 1u);
    EXPECT_EQ(s->find_claim("capture", "m-1")->disposition, Disposition::dead_lettered);
}

TEST_F(PostgresStoreTest, MisuseIsAUsageError) {
    auto s = store();
    {
        auto tx = s->begin();
        EXPECT_THROW((void)s->begin(), idem::usage_error);  // same thread: would deadlock
        EXPECT_THROW((void)s->find_claim("a", "b"), idem::usage_error);
        EXPECT_THROW(tx.execute("SELECT $1::text", std::string("nul\0inside", 10)),
                     idem::usage_error);
        EXPECT_THROW(tx.execute("SELECT $1::int, $2::int", 1), idem::usage_error);
    }
    {
        auto tx = s->begin();
        (void)tx.claim("s", "id");
        EXPECT_THROW(tx.execute("COMMIT"), idem::usage_error);  // ended behind idem's back
        EXPECT_FALSE(tx.active());
    }
    // The effect's COMMIT went through behind idem's back: the claim row is stored with the
    // outcome it is inserted with ('processed'; idem's commit() would have corrected it).
    EXPECT_TRUE(s->find_claim("s", "id").has_value());
    // A borrowed connection inside the user's own transaction is refused.
    PgConnection conn{connect()};
    PQclear(PQexec(conn.get(), "BEGIN"));
    EXPECT_THROW(PostgresStore{conn.get()}, idem::usage_error);
    PQclear(PQexec(conn.get(), "ROLLBACK"));
}

// ---- borrowed connection, options ----------------------------------------------------------

TEST_F(PostgresStoreTest, ABorrowedConnectionCarriesTheEffectAndIsLeftOpenAndClean) {
    PgConnection conn{connect()};
    {
        PostgresStore s(conn.get());
        auto handler =
            idem::make_handler(s, idem::Policy{"raw"}, [](auto& tx, const std::string& body) {
                // The effect's own libpq code on the same connection joins the transaction.
                PGconn* raw = tx.conn();
                const char* values[] = {body.c_str()};
                PGresult* r =
                    PQexecParams(raw, "INSERT INTO effects(message_id) VALUES ($1::bytea)", 1,
                                 nullptr, values, nullptr, nullptr, 0);
                const bool ok = PQresultStatus(r) == PGRES_COMMAND_OK;
                PQclear(r);
                if (!ok) throw std::runtime_error("insert failed");
            });
        EXPECT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
                  Disposition::processed);
        EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("m-1")).disposition,
                  Disposition::duplicate);
    }
    EXPECT_EQ(PQstatus(conn.get()), CONNECTION_OK);
    EXPECT_EQ(PQtransactionStatus(conn.get()), PQTRANS_IDLE);
    PGresult* r = PQexec(conn.get(), "SELECT count(*) FROM pg_prepared_statements");
    EXPECT_STREQ(PQgetvalue(r, 0, 0), "0");  // the store's statements are deallocated
    PQclear(r);
    EXPECT_EQ(count("SELECT count(*) FROM effects"), 1);
}

// ---- notices ------------------------------------------------------------------------------

/// An effect that makes the server send a NOTICE with @p text, then writes its row.
auto noisy_writer(std::string text) {
    return [text = std::move(text)](auto& tx, const std::string& body) {
        tx.execute("DO $$ BEGIN RAISE NOTICE '" + text + "'; END $$");
        tx.execute("INSERT INTO effects(message_id) VALUES ($1)", idem::Blob{body});
    };
}

bool has(const std::vector<std::string>& notices, const std::string& text) {
    return std::find(notices.begin(), notices.end(), text) != notices.end();
}

/// A connection with libpq's own notice handling (the fixture's connect() silences it).
PGconn* plain_connection(const std::string& conninfo) {
    PGconn* conn = PQconnectdb(conninfo.c_str());
    if (PQstatus(conn) != CONNECTION_OK) {
        PQfinish(conn);
        throw std::runtime_error("cannot connect");
    }
    return conn;
}

void raise_notice(PGconn* conn, const std::string& text) {
    PQclear(PQexec(conn, ("DO $$ BEGIN RAISE NOTICE '" + text + "'; END $$").c_str()));
}

TEST_F(PostgresStoreTest, NoticesReachOnNoticeAndNotStderr) {
    std::vector<std::string> notices;
    idem::PostgresOptions options;
    options.on_notice = [&](std::string_view text) { notices.emplace_back(text); };
    auto s = store(options);
    auto handler = idem::make_handler(*s, idem::Policy{"notices"}, noisy_writer("hello"));

    testing::internal::CaptureStderr();
    const auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("m-1"));
    s->execute("DO $$ BEGIN RAISE WARNING 'careful'; END $$");
    const std::string err = testing::internal::GetCapturedStderr();

    EXPECT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
    EXPECT_TRUE(has(notices, "NOTICE:  hello")) << ::testing::PrintToString(notices);
    EXPECT_TRUE(has(notices, "WARNING:  careful")) << ::testing::PrintToString(notices);
    EXPECT_EQ(err.find("hello"), std::string::npos) << err;
    EXPECT_EQ(err.find("careful"), std::string::npos) << err;

    // The receiver survives the reconnect after a lost session (PQreset keeps it).
    terminate(PQbackendPID(s->conn()));
    EXPECT_EQ(handler.handle(Delivery{"m-2", 1u}, std::string("m-2")).disposition,
              Disposition::failed);
    testing::internal::CaptureStderr();
    EXPECT_EQ(handler.handle(Delivery{"m-2", 2u}, std::string("m-2")).disposition,
              Disposition::processed);
    const std::string after = testing::internal::GetCapturedStderr();
    EXPECT_EQ(std::count(notices.begin(), notices.end(), "NOTICE:  hello"), 2);
    EXPECT_EQ(after.find("hello"), std::string::npos) << after;

    // A throwing sink does not escape through libpq: the statement still succeeds.
    idem::PostgresOptions throwing;
    throwing.on_notice = [](std::string_view) { throw std::runtime_error("sink failed"); };
    auto t = store(throwing);
    EXPECT_EQ(t->execute("DO $$ BEGIN RAISE NOTICE 'ignored'; END $$"), 0);
}

TEST_F(PostgresStoreTest, NoticesOfAnOwnedConnectionAreDroppedWithoutOnNotice) {
    auto s = store();
    auto handler = idem::make_handler(*s, idem::Policy{"notices"}, noisy_writer("dropped"));
    testing::internal::CaptureStderr();
    const auto outcome = handler.handle(Delivery{"m-1", 1u}, std::string("m-1"));
    raise_notice(s->conn(), "dropped too");
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
    EXPECT_EQ(err.find("dropped"), std::string::npos) << err;
}

TEST_F(PostgresStoreTest, ABorrowedConnectionWithOnNoticeRoutesItsNoticesUntilTheStoreIsGone) {
    PgConnection conn{plain_connection(conninfo())};
    std::vector<std::string> notices;
    {
        idem::PostgresOptions options;
        options.on_notice = [&](std::string_view text) { notices.emplace_back(text); };
        PostgresStore s(conn.get(), options);
        auto handler = idem::make_handler(s, idem::Policy{"notices"}, noisy_writer("routed"));
        testing::internal::CaptureStderr();
        EXPECT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
                  Disposition::processed);
        const std::string err = testing::internal::GetCapturedStderr();
        EXPECT_TRUE(has(notices, "NOTICE:  routed")) << ::testing::PrintToString(notices);
        EXPECT_EQ(err.find("routed"), std::string::npos) << err;
    }
    // The store is gone: libpq's own handling is back (it prints on stderr), the sink hears
    // nothing more.
    const auto heard = notices.size();
    testing::internal::CaptureStderr();
    raise_notice(conn.get(), "after the store");
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("NOTICE:  after the store"), std::string::npos) << err;
    EXPECT_EQ(notices.size(), heard);
}

TEST_F(PostgresStoreTest, ABorrowedConnectionKeepsTheConsumersOwnNoticeHandling) {
    struct Heard {
        std::vector<std::string> texts;
        static void processor(void* arg, const char* message) {
            static_cast<Heard*>(arg)->texts.emplace_back(message);
        }
        static void receiver(void* arg, const PGresult* result) {
            static_cast<Heard*>(arg)->texts.emplace_back(
                PQresultErrorField(result, PG_DIAG_MESSAGE_PRIMARY));
        }
    };
    std::vector<std::string> notices;
    idem::PostgresOptions options;
    options.on_notice = [&](std::string_view text) { notices.emplace_back(text); };

    // 1. The consumer's notice processor: still called while the store routes notices to
    // on_notice, and still installed (with its argument) afterwards.
    {
        PgConnection conn{plain_connection(conninfo())};
        Heard heard;
        PQsetNoticeProcessor(conn.get(), &Heard::processor, &heard);
        {
            PostgresStore s(conn.get(), options);
            auto handler = idem::make_handler(s, idem::Policy{"notices"}, noisy_writer("both"));
            EXPECT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
                      Disposition::processed);
        }
        EXPECT_TRUE(has(notices, "NOTICE:  both")) << ::testing::PrintToString(notices);
        EXPECT_TRUE(has(heard.texts, "NOTICE:  both\n")) << ::testing::PrintToString(heard.texts);
        EXPECT_EQ(PQsetNoticeProcessor(conn.get(), nullptr, nullptr), &Heard::processor);
        raise_notice(conn.get(), "later");
        EXPECT_TRUE(has(heard.texts, "NOTICE:  later\n")) << ::testing::PrintToString(heard.texts);
        EXPECT_FALSE(has(notices, "NOTICE:  later"));
    }
    // 2. The consumer's notice receiver: left alone, it gets the notices.
    {
        PgConnection conn{plain_connection(conninfo())};
        Heard heard;
        PQsetNoticeReceiver(conn.get(), &Heard::receiver, &heard);
        {
            PostgresStore s(conn.get(), options);
            EXPECT_EQ(PQsetNoticeReceiver(conn.get(), nullptr, nullptr), &Heard::receiver);
            auto handler = idem::make_handler(s, idem::Policy{"notices"}, noisy_writer("theirs"));
            EXPECT_EQ(handler.handle(Delivery{"m-2", 1u}, std::string("m-2")).disposition,
                      Disposition::processed);
        }
        EXPECT_TRUE(has(heard.texts, "theirs")) << ::testing::PrintToString(heard.texts);
        EXPECT_FALSE(has(notices, "NOTICE:  theirs"));
        EXPECT_EQ(PQsetNoticeReceiver(conn.get(), nullptr, nullptr), &Heard::receiver);
    }
    // 3. No on_notice: the borrowed connection's handling is not touched at all.
    {
        PgConnection conn{connect()};  // the fixture's silent processor
        const auto receiver = PQsetNoticeReceiver(conn.get(), nullptr, nullptr);
        const auto processor = PQsetNoticeProcessor(conn.get(), nullptr, nullptr);
        PostgresStore s(conn.get());
        EXPECT_EQ(PQsetNoticeReceiver(conn.get(), nullptr, nullptr), receiver);
        EXPECT_EQ(PQsetNoticeProcessor(conn.get(), nullptr, nullptr), processor);
    }
}

TEST_F(PostgresStoreTest, WorksWithoutPreparedStatements) {
    idem::PostgresOptions options;
    options.prepare_statements = false;
    auto s = store(options);
    auto handler = idem::make_handler(*s, idem::Policy{"plain"}, writer());
    EXPECT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
              Disposition::processed);
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("m-1")).disposition,
              Disposition::duplicate);
    const auto batch = handler.handle_batch(
        std::vector<Delivery>{{"m-1", 3u}, {"m-2", 1u}, {"m-2", 1u}, {std::string("m\0-3", 4), 1u}},
        std::vector<std::string>{"m-1", "m-2", "m-2", "m-3"});
    EXPECT_EQ(batch[0].disposition, Disposition::duplicate) << batch[0].reason;
    EXPECT_EQ(batch[1].disposition, Disposition::processed) << batch[1].reason;
    EXPECT_EQ(batch[2].disposition, Disposition::duplicate) << batch[2].reason;
    EXPECT_EQ(batch[3].disposition, Disposition::processed) << batch[3].reason;
    EXPECT_EQ(std::stoll(s->query_text("SELECT count(*) FROM pg_prepared_statements").value()), 0);
}

TEST_F(PostgresStoreTest, LostPreparedStatementsArePreparedAgain) {
    auto s = store();
    auto handler = idem::make_handler(*s, idem::Policy{"p"}, writer());
    ASSERT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
              Disposition::processed);
    const auto prepared = [&] {
        return s  // idem's own statements, not the cached ones of execute() / query_*()
            ->query_int("SELECT count(*) FROM pg_prepared_statements WHERE name !~ '_u[0-9]+$'")
            .value_or(-1);
    };
    const auto all = prepared();
    // The claim only: BEGIN, SAVEPOINT… are not prepared, and a processed outcome needs no
    // statement (the claim row is inserted as 'processed').
    ASSERT_EQ(all, 1);
    // Some lost (a targeted DEALLOCATE), then all lost (a pooler's DISCARD ALL): each costs
    // one failed delivery (not acked), and the next one runs with the statements prepared again.
    for (const char* lose : {"DEALLOCATE idem_*_0", "DEALLOCATE ALL"}) {
        std::string sql = lose;
        const auto star = sql.find('*');
        if (star != std::string::npos) {
            sql.replace(star, 1,
                        s->query_text("SELECT split_part(name, '_', 2) FROM pg_prepared_statements "
                                      "LIMIT 1")
                            .value());
        }
        s->execute(sql);
        const std::string id = std::string("after ") + lose;
        auto outcome = handler.handle(Delivery{id, 1u}, id);
        EXPECT_EQ(outcome.disposition, Disposition::failed) << outcome.reason;
        EXPECT_NE(outcome.reason.find("26000"), std::string::npos) << outcome.reason;
        EXPECT_EQ(handler.handle(Delivery{id, 2u}, id).disposition, Disposition::processed);
        EXPECT_EQ(prepared(), all);
    }
}

}  // namespace
}  // namespace idem_test::postgres_store
