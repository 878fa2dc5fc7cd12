// The redis component's test kit is installed and usable: idem/testing/redis_server.hpp compiles
// in a user's project and links with idem::redis (hiredis). No server is started here.
#include <string>

#include <idem/testing/redis_server.hpp>

bool idem_consumer_redis_testing_kit_links() {
    std::string why;
    (void)idem::testing::RedisServer::available(&why);  // true or false: both fine here
    idem::testing::RedisClient client{"127.0.0.1", 1};  // connects on first use only
    return !client.connected();
}
