// Doc-test wrapper `circuit_breaker`: the block is a consumer loop's step on a MemoryStore that
// is unreachable once (an injected begin fault): the breaker opens, probes and closes again.
#include <idem/broker/circuit_breaker.hpp>
#include <idem/idem.hpp>
#include <idem/store/memory.hpp>

#include <string>

inline void doctest_run() {
    idem::MemoryStore store;
    auto handler = idem::make_handler(
        store, idem::Policy{"capture"},
        [](auto& tx, const std::string& body) { tx.put("captures", body, "captured"); });
    const idem::Delivery delivery{"m-1", 1u};
    const std::string body = "order 8814";
    bool stopping = false;
    store.inject(idem::Fault::begin);  // the store is unreachable for this delivery
    // @block
    IDEM_DOCTEST_CHECK(breaker.stats().opened == 1);
    IDEM_DOCTEST_CHECK(breaker.stats().probes == 1);
    IDEM_DOCTEST_CHECK(!breaker.is_open());  // the probe found the store back
    IDEM_DOCTEST_CHECK(handler.handle(delivery, body).disposition == idem::Disposition::processed);
}
