# Dependencies of idem::postgres, included by idemConfig.cmake only when the postgres component
# is requested. On failure find_dependency() sets idem_FOUND to FALSE and returns from this file.
find_dependency(PostgreSQL)
