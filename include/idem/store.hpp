#pragma once
/// @file
/// @brief The Store concept; forwards to idem/contract/store.hpp (the capabilities, checks and
/// concept) and idem/contract/records.hpp (the values a store exchanges).

#include "idem/contract/store.hpp"
