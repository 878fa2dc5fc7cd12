// Doc-test wrapper `redrive`: the block brings dead letters back. Before it, a MemoryStore holds
// a message parked at the poison limit, and a relay hands each outbox intent to the consumer as
// a delivery of its key (what a broker sender and consumer do); the consumer's effect is fixed
// by then. After it, doctest_run() checks that the message ran once and its intent went out.
#include <idem/idem.hpp>
#include <idem/outbox.hpp>
#include <idem/store/memory.hpp>

#include <string>

inline void doctest_run() {
    idem::MemoryStore store;
    bool fixed = false;
    auto consumer = idem::make_handler(store, idem::Policy{"capture-payment"},
                                       [&](auto& tx, const std::string& body) {
                                           if (!fixed) throw std::runtime_error("gateway 503");
                                           tx.put("captures", body, "captured");
                                       });
    IDEM_DOCTEST_CHECK(
        consumer.handle(idem::Delivery{"pay-8814", 5u}, std::string("8814")).disposition ==
        idem::Disposition::dead_lettered);
    fixed = true;
    idem::Relay relay{store, [&](const idem::OutboxRow& row) {
                          consumer.handle(idem::Delivery{row.idempotency_key, 1u}, row.payload);
                      }};
    // @block
    IDEM_DOCTEST_CHECK(report.count(idem::RedriveStatus::redriven) == 1);
    IDEM_DOCTEST_CHECK(store.count("captures") == 1);
    IDEM_DOCTEST_CHECK(
        store.redrive(selection, options).count(idem::RedriveStatus::already_redriven) == 1);
    IDEM_DOCTEST_CHECK(store.outbox_rows().size() == 1);
}
