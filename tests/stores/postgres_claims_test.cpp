// PostgresStore against a real PostgreSQL server: schema and versioning, claims, the wait
// on a concurrent claim, lock_timeout, hostile values and purge.

#include "support/postgres_test_env.hpp"
#include "support/stored_offsets.hpp"

namespace idem_test::postgres_store {
namespace {

// ---- schema -------------------------------------------------------------------------------

TEST_F(PostgresStoreTest, CreatesItsVersionedSchemaOnceAndReusesIt) {
    {
        PostgresStore first(conninfo());
        EXPECT_EQ(first.schema(), "public");
    }
    EXPECT_EQ(count("SELECT version FROM idem_schema"), PostgresStore::schema_version);
    EXPECT_EQ(count("SELECT count(*) FROM pg_tables WHERE schemaname = 'public' AND tablename IN "
                    "('idem_claims', 'idem_dead_letters', 'idem_locks', 'idem_outbox', "
                    "'idem_schema')"),
              5);
    EXPECT_EQ(count("SELECT count(*) FROM pg_indexes WHERE indexname = 'idem_claims_claimed_at'"),
              1);
    PostgresStore second(conninfo());  // finds the finished schema
    EXPECT_EQ(count("SELECT count(*) FROM idem_schema"), 1);
}

TEST_F(PostgresStoreTest, RefusesASchemaWrittenByANewerIdem) {
    { PostgresStore created(conninfo()); }
    exec("UPDATE idem_schema SET version = " + std::to_string(PostgresStore::schema_version + 1));
    try {
        PostgresStore refused(conninfo());
        FAIL() << "a newer schema must be refused";
    } catch (const idem::store_error& e) {
        EXPECT_NE(std::string(e.what()).find("newer"), std::string::npos) << e.what();
    }
}

TEST_F(PostgresStoreTest, OwnSchemaWithAnAwkwardNameKeepsTablesApart) {
    idem::PostgresOptions options;
    options.schema = "idem \"quoted\"; DROP";
    auto separate = store(options);
    auto plain = store();
    auto a = idem::make_handler(*separate, idem::Policy{"s"}, writer());
    auto b = idem::make_handler(*plain, idem::Policy{"s"}, writer());
    EXPECT_EQ(a.handle(Delivery{"m-1", 1u}, std::string("a")).disposition, Disposition::processed);
    EXPECT_EQ(b.handle(Delivery{"m-1", 1u}, std::string("b")).disposition, Disposition::processed);
    EXPECT_EQ(count("SELECT count(*) FROM \"idem \"\"quoted\"\"; DROP\".idem_claims"), 1);
    EXPECT_EQ(count("SELECT count(*) FROM public.idem_claims"), 1);
}

TEST_F(PostgresStoreTest, VersionTwoSchemaIsMigratedToStoredOffsetsInItsOwnSchema) {
    idem::PostgresOptions options;
    options.schema = "idem v2";
    {
        auto created = store(options);
        auto handler = idem::make_handler(*created, idem::Policy{"s"}, writer());
        ASSERT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("a")).disposition,
                  Disposition::processed);
    }
    // What idem schema version 2 left: no idem_offsets, no redrive columns (version 4).
    exec("DROP TABLE \"idem v2\".idem_offsets");
    exec("DROP INDEX \"idem v2\".idem_dead_letters_message");
    exec(
        "ALTER TABLE \"idem v2\".idem_dead_letters DROP COLUMN redrive_count, "
        "DROP COLUMN redriven_at");
    exec("UPDATE \"idem v2\".idem_schema SET version = 2");
    auto migrated = store(options);
    EXPECT_EQ(count("SELECT version FROM \"idem v2\".idem_schema"),
              idem::PostgresStore::schema_version);
    EXPECT_EQ(count("SELECT count(*) FROM pg_tables WHERE schemaname = 'idem v2' AND "
                    "tablename = 'idem_offsets'"),
              1);
    EXPECT_EQ(count("SELECT count(*) FROM pg_tables WHERE tablename = 'idem_offsets'"), 1);
    EXPECT_TRUE(migrated->find_claim("s", "m-1").has_value());
    EXPECT_TRUE(idem_test::commit_offset(*migrated, "g", "t", 0, 12));
    EXPECT_EQ(migrated->stored_offset("g", "t", 0), std::optional<std::int64_t>(12));
    EXPECT_EQ(count("SELECT next_offset FROM \"idem v2\".idem_offsets"), 12);
}

TEST_F(PostgresStoreTest, ConcurrentFirstStartsDoNotRace) {
    constexpr int kStores = 8;
    std::vector<std::future<std::string>> starts;
    std::promise<void> go;
    std::shared_future<void> ready = go.get_future().share();
    for (int i = 0; i < kStores; ++i) {
        starts.push_back(std::async(std::launch::async, [&, ready] {
            ready.wait();
            try {
                PostgresStore store(conninfo());
                return std::string();
            } catch (const std::exception& e) {
                return std::string(e.what());
            }
        }));
    }
    go.set_value();
    for (auto& start : starts)
        EXPECT_EQ(start.get(), "");
    EXPECT_EQ(count("SELECT count(*) FROM idem_schema"), 1);
}

TEST_F(PostgresStoreTest, BadOptionsAndConnectionsAreRefusedWithAReason) {
    idem::PostgresOptions negative;
    negative.lock_timeout = -1ms;
    EXPECT_THROW(PostgresStore(conninfo(), negative), idem::usage_error);
    idem::PostgresOptions empty_schema;
    empty_schema.schema = "";
    EXPECT_THROW(PostgresStore(conninfo(), empty_schema), idem::usage_error);
    EXPECT_THROW(PostgresStore(static_cast<PGconn*>(nullptr)), idem::usage_error);
    try {
        PostgresStore unreachable(
            "host=127.0.0.1 port=1 user=idem password=s3cret "
            "connect_timeout=2");
        FAIL();
    } catch (const idem::store_unavailable& e) {
        EXPECT_NE(std::string(e.what()).find("cannot connect"), std::string::npos);
        EXPECT_EQ(std::string(e.what()).find("s3cret"), std::string::npos) << e.what();
    }
}

// ---- claims -------------------------------------------------------------------------------

TEST_F(PostgresStoreTest, ClaimThenDuplicateWithTheRecordedOutcomeAndFingerprint) {
    auto s = store(clocked());
    {
        auto tx = s->begin();
        EXPECT_EQ(tx.claim("capture", "m-1", "fp-1").status, ClaimStatus::claimed);
        tx.record_outcome("capture", "m-1", Disposition::processed, "");
        tx.commit();
    }
    auto tx = s->begin();
    auto again = tx.claim("capture", "m-1", "fp-other");
    EXPECT_EQ(again.status, ClaimStatus::duplicate);
    EXPECT_EQ(again.recorded, Disposition::processed);
    EXPECT_EQ(again.fingerprint, "fp-1");
    tx.rollback();
    auto found = s->find_claim("capture", "m-1");
    ASSERT_TRUE(found.has_value());
    EXPECT_EQ(found->claimed_at, now());
    EXPECT_EQ(found->fingerprint, "fp-1");
    EXPECT_FALSE(s->find_claim("capture", "m-2").has_value());
}

TEST_F(PostgresStoreTest, RoundTripsPerMessage) {
    auto s = store();
    auto handler = idem::make_handler(*s, idem::Policy{"rt"}, writer());
    ASSERT_EQ(handler.handle(Delivery{"warm-up", 1u}, std::string("w")).disposition,
              Disposition::processed);  // statements prepared
    {
        const auto before = s->round_trips();
        auto tx = s->begin();
        EXPECT_EQ(s->round_trips(), before);  // BEGIN is queued
        ASSERT_EQ(tx.claim("rt", "x").status, ClaimStatus::claimed);
        EXPECT_EQ(s->round_trips(), before + 1);  // BEGIN + claim
        tx.rollback();
    }
    auto before = s->round_trips();
    ASSERT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("m-1")).disposition,
              Disposition::processed);
    // claim (with BEGIN), the effect's INSERT, COMMIT.
    EXPECT_EQ(s->round_trips() - before, 3u);
    before = s->round_trips();
    ASSERT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("m-1")).disposition,
              Disposition::duplicate);
    // claim (nothing inserted), reading the stored outcome, ROLLBACK
    EXPECT_EQ(s->round_trips() - before, 3u);
}

TEST_F(PostgresStoreTest, ASecondConnectionWaitsForTheFirstAndThenSeesADuplicate) {
    auto first = store();
    auto second = store();
    auto tx = first->begin();
    ASSERT_EQ(tx.claim("capture", "m-1").status, ClaimStatus::claimed);
    tx.execute("INSERT INTO effects(message_id) VALUES ($1)", idem::Blob{"m-1"});

    const auto started = std::chrono::steady_clock::now();
    auto waiting = std::async(std::launch::async, [&] {
        auto other = second->begin();
        auto result = other.claim("capture", "m-1");
        return std::make_pair(result, std::chrono::steady_clock::now() - started);
    });
    EXPECT_EQ(waiting.wait_for(300ms), std::future_status::timeout);  // blocked on the index
    tx.record_outcome("capture", "m-1", Disposition::processed, "");
    tx.commit();
    const auto [result, waited] = waiting.get();
    EXPECT_EQ(result.status, ClaimStatus::duplicate);
    EXPECT_EQ(result.recorded, Disposition::processed);
    EXPECT_GE(waited, 300ms);
    EXPECT_EQ(count("SELECT count(*) FROM effects"), 1);
}

TEST_F(PostgresStoreTest, WhenTheFirstRollsBackTheWaitingOneClaims) {
    auto first = store();
    auto second = store();
    auto tx = first->begin();
    ASSERT_EQ(tx.claim("capture", "m-1").status, ClaimStatus::claimed);
    auto waiting = std::async(std::launch::async, [&] {
        auto other = second->begin();
        auto status = other.claim("capture", "m-1").status;
        other.record_outcome("capture", "m-1", Disposition::processed, "");
        other.commit();
        return status;
    });
    EXPECT_EQ(waiting.wait_for(200ms), std::future_status::timeout);
    tx.rollback();
    EXPECT_EQ(waiting.get(), ClaimStatus::claimed);
    EXPECT_EQ(first->find_claim("capture", "m-1")->disposition, Disposition::processed);
}

TEST_F(PostgresStoreTest, LockTimeoutGivesInProgressAndTheTransactionIsAborted) {
    auto holder = store();
    idem::PostgresOptions impatient;
    impatient.lock_timeout = 150ms;
    auto waiter = store(impatient);
    auto held = holder->begin();
    ASSERT_EQ(held.claim("capture", "m-1").status, ClaimStatus::claimed);
    {
        const auto started = std::chrono::steady_clock::now();
        auto tx = waiter->begin();
        EXPECT_EQ(tx.claim("capture", "m-1").status, ClaimStatus::in_progress);
        EXPECT_GE(std::chrono::steady_clock::now() - started, 150ms);
        EXPECT_THROW(tx.commit(), idem::commit_failed);  // PostgreSQL aborted it
    }
    auto handler = idem::make_handler(*waiter, idem::Policy{"capture"}, writer());
    auto outcome = handler.handle(Delivery{"m-1", 2u}, std::string("m-1"));
    EXPECT_EQ(outcome.disposition, Disposition::in_progress) << outcome.reason;
    EXPECT_FALSE(idem::should_ack(outcome));
    // The store is fine afterwards.
    EXPECT_EQ(handler.handle(Delivery{"m-2", 1u}, std::string("m-2")).disposition,
              Disposition::processed);
    held.rollback();
    EXPECT_EQ(handler.handle(Delivery{"m-1", 3u}, std::string("m-1")).disposition,
              Disposition::processed);
}

// ---- values -----------------------------------------------------------------------------------

TEST_F(PostgresStoreTest, HostileValuesRoundTripExactly) {
    auto s = store();
    const std::string big(10 * 1024, '\'');
    const std::vector<std::string> values = {std::string("nul\0inside", 10),
                                             "quote'\"; DROP TABLE idem_claims; --",
                                             "\xff\xfe invalid utf-8 \xc3",
                                             big,
                                             std::string(),
                                             std::string("\0", 1)};
    {
        auto tx = s->begin();
        for (const auto& v : values) {
            const std::string id = v.substr(0, 300);
            ASSERT_EQ(tx.claim(v, id, v).status, ClaimStatus::claimed);
            tx.execute("INSERT INTO effects(message_id) VALUES ($1)", idem::Blob{v});
            EXPECT_EQ(tx.query_text("SELECT $1::bytea", idem::Blob{v}), v);
            idem::DeadLetter letter;
            letter.scope = v;
            letter.message_id = id;
            letter.delivery_count = 7;
            letter.reason = "why: " + v.substr(0, 40);
            letter.payload = v;
            tx.dead_letter(letter);
            tx.record_outcome(v, id, Disposition::rejected, v.substr(0, 100));
        }
        tx.commit();
    }
    const auto letters = s->dead_letters();
    ASSERT_EQ(letters.size(), values.size());
    for (std::size_t i = 0; i < values.size(); ++i) {
        const std::string& v = values[i];
        const std::string id = v.substr(0, 300);
        auto claim = s->find_claim(v, id);
        ASSERT_TRUE(claim.has_value()) << i;
        EXPECT_EQ(claim->scope, v);
        EXPECT_EQ(claim->message_id, id);
        EXPECT_EQ(claim->fingerprint, v);
        EXPECT_EQ(claim->disposition, Disposition::rejected);
        EXPECT_EQ(letters[i].payload, v);
        EXPECT_EQ(letters[i].scope, v);
        EXPECT_EQ(letters[i].delivery_count, 7u);
    }
    // Text columns keep valid UTF-8: invalid bytes and NULs become U+FFFD, the rest stays.
    EXPECT_EQ(s->find_claim(values[2], values[2])->reason,
              "\xEF\xBF\xBD\xEF\xBF\xBD invalid "
              "utf-8 \xEF\xBF\xBD");
    EXPECT_EQ(s->find_claim(values[0], values[0])->reason, "nul\xEF\xBF\xBDinside");
    EXPECT_EQ(s->find_claim(values[3], values[3].substr(0, 300))->reason, std::string(100, '\''));
    EXPECT_EQ(count("SELECT count(*) FROM effects"), static_cast<long long>(values.size()));
    // The same values as one batch's ids and fingerprints (binary bytea[] parameters).
    {
        auto tx = s->begin();
        std::vector<std::string> ids;
        for (const auto& v : values)
            ids.push_back(v.substr(0, 300));
        const auto claims =
            tx.claim_many("batch", std::vector<std::string_view>(ids.begin(), ids.end()), values);
        for (const auto& claim : claims)
            EXPECT_EQ(claim.status, ClaimStatus::claimed);
        tx.commit();
        for (std::size_t i = 0; i < values.size(); ++i) {
            auto claim = s->find_claim("batch", ids[i]);
            ASSERT_TRUE(claim.has_value()) << i;
            EXPECT_EQ(claim->message_id, ids[i]);
            EXPECT_EQ(claim->fingerprint, values[i]);
        }
    }
    // Text and numbers bind as text and take the SQL's types.
    EXPECT_EQ(s->query_text("SELECT $1::text || $2::int || $3::float8 || $4::bool",
                            std::string_view("a'b"), 42, 0.5, true),
              "a'b420.5true");
    EXPECT_EQ(s->query_int("SELECT $1::bigint", std::numeric_limits<std::int64_t>::min()),
              std::numeric_limits<std::int64_t>::min());
    EXPECT_EQ(s->query_int("SELECT NULL::int"), std::nullopt);
    EXPECT_EQ(s->query_text("SELECT $1::text", std::optional<std::string>{}), std::nullopt);
    EXPECT_EQ(s->query_int("SELECT $1::bool", false), 0);
    EXPECT_THROW((void)s->query_int("SELECT 'x'::text"), idem::usage_error);
}

TEST_F(PostgresStoreTest, PurgeDeletesClaimsOlderThanTheRetentionOnTheInjectedClock) {
    auto s = store(clocked());
    auto handler = idem::make_handler(*s, idem::Policy{"capture"}, writer());
    ASSERT_EQ(handler.handle(Delivery{"old", 1u}, std::string("old")).disposition,
              Disposition::processed);
    advance(std::chrono::hours(24 * 10));
    ASSERT_EQ(handler.handle(Delivery{"young", 1u}, std::string("young")).disposition,
              Disposition::processed);
    advance(std::chrono::hours(24 * 4));                          // old: 14 days, young: 4 days
    EXPECT_EQ(s->purge(std::chrono::hours(24 * 14)).claims, 0u);  // exactly 14 days: kept
    advance(1ms);
    EXPECT_EQ(s->purge(std::chrono::hours(24 * 14)).claims, 1u);
    EXPECT_FALSE(s->find_claim("capture", "old").has_value());
    EXPECT_TRUE(s->find_claim("capture", "young").has_value());
    EXPECT_THROW(s->purge(-std::chrono::hours(1)), idem::usage_error);
    // Many batches: claims, sent intents (an unsent and a parked one stay), expired locks (a
    // live one stays).
    exec(
        "INSERT INTO idem_claims(scope, message_id, claimed_at, outcome) SELECT 'bulk', "
        "int4send(g), 0, 'processed' FROM generate_series(1, 12000) g");
    exec(
        "INSERT INTO idem_outbox(destination, idempotency_key, payload, created_at, sent_at, "
        "next_attempt_at) SELECT 'rail', int4send(g), '', 0, 0, 0 FROM generate_series(1, 12000) "
        "g");
    exec(
        "INSERT INTO idem_outbox(destination, idempotency_key, payload, created_at, "
        "next_attempt_at, parked) VALUES ('rail', 'unsent', '', 0, 0, false), "
        "('rail', 'parked', '', 0, 0, true)");
    exec(
        "INSERT INTO idem_locks(lock_key, owner, expires_at) SELECT int4send(g), 'o', 0 "
        "FROM generate_series(1, 12000) g");
    ASSERT_TRUE(s->hold_lock("live", "o", std::chrono::hours(1)));
    const idem::PurgeResult purged = s->purge(std::chrono::hours(1));
    EXPECT_EQ(purged.claims, 12001u);  // and "young"
    EXPECT_EQ(purged.sent_intents, 12000u);
    EXPECT_EQ(purged.expired_locks, 12000u);
    EXPECT_EQ(s->query_int("SELECT count(*) FROM idem_outbox"), 2);
    EXPECT_EQ(s->query_int("SELECT count(*) FROM idem_locks"), 1);
}

}  // namespace
}  // namespace idem_test::postgres_store
