// Doc-test wrapper `refund_overlap`: the block is the body of a function that has a store
// (MemoryStore) and the user's gateway; RefundRequested has its idem_payload. doctest_run() then
// refunds while another job holds the invoice (deferred, back after the 15 s release) and
// after it let go (processed).
#include <idem/idem.hpp>
#include <idem/store/memory.hpp>

#include <chrono>
#include <string>

struct RefundRequested {
    std::string invoice_id;
    long amount = 0;
};
inline std::string idem_payload(const RefundRequested& m) {
    return m.invoice_id;
}

struct RefundGateway {
    int refunds = 0;
    std::string refund(const std::string& key, long /*amount*/) {
        ++refunds;
        return "re-" + key;
    }
};

inline void doctest_run() {
    idem::MemoryStore store;
    RefundGateway gateway;
    // @block
    const RefundRequested m{"42", 1250};
    IDEM_DOCTEST_CHECK(store.hold_lock("invoice-42", "nightly-batch", std::chrono::minutes(1)));
    const idem::Outcome blocked = refund.handle(idem::Delivery{"m-1", 1u}, m);
    IDEM_DOCTEST_CHECK(blocked.disposition == idem::Disposition::deferred);
    IDEM_DOCTEST_CHECK(blocked.retry_after == std::chrono::milliseconds(15000));
    store.release_lock("invoice-42", "nightly-batch");
    IDEM_DOCTEST_CHECK(refund.handle(idem::Delivery{"m-1", 2u}, m).disposition ==
                       idem::Disposition::processed);
    IDEM_DOCTEST_CHECK(gateway.refunds == 1);
}
