#include "io/checkpoint.h"

#include <fmt/format.h>
#include <zlib.h>

#include <fcntl.h>
#include <unistd.h>
#include <algorithm>

#include "core/check.h"
#include "core/log.h"
#include "io/safetensors.h"

namespace fs = std::filesystem;

namespace moetrain {

namespace {

constexpr const char* kFiles[] = {"model.safetensors", "config.json", "optimizer.safetensors",
                                  "state.safetensors", "trainer_state.json"};

uint32_t crc32_of(const uint8_t* data, std::size_t n) {
  uLong crc = crc32(0L, Z_NULL, 0);
  // zlib's length is a uInt: feed large files in pieces.
  while (n > 0) {
    uInt piece = static_cast<uInt>(std::min<std::size_t>(n, 1u << 30));
    crc = crc32(crc, data, piece);
    data += piece, n -= piece;
  }
  return static_cast<uint32_t>(crc);
}

void write_tensors(const fs::path& path, const std::vector<NamedTensor>& tensors) {
  SafetensorsWriter w;
  for (const auto& t : tensors) w.add(t.name, SafetensorsDType::F32, t.shape, t.data);
  // transformers' from_pretrained refuses a safetensors file whose metadata does not name the
  // framework whose layout the tensors follow; ours are PyTorch's (row-major, (out, in) weights).
  w.set_metadata("format", "pt");
  w.write(path);
}

void read_tensors(const fs::path& path, const std::vector<NamedTensor>& tensors) {
  if (tensors.empty()) return;
  SafetensorsReader r(path);
  for (const auto& t : tensors) {
    MOETRAIN_CHECK(r.contains(t.name),
                   "{}: no tensor '{}' (the checkpoint is of a different model or run?)",
                   path.string(), t.name);
    MOETRAIN_CHECK(r.shape(t.name) == t.shape, "{}: tensor '{}' has shape {}, this run expects {}",
                   path.string(), t.name, shape_str(r.shape(t.name)), shape_str(t.shape));
    r.copy_to_f32(t.name, t.data, shape_numel(t.shape));
  }
}

void fsync_dir(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  MOETRAIN_CHECK(fd >= 0, "cannot open directory {} to sync it", dir.string());
  ::fsync(fd);
  ::close(fd);
}

int64_t step_of(const fs::path& dir) {
  std::string name = dir.filename().string();
  if (!name.starts_with("step_") || name.size() != 13) return -1;
  try {
    return std::stoll(name.substr(5));
  } catch (const std::exception&) {
    return -1;
  }
}

}  // namespace

fs::path checkpoint_dir(const fs::path& run_dir, int64_t step) {
  return run_dir / "checkpoints" / fmt::format("step_{:08}", step);
}

fs::path write_checkpoint(const fs::path& run_dir, int64_t step, const CheckpointContents& c,
                          int64_t keep) {
  fs::path root = run_dir / "checkpoints";
  fs::path final_dir = checkpoint_dir(run_dir, step);
  fs::path tmp = root / fmt::format(".tmp_step_{:08}_{}", step, ::getpid());
  std::error_code ec;
  fs::create_directories(root, ec);
  MOETRAIN_CHECK(!ec, "cannot create checkpoint directory {}: {}", root.string(), ec.message());
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  MOETRAIN_CHECK(!ec, "cannot create {}: {}", tmp.string(), ec.message());

  write_tensors(tmp / "model.safetensors", c.model);
  write_tensors(tmp / "optimizer.safetensors", c.optimizer);
  write_tensors(tmp / "state.safetensors", c.state);
  write_file_atomic(tmp / "config.json", c.config.dump(2) + "\n");
  write_file_atomic(tmp / "trainer_state.json", c.trainer.dump(2) + "\n");

  nlohmann::json manifest = {{"format", "moetrain-checkpoint"}, {"version", 1}, {"step", step}};
  for (const char* f : kFiles) {
    MappedFile m(tmp / f);
    manifest["files"][f] = {{"bytes", m.size()}, {"crc32", crc32_of(m.data(), m.size())}};
  }
  write_file_atomic(tmp / "manifest.json", manifest.dump(2) + "\n");
  fsync_dir(tmp);

  // Replace a checkpoint of the same step (a rerun) only once the new one is complete.
  if (fs::exists(final_dir)) fs::remove_all(final_dir, ec);
  fs::rename(tmp, final_dir, ec);
  MOETRAIN_CHECK(!ec, "cannot rename {} to {}: {}", tmp.string(), final_dir.string(), ec.message());
  fsync_dir(root);
  write_file_atomic(root / "latest", final_dir.filename().string() + "\n");

  // Keep the newest `keep` complete checkpoints.
  std::vector<fs::path> dirs;
  for (const auto& e : fs::directory_iterator(root))
    if (e.is_directory() && step_of(e.path()) >= 0) dirs.push_back(e.path());
  std::sort(dirs.begin(), dirs.end(),
            [](const fs::path& a, const fs::path& b) { return step_of(a) > step_of(b); });
  for (std::size_t i = static_cast<std::size_t>(std::max<int64_t>(keep, 1)); i < dirs.size(); ++i) {
    fs::remove_all(dirs[i], ec);
  }
  return final_dir;
}

void verify_checkpoint(const fs::path& dir) {
  fs::path mpath = dir / "manifest.json";
  MOETRAIN_CHECK(fs::is_regular_file(mpath), "{}: no manifest.json (an incomplete checkpoint)",
                 dir.string());
  nlohmann::json manifest;
  {
    MappedFile m(mpath);
    manifest = nlohmann::json::parse(m.data(), m.data() + m.size(), nullptr, false);
  }
  MOETRAIN_CHECK(!manifest.is_discarded() && manifest.is_object() && manifest.contains("files") &&
                     manifest["files"].is_object(),
                 "{}: manifest.json is not a valid checkpoint manifest", dir.string());
  for (const char* f : kFiles) {
    MOETRAIN_CHECK(manifest["files"].contains(f), "{}: manifest.json does not list {}",
                   dir.string(), f);
    const auto& entry = manifest["files"][f];
    fs::path p = dir / f;
    MOETRAIN_CHECK(fs::is_regular_file(p), "{}: missing", p.string());
    MappedFile m(p);
    uint64_t want_bytes = entry.value("bytes", uint64_t{0});
    MOETRAIN_CHECK(m.size() == want_bytes,
                   "{}: {} bytes, the manifest says {} (truncated or replaced)", p.string(),
                   m.size(), want_bytes);
    uint32_t crc = crc32_of(m.data(), m.size());
    uint32_t want_crc = entry.value("crc32", uint32_t{0});
    MOETRAIN_CHECK(crc == want_crc,
                   "{}: CRC-32 {:08x}, the manifest says {:08x} (the file is corrupt)", p.string(),
                   crc, want_crc);
  }
}

std::optional<fs::path> find_latest_checkpoint(const fs::path& run_dir) {
  fs::path root = run_dir / "checkpoints";
  if (!fs::is_directory(root)) return std::nullopt;
  std::vector<fs::path> candidates;
  if (fs::is_regular_file(root / "latest")) {
    MappedFile m(root / "latest");
    std::string name(reinterpret_cast<const char*>(m.data()), m.size());
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    if (!name.empty() && name.find('/') == std::string::npos) candidates.push_back(root / name);
  }
  std::vector<fs::path> dirs;
  for (const auto& e : fs::directory_iterator(root))
    if (e.is_directory() && step_of(e.path()) >= 0) dirs.push_back(e.path());
  std::sort(dirs.begin(), dirs.end(),
            [](const fs::path& a, const fs::path& b) { return step_of(a) > step_of(b); });
  for (const auto& d : dirs)
    if (candidates.empty() || d != candidates.front()) candidates.push_back(d);
  for (const auto& dir : candidates) {
    try {
      verify_checkpoint(dir);
      return dir;
    } catch (const Error& e) {
      log_warn("refusing checkpoint {}: {}", dir.string(), e.what());
    }
  }
  return std::nullopt;
}

nlohmann::json read_checkpoint_json(const fs::path& dir, const std::string& file) {
  fs::path p = dir / file;
  MOETRAIN_CHECK(fs::is_regular_file(p), "{}: missing (is {} a checkpoint directory?)", p.string(),
                 dir.string());
  MappedFile m(p);
  auto j = nlohmann::json::parse(m.data(), m.data() + m.size(), nullptr, false);
  MOETRAIN_CHECK(!j.is_discarded() && j.is_object(), "{}: not a valid JSON object", p.string());
  return j;
}

void read_checkpoint(const fs::path& dir, CheckpointContents& into) {
  verify_checkpoint(dir);
  into.config = read_checkpoint_json(dir, "config.json");
  into.trainer = read_checkpoint_json(dir, "trainer_state.json");
  read_tensors(dir / "model.safetensors", into.model);
  read_tensors(dir / "optimizer.safetensors", into.optimizer);
  read_tensors(dir / "state.safetensors", into.state);
}

}  // namespace moetrain
