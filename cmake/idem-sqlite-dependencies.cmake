# Dependencies of idem::sqlite, included by idemConfig.cmake only when the sqlite component is
# requested. On failure find_dependency() sets idem_FOUND to FALSE and returns from this file.
find_dependency(SQLite3)
