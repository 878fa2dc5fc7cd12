#pragma once
// The memory store and every SQL store this build has, as one list for typed tests, and the
// names those tests print (each environment's `name`).

#include <gtest/gtest.h>

#include <string>

#include "store_envs.hpp"
#if IDEM_HAS_POSTGRES
#include "postgres_env.hpp"
#endif
#if IDEM_HAS_MYSQL
#include "mysql_env.hpp"
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

struct EnvNames {
    template <class Env>
    static std::string GetName(int) {
        return Env::name;
    }
};

}  // namespace idem_test
