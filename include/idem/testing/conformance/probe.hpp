#pragma once
/// @file
/// @brief The conformance test of the circuit breaker's probe (idem::probe_store, what every
/// consumer's breaker runs before it reads again): it must reach the store's server, so it fails
/// while the server is down and passes again once it is back. A probe that passes against a dead
/// server keeps the consumer pulling through the outage, every delivery failing and spending the
/// broker's delivery count. The environment takes the server down and brings it back
/// (Env::stop_server(), Env::start_server()); one without them fails this test with what to add.
/// Part of idem/testing/conformance.hpp, which registers the suite; include that one.

#include <chrono>
#include <exception>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

#include "idem/broker/circuit_breaker.hpp"
#include "idem/delivery.hpp"
#include "idem/error.hpp"
#include "idem/outcome.hpp"
#include "idem/testing/conformance/suite.hpp"

namespace idem {
namespace testing {
namespace conformance {

/// An environment that can take its store's server down and bring it back: `stop_server()`,
/// `start_server()`.
template <class Env, class = void>
struct can_stop_server : std::false_type {};
template <class Env>
struct can_stop_server<Env, std::void_t<decltype(std::declval<Env&>().stop_server()),
                                        decltype(std::declval<Env&>().start_server())>>
    : std::true_type {};

/// What one probe did: "" when it passed, else the exception's kind and text.
template <class Store>
std::string probe_result(Store& store, bool* unreachable) {
    *unreachable = false;
    try {
        idem::probe_store(store);
        return "";
    } catch (const store_unavailable& e) {
        *unreachable = true;
        return std::string("store_unavailable: ") + e.what();
    } catch (const store_timeout& e) {
        *unreachable = true;
        return std::string("store_timeout: ") + e.what();
    } catch (const std::exception& e) {
        return std::string("another exception: ") + e.what();
    }
}

}  // namespace conformance
}  // namespace testing
}  // namespace idem

/// The probe fails (store_unavailable or store_timeout) while the server is down, twice in a row
/// (a breaker probes again after its backoff), and passes once it is back (within 30 s: a server
/// replaying its log after a restart may refuse for a while, and so may the probe), after which
/// the store takes claims again. First the store is used, so a session or pooled connection
/// exists: an idle connection that was not told of the outage must not pass the probe.
TYPED_TEST_P(IdemStoreConformance, ProbeFailsWhileTheServerIsDownAndPassesOnceItIsBack) {
    using Env = std::remove_reference_t<decltype(this->env)>;
    if constexpr (!idem::testing::conformance::can_stop_server<Env>::value) {
        FAIL() << Env::name
               << ": the environment has no stop_server() / start_server(), so the circuit "
                  "breaker's probe cannot be checked against an outage. Add them: stop_server() "
                  "makes the store's server unreachable (kill it, stop it, or for a store with no "
                  "server inject the failure), start_server() brings it back.";
    } else {
        auto handler = this->writer();
        ASSERT_EQ(
            handler.handle(idem::Delivery{"probe-before", 1u}, std::string("before")).disposition,
            idem::Disposition::processed);
        bool unreachable = false;
        EXPECT_EQ(idem::testing::conformance::probe_result(this->store(), &unreachable), "")
            << "the probe failed against a store that is up";

        this->env.stop_server();
        for (int i = 0; i < 2; ++i) {
            const std::string result =
                idem::testing::conformance::probe_result(this->store(), &unreachable);
            EXPECT_TRUE(unreachable)
                << "probe " << i + 1 << " while the server is down: "
                << (result.empty() ? "it passed (the probe does not reach the server)" : result);
        }
        this->env.start_server();

        std::string last;
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        do {
            last = idem::testing::conformance::probe_result(this->store(), &unreachable);
            if (last.empty()) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        } while (std::chrono::steady_clock::now() < deadline);
        EXPECT_EQ(last, "") << "the probe still fails after the server came back";
        EXPECT_EQ(
            handler.handle(idem::Delivery{"probe-after", 1u}, std::string("after")).disposition,
            idem::Disposition::processed);
        EXPECT_TRUE(this->env.has_effect("before"));
        EXPECT_TRUE(this->env.has_effect("after"));
    }
}
