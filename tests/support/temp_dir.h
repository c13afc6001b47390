// Test support: a uniquely named temporary directory, removed with everything in it on scope exit.
#pragma once
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <system_error>

namespace moetrain::testing {

class TempDir {
 public:
  explicit TempDir(std::string_view tag = "test") {
    static std::atomic<int> counter{0};
    const auto base = std::filesystem::temp_directory_path();
    // pid + counter keeps parallel ctest processes and repeated fixtures apart.
    for (;;) {
      path_ = base / ("moetrain_" + std::string(tag) + "_" + std::to_string(::getpid()) + "_" +
                      std::to_string(counter++));
      if (std::filesystem::create_directory(path_)) break;
    }
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(std::string_view name) const { return path_ / name; }

  // Writes `bytes` to `name` inside the directory and returns its path.
  std::filesystem::path write(std::string_view name, std::string_view bytes) const {
    auto p = path_ / name;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p;
  }

 private:
  std::filesystem::path path_;
};

inline std::string read_file_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

}  // namespace moetrain::testing
