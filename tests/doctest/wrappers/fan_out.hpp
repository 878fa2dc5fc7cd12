// Doc-test wrapper `fan_out`: the block is the body of a function that has a store, a policy,
// an effect, LoggingOptions and an spdlog logger (spdlog's default one).
#include <idem/idem.hpp>
#include <idem/observers/fan_out.hpp>
#include <idem/observers/logging.hpp>
#include <idem/observers/prometheus.hpp>
#include <idem/observers/spdlog.hpp>
#include <idem/store/memory.hpp>

#include <string>

inline void doctest_run() {
    idem::MemoryStore store;
    const idem::Policy policy{"capture"};
    auto effect = [](auto& tx, const std::string& order) { tx.put("captures", order, "1"); };
    idem::LoggingOptions options;
    auto logger = spdlog::default_logger();
    // @block
}
