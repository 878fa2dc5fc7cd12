// idem: the operator's command over an idem store (docs/operations.md). It lists, shows,
// redrives and purges dead letters, shows a claim, purges old claims and prints counts, on the
// stores named by URL: sqlite:PATH, postgresql://… (or postgres://…, or a libpq key=value
// string after postgresql:), mysql://USER:PASSWORD@HOST:PORT/DATABASE (or mariadb://…),
// redis://… (one server, or a Cluster's seed nodes) and redis-sentinel://…
//
// Exit status: 0 done; 1 done, but some entries failed (run it again: a redrive or a purge
// repeats nothing it finished) or had no destination to be redriven to; 2 a usage error (nothing
// was opened); 3 the store could not be opened or failed (nothing of the failed step was changed).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include "idem/contract/redrive.hpp"
#include "idem/detail/json.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"
#include "idem/store/sqlite.hpp"
#ifdef IDEM_TOOL_WITH_POSTGRES
#include "idem/store/postgres.hpp"
#endif
#ifdef IDEM_TOOL_WITH_MYSQL
#include "idem/store/mysql.hpp"
#endif
#ifdef IDEM_TOOL_WITH_REDIS
#include "idem/store/redis.hpp"
#endif

namespace {

using Clock = std::chrono::system_clock;

constexpr int exit_done = 0;
constexpr int exit_some_failed = 1;
constexpr int exit_usage = 2;
constexpr int exit_store = 3;

/// A command line the tool cannot act on: printed with the verb's usage, exit 2.
struct usage_problem : std::runtime_error {
    using std::runtime_error::runtime_error;
};

constexpr const char* general_usage = R"(usage: idem [--store URL] COMMAND [ARGS] [--json]

Operates on an idem store (docs/operations.md). The store comes from --store or, without it,
the environment variable IDEM_STORE:
  sqlite:PATH                             an existing SQLite file
  postgresql://USER:PASSWORD@HOST:PORT/DB  (or postgres://..., or postgresql:KEY=VALUE ...)
  mysql://USER:PASSWORD@HOST:PORT/DB       (or mariadb://...)
  redis://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][/DB]
                                          one server, or seed nodes of a Redis Cluster
  redis-sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER[/DB]
                                          the master that these Sentinels name
Opening a SQL store creates or migrates idem's tables, as a consumer of this version does.

Commands:
  dead-letters list      the parked messages a selection takes
  dead-letters show      one message's dead letters, claim and attempt count
  dead-letters redrive   bring the selected messages back, each exactly once
  dead-letters purge     delete the selected dead letters (their claims stay)
  claims show            one message's story
  purge                  delete claims (and sent intents, expired locks, attempt counts) by age
  stats                  dead letters counted by scope and reason

Every command takes --help. Exit status: 0 done; 1 some entries failed (run it again) or
had nowhere to be redriven; 2 usage error; 3 the store could not be opened or failed.
)";

constexpr const char* selection_usage =
    R"(Selection (every condition given must hold; dead letters are taken oldest first):
  --scope SCOPE        the handler's policy scope
  --id ID              this message id (repeatable)
  --reason TEXT        reasons containing TEXT
  --failure TEXT       the effect's last failure before it was parked contains TEXT
  --since TIME         parked at or after TIME
  --before TIME        parked before TIME
  --limit N            at most N entries
TIME: seconds since the epoch, an ISO date-time (2026-12-03T10:00:00Z), or an age (90s, 15m,
2h, 7d) meaning that long ago.
)";

struct Verb {
    const char* name;
    const char* usage;
};

constexpr Verb verbs[] = {
    {"dead-letters list", R"(usage: idem dead-letters list [SELECTION] [--all] [--json]
Lists the dead letters the selection takes: still parked ones only, or with --all the redriven
entries too.
)"},
    {"dead-letters show", R"(usage: idem dead-letters show SCOPE ID [--json]
Shows one message's story: its claim, the attempts the store counted, how its effect failed
since its last redrive, each dead-letter entry (parked and redriven, with its payload, where the
broker held it, and how and when its effect failed before it was parked) and the outbox intents
its attempts wrote (its effect's and its redrives'). The same as claims show.
)"},
    {"dead-letters redrive", R"(usage: idem dead-letters redrive [--destination DEST] [SELECTION]
                            [--rate N] [--dry-run] [--json]
Brings the parked messages the selection takes back, each exactly once: in one transaction per
message its claim is released (a fresh poison limit) and an outbox intent re-publishes the
stored payload under its message id, to DEST or else to where the broker held it (its origin);
the consumer's relay ships it. A message processed meanwhile is reported and left alone; one
that records no origin, without --destination, is left parked (no_destination); running the
same redrive again repeats nothing.
  --destination DEST   where the relay publishes (a queue, subject, stream or topic);
                       default: each message's origin
  --rate N             at most N messages a second
  --dry-run            say what would be redriven, change nothing
)"},
    {"dead-letters purge", R"(usage: idem dead-letters purge SELECTION|--everything [--rate N]
                          [--dry-run] [--json]
Deletes the dead letters the selection takes (redriven entries too). Their claims stay: a
re-published copy is still answered duplicate. Refuses an empty selection unless --everything.
  --rate N             at most N entries a second
  --dry-run            say what would be deleted, delete nothing
)"},
    {"claims show", R"(usage: idem claims show SCOPE ID [--json]
Shows message ID of SCOPE's story: its claim (outcome, reason, time), the attempts the store
counted, how its effect failed since its last redrive, its dead-letter entries and the outbox
intents its attempts wrote (its effect's and its redrives'). The same as dead-letters show.
)"},
    {"purge", R"(usage: idem purge --older-than AGE [--batch-rows N] [--rows-per-second N]
                  [--time-budget SECONDS] [--json]
Deletes claims claimed longer ago than AGE (90s, 15m, 2h, 7d), with the outbox intents sent
before then, expired locks and stale attempt counts, in batches of N rows (1000), paced so
consumers keep their speed. Dead letters are never purged by age: see dead-letters purge.
)"},
    {"stats", R"(usage: idem stats [--json]
Counts the dead letters by scope and reason, parked and redriven.
)"},
};

// ---------------------------------------------------------------------------------------------
// Arguments

class Arguments {
  public:
    explicit Arguments(std::vector<std::string> args) : args_(std::move(args)) {}

    /// Removes a flag without value; whether it was there.
    bool flag(std::string_view name) {
        const auto it = std::find(args_.begin(), args_.end(), name);
        if (it == args_.end()) return false;
        args_.erase(it);
        return true;
    }
    /// Removes every `--name VALUE` (or `--name=VALUE`), in order.
    std::vector<std::string> values(std::string_view name) {
        std::vector<std::string> out;
        for (std::size_t i = 0; i < args_.size();) {
            const std::string& arg = args_[i];
            if (arg == name) {
                if (i + 1 >= args_.size())
                    throw usage_problem(fmt::format("{} needs a value", name));
                out.push_back(args_[i + 1]);
                args_.erase(args_.begin() + static_cast<std::ptrdiff_t>(i),
                            args_.begin() + static_cast<std::ptrdiff_t>(i + 2));
            } else if (arg.size() > name.size() && arg.compare(0, name.size(), name) == 0 &&
                       arg[name.size()] == '=') {
                out.push_back(arg.substr(name.size() + 1));
                args_.erase(args_.begin() + static_cast<std::ptrdiff_t>(i));
            } else {
                ++i;
            }
        }
        return out;
    }
    std::optional<std::string> value(std::string_view name) {
        auto all = values(name);
        if (all.size() > 1) throw usage_problem(fmt::format("{} given twice", name));
        if (all.empty()) return std::nullopt;
        return all.front();
    }
    /// The next word that is not an option, removed.
    std::optional<std::string> word() {
        for (std::size_t i = 0; i < args_.size(); ++i) {
            if (args_[i].rfind("--", 0) != 0) {
                std::string out = args_[i];
                args_.erase(args_.begin() + static_cast<std::ptrdiff_t>(i));
                return out;
            }
        }
        return std::nullopt;
    }
    /// Refuses whatever no one took.
    void finish() const {
        if (!args_.empty())
            throw usage_problem(fmt::format("unexpected argument '{}'", args_.front()));
    }

  private:
    std::vector<std::string> args_;
};

std::uint64_t parse_count(std::string_view what, const std::string& text) {
    std::size_t used = 0;
    unsigned long long value = 0;
    try {
        value = std::stoull(text, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    if (used != text.size() || text.empty() || text[0] == '-') {
        throw usage_problem(fmt::format("{} wants a whole number, not '{}'", what, text));
    }
    return value;
}

double parse_rate(std::string_view what, const std::string& text) {
    std::size_t used = 0;
    double value = 0;
    try {
        value = std::stod(text, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    if (used != text.size() || !(value > 0)) {
        throw usage_problem(fmt::format("{} wants a positive number, not '{}'", what, text));
    }
    return value;
}

/// "90s", "15m", "2h", "7d" (or a bare number of seconds).
Clock::duration parse_age(std::string_view what, const std::string& text) {
    if (text.empty()) throw usage_problem(fmt::format("{} is empty", what));
    const char unit = text.back();
    const bool has_unit = unit == 's' || unit == 'm' || unit == 'h' || unit == 'd';
    const std::uint64_t n = parse_count(what, has_unit ? text.substr(0, text.size() - 1) : text);
    const std::uint64_t per = unit == 'm' ? 60 : unit == 'h' ? 3600 : unit == 'd' ? 86400 : 1;
    return std::chrono::seconds(static_cast<std::int64_t>(n * per));
}

/// Seconds since the epoch, YYYY-MM-DDTHH:MM:SSZ (or with a space), YYYY-MM-DD, or an age.
Clock::time_point parse_time(std::string_view what, const std::string& text) {
    int year = 0, month = 0, day = 0, hour = 0, minute = 0, second = 0;
    char sep = 0;
    int used = 0;
    if (std::sscanf(text.c_str(), "%4d-%2d-%2d%n", &year, &month, &day, &used) == 3) {
        const std::string rest = text.substr(static_cast<std::size_t>(used));
        int more = 0;
        const bool date_only = rest.empty();
        const bool with_time = std::sscanf(rest.c_str(), "%c%2d:%2d:%2d%n", &sep, &hour, &minute,
                                           &second, &more) == 4 &&
                               (sep == 'T' || sep == ' ') &&
                               (rest.substr(static_cast<std::size_t>(more)).empty() ||
                                rest.substr(static_cast<std::size_t>(more)) == "Z");
        if ((date_only || with_time) && month >= 1 && month <= 12 && day >= 1 && day <= 31 &&
            hour < 24 && minute < 60 && second < 61) {
            std::tm tm{};
            tm.tm_year = year - 1900;
            tm.tm_mon = month - 1;
            tm.tm_mday = day;
            tm.tm_hour = hour;
            tm.tm_min = minute;
            tm.tm_sec = second;
            return Clock::from_time_t(timegm(&tm));
        }
        throw usage_problem(
            fmt::format("{}: '{}' is not a date-time (2026-12-03T10:00:00Z)", what, text));
    }
    const char last = text.empty() ? '\0' : text.back();
    if (last == 's' || last == 'm' || last == 'h' || last == 'd') {
        return Clock::now() - parse_age(what, text);
    }
    return Clock::time_point(
        std::chrono::seconds(static_cast<std::int64_t>(parse_count(what, text))));
}

idem::DeadLetterSelection parse_selection(Arguments& args) {
    idem::DeadLetterSelection selection;
    selection.scope = args.value("--scope").value_or("");
    selection.message_ids = args.values("--id");
    selection.reason_contains = args.value("--reason").value_or("");
    selection.failure_contains = args.value("--failure").value_or("");
    if (auto since = args.value("--since")) selection.created_from = parse_time("--since", *since);
    if (auto before = args.value("--before")) {
        selection.created_before = parse_time("--before", *before);
    }
    if (auto limit = args.value("--limit")) {
        selection.limit = static_cast<std::size_t>(parse_count("--limit", *limit));
        if (selection.limit == 0) throw usage_problem("--limit wants at least 1");
    }
    return selection;
}

bool selection_is_empty(const idem::DeadLetterSelection& selection) {
    return selection.scope.empty() && selection.message_ids.empty() &&
           selection.reason_contains.empty() && selection.failure_contains.empty() &&
           !selection.created_from && !selection.created_before && selection.limit == 0;
}

// ---------------------------------------------------------------------------------------------
// Output

/// Strings are bytes: each byte outside printable ASCII is \u00XX (detail::append_json_bytes).
std::string json_string(std::string_view text) {
    std::string out;
    idem::detail::append_json_bytes(out, text);
    return out;
}

std::string iso_time(Clock::time_point at) {
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(at.time_since_epoch()).count();
    const std::time_t seconds = static_cast<std::time_t>(ms / 1000);
    std::tm tm{};
    gmtime_r(&seconds, &tm);
    char text[32];
    std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%S", &tm);
    return fmt::format("{}.{:03}Z", text, ms % 1000);
}

/// The payload as text when it is printable UTF-8-ish ASCII, else its bytes in hex.
std::string shown_payload(const std::string& payload) {
    const bool printable = std::all_of(payload.begin(), payload.end(), [](char c) {
        const auto byte = static_cast<unsigned char>(c);
        return byte >= 0x20 || c == '\n' || c == '\t';
    });
    if (printable) return payload;
    std::string hex = "hex:";
    for (const char c : payload)
        hex += fmt::format("{:02x}", static_cast<unsigned char>(c));
    return hex;
}

/// A time as a JSON string, or null when unset.
std::string optional_time_json(const std::optional<Clock::time_point>& at) {
    return at ? json_string(iso_time(*at)) : "null";
}

std::string letter_json(const idem::DeadLetter& letter, bool with_payload) {
    std::string out = fmt::format(
        "{{\"entry\":{},\"scope\":{},\"message_id\":{},\"reason\":{},\"delivery_count\":{},"
        "\"parked_at\":{},\"redrive_count\":{},\"redriven_at\":{},\"origin\":{},"
        "\"origin_position\":{},\"failure\":{},\"first_failed_at\":{},\"last_failed_at\":{}",
        letter.id, json_string(letter.scope), json_string(letter.message_id),
        json_string(letter.reason), letter.delivery_count, json_string(iso_time(letter.created_at)),
        letter.redrive_count, optional_time_json(letter.redriven_at), json_string(letter.origin),
        json_string(letter.origin_position), json_string(letter.failure),
        optional_time_json(letter.first_failed_at), optional_time_json(letter.last_failed_at));
    if (with_payload) out += fmt::format(",\"payload\":{}", json_string(letter.payload));
    return out + "}";
}

/// A JSON array of @p letters.
std::string letters_json(const std::vector<idem::DeadLetter>& letters, bool with_payload) {
    std::string out = "[";
    for (std::size_t i = 0; i < letters.size(); ++i) {
        out += (i ? "," : "") + letter_json(letters[i], with_payload);
    }
    return out + "]";
}

std::string letter_line(const idem::DeadLetter& letter) {
    return fmt::format(
        "{:>6}  {}  {}  {}  count {}{}{}  {}", letter.id, iso_time(letter.created_at), letter.scope,
        letter.message_id, letter.delivery_count,
        letter.origin.empty()
            ? std::string()
            : fmt::format("  from {}{}{}", letter.origin, letter.origin_position.empty() ? "" : " ",
                          letter.origin_position),
        letter.redriven_at ? fmt::format("  redriven {}", iso_time(*letter.redriven_at))
                           : std::string(),
        letter.reason);
}

/// Prints a progress line on stderr at most once a second while long work goes on.
class Progress {
  public:
    Progress(std::string what, std::size_t total) : what_(std::move(what)), total_(total) {}
    void tick(std::size_t done) {
        const auto now = std::chrono::steady_clock::now();
        if (now - last_ < std::chrono::seconds(1) && done != total_) return;
        if (done == total_ && !printed_) return;  // quick work: no progress line at all
        last_ = now;
        printed_ = true;
        std::fprintf(stderr, "idem: %s %zu/%zu\n", what_.c_str(), done, total_);
    }

  private:
    std::string what_;
    std::size_t total_;
    std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
    bool printed_ = false;
};

/// Waits so that @p done items took at least done / rate seconds since @p start.
void pace(double rate, std::size_t done, std::chrono::steady_clock::time_point start) {
    if (rate <= 0) return;
    const auto due = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                 std::chrono::duration<double>(static_cast<double>(done) / rate));
    std::this_thread::sleep_until(due);
}

// ---------------------------------------------------------------------------------------------
// Stores

/// What the commands need of a store, whichever it is.
class Store {
  public:
    virtual ~Store() = default;
    virtual std::vector<idem::DeadLetter> dead_letters(const idem::DeadLetterSelection&) = 0;
    virtual idem::RedriveReport redrive(const idem::DeadLetterSelection&,
                                        const idem::RedriveOptions&) = 0;
    virtual std::vector<idem::DeadLetter> purge_dead_letters(const idem::DeadLetterSelection&,
                                                             bool dry_run) = 0;
    virtual std::optional<idem::ClaimRecord> find_claim(const std::string& scope,
                                                        const std::string& id) = 0;
    virtual std::uint32_t attempts(const std::string& scope, const std::string& id) = 0;
    virtual std::optional<idem::NotedFailure> noted_failure(const std::string& scope,
                                                            const std::string& id) = 0;
    virtual std::vector<idem::OutboxRow> outbox_rows(const std::string& scope,
                                                     const std::string& id) = 0;
    virtual idem::PurgeResult purge(Clock::duration older_than, const idem::PurgeOptions&) = 0;
};

template <class S>
class StoreOf final : public Store {
  public:
    template <class... Args>
    explicit StoreOf(Args&&... args) : store_(std::forward<Args>(args)...) {}
    std::vector<idem::DeadLetter> dead_letters(const idem::DeadLetterSelection& s) override {
        return store_.dead_letters(s);
    }
    idem::RedriveReport redrive(const idem::DeadLetterSelection& s,
                                const idem::RedriveOptions& o) override {
        return store_.redrive(s, o);
    }
    std::vector<idem::DeadLetter> purge_dead_letters(const idem::DeadLetterSelection& s,
                                                     bool dry_run) override {
        return store_.purge_dead_letters(s, dry_run);
    }
    std::optional<idem::ClaimRecord> find_claim(const std::string& scope,
                                                const std::string& id) override {
        return store_.find_claim(scope, id);
    }
    std::uint32_t attempts(const std::string& scope, const std::string& id) override {
        return store_.attempts(scope, id);
    }
    std::optional<idem::NotedFailure> noted_failure(const std::string& scope,
                                                    const std::string& id) override {
        return store_.noted_failure(scope, id);
    }
    std::vector<idem::OutboxRow> outbox_rows(const std::string& scope,
                                             const std::string& id) override {
        return store_.outbox_rows(scope, id);
    }
    idem::PurgeResult purge(Clock::duration older_than, const idem::PurgeOptions& o) override {
        return store_.purge(older_than, o);
    }

  private:
    S store_;
};

#if defined(IDEM_TOOL_WITH_MYSQL) || defined(IDEM_TOOL_WITH_REDIS)
std::string percent_decoded(std::string_view text) {
    std::string out;
    for (std::size_t i = 0; i < text.size(); ++i) {
        if (text[i] == '%' && i + 2 < text.size()) {
            const std::string hex(text.substr(i + 1, 2));
            char* end = nullptr;
            const long value = std::strtol(hex.c_str(), &end, 16);
            if (end != hex.c_str() + 2) throw usage_problem("bad %-escape in the store URL");
            out += static_cast<char>(value);
            i += 2;
        } else {
            out += text[i];
        }
    }
    return out;
}

/// The user and password before '@' in @p authority, percent-decoded; @p authority keeps the
/// rest.
std::pair<std::string, std::string> login_of(std::string_view& authority) {
    const auto at = authority.rfind('@');
    if (at == std::string_view::npos) return {};
    const std::string_view login = authority.substr(0, at);
    authority = authority.substr(at + 1);
    const auto colon = login.find(':');
    return {
        percent_decoded(login.substr(0, colon)),
        colon == std::string_view::npos ? std::string() : percent_decoded(login.substr(colon + 1))};
}

/// HOST[:PORT] of a store URL: the host (maybe empty), and the port when one is given.
std::pair<std::string_view, std::optional<std::uint64_t>> host_and_port(std::string_view text) {
    const auto colon = text.rfind(':');
    if (colon == std::string_view::npos) return {text, std::nullopt};
    return {text.substr(0, colon),
            parse_count("the port of the store URL", std::string(text.substr(colon + 1)))};
}
#endif

#ifdef IDEM_TOOL_WITH_MYSQL
/// "mysql://user:password@host:port/database": the endpoint (the password is never printed).
idem::MysqlEndpoint mysql_endpoint(std::string_view rest) {
    idem::MysqlEndpoint endpoint;
    const auto slash = rest.find('/');
    if (slash == std::string_view::npos || slash + 1 == rest.size()) {
        throw usage_problem("a mysql:// store URL names its database: mysql://USER@HOST/DATABASE");
    }
    endpoint.database = percent_decoded(rest.substr(slash + 1));
    std::string_view authority = rest.substr(0, slash);
    std::tie(endpoint.user, endpoint.password) = login_of(authority);
    const auto [host, port] = host_and_port(authority);
    if (port) endpoint.port = static_cast<unsigned>(*port);
    if (!host.empty()) endpoint.host = std::string(host);
    return endpoint;
}
#endif

#ifdef IDEM_TOOL_WITH_REDIS
/// A redis:// or redis-sentinel:// URL: the seeds (one server, a Cluster's nodes), or one
/// endpoint naming the Sentinels and the master.
struct RedisUrl {
    std::vector<idem::RedisEndpoint> seeds;
};

/// The pieces of @p text between the @p separator characters, up to the last one (a trailing
/// separator adds no empty piece).
std::vector<std::string_view> pieces(std::string_view text, char separator) {
    std::vector<std::string_view> out;
    while (!text.empty()) {
        const auto next = text.find(separator);
        out.push_back(text.substr(0, next));
        text = next == std::string_view::npos ? std::string_view() : text.substr(next + 1);
    }
    return out;
}

RedisUrl redis_url(const std::string& url) {
    const bool sentinel = url.rfind("redis-sentinel://", 0) == 0;
    std::string_view rest = std::string_view(url).substr(url.find("://") + 3);
    const auto slash = rest.find('/');
    std::string_view authority = rest.substr(0, slash);
    const std::vector<std::string_view> path = slash == std::string_view::npos
                                                   ? std::vector<std::string_view>()
                                                   : pieces(rest.substr(slash + 1), '/');
    const auto [user, password] = login_of(authority);
    std::vector<std::pair<std::string, int>> hosts;
    for (const std::string_view one : pieces(authority, ',')) {
        const auto [host, port] = host_and_port(one);
        if (host.empty())
            throw usage_problem("a Redis store URL names its hosts: redis://HOST:PORT");
        hosts.emplace_back(std::string(host),
                           port ? static_cast<int>(*port) : (sentinel ? 26379 : 6379));
    }
    if (hosts.empty()) throw usage_problem("a Redis store URL names its hosts: redis://HOST:PORT");
    std::size_t next_part = 0;
    std::string master;
    if (sentinel) {
        if (path.empty() || path[0].empty()) {
            throw usage_problem(
                "a redis-sentinel:// URL names the master: redis-sentinel://HOST:PORT/MASTER");
        }
        master = percent_decoded(path[0]);
        next_part = 1;
    }
    int db = 0;
    if (path.size() > next_part && !path[next_part].empty()) {
        db = static_cast<int>(
            parse_count("the database of the store URL", std::string(path[next_part])));
    }
    if (path.size() > next_part + 1) throw usage_problem("the Redis store URL has too many parts");
    RedisUrl parsed;
    if (sentinel) {
        std::vector<idem::RedisSentinelAddress> sentinels;
        for (const auto& [host, port] : hosts)
            sentinels.push_back(idem::RedisSentinelAddress{host, port});
        idem::RedisEndpoint endpoint = idem::RedisEndpoint::sentinel(master, std::move(sentinels));
        endpoint.username = user;
        endpoint.password = password;
        endpoint.db = db;
        parsed.seeds.push_back(std::move(endpoint));
        return parsed;
    }
    for (const auto& [host, port] : hosts) {
        idem::RedisEndpoint endpoint;
        endpoint.host = host;
        endpoint.port = port;
        endpoint.username = user;
        endpoint.password = password;
        endpoint.db = db;
        parsed.seeds.push_back(std::move(endpoint));
    }
    return parsed;
}
#endif

std::unique_ptr<Store> open_store(const std::string& url) {
    const auto starts = [&](std::string_view prefix) { return url.rfind(prefix, 0) == 0; };
    if (starts("sqlite:")) {
        std::string path = url.substr(7);
        if (path.rfind("//", 0) == 0) path = path.substr(2);
        if (path.empty()) throw usage_problem("sqlite: wants a file: sqlite:PATH");
        struct stat info {};
        // A mistyped path must not become a new, empty database.
        if (::stat(path.c_str(), &info) != 0) {
            throw idem::store_unavailable(fmt::format("no such SQLite file: {}", path));
        }
        return std::make_unique<StoreOf<idem::SqliteStore>>(path);
    }
    if (starts("postgresql:") || starts("postgres:")) {
#ifdef IDEM_TOOL_WITH_POSTGRES
        // libpq takes the URL itself; after "postgresql:" without "//", a key=value string.
        const std::string rest = url.substr(url.find(':') + 1);
        const std::string conninfo = rest.rfind("//", 0) == 0 ? url : rest;
        return std::make_unique<StoreOf<idem::PostgresStore>>(conninfo);
#else
        throw usage_problem("this idem was built without PostgreSQL (IDEM_WITH_POSTGRES)");
#endif
    }
    if (starts("mysql://") || starts("mariadb://")) {
#ifdef IDEM_TOOL_WITH_MYSQL
        return std::make_unique<StoreOf<idem::MysqlStore>>(
            mysql_endpoint(std::string_view(url).substr(url.find("://") + 3)));
#else
        throw usage_problem("this idem was built without MySQL (IDEM_WITH_MYSQL)");
#endif
    }
    if (starts("rediss:")) {
        throw usage_problem("the Redis store speaks no TLS: use redis:// or redis-sentinel://");
    }
    if (starts("redis://") || starts("redis-sentinel://")) {
#ifdef IDEM_TOOL_WITH_REDIS
        idem::RedisOptions options;
        // The consumers' stores check the server's persistence; the tool only reads and redrives.
        options.accept_no_persistence = true;
        const RedisUrl parsed = redis_url(url);
        if (parsed.seeds.size() == 1 || parsed.seeds.front().via_sentinel()) {
            return std::make_unique<StoreOf<idem::RedisStore>>(parsed.seeds.front(), options);
        }
        return std::make_unique<StoreOf<idem::RedisStore>>(parsed.seeds, options);
#else
        throw usage_problem("this idem was built without Redis (IDEM_WITH_REDIS)");
#endif
    }
    throw usage_problem(fmt::format(
        "unknown store URL '{}': use sqlite:PATH, postgresql://..., mysql://... or redis://...",
        url.substr(0, url.find(':'))));
}

// ---------------------------------------------------------------------------------------------
// Commands

struct Context {
    Arguments& args;
    bool json = false;
    std::function<Store&()> store;
};

/// The selected entries still parked (not redriven), oldest first; the limit counts those.
std::vector<idem::DeadLetter> parked(Store& store, const idem::DeadLetterSelection& selection) {
    idem::DeadLetterSelection unlimited = selection;
    unlimited.limit = 0;
    std::vector<idem::DeadLetter> out;
    for (auto& letter : store.dead_letters(unlimited)) {
        if (letter.redriven_at) continue;
        if (selection.limit != 0 && out.size() >= selection.limit) break;
        out.push_back(std::move(letter));
    }
    return out;
}

int list_letters(Context& c) {
    const bool all = c.args.flag("--all");
    const idem::DeadLetterSelection selection = parse_selection(c.args);
    c.args.finish();
    const std::vector<idem::DeadLetter> letters =
        all ? c.store().dead_letters(selection) : parked(c.store(), selection);
    if (c.json) {
        fmt::print("{{\"dead_letters\":{}}}\n", letters_json(letters, false));
    } else {
        for (const auto& letter : letters)
            fmt::print("{}\n", letter_line(letter));
        fmt::print("{} dead letter(s)\n", letters.size());
    }
    return exit_done;
}

int redrive(Context& c) {
    idem::RedriveOptions options;
    options.destination = c.args.value("--destination").value_or("");
    options.dry_run = c.args.flag("--dry-run");
    const auto rate_text = c.args.value("--rate");
    const double rate = rate_text ? parse_rate("--rate", *rate_text) : 0;
    const idem::DeadLetterSelection selection = parse_selection(c.args);
    c.args.finish();
    Store& store = c.store();
    // One message at a time (a selection of its id), so the rate and the progress hold.
    const std::vector<idem::DeadLetter> letters = parked(store, selection);
    idem::RedriveReport report;
    report.dry_run = options.dry_run;
    Progress progress(options.dry_run ? "judged" : "redriven", letters.size());
    const auto start = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < letters.size(); ++i) {
        pace(rate, i, start);
        idem::DeadLetterSelection one;
        one.scope = letters[i].scope;
        one.message_ids = {letters[i].message_id};
        for (auto& entry : store.redrive(one, options).entries) {
            if (entry.letter.id == letters[i].id) report.entries.push_back(std::move(entry));
        }
        progress.tick(i + 1);
    }
    const std::size_t failed = report.count(idem::RedriveStatus::failed);
    const std::size_t nowhere = report.count(idem::RedriveStatus::no_destination);
    if (c.json) {
        std::string out = fmt::format("{{\"dry_run\":{},\"entries\":[", options.dry_run);
        for (std::size_t i = 0; i < report.entries.size(); ++i) {
            const auto& entry = report.entries[i];
            out += fmt::format("{}{{\"entry\":{},\"scope\":{},\"message_id\":{},\"status\":{}",
                               i ? "," : "", entry.letter.id, json_string(entry.letter.scope),
                               json_string(entry.letter.message_id),
                               json_string(idem::to_string(entry.status)));
            if (entry.status == idem::RedriveStatus::processed_meanwhile) {
                out +=
                    fmt::format(",\"recorded\":{}", json_string(idem::to_string(entry.recorded)));
            }
            if (!entry.error.empty()) out += fmt::format(",\"error\":{}", json_string(entry.error));
            out += "}";
        }
        fmt::print("{}]}}\n", out);
    } else {
        for (const auto& entry : report.entries) {
            fmt::print("{:>6}  {}  {}  {}{}\n", entry.letter.id, entry.letter.scope,
                       entry.letter.message_id, idem::to_string(entry.status),
                       entry.error.empty() ? "" : ": " + entry.error);
        }
        fmt::print(
            "{}: {} redriven, {} processed meanwhile, {} without a claim, {} without a "
            "destination, {} failed\n",
            options.dry_run ? "dry run" : "redrive", report.count(idem::RedriveStatus::redriven),
            report.count(idem::RedriveStatus::processed_meanwhile),
            report.count(idem::RedriveStatus::no_claim), nowhere, failed);
    }
    // Left parked for want of a destination is work not done, as a failure is.
    return failed + nowhere ? exit_some_failed : exit_done;
}

int purge_letters(Context& c) {
    const bool everything = c.args.flag("--everything");
    const bool dry_run = c.args.flag("--dry-run");
    const auto rate_text = c.args.value("--rate");
    const double rate = rate_text ? parse_rate("--rate", *rate_text) : 0;
    const idem::DeadLetterSelection selection = parse_selection(c.args);
    c.args.finish();
    if (selection_is_empty(selection) && !everything) {
        throw usage_problem(
            "dead-letters purge wants a selection (--scope, --id, --reason, --failure, --since, "
            "--before, --limit) or --everything");
    }
    Store& store = c.store();
    std::vector<idem::DeadLetter> purged;
    if (rate == 0 || dry_run) {
        purged = store.purge_dead_letters(selection, dry_run);
    } else {
        // One entry at a time: each call deletes the oldest entry the selection still takes.
        const std::size_t total = store.dead_letters(selection).size();
        idem::DeadLetterSelection oldest = selection;
        oldest.limit = 1;
        Progress progress("purged", total);
        const auto start = std::chrono::steady_clock::now();
        while (purged.size() < total) {
            pace(rate, purged.size(), start);
            auto letters = store.purge_dead_letters(oldest, false);
            if (letters.empty()) break;
            purged.push_back(std::move(letters.front()));
            progress.tick(purged.size());
        }
    }
    if (c.json) {
        fmt::print("{{\"dry_run\":{},\"purged\":{}}}\n", dry_run, letters_json(purged, false));
    } else {
        for (const auto& letter : purged)
            fmt::print("{}\n", letter_line(letter));
        fmt::print("{} dead letter(s) {}\n", purged.size(), dry_run ? "would be purged" : "purged");
    }
    return exit_done;
}

std::string outbox_json(const idem::OutboxRow& row) {
    return fmt::format(
        "{{\"entry\":{},\"destination\":{},\"idempotency_key\":{},\"created_at\":{},"
        "\"sent_at\":{},\"attempts\":{},\"last_error\":{},\"parked\":{}}}",
        row.id, json_string(row.destination), json_string(row.idempotency_key),
        json_string(iso_time(row.created_at)), optional_time_json(row.sent_at), row.attempts,
        json_string(row.last_error), row.parked);
}

std::string outbox_line(const idem::OutboxRow& row) {
    const std::string state =
        row.parked    ? fmt::format("parked after {} attempts: {}", row.attempts, row.last_error)
        : row.sent_at ? "sent " + iso_time(*row.sent_at)
                      : fmt::format("unsent ({} failed sends{}{})", row.attempts,
                                    row.last_error.empty() ? "" : ", last: ", row.last_error);
    return fmt::format("{:>6}  {}  to {}  key {}  {}", row.id, iso_time(row.created_at),
                       row.destination, row.idempotency_key, state);
}

/// One message's story, for `dead-letters show` and `claims show`: its claim, the attempts the
/// store counted, the failures noted since its last redrive, its dead-letter entries (parked
/// and redriven) and the outbox intents its attempts wrote (its effect's, its redrives').
int show_message(Context& c, const char* verb) {
    const auto scope = c.args.word();
    const auto id = c.args.word();
    if (!scope || !id) throw usage_problem(std::string(verb) + " wants SCOPE and ID");
    c.args.finish();
    idem::DeadLetterSelection selection;
    selection.scope = *scope;
    selection.message_ids = {*id};
    Store& store = c.store();
    const auto claim = store.find_claim(*scope, *id);
    const std::uint32_t attempts = store.attempts(*scope, *id);
    const auto failure = store.noted_failure(*scope, *id);
    const auto letters = store.dead_letters(selection);
    const auto intents = store.outbox_rows(*scope, *id);
    if (c.json) {
        std::string out = fmt::format(
            "{{\"scope\":{},\"message_id\":{},\"claim\":", json_string(*scope), json_string(*id));
        out += claim ? fmt::format("{{\"outcome\":{},\"reason\":{},\"claimed_at\":{}}}",
                                   json_string(idem::to_string(claim->disposition)),
                                   json_string(claim->reason),
                                   json_string(iso_time(claim->claimed_at)))
                     : std::string("null");
        out += fmt::format(",\"attempts\":{},\"failure\":", attempts);
        out += failure
                   ? fmt::format("{{\"text\":{},\"first_failed_at\":{},\"last_failed_at\":{}}}",
                                 json_string(failure->text), json_string(iso_time(failure->first)),
                                 json_string(iso_time(failure->last)))
                   : std::string("null");
        out += ",\"dead_letters\":" + letters_json(letters, true) + ",\"outbox\":[";
        for (std::size_t i = 0; i < intents.size(); ++i)
            out += (i ? "," : "") + outbox_json(intents[i]);
        fmt::print("{}]}}\n", out);
        return exit_done;
    }
    if (claim) {
        fmt::print("claim: {} at {}{}\n", idem::to_string(claim->disposition),
                   iso_time(claim->claimed_at),
                   claim->reason.empty() ? "" : " (" + claim->reason + ")");
    } else {
        fmt::print("no claim for {} in {}\n", *id, *scope);
    }
    fmt::print("attempts counted by the store: {}\n", attempts);
    if (failure) {
        fmt::print("failing from {} to {}, last: {}\n", iso_time(failure->first),
                   iso_time(failure->last), failure->text);
    }
    for (const auto& letter : letters) {
        fmt::print("dead letter {}\n  payload: {}\n", letter_line(letter),
                   shown_payload(letter.payload));
        if (letter.first_failed_at && letter.last_failed_at) {
            fmt::print("  failed from {} to {}, last: {}\n", iso_time(*letter.first_failed_at),
                       iso_time(*letter.last_failed_at), letter.failure);
        }
    }
    if (letters.empty()) fmt::print("no dead letter for {} in {}\n", *id, *scope);
    for (const auto& intent : intents)
        fmt::print("outbox {}\n", outbox_line(intent));
    return exit_done;
}

int purge_claims(Context& c) {
    const auto age = c.args.value("--older-than");
    if (!age) throw usage_problem("purge wants --older-than AGE (7d, 12h, ...)");
    const Clock::duration older_than = parse_age("--older-than", *age);
    idem::PurgeOptions options;
    if (auto rows = c.args.value("--batch-rows")) {
        options.batch_rows = static_cast<std::size_t>(parse_count("--batch-rows", *rows));
        if (options.batch_rows == 0) throw usage_problem("--batch-rows wants at least 1");
    }
    if (auto rate = c.args.value("--rows-per-second")) {
        options.max_rows_per_second = parse_rate("--rows-per-second", *rate);
    }
    if (auto budget = c.args.value("--time-budget")) {
        options.time_budget = std::chrono::seconds(parse_count("--time-budget", *budget));
    }
    c.args.finish();
    const idem::PurgeResult result = c.store().purge(older_than, options);
    const double seconds = std::chrono::duration<double>(result.elapsed).count();
    if (c.json) {
        fmt::print(
            "{{\"claims\":{},\"sent_intents\":{},\"expired_locks\":{},\"attempt_counts\":{},"
            "\"batches\":{},\"partitions_dropped\":{},\"complete\":{},\"seconds\":{:.3f}}}\n",
            result.claims, result.sent_intents, result.expired_locks, result.attempt_counts,
            result.batches, result.partitions_dropped, result.complete, seconds);
    } else {
        fmt::print(
            "purged {} claims{}, {} sent intents, {} expired locks, {} attempt counts in {} "
            "batches, {:.1f} s{}\n",
            result.claims,
            result.partitions_dropped > 0
                ? fmt::format(" ({} partitions dropped)", result.partitions_dropped)
                : std::string(),
            result.sent_intents, result.expired_locks, result.attempt_counts, result.batches,
            seconds, result.complete ? "" : " (stopped by its time budget)");
    }
    return exit_done;
}

int stats(Context& c) {
    c.args.finish();
    struct Counts {
        std::size_t parked = 0;
        std::size_t redriven = 0;
    };
    std::map<std::pair<std::string, std::string>, Counts> by_reason;
    std::map<std::string, Counts> by_scope;
    for (const auto& letter : c.store().dead_letters(idem::DeadLetterSelection{})) {
        auto& reason = by_reason[{letter.scope, letter.reason}];
        auto& scope = by_scope[letter.scope];
        (letter.redriven_at ? reason.redriven : reason.parked) += 1;
        (letter.redriven_at ? scope.redriven : scope.parked) += 1;
    }
    if (c.json) {
        std::string out = "{\"scopes\":[";
        bool first = true;
        for (const auto& [scope, counts] : by_scope) {
            out += fmt::format("{}{{\"scope\":{},\"parked\":{},\"redriven\":{}}}", first ? "" : ",",
                               json_string(scope), counts.parked, counts.redriven);
            first = false;
        }
        out += "],\"reasons\":[";
        first = true;
        for (const auto& [key, counts] : by_reason) {
            out += fmt::format("{}{{\"scope\":{},\"reason\":{},\"parked\":{},\"redriven\":{}}}",
                               first ? "" : ",", json_string(key.first), json_string(key.second),
                               counts.parked, counts.redriven);
            first = false;
        }
        fmt::print("{}]}}\n", out);
    } else {
        for (const auto& [key, counts] : by_reason) {
            fmt::print("{:>8} parked {:>8} redriven  {}  {}\n", counts.parked, counts.redriven,
                       key.first, key.second);
        }
        std::size_t parked = 0;
        for (const auto& [scope, counts] : by_scope)
            parked += counts.parked;
        fmt::print("{} dead letter(s) parked in {} scope(s)\n", parked, by_scope.size());
    }
    return exit_done;
}

int run(std::vector<std::string> argv) {
    Arguments args(std::move(argv));
    const bool help = args.flag("--help") || args.flag("-h");
    const bool json = args.flag("--json");
    std::optional<std::string> url = args.value("--store");
    const std::optional<std::string> first = args.word();
    if (!first) {
        std::fputs(general_usage, help ? stdout : stderr);
        return help ? exit_done : exit_usage;
    }
    std::string name = *first;
    if (name == "dead-letters" || name == "claims") {
        const auto second = args.word();
        if (!second) throw usage_problem(fmt::format("{} wants a command: see idem --help", name));
        name += " " + *second;
    }
    const Verb* verb = nullptr;
    for (const Verb& candidate : verbs) {
        if (name == candidate.name) verb = &candidate;
    }
    if (!verb) throw usage_problem(fmt::format("unknown command '{}': see idem --help", name));
    if (help) {
        fmt::print("{}", verb->usage);
        if (name == "dead-letters list" || name == "dead-letters redrive" ||
            name == "dead-letters purge") {
            fmt::print("{}", selection_usage);
        }
        return exit_done;
    }
    if (!url) {
        if (const char* env = std::getenv("IDEM_STORE")) url = env;
    }
    if (!url || url->empty()) throw usage_problem("no store: give --store URL or set IDEM_STORE");

    std::unique_ptr<Store> opened;
    Context context{args, json, [&]() -> Store& {
                        if (!opened) opened = open_store(*url);
                        return *opened;
                    }};
    if (name == "dead-letters list") return list_letters(context);
    if (name == "dead-letters show") return show_message(context, "dead-letters show");
    if (name == "dead-letters redrive") return redrive(context);
    if (name == "dead-letters purge") return purge_letters(context);
    if (name == "claims show") return show_message(context, "claims show");
    if (name == "purge") return purge_claims(context);
    return stats(context);
}

/// Prints @p message as the tool's one line (the library's messages start with "idem: " too).
void complain(std::string_view message) {
    while (message.rfind("idem: ", 0) == 0)
        message.remove_prefix(6);
    std::fprintf(stderr, "idem: %.*s\n", static_cast<int>(message.size()), message.data());
}

}  // namespace

int main(int argc, char** argv) {
    try {
        return run(std::vector<std::string>(argv + 1, argv + argc));
    } catch (const usage_problem& problem) {
        complain(problem.what());
        return exit_usage;
    } catch (const idem::usage_error& error) {
        complain(error.what());
        return exit_usage;
    } catch (const std::exception& error) {
        complain(error.what());
        return exit_store;
    }
}
