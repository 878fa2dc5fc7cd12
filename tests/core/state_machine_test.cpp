#include "idem/state_machine.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

#include <gtest/gtest.h>

#include "idem/idem.hpp"
#include "idem/store/memory.hpp"
#include "support/backends.hpp"
#if IDEM_HAS_SQLITE
#include "idem/store/sqlite.hpp"
#include "idem/testing/temp_dir.hpp"
#endif

// The enums and their to_string() live in their own namespace so the guard's reasons find the
// names by ADL, as a user's would.
namespace payments {

enum class PaymentState { authorised, captured, refunded, voided };
// chargeback has no transition at all: always impossible.
enum class PaymentEvent { capture, refund, void_, chargeback };

constexpr std::string_view to_string(PaymentState s) noexcept {
    switch (s) {
        case PaymentState::authorised:
            return "authorised";
        case PaymentState::captured:
            return "captured";
        case PaymentState::refunded:
            return "refunded";
        case PaymentState::voided:
            return "voided";
    }
    return "?";
}

// A different return type on purpose: any to_string() a std::string can be built from works.
inline std::string to_string(PaymentEvent e) {
    switch (e) {
        case PaymentEvent::capture:
            return "capture";
        case PaymentEvent::refund:
            return "refund";
        case PaymentEvent::void_:
            return "void";
        case PaymentEvent::chargeback:
            return "chargeback";
    }
    return "?";
}

constexpr idem::StateMachine payment_flow{
    idem::Transition{PaymentState::authorised, PaymentEvent::capture, PaymentState::captured},
    idem::Transition{PaymentState::captured, PaymentEvent::refund, PaymentState::refunded},
    idem::Transition{PaymentState::authorised, PaymentEvent::void_, PaymentState::voided}};

constexpr std::array all_states{PaymentState::authorised, PaymentState::captured,
                                PaymentState::refunded, PaymentState::voided};
constexpr std::array all_events{PaymentEvent::capture, PaymentEvent::refund, PaymentEvent::void_,
                                PaymentEvent::chargeback};

}  // namespace payments

// No to_string(): reasons fall back to the underlying integers. Byte-sized underlying types
// check that the fallback prints numbers, not characters.
namespace doors {
enum class Door : std::uint8_t { closed, open, locked };
enum class DoorEvent : char { open, close, lock, unlock };

// A cycle: closed <-> open, closed <-> locked.
constexpr idem::StateMachine door_flow{
    idem::Transition{Door::closed, DoorEvent::open, Door::open},
    idem::Transition{Door::open, DoorEvent::close, Door::closed},
    idem::Transition{Door::closed, DoorEvent::lock, Door::locked},
    idem::Transition{Door::locked, DoorEvent::unlock, Door::closed}};
}  // namespace doors

// A table with an initial state: `none` is the state of a payment that does not exist yet, and
// authorise (a transition from none) is the event that creates it.
namespace lifecycle {
enum class Payment { none, authorised, captured, refunded, voided };
enum class Event { authorise, capture, refund, void_ };

constexpr std::string_view to_string(Payment s) noexcept {
    switch (s) {
        case Payment::none:
            return "none";
        case Payment::authorised:
            return "authorised";
        case Payment::captured:
            return "captured";
        case Payment::refunded:
            return "refunded";
        case Payment::voided:
            return "voided";
    }
    return "?";
}
constexpr std::string_view to_string(Event e) noexcept {
    switch (e) {
        case Event::authorise:
            return "authorise";
        case Event::capture:
            return "capture";
        case Event::refund:
            return "refund";
        case Event::void_:
            return "void";
    }
    return "?";
}

constexpr idem::StateMachine payment_lifecycle{
    idem::Initial{Payment::none},
    idem::Transition{Payment::none, Event::authorise, Payment::authorised},
    idem::Transition{Payment::authorised, Event::capture, Payment::captured},
    idem::Transition{Payment::captured, Event::refund, Payment::refunded},
    idem::Transition{Payment::authorised, Event::void_, Payment::voided}};

std::optional<Payment> parse(std::string_view text) {
    for (auto s : {Payment::none, Payment::authorised, Payment::captured, Payment::refunded,
                   Payment::voided}) {
        if (to_string(s) == text) return s;
    }
    return std::nullopt;
}
}  // namespace lifecycle

namespace {

using idem::EffectResult;
using idem::Verdict;
using payments::payment_flow;
using payments::PaymentEvent;
using payments::PaymentState;

// ---- compile-time checks: the table and classify() are usable in constant expressions ----

static_assert(std::is_same_v<decltype(payment_flow),
                             const idem::StateMachine<PaymentState, PaymentEvent, 3>>);
static_assert(payment_flow.size() == 3);
static_assert(payment_flow.next(PaymentState::authorised, PaymentEvent::capture) ==
              PaymentState::captured);
static_assert(!payment_flow.next(PaymentState::refunded, PaymentEvent::capture).has_value());
static_assert(payment_flow.reachable(PaymentState::authorised, PaymentState::refunded));
static_assert(!payment_flow.reachable(PaymentState::refunded, PaymentState::authorised));
static_assert(payment_flow.classify(PaymentState::captured, PaymentEvent::refund).verdict ==
              Verdict::allowed);
static_assert(payment_flow.classify(PaymentState::refunded, PaymentEvent::capture).verdict ==
              Verdict::stale);
static_assert(payment_flow.classify(PaymentState::authorised, PaymentEvent::refund).verdict ==
              Verdict::early);
static_assert(payment_flow.classify(PaymentState::voided, PaymentEvent::refund).verdict ==
              Verdict::impossible);
static_assert(doors::door_flow.classify(doors::Door::open, doors::DoorEvent::unlock).verdict ==
              Verdict::early);

constexpr auto payment_flow_made = idem::make_state_machine<PaymentState, PaymentEvent>({
    {PaymentState::authorised, PaymentEvent::capture, PaymentState::captured},
    {PaymentState::captured, PaymentEvent::refund, PaymentState::refunded},
    {PaymentState::authorised, PaymentEvent::void_, PaymentState::voided},
});
// std::array's operator== is constexpr only from C++20.
template <class A, class B>
constexpr bool same_table(const A& a, const B& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i) {
        if (a.transitions()[i] != b.transitions()[i]) return false;
    }
    return true;
}
static_assert(same_table(payment_flow_made, payment_flow));

// An initial state: "no entity yet" classifies as that state.
using lifecycle::payment_lifecycle;
static_assert(!payment_flow.initial().has_value());
static_assert(payment_lifecycle.initial() == lifecycle::Payment::none);
static_assert(payment_lifecycle.size() == 4);
static_assert(payment_lifecycle.classify(lifecycle::Payment::none, lifecycle::Event::authorise)
                  .verdict == Verdict::allowed);
static_assert(payment_lifecycle.classify(lifecycle::Payment::none, lifecycle::Event::capture)
                  .verdict == Verdict::early);
static_assert(payment_lifecycle.classify(lifecycle::Payment::captured, lifecycle::Event::authorise)
                  .verdict == Verdict::stale);
constexpr auto payment_lifecycle_made =
    idem::make_state_machine<lifecycle::Payment, lifecycle::Event>(
        idem::Initial{lifecycle::Payment::none},
        {
            {lifecycle::Payment::none, lifecycle::Event::authorise, lifecycle::Payment::authorised},
            {lifecycle::Payment::authorised, lifecycle::Event::capture,
             lifecycle::Payment::captured},
            {lifecycle::Payment::captured, lifecycle::Event::refund, lifecycle::Payment::refunded},
            {lifecycle::Payment::authorised, lifecycle::Event::void_, lifecycle::Payment::voided},
        });
static_assert(same_table(payment_lifecycle_made, payment_lifecycle));
static_assert(payment_lifecycle_made.initial() == lifecycle::Payment::none);

// ---- StateMachine ----

TEST(StateMachine, NextFollowsTheTable) {
    EXPECT_EQ(payment_flow.next(PaymentState::authorised, PaymentEvent::capture),
              PaymentState::captured);
    EXPECT_EQ(payment_flow.next(PaymentState::captured, PaymentEvent::refund),
              PaymentState::refunded);
    EXPECT_EQ(payment_flow.next(PaymentState::authorised, PaymentEvent::void_),
              PaymentState::voided);
    EXPECT_EQ(payment_flow.next(PaymentState::refunded, PaymentEvent::capture), std::nullopt);
    EXPECT_EQ(payment_flow.next(PaymentState::captured, PaymentEvent::void_), std::nullopt);
    EXPECT_EQ(payment_flow.next(PaymentState::authorised, PaymentEvent::chargeback), std::nullopt);
}

TEST(StateMachine, ClassifiesEveryPaymentCase) {
    struct Case {
        PaymentState current;
        PaymentEvent event;
        Verdict verdict;
    };
    using S = PaymentState;
    using E = PaymentEvent;
    const Case cases[] = {
        {S::authorised, E::capture, Verdict::allowed},
        {S::authorised, E::refund, Verdict::early},  // the capture has not arrived yet
        {S::authorised, E::void_, Verdict::allowed},
        {S::authorised, E::chargeback, Verdict::impossible},
        {S::captured, E::capture, Verdict::stale},  // a second capture
        {S::captured, E::refund, Verdict::allowed},
        {S::captured, E::void_, Verdict::stale},  // past authorised, where a void applies
        {S::captured, E::chargeback, Verdict::impossible},
        {S::refunded, E::capture, Verdict::stale},  // a refunded payment never becomes captured
        {S::refunded, E::refund, Verdict::stale},
        {S::refunded, E::void_, Verdict::stale},
        {S::refunded, E::chargeback, Verdict::impossible},
        {S::voided, E::capture, Verdict::stale},
        {S::voided, E::refund, Verdict::impossible},  // captured is neither behind nor ahead
        {S::voided, E::void_, Verdict::stale},
        {S::voided, E::chargeback, Verdict::impossible},
    };
    for (const auto& c : cases) {
        EXPECT_EQ(payment_flow.classify(c.current, c.event).verdict, c.verdict)
            << to_string(c.current) << " + " << to_string(c.event);
    }
}

TEST(StateMachine, ClassificationCarriesNextAndSource) {
    const auto allowed = payment_flow.classify(PaymentState::captured, PaymentEvent::refund);
    EXPECT_EQ(allowed.next, PaymentState::refunded);
    EXPECT_EQ(allowed.source, PaymentState::captured);

    const auto stale = payment_flow.classify(PaymentState::refunded, PaymentEvent::capture);
    EXPECT_EQ(stale.next, std::nullopt);
    EXPECT_EQ(stale.source, PaymentState::authorised);

    const auto early = payment_flow.classify(PaymentState::authorised, PaymentEvent::refund);
    EXPECT_EQ(early.next, std::nullopt);
    EXPECT_EQ(early.source, PaymentState::captured);

    const auto impossible = payment_flow.classify(PaymentState::voided, PaymentEvent::refund);
    EXPECT_EQ(impossible.next, std::nullopt);
    EXPECT_EQ(impossible.source, std::nullopt);
}

TEST(StateMachine, ReachableIsReflexiveAndTransitive) {
    for (auto s : payments::all_states)
        EXPECT_TRUE(payment_flow.reachable(s, s));
    EXPECT_TRUE(payment_flow.reachable(PaymentState::authorised, PaymentState::captured));
    EXPECT_TRUE(payment_flow.reachable(PaymentState::authorised, PaymentState::refunded));
    EXPECT_TRUE(payment_flow.reachable(PaymentState::authorised, PaymentState::voided));
    EXPECT_FALSE(payment_flow.reachable(PaymentState::captured, PaymentState::voided));
    EXPECT_FALSE(payment_flow.reachable(PaymentState::voided, PaymentState::captured));
    EXPECT_FALSE(payment_flow.reachable(PaymentState::refunded, PaymentState::captured));
}

TEST(StateMachine, HandlesOnlyEventsWithATransition) {
    EXPECT_TRUE(payment_flow.handles(PaymentEvent::capture));
    EXPECT_TRUE(payment_flow.handles(PaymentEvent::void_));
    EXPECT_FALSE(payment_flow.handles(PaymentEvent::chargeback));
}

TEST(StateMachine, DuplicateFromOnWithDifferentTargetsThrows) {
    // Run time: a machine built from data that is not a constant expression.
    const PaymentState target = PaymentState::voided;
    try {
        const idem::StateMachine bad{
            idem::Transition{PaymentState::authorised, PaymentEvent::capture,
                             PaymentState::captured},
            idem::Transition{PaymentState::authorised, PaymentEvent::capture, target}};
        (void)bad;
        FAIL() << "expected idem::usage_error";
    } catch (const idem::usage_error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("authorised"), std::string::npos) << what;
        EXPECT_NE(what.find("capture"), std::string::npos) << what;
        EXPECT_NE(what.find("captured and voided"), std::string::npos) << what;
    }

    using T = idem::Transition<PaymentState, PaymentEvent>;
    const std::array<T, 2> table{
        T{PaymentState::captured, PaymentEvent::refund, target},
        T{PaymentState::captured, PaymentEvent::refund, PaymentState::refunded}};
    EXPECT_THROW(idem::StateMachine{table}, idem::usage_error);
    EXPECT_THROW((void)(idem::make_state_machine<PaymentState, PaymentEvent>(
                     {{PaymentState::captured, PaymentEvent::refund, target},
                      {PaymentState::captured, PaymentEvent::refund, PaymentState::refunded}})),
                 idem::usage_error);
}

TEST(StateMachine, InitialStateWithoutATransitionFromItThrows) {
    using lifecycle::Event;
    using lifecycle::Payment;
    const auto build = [] {
        return idem::StateMachine{
            idem::Initial{Payment::none},
            idem::Transition{Payment::authorised, Event::capture, Payment::captured}};
    };
    try {
        (void)build();
        FAIL() << "expected usage_error";
    } catch (const idem::usage_error& e) {
        EXPECT_TRUE(std::string_view(e.what()).find("initial state none has no transition") !=
                    std::string_view::npos)
            << e.what();
    }
    const std::array<idem::Transition<Payment, Event>, 1> rows{
        {{Payment::none, Event::authorise, Payment::authorised}}};
    EXPECT_EQ(idem::StateMachine(idem::Initial{Payment::none}, rows).initial(), Payment::none);
}

TEST(StateMachine, IdenticalDuplicateIsAccepted) {
    constexpr idem::StateMachine twice{
        idem::Transition{PaymentState::authorised, PaymentEvent::capture, PaymentState::captured},
        idem::Transition{PaymentState::authorised, PaymentEvent::capture, PaymentState::captured}};
    static_assert(twice.size() == 2);
    EXPECT_EQ(twice.next(PaymentState::authorised, PaymentEvent::capture), PaymentState::captured);
}

TEST(StateMachine, CyclicMachineClassifiesBothWaysReachableAsEarly) {
    using doors::Door;
    using doors::DoorEvent;
    const auto& flow = doors::door_flow;
    EXPECT_TRUE(flow.reachable(Door::open, Door::locked));
    EXPECT_TRUE(flow.reachable(Door::locked, Door::open));
    // open -> closed -> locked and locked -> closed -> open: both directions, so early.
    EXPECT_EQ(flow.classify(Door::open, DoorEvent::unlock).verdict, Verdict::early);
    EXPECT_EQ(flow.classify(Door::open, DoorEvent::lock).verdict, Verdict::early);
    EXPECT_EQ(flow.classify(Door::locked, DoorEvent::close).verdict, Verdict::early);
    EXPECT_EQ(flow.classify(Door::closed, DoorEvent::lock).verdict, Verdict::allowed);
    EXPECT_EQ(flow.classify(Door::closed, DoorEvent::lock).next, Door::locked);
}

TEST(StateMachine, VerdictNames) {
    EXPECT_EQ(idem::to_string(Verdict::allowed), "allowed");
    EXPECT_EQ(idem::to_string(Verdict::stale), "stale");
    EXPECT_EQ(idem::to_string(Verdict::early), "early");
    EXPECT_EQ(idem::to_string(Verdict::impossible), "impossible");
}

// ---- guarded() ----

// An in-memory stand-in for a store transaction: just the payments table.
struct FakeTx {
    std::map<int, PaymentState> payments;
};

struct PaymentMessage {
    int payment_id = 0;
    PaymentEvent event = PaymentEvent::capture;
};

std::optional<PaymentState> load_state(const FakeTx& tx, int id) {
    const auto it = tx.payments.find(id);
    if (it == tx.payments.end()) return std::nullopt;
    return it->second;
}

// A guarded effect that counts how often apply ran.
auto make_payment_effect(int& applied) {
    return idem::guarded(
               payment_flow,
               [](auto& tx, const PaymentMessage& m) { return load_state(tx, m.payment_id); },
               [&applied](auto& tx, const PaymentMessage& m, PaymentState next) {
                   ++applied;
                   tx.payments[m.payment_id] = next;
               })
        .named("payment");
}

bool contains(const std::string& text, std::string_view part) {
    return text.find(part) != std::string::npos;
}

TEST(Guarded, RefundThenStaleCaptureStaysRefunded) {
    int applied = 0;
    auto effect = make_payment_effect(applied);
    FakeTx tx{{{7, PaymentState::captured}}};

    const auto refund = effect(tx, PaymentMessage{7, PaymentEvent::refund});
    EXPECT_EQ(refund.kind(), EffectResult::Kind::applied);
    EXPECT_EQ(tx.payments[7], PaymentState::refunded);

    const auto capture = effect(tx, PaymentMessage{7, PaymentEvent::capture});
    EXPECT_EQ(capture.kind(), EffectResult::Kind::rejected);
    EXPECT_EQ(capture.reason(),
              "stale event capture: payment is refunded, already past authorised");
    EXPECT_TRUE(contains(capture.reason(), "stale"));
    EXPECT_EQ(tx.payments[7], PaymentState::refunded);
    EXPECT_EQ(applied, 1);
}

TEST(Guarded, RefundBeforeCaptureIsDeferredAndAppliesAfterIt) {
    int applied = 0;
    auto effect = make_payment_effect(applied);
    FakeTx tx{{{8, PaymentState::authorised}}};

    const auto early = effect(tx, PaymentMessage{8, PaymentEvent::refund});
    EXPECT_EQ(early.kind(), EffectResult::Kind::deferred);
    EXPECT_EQ(early.reason(),
              "early event refund: payment is authorised, the event applies from captured, not "
              "reached yet");
    EXPECT_EQ(applied, 0);
    EXPECT_EQ(tx.payments[8], PaymentState::authorised);

    // The capture arrives, then the broker redelivers the refund.
    EXPECT_EQ(effect(tx, PaymentMessage{8, PaymentEvent::capture}).kind(),
              EffectResult::Kind::applied);
    EXPECT_EQ(effect(tx, PaymentMessage{8, PaymentEvent::refund}).kind(),
              EffectResult::Kind::applied);
    EXPECT_EQ(tx.payments[8], PaymentState::refunded);
    EXPECT_EQ(applied, 2);
}

TEST(Guarded, UnknownEntityIsDeferred) {
    int applied = 0;
    auto effect = make_payment_effect(applied);
    FakeTx tx;
    const auto result = effect(tx, PaymentMessage{9, PaymentEvent::capture});
    EXPECT_EQ(result.kind(), EffectResult::Kind::deferred);
    EXPECT_TRUE(contains(result.reason(), "payment not found yet")) << result.reason();
    EXPECT_TRUE(contains(result.reason(), "capture")) << result.reason();
    EXPECT_EQ(applied, 0);
    EXPECT_TRUE(tx.payments.empty());
}

// ---- guarded() with an initial state: the event that creates the entity ----

struct LifecycleTx {
    std::map<int, lifecycle::Payment> payments;
};
struct LifecycleMessage {
    int payment_id = 0;
    lifecycle::Event event = lifecycle::Event::authorise;
};

// What a dead letter of this message keeps (found by ADL).
std::string idem_payload(const LifecycleMessage& m) {
    return std::to_string(m.payment_id) + ":" + std::to_string(static_cast<int>(m.event));
}

auto make_lifecycle_effect(int& applied) {
    return idem::guarded(
               payment_lifecycle,
               [](LifecycleTx& tx, const LifecycleMessage& m) -> std::optional<lifecycle::Payment> {
                   const auto it = tx.payments.find(m.payment_id);
                   if (it == tx.payments.end()) return std::nullopt;
                   return it->second;
               },
               [&applied](LifecycleTx& tx, const LifecycleMessage& m, lifecycle::Payment next) {
                   ++applied;
                   tx.payments[m.payment_id] = next;
               })
        .named("payment");
}

TEST(Guarded, CreationEventOnAnAbsentEntityIsAppliedAndWritesTheFirstState) {
    int applied = 0;
    auto effect = make_lifecycle_effect(applied);
    LifecycleTx tx;
    const auto result = effect(tx, LifecycleMessage{5, lifecycle::Event::authorise});
    EXPECT_EQ(result.kind(), EffectResult::Kind::applied) << result.reason();
    EXPECT_EQ(applied, 1);
    ASSERT_EQ(tx.payments.count(5), 1U);
    EXPECT_EQ(tx.payments.at(5), lifecycle::Payment::authorised);
}

TEST(Guarded, NonCreationEventOnAnAbsentEntityIsStillDeferred) {
    int applied = 0;
    auto effect = make_lifecycle_effect(applied);
    LifecycleTx tx;
    for (auto event :
         {lifecycle::Event::capture, lifecycle::Event::refund, lifecycle::Event::void_}) {
        const auto result = effect(tx, LifecycleMessage{6, event});
        EXPECT_EQ(result.kind(), EffectResult::Kind::deferred) << result.reason();
        EXPECT_TRUE(contains(result.reason(), "payment not found yet")) << result.reason();
    }
    EXPECT_EQ(effect(tx, LifecycleMessage{6, lifecycle::Event::capture}).reason(),
              "payment not found yet: event capture deferred until it exists (it applies from "
              "authorised)");
    EXPECT_EQ(applied, 0);
    EXPECT_TRUE(tx.payments.empty());
}

TEST(Guarded, SecondCreationEventAfterTheEntityExistsIsStale) {
    int applied = 0;
    auto effect = make_lifecycle_effect(applied);
    LifecycleTx tx;
    ASSERT_EQ(effect(tx, LifecycleMessage{7, lifecycle::Event::authorise}).kind(),
              EffectResult::Kind::applied);
    const auto again = effect(tx, LifecycleMessage{7, lifecycle::Event::authorise});
    EXPECT_EQ(again.kind(), EffectResult::Kind::rejected);
    EXPECT_EQ(again.reason(), "stale event authorise: payment is authorised, already past none");
    ASSERT_EQ(effect(tx, LifecycleMessage{7, lifecycle::Event::capture}).kind(),
              EffectResult::Kind::applied);
    EXPECT_EQ(effect(tx, LifecycleMessage{7, lifecycle::Event::authorise}).kind(),
              EffectResult::Kind::rejected);
    EXPECT_EQ(tx.payments.at(7), lifecycle::Payment::captured);
    EXPECT_EQ(applied, 2);
}

// Every event on an absent entity classifies as if the entity were in the initial state, and
// apply runs only for the creation event.
TEST(Guarded, AbsentEntityClassifiesAsTheInitialStateForEveryEvent) {
    for (auto event : {lifecycle::Event::authorise, lifecycle::Event::capture,
                       lifecycle::Event::refund, lifecycle::Event::void_}) {
        int applied = 0;
        auto effect = make_lifecycle_effect(applied);
        LifecycleTx tx;
        const auto result = effect(tx, LifecycleMessage{1, event});
        const auto verdict = payment_lifecycle.classify(lifecycle::Payment::none, event).verdict;
        SCOPED_TRACE(std::string(to_string(event)));
        EXPECT_EQ(applied, verdict == Verdict::allowed ? 1 : 0);
        EXPECT_EQ(result.kind(), verdict == Verdict::allowed ? EffectResult::Kind::applied
                                                             : EffectResult::Kind::deferred);
    }
}

TEST(Guarded, AnEventThatCanNeverFollowTheInitialStateIsRejected) {
    // `orphan` leaves a state that nothing reaches from none: no amount of waiting helps.
    enum class S { none, open, orphan, closed };
    enum class E { open, close };
    constexpr idem::StateMachine flow{idem::Initial{S::none},
                                      idem::Transition{S::none, E::open, S::open},
                                      idem::Transition{S::orphan, E::close, S::closed}};
    struct Tx {
        std::optional<S> s;
    };
    struct Msg {
        E event;
    };
    auto effect = idem::guarded(
        flow, [](Tx& tx, const Msg&) { return tx.s; },
        [](Tx& tx, const Msg&, S next) { tx.s = next; });
    Tx tx;
    const auto result = effect(tx, Msg{E::close});
    EXPECT_EQ(result.kind(), EffectResult::Kind::rejected);
    EXPECT_EQ(result.reason(),
              "impossible transition: event 1 does not apply to the entity, which does not "
              "exist yet (state 0), nor can it later");
    EXPECT_FALSE(tx.s.has_value());
}

TEST(Guarded, ImpossibleTransitionsAreRejectedWithTheirReason) {
    int applied = 0;
    auto effect = make_payment_effect(applied);
    FakeTx tx{{{1, PaymentState::voided}, {2, PaymentState::authorised}}};

    const auto refund = effect(tx, PaymentMessage{1, PaymentEvent::refund});
    EXPECT_EQ(refund.kind(), EffectResult::Kind::rejected);
    EXPECT_EQ(refund.reason(),
              "impossible transition: event refund does not apply to payment in voided, nor can "
              "it later");

    const auto chargeback = effect(tx, PaymentMessage{2, PaymentEvent::chargeback});
    EXPECT_EQ(chargeback.kind(), EffectResult::Kind::rejected);
    EXPECT_EQ(chargeback.reason(),
              "impossible transition: event chargeback has no transition in the table");
    EXPECT_EQ(applied, 0);
}

TEST(Guarded, ApplyResultPassesThrough) {
    auto effect = idem::guarded(
        payment_flow,
        [](auto& tx, const PaymentMessage& m) { return load_state(tx, m.payment_id); },
        [](auto&, const PaymentMessage& m, PaymentState) {
            // The gateway answered; nothing is written in either case.
            if (m.payment_id == 1) return EffectResult::rejected("gateway declined the capture");
            return EffectResult::deferred("gateway busy");
        });
    FakeTx tx{{{1, PaymentState::authorised}, {2, PaymentState::authorised}}};

    const auto declined = effect(tx, PaymentMessage{1, PaymentEvent::capture});
    EXPECT_EQ(declined.kind(), EffectResult::Kind::rejected);
    EXPECT_EQ(declined.reason(), "gateway declined the capture");

    const auto busy = effect(tx, PaymentMessage{2, PaymentEvent::capture});
    EXPECT_EQ(busy.kind(), EffectResult::Kind::deferred);
    EXPECT_EQ(busy.reason(), "gateway busy");
    EXPECT_EQ(tx.payments[1], PaymentState::authorised);
}

TEST(Guarded, ApplyExceptionsPropagateToTheHandler) {
    // The handler turns an exception into `failed` and rolls the transaction back.
    auto effect = idem::guarded(
        payment_flow,
        [](auto& tx, const PaymentMessage& m) { return load_state(tx, m.payment_id); },
        [](auto&, const PaymentMessage&, PaymentState) -> void {
            throw std::runtime_error("gateway timeout");
        });
    FakeTx tx{{{1, PaymentState::authorised}}};
    EXPECT_THROW(effect(tx, PaymentMessage{1, PaymentEvent::capture}), std::runtime_error);
}

// Every (state, event) pair: apply runs exactly when next() has a value, and the state after is
// next(state, event) or unchanged. In particular a refunded payment never becomes captured.
TEST(Guarded, ExhaustiveOverAllStateEventPairs) {
    for (auto state : payments::all_states) {
        for (auto event : payments::all_events) {
            int applied = 0;
            auto effect = make_payment_effect(applied);
            FakeTx tx{{{1, state}}};
            const auto result = effect(tx, PaymentMessage{1, event});
            const auto next = payment_flow.next(state, event);
            const auto verdict = payment_flow.classify(state, event).verdict;
            SCOPED_TRACE(std::string(to_string(state)) + " + " + to_string(event));

            EXPECT_EQ(applied, next ? 1 : 0);
            EXPECT_EQ(tx.payments.at(1), next.value_or(state));
            switch (verdict) {
                case Verdict::allowed:
                    EXPECT_EQ(result.kind(), EffectResult::Kind::applied);
                    break;
                case Verdict::early:
                    EXPECT_EQ(result.kind(), EffectResult::Kind::deferred);
                    EXPECT_TRUE(contains(result.reason(), "early")) << result.reason();
                    break;
                case Verdict::stale:
                    EXPECT_EQ(result.kind(), EffectResult::Kind::rejected);
                    EXPECT_TRUE(contains(result.reason(), "stale")) << result.reason();
                    break;
                case Verdict::impossible:
                    EXPECT_EQ(result.kind(), EffectResult::Kind::rejected);
                    EXPECT_TRUE(contains(result.reason(), "impossible")) << result.reason();
                    break;
            }
            if (state == PaymentState::refunded) {
                EXPECT_EQ(tx.payments.at(1), PaymentState::refunded);
            }
        }
    }
}

TEST(Guarded, ReasonsFallBackToIntegersWithoutToString) {
    using doors::Door;
    using doors::DoorEvent;
    struct DoorMessage {
        DoorEvent event;
    };
    struct DoorTx {
        std::optional<Door> door;
    };
    auto effect = idem::guarded(
        doors::door_flow, [](DoorTx& tx, const DoorMessage&) { return tx.door; },
        [](DoorTx& tx, const DoorMessage&, Door next) { tx.door = next; });

    DoorTx tx{Door::open};
    const auto early = effect(tx, DoorMessage{DoorEvent::unlock});
    EXPECT_EQ(early.kind(), EffectResult::Kind::deferred);
    EXPECT_EQ(early.reason(),
              "early event 3: entity is state 1, the event applies from state 2, not "
              "reached yet");

    DoorTx missing{};
    EXPECT_EQ(effect(missing, DoorMessage{DoorEvent::open}).reason(),
              "entity not found yet: event 0 deferred until it exists");
}

TEST(Guarded, EventOfAndPlainStateOverload) {
    // A message whose event is not a member named `event`, and a state_of that returns the
    // state itself (the entity always exists).
    struct Envelope {
        int id;
        int type;
    };
    auto effect = idem::guarded(
        payment_flow, [](const Envelope& e) { return static_cast<PaymentEvent>(e.type); },
        [](FakeTx& tx, const Envelope& e) { return tx.payments.at(e.id); },
        [](FakeTx& tx, const Envelope& e, PaymentState next) { tx.payments[e.id] = next; });
    FakeTx tx{{{3, PaymentState::authorised}}};

    EXPECT_EQ(effect(tx, Envelope{3, static_cast<int>(PaymentEvent::void_)}).kind(),
              EffectResult::Kind::applied);
    EXPECT_EQ(tx.payments[3], PaymentState::voided);
    const auto late = effect(tx, Envelope{3, static_cast<int>(PaymentEvent::capture)});
    EXPECT_EQ(late.kind(), EffectResult::Kind::rejected);
    EXPECT_EQ(late.reason(), "stale event capture: entity is voided, already past authorised");
}

TEST(Guarded, ConstEffectAndMutableApply) {
    // A const effect (stored as a const member) and a mutable apply both work.
    const auto const_effect = idem::guarded(
        payment_flow,
        [](auto& tx, const PaymentMessage& m) { return load_state(tx, m.payment_id); },
        [](auto& tx, const PaymentMessage& m, PaymentState next) {
            tx.payments[m.payment_id] = next;
        });
    FakeTx tx{{{1, PaymentState::authorised}, {2, PaymentState::authorised}}};
    EXPECT_EQ(const_effect(tx, PaymentMessage{1, PaymentEvent::capture}).kind(),
              EffectResult::Kind::applied);

    auto counting = idem::guarded(
        payment_flow,
        [](auto& tx, const PaymentMessage& m) { return load_state(tx, m.payment_id); },
        [calls = 0](auto& tx, const PaymentMessage& m, PaymentState next) mutable {
            ++calls;
            tx.payments[m.payment_id] = next;
            return calls == 1 ? EffectResult::applied() : EffectResult::rejected("twice");
        });
    EXPECT_EQ(counting(tx, PaymentMessage{2, PaymentEvent::capture}).kind(),
              EffectResult::Kind::applied);
    EXPECT_EQ(counting(tx, PaymentMessage{2, PaymentEvent::refund}).kind(),
              EffectResult::Kind::rejected);
}

// ---- the creation event through a real handler ----

// The handler flow shared by both stores: a capture before the payment exists is deferred, the
// authorisation creates it, a second authorisation (another message id) is stale, the redelivered
// capture then applies. `state()` reads the committed state ("" when absent).
template <class Store, class Effect, class State>
void expect_creation_through_the_handler(Store& store, Effect effect, State state) {
    using idem::Delivery;
    using idem::Disposition;
    using lifecycle::Event;
    auto handler = idem::make_handler(store, idem::Policy{"payment-events"}, std::move(effect));

    const auto early =
        handler.handle(Delivery{"evt-capture", 1u}, LifecycleMessage{42, Event::capture});
    EXPECT_EQ(early.disposition, Disposition::deferred) << early.reason;
    EXPECT_FALSE(idem::should_ack(early));
    EXPECT_EQ(state(), "");
    EXPECT_FALSE(store.find_claim("payment-events", "evt-capture").has_value());

    const auto created =
        handler.handle(Delivery{"evt-auth", 1u}, LifecycleMessage{42, Event::authorise});
    EXPECT_EQ(created.disposition, Disposition::processed) << created.reason;
    EXPECT_EQ(state(), "authorised");

    const auto duplicate =
        handler.handle(Delivery{"evt-auth", 2u}, LifecycleMessage{42, Event::authorise});
    EXPECT_EQ(duplicate.disposition, Disposition::duplicate);

    const auto second =
        handler.handle(Delivery{"evt-auth-again", 1u}, LifecycleMessage{42, Event::authorise});
    EXPECT_EQ(second.disposition, Disposition::rejected);
    EXPECT_TRUE(idem::should_ack(second));
    EXPECT_EQ(second.reason, "stale event authorise: payment is authorised, already past none");
    const auto claim = store.find_claim("payment-events", "evt-auth-again");
    ASSERT_TRUE(claim.has_value());
    EXPECT_EQ(claim->disposition, Disposition::rejected);
    EXPECT_EQ(state(), "authorised");

    const auto captured =
        handler.handle(Delivery{"evt-capture", 2u}, LifecycleMessage{42, Event::capture});
    EXPECT_EQ(captured.disposition, Disposition::processed) << captured.reason;
    EXPECT_EQ(state(), "captured");
}

TEST(GuardedHandler, CreationEventOnMemoryStore) {
    idem::MemoryStore store;
    auto effect = idem::guarded(
                      payment_lifecycle,
                      [](auto& tx, const LifecycleMessage& m) -> std::optional<lifecycle::Payment> {
                          const auto text = tx.get("payments", std::to_string(m.payment_id));
                          if (!text) return std::nullopt;
                          return lifecycle::parse(*text);
                      },
                      [](auto& tx, const LifecycleMessage& m, lifecycle::Payment next) {
                          tx.put("payments", std::to_string(m.payment_id), to_string(next));
                      })
                      .named("payment");
    expect_creation_through_the_handler(store, effect,
                                        [&] { return store.get("payments", "42").value_or(""); });
}

#if IDEM_HAS_SQLITE
TEST(GuardedHandler, CreationEventOnSqliteStore) {
    idem::testing::TempDir dir;
    idem::SqliteStore store{dir.file("payments.db")};
    store.execute("CREATE TABLE payments(id INTEGER PRIMARY KEY, state TEXT NOT NULL)");
    auto effect = idem::guarded(
                      payment_lifecycle,
                      [](auto& tx, const LifecycleMessage& m) -> std::optional<lifecycle::Payment> {
                          const auto text = tx.query_text("SELECT state FROM payments WHERE id = ?",
                                                          m.payment_id);
                          if (!text) return std::nullopt;
                          return lifecycle::parse(*text);
                      },
                      [](auto& tx, const LifecycleMessage& m, lifecycle::Payment next) {
                          // The creation event inserts the row; the others update it.
                          tx.execute(
                              "INSERT INTO payments(id, state) VALUES (?, ?) "
                              "ON CONFLICT(id) DO UPDATE SET state = excluded.state",
                              m.payment_id, std::string(to_string(next)));
                      })
                      .named("payment");
    expect_creation_through_the_handler(store, effect, [&] {
        return store.query_text("SELECT state FROM payments WHERE id = 42").value_or("");
    });
}
#endif  // IDEM_HAS_SQLITE

}  // namespace
