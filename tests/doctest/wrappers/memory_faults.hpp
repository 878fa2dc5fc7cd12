// Doc-test wrapper `memory_faults`: the block injects faults into a MemoryStore; doctest_run()
// then handles deliveries and checks what each fault does, in the order the store meets them
// (begin, claim, commit).
#include <idem/idem.hpp>
#include <idem/store/memory.hpp>

#include <string>

inline void doctest_run() {
    // @block
    auto handler = idem::make_handler(
        store, idem::Policy{"capture"},
        [](auto& tx, const std::string& body) { tx.put("captures", body, "captured"); });
    auto cause_of_next = [&] {
        const idem::Outcome outcome = handler.handle(idem::Delivery{"m-1", 1u}, std::string("x"));
        IDEM_DOCTEST_CHECK(outcome.disposition == idem::Disposition::failed);
        return outcome.cause;
    };
    using idem::FailureCause;
    IDEM_DOCTEST_CHECK(cause_of_next() == FailureCause::store_unavailable);  // begin
    IDEM_DOCTEST_CHECK(cause_of_next() == FailureCause::store_unavailable);  // claim
    IDEM_DOCTEST_CHECK(cause_of_next() == FailureCause::store_unavailable);  // claim
    IDEM_DOCTEST_CHECK(cause_of_next() == FailureCause::commit_failed);      // commit
    IDEM_DOCTEST_CHECK(store.count("captures") == 0);                        // nothing stored
    IDEM_DOCTEST_CHECK(handler.handle(idem::Delivery{"m-1", 1u}, std::string("x")).disposition ==
                       idem::Disposition::processed);
}
