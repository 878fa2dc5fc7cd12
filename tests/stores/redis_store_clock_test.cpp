// RedisStore's claims by SET on the server's clock, retention after a takeover, keys that
// share a Cluster slot, and hostile ids and payloads, against a real redis-server.

#include "support/redis_store_test_env.hpp"

namespace idem_test::redis_store {
namespace {

// ---- keys, hostile ids and payloads ----------------------------------------------------------

/// Redis Cluster's key slot: CRC16/XMODEM of the hash tag (or the whole key), mod 16384.
unsigned key_slot(const std::string& key) {
    std::string hashed = key;
    auto open = key.find('{');
    if (open != std::string::npos) {
        auto close = key.find('}', open + 1);
        if (close != std::string::npos && close != open + 1)
            hashed = key.substr(open + 1, close - open - 1);
    }
    unsigned crc = 0;
    for (unsigned char c : hashed) {
        crc ^= static_cast<unsigned>(c) << 8;
        for (int i = 0; i < 8; ++i)
            crc = (crc & 0x8000) ? ((crc << 1) ^ 0x1021) : (crc << 1);
        crc &= 0xFFFF;
    }
    return crc % 16384;
}

// ---- claims by SET on the server's clock ------------------------------------------------------
// A new id is claimed with one `SET … NX PX … GET`, which cannot read the server's clock: its
// times are stored as "the expiry minus the retention" and resolved by whoever reads them.

class RedisServerClockTest : public RedisStoreTest {
  protected:
    /// A store on the server's clock (no RedisOptions::clock), as in production.
    std::unique_ptr<idem::RedisStore> worker(bool claim_with_set = true) {
        idem::RedisOptions options;
        options.claim_with_set = claim_with_set;
        return std::make_unique<idem::RedisStore>(store().endpoint(), options);
    }
    std::int64_t server_ms() {
        auto t = client().array({"TIME"});
        return std::stoll(*t.at(0)) * 1000 + std::stoll(*t.at(1)) / 1000;
    }
    std::string claim_key(const std::string& scope, const std::string& id) {
        return store().options().key_prefix + "c{" + scope + ":" + id + "}";
    }
};

TEST_F(RedisServerClockTest, ANewIdIsOneSetAndItsTimesAreTheServersWhenRead) {
    auto a = worker();
    EXPECT_TRUE(a->claims_with_set());
    const std::int64_t before = server_ms();
    auto tx = a->begin();
    tx.set_terms(idem::ClaimTerms{30s, idem::days(14)});
    const auto trips = a->round_trips();
    auto claim = tx.claim("pay", "m-1", "fp-1");
    ASSERT_EQ(claim.status, ClaimStatus::claimed);
    EXPECT_EQ(claim.attempts, 1u);
    EXPECT_LE(a->round_trips() - trips, 2u);  // the SET (and the connection's first connect)
    const std::int64_t after = server_ms();

    // Stored as SET wrote it: no number the client could only have guessed.
    auto raw = client().str({"GET", claim_key("pay", "m-1")});
    ASSERT_TRUE(raw.has_value());
    const std::string retention_ms = std::to_string(idem::days(14) / 1ms);
    EXPECT_EQ(
        raw->rfind(
            "leased|" + tx.token() + "||1|~" + retention_ms + "|~" + retention_ms + "|30000|", 0),
        0u)
        << *raw;
    auto found = a->find_claim("pay", "m-1");
    ASSERT_TRUE(found.has_value());
    const std::int64_t claimed_at = idem::to_unix_ms(found->claimed_at);
    EXPECT_GE(claimed_at, before - 1);
    EXPECT_LE(claimed_at, after + 1);
    EXPECT_EQ(found->fingerprint, "fp-1");
    EXPECT_EQ(found->disposition, Disposition::in_progress);

    tx.record_outcome("pay", "m-1", Disposition::processed, "");
    tx.commit();
    auto done = a->find_claim("pay", "m-1");
    ASSERT_TRUE(done.has_value());
    EXPECT_EQ(done->disposition, Disposition::processed);
    EXPECT_EQ(idem::to_unix_ms(done->claimed_at), claimed_at);  // the expiry was kept

    // A duplicate is answered from what the SET returned: one round trip, no script.
    auto again = a->begin();
    const auto dup_trips = a->round_trips();
    auto dup = again.claim("pay", "m-1", "fp-1");
    EXPECT_EQ(dup.status, ClaimStatus::duplicate);
    EXPECT_EQ(dup.recorded, Disposition::processed);
    EXPECT_EQ(dup.fingerprint, "fp-1");
    EXPECT_EQ(dup.attempts, 1u);
    EXPECT_EQ(a->round_trips() - dup_trips, 1u);
}

TEST_F(RedisServerClockTest, ALeaseTakenBySetIsLiveUntilItsServerTimeExpiryThenTakenOver) {
    auto a = worker();
    auto b = worker();
    auto a_tx = a->begin();
    a_tx.set_terms(idem::ClaimTerms{400ms, idem::days(1)});
    ASSERT_EQ(a_tx.claim("refund", "m-1").status, ClaimStatus::claimed);
    const std::int64_t claimed_at = idem::to_unix_ms(a->find_claim("refund", "m-1")->claimed_at);
    {
        auto b_tx = b->begin();
        b_tx.set_terms(idem::ClaimTerms{400ms, idem::days(1)});
        auto held = b_tx.claim("refund", "m-1");  // the script resolves the lease's start
        EXPECT_EQ(held.status, ClaimStatus::in_progress);
        EXPECT_EQ(held.attempts, 1u);
    }
    std::this_thread::sleep_for(500ms);
    auto b_tx = b->begin();
    b_tx.set_terms(idem::ClaimTerms{400ms, idem::days(1)});
    auto taken = b_tx.claim("refund", "m-1");
    EXPECT_EQ(taken.status, ClaimStatus::claimed);
    EXPECT_EQ(taken.attempts, 2u);
    // The takeover writes the times as numbers; the claim's own time is the first claim's.
    auto raw = client().str({"GET", claim_key("refund", "m-1")});
    ASSERT_TRUE(raw.has_value());
    EXPECT_EQ(raw->find('~'), std::string::npos) << *raw;
    EXPECT_EQ(idem::to_unix_ms(b->find_claim("refund", "m-1")->claimed_at), claimed_at);
    // A's completion is fenced off.
    a_tx.record_outcome("refund", "m-1", Disposition::processed, "");
    EXPECT_THROW(a_tx.commit(), idem::commit_failed);
    b_tx.record_outcome("refund", "m-1", Disposition::processed, "");
    b_tx.commit();
    EXPECT_EQ(b->find_claim("refund", "m-1")->disposition, Disposition::processed);
}

TEST_F(RedisServerClockTest, ReleasedSetClaimsCountAttemptsAndPurgeReadsTheirAge) {
    auto a = worker();
    {
        auto tx = a->begin();
        ASSERT_EQ(tx.claim("jobs", "m-1").status, ClaimStatus::claimed);
    }  // rolled back: released, the attempt stays
    {
        auto tx = a->begin();
        auto again = tx.claim("jobs", "m-1");
        EXPECT_EQ(again.status, ClaimStatus::claimed);
        EXPECT_EQ(again.attempts, 2u);
        tx.record_outcome("jobs", "m-1", Disposition::processed, "");
        tx.commit();
    }
    {
        auto tx = a->begin();
        ASSERT_EQ(tx.claim("jobs", "m-2").status, ClaimStatus::claimed);
        tx.record_outcome("jobs", "m-2", Disposition::processed, "");
        tx.commit();
    }
    // Both are younger than an hour; older than 0 ms both go (purge resolves `~` times).
    EXPECT_EQ(a->purge(1h).claims, 0u);
    std::this_thread::sleep_for(5ms);
    EXPECT_EQ(a->purge(1ms).claims, 2u);
    EXPECT_FALSE(a->find_claim("jobs", "m-1").has_value());
}

TEST_F(RedisServerClockTest, WithoutSetClaimsEveryClaimIsTheScriptAndTheAnswersAreTheSame) {
    auto scripted = worker(false);
    auto by_set = worker(true);
    EXPECT_FALSE(scripted->claims_with_set());
    for (auto* s : {scripted.get(), by_set.get()}) {
        const std::string scope = s == scripted.get() ? "scripted" : "set";
        auto handler =
            idem::make_handler(*s, idem::Policy{scope}, [](auto&, const std::string&) {});
        std::vector<Delivery> deliveries = {{"m-1", 1u}, {"m-2", 1u}, {"m-1", 1u}};
        std::vector<std::string> bodies = {"a", "b", "a"};
        auto first = handler.handle_batch(deliveries, bodies);
        EXPECT_EQ(first[0].disposition, Disposition::processed) << scope;
        EXPECT_EQ(first[1].disposition, Disposition::processed) << scope;
        EXPECT_EQ(first[2].disposition, Disposition::duplicate) << scope;
        auto second = handler.handle_batch(deliveries, bodies);
        for (const auto& outcome : second)
            EXPECT_EQ(outcome.disposition, Disposition::duplicate) << scope;
        auto raw = client().str({"GET", claim_key(scope, "m-1")});
        ASSERT_TRUE(raw.has_value());
        // The script reads TIME and writes numbers; SET writes `~<retention>`.
        EXPECT_EQ(raw->find('~') == std::string::npos, s == scripted.get()) << *raw;
    }
}

TEST_F(RedisServerClockTest, AServerThatRefusesSetGetTurnsTheStoreToTheClaimScriptForGood) {
    // Redis before 7.0 answers SET … NX … GET with a syntax error (and writes nothing); a proxy
    // in front of the real server answers so.
    idem_test::RefusingProxy proxy(store().endpoint().host, store().endpoint().port,
                                   idem_test::is_set_nx_get, "ERR syntax error");
    idem::RedisEndpoint through_proxy = store().endpoint();
    through_proxy.port = proxy.port();
    idem::RedisStore old_server{through_proxy};
    ASSERT_TRUE(old_server.claims_with_set());
    int runs = 0;
    auto handler = idem::make_handler(old_server, idem::Policy{"old"},
                                      [&runs](auto&, const std::string&) { ++runs; });
    EXPECT_EQ(handler.handle(Delivery{"m-1", 1u}, std::string("a")).disposition,
              Disposition::processed);
    EXPECT_EQ(proxy.refused(), 1);
    EXPECT_FALSE(old_server.claims_with_set());
    EXPECT_EQ(handler.handle(Delivery{"m-1", 2u}, std::string("a")).disposition,
              Disposition::duplicate);
    auto batch = handler.handle_batch(std::vector<Delivery>{{"m-2", 1u}, {"m-1", 3u}, {"m-3", 1u}},
                                      std::vector<std::string>{"b", "a", "c"});
    EXPECT_EQ(batch[0].disposition, Disposition::processed);
    EXPECT_EQ(batch[1].disposition, Disposition::duplicate);
    EXPECT_EQ(batch[2].disposition, Disposition::processed);
    EXPECT_EQ(proxy.refused(), 1);  // never asked again
    EXPECT_EQ(runs, 3);
    auto raw = client().str({"GET", claim_key("old", "m-2")});
    ASSERT_TRUE(raw.has_value());
    EXPECT_EQ(raw->find('~'), std::string::npos) << *raw;  // written by the script
}

TEST_F(RedisStoreTest, OneClaimsKeysShareAClusterSlotWhateverTheIdHolds) {
    ASSERT_EQ(key_slot("123456789"), 0x31C3u % 16384);  // the CRC16 check value
    const std::vector<std::string> ids = {"plain", "a}b", "{x}", "}",
                                          "{",     "%7D", "a:b", std::string("nul\0id", 6)};
    for (const auto& id : ids) {
        EXPECT_EQ(key_slot(store().claim_key("capture", id)),
                  key_slot(store().dead_letter_key("capture", id)))
            << id;
    }
    // Escaping keeps different (scope, id) pairs apart.
    EXPECT_NE(store().claim_key("a:b", "c"), store().claim_key("a", "b:c"));
    EXPECT_NE(store().claim_key("s", "a}b"), store().claim_key("s", "a%7Db"));
    EXPECT_NE(store().claim_key("s", "}"), store().claim_key("s", "%7D"));
}

TEST_F(RedisStoreTest, HostileIdsAndPayloadsRoundTripIntact) {
    const std::vector<std::string> ids = {"with space",
                                          "quote\"s and 'single'",
                                          "{braces}",
                                          "}{",
                                          std::string("n\0l", 3),
                                          "%25%7D",
                                          "a:b:c",
                                          "\xff\xfe binary",
                                          "*?[glob]\\",
                                          "emoji \xf0\x9f\x92\xb3"};
    const std::string payload = std::string("payload\0with nul", 16) + "\r\n\"{}\xff";
    idem::PolicyOptions park_at_once;
    park_at_once.max_deliveries = 1;
    auto writer = idem::make_handler(
        store(), idem::Policy{"scope:with{odd}chars"},
        [](auto& tx, const std::string& body) { tx.write("SADD", "seen", body); });
    auto parker = idem::make_handler(store(), idem::Policy{"park", park_at_once},
                                     [](auto&, const std::string&) {});
    for (const auto& id : ids) {
        EXPECT_EQ(writer.handle(Delivery{id, 1u}, id + payload).disposition, Disposition::processed)
            << id;
        EXPECT_EQ(writer.handle(Delivery{id, 2u}, id + payload).disposition, Disposition::duplicate)
            << id;
        auto record = store().find_claim("scope:with{odd}chars", id);
        ASSERT_TRUE(record.has_value()) << id;
        EXPECT_EQ(record->message_id, id);
        EXPECT_EQ(parker.handle(Delivery{id, 1u}, id + payload).disposition,
                  Disposition::dead_lettered);
        EXPECT_EQ(client().integer({"SISMEMBER", "seen", id + payload}), 1) << id;
    }
    EXPECT_EQ(client().integer({"SCARD", "seen"}), static_cast<long long>(ids.size()));
    auto letters = store().dead_letters();
    ASSERT_EQ(letters.size(), ids.size());
    std::set<std::string> got_ids;
    for (const auto& letter : letters) {
        got_ids.insert(letter.message_id);
        EXPECT_EQ(letter.payload, letter.message_id + payload);
        EXPECT_EQ(letter.scope, "park");
    }
    EXPECT_EQ(got_ids, std::set<std::string>(ids.begin(), ids.end()));
}

// ---- retention after a takeover -----------------------------------------------------------------

TEST_F(RedisServerClockTest, ATakeoverRestartsTheRetentionAndKeepsTheFirstClaimedAt) {
    auto a = worker();
    const idem::ClaimTerms terms{30s, idem::days(14)};
    {
        auto tx = a->begin();
        tx.set_terms(terms);
        ASSERT_EQ(tx.claim("pay", "m-1", "fp-1").status, ClaimStatus::claimed);
    }  // rolled back: released, the record (and its expiry) stays
    const auto first = a->find_claim("pay", "m-1");
    ASSERT_FALSE(first.has_value());  // released
    // The record has aged: ten days of its retention are gone.
    const std::string key = claim_key("pay", "m-1");
    const std::int64_t four_days_ms = idem::days(4) / 1ms;
    client().exec({"PEXPIRE", key, std::to_string(four_days_ms)});
    const std::string before = *client().str({"GET", key});

    auto tx = a->begin();
    tx.set_terms(terms);
    ASSERT_EQ(tx.claim("pay", "m-1", "fp-2").status, ClaimStatus::claimed);  // the takeover
    tx.commit();
    // The retention counts again from the takeover (the latest delivery), not from claimed_at.
    const std::int64_t left = *client().integer({"PTTL", key});
    EXPECT_GT(left, idem::days(14) / 1ms - 60'000) << "the takeover kept the old expiry";
    const std::int64_t expires_at = *client().integer({"PEXPIRETIME", key});
    EXPECT_NEAR(static_cast<double>(expires_at),
                static_cast<double>(server_ms() + idem::days(14) / 1ms), 60'000.0);
    // claimed_at stays the first claim's (as resolved before the takeover), attempts go on.
    auto record = idem::redis::Record::decode(*client().str({"GET", key}));
    ASSERT_TRUE(record.has_value());
    auto old_record = idem::redis::Record::decode(before);
    ASSERT_TRUE(old_record.has_value());
    EXPECT_EQ(old_record->state, "free");
    EXPECT_EQ(record->attempts, 2u);
    EXPECT_EQ(record->fingerprint, "fp-2");
    EXPECT_FALSE(record->times_before_expiry.has_value());  // the takeover writes numbers
    const auto claim = a->find_claim("pay", "m-1");
    ASSERT_TRUE(claim.has_value());
    // The record says its first claim was ten days ago (its expiry minus the retention, as the SET
    // claim stores it): the takeover keeps that, it does not restart claimed_at.
    const std::int64_t ten_days_ago = server_ms() - idem::days(10) / 1ms;
    EXPECT_NEAR(static_cast<double>(idem::to_unix_ms(claim->claimed_at)),
                static_cast<double>(ten_days_ago), 60'000.0);
    EXPECT_EQ(record->claimed_at, idem::to_unix_ms(claim->claimed_at));
}

// ---- a paced purge
// ------------------------------------------------------------------------------- purge() walks the
// keyspace a SCAN page at a time (PurgeOptions::batch_rows keys looked at per page), so a run holds
// one page of keys whatever the store's size, pauses between pages and stops when asked.

/// @p n claims "<prefix>-<i>" processed now, each its own handle().
template <class Handler>
void process(Handler& handler, const std::string& prefix, int n) {
    for (int i = 0; i < n; ++i) {
        ASSERT_EQ(handler.handle(Delivery{prefix + "-" + std::to_string(i), 1u}, std::string("x"))
                      .disposition,
                  Disposition::processed)
            << prefix << i;
    }
}

TEST_F(RedisStoreTest, APacedPurgeDeletesExactlyTheExpiredRowsPageByPage) {
    auto& s = store();
    const auto t0 = now();
    auto handler =
        idem::make_handler(s, idem::Policy{"ledger"}, [](auto&, const std::string& body) {
            if (body == "p") throw idem::malformed_message("unreadable");
        });
    process(handler, "old", 600);
    for (const char* id : {"poison-sent", "poison-unsent", "poison-kept"}) {
        ASSERT_EQ(handler.handle(Delivery{id, 1u}, std::string("p")).disposition,
                  Disposition::dead_lettered);
    }
    idem::DeadLetterSelection two;
    two.scope = "ledger";
    two.message_ids = {"poison-sent", "poison-unsent"};
    idem::RedriveOptions to_orders;
    to_orders.destination = "orders";
    ASSERT_EQ(s.redrive(two, to_orders).count(idem::RedriveStatus::redriven), 2u);
    const auto leased = s.lease_outbox(1, 30s);
    ASSERT_EQ(leased.size(), 1u);
    s.mark_outbox_sent(leased[0].id);
    now() = t0 + idem::days(10);
    process(handler, "new", 50);

    now() = t0 + idem::days(15);
    idem::PurgeOptions options;
    options.batch_rows = 100;
    options.duty_cycle = 1.0;  // no pause: this test counts rows, not time
    std::vector<std::size_t> claims_after_page;
    options.on_batch = [&](const idem::PurgeResult& so_far) {
        claims_after_page.push_back(so_far.claims);
    };
    const auto result = s.purge(idem::days(14), options);
    EXPECT_TRUE(result.complete);
    EXPECT_EQ(result.claims, 601u) << "600 old claims and the parked one's";
    EXPECT_EQ(result.sent_intents, 1u);
    EXPECT_EQ(result.batches, claims_after_page.size());
    EXPECT_GE(result.batches, 5u) << "about 700 keys, 100 looked at per page";
    std::size_t largest_page = 0;
    for (std::size_t i = 0; i < claims_after_page.size(); ++i) {
        largest_page =
            std::max(largest_page, claims_after_page[i] - (i == 0 ? 0 : claims_after_page[i - 1]));
    }
    EXPECT_LT(largest_page, 601u) << "one page deleted everything: not paged";
    for (int i = 0; i < 600; i += 37)
        EXPECT_FALSE(s.find_claim("ledger", "old-" + std::to_string(i)).has_value()) << i;
    for (int i = 0; i < 50; ++i)
        EXPECT_TRUE(s.find_claim("ledger", "new-" + std::to_string(i)).has_value()) << i;
    EXPECT_EQ(s.dead_letters(idem::DeadLetterSelection{}).size(), 3u)
        << "dead letters are never purged";
    const auto kept = s.outbox_rows();
    ASSERT_EQ(kept.size(), 1u) << "the unsent intent stays, the sent one goes";
    EXPECT_FALSE(kept[0].sent_at.has_value());
    EXPECT_EQ(s.purge(idem::days(14), options).rows(), 0u);
}

TEST_F(RedisStoreTest, AStoppedPurgeLeavesTheRestForTheNextRun) {
    auto& s = store();
    const auto t0 = now();
    auto handler = idem::make_handler(s, idem::Policy{"ledger"}, [](auto&, const std::string&) {});
    process(handler, "m", 400);
    now() = t0 + idem::days(15);
    idem::PurgeOptions options;
    options.batch_rows = 50;
    std::size_t pages = 0;
    options.on_batch = [&](const idem::PurgeResult&) { ++pages; };
    options.should_stop = [&] { return pages >= 2; };
    const auto first = s.purge(idem::days(14), options);
    EXPECT_FALSE(first.complete);
    EXPECT_EQ(first.batches, 2u);
    EXPECT_GT(first.claims, 0u);
    EXPECT_LT(first.claims, 400u);
    options.should_stop = nullptr;
    const auto second = s.purge(idem::days(14), options);
    EXPECT_TRUE(second.complete);
    EXPECT_EQ(first.claims + second.claims, 400u);
}

// ---- fuzz regressions (tests/fuzz/corpus/redis_record, redis_dead_letter) ----------------------
// A stored value is outside bytes: a corrupt or hostile record must read as no record, or as
// numbers held at their limits, never overflow or throw (fuzz.redis_record found each of these).

TEST(RedisRecordFuzzRegression, ALongRunOfDigitsReadsAsTheNearestLimit) {
    using idem::redis::parse_int;
    EXPECT_EQ(parse_int("99999999999999999999"), INT64_MAX);
    EXPECT_EQ(parse_int("-99999999999999999999"), INT64_MIN);
    EXPECT_EQ(parse_int("9223372036854775807"), INT64_MAX);
    EXPECT_EQ(parse_int("-9223372036854775808"), INT64_MIN);
    EXPECT_EQ(parse_int("-9223372036854775807"), -INT64_MAX);
    EXPECT_EQ(parse_int("1700000000000|rest"), 1700000000000);
    EXPECT_EQ(parse_int("x"), 0);
}

TEST(RedisRecordFuzzRegression, ANegativeOrWrappingFieldLengthIsNoRecord) {
    using idem::redis::Record;
    // corpus: regression-decode-negative-length (substr threw std::out_of_range)
    constexpr char negative[] =
        "leased|0123456394abcdef0123456789abc||1|1700000000200|1700000000000|30000|0|-3|5\n"
        "order\0\0sorder";
    EXPECT_FALSE(Record::decode(std::string_view(negative, sizeof negative - 1)));
    // lengths whose sum wraps around size_t
    EXPECT_FALSE(Record::decode("done|||1|0|0|0|9223372036854775807|9223372036854775807|2\nab"));
    EXPECT_FALSE(Record::decode("done|||1|0|0|0|3|0|0\nab"));
    auto fits = Record::decode("done||processed|1|0|0|0|1|0|1\nabreason");
    ASSERT_TRUE(fits);
    EXPECT_EQ(fits->fingerprint, "a");
    EXPECT_EQ(fits->id, "b");
    EXPECT_EQ(fits->reason, "reason");
}

TEST(RedisRecordFuzzRegression, TimesAtTheLimitsResolveAndEndWithoutOverflow) {
    using idem::redis::Record;
    // corpus: regression-resolve-overflow (the expiry minus `~<ms>` overflowed)
    auto set_claim = Record::decode("free|||3|~86400000|~86400000|30000|0|1|2\nsid");
    ASSERT_TRUE(set_claim);
    set_claim->resolve(INT64_MIN);
    EXPECT_EQ(set_claim->claimed_at, INT64_MIN);
    auto before_min = Record::decode("free|||3|~-9223372036854775808|~0|0|0|0|0\n");
    ASSERT_TRUE(before_min);
    before_min->resolve(1);
    EXPECT_EQ(before_min->claimed_at, INT64_MAX);
    // corpus: regression-lease-until-overflow (a claim written with times and lease at INT64_MIN)
    const std::string head =
        Record::new_head("leased", "ab", "", "-9223372036854775808", 86400000, INT64_MIN);
    auto leased = Record::decode(head + Record::fields("", "s", "id"));
    ASSERT_TRUE(leased);
    EXPECT_EQ(leased->leased_at, INT64_MIN);
    EXPECT_EQ(leased->lease_ms, INT64_MIN);
    EXPECT_EQ(leased->lease_until(), INT64_MIN);
    // corpus: regression-parse-int-overflow (INT64_MIN written, read back past the limit)
    auto server_time = Record::decode(Record::new_head("leased", "ab", "", "", INT64_MIN, 1) +
                                      Record::fields("", "s", "id"));
    ASSERT_TRUE(server_time);
    EXPECT_EQ(server_time->times_before_expiry, INT64_MIN);
}

TEST(RedisDeadLetterFuzzRegression, ACreatedAtPastTheClockIsHeldAtItsLatestTime) {
    using idem::redis::Reply;
    auto text = [](std::string s) {
        Reply r;
        r.type = Reply::Type::string;
        r.str = std::move(s);
        return r;
    };
    Reply fields;
    fields.type = Reply::Type::array;
    for (const char* part : {"scope", "s", "id", "m", "delivery_count", "5", "created_at",
                             "99999999999999999999", "order_us", "1"})
        fields.elements.push_back(text(part));
    Reply entry;
    entry.type = Reply::Type::array;
    entry.elements = {text("1-0"), fields};
    const auto letter = idem::redis::dead_letter_of(entry);
    ASSERT_TRUE(letter);
    EXPECT_EQ(letter->letter.created_at, std::chrono::system_clock::time_point::max());
    EXPECT_EQ(letter->letter.delivery_count, 5u);
    EXPECT_EQ(letter->letter.message_id, "m");
    Reply short_entry;
    short_entry.type = Reply::Type::array;
    short_entry.elements = {text("1-0")};
    EXPECT_FALSE(idem::redis::dead_letter_of(short_entry));
}

}  // namespace
}  // namespace idem_test::redis_store
