// RedisStore in a pre-fork pool: the parent makes the store and uses it, then fork()s workers that
// use the same (inherited) store object. Each process must draw its own lease tokens (a sibling
// that repeated its parent's sequence would take a killed worker's lease, or an overlap lock, as
// its own) and open its own connections (an inherited socket is the parent's too). Every test
// runs against the shared test redis-server; children report through pipes and every wait is
// bounded.

#include <gtest/gtest.h>

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

#include "idem/idem.hpp"
#include "idem/store/redis.hpp"
#include "idem/testing/redis_server.hpp"
#include "support/forked_child.hpp"
#include "support/redis_env.hpp"
#include "support/require_redis.hpp"

namespace {

using idem::Delivery;
using idem::Disposition;
using namespace std::chrono_literals;

using Child = idem_test::ForkedChild;

class RedisForkTest : public ::testing::Test {
  protected:
    void SetUp() override {
        IDEM_REQUIRE_REDIS();
        auto& server = idem::testing::shared_redis();
        server.flushall();
        idem::RedisOptions options;
        options.lease = 5s;  // the server's clock: it is shared by every process
        store_ = std::make_unique<idem::RedisStore>(idem_test::redis_endpoint(server), options);
        // The parent uses the store on its main thread before forking: a token drawn, a claim
        // committed, a connection pooled.
        auto handler =
            idem::make_handler(*store_, idem::Policy{"warm-up"},
                               [](auto& tx, const std::string&) { tx.write("INCR", "w"); });
        ASSERT_EQ(handler.handle(Delivery{"warm", 1u}, std::string("x")).disposition,
                  Disposition::processed);
        parent_client_id_ = client_id();
    }

    long long client_id() {
        return store_->with_connection([](idem::redis::Connection& c) {
            return c.checked({"CLIENT", "ID"}, "CLIENT ID").integer;
        });
    }
    long long counter(const std::string& key) {
        auto reply = store_->with_connection([&](idem::redis::Connection& c) {
            return c.checked({"GET", key}, "GET");
        });
        return reply.is_nil() ? 0 : std::stoll(reply.str);
    }

    std::unique_ptr<idem::RedisStore> store_;
    long long parent_client_id_ = 0;
};

TEST_F(RedisForkTest, TokensDifferBetweenAParentAndItsForkedChild) {
    (void)idem::redis::new_lease_token();  // the parent has drawn before the fork
    Child child([](const auto& send) {
        send(idem::redis::new_lease_token());
        send(idem::redis::new_lease_token());
    });
    const std::string parent_next = idem::redis::new_lease_token();
    const std::string parent_after = idem::redis::new_lease_token();
    auto first = child.line();
    auto second = child.line();
    ASSERT_TRUE(first && second) << "the child reported nothing";
    EXPECT_EQ(first->size(), 32u);
    EXPECT_NE(*first, parent_next);
    EXPECT_NE(*second, parent_after);
    EXPECT_NE(*first, *second);
}

TEST_F(RedisForkTest, AChildOpensItsOwnConnectionAndTheParentKeepsItsOwn) {
    const std::size_t trips = store_->round_trips();
    Child child([this](const auto& send) { send(std::to_string(client_id())); });
    auto reported = child.line();
    ASSERT_TRUE(reported) << "the child reported nothing";
    EXPECT_NE(std::stoll(*reported), parent_client_id_)
        << "the child sent its commands on the parent's socket";
    child.kill();
    // The child closed its copy of the pooled socket: the parent's connection still works, and
    // is still the same one (not a reconnect after a broken socket).
    EXPECT_EQ(client_id(), parent_client_id_);
    EXPECT_GT(store_->round_trips(), trips);
}

TEST_F(RedisForkTest, ASiblingWaitsOutAKilledWorkersLeaseThenProcessesOnce) {
    auto make = [this] {
        return idem::make_handler(
            *store_, idem::Policy{"orders"},
            [](auto& tx, const std::string& body) { tx.write("INCR", "effects:" + body); });
    };
    // Worker A claims X and is killed inside the effect, holding the lease.
    Child a([&](const auto& send) {
        auto handler = idem::make_handler(*store_, idem::Policy{"orders"},
                                          [&](auto& tx, const std::string& body) {
                                              tx.write("INCR", "effects:" + body);
                                              send("claimed");
                                              ::sleep(120);  // killed long before
                                          });
        handler.handle(Delivery{"X", 1u}, std::string("x"));
        send("not killed");
    });
    ASSERT_EQ(a.line(), std::optional<std::string>("claimed"));
    a.kill();

    // Worker B, forked from the same parent after A: X is in progress while A's lease lives,
    // then B takes it over and processes it once.
    Child b([&](const auto& send) {
        auto handler = make();
        auto first = handler.handle(Delivery{"X", 2u}, std::string("x"));
        send(std::string(idem::to_string(first.disposition)));
        const auto deadline = std::chrono::steady_clock::now() + 60s;
        auto outcome = first;
        while (outcome.disposition == Disposition::in_progress &&
               std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(100ms);
            outcome = handler.handle(Delivery{"X", 3u}, std::string("x"));
        }
        send(std::string(idem::to_string(outcome.disposition)));
    });
    EXPECT_EQ(b.line(), std::optional<std::string>("in_progress"))
        << "a sibling took a killed worker's live lease as its own";
    EXPECT_EQ(b.line(90s), std::optional<std::string>("processed"));
    b.kill();
    EXPECT_EQ(counter("effects:x"), 1);
    EXPECT_EQ(store_->attempts("orders", "X"), 2u);
    auto claim = store_->find_claim("orders", "X");
    ASSERT_TRUE(claim.has_value());
    EXPECT_EQ(claim->disposition, Disposition::processed);
    // The parent's pooled connection survived both children.
    EXPECT_EQ(client_id(), parent_client_id_);
}

TEST_F(RedisForkTest, TheOverlapLockExcludesASibling) {
    auto locked = [this](const std::function<void()>& inside) {
        return idem::make_handler(
            *store_, idem::Policy{"refund"},
            idem::without_overlapping([](const std::string&) { return idem::key("invoice", "42"); },
                                      idem::OverlapOptions{},
                                      [inside](auto& tx, const std::string& body) {
                                          tx.write("INCR", "refunds:" + body);
                                          inside();
                                      }));
    };
    Child a([&](const auto& send) {
        auto handler = locked([&] {
            send("locked");
            ::sleep(120);  // killed long before
        });
        handler.handle(Delivery{"refund-1", 1u}, std::string("a"));
    });
    ASSERT_EQ(a.line(), std::optional<std::string>("locked"));
    Child b([&](const auto& send) {
        auto handler = locked([] {});
        auto outcome = handler.handle(Delivery{"refund-2", 1u}, std::string("b"));
        send(std::string(idem::to_string(outcome.disposition)));
    });
    EXPECT_EQ(b.line(), std::optional<std::string>("deferred"))
        << "a sibling got into a lock another worker holds";
    b.kill();
    a.kill();
    EXPECT_EQ(counter("refunds:b"), 0);
}

}  // namespace
