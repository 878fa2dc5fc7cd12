#pragma once
/// @file
/// @brief A constexpr transition table (StateMachine) and guarded(), which turns it into an
/// effect that refuses stale and impossible events and defers early ones.
///
/// A table may declare an initial state (`idem::Initial{State::none}` before its rows): an entity
/// that does not exist yet is then in that state, so the event that creates it (a transition
/// from the initial state) is applied, and any other event for it is deferred until it exists.
///
/// Idempotency does not give ordering: a refund can arrive before the capture it undoes, or a
/// capture after the payment was refunded. The guard reads the entity's state inside the claim's
/// transaction and applies only transitions the table allows, so out-of-order delivery becomes a
/// logged refusal instead of a refunded payment marked as captured.
///
/// @code
/// constexpr idem::StateMachine payment_flow{
///     idem::Initial{PaymentState::none},  // optional: "no payment yet" is `none`
///     idem::Transition{PaymentState::none, PaymentEvent::authorise, PaymentState::authorised},
///     idem::Transition{PaymentState::authorised, PaymentEvent::capture, PaymentState::captured},
///     idem::Transition{PaymentState::captured, PaymentEvent::refund, PaymentState::refunded},
///     idem::Transition{PaymentState::authorised, PaymentEvent::void_, PaymentState::voided}};
///
/// // PaymentMessage has a public `event` member; state_of returns std::optional<PaymentState>,
/// // empty while the payment does not exist (treated as the initial state `none`).
/// auto effect = idem::guarded(
///     payment_flow,
///     [](auto& tx, const PaymentMessage& m) { return load_state(tx, m.payment_id); },
///     [](auto& tx, const PaymentMessage& m, PaymentState next) {
///         upsert_state(tx, m.payment_id, next);   // authorise inserts the row
///     }).named("payment");
/// @endcode

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/detail/traits.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief One row of a transition table: in state `from`, event `on` leads to state `to`.
template <class State, class Event>
struct Transition {
    State from;  ///< the state the entity is in
    Event on;    ///< the event
    State to;    ///< the state the event leads to

    /// Equal when from, on and to are.
    friend constexpr bool operator==(const Transition& a, const Transition& b) noexcept {
        return a.from == b.from && a.on == b.on && a.to == b.to;
    }
    /// Different when from, on or to is.
    friend constexpr bool operator!=(const Transition& a, const Transition& b) noexcept {
        return !(a == b);
    }
};

/// Lets `idem::Transition{State::a, Event::e, State::b}` deduce its types in C++17, where
/// aggregates have no implicit deduction.
template <class State, class Event>
Transition(State, Event, State) -> Transition<State, Event>;

/// @brief Declares a StateMachine's initial state: the state of an entity that does not exist
/// yet. Put it before the table's rows: `StateMachine{idem::Initial{State::none}, rows...}`.
///
/// guarded() treats an empty `state_of` answer as this state, so the event that creates the
/// entity (a row `{State::none, Event::create, State::created}`) is allowed, a later event for
/// an entity that does not exist yet is early (deferred), and a second creation event once the
/// entity exists is stale (rejected). The initial state is usually a value of the State enum
/// that no stored entity has (`none`); the table must have a transition from it.
template <class State>
struct Initial {
    State state;  ///< the state of an entity that does not exist yet
};

/// Lets `idem::Initial{State::none}` deduce its type in C++17.
template <class State>
Initial(State) -> Initial<State>;

/// @brief How an event relates to an entity's current state. See StateMachine::classify().
enum class Verdict {
    allowed,     ///< the table has a transition from the current state on this event
    stale,       ///< the entity is already past the event's source state: reject and ack
    early,       ///< the event's source state is still ahead: defer, the broker redelivers
    impossible,  ///< neither, or the event has no transition at all: reject and ack
};

/// @brief Name of a verdict, for logs.
[[nodiscard]] constexpr std::string_view to_string(Verdict v) noexcept {
    switch (v) {
        case Verdict::allowed:
            return "allowed";
        case Verdict::stale:
            return "stale";
        case Verdict::early:
            return "early";
        case Verdict::impossible:
            return "impossible";
    }
    return "unknown";
}

/// @brief The answer of StateMachine::classify().
template <class State>
struct Classification {
    Verdict verdict = Verdict::impossible;  ///< how the event relates to the state
    /// The state to write: set only when the verdict is allowed.
    std::optional<State> next{};
    /// The event's source state the verdict refers to: the current state when allowed, the
    /// source already passed when stale, the source still ahead when early; empty when
    /// impossible.
    std::optional<State> source{};
};

namespace detail {

template <class T, class = void>
struct has_adl_to_string : std::false_type {};
// Unqualified on purpose: a to_string() declared next to the user's enum is found by ADL.
template <class T>
struct has_adl_to_string<T, std::void_t<decltype(to_string(std::declval<const T&>()))>>
    : std::is_constructible<std::string, decltype(to_string(std::declval<const T&>()))> {};

/// A state or event as reasons print it: the user's to_string() if ADL finds one, else
/// "<kind> <integer>" so that a reason always identifies the value.
template <class T>
[[nodiscard]] std::string name_of(const T& value, std::string_view kind) {
    if constexpr (has_adl_to_string<T>::value) {
        return std::string(to_string(value));
    } else if constexpr (std::is_enum_v<T>) {
        // Unary + so an enum based on char / uint8_t prints as a number, not a character.
        return fmt::format("{} {}", kind, +static_cast<std::underlying_type_t<T>>(value));
    } else {
        return fmt::format("{} {}", kind, +value);
    }
}

/// An event as the subject of a reason: "event capture", or "event 3" without a to_string().
template <class Event>
[[nodiscard]] std::string event_label(const Event& event) {
    if constexpr (has_adl_to_string<Event>::value) {
        return fmt::format("event {}", name_of(event, "event"));
    } else {
        return name_of(event, "event");
    }
}

/// Not constexpr on purpose: reaching it while building a constexpr StateMachine makes the
/// initialisation not a constant expression, and the compiler's error names this function.
template <class State, class Event>
[[noreturn]] void duplicate_transition_with_different_targets(State from, Event on, State a,
                                                              State b) {
    throw usage_error(fmt::format(
        "idem::StateMachine: two transitions from {} on {} lead to different states ({} and "
        "{}); a transition table must name one target per (from, on) pair",
        name_of(from, "state"), name_of(on, "event"), name_of(a, "state"), name_of(b, "state")));
}

/// Not constexpr on purpose, like duplicate_transition_with_different_targets().
template <class State>
[[noreturn]] void initial_state_without_transition(State initial) {
    throw usage_error(fmt::format(
        "idem::StateMachine: the initial state {} has no transition from it, so no event could "
        "create an entity; add the creation event's row ({{{}, <event>, <state>}}) or drop "
        "idem::Initial",
        name_of(initial, "state"), name_of(initial, "state")));
}

}  // namespace detail

/// @brief A constexpr transition table of N transitions over enum (or integer) states and events.
///
/// Build it with CTAD or make_state_machine(). A table where the same (from, on) pair leads to
/// two different states is refused: a compile error for a constexpr machine, usage_error at run
/// time. The same transition listed twice is harmless and accepted.
///
/// An optional initial state (idem::Initial, first argument) is the state of an entity that does
/// not exist yet; guarded() uses it when `state_of` answers std::nullopt. Without one such an
/// entity's events are all deferred. A declared initial state without a transition from it is
/// refused like a duplicate.
///
/// @code
/// constexpr idem::StateMachine flow{
///     idem::Initial{State::none},
///     idem::Transition{State::none, Event::authorise, State::authorised},
///     idem::Transition{State::authorised, Event::capture, State::captured},
///     idem::Transition{State::captured, Event::refund, State::refunded}};
/// static_assert(flow.classify(State::refunded, Event::capture).verdict == idem::Verdict::stale);
/// static_assert(flow.classify(*flow.initial(), Event::capture).verdict == idem::Verdict::early);
/// @endcode
template <class State, class Event, std::size_t N>
class StateMachine {
    static_assert(std::is_enum_v<State> || std::is_integral_v<State>,
                  "idem::StateMachine: State must be an enum (or an integer type)");
    static_assert(std::is_enum_v<Event> || std::is_integral_v<Event>,
                  "idem::StateMachine: Event must be an enum (or an integer type)");

  public:
    using state_type = State;                          ///< the entity's states
    using event_type = Event;                          ///< the events
    using transition_type = Transition<State, Event>;  ///< a row of the table

    /// @brief Builds the table from N transitions.
    /// @throws usage_error when one (from, on) pair leads to two different states.
    template <class... Ts,
              std::enable_if_t<sizeof...(Ts) == N &&
                                   (std::is_convertible_v<const Ts&, transition_type> && ...),
                               int> = 0>
    constexpr StateMachine(const Ts&... transitions)  // NOLINT: braces read as the table
        : table_{{static_cast<transition_type>(transitions)...}} {
        validate();
    }

    /// @brief Builds the table from an array of transitions.
    /// @throws usage_error when one (from, on) pair leads to two different states.
    constexpr explicit StateMachine(const std::array<transition_type, N>& table) : table_(table) {
        validate();
    }

    /// @brief Builds the table from an initial state and N transitions.
    /// @throws usage_error when one (from, on) pair leads to two different states, or when no
    /// transition leaves the initial state.
    template <class... Ts,
              std::enable_if_t<sizeof...(Ts) == N &&
                                   (std::is_convertible_v<const Ts&, transition_type> && ...),
                               int> = 0>
    constexpr StateMachine(Initial<State> initial,  // NOLINT: braces read as the table
                           const Ts&... transitions)
        : table_{{static_cast<transition_type>(transitions)...}}, initial_(initial.state) {
        validate();
    }

    /// @brief Builds the table from an initial state and an array of transitions.
    /// @throws usage_error as the constructor above.
    constexpr StateMachine(Initial<State> initial, const std::array<transition_type, N>& table)
        : table_(table), initial_(initial.state) {
        validate();
    }

    /// The number of transitions in the table.
    [[nodiscard]] static constexpr std::size_t size() noexcept { return N; }
    /// @brief The state of an entity that does not exist yet, if the table declares one.
    [[nodiscard]] constexpr std::optional<State> initial() const noexcept { return initial_; }
    /// The table's rows, in the order given.
    [[nodiscard]] constexpr const std::array<transition_type, N>& transitions() const noexcept {
        return table_;
    }

    /// @brief The state `event` leads to from `state`, or empty when the table has no such row.
    [[nodiscard]] constexpr std::optional<State> next(State state, Event event) const noexcept {
        for (const auto& t : table_) {
            if (t.from == state && t.on == event) return t.to;
        }
        return std::nullopt;
    }

    /// @brief True when `to` can be reached from `from` by zero or more transitions.
    [[nodiscard]] constexpr bool reachable(State from, State to) const noexcept {
        if (from == to) return true;
        // Depth-first over transitions: each row is pushed at most once, so cycles terminate.
        std::array<bool, N> seen{};
        std::array<std::size_t, N> stack{};
        std::size_t depth = 0;
        for (std::size_t i = 0; i < N; ++i) {
            if (table_[i].from == from) {
                seen[i] = true;
                stack[depth++] = i;
            }
        }
        while (depth > 0) {
            const State reached = table_[stack[--depth]].to;
            if (reached == to) return true;
            for (std::size_t j = 0; j < N; ++j) {
                if (!seen[j] && table_[j].from == reached) {
                    seen[j] = true;
                    stack[depth++] = j;
                }
            }
        }
        return false;
    }

    /// @brief Classifies `event` against the entity's `current` state.
    ///
    /// - allowed: the table has (current, event); `next` is the state to write.
    /// - early: some source state of `event` is reachable from `current`: the event's predecessor
    ///   has not arrived yet, so waiting can make it apply.
    /// - stale: `current` is reachable from a source state of `event`: the entity has moved past
    ///   the point where the event applies, and waiting cannot help.
    /// - impossible: neither, or no transition is triggered by `event` at all.
    ///
    /// Early wins when both hold, which happens with cycles (or with an event that has several
    /// source states). Deferring is safe: it is bounded by the delivery-count limit and ends in
    /// dead letters, so nothing is lost, whereas rejecting could drop an event that was valid.
    [[nodiscard]] constexpr Classification<State> classify(State current,
                                                           Event event) const noexcept {
        if (const auto to = next(current, event)) {
            return {Verdict::allowed, to, current};
        }
        std::optional<State> passed;
        for (const auto& t : table_) {
            if (t.on != event) continue;
            if (reachable(current, t.from)) return {Verdict::early, std::nullopt, t.from};
            if (!passed && reachable(t.from, current)) passed = t.from;
        }
        if (passed) return {Verdict::stale, std::nullopt, passed};
        return {Verdict::impossible, std::nullopt, std::nullopt};
    }

    /// @brief True when at least one transition is triggered by `event`.
    [[nodiscard]] constexpr bool handles(Event event) const noexcept {
        for (const auto& t : table_) {
            if (t.on == event) return true;
        }
        return false;
    }

  private:
    constexpr void validate() const {
        for (std::size_t i = 0; i < N; ++i) {
            for (std::size_t j = i + 1; j < N; ++j) {
                const auto& a = table_[i];
                const auto& b = table_[j];
                if (a.from == b.from && a.on == b.on && a.to != b.to) {
                    detail::duplicate_transition_with_different_targets(a.from, a.on, a.to, b.to);
                }
            }
        }
        if (initial_) {
            bool leaves = false;
            for (const auto& t : table_) {
                if (t.from == *initial_) leaves = true;
            }
            if (!leaves) detail::initial_state_without_transition(*initial_);
        }
    }

    std::array<transition_type, N> table_;
    std::optional<State> initial_{};
};

/// Lets `StateMachine{rows...}` deduce State, Event and the number of rows.
template <class State, class Event, class... Rest>
StateMachine(Transition<State, Event>, Rest...) -> StateMachine<State, Event, 1 + sizeof...(Rest)>;
/// Lets `StateMachine{idem::Initial{...}, rows...}` deduce State, Event and the number of rows.
template <class State, class Event, class... Rest>
StateMachine(Initial<State>, Transition<State, Event>, Rest...)
    -> StateMachine<State, Event, 1 + sizeof...(Rest)>;

namespace detail {
template <class State, class Event, std::size_t N, std::size_t... I>
constexpr StateMachine<State, Event, N> make_state_machine(
    const Transition<State, Event> (&table)[N], std::index_sequence<I...>) {
    return StateMachine<State, Event, N>(table[I]...);
}
template <class State, class Event, std::size_t N, std::size_t... I>
constexpr StateMachine<State, Event, N> make_state_machine(
    Initial<State> initial, const Transition<State, Event> (&table)[N], std::index_sequence<I...>) {
    return StateMachine<State, Event, N>(initial, table[I]...);
}
}  // namespace detail

/// @brief Builds a StateMachine from a braced list of {from, on, to} rows.
///
/// @code
/// constexpr auto flow = idem::make_state_machine<State, Event>({
///     {State::authorised, Event::capture, State::captured},
///     {State::captured, Event::refund, State::refunded}});
/// @endcode
/// @throws usage_error when one (from, on) pair leads to two different states.
template <class State, class Event, std::size_t N>
[[nodiscard]] constexpr StateMachine<State, Event, N> make_state_machine(
    const Transition<State, Event> (&table)[N]) {
    return detail::make_state_machine(table, std::make_index_sequence<N>{});
}

/// @brief make_state_machine() with an initial state (see idem::Initial).
///
/// @code
/// constexpr auto flow = idem::make_state_machine<State, Event>(idem::Initial{State::none}, {
///     {State::none, Event::authorise, State::authorised},
///     {State::authorised, Event::capture, State::captured}});
/// @endcode
/// @throws usage_error as the StateMachine constructors.
template <class State, class Event, std::size_t N>
[[nodiscard]] constexpr StateMachine<State, Event, N> make_state_machine(
    Initial<State> initial, const Transition<State, Event> (&table)[N]) {
    return detail::make_state_machine(initial, table, std::make_index_sequence<N>{});
}

namespace detail {

template <class M, class = void>
struct has_event_member : std::false_type {};
template <class M>
struct has_event_member<M, std::void_t<decltype(std::declval<const M&>().event)>> : std::true_type {
};

/// event_of for messages that carry a public `event` data member.
struct event_member {
    template <class Msg>
    constexpr auto operator()(const Msg& msg) const {
        static_assert(has_event_member<Msg>::value,
                      "idem::guarded(machine, state_of, apply): the message has no public data "
                      "member `event`; pass an event_of function: guarded(machine, event_of, "
                      "state_of, apply)");
        return msg.event;
    }
};

}  // namespace detail

/// @brief The effect returned by guarded(): reads the state, classifies, applies only what the
/// table allows.
template <class Machine, class EventOf, class StateOf, class Apply>
class Guarded {
  public:
    using state_type = typename Machine::state_type;  ///< the machine's states
    using event_type = typename Machine::event_type;  ///< the machine's events

    /// Made by guarded(); see there for the parameters.
    Guarded(const Machine& machine, EventOf event_of, StateOf state_of, Apply apply)
        : machine_(machine),
          event_of_(std::move(event_of)),
          state_of_(std::move(state_of)),
          apply_(std::move(apply)) {}

    /// @brief Names the entity in reasons ("payment is refunded" rather than "entity is ...").
    [[nodiscard]] Guarded named(std::string entity) const& {
        Guarded copy(*this);
        copy.entity_ = std::move(entity);
        return copy;
    }
    /// @brief named() on a temporary: moves instead of copying.
    [[nodiscard]] Guarded named(std::string entity) && {
        entity_ = std::move(entity);
        return std::move(*this);
    }

    /// @brief Runs inside the claim's transaction: the state read and apply's write share it.
    template <class Tx, class Msg>
    EffectResult operator()(Tx& tx, const Msg& msg) const {
        return run(*this, tx, msg);
    }
    /// @brief The same, on a non-const effect (its callables may keep state).
    template <class Tx, class Msg>
    EffectResult operator()(Tx& tx, const Msg& msg) {
        return run(*this, tx, msg);
    }

    /// The transition table.
    [[nodiscard]] const Machine& machine() const noexcept { return machine_; }

  private:
    template <class Self, class Tx, class Msg>
    static EffectResult run(Self& self, Tx& tx, const Msg& msg) {
        using State = state_type;
        using Event = event_type;
        using EventOfRef = std::conditional_t<std::is_const_v<Self>, const EventOf&, EventOf&>;
        using StateOfRef = std::conditional_t<std::is_const_v<Self>, const StateOf&, StateOf&>;
        using ApplyRef = std::conditional_t<std::is_const_v<Self>, const Apply&, Apply&>;

        static_assert(std::is_invocable_v<EventOfRef, const Msg&>,
                      "idem::guarded: event_of must be callable as event_of(msg)");
        static_assert(std::is_convertible_v<std::invoke_result_t<EventOfRef, const Msg&>, Event>,
                      "idem::guarded: event_of(msg) must return the machine's Event type");
        static_assert(std::is_invocable_v<StateOfRef, Tx&, const Msg&>,
                      "idem::guarded: state_of must be callable as state_of(tx, msg)");
        using Read = std::decay_t<std::invoke_result_t<StateOfRef, Tx&, const Msg&>>;
        static_assert(
            std::is_same_v<Read, std::optional<State>> || std::is_convertible_v<Read, State>,
            "idem::guarded: state_of(tx, msg) must return the machine's State, or "
            "std::optional<State> (empty when the entity does not exist yet)");
        static_assert(std::is_invocable_v<ApplyRef, Tx&, const Msg&, State>,
                      "idem::guarded: apply must be callable as apply(tx, msg, next_state)");
        using Applied = std::invoke_result_t<ApplyRef, Tx&, const Msg&, State>;
        static_assert(
            std::is_void_v<Applied> || std::is_same_v<std::decay_t<Applied>, EffectResult>,
            "idem::guarded: apply must return void or idem::EffectResult");

        const Event event = static_cast<Event>(self.event_of_(msg));
        std::optional<State> current;
        if constexpr (detail::is_optional<Read>::value) {
            current = self.state_of_(tx, msg);
        } else {
            current = static_cast<State>(self.state_of_(tx, msg));
        }
        const std::string& entity = self.entity_;
        const bool absent = !current;
        if (absent) {
            const auto initial = self.machine_.initial();
            if (!initial) {
                // The message that creates the entity may still be on its way: wait for it.
                return EffectResult::deferred(
                    fmt::format("{} not found yet: {} deferred until it exists", entity,
                                detail::event_label(event)));
            }
            // A machine with an initial state: "no entity yet" is that state, so a creation
            // event (a transition from it) is allowed and the others classify against it.
            current = initial;
        }

        const auto c = self.machine_.classify(*current, event);
        if (absent && c.verdict == Verdict::early) {
            return EffectResult::deferred(fmt::format(
                "{} not found yet: {} deferred until it exists (it applies from {})", entity,
                detail::event_label(event), detail::name_of(*c.source, "state")));
        }
        // "payment is refunded" / "payment does not exist yet (none)".
        const std::string is_current =
            absent ? fmt::format("{} does not exist yet ({})", entity,
                                 detail::name_of(*current, "state"))
                   : fmt::format("{} is {}", entity, detail::name_of(*current, "state"));
        switch (c.verdict) {
            case Verdict::allowed:
                if constexpr (std::is_void_v<Applied>) {
                    self.apply_(tx, msg, *c.next);
                    return EffectResult::applied();
                } else {
                    return self.apply_(tx, msg, *c.next);
                }
            case Verdict::stale:
                return EffectResult::rejected(fmt::format("stale {}: {}, already past {}",
                                                          detail::event_label(event), is_current,
                                                          detail::name_of(*c.source, "state")));
            case Verdict::early:
                return EffectResult::deferred(fmt::format(
                    "early {}: {}, the event applies from {}, not reached yet",
                    detail::event_label(event), is_current, detail::name_of(*c.source, "state")));
            case Verdict::impossible:
                break;
        }
        if (!self.machine_.handles(event)) {
            return EffectResult::rejected(
                fmt::format("impossible transition: {} has no transition in the table",
                            detail::event_label(event)));
        }
        if (absent) {
            return EffectResult::rejected(fmt::format(
                "impossible transition: {} does not apply to the {}, which does not exist yet "
                "({}), nor can it later",
                detail::event_label(event), entity, detail::name_of(*current, "state")));
        }
        return EffectResult::rejected(
            fmt::format("impossible transition: {} does not apply to {} in {}, nor can it later",
                        detail::event_label(event), entity, detail::name_of(*current, "state")));
    }

    Machine machine_;
    EventOf event_of_;
    StateOf state_of_;
    Apply apply_;
    std::string entity_ = "entity";
};

/// @brief Wraps `apply` in a state guard: the effect the handler runs for each message.
///
/// - `event_of(msg)` returns the Event;
/// - `state_of(tx, msg)` reads the entity's State inside the claim's transaction, or returns an
///   empty std::optional<State> when the entity does not exist yet. With a machine that declares
///   an initial state (idem::Initial) that entity is in the initial state: the creation event is
///   applied, the others are deferred. Without one every event for it is deferred;
/// - `apply(tx, msg, next_state)` performs the effect and writes next_state; it returns void or
///   an EffectResult, which is passed through. It runs only for an allowed transition; for a
///   creation event (from the initial state) it is the one that creates the entity's row.
///
/// Stale and impossible events are rejected (acked, recorded); early ones are deferred (not
/// acked; the delivery-count limit bounds the wait).
template <class State, class Event, std::size_t N, class EventOf, class StateOf, class Apply>
[[nodiscard]] auto guarded(const StateMachine<State, Event, N>& machine, EventOf event_of,
                           StateOf state_of, Apply apply) {
    return Guarded<StateMachine<State, Event, N>, EventOf, StateOf, Apply>(
        machine, std::move(event_of), std::move(state_of), std::move(apply));
}

/// @brief guarded() for messages that carry their event in a public data member `event`.
template <class State, class Event, std::size_t N, class StateOf, class Apply>
[[nodiscard]] auto guarded(const StateMachine<State, Event, N>& machine, StateOf state_of,
                           Apply apply) {
    return Guarded<StateMachine<State, Event, N>, detail::event_member, StateOf, Apply>(
        machine, detail::event_member{}, std::move(state_of), std::move(apply));
}

IDEM_END_NAMESPACE
