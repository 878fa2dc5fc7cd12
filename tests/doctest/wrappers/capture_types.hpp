// Doc-test types (`// @use capture_types`, no block of its own): the user's own types the
// docs' capture examples name. A payment message, and a gateway that honours idempotency keys:
// a key it has seen gets its first charge back.
#include <map>
#include <string>

struct CapturePayment {
    std::string order_id;
    std::string token;
    long amount = 0;
    std::string to_json() const {
        return "{\"order_id\":\"" + order_id + "\",\"amount\":" + std::to_string(amount) + "}";
    }
};

struct Charge {
    std::string reference;
};

struct Gateway {
    std::map<std::string, Charge> charges;  // by idempotency key
    int requests = 0;
    Charge capture(const std::string& /*token*/, long /*amount*/, const std::string& key) {
        ++requests;
        auto it = charges.find(key);
        if (it == charges.end()) it = charges.emplace(key, Charge{"ch-" + key}).first;
        return it->second;
    }
};
