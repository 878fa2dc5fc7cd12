#pragma once
/// @file
/// @brief Bringing dead letters back, exactly once: the selection of dead letters
/// (DeadLetterSelection), what a redrive is asked (RedriveOptions) and what it answers
/// (RedriveReport), and the one loop every store's `redrive()` runs (detail::run_redrive). The
/// store does each message's step in one transaction of its own: the parked claim is removed
/// (and its attempt count, a fresh poison limit), an outbox intent re-publishes the stored
/// payload under the same message id, and the entry is marked redriven. docs/operations.md.
///
/// @code
/// idem::DeadLetterSelection selection;
/// selection.scope = "capture-payment";
/// selection.reason_contains = "gateway 503";
/// idem::RedriveOptions options;
/// options.destination = "payments";   // where the relay publishes it (empty: where it was)
/// const idem::RedriveReport report = store.redrive(selection, options);
/// // report.count(idem::RedriveStatus::redriven) intents now wait for the relay
/// @endcode

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/config.hpp"
#include "idem/contract/records.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"

IDEM_BEGIN_NAMESPACE

/// @brief Which dead letters a listing or a redrive takes: every condition set must hold; an
/// empty selection takes them all. Entries come oldest first (the order they were written).
struct DeadLetterSelection {
    /// Only this policy scope; empty: every scope.
    std::string scope{};
    /// Only these message ids; empty: any id.
    std::vector<std::string> message_ids{};
    /// Only entries whose reason contains this text; empty: any reason.
    std::string reason_contains{};
    /// Only entries whose effect's last failure before it was parked (DeadLetter::failure)
    /// contains this text, e.g. a gateway's error code: the messages one fault parked; empty:
    /// any (an entry without a recorded failure too).
    std::string failure_contains{};
    /// Only entries parked at or after this time.
    std::optional<std::chrono::system_clock::time_point> created_from{};
    /// Only entries parked before this time.
    std::optional<std::chrono::system_clock::time_point> created_before{};
    /// At most this many entries, the oldest; 0: no limit.
    std::size_t limit = 0;

    /// @brief Whether @p letter is selected (the limit aside).
    [[nodiscard]] bool matches(const DeadLetter& letter) const {
        if (!scope.empty() && letter.scope != scope) return false;
        if (!message_ids.empty() && std::find(message_ids.begin(), message_ids.end(),
                                              letter.message_id) == message_ids.end()) {
            return false;
        }
        if (!reason_contains.empty() && letter.reason.find(reason_contains) == std::string::npos) {
            return false;
        }
        if (!failure_contains.empty() &&
            letter.failure.find(failure_contains) == std::string::npos) {
            return false;
        }
        if (created_from && letter.created_at < *created_from) return false;
        if (created_before && !(letter.created_at < *created_before)) return false;
        return true;
    }

    /// @brief Whether the limit is reached with @p selected entries.
    [[nodiscard]] bool full(std::size_t selected) const noexcept {
        return limit != 0 && selected >= limit;
    }
};

/// @brief What Store::redrive() does.
struct RedriveOptions {
    /// Where the relay re-publishes each redriven message (a queue, a subject, a stream, a
    /// topic: the destination of the store's outbox, see outbox.hpp). Empty: each message goes
    /// back to where the broker held it (DeadLetter::origin); an entry that records no origin
    /// is then left parked (RedriveStatus::no_destination).
    std::string destination{};
    /// List what would be redriven, and change nothing.
    bool dry_run = false;
    /// At most this many entries a second (each entry's transaction starts no sooner than
    /// its turn), so a large redrive does not flood the consumers; 0: as fast as it goes.
    double max_per_second = 0;

    /// The check every store's redrive() makes. @throws usage_error.
    void validate(std::string_view who) const {
        if (!(max_per_second >= 0) || max_per_second == std::numeric_limits<double>::infinity()) {
            throw usage_error(fmt::format(
                "{}: RedriveOptions::max_per_second must be a finite rate, 0 or more (0: unpaced)",
                who));
        }
    }
};

/// @brief What a redrive did with one selected dead letter.
enum class RedriveStatus {
    /// Its parked claim was removed and an intent re-publishes it (dry run: it would be).
    redriven,
    /// This entry was redriven before: nothing done.
    already_redriven,
    /// Its claim records another outcome now (processed meanwhile, by a re-publish the store
    /// did not redrive): reported, not re-run. RedriveEntry::recorded says which.
    processed_meanwhile,
    /// No claim holds its id (purged by retention, or a malformed delivery parked without one):
    /// nothing done, since the store cannot tell whether it ran.
    no_claim,
    /// Its transaction failed (RedriveEntry::error): nothing of it was written; run the redrive
    /// again.
    failed,
    /// No RedriveOptions::destination was given and the entry records no origin (a delivery
    /// that named none, or an entry written before origins were kept): nothing done; redrive
    /// it to a destination.
    no_destination,
};

/// @brief The status's name ("redriven", "already_redriven", ...).
[[nodiscard]] constexpr std::string_view to_string(RedriveStatus status) noexcept {
    switch (status) {
        case RedriveStatus::redriven:
            return "redriven";
        case RedriveStatus::already_redriven:
            return "already_redriven";
        case RedriveStatus::processed_meanwhile:
            return "processed_meanwhile";
        case RedriveStatus::no_claim:
            return "no_claim";
        case RedriveStatus::failed:
            return "failed";
        case RedriveStatus::no_destination:
            return "no_destination";
    }
    return "unknown";
}

/// @brief One selected dead letter and what the redrive did with it.
struct RedriveEntry {
    /// The entry as it was selected (before the redrive marked it).
    DeadLetter letter;
    /// What was done.
    RedriveStatus status = RedriveStatus::redriven;
    /// For processed_meanwhile: the outcome its claim records.
    Disposition recorded = Disposition::processed;
    /// For failed: why.
    std::string error{};
};

/// @brief Answer of Store::redrive(): each selected entry, oldest first, with its status.
struct RedriveReport {
    /// Whether it was a dry run (nothing changed; `redriven` means "would be").
    bool dry_run = false;
    /// The selected entries and what was done with each.
    std::vector<RedriveEntry> entries{};

    /// @brief The number of entries with @p status.
    [[nodiscard]] std::size_t count(RedriveStatus status) const noexcept {
        return static_cast<std::size_t>(
            std::count_if(entries.begin(), entries.end(),
                          [status](const RedriveEntry& entry) { return entry.status == status; }));
    }
};

/// @brief The outbox intent that re-publishes @p letter: its payload, to @p destination, with
/// its message id as the idempotency key, which the senders publish as the message's id
/// (outbox.hpp), so the handler finds the same id, whose parked claim the redrive removed.
[[nodiscard]] inline OutboxIntent redrive_intent(const DeadLetter& letter,
                                                 std::string_view destination) {
    return OutboxIntent{std::string(destination), letter.message_id, letter.payload};
}

/// @brief Where a redrive re-publishes @p letter: the options' destination, or the letter's
/// origin when none is given (empty when neither is known).
[[nodiscard]] inline const std::string& redrive_destination(const DeadLetter& letter,
                                                            const RedriveOptions& options) {
    return options.destination.empty() ? letter.origin : options.destination;
}

namespace detail {

/// What a redrive does with @p letter, judged from its claim as it is now: the dry run's answer,
/// and the answer of a step that found nothing to do.
[[nodiscard]] inline RedriveEntry judge_redrive(const DeadLetter& letter,
                                                const std::optional<ClaimRecord>& claim) {
    RedriveEntry entry{letter, RedriveStatus::redriven, Disposition::processed, {}};
    if (letter.redriven_at) {
        entry.status = RedriveStatus::already_redriven;
    } else if (!claim) {
        entry.status = RedriveStatus::no_claim;
    } else if (claim->disposition != Disposition::dead_lettered) {
        entry.status = RedriveStatus::processed_meanwhile;
        entry.recorded = claim->disposition;
    }
    return entry;
}

/// The loop of every store's redrive(): each selected entry in turn, oldest first. A dry run
/// judges each from its claim (@p find_claim(scope, id)) and changes nothing. Otherwise
/// @p step(letter) runs the entry's transaction and returns whether it redrove it; when it did
/// not, the entry is judged again from the store as it is now (another redrive, or a handler,
/// got there first). A step whose transaction fails (store_error), or whose destination the
/// store refuses (usage_error), makes that entry `failed` and the loop goes on: nothing of it
/// was written, so running the redrive again finishes it. An entry with nowhere to go
/// (redrive_destination() empty) is `no_destination` and never stepped.
template <class FindClaim, class FindLetter, class Step>
RedriveReport run_redrive(const std::vector<DeadLetter>& letters, const RedriveOptions& options,
                          FindClaim&& find_claim, FindLetter&& find_letter, Step&& step) {
    RedriveReport report;
    report.dry_run = options.dry_run;
    report.entries.reserve(letters.size());
    const auto started = std::chrono::steady_clock::now();
    std::size_t stepped = 0;
    for (const DeadLetter& letter : letters) {
        if (!letter.redriven_at && redrive_destination(letter, options).empty()) {
            report.entries.push_back(
                RedriveEntry{letter, RedriveStatus::no_destination, Disposition::processed, {}});
            continue;
        }
        if (options.dry_run || letter.redriven_at) {
            report.entries.push_back(
                judge_redrive(letter, find_claim(letter.scope, letter.message_id)));
            continue;
        }
        if (options.max_per_second > 0) {  // the n-th step no sooner than n / rate seconds in
            std::this_thread::sleep_until(
                started + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(static_cast<double>(stepped) /
                                                            options.max_per_second)));
        }
        ++stepped;
        try {
            if (step(letter)) {
                report.entries.push_back(
                    RedriveEntry{letter, RedriveStatus::redriven, Disposition::processed, {}});
                continue;
            }
            const std::optional<DeadLetter> now = find_letter(letter.id);
            RedriveEntry entry =
                judge_redrive(now ? *now : letter, find_claim(letter.scope, letter.message_id));
            entry.letter = letter;
            if (entry.status == RedriveStatus::redriven) {
                // Parked again between the step and this look: another redrive's to take.
                entry.status = RedriveStatus::already_redriven;
            }
            report.entries.push_back(std::move(entry));
        } catch (const store_error& e) {
            report.entries.push_back(
                RedriveEntry{letter, RedriveStatus::failed, Disposition::processed, e.what()});
        } catch (const usage_error& e) {
            report.entries.push_back(
                RedriveEntry{letter, RedriveStatus::failed, Disposition::processed, e.what()});
        }
    }
    return report;
}

}  // namespace detail

IDEM_END_NAMESPACE
