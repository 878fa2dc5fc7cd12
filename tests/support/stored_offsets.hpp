#pragma once
// Stored offsets (idem/contract/stored_offset.hpp) for the backend tests: one offset committed
// by a transaction holding nothing but its hook, as a broker does after a duplicate.

#include <cstdint>
#include <string>
#include <utility>

#include "idem/contract/commit_hook.hpp"
#include "idem/contract/stored_offset.hpp"

namespace idem_test {

/// @return whether the commit did the hook (acked_in_commit).
template <class Store>
bool commit_offset(Store& store, std::string group, std::string topic, std::int32_t partition,
                   std::int64_t next_offset) {
    idem::CommitHook hook{
        idem::StoredOffset{std::move(group), std::move(topic), partition, next_offset}};
    auto tx = store.begin();
    if (!tx.attach(hook)) return false;
    tx.commit();
    return hook.acked_in_commit;
}

}  // namespace idem_test
