#pragma once
/// @file
/// @brief idem::testing::TempDir: a fresh directory under the system temp dir, removed with
/// everything in it on destruction (a store's files in a test). Standard library only (and
/// idem/config.hpp: the versioned namespace).

#include <stdlib.h>

#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

#include "idem/config.hpp"

IDEM_BEGIN_NAMESPACE
namespace testing {

/// @brief A fresh directory (mkdtemp), removed with its contents by the destructor.
class TempDir {
  public:
    TempDir() {
        std::string pattern =
            (std::filesystem::temp_directory_path() / "idem-test-XXXXXX").string();
        if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
        path_ = pattern;
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    ~TempDir() {
        std::error_code ignored;
        std::filesystem::remove_all(path_, ignored);
    }
    [[nodiscard]] const std::filesystem::path& path() const { return path_; }
    [[nodiscard]] std::string file(const std::string& name) const {
        return (path_ / name).string();
    }

  private:
    std::filesystem::path path_;
};

}  // namespace testing
IDEM_END_NAMESPACE
