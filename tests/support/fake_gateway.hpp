#pragma once
// An in-process payment gateway that honours idempotency keys like Stripe: a new key makes one
// charge and returns its reference; the same key returns the first reference again.

#include <cstddef>
#include <map>
#include <mutex>
#include <string>

namespace idem_test {

class FakeGateway {
  public:
    struct Charge {
        std::string reference;
        long amount = 0;
    };

    /// Captures `amount` under `idempotency_key`; a repeated key returns the first charge.
    Charge capture(const std::string& idempotency_key, long amount) {
        std::lock_guard<std::mutex> lock(mutex_);
        ++requests_;
        auto it = charges_.find(idempotency_key);
        if (it != charges_.end()) return it->second;
        Charge charge{"ch_" + std::to_string(charges_.size() + 1), amount};
        charges_.emplace(idempotency_key, charge);
        return charge;
    }

    [[nodiscard]] std::size_t requests() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return requests_;
    }
    /// Charges really made (distinct keys).
    [[nodiscard]] std::size_t charges() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return charges_.size();
    }

  private:
    mutable std::mutex mutex_;
    std::size_t requests_ = 0;
    std::map<std::string, Charge> charges_;
};

}  // namespace idem_test
