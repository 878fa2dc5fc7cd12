// Doc-test wrapper `crash_test`: the block is a GoogleTest file at namespace scope; before it,
// the user's own helpers it names (a gateway fake on its own file, a temp dir, the schema, a row
// count), after it the definition of the idem_payload it declares. Compiled only: the tests are
// registered, not run (tests/testing/testing_kit_test.cpp runs the complete version).
#include <cstdlib>
#include <string>

// @use capture_types

struct FileGateway {
    explicit FileGateway(const std::string& /*path*/) {}
    std::string capture(const std::string& key, long /*amount*/) { return "ch-" + key; }
    long long charges() { return 0; }
};

struct TempDir {
    std::string file(const std::string& name) const { return "/tmp/" + name; }
};

inline void create_schema(const std::string& /*db_path*/) {}
inline long long count_rows(const std::string& /*db_path*/, const std::string& /*table*/) {
    return 0;
}

// @block

std::string idem_payload(const CapturePayment& m) {
    return m.to_json();
}
