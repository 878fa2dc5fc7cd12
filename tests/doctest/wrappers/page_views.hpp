// Doc-test wrapper `page_views`: the block is the body of a function that has a RedisStore;
// PageView has its idem_payload. Compiled only: it needs a server.
#include <idem/idem.hpp>
#include <idem/store/redis.hpp>

#include <string>

struct PageView {
    std::string page;
};
inline std::string idem_payload(const PageView& v) {
    return v.page;
}

inline void doctest_run() {
    idem::RedisStore store{idem::RedisEndpoint{"127.0.0.1", 6379}};
    // @block
}
