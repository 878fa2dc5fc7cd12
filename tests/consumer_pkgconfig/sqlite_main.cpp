// Built by tests/consumer_pkgconfig/Makefile with `pkg-config --cflags --libs idem-sqlite` only:
// a handler on the SQLite store, whose redelivery must be a duplicate.
#include <cstdio>
#include <string>

#include <idem/idem.hpp>
#include <idem/store/sqlite.hpp>

int main() {
    static_assert(IDEM_VERSION_MAJOR == 0 && IDEM_VERSION_MINOR == 1, "unexpected idem version");
    idem::SqliteStore store(":memory:");
    int runs = 0;
    auto handler = idem::make_handler(store, idem::Policy{"pkgconfig-check"},
                                      [&](auto& tx, const std::string& body) {
                                          ++runs;
                                          tx.execute("CREATE TABLE IF NOT EXISTS t(v TEXT)");
                                          tx.execute("INSERT INTO t(v) VALUES (?)", body);
                                      });
    const auto first = handler.handle(idem::Delivery{"m-1", 1u}, std::string("hello"));
    const auto second = handler.handle(idem::Delivery{"m-1", 2u}, std::string("hello"));
    if (first.disposition != idem::Disposition::processed ||
        second.disposition != idem::Disposition::duplicate || runs != 1) {
        std::printf("idem-pkgconfig FAILED: %s / %s / runs=%d\n",
                    std::string(idem::to_string(first.disposition)).c_str(),
                    std::string(idem::to_string(second.disposition)).c_str(), runs);
        return 1;
    }
    std::printf("idem-pkgconfig sqlite ok\n");
    return 0;
}
