// Test support for tests/dist: a temporary directory every rank sees. Rank 0 owns it and
// announces its path; it is removed once every rank is done with it.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "core/comm.h"
#include "support/temp_dir.h"

namespace moetrain::testing {

class SharedDir {
 public:
  SharedDir(Comm& comm, const char* tag) : comm_(comm) {
    std::string p;
    if (comm.rank() == 0) {
      own_ = std::make_unique<TempDir>(tag);
      p = own_->path().string();
    }
    int64_t n = static_cast<int64_t>(p.size());
    comm.broadcast(&n, sizeof(n));
    p.resize(static_cast<std::size_t>(n));
    comm.broadcast(p.data(), n);
    path_ = p;
  }
  ~SharedDir() { comm_.barrier(); }  // nobody still reads it when rank 0 removes it
  SharedDir(const SharedDir&) = delete;
  SharedDir& operator=(const SharedDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  Comm& comm_;
  std::unique_ptr<TempDir> own_;
  std::filesystem::path path_;
};

}  // namespace moetrain::testing
