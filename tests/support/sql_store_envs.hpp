#pragma once
// The memory store and every SQL store this build has, as one list for typed tests, and the
// names those tests print (each environment's `name`).

#include <gtest/gtest.h>

#include <string>
#include <type_traits>

#include "store_envs.hpp"
#if IDEM_HAS_POSTGRES
#include "postgres_env.hpp"
#include "require_postgres.hpp"
#endif
#if IDEM_HAS_MYSQL
#include "mysql_env.hpp"
#include "require_mariadb.hpp"
#endif

namespace idem_test {

using MemoryAndSqlEnvs = ::testing::Types<MemoryEnv
#if IDEM_HAS_SQLITE
                                          ,
                                          SqliteEnv
#endif
#if IDEM_HAS_POSTGRES
                                          ,
                                          PostgresEnv
#endif
#if IDEM_HAS_MYSQL
                                          ,
                                          MysqlEnv
#endif
                                          >;

/// A typed test's fixture over one of those environments: a fresh store per test, and the
/// test skipped (failed under CI=true) when the store's server is missing.
template <class Env>
class StoreEnvTest : public ::testing::Test {
  protected:
    Env env;
    typename Env::Store& store() { return *env.store; }

    void SetUp() override {
#if IDEM_HAS_POSTGRES
        if constexpr (std::is_same_v<Env, PostgresEnv>) IDEM_REQUIRE_POSTGRES();
#endif
#if IDEM_HAS_MYSQL
        if constexpr (std::is_same_v<Env, MysqlEnv>) IDEM_REQUIRE_MARIADB();
#endif
    }
};

struct EnvNames {
    template <class Env>
    static std::string GetName(int) {
        return Env::name;
    }
};

}  // namespace idem_test
