// Doc-test wrapper `store_concept`: the block declares a store type at namespace scope; it must
// be what the handler's check (idem/contract/store.hpp) accepts as a store.
#include <idem/idem.hpp>

#include <chrono>
#include <optional>
#include <string_view>
#include <vector>

// @block

static_assert(idem::is_store_v<MyStore>, "the synopsis is a store idem accepts");
static_assert(idem::check_store<MyStore>());
static_assert(std::is_move_constructible_v<MyStore::Transaction> &&
              !std::is_copy_constructible_v<MyStore::Transaction>);
#if IDEM_HAS_CONCEPTS
static_assert(idem::IdempotencyStore<MyStore>);
#endif
