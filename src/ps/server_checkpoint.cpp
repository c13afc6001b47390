#include "ps/server_checkpoint.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "core/parse.h"
#include "io/safetensors.h"
#include "ps/message.h"

namespace fs = std::filesystem;

namespace moetrain::ps {

namespace {

constexpr const char* kPrefix = "clock_";
constexpr const char* kSuffix = ".safetensors";

int64_t meta_int(const SafetensorsReader& r, const std::string& key) {
  auto it = r.metadata().find(key);
  MOETRAIN_CHECK(it != r.metadata().end(), "{}: metadata has no '{}'", r.path().string(), key);
  const std::optional<int64_t> v = parse_whole(it->second);
  MOETRAIN_CHECK(v, "{}: metadata '{}' = '{}' is not an integer", r.path().string(), key,
                 it->second);
  return *v;
}

}  // namespace

fs::path server_checkpoint_dir(const fs::path& run_dir, int64_t index) {
  return run_dir / "ps" / ("server_" + std::to_string(index));
}

fs::path server_checkpoint_path(const fs::path& run_dir, int64_t index, int64_t clock) {
  char name[64];
  std::snprintf(name, sizeof(name), "%s%010lld%s", kPrefix, static_cast<long long>(clock), kSuffix);
  return server_checkpoint_dir(run_dir, index) / name;
}

void write_server_checkpoint(const fs::path& run_dir, int64_t index, int64_t clock,
                             int64_t key_begin, int64_t key_end, const float* params,
                             Optimizer& optimizer, const std::map<int64_t, int64_t>& worker_clocks,
                             const std::string& config_hash, int keep,
                             const std::string& rule_state) {
  const int64_t n = key_end - key_begin;
  SafetensorsWriter w;
  // The checksum covers the tensors in the order they are added.
  uint32_t crc = 0;
  auto add = [&](const std::string& name, SafetensorsDType dt, Shape shape, const void* data,
                 std::size_t bytes) {
    w.add(name, dt, std::move(shape), data);
    crc = crc32_bytes(data, bytes, crc);
  };
  add("params", SafetensorsDType::F32, {n}, params, static_cast<std::size_t>(n) * 4);
  // The optimizer's range may end before the key range (the router bias and expert count keys
  // past the parameters have no optimizer state): its buffers are written padded with zeros to
  // the key range, as a snapshot to a backup pads them.
  std::vector<StateBuffer> state = optimizer.state();
  std::vector<std::vector<float>> padded;
  padded.reserve(state.size());
  for (const StateBuffer& b : state) {
    MOETRAIN_CHECK(static_cast<int64_t>(b.values.size()) <= n,
                   "optimizer buffer '{}' of {} values for keys [{}, {})", b.name, b.values.size(),
                   key_begin, key_end);
    padded.emplace_back(b.values.begin(), b.values.end());
    padded.back().resize(static_cast<std::size_t>(n), 0.0f);
    add("optimizer." + b.name, SafetensorsDType::F32, {n}, padded.back().data(),
        static_cast<std::size_t>(n) * 4);
  }
  std::vector<int64_t> clocks;
  for (auto [wk, c] : worker_clocks) clocks.insert(clocks.end(), {wk, c});
  add("worker_clocks", SafetensorsDType::I64, {static_cast<int64_t>(worker_clocks.size()), 2},
      clocks.data(), clocks.size() * 8);
  if (!rule_state.empty())
    add("rule_state", SafetensorsDType::U8, {static_cast<int64_t>(rule_state.size())},
        rule_state.data(), rule_state.size());
  w.set_metadata("format", "moetrain-ps-server-checkpoint");
  w.set_metadata("server_index", std::to_string(index));
  w.set_metadata("clock", std::to_string(clock));
  w.set_metadata("key_begin", std::to_string(key_begin));
  w.set_metadata("key_end", std::to_string(key_end));
  w.set_metadata("optimizer_steps", std::to_string(optimizer.step_count()));
  w.set_metadata("config_hash", config_hash);
  w.set_metadata("crc32c", std::to_string(crc));
  const fs::path dir = server_checkpoint_dir(run_dir, index);
  fs::create_directories(dir);
  w.write(server_checkpoint_path(run_dir, index, clock));
  std::vector<int64_t> have = list_server_checkpoints(run_dir, index);
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < have.size(); ++i)
    fs::remove(server_checkpoint_path(run_dir, index, have[i]));
}

ServerCheckpoint read_server_checkpoint(const fs::path& path, int64_t key_begin, int64_t key_end,
                                        const std::string& config_hash) {
  SafetensorsReader r(path);
  const std::string file = path.string();
  MOETRAIN_CHECK(
      r.metadata().count("format") && r.metadata().at("format") == "moetrain-ps-server-checkpoint",
      "{}: not a parameter-server checkpoint", file);
  ServerCheckpoint c;
  c.index = meta_int(r, "server_index");
  c.clock = meta_int(r, "clock");
  c.key_begin = meta_int(r, "key_begin");
  c.key_end = meta_int(r, "key_end");
  c.optimizer_steps = meta_int(r, "optimizer_steps");
  c.config_hash = r.metadata().count("config_hash") ? r.metadata().at("config_hash") : "";
  MOETRAIN_CHECK(c.key_begin == key_begin && c.key_end == key_end,
                 "{}: holds keys [{}, {}), this server holds [{}, {})", file, c.key_begin,
                 c.key_end, key_begin, key_end);
  MOETRAIN_CHECK(c.config_hash == config_hash, "{}: written for configuration {}, this job's is {}",
                 file, c.config_hash, config_hash);
  const int64_t n = key_end - key_begin;
  uint32_t crc = 0;
  auto f32 = [&](const std::string& name) {
    MOETRAIN_CHECK(r.dtype(name) == SafetensorsDType::F32 && r.entry(name).numel() == n,
                   "{}: tensor '{}' must be F32 with {} values", file, name, n);
    std::vector<float> v = r.read_f32(name);
    crc = crc32_bytes(v.data(), v.size() * 4, crc);
    return v;
  };
  c.params = f32("params");
  // names() is in data order, which is the order the writer added (and checksummed) them.
  for (const std::string& name : r.names())
    if (name.starts_with("optimizer.")) c.optimizer[name.substr(10)] = f32(name);
  MOETRAIN_CHECK(r.contains("worker_clocks") && r.dtype("worker_clocks") == SafetensorsDType::I64 &&
                     r.shape("worker_clocks").size() == 2 && r.shape("worker_clocks")[1] == 2,
                 "{}: tensor 'worker_clocks' must be I64 of shape (k, 2)", file);
  const auto wc = r.bytes("worker_clocks");
  std::vector<int64_t> clocks(wc.size() / 8);
  std::memcpy(clocks.data(), wc.data(), clocks.size() * 8);
  crc = crc32_bytes(clocks.data(), clocks.size() * 8, crc);
  for (std::size_t i = 0; i + 1 < clocks.size(); i += 2) c.worker_clocks[clocks[i]] = clocks[i + 1];
  if (r.contains("rule_state")) {
    MOETRAIN_CHECK(r.dtype("rule_state") == SafetensorsDType::U8,
                   "{}: tensor 'rule_state' must be U8", file);
    const auto rs = r.bytes("rule_state");
    c.rule_state.assign(reinterpret_cast<const char*>(rs.data()), rs.size());
    crc = crc32_bytes(c.rule_state.data(), c.rule_state.size(), crc);
  }
  const int64_t want = meta_int(r, "crc32c");
  MOETRAIN_CHECK(static_cast<int64_t>(crc) == want,
                 "{}: checksum mismatch (metadata says {}, contents give {}): the file is "
                 "corrupt",
                 file, want, crc);
  return c;
}

std::vector<int64_t> list_server_checkpoints(const fs::path& run_dir, int64_t index) {
  std::vector<int64_t> out;
  const fs::path dir = server_checkpoint_dir(run_dir, index);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with(kPrefix) || !name.ends_with(kSuffix)) continue;
    const std::string digits = name.substr(
        std::strlen(kPrefix), name.size() - std::strlen(kPrefix) - std::strlen(kSuffix));
    if (digits.empty() || !std::all_of(digits.begin(), digits.end(), ::isdigit)) continue;
    out.push_back(std::stoll(digits));
  }
  std::sort(out.begin(), out.end());
  return out;
}

void restore_optimizer(const ServerCheckpoint& c, Optimizer& optimizer) {
  std::vector<StateBuffer> state = optimizer.state();
  MOETRAIN_CHECK(state.size() == c.optimizer.size(),
                 "server checkpoint of clock {} holds {} optimizer buffers, the optimizer has {}",
                 c.clock, c.optimizer.size(), state.size());
  for (StateBuffer& b : state) {
    auto it = c.optimizer.find(b.name);
    // Written padded to the key range (write_server_checkpoint): the optimizer's range is its
    // beginning.
    MOETRAIN_CHECK(it != c.optimizer.end() && it->second.size() >= b.values.size(),
                   "server checkpoint of clock {} has no optimizer buffer '{}' of {} values",
                   c.clock, b.name, b.values.size());
    std::copy_n(it->second.begin(), b.values.size(), b.values.begin());
  }
  optimizer.set_step_count(c.optimizer_steps);
}

}  // namespace moetrain::ps
