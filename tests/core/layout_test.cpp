// The layout docs/architecture.md describes, checked on the headers themselves: which part of
// include/idem/ may include which, no include cycle, and the size limits of the headers.

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

const fs::path include_root = fs::path(IDEM_SOURCE_DIR) / "include" / "idem";

// Every header, by its path under include/idem/ ("store/redis/commit.hpp").
std::vector<std::string> headers() {
    std::vector<std::string> all;
    for (const auto& entry : fs::recursive_directory_iterator(include_root))
        if (entry.is_regular_file() && entry.path().extension() == ".hpp")
            all.push_back(entry.path().lexically_relative(include_root).generic_string());
    std::sort(all.begin(), all.end());
    return all;
}

std::string read(const std::string& header) {
    std::ifstream in(include_root / header);
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
}

// What a header includes of idem's own: `#include "idem/<path>"`.
std::vector<std::string> idem_includes(const std::string& header) {
    static const std::regex include_line(R"re(#include\s+"idem/([^"]+)")re");
    std::vector<std::string> found;
    const std::string text = read(header);
    for (std::sregex_iterator it(text.begin(), text.end(), include_line), end; it != end; ++it)
        found.push_back((*it)[1]);
    return found;
}

std::size_t line_count(const std::string& header) {
    const std::string text = read(header);
    return static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n'));
}

// The part a header belongs to: "core" for the loose headers of idem/, "store/redis" for the
// Redis store's parts, "testing" for the test kit and its conformance suite, else its folder.
std::string part_of(const std::string& header) {
    const auto slash = header.find('/');
    if (slash == std::string::npos) return "core";
    const std::string folder = header.substr(0, slash);
    if (folder == "store" && header.rfind("store/redis/", 0) == 0) return "store/redis";
    return folder;
}

// Which parts each part may include (besides itself), as docs/architecture.md lists them.
const std::map<std::string, std::set<std::string>>& allowed_parts() {
    static const std::map<std::string, std::set<std::string>> allowed{
        {"core", {"contract", "handler", "effects", "detail"}},
        {"contract", {"core"}},
        {"handler", {"core", "contract"}},
        {"effects", {"core", "contract", "detail"}},
        {"detail", {"core", "contract"}},
        {"observers", {"core", "contract", "detail"}},
        {"sql", {"core", "contract", "detail"}},
        {"sqlite", {"core", "contract", "sql"}},
        {"postgres", {"core", "contract", "sql", "detail"}},
        {"mysql", {"core", "contract", "sql"}},
        {"redis", {"core", "contract", "detail"}},
        {"store/redis", {"core", "contract", "detail", "redis"}},
        {"store",
         {"core", "contract", "detail", "sql", "sqlite", "postgres", "mysql", "redis",
          "store/redis"}},
        {"broker", {"core", "contract", "handler", "detail", "redis", "rabbitmq", "nats", "kafka"}},
        {"rabbitmq", {"core", "contract"}},
        {"nats", {"core", "contract"}},
        {"kafka", {"core", "contract"}},
        {"senders", {"core", "contract", "redis", "rabbitmq", "nats", "kafka"}},
        {"testing", {"core", "contract", "detail", "effects", "redis", "rabbitmq"}},
    };
    return allowed;
}

// The few single headers a part may include outside its parts, each a leaf the docs name.
const std::set<std::pair<std::string, std::string>>& allowed_headers() {
    static const std::set<std::pair<std::string, std::string>> allowed{
        {"core", "broker/pipeline.hpp"},              // idem.hpp brings in PipelinedLoop
        {"observers", "broker/consumer_health.hpp"},  // a leaf: config.hpp only
        // Each broker's consumer options (<client>/consumer_options.hpp) derive from the base's.
        {"kafka", "broker/consumer_options.hpp"},
        {"rabbitmq", "broker/consumer_options.hpp"},
        {"nats", "broker/consumer_options.hpp"},
        {"nats", "broker/redelivery_backoff.hpp"},  // jetstream_backoff() follows it
        {"redis", "broker/consumer_options.hpp"},
        {"testing", "broker/circuit_breaker.hpp"},  // the suite's probe cases
    };
    return allowed;
}

TEST(Layout, EveryIncludePointsToAPartItsPartMayInclude) {
    std::vector<std::string> wrong;
    for (const auto& header : headers()) {
        const std::string from = part_of(header);
        const auto rule = allowed_parts().find(from);
        if (rule == allowed_parts().end()) {
            wrong.push_back(header + ": a part docs/architecture.md does not name (" + from + ")");
            continue;
        }
        for (const auto& included : idem_includes(header)) {
            const std::string to = part_of(included);
            if (to == from || rule->second.count(to) || allowed_headers().count({from, included}))
                continue;
            wrong.push_back(header + " includes " + included + " (" + from + " -> " + to + ")");
        }
    }
    EXPECT_TRUE(wrong.empty()) << [&] {
        std::string all;
        for (const auto& line : wrong)
            all += line + "\n";
        return all;
    }();
}

TEST(Layout, NoBrokerHeaderIncludesAStore) {
    const std::set<std::string> store_parts{"store",  "store/redis", "sql",
                                            "sqlite", "postgres",    "mysql"};
    for (const auto& header : headers()) {
        if (part_of(header) != "broker") continue;
        for (const auto& included : idem_includes(header)) {
            EXPECT_EQ(store_parts.count(part_of(included)), 0u)
                << header << " includes " << included;
        }
    }
}

TEST(Layout, TheIncludeGraphHasNoCycle) {
    std::map<std::string, std::vector<std::string>> edges;
    const auto all = headers();
    for (const auto& header : all)
        edges[header] = idem_includes(header);

    enum class Mark { unvisited, on_path, done };
    std::map<std::string, Mark> mark;
    std::vector<std::string> path;
    std::string cycle;
    // Depth first; a header met again while on the path closes a cycle.
    std::function<void(const std::string&)> visit = [&](const std::string& header) {
        mark[header] = Mark::on_path;
        path.push_back(header);
        for (const auto& next : edges[header]) {
            if (!cycle.empty()) break;
            if (mark[next] == Mark::on_path) {
                auto start = std::find(path.begin(), path.end(), next);
                for (auto it = start; it != path.end(); ++it)
                    cycle += *it + " -> ";
                cycle += next;
            } else if (mark[next] == Mark::unvisited && edges.count(next)) {
                visit(next);
            }
        }
        path.pop_back();
        mark[header] = Mark::done;
    };
    for (const auto& header : all)
        if (mark[header] == Mark::unvisited && cycle.empty()) visit(header);
    EXPECT_TRUE(cycle.empty()) << cycle;
}

TEST(Layout, EveryIncludeNamesAHeaderThatExists) {
    for (const auto& header : headers()) {
        for (const auto& included : idem_includes(header)) {
            EXPECT_TRUE(fs::exists(include_root / included)) << header << " includes " << included;
        }
    }
}

TEST(Layout, NoPublicHeaderIsOver800Lines) {
    for (const auto& header : headers()) {
        EXPECT_LE(line_count(header), 800u) << header;
    }
}

TEST(Layout, TheBrokerBaseAndEveryAdapterAreAtMost500Lines) {
    for (const char* header :
         {"broker/consumer.hpp", "broker/redis_streams.hpp", "broker/rabbitmq.hpp",
          "broker/nats_jetstream.hpp", "broker/kafka.hpp"}) {
        EXPECT_LE(line_count(header), 500u) << header;
    }
}

TEST(Layout, TheRedisClientFolderHoldsNoStorePart) {
    // idem/redis/ is the client; the store's parts are under idem/store/redis/. A header there
    // that names RedisStore's transaction state, context or scripts is a store part gone astray.
    for (const auto& header : headers()) {
        if (part_of(header) != "redis") continue;
        for (const auto& included : idem_includes(header)) {
            EXPECT_NE(part_of(included), "store/redis") << header << " includes " << included;
        }
    }
}

}  // namespace
