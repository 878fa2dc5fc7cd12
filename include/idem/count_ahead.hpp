#pragma once
/// @file
/// @brief CountAhead: a consumer's note, from one handle() to the next, of the delivery it hands
/// its handler next, so that a store-counted attempt (DeliveryCounter::store: Kafka) is counted
/// inside the commit of the message before it instead of in a commit of its own.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "idem/config.hpp"
#include "idem/delivery.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief Carries the attempt count of the next delivery from one IdempotentHandler::handle() to
/// the next, for a broker that keeps no delivery count (DeliveryCounter::store).
///
/// The poison limit of such a broker needs each attempt counted in the store before its effect
/// runs, in a write that survives a worker killed by the effect. Without a CountAhead that is a
/// commit of its own per message (Store::count_attempt()). A consumer that knows which delivery
/// it handles next says so with next(); handle() then counts that delivery's attempt in its own
/// transaction, which commits before the next effect begins, and the next handle() takes the
/// count from here instead of counting again. Where the handle() commits nothing (a duplicate,
/// a failure, a deferral) or its store's transaction cannot count (Transaction::count_attempt()),
/// the next delivery counts its attempt itself, as without a CountAhead.
///
/// A delivery counted ahead and then not handled (the consumer stopped, or the worker died,
/// between the two) has one attempt counted more than it had, as has a worker killed between
/// a count of its own and the effect: the poison limit never counts fewer attempts than ran.
///
/// @code
/// idem::CountAhead ahead;
/// for (std::size_t i = 0; i < deliveries.size(); ++i) {
///     if (i + 1 < deliveries.size()) ahead.next(deliveries[i + 1]);
///     else ahead.none();
///     outcomes.push_back(handler.handle(deliveries[i], bodies[i], ahead));
/// }
/// @endcode
///
/// One per consumer (it is not shared between threads), handed to every handle() of its loop.
class CountAhead {
  public:
    /// @p delivery is the one the next handle() will get. Only a store-counted delivery with an
    /// id is counted ahead; any other clears the note.
    void next(const Delivery& delivery) {
        if (delivery.counted_by == DeliveryCounter::store && !delivery.message_id.empty()) {
            next_ = delivery.message_id;
            has_next_ = true;
        } else {
            none();
        }
    }
    /// No delivery is known to follow (the last of a poll).
    void none() noexcept { has_next_ = false; }
    /// next() with the first of [@p first, @p last) that @p waits does not hold back (a
    /// record behind one tried again in its partition), as @p delivery_of maps it; else none().
    template <class It, class Waits, class DeliveryOf>
    void next_of(It first, It last, Waits&& waits, DeliveryOf&& delivery_of) {
        for (; first != last; ++first) {
            if (!waits(*first)) return next(delivery_of(*first));
        }
        none();
    }

    // ---- the handler's side ----

    /// The id next() named, taken: the one to count in this handle()'s commit (empty: none).
    [[nodiscard]] std::string take_next() {
        if (!has_next_) return {};
        has_next_ = false;
        return std::move(next_);
    }
    /// The count the previous handle() committed for @p id, taken; what it committed for any
    /// other id is dropped (it was meant for the delivery handled now, and this is not it).
    [[nodiscard]] std::optional<std::uint32_t> take_counted(std::string_view id) {
        std::optional<std::uint32_t> count = std::exchange(counted_, std::nullopt);
        if (count && counted_id_ != id) return std::nullopt;
        return count;
    }
    /// The previous handle() committed @p count attempts for @p id.
    void counted(std::string id, std::uint32_t count) {
        counted_id_ = std::move(id);
        counted_ = count;
    }

  private:
    std::string next_;
    bool has_next_ = false;
    std::string counted_id_;
    std::optional<std::uint32_t> counted_;
};

IDEM_END_NAMESPACE
