#pragma once
// The chaos run's payment gateway: two Lua scripts inside the run's redis-server, so it lives
// outside every worker process and survives their deaths. Real idempotency-key semantics:
//
//   request(key)  the key already has a charge  → that charge's reference, nothing new
//                 a request with the key is in flight → refused: "in flight"
//                 otherwise → the key is marked in flight (for --inflight-ms, so a request
//                 whose worker was killed does not block the key for ever) and accepted
//   ... the request takes a random time (0..--latency-ms): the worker sleeps ...
//   finish(key)   makes the ONE charge of the key, stores its reference, clears the in-flight
//                 mark and returns the reference (or the existing one, if another request
//                 finished first; or refuses if another request now holds the key)
//
// A worker killed between request and finish made no charge (the request never completed).
// Keys: gw:requests, gw:charges (charges made), gw:refused (INCR counters), gw:ref:<key> (the
// key's charge), gw:inflight:<key> (PX), gw:charged:<order> (a list: every charge of the order,
// which is what the verification compares with the captures).

#include <chrono>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "idem/error.hpp"
#include "idem/redis/connection.hpp"

namespace chaos {

inline constexpr const char* gw_requests_key = "gw:requests";
inline constexpr const char* gw_charges_key = "gw:charges";
inline constexpr const char* gw_refused_key = "gw:refused";
inline std::string gw_charged_key(long order) {
    return "gw:charged:" + std::to_string(order);
}

// KEYS: gw:ref:<key>, gw:inflight:<key>, gw:requests, gw:refused. ARGV: token, inflight_ms.
inline constexpr const char* gateway_request_source = R"(
redis.call('INCR', KEYS[3])
local ref = redis.call('GET', KEYS[1])
if ref then return {'charged', ref} end
if not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('INCR', KEYS[4])
  return redis.error_reply('in flight: a request with this idempotency key is being processed')
end
return {'accepted', ''}
)";

// KEYS: gw:ref:<key>, gw:inflight:<key>, gw:charges, gw:charged:<order>, gw:refused.
// ARGV: token.
inline constexpr const char* gateway_finish_source = R"(
local ref = redis.call('GET', KEYS[1])
local holder = redis.call('GET', KEYS[2])
if ref then
  if holder == ARGV[1] then redis.call('DEL', KEYS[2]) end
  return ref
end
if holder and holder ~= ARGV[1] then
  redis.call('INCR', KEYS[5])
  return redis.error_reply('in flight: another request took over this idempotency key')
end
local n = redis.call('INCR', KEYS[3])
ref = string.format('ch_%06d', n)
redis.call('SET', KEYS[1], ref)
redis.call('RPUSH', KEYS[4], ref)
if holder then redis.call('DEL', KEYS[2]) end
return ref
)";

/// What the gateway answers when it refuses a request (the effect lets it escape: failed, not
/// acked, redelivered).
struct gateway_refused : std::runtime_error {
    using std::runtime_error::runtime_error;
};

/// A worker's client of the gateway. Not thread-safe (one per worker; workers are single-threaded).
class GatewayClient {
  public:
    GatewayClient(idem::redis::Connection& connection, std::chrono::milliseconds latency,
                  std::chrono::milliseconds inflight, std::mt19937_64& random)
        : connection_(connection), latency_(latency), inflight_(inflight), random_(random) {}

    /// Captures @p amount for @p order under @p idempotency_key; returns the charge's reference.
    /// @throws gateway_refused ("in flight"), std::runtime_error when the gateway is unreachable.
    std::string capture(const std::string& idempotency_key, long order, long /*amount*/) {
        static const idem::redis::Script request{"gateway request", gateway_request_source};
        static const idem::redis::Script finish{"gateway finish", gateway_finish_source};
        const std::string ref_key = "gw:ref:" + idempotency_key;
        const std::string inflight_key = "gw:inflight:" + idempotency_key;
        const std::string token = fmt::format("{:016x}", random_());
        idem::redis::Reply reply =
            call(request, {ref_key, inflight_key, gw_requests_key, gw_refused_key},
                 {token, std::to_string(inflight_.count())});
        if (reply.is_array() && reply.elements.size() == 2 && reply.elements[0].str == "charged") {
            return reply.elements[1].str;
        }
        // The request takes time; the worker may be killed meanwhile (no charge is then made).
        std::uniform_int_distribution<long> micros(0, static_cast<long>(latency_.count()) * 1000);
        std::this_thread::sleep_for(std::chrono::microseconds(micros(random_)));
        reply = call(finish,
                     {ref_key, inflight_key, gw_charges_key, gw_charged_key(order), gw_refused_key},
                     {token});
        if (reply.type != idem::redis::Reply::Type::string || reply.str.empty()) {
            throw std::runtime_error("gateway: unexpected reply to finish");
        }
        return reply.str;
    }

  private:
    idem::redis::Connection& connection_;
    std::chrono::milliseconds latency_;
    std::chrono::milliseconds inflight_;
    std::mt19937_64& random_;

    idem::redis::Reply call(const idem::redis::Script& script, const std::vector<std::string>& keys,
                            const std::vector<std::string>& args) {
        idem::redis::Reply reply;
        try {
            reply = connection_.eval(script, keys, args);
        } catch (const idem::error& e) {  // not a store error: the gateway is another system
            throw std::runtime_error(fmt::format("gateway unreachable: {}", e.what()));
        }
        if (reply.is_error()) {
            if (reply.str.find("in flight") != std::string::npos) throw gateway_refused(reply.str);
            throw std::runtime_error("gateway: " + reply.str);
        }
        return reply;
    }
};

}  // namespace chaos
