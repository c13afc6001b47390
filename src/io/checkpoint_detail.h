// What the checkpoint writer and reader share (io/checkpoint.cpp, io/checkpoint_write.cpp): the
// names of the format, and the helpers that keep every rank in step.
#pragma once
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/comm.h"
#include "io/checkpoint.h"

namespace moetrain::checkpoint_detail {

namespace fs = std::filesystem;
using json = nlohmann::json;

inline constexpr int kVersion = 2;
inline constexpr const char* kManifest = "manifest.json";
inline constexpr const char* kModelIndex = "model.safetensors.index.json";
inline constexpr std::array<const char*, 3> kFamilies = {"model", "optimizer", "state"};

inline const std::vector<TensorPiece>& family(const CheckpointShare& s, std::size_t f) {
  return f == 0 ? s.model : f == 1 ? s.optimizer : s.state;
}

inline bool is_whole(const TensorPiece& p) {
  return p.begin == 0 && p.end == shape_numel(p.shape);
}

// The piece's tensor name inside its safetensors file: the global name for a whole tensor (what
// transformers looks for), with the element range appended for a slice.
inline std::string piece_key(const TensorPiece& p) {
  return is_whole(p) ? p.name : fmt::format("{}[{}:{}]", p.name, p.begin, p.end);
}

inline void broadcast_string(Comm& comm, std::string& s, int root) {
  int64_t n = static_cast<int64_t>(s.size());
  comm.broadcast(&n, sizeof(n), {root});
  s.resize(static_cast<std::size_t>(n));
  if (n > 0) comm.broadcast(s.data(), n, {root});
}

// Runs f on every rank. If it throws anywhere, every rank throws (the failing rank its own error,
// the others the lowest failing rank's message), so no rank goes on into a collective that the
// others have left.
template <class F>
void on_every_rank(Comm* comm, F&& f) {
  std::exception_ptr failure;
  std::string message;
  try {
    f();
  } catch (const std::exception& e) {
    failure = std::current_exception();
    message = e.what();
  }
  if (comm == nullptr || comm->size() == 1) {
    if (failure) std::rethrow_exception(failure);
    return;
  }
  std::vector<int64_t> failed = comm->allgather_one(failure ? 1 : 0);
  auto it = std::find(failed.begin(), failed.end(), int64_t{1});
  if (it == failed.end()) return;
  const int q = static_cast<int>(it - failed.begin());
  broadcast_string(*comm, message, q);
  if (comm->rank() == q) std::rethrow_exception(failure);
  MOETRAIN_FAIL("rank {}: {}", q, message);
}

inline void fsync_dir(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  MOETRAIN_CHECK(fd >= 0, "cannot open directory {} to sync it", dir.string());
  int rc = ::fsync(fd);
  ::close(fd);
  MOETRAIN_CHECK(rc == 0, "cannot fsync directory {}", dir.string());
}

// The step of a directory named `prefix` + 8 digits, else −1.
inline int64_t step_of(const fs::path& dir, std::string_view prefix = "step_") {
  std::string name = dir.filename().string();
  if (!name.starts_with(prefix) || name.size() != prefix.size() + 8) return -1;
  int64_t step = 0;
  for (char ch : name.substr(prefix.size())) {
    if (ch < '0' || ch > '9') return -1;
    step = step * 10 + (ch - '0');
  }
  return step;
}


// Checks the manifest's tensor table against its file table; `where` names the manifest.
void check_tensors(json& tensors, const json& files, const fs::path& where);

}  // namespace moetrain::checkpoint_detail
