#pragma once
/// @file
/// @brief The redrive suite (registered as IdemRedriveConformance): dead letters brought back
/// exactly once (contract/redrive.hpp) — a redriven message is processed once when the relay
/// delivers its intent, a second redrive or a concurrent one writes no second intent, a message
/// processed meanwhile is reported and not re-run, a dry run changes nothing, the redriven
/// message gets a fresh poison limit, a failed redrive leaves nothing, and a message parked
/// again keeps its history; the listing's selection, past many pages of entries; a purge by
/// selection deletes those entries only and keeps their claims. For every store
/// with `redrive()` and an outbox; its environment is the main suite's plus:
///   refuse_redrives(), accept_redrives()  make the redrive's transactions really fail (an
///                              injected commit fault, a trigger refusing the outbox's insert)
///                              and work again
/// and, optional, `std::unique_ptr<Store> another_store()`: a second connection on the same
/// data, so the concurrent test races two connections (without it, threads share the store).
/// Part of idem/testing/conformance.hpp, which registers the suite; include that one.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/contract/redrive.hpp"
#include "idem/contract/store.hpp"
#include "idem/delivery.hpp"
#include "idem/error.hpp"
#include "idem/outbox.hpp"
#include "idem/outcome.hpp"
#include "idem/testing/conformance/suite.hpp"

namespace idem {
namespace testing {
namespace conformance {

template <class Env, class = void>
struct can_refuse_redrives : std::false_type {};
template <class Env>
struct can_refuse_redrives<Env, std::void_t<decltype(std::declval<Env&>().refuse_redrives()),
                                            decltype(std::declval<Env&>().accept_redrives())>>
    : std::true_type {};

template <class Env, class = void>
struct has_another_store : std::false_type {};
template <class Env>
struct has_another_store<Env, std::void_t<decltype(std::declval<Env&>().another_store())>>
    : std::true_type {};

}  // namespace conformance

/// @brief The fixture of the redrive suite: the main suite's, and a handler whose effect fails
/// (a poison message) until fix() is called, the relay that delivers the redriven intents to it.
template <class Env>
class RedriveConformance : public StoreConformance<Env> {
    static_assert(conformance::can_refuse_redrives<Env>::value,
                  "IdemRedriveConformance: the environment needs refuse_redrives() and "
                  "accept_redrives(), which make the store's redrive transactions really fail "
                  "and work again");

  protected:
    static constexpr const char* scope = "redrive";
    static constexpr const char* destination = "orders";

    std::shared_ptr<std::atomic<bool>> fixed_ = std::make_shared<std::atomic<bool>>(false);

    /// The consumer: its effect throws (a poison message) until fix().
    auto consumer() {
        auto fixed = fixed_;
        return this->make(idem::Policy{scope}, [fixed](auto& tx, const std::string& body) {
            if (!fixed->load()) throw std::runtime_error("gateway 503");
            Env::write_effect(tx, body);
        });
    }
    void fix() { fixed_->store(true); }

    /// Parks @p id: a delivery at the poison limit (5), its effect never runs. A lease store
    /// judges by its own count of the claims taken to run the effect, not the broker's: there
    /// the broker redelivers it until that count reaches the limit, each attempt failing.
    /// @p origin and @p position: where the broker held it (Delivery::origin).
    template <class Handler>
    void park(Handler& handler, const std::string& id, const std::string& origin = {},
              const std::string& position = {}, idem::Outcome* parked = nullptr) {
        idem::Delivery delivery{id, 5u};
        delivery.origin = origin;
        delivery.origin_position = position;
        for (int attempt = 1; attempt <= 5; ++attempt) {
            idem::Outcome outcome = handler.handle(delivery, id);
            if (outcome.disposition == idem::Disposition::dead_lettered) {
                if (parked != nullptr) *parked = std::move(outcome);
                return;
            }
            ASSERT_EQ(outcome.disposition, idem::Disposition::failed) << outcome.reason;
        }
        FAIL() << id << " was not parked after 5 deliveries at the limit";
    }

    static idem::RedriveOptions to_orders(bool dry_run = false) {
        idem::RedriveOptions options;
        options.destination = destination;
        options.dry_run = dry_run;
        return options;
    }
    static idem::DeadLetterSelection ids(std::vector<std::string> message_ids) {
        idem::DeadLetterSelection selection;
        selection.scope = scope;
        selection.message_ids = std::move(message_ids);
        return selection;
    }

    /// One relay run whose sender hands each intent to @p handler as a delivery of its key
    /// (the message id) with @p count; the outcomes, in order.
    template <class Handler>
    std::vector<idem::Disposition> relay_to(Handler& handler, std::uint32_t count = 1) {
        std::vector<idem::Disposition> outcomes;
        idem::Relay relay{
            this->store(), [&](const idem::OutboxRow& row) {
                EXPECT_EQ(row.destination, destination);
                outcomes.push_back(
                    handler.handle(idem::Delivery{row.idempotency_key, count}, row.payload)
                        .disposition);
            }};
        relay.run_once();
        return outcomes;
    }

    /// Counts an attempt of @p id where the store counts attempts apart from the claim
    /// (count_attempt(), for brokers without a delivery count); the Redis store counts them in
    /// the claim record only. Answers the attempts the store records for @p id now.
    std::uint32_t count_attempt(const std::string& id) {
        if constexpr (idem::has_count_attempt<typename StoreConformance<Env>::Store>::value) {
            this->store().count_attempt(scope, id);
        }
        return this->store().attempts(scope, id);
    }

    /// Whether the store notes the effect's failures for its dead letters (note_failure()); the
    /// tests of that skip a store that does not.
    static constexpr bool notes_failures =
        idem::has_note_failure<typename StoreConformance<Env>::Store>::value;
    /// Whether it reads them back (noted_failure()) for a broker's dead-letter copy.
    static constexpr bool recalls_failures =
        idem::has_noted_failure<typename StoreConformance<Env>::Store>::value;

    std::optional<idem::Disposition> claim_of(const std::string& id) {
        auto claim = this->store().find_claim(scope, id);
        if (!claim) return std::nullopt;
        return claim->disposition;
    }
};

}  // namespace testing
}  // namespace idem

/// The redrive suite's registered name (a name at global scope: GoogleTest's *_P macros paste
/// it).
template <class Env>
using IdemRedriveConformance = ::idem::testing::RedriveConformance<Env>;

TYPED_TEST_SUITE_P(IdemRedriveConformance);

TYPED_TEST_P(IdemRedriveConformance, RedrivenMessageIsProcessedOnceWhenTheRelayDeliversIt) {
    auto handler = this->consumer();
    this->park(handler, "p-1");
    // A plain re-publish is swallowed: the claim says dead_lettered.
    EXPECT_EQ(handler.handle(idem::Delivery{"p-1", 1u}, std::string("p-1")).disposition,
              idem::Disposition::duplicate);
    this->fix();
    const idem::RedriveReport report = this->store().redrive(this->ids({"p-1"}), this->to_orders());
    ASSERT_EQ(report.entries.size(), 1u);
    EXPECT_FALSE(report.dry_run);
    EXPECT_EQ(report.entries[0].status, idem::RedriveStatus::redriven);
    EXPECT_EQ(report.entries[0].letter.message_id, "p-1");
    EXPECT_FALSE(this->claim_of("p-1").has_value()) << "the parked claim is removed";
    const auto rows = this->store().outbox_rows();
    ASSERT_EQ(rows.size(), 1u);
    EXPECT_EQ(rows[0].idempotency_key, "p-1") << "re-published under its own message id";
    EXPECT_EQ(rows[0].payload, "p-1");
    EXPECT_EQ(rows[0].destination, "orders");
    EXPECT_FALSE(rows[0].sent_at.has_value());

    EXPECT_EQ(this->relay_to(handler),
              (std::vector<idem::Disposition>{idem::Disposition::processed}));
    EXPECT_TRUE(this->relay_to(handler).empty()) << "the intent was marked sent";
    // The broker delivers the re-published message again: a duplicate.
    EXPECT_EQ(handler.handle(idem::Delivery{"p-1", 2u}, std::string("p-1")).disposition,
              idem::Disposition::duplicate);
    EXPECT_EQ(this->env.effect_rows(), 1u);
    EXPECT_TRUE(this->env.has_effect("p-1"));
    EXPECT_EQ(this->claim_of("p-1"),
              std::optional<idem::Disposition>(idem::Disposition::processed));
    const auto letters = this->store().dead_letters(this->ids({"p-1"}));
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_EQ(letters[0].redrive_count, 1u);
    ASSERT_TRUE(letters[0].redriven_at.has_value());
    EXPECT_EQ(*letters[0].redriven_at, this->env.now);
}

TYPED_TEST_P(IdemRedriveConformance, RedrivingTwiceWritesOneIntent) {
    auto handler = this->consumer();
    this->park(handler, "t-1");
    this->park(handler, "t-2");
    this->fix();
    const auto first = this->store().redrive(this->ids({}), this->to_orders());
    EXPECT_EQ(first.count(idem::RedriveStatus::redriven), 2u);
    const auto second = this->store().redrive(this->ids({}), this->to_orders());
    ASSERT_EQ(second.entries.size(), 2u);
    EXPECT_EQ(second.count(idem::RedriveStatus::already_redriven), 2u);
    EXPECT_EQ(this->store().outbox_rows().size(), 2u);
    EXPECT_EQ(this->relay_to(handler).size(), 2u);
    // Once processed, a third redrive still writes nothing.
    const auto third = this->store().redrive(this->ids({"t-1"}), this->to_orders());
    ASSERT_EQ(third.entries.size(), 1u);
    EXPECT_EQ(third.entries[0].status, idem::RedriveStatus::already_redriven);
    EXPECT_EQ(this->store().outbox_rows().size(), 2u);
    EXPECT_TRUE(this->relay_to(handler).empty());
    EXPECT_EQ(this->env.effect_rows(), 2u);
}

TYPED_TEST_P(IdemRedriveConformance, MessageProcessedMeanwhileIsReportedNotRerun) {
    auto handler = this->consumer();
    this->park(handler, "m-1");
    // Its claim goes with the retention (the dead letter stays), and a re-publish runs it.
    this->env.now += std::chrono::hours(24 * 15);
    EXPECT_EQ(this->store().purge(std::chrono::hours(24 * 14)).claims, 1u);
    this->fix();
    ASSERT_EQ(handler.handle(idem::Delivery{"m-1", 1u}, std::string("m-1")).disposition,
              idem::Disposition::processed);
    const auto report = this->store().redrive(this->ids({"m-1"}), this->to_orders());
    ASSERT_EQ(report.entries.size(), 1u);
    EXPECT_EQ(report.entries[0].status, idem::RedriveStatus::processed_meanwhile);
    EXPECT_EQ(report.entries[0].recorded, idem::Disposition::processed);
    EXPECT_TRUE(this->store().outbox_rows().empty());
    EXPECT_EQ(this->claim_of("m-1"),
              std::optional<idem::Disposition>(idem::Disposition::processed));
    EXPECT_FALSE(this->store().dead_letters(this->ids({"m-1"}))[0].redriven_at.has_value());
    EXPECT_EQ(this->env.effect_rows(), 1u);
}

TYPED_TEST_P(IdemRedriveConformance, DryRunChangesNothing) {
    auto handler = this->consumer();
    this->park(handler, "d-1");
    this->park(handler, "d-2");
    const std::uint32_t attempts = this->count_attempt("d-1");
    const auto dry = this->store().redrive(this->ids({}), this->to_orders(true));
    EXPECT_TRUE(dry.dry_run);
    ASSERT_EQ(dry.entries.size(), 2u);
    EXPECT_EQ(dry.count(idem::RedriveStatus::redriven), 2u) << "both would be redriven";
    EXPECT_TRUE(this->store().outbox_rows().empty());
    EXPECT_EQ(this->claim_of("d-1"),
              std::optional<idem::Disposition>(idem::Disposition::dead_lettered));
    EXPECT_EQ(this->claim_of("d-2"),
              std::optional<idem::Disposition>(idem::Disposition::dead_lettered));
    EXPECT_EQ(this->store().attempts(this->scope, "d-1"), attempts);
    for (const idem::DeadLetter& letter : this->store().dead_letters(this->ids({}))) {
        EXPECT_FALSE(letter.redriven_at.has_value());
        EXPECT_EQ(letter.redrive_count, 0u);
    }
    const auto real = this->store().redrive(this->ids({}), this->to_orders());
    EXPECT_EQ(real.count(idem::RedriveStatus::redriven), 2u);
    EXPECT_EQ(this->store().outbox_rows().size(), 2u);
}

TYPED_TEST_P(IdemRedriveConformance, RedrivenMessageGetsAFreshPoisonLimit) {
    auto handler = this->consumer();
    using Store = typename TestFixture::Store;
    constexpr bool counts_apart = idem::has_count_attempt<Store>::value;
    for (int i = 0; i < 5; ++i)
        this->count_attempt("f-1");
    this->park(handler, "f-1");
    if (counts_apart) {
        ASSERT_EQ(this->store().attempts(this->scope, "f-1"), 5u);
    }
    ASSERT_EQ(this->store()
                  .redrive(this->ids({"f-1"}), this->to_orders())
                  .count(idem::RedriveStatus::redriven),
              1u);
    EXPECT_EQ(this->store().attempts(this->scope, "f-1"), 0u) << "the attempt count is gone";
    if (counts_apart) {
        EXPECT_EQ(this->count_attempt("f-1"), 1u);
    }
    // Still poison: its first delivery fails and is not parked at once.
    EXPECT_EQ(this->relay_to(handler, 1u),
              (std::vector<idem::Disposition>{idem::Disposition::failed}));
    EXPECT_FALSE(this->claim_of("f-1").has_value());
    EXPECT_EQ(this->store().dead_letters(this->ids({"f-1"})).size(), 1u);
}

TYPED_TEST_P(IdemRedriveConformance, ConcurrentRedrivesWriteOneIntentPerMessage) {
    auto handler = this->consumer();
    constexpr int messages = 6;
    std::vector<std::string> parked;
    for (int i = 0; i < messages; ++i) {
        parked.push_back("c-" + std::to_string(i));
        this->park(handler, parked.back());
    }
    using Store = typename TestFixture::Store;
    std::vector<std::unique_ptr<Store>> others;
    std::vector<Store*> stores{&this->store()};
    if constexpr (idem::testing::conformance::has_another_store<TypeParam>::value) {
        others.push_back(this->env.another_store());
        stores.push_back(others.back().get());
    } else {
        stores.push_back(&this->store());
    }
    std::vector<idem::RedriveReport> reports(4);
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    for (std::size_t t = 0; t < reports.size(); ++t) {
        threads.emplace_back([&, t] {
            ready.fetch_add(1);
            while (ready.load() < static_cast<int>(reports.size()))
                std::this_thread::yield();
            reports[t] = stores[t % stores.size()]->redrive(this->ids({}), this->to_orders());
        });
    }
    for (auto& thread : threads)
        thread.join();
    std::size_t redriven = 0;
    for (const auto& report : reports) {
        EXPECT_EQ(report.entries.size(), static_cast<std::size_t>(messages));
        EXPECT_EQ(report.count(idem::RedriveStatus::failed), 0u);
        redriven += report.count(idem::RedriveStatus::redriven);
    }
    EXPECT_EQ(redriven, static_cast<std::size_t>(messages)) << "each message redriven once";
    const auto rows = this->store().outbox_rows();
    ASSERT_EQ(rows.size(), static_cast<std::size_t>(messages));
    std::set<std::string> keys;
    for (const auto& row : rows)
        keys.insert(row.idempotency_key);
    EXPECT_EQ(keys, std::set<std::string>(parked.begin(), parked.end()));
    this->fix();
    EXPECT_EQ(this->relay_to(handler).size(), static_cast<std::size_t>(messages));
    EXPECT_EQ(this->env.effect_rows(), static_cast<std::size_t>(messages));
    for (const auto& letter : this->store().dead_letters(this->ids({})))
        EXPECT_EQ(letter.redrive_count, 1u);
}

TYPED_TEST_P(IdemRedriveConformance, FailedRedriveLeavesNothingAndARerunRedrivesOnce) {
    auto handler = this->consumer();
    this->park(handler, "x-1");
    const std::uint32_t attempts = this->count_attempt("x-1");
    this->env.refuse_redrives();
    const auto failed = this->store().redrive(this->ids({"x-1"}), this->to_orders());
    this->env.accept_redrives();
    ASSERT_EQ(failed.entries.size(), 1u);
    EXPECT_EQ(failed.entries[0].status, idem::RedriveStatus::failed);
    EXPECT_FALSE(failed.entries[0].error.empty());
    EXPECT_TRUE(this->store().outbox_rows().empty());
    EXPECT_EQ(this->claim_of("x-1"),
              std::optional<idem::Disposition>(idem::Disposition::dead_lettered));
    EXPECT_EQ(this->store().attempts(this->scope, "x-1"), attempts);
    EXPECT_FALSE(this->store().dead_letters(this->ids({"x-1"}))[0].redriven_at.has_value());

    const auto again = this->store().redrive(this->ids({"x-1"}), this->to_orders());
    ASSERT_EQ(again.entries.size(), 1u);
    EXPECT_EQ(again.entries[0].status, idem::RedriveStatus::redriven);
    EXPECT_EQ(this->store().outbox_rows().size(), 1u);
    this->fix();
    EXPECT_EQ(this->relay_to(handler),
              (std::vector<idem::Disposition>{idem::Disposition::processed}));
    EXPECT_EQ(this->env.effect_rows(), 1u);
}

TYPED_TEST_P(IdemRedriveConformance, MessageParkedAgainKeepsItsHistory) {
    auto handler = this->consumer();
    this->park(handler, "h-1");
    ASSERT_EQ(this->store()
                  .redrive(this->ids({"h-1"}), this->to_orders())
                  .count(idem::RedriveStatus::redriven),
              1u);
    this->env.now += std::chrono::minutes(1);
    // Still poison: the re-published message fails up to the limit and is parked again.
    const std::vector<idem::Disposition> outcomes = this->relay_to(handler, 5u);
    ASSERT_EQ(outcomes.size(), 1u);
    if (outcomes[0] != idem::Disposition::dead_lettered) {
        // A lease store counts its own attempts: the broker redelivers it up to the limit.
        EXPECT_EQ(outcomes[0], idem::Disposition::failed);
        this->park(handler, "h-1");
    }
    auto letters = this->store().dead_letters(this->ids({"h-1"}));
    ASSERT_EQ(letters.size(), 2u);
    EXPECT_EQ(letters[0].redrive_count, 1u);
    EXPECT_TRUE(letters[0].redriven_at.has_value());
    EXPECT_LT(letters[0].id, letters[1].id);
    EXPECT_EQ(letters[1].redrive_count, 0u);
    EXPECT_FALSE(letters[1].redriven_at.has_value());

    const auto report = this->store().redrive(this->ids({"h-1"}), this->to_orders());
    ASSERT_EQ(report.entries.size(), 2u);
    EXPECT_EQ(report.entries[0].status, idem::RedriveStatus::already_redriven);
    EXPECT_EQ(report.entries[1].status, idem::RedriveStatus::redriven);
    letters = this->store().dead_letters(this->ids({"h-1"}));
    ASSERT_EQ(letters.size(), 2u);
    EXPECT_EQ(letters[0].redrive_count, 1u);
    EXPECT_EQ(letters[1].redrive_count, 2u) << "the message's second redrive";
    // One intent per message: the sent one is armed again, not doubled.
    const auto rows = this->store().outbox_rows();
    ASSERT_EQ(rows.size(), 1u);
    EXPECT_FALSE(rows[0].sent_at.has_value());
    this->fix();
    EXPECT_EQ(this->relay_to(handler),
              (std::vector<idem::Disposition>{idem::Disposition::processed}));
    EXPECT_EQ(this->env.effect_rows(), 1u);
}

TYPED_TEST_P(IdemRedriveConformance, SelectionTakesScopeIdsReasonTimeAndLimitOldestFirst) {
    const auto park = [&](const std::string& scope, const std::string& id,
                          const std::string& reason) {
        idem::DeadLetter letter;
        letter.scope = scope;
        letter.message_id = id;
        letter.delivery_count = 5;
        letter.reason = reason;
        letter.payload = "bytes of " + id;
        auto tx = this->store().begin();
        tx.dead_letter(letter);
        tx.commit();
    };
    const auto first = this->env.now;
    park("redrive", "s-1", "gateway 503 at the limit");
    this->env.now += std::chrono::minutes(1);
    park("redrive", "s-2", "malformed body");
    park("other", "s-3", "gateway 503 at the limit");
    this->env.now += std::chrono::minutes(1);
    park("redrive", "s-4", "gateway 503 at the limit");
    const auto listed = [&](const idem::DeadLetterSelection& selection) {
        std::vector<std::string> out;
        for (const auto& letter : this->store().dead_letters(selection))
            out.push_back(letter.message_id);
        return out;
    };
    using list = std::vector<std::string>;
    EXPECT_EQ(listed({}), (list{"s-1", "s-2", "s-3", "s-4"}));
    idem::DeadLetterSelection selection;
    selection.scope = "redrive";
    EXPECT_EQ(listed(selection), (list{"s-1", "s-2", "s-4"}));
    selection.reason_contains = "503";
    EXPECT_EQ(listed(selection), (list{"s-1", "s-4"}));
    selection.created_from = first + std::chrono::minutes(1);
    EXPECT_EQ(listed(selection), (list{"s-4"}));
    selection = {};
    selection.created_before = first + std::chrono::minutes(2);
    EXPECT_EQ(listed(selection), (list{"s-1", "s-2", "s-3"}));
    selection.limit = 2;
    EXPECT_EQ(listed(selection), (list{"s-1", "s-2"}));
    selection = {};
    selection.message_ids = {"s-4", "s-3"};
    EXPECT_EQ(listed(selection), (list{"s-3", "s-4"}));
    const auto letters = this->store().dead_letters(selection);
    ASSERT_EQ(letters.size(), 2u);
    EXPECT_EQ(letters[0].payload, "bytes of s-3");
    EXPECT_EQ(letters[0].scope, "other");
    // Without a destination, entries that record no origin stay as they are.
    const auto nowhere = this->store().redrive(selection, idem::RedriveOptions{});
    EXPECT_EQ(nowhere.count(idem::RedriveStatus::no_destination), 2u);
    EXPECT_TRUE(this->store().outbox_rows().empty());
    // No claim holds these ids (written without one): reported, not redriven.
    const auto report = this->store().redrive(selection, this->to_orders());
    EXPECT_EQ(report.count(idem::RedriveStatus::no_claim), 2u);
    EXPECT_TRUE(this->store().outbox_rows().empty());
}

TYPED_TEST_P(IdemRedriveConformance, ListingWalksEveryEntryPastManyPages) {
    // More entries than a store reads at once (the SQL stores page by 256): every one is found,
    // in order, and the limit stops the walk.
    constexpr int entries = 700;
    {
        auto tx = this->store().begin();
        for (int i = 0; i < entries; ++i) {
            idem::DeadLetter letter;
            letter.scope = i % 2 == 0 ? "even" : "odd";
            letter.message_id = "e-" + std::to_string(i);
            letter.reason = "poison";
            letter.payload = letter.message_id;
            tx.dead_letter(letter);
        }
        tx.commit();
    }
    EXPECT_EQ(this->store().dead_letters().size(), static_cast<std::size_t>(entries));
    idem::DeadLetterSelection odd;
    odd.scope = "odd";
    const auto letters = this->store().dead_letters(odd);
    ASSERT_EQ(letters.size(), static_cast<std::size_t>(entries / 2));
    for (std::size_t i = 0; i < letters.size(); ++i) {
        EXPECT_EQ(letters[i].message_id, "e-" + std::to_string(2 * i + 1));
        if (i > 0) {
            EXPECT_LT(letters[i - 1].id, letters[i].id);
        }
    }
    odd.limit = 300;
    const auto limited = this->store().dead_letters(odd);
    ASSERT_EQ(limited.size(), 300u);
    EXPECT_EQ(limited.back().message_id, "e-599");
    idem::DeadLetterSelection last;
    last.message_ids = {"e-699", "e-0"};
    const auto found = this->store().dead_letters(last);
    ASSERT_EQ(found.size(), 2u);
    EXPECT_EQ(found[0].message_id, "e-0");
    EXPECT_EQ(found[1].message_id, "e-699");
}

TYPED_TEST_P(IdemRedriveConformance, PurgeDeletesOnlyTheSelectedEntriesAndKeepsTheirClaims) {
    auto handler = this->consumer();
    for (const char* id : {"g-1", "g-2", "g-3"})
        this->park(handler, id);
    // A dry run names the entries and deletes nothing.
    const auto would = this->store().purge_dead_letters(this->ids({"g-1", "g-3"}), true);
    ASSERT_EQ(would.size(), 2u);
    EXPECT_EQ(would[0].message_id, "g-1");
    EXPECT_EQ(would[1].message_id, "g-3");
    EXPECT_EQ(this->store().dead_letters().size(), 3u);

    const auto purged = this->store().purge_dead_letters(this->ids({"g-1", "g-3"}));
    ASSERT_EQ(purged.size(), 2u);
    EXPECT_EQ(purged[0].message_id, "g-1");
    const auto left = this->store().dead_letters();
    ASSERT_EQ(left.size(), 1u);
    EXPECT_EQ(left[0].message_id, "g-2");
    // Purged twice: nothing more to delete.
    EXPECT_TRUE(this->store().purge_dead_letters(this->ids({"g-1", "g-3"})).empty());
    // The claims stay: a re-published copy is still answered duplicate, and nothing is left to
    // redrive for the purged ids.
    EXPECT_EQ(this->claim_of("g-1"), idem::Disposition::dead_lettered);
    EXPECT_EQ(handler.handle(idem::Delivery{"g-1", 1u}, std::string("g-1")).disposition,
              idem::Disposition::duplicate);
    EXPECT_TRUE(this->store().redrive(this->ids({"g-1"}), this->to_orders()).entries.empty());
}

TYPED_TEST_P(IdemRedriveConformance, ARateSpacesTheRedrives) {
    auto handler = this->consumer();
    for (const char* id : {"r-1", "r-2", "r-3"})
        this->park(handler, id);
    idem::RedriveOptions options = this->to_orders();
    options.max_per_second = -1;
    EXPECT_THROW(this->store().redrive(this->ids({}), options), idem::usage_error);
    EXPECT_TRUE(this->store().outbox_rows().empty()) << "a refused rate changes nothing";
    // 20 a second: the third entry's transaction starts 100 ms after the first's, or later.
    options.max_per_second = 20;
    const auto started = std::chrono::steady_clock::now();
    const idem::RedriveReport report = this->store().redrive(this->ids({}), options);
    EXPECT_GE(std::chrono::steady_clock::now() - started, std::chrono::milliseconds(100));
    EXPECT_EQ(report.count(idem::RedriveStatus::redriven), 3u);
    EXPECT_EQ(this->store().outbox_rows().size(), 3u);
}

TYPED_TEST_P(IdemRedriveConformance, WithoutADestinationEachMessageGoesBackToItsOrigin) {
    auto handler = this->consumer();
    this->park(handler, "o-1", "orders-in", "1700000000000-0");
    this->park(handler, "o-2", "payments-in", "partition 3 offset 41");
    this->park(handler, "o-3");  // its delivery named no origin
    const auto letters = this->store().dead_letters(this->ids({}));
    ASSERT_EQ(letters.size(), 3u);
    EXPECT_EQ(letters[0].origin, "orders-in");
    EXPECT_EQ(letters[0].origin_position, "1700000000000-0");
    EXPECT_EQ(letters[1].origin, "payments-in");
    EXPECT_EQ(letters[1].origin_position, "partition 3 offset 41");
    EXPECT_EQ(letters[2].origin, "");
    EXPECT_EQ(letters[2].origin_position, "");
    this->fix();

    idem::RedriveOptions back;  // no destination: each to its origin
    back.dry_run = true;
    const idem::RedriveReport judged = this->store().redrive(this->ids({}), back);
    ASSERT_EQ(judged.entries.size(), 3u);
    EXPECT_EQ(judged.entries[0].status, idem::RedriveStatus::redriven);
    EXPECT_EQ(judged.entries[1].status, idem::RedriveStatus::redriven);
    EXPECT_EQ(judged.entries[2].status, idem::RedriveStatus::no_destination);
    EXPECT_TRUE(this->store().outbox_rows().empty()) << "a dry run changes nothing";

    back.dry_run = false;
    const idem::RedriveReport report = this->store().redrive(this->ids({}), back);
    ASSERT_EQ(report.entries.size(), 3u);
    EXPECT_EQ(report.count(idem::RedriveStatus::redriven), 2u);
    EXPECT_EQ(report.entries[2].status, idem::RedriveStatus::no_destination);
    auto rows = this->store().outbox_rows();
    ASSERT_EQ(rows.size(), 2u);
    std::sort(rows.begin(), rows.end(),
              [](const auto& a, const auto& b) { return a.idempotency_key < b.idempotency_key; });
    EXPECT_EQ(rows[0].idempotency_key, "o-1");
    EXPECT_EQ(rows[0].destination, "orders-in");
    EXPECT_EQ(rows[1].idempotency_key, "o-2");
    EXPECT_EQ(rows[1].destination, "payments-in");
    EXPECT_FALSE(this->claim_of("o-1").has_value());
    EXPECT_EQ(this->claim_of("o-3"), idem::Disposition::dead_lettered) << "left parked";

    // Named, the destination goes for every entry, the one without an origin too.
    const auto named = this->store().redrive(this->ids({"o-3"}), this->to_orders());
    ASSERT_EQ(named.entries.size(), 1u);
    EXPECT_EQ(named.entries[0].status, idem::RedriveStatus::redriven);
    EXPECT_EQ(this->store().outbox_rows().size(), 3u);
}

TYPED_TEST_P(IdemRedriveConformance, ADeadLetterSaysHowAndWhenItsEffectFailed) {
    if (!TestFixture::notes_failures) GTEST_SKIP() << "the store has no note_failure()";
    auto handler = this->consumer();  // its effect throws "gateway 503"
    const auto started = this->env.now;
    EXPECT_EQ(handler.handle(idem::Delivery{"f-1", 1u}, std::string("f-1")).disposition,
              idem::Disposition::failed);
    this->env.now = started + std::chrono::minutes(1);
    EXPECT_EQ(handler.handle(idem::Delivery{"f-1", 2u}, std::string("f-1")).disposition,
              idem::Disposition::failed);
    this->env.now = started + std::chrono::minutes(2);
    idem::Outcome parked;
    this->park(handler, "f-1", {}, {}, &parked);
    auto letters = this->store().dead_letters(this->ids({"f-1"}));
    ASSERT_EQ(letters.size(), 1u);
    EXPECT_NE(letters[0].failure.find("gateway 503"), std::string::npos) << letters[0].failure;
    ASSERT_TRUE(letters[0].first_failed_at.has_value());
    EXPECT_EQ(*letters[0].first_failed_at, started);
    ASSERT_TRUE(letters[0].last_failed_at.has_value());
    EXPECT_GE(*letters[0].last_failed_at, started + std::chrono::minutes(1));
    EXPECT_LE(*letters[0].last_failed_at, started + std::chrono::minutes(2));
    // Selected by how it failed: the messages one fault parked.
    idem::DeadLetterSelection by_failure = this->ids({});
    by_failure.failure_contains = "gateway 503";
    EXPECT_EQ(this->store().dead_letters(by_failure).size(), 1u);
    by_failure.failure_contains = "timed out";
    EXPECT_TRUE(this->store().dead_letters(by_failure).empty());
    if (TestFixture::recalls_failures) {
        // The outcome a broker's dead-letter copy is made from says the same, and so does that
        // of a duplicate of the parked message (whose copy the consumer sends again).
        const idem::Outcome duplicate = handler.handle(idem::Delivery{"f-1", 6u}, "f-1");
        EXPECT_TRUE(duplicate.duplicate_of_dead_letter()) << duplicate.reason;
        for (const idem::Outcome* outcome :
             std::vector<const idem::Outcome*>{&parked, &duplicate}) {
            ASSERT_TRUE(outcome->noted_failure.has_value()) << outcome->reason;
            EXPECT_EQ(outcome->noted_failure->text, letters[0].failure);
            EXPECT_EQ(outcome->noted_failure->first, *letters[0].first_failed_at);
            EXPECT_EQ(outcome->noted_failure->last, *letters[0].last_failed_at);
        }
    }

    // Its redrive clears the history: parked again, the new entry keeps none from before.
    ASSERT_EQ(this->store()
                  .redrive(this->ids({"f-1"}), this->to_orders())
                  .count(idem::RedriveStatus::redriven),
              1u);
    this->env.now = started + std::chrono::minutes(10);
    this->park(handler, "f-1");
    letters = this->store().dead_letters(this->ids({"f-1"}));
    ASSERT_EQ(letters.size(), 2u);
    EXPECT_EQ(*letters[0].first_failed_at, started) << "the older entry keeps its history";
    EXPECT_FALSE(letters[1].first_failed_at &&
                 *letters[1].first_failed_at < started + std::chrono::minutes(10));
}

TYPED_TEST_P(IdemRedriveConformance, ABatchNotesEachFailedEffect) {
    if (!TestFixture::notes_failures) GTEST_SKIP() << "the store has no note_failure()";
    auto handler = this->consumer();  // its effect throws "gateway 503"
    const std::vector<idem::Delivery> deliveries{{"b-1", 1u}, {"b-2", 1u}};
    const std::vector<std::string> bodies{"b-1", "b-2"};
    for (const idem::Outcome& outcome : handler.handle_batch(deliveries, bodies))
        EXPECT_EQ(outcome.disposition, idem::Disposition::failed) << outcome.reason;
    this->park(handler, "b-1");
    this->park(handler, "b-2");
    const auto letters = this->store().dead_letters(this->ids({}));
    ASSERT_EQ(letters.size(), 2u);
    for (const idem::DeadLetter& letter : letters) {
        EXPECT_NE(letter.failure.find("gateway 503"), std::string::npos) << letter.message_id;
        ASSERT_TRUE(letter.first_failed_at.has_value()) << letter.message_id;
        EXPECT_EQ(*letter.first_failed_at, this->env.now);
    }
}
