// Built by tests/consumer_pkgconfig/Makefile with `pkg-config --cflags --libs idem-postgres
// idem-redis` only: the headers compile, the stores fit, and libpq and hiredis link (their
// functions are called; no server is needed).
#include <cstdio>

#include <idem/idem.hpp>
#include <idem/store/postgres.hpp>
#include <idem/store/redis.hpp>

int main() {
    static_assert(idem::is_store_v<idem::PostgresStore>, "PostgresStore must fit");
    static_assert(idem::is_store_v<idem::RedisStore>, "RedisStore must fit");
    const int libpq = PQlibVersion();
    redisReader* reader = redisReaderCreate();
    const bool hiredis = reader != nullptr;
    if (reader != nullptr) redisReaderFree(reader);
    if (libpq <= 0 || !hiredis) {
        std::printf("idem-pkgconfig FAILED: libpq %d, hiredis reader %d\n", libpq, hiredis);
        return 1;
    }
    std::printf("idem-pkgconfig components ok (libpq %d)\n", libpq);
    return 0;
}
