// The SQL stores in a pre-fork worker pool: the parent makes the store and uses it, then fork()s
// workers that use the same (inherited) store object. A sqlite3* or PGconn* must not be used by
// two processes (SQLite: "do not carry an open connection across fork()"; a PGconn's socket
// shared by two processes interleaves their protocol messages), so a child's first use drops the
// inherited connection without a word to the server or the file and opens its own; a borrowed
// connection cannot be reopened: usage_error. Real SQLite files and a real PostgreSQL server;
// children report through pipes and every wait is bounded.

#include <gtest/gtest.h>
#include <libpq-fe.h>
#include <sqlite3.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

#include "idem/effects/overlap.hpp"
#include "idem/handler.hpp"
#include "idem/idem.hpp"
#include "idem/store/postgres.hpp"
#include "idem/store/sqlite.hpp"
#include "idem/testing/postgres_server.hpp"
#include "idem/testing/temp_dir.hpp"
#include "support/forked_child.hpp"
#include "support/require_postgres.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;
using namespace std::chrono_literals;
using Line = std::optional<std::string>;

using Child = idem_test::ForkedChild;

// ---------------------------------------------------------------------------------------------
// The two environments: a store that opens its own connection (short lock waits, so a sibling
// blocked by a live holder answers quickly), and one on a borrowed connection.

struct SqliteForkEnv {
    using Store = idem::SqliteStore;
    static constexpr bool needs_postgres = false;
    static constexpr const char* insert = "INSERT INTO effects(k) VALUES (?1)";
    static constexpr const char* count_sql = "SELECT count(*) FROM effects WHERE k = ?1";
    // BEGIN IMMEDIATE makes writers take turns: a sibling waits out the busy timeout (failed,
    // store_timeout) while a live worker holds the write lock, for a claim or an overlap lock.
    static constexpr const char* blocked_claim = "failed";
    static constexpr const char* blocked_lock = "failed";

    idem::testing::TempDir dir;
    std::string path = dir.file("idem.db");
    sqlite3* raw = nullptr;

    SqliteForkEnv() {
        Store setup{path};
        setup.execute("CREATE TABLE effects(k TEXT NOT NULL)");
    }
    SqliteForkEnv(const SqliteForkEnv&) = delete;
    SqliteForkEnv& operator=(const SqliteForkEnv&) = delete;
    ~SqliteForkEnv() {
        if (raw != nullptr) sqlite3_close(raw);
    }
    std::unique_ptr<Store> owned() {
        idem::SqliteOptions options;
        options.busy_timeout = 300ms;
        return std::make_unique<Store>(path, options);
    }
    std::unique_ptr<Store> borrowed() {
        if (sqlite3_open(path.c_str(), &raw) != SQLITE_OK) throw std::runtime_error("open");
        return std::make_unique<Store>(raw);
    }
    /// No session to tell apart on SQLite.
    static long long session(Store&) { return 0; }
};

struct PostgresForkEnv {
    using Store = idem::PostgresStore;
    static constexpr bool needs_postgres = true;
    static constexpr const char* insert = "INSERT INTO effects(k) VALUES ($1)";
    static constexpr const char* count_sql = "SELECT count(*) FROM effects WHERE k = $1";
    // The sibling's INSERT waits on the holder's uncommitted claim row up to lock_timeout:
    // in_progress. The overlap lock is a session's advisory lock: deferred.
    static constexpr const char* blocked_claim = "in_progress";
    static constexpr const char* blocked_lock = "deferred";

    std::string database;
    PGconn* raw = nullptr;

    PostgresForkEnv() {
        if (!idem::testing::PostgresServer::available()) return;
        auto& server = idem::testing::shared_postgres();
        database = server.fresh_database();
        server.exec("CREATE TABLE effects(k TEXT NOT NULL)", database);
    }
    PostgresForkEnv(const PostgresForkEnv&) = delete;
    PostgresForkEnv& operator=(const PostgresForkEnv&) = delete;
    ~PostgresForkEnv() {
        if (raw != nullptr) PQfinish(raw);
        if (database.empty()) return;
        try {
            idem::testing::shared_postgres().exec(
                "DROP DATABASE IF EXISTS " + database + " WITH (FORCE)", "postgres");
        } catch (...) {  // a leftover database dies with the test server
        }
    }
    std::unique_ptr<Store> owned() {
        idem::PostgresOptions options;
        options.lock_timeout = 300ms;
        return std::make_unique<Store>(idem::testing::shared_postgres().conninfo(database),
                                       options);
    }
    std::unique_ptr<Store> borrowed() {
        raw = idem::testing::shared_postgres().connect(database);
        return std::make_unique<Store>(raw);
    }
    /// The server process of the store's session.
    static long long session(Store& store) {
        return store.query_int("SELECT pg_backend_pid()").value_or(-1);
    }
};

template <class Env>
class SqlForkTest : public ::testing::Test {
  protected:
    using Store = typename Env::Store;

    void SetUp() override {
        if constexpr (Env::needs_postgres) IDEM_REQUIRE_POSTGRES();
        env_ = std::make_unique<Env>();
        store_ = env_->owned();
        // The parent uses the store before forking: a claim committed, statements prepared.
        auto handler = writer(*store_, "warm-up");
        ASSERT_EQ(handler.handle(Delivery{"warm", 1u}, std::string("warm")).disposition,
                  Disposition::processed);
    }
    void TearDown() override {
        store_.reset();
        env_.reset();
    }

  public:
    /// A handler whose effect inserts the body into `effects`, then runs @p inside.
    static auto writer(
        Store& store, const std::string& scope, std::function<void()> inside = [] {}) {
        return idem::make_handler(store, idem::Policy{scope},
                                  [inside](auto& tx, const std::string& body) {
                                      tx.execute(Env::insert, body);
                                      inside();
                                  });
    }
    /// The same behind the overlap lock on invoice-42.
    static auto locked(
        Store& store, std::function<void()> inside = [] {}) {
        return idem::make_handler(
            store, idem::Policy{"refund"},
            idem::without_overlapping([](const std::string&) { return idem::key("invoice", "42"); },
                                      idem::OverlapOptions{},
                                      [inside](auto& tx, const std::string& body) {
                                          tx.execute(Env::insert, body);
                                          inside();
                                      }));
    }
    /// Retries @p handle until it stops answering @p blocked; sends the first and the last
    /// disposition. The broker's count stays 2 (the retries here are not redeliveries).
    template <class Handle, class Send>
    static void retry(Handle&& handle, const Send& send) {
        auto outcome = handle();
        send(std::string(idem::to_string(outcome.disposition)));
        const auto deadline = std::chrono::steady_clock::now() + 60s;
        while ((outcome.disposition == Disposition::in_progress ||
                outcome.disposition == Disposition::failed ||
                outcome.disposition == Disposition::deferred) &&
               std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(50ms);
            outcome = handle();
        }
        send(std::string(idem::to_string(outcome.disposition)) + " " + outcome.reason);
    }

  protected:
    long long effects(Store& store, const std::string& k) {
        return store.query_int(Env::count_sql, k).value_or(-1);
    }

    std::unique_ptr<Env> env_;
    std::unique_ptr<Store> store_;
};

using Envs = ::testing::Types<SqliteForkEnv, PostgresForkEnv>;
class EnvNames {
  public:
    template <class T>
    static std::string GetName(int) {
        return std::is_same_v<T, SqliteForkEnv> ? "sqlite" : "postgres";
    }
};
TYPED_TEST_SUITE(SqlForkTest, Envs, EnvNames);

// (a) A child that claimed X is SIGKILLed inside its effect: its transaction rolls back, and a
// sibling, blocked while the holder lived, then processes X exactly once.
TYPED_TEST(SqlForkTest, AKilledChildsClaimRollsBackAndASiblingProcessesItOnce) {
    auto& store = *this->store_;
    Child a([&](const auto& send) {
        auto handler = this->writer(store, "orders", [&] {
            send("claimed");
            ::sleep(120);  // killed long before
        });
        handler.handle(Delivery{"X", 1u}, std::string("x"));
        send("not killed");
    });
    ASSERT_EQ(a.line(), Line("claimed"));
    Child b([&](const auto& send) {
        auto handler = this->writer(store, "orders");
        this->retry([&] { return handler.handle(Delivery{"X", 2u}, std::string("x")); }, send);
    });
    EXPECT_EQ(b.line(), Line(TypeParam::blocked_claim))
        << "a sibling got past a live worker's claim (the two shared one connection?)";
    a.kill();
    const Line last = b.line(90s);
    ASSERT_TRUE(last.has_value());
    EXPECT_EQ(last->rfind("processed", 0), 0u) << *last;
    b.kill();
    EXPECT_EQ(this->effects(store, "x"), 1);
    auto claim = store.find_claim("orders", "X");
    ASSERT_TRUE(claim.has_value());
    EXPECT_EQ(claim->disposition, Disposition::processed);
}

// (b) The overlap lock, held by a child inside its open transaction, keeps a sibling out (SQLite:
// BEGIN IMMEDIATE serialises the two; PostgreSQL: the advisory lock of the holder's session,
// which must not be the sibling's session too); once the holder is killed the sibling runs.
TYPED_TEST(SqlForkTest, TheOverlapLockExcludesASibling) {
    auto& store = *this->store_;
    Child a([&](const auto& send) {
        auto handler = this->locked(store, [&] {
            send("locked");
            ::sleep(120);  // killed long before
        });
        handler.handle(Delivery{"refund-1", 1u}, std::string("a"));
    });
    ASSERT_EQ(a.line(), Line("locked"));
    Child b([&](const auto& send) {
        auto handler = this->locked(store);
        this->retry(
            [&] {
                return handler.handle(Delivery{"refund-2", 1u}, std::string("b"));
            },
            send);
    });
    EXPECT_EQ(b.line(), Line(TypeParam::blocked_lock))
        << "a sibling got into a lock another worker holds";
    a.kill();
    const Line last = b.line(90s);
    ASSERT_TRUE(last.has_value());
    EXPECT_EQ(last->rfind("processed", 0), 0u) << *last;
    b.kill();
    EXPECT_EQ(this->effects(store, "a"), 0);
    EXPECT_EQ(this->effects(store, "b"), 1);
}

// (c) Children that used the inherited store, and one that only destroyed it, leave the parent's
// connection alone: on PostgreSQL the parent's session is still the same one (a child's PQfinish
// or PQreset on the inherited PGconn would have sent Terminate on it), and each child had its own.
TYPED_TEST(SqlForkTest, TheParentsConnectionOutlivesChildrenThatUsedOrDestroyedTheStore) {
    auto& store = *this->store_;
    const long long parent_session = TypeParam::session(store);
    for (int i = 0; i < 2; ++i) {
        Child used([&](const auto& send) {
            auto handler = this->writer(store, "orders");
            const auto outcome =
                handler.handle(Delivery{"c" + std::to_string(i), 1u}, "c" + std::to_string(i));
            send(std::string(idem::to_string(outcome.disposition)));
            send(std::to_string(TypeParam::session(store)));
            this->store_.reset();  // the child's own connection closes
            send("done");
        });
        EXPECT_EQ(used.line(), Line("processed"));
        const Line session = used.line();
        ASSERT_TRUE(session.has_value());
        if (parent_session != 0) {
            EXPECT_NE(std::stoll(*session), parent_session)
                << "the child sent its statements in the parent's session";
        }
        EXPECT_EQ(used.line(), Line("done"));
        EXPECT_EQ(used.wait(), std::optional<int>(0));
    }
    Child destroyed([&](const auto& send) {
        this->store_.reset();  // never used in the child: the parent's connection, dropped
        send("done");
    });
    EXPECT_EQ(destroyed.line(), Line("done"));
    EXPECT_EQ(destroyed.wait(), std::optional<int>(0));

    auto handler = this->writer(store, "orders");
    const auto outcome = handler.handle(Delivery{"p", 1u}, std::string("p"));
    EXPECT_EQ(outcome.disposition, Disposition::processed) << outcome.reason;
    EXPECT_EQ(TypeParam::session(store), parent_session) << "the parent's session was ended";
    EXPECT_EQ(this->effects(store, "c0"), 1);
    EXPECT_EQ(this->effects(store, "c1"), 1);
    EXPECT_EQ(this->effects(store, "p"), 1);
}

// (d) A borrowed connection cannot be reopened by the store: its use in a child is a usage_error
// that names the fix, and the parent's connection is left alone.
TYPED_TEST(SqlForkTest, ABorrowedConnectionInAChildIsAUsageError) {
    auto borrowed = this->env_->borrowed();
    auto handler = this->writer(*borrowed, "borrowed");
    ASSERT_EQ(handler.handle(Delivery{"b1", 1u}, std::string("b1")).disposition,
              Disposition::processed);
    const long long parent_session = TypeParam::session(*borrowed);
    Child child([&](const auto& send) {
        for (int i = 0; i < 2; ++i) {  // each use, not only the first
            try {
                auto tx = borrowed->begin();
                send("no error");
            } catch (const idem::usage_error& e) {
                send(std::string("usage_error: ") + e.what());
            }
        }
        try {
            (void)borrowed->find_claim("borrowed", "b1");
            send("no error");
        } catch (const idem::usage_error& e) {
            send(std::string("usage_error: ") + e.what());
        }
        borrowed.reset();  // must not touch the consumer's connection either
        send("done");
    });
    for (int i = 0; i < 3; ++i) {
        const Line line = child.line();
        ASSERT_TRUE(line.has_value());
        EXPECT_EQ(line->rfind("usage_error: ", 0), 0u) << *line;
        EXPECT_NE(line->find("fork()"), std::string::npos) << *line;
        EXPECT_NE(line->find("after fork()"), std::string::npos) << *line;
        EXPECT_NE(line->find("let the store open it"), std::string::npos) << *line;
    }
    EXPECT_EQ(child.line(), Line("done"));
    EXPECT_EQ(child.wait(), std::optional<int>(0));
    EXPECT_EQ(handler.handle(Delivery{"b2", 1u}, std::string("b2")).disposition,
              Disposition::processed);
    EXPECT_EQ(TypeParam::session(*borrowed), parent_session);
    EXPECT_EQ(this->effects(*borrowed, "b2"), 1);
}

// A transaction begun before fork() cannot go on in the child (it is the parent's, on the
// parent's connection); its destructor in the child sends nothing, and the parent commits it.
TYPED_TEST(SqlForkTest, ATransactionBegunBeforeForkCannotGoOnInTheChild) {
    auto& store = *this->store_;
    auto tx = store.begin();
    ASSERT_EQ(tx.claim("orders", "T").status, idem::ClaimStatus::claimed);
    Child child([&](const auto& send) {
        try {
            tx.execute(TypeParam::insert, std::string("child"));
            send("no error");
        } catch (const idem::usage_error& e) {
            send(std::string("usage_error: ") + e.what());
        }
        tx.rollback();
        send("done");
    });
    const Line line = child.line();
    ASSERT_TRUE(line.has_value());
    EXPECT_NE(line->find("begun in the parent"), std::string::npos) << *line;
    EXPECT_EQ(child.line(), Line("done"));
    EXPECT_EQ(child.wait(), std::optional<int>(0));
    tx.execute(TypeParam::insert, std::string("t"));
    tx.record_outcome("orders", "T", Disposition::processed, "");
    tx.commit();
    EXPECT_EQ(this->effects(store, "t"), 1);
    EXPECT_EQ(this->effects(store, "child"), 0);
}

// SQLite: the child's connection is its own, so its locks are real ones. In WAL mode a
// connection keeps SQLite's SHARED lock on the database file while it is open; a child still on
// the inherited sqlite3* believes it holds the parent's (bookkeeping copied by fork()) and holds
// none, so a checkpoint-on-close elsewhere could delete the WAL under it.
TEST(SqliteForkLocks, AChildHoldsSqlitesSharedLockOfItsOwn) {
    SqliteForkEnv env;
    auto store = env.owned();
    auto handler = SqlForkTest<SqliteForkEnv>::writer(*store, "orders");
    ASSERT_EQ(handler.handle(Delivery{"warm", 1u}, std::string("warm")).disposition,
              Disposition::processed);
    Child child([&](const auto& send) {
        auto mine = SqlForkTest<SqliteForkEnv>::writer(*store, "orders");
        const auto outcome = mine.handle(Delivery{"c", 1u}, std::string("c"));
        send(std::string(idem::to_string(outcome.disposition)));
        ::sleep(120);  // killed long before
    });
    ASSERT_EQ(child.line(), Line("processed"));
    // The parent lets go of its own connection first: closing the probe's descriptor below
    // would drop every POSIX lock this process has on the file.
    store.reset();
    const int fd = ::open(env.path.c_str(), O_RDWR | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    struct flock probe {};
    probe.l_type = F_WRLCK;
    probe.l_whence = SEEK_SET;
    probe.l_start = 0x40000002;  // SQLite's SHARED_FIRST
    probe.l_len = 510;           // SHARED_SIZE
    ASSERT_EQ(::fcntl(fd, F_GETLK, &probe), 0);
    ::close(fd);
    EXPECT_NE(probe.l_type, F_UNLCK) << "the child holds no lock on the database file";
    EXPECT_EQ(probe.l_pid, child.pid());
    child.kill();
    EXPECT_EQ(env.owned()->query_int("SELECT count(*) FROM effects WHERE k = 'c'"), 1);
}

}  // namespace
