// The store conformance suite (idem/testing/conformance.hpp, installed) instantiated for idem's
// own stores: the memory store always, each backend's when this build has it. Built again as
// redis_cluster_conformance_test: a RedisStore given one node of a Redis Cluster only (one
// cluster per process, so that binary runs as one ctest test).

#include "idem/testing/conformance.hpp"

#include <gtest/gtest.h>

#include <string>

#include "idem/idem.hpp"
#include "support/store_envs.hpp"  // IDEM_HAS_<NAME>: which stores this build has
#if IDEM_HAS_POSTGRES
#include "support/postgres_env.hpp"
#endif
#if IDEM_HAS_REDIS
#include "support/redis_env.hpp"
#endif
#if IDEM_HAS_MYSQL
#include "support/mysql_env.hpp"
#endif
#if IDEM_CONFORMANCE_ON_REDIS_CLUSTER  // redis_cluster_conformance_test: this file again
#include "support/redis_cluster_env.hpp"
#endif

namespace {

#if IDEM_CONFORMANCE_ON_REDIS_CLUSTER
using Stores = ::testing::Types<idem_test::RedisClusterEnv>;
using DurableStores = Stores;
#else
using Stores =
    ::testing::Types<idem_test::MemoryEnv
#if IDEM_HAS_SQLITE
                     ,
                     idem_test::SqliteEnv
#endif
#if IDEM_HAS_POSTGRES
                     ,
                     idem_test::PostgresEnv, idem_test::PostgresPartitionedEnv
#endif
#if IDEM_HAS_REDIS
                     ,
                     idem_test::RedisEnv, idem_test::RedisLocalEnv
#endif
#if IDEM_HAS_MYSQL
                     ,
                     idem_test::MysqlEnv, idem_test::MysqlReadCommittedEnv,
                     idem_test::MysqlPartitionedEnv, idem_test::MysqlPartitionedReadCommittedEnv
#endif
                     >;
#if IDEM_HAS_SQLITE
// Every store but the memory fake keeps its data across a restart: the durability suite.
using DurableStores = ::testing::Types<idem_test::SqliteEnv
#if IDEM_HAS_POSTGRES
                                       ,
                                       idem_test::PostgresEnv
#endif
#if IDEM_HAS_REDIS
                                       ,
                                       idem_test::RedisEnv, idem_test::RedisLocalEnv
#endif
#if IDEM_HAS_MYSQL
                                       ,
                                       idem_test::MysqlEnv, idem_test::MysqlReadCommittedEnv
#endif
                                       >;
#endif
#endif

#if IDEM_CONFORMANCE_ON_REDIS_CLUSTER
using RedriveStores = Stores;
#else
// The stores with redrive() (contract/redrive.hpp): every store.
using RedriveStores =
    ::testing::Types<idem_test::MemoryEnv
#if IDEM_HAS_SQLITE
                     ,
                     idem_test::SqliteEnv
#endif
#if IDEM_HAS_POSTGRES
                     ,
                     idem_test::PostgresEnv, idem_test::PostgresPartitionedEnv
#endif
#if IDEM_HAS_REDIS
                     ,
                     idem_test::RedisEnv, idem_test::RedisLocalEnv
#endif
#if IDEM_HAS_MYSQL
                     ,
                     idem_test::MysqlEnv, idem_test::MysqlReadCommittedEnv,
                     idem_test::MysqlPartitionedEnv, idem_test::MysqlPartitionedReadCommittedEnv
#endif
                     >;
#endif

// Every store fits the Store concept: the C++17 trait, and the C++20 concept where available.
template <class... Envs>
constexpr bool all_fit(::testing::Types<Envs...>*) {
    return (idem::is_store_v<typename Envs::Store> && ...);
}
static_assert(all_fit(static_cast<Stores*>(nullptr)));
static_assert(!idem::is_store_v<int>);
#if IDEM_HAS_CONCEPTS
template <class... Envs>
constexpr bool all_model(::testing::Types<Envs...>*) {
    return (idem::IdempotencyStore<typename Envs::Store> && ...);
}
static_assert(all_model(static_cast<Stores*>(nullptr)));
static_assert(!idem::IdempotencyStore<std::string>);
#endif

}  // namespace

INSTANTIATE_TYPED_TEST_SUITE_P(Idem, IdemStoreConformance, Stores, idem::testing::ConformanceNames);
INSTANTIATE_TYPED_TEST_SUITE_P(Idem, IdemRedriveConformance, RedriveStores,
                               idem::testing::ConformanceNames);
#if IDEM_CONFORMANCE_ON_REDIS_CLUSTER || IDEM_HAS_SQLITE
INSTANTIATE_TYPED_TEST_SUITE_P(Idem, IdemDurableStoreConformance, DurableStores,
                               idem::testing::ConformanceNames);
#else
// Built with no store but the memory fake (every component off): nothing keeps data across a
// restart, so the durability suite has no store to run on.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(IdemDurableStoreConformance);
#endif
