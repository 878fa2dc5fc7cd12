#pragma once
// --store-outage-ms (driver.cpp): the workers' store made unreachable for a while, again and
// again at seeded random moments, never two at once, while the driver goes on killing workers.
// A server store (PostgreSQL, MariaDB, the store's own redis-server) is alternately
//   - hung: SIGSTOP (PostgreSQL: the postmaster and every backend), SIGCONT at the end: the
//     workers' connections stay open and their calls wait (or time out, where the client has a
//     timeout: the Redis client's command_timeout);
//   - refused: SIGKILL, restarted on the same port and data at the end (crash recovery): the
//     workers' connections break and reconnecting is refused meanwhile.
// SQLite has no server: the driver holds BEGIN EXCLUSIVE on the database, so every worker's
// write transaction waits out its busy timeout and fails with store_timeout (the workers' busy
// timeout is a quarter of the outage, worker.cpp).
// Each outage lasts --store-outage-ms (plus the restart, for a refusal). The first one starts as
// soon as the driver sees a tenth of the messages delivered (start_soon()), so a fast run cannot
// drain before any outage; failing that, 0.5 to 1.5 times max(outage, 2 s) after the start. The
// next one starts 0.5 to 1.5 times max(outage, 2 s) after the end of the last.

#include <signal.h>
#include <sqlite3.h>
#include <sys/types.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "chaos.hpp"
#include "idem/testing/mariadb_server.hpp"
#include "idem/testing/postgres_server.hpp"
#include "idem/testing/redis_server.hpp"

namespace chaos {

class StoreOutages {
  public:
    using Clock = std::chrono::steady_clock;

    /// The store's server (at most one of them; none for SQLite, whose file is @p sqlite_path).
    struct Target {
        std::string sqlite_path;
        idem::testing::PostgresServer* postgres = nullptr;
        idem::testing::MariadbServer* mariadb = nullptr;
        idem::testing::RedisServer* redis = nullptr;
    };

    StoreOutages(const Options& options, Target target)
        : length_(options.store_outage),
          gap_(std::max<Clock::duration>(options.store_outage, std::chrono::seconds(2))),
          random_(options.seed ^ 0x5f0e0a7a9e5ull),  // apart from the kills' sequence
          target_(std::move(target)) {
        next_ = Clock::now() + next_gap();
    }
    StoreOutages(const StoreOutages&) = delete;
    StoreOutages& operator=(const StoreOutages&) = delete;
    ~StoreOutages() {
        try {
            end();
        } catch (...) {
        }
        if (db_ != nullptr) sqlite3_close(db_);
    }

    /// Starts the next outage or ends the one in progress when it is due. Returns a line to
    /// show when it did either (empty otherwise).
    std::string tick() {
        const auto now = Clock::now();
        if (!in_outage_ && now >= next_) {
            begin();
            until_ = Clock::now() + length_;
            return fmt::format("store outage {} ({}) begins", count_, last_kind_);
        }
        if (in_outage_ && now >= until_) {
            end();
            return fmt::format("store outage {} ({}) ended", count_, last_kind_);
        }
        return {};
    }

    /// Whether the store is down (or hung, or locked) now.
    [[nodiscard]] bool active() const noexcept { return in_outage_; }

    /// Makes the next outage due now, unless one is in progress (then the gap after it holds).
    void start_soon() {
        if (!in_outage_) next_ = std::min(next_, Clock::now());
    }

    /// Ends the outage in progress (before the workers are stopped and the store is read).
    void end() {
        if (!in_outage_) return;
        in_outage_ = false;
        if (target_.postgres != nullptr) {
            if (hung_) {
                resume_postgres();
            } else {
                target_.postgres->start();
            }
        } else if (target_.mariadb != nullptr) {
            if (hung_) {
                ::kill(target_.mariadb->pid(), SIGCONT);
            } else {
                target_.mariadb->start();
            }
        } else if (target_.redis != nullptr) {
            if (hung_) {
                target_.redis->resume();
            } else {
                target_.redis->start();
            }
        } else {
            exec("ROLLBACK");
        }
        next_ = Clock::now() + next_gap();
    }

    [[nodiscard]] long count() const noexcept { return count_; }
    [[nodiscard]] long hangs() const noexcept { return hangs_; }
    [[nodiscard]] long refusals() const noexcept { return refusals_; }
    [[nodiscard]] long locks() const noexcept { return locks_; }

  private:
    Clock::duration next_gap() {
        return std::chrono::duration_cast<Clock::duration>(
            gap_ * std::uniform_real_distribution<double>(0.5, 1.5)(random_));
    }

    void begin() {
        ++count_;
        in_outage_ = true;
        const bool server =
            target_.postgres != nullptr || target_.mariadb != nullptr || target_.redis != nullptr;
        hung_ = server && count_ % 2 == 1;  // a hang first, then a refusal, alternately
        if (!server) {
            ++locks_;
            last_kind_ = "exclusive lock";
            exec("BEGIN EXCLUSIVE");
            return;
        }
        if (hung_) {
            ++hangs_;
            last_kind_ = "SIGSTOP";
        } else {
            ++refusals_;
            last_kind_ = "SIGKILL, restart";
        }
        if (target_.postgres != nullptr) {
            if (hung_) {
                stop_postgres();
            } else {
                target_.postgres->kill9();
            }
        } else if (target_.mariadb != nullptr) {
            if (hung_) {
                ::kill(target_.mariadb->pid(), SIGSTOP);
            } else {
                target_.mariadb->kill9();
            }
        } else if (hung_) {
            target_.redis->pause();
        } else {
            target_.redis->kill9();
        }
    }

    /// The postmaster first (it forks no new backend then), then every backend.
    void stop_postgres() {
        const pid_t postmaster = target_.postgres->pid();
        ::kill(postmaster, SIGSTOP);
        stopped_ = idem::testing::detail::children_of(postmaster);
        for (pid_t child : stopped_)
            ::kill(child, SIGSTOP);
    }
    void resume_postgres() {
        for (pid_t child : stopped_)
            ::kill(child, SIGCONT);
        ::kill(target_.postgres->pid(), SIGCONT);
        stopped_.clear();
    }

    /// On the driver's own connection to the SQLite file (it waits for a worker's transaction
    /// to end before it holds the lock).
    void exec(const char* sql) {
        if (db_ == nullptr) {
            if (sqlite3_open(target_.sqlite_path.c_str(), &db_) != SQLITE_OK) {
                throw std::runtime_error("store outage: open " + target_.sqlite_path);
            }
            sqlite3_busy_timeout(db_, 30'000);
        }
        char* error = nullptr;
        if (sqlite3_exec(db_, sql, nullptr, nullptr, &error) != SQLITE_OK) {
            const std::string message = error != nullptr ? error : "?";
            sqlite3_free(error);
            throw std::runtime_error(std::string("store outage: ") + sql + ": " + message);
        }
    }

    Clock::duration length_;
    Clock::duration gap_;
    std::mt19937_64 random_;
    Target target_;
    sqlite3* db_ = nullptr;
    bool in_outage_ = false;
    bool hung_ = false;
    Clock::time_point next_{};
    Clock::time_point until_{};
    std::vector<pid_t> stopped_;
    long count_ = 0;
    long hangs_ = 0;
    long refusals_ = 0;
    long locks_ = 0;
    const char* last_kind_ = "";
};

}  // namespace chaos
