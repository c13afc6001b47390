#include "io/checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "core/check.h"
#include "core/log.h"
#include "io/checkpoint_detail.h"
#include "io/crc32c.h"
#include "io/file.h"
#include "io/safetensors.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace moetrain {

using namespace checkpoint_detail;

namespace {

const json& member(const json& j, const char* key, const fs::path& where) {
  MOETRAIN_CHECK(j.is_object() && j.contains(key),
                 "{}: no '{}' (not a moetrain checkpoint manifest)", where.string(), key);
  return j.at(key);
}

}  // namespace

// Every tensor's pieces, sorted by begin, must tile [0, numel) exactly and name a listed file.
void checkpoint_detail::check_tensors(json& tensors, const json& files, const fs::path& where) {
  for (const char* fam : kFamilies) {
    json& group = tensors[fam];
    MOETRAIN_CHECK(group.is_object(), "{}: tensors.{} is not an object", where.string(), fam);
    for (auto& [name, t] : group.items()) {
      MOETRAIN_CHECK(t.contains("shape") && t["shape"].is_array() && t.contains("pieces") &&
                         t["pieces"].is_array(),
                     "{}: tensor '{}' has no shape or pieces", where.string(), name);
      const int64_t numel = shape_numel(t["shape"].get<Shape>());
      json& pieces = t["pieces"];
      std::sort(pieces.begin(), pieces.end(), [](const json& a, const json& b) {
        return a.value("begin", int64_t{0}) < b.value("begin", int64_t{0});
      });
      int64_t at = 0;
      for (const json& p : pieces) {
        const int64_t b = p.value("begin", int64_t{-1}), e = p.value("end", int64_t{-1});
        MOETRAIN_CHECK(b == at && e > b && e <= numel,
                       "{}: tensor '{}' ({} elements): a piece covers [{}, {}), expected one from "
                       "{} (pieces missing or overlapping)",
                       where.string(), name, numel, b, e, at);
        const std::string file = p.value("file", std::string());
        MOETRAIN_CHECK(files.contains(file), "{}: tensor '{}' is in '{}', a file not listed",
                       where.string(), name, file);
        at = e;
      }
      MOETRAIN_CHECK(at == numel, "{}: tensor '{}' has {} elements, its pieces cover {}",
                     where.string(), name, numel, at);
    }
  }
}

namespace {

json read_manifest(const fs::path& dir) {
  const fs::path path = dir / kManifest;
  MOETRAIN_CHECK(fs::is_regular_file(path), "{}: no {} (an uncommitted or incomplete checkpoint)",
                 dir.string(), kManifest);
  json m;
  {
    MappedFile f(path);
    m = json::parse(f.data(), f.data() + f.size(), nullptr, false);
  }
  MOETRAIN_CHECK(!m.is_discarded() && m.is_object(), "{}: not valid JSON", path.string());
  const auto [format, version] = reading_json(
      path, [&] { return std::pair(m.value("format", std::string()), m.value("version", 0)); });
  MOETRAIN_CHECK(format == "moetrain-checkpoint" && version == kVersion,
                 "{}: format '{}' version {}, expected moetrain-checkpoint version {}",
                 path.string(), format, version, kVersion);
  const json& files = member(m, "files", path);
  MOETRAIN_CHECK(files.is_object(), "{}: 'files' is not an object", path.string());
  member(m, "tensors", path);
  check_tensors(m["tensors"], files, path);
  return m;
}

// `latest` is a hint written after the commit (a full disk can leave it behind): the committed
// checkpoints, newest first, are the candidates. A hint naming anything but one of this run
// directory's checkpoints is refused with a warning.
std::vector<fs::path> candidates(const fs::path& run_dir) {
  const fs::path root = run_dir / "checkpoints";
  std::vector<fs::path> out;
  if (!fs::is_directory(root)) return out;
  std::vector<std::pair<int64_t, fs::path>> dirs;
  for (const auto& e : fs::directory_iterator(root))
    if (e.is_directory() && step_of(e.path()) >= 0) dirs.push_back({step_of(e.path()), e.path()});
  std::sort(dirs.begin(), dirs.end(), [](auto& a, auto& b) { return a.first > b.first; });
  for (const auto& d : dirs) out.push_back(d.second);
  // A link (or, from older runs, a text file naming the directory).
  const fs::path latest = root / "latest";
  if (fs::is_symlink(latest) || fs::is_regular_file(latest)) {
    std::string name;
    if (fs::is_symlink(latest)) {
      name = fs::read_symlink(latest).string();
    } else {
      MappedFile m(latest);
      name.assign(reinterpret_cast<const char*>(m.data()), m.size());
    }
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    const fs::path named(name);
    if (name.empty() || named.is_absolute() || named.has_parent_path() || step_of(name) < 0)
      log_warn("{}: '{}' is not a checkpoint of this run directory (expected step_N): ignored",
               (root / "latest").string(), name);
    else if (!out.empty() && out.front().filename() != named)
      log_warn("{} names {}, but {} is newer: trying the newest first", (root / "latest").string(),
               name, out.front().filename().string());
  }
  return out;
}

// The step is in three places: the directory's name, the manifest and trainer_state.json. A
// disagreement is a corrupt (or re-signed) checkpoint: trusting trainer_state.json alone would
// make the run write, and rotate towards, a step it never reached.
void check_steps(const fs::path& dir, const json& m) {
  const fs::path path = dir / kManifest;
  const int64_t step = reading_json(path, [&] { return member(m, "step", path).get<int64_t>(); });
  const int64_t named = step_of(dir.filename());
  MOETRAIN_CHECK(named < 0 || named == step,
                 "{}: step {}, but the directory is {} (a corrupt or re-signed checkpoint)",
                 path.string(), step, dir.filename().string());
  if (!m["files"].contains("trainer_state.json")) return;
  const fs::path state_path = dir / "trainer_state.json";
  const json state = read_checkpoint_json(dir, "trainer_state.json");
  if (!state.contains("step")) return;
  MOETRAIN_CHECK(state["step"].is_number_integer() && state["step"].get<int64_t>() == step,
                 "{}: step {}, the manifest says {} (a corrupt or re-signed checkpoint)",
                 state_path.string(), state["step"].dump(), step);
}

}  // namespace

TensorPiece whole_tensor(std::string name, Shape shape, float* data) {
  const int64_t n = shape_numel(shape);
  return {std::move(name), std::move(shape), 0, n, data};
}

fs::path checkpoint_dir(const fs::path& run_dir, int64_t step) {
  return run_dir / "checkpoints" / fmt::format("step_{:08}", step);
}

void verify_checkpoint(const fs::path& dir, Comm* comm) {
  const int rank = comm ? comm->rank() : 0, world = comm ? comm->size() : 1;
  on_every_rank(comm, [&] {
    json m = read_manifest(dir);
    reading_json(dir / kManifest, [&] {
      // Sizes on every rank (cheap); checksums of a share of the files each, the biggest first.
      std::vector<std::pair<uint64_t, std::string>> by_size;
      for (auto& [name, entry] : m["files"].items()) {
        const fs::path p = dir / name;
        MOETRAIN_CHECK(fs::is_regular_file(p), "{}: missing (listed in the manifest)", p.string());
        const uint64_t want = entry.value("bytes", uint64_t{0}), got = fs::file_size(p);
        MOETRAIN_CHECK(got == want, "{}: {} bytes, the manifest says {} (truncated or replaced)",
                       p.string(), got, want);
        by_size.push_back({want, name});
      }
      std::stable_sort(by_size.begin(), by_size.end(),
                       [](auto& a, auto& b) { return a.first > b.first; });
      for (std::size_t i = static_cast<std::size_t>(rank); i < by_size.size();
           i += static_cast<std::size_t>(world)) {
        const std::string& name = by_size[i].second;
        // A window at a time, each handed back once summed: the file never becomes resident.
        MappedFile f(dir / name);
        uint32_t crc = 0;
        for (std::size_t at = 0; at < f.size();) {
          const std::size_t k =
              std::min(f.size() - at, static_cast<std::size_t>(kCheckpointWindow));
          crc = crc32c(f.data() + at, k, crc);
          f.hand_back(f.data() + at, k);
          at += k;
        }
        const uint32_t want = m["files"][name].value("crc32c", uint32_t{0});
        MOETRAIN_CHECK(crc == want,
                       "{}: CRC-32C {:08x}, the manifest says {:08x} (the file is corrupt)",
                       (dir / name).string(), crc, want);
      }
    });
    check_steps(dir, m);
  });
}

std::optional<fs::path> find_latest_checkpoint(const fs::path& run_dir, Comm* comm,
                                               const CheckpointLoad& load,
                                               std::vector<std::string>* refusals) {
  std::vector<fs::path> list = candidates(run_dir);
  if (comm != nullptr && comm->size() > 1) {
    std::vector<int64_t> seen = comm->allgather_one(static_cast<int64_t>(list.size()));
    for (int q = 1; q < comm->size(); ++q)
      MOETRAIN_CHECK(seen[q] == seen[0],
                     "{}: rank 0 sees {} checkpoint(s), rank {} sees {}: the run directory must "
                     "be one directory shared by every process",
                     run_dir.string(), seen[0], q, seen[q]);
    // Every rank walks rank 0's list, so that the verifications stay in step.
    std::string names;
    for (const fs::path& p : list) names += p.filename().string() + "\n";
    broadcast_string(*comm, names, 0);
    list.clear();
    for (std::size_t at = 0, nl; (nl = names.find('\n', at)) != std::string::npos; at = nl + 1)
      list.push_back(run_dir / "checkpoints" / names.substr(at, nl - at));
  }
  for (const fs::path& dir : list) {
    try {
      verify_checkpoint(dir, comm);
      // Checksums pass but the contents may still not parse or fit: that is a corrupt
      // checkpoint too, and the previous one is tried.
      if (load) on_every_rank(comm, [&] { load(dir); });
      return dir;
    } catch (const std::exception& e) {
      log_warn("refusing checkpoint {}: {}", dir.string(), e.what());
      if (refusals) refusals->push_back(fmt::format("{}: {}", dir.string(), e.what()));
    }
  }
  return std::nullopt;
}

void throw_json_error(const fs::path& file, const std::exception& e) {
  MOETRAIN_FAIL("{}: {} (a key is missing or has the wrong type)", file.string(), e.what());
}

json read_checkpoint_json(const fs::path& dir, const std::string& file) {
  fs::path p = dir / file;
  MOETRAIN_CHECK(fs::is_regular_file(p), "{}: missing (is {} a checkpoint directory?)", p.string(),
                 dir.string());
  MappedFile m(p);
  auto j = json::parse(m.data(), m.data() + m.size(), nullptr, false);
  MOETRAIN_CHECK(!j.is_discarded() && j.is_object(), "{}: not a valid JSON object", p.string());
  return j;
}

void read_checkpoint_pieces(const fs::path& dir, const CheckpointShare& into) {
  const json m = read_manifest(dir);
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers;
  std::vector<float> window;
  for (std::size_t f = 0; f < kFamilies.size(); ++f) {
    const json& group = m["tensors"][kFamilies[f]];
    for (const TensorPiece& want : family(into, f)) {
      const int64_t numel = shape_numel(want.shape);
      MOETRAIN_CHECK(0 <= want.begin && want.begin <= want.end && want.end <= numel,
                     "reading '{}' [{}, {}): outside its {} elements", want.name, want.begin,
                     want.end, numel);
      if (want.begin == want.end) continue;
      auto it = group.find(want.name);
      MOETRAIN_CHECK(it != group.end(),
                     "{}: no {} tensor '{}' (the checkpoint is of a different model or run?)",
                     dir.string(), kFamilies[f], want.name);
      const Shape saved = (*it)["shape"].get<Shape>();
      MOETRAIN_CHECK(saved == want.shape, "{}: tensor '{}' has shape {}, this run expects {}",
                     dir.string(), want.name, shape_str(saved), shape_str(want.shape));
      int64_t covered = 0;
      for (const json& p : (*it)["pieces"]) {
        const int64_t pb = p["begin"], pe = p["end"];
        const int64_t lo = std::max(want.begin, pb), hi = std::min(want.end, pe);
        if (lo >= hi) continue;
        const std::string file = p["file"], key = p["key"];
        auto& reader = readers[file];
        if (!reader) reader = std::make_unique<SafetensorsReader>(dir / file);
        const SafetensorsEntry& e = reader->entry(key);
        MOETRAIN_CHECK(e.dtype == SafetensorsDType::F32 &&
                           e.nbytes() == static_cast<uint64_t>(pe - pb) * sizeof(float),
                       "{}: tensor '{}' is {} with {} bytes, the manifest says F32 [{}, {})",
                       (dir / file).string(), key, safetensors_dtype_name(e.dtype), e.nbytes(), pb,
                       pe);
        // A window at a time, each window's pages of the file handed back once copied; a piece
        // outside memory goes through a buffer of one window, checked before it is stored.
        const std::span<const uint8_t> bytes = reader->bytes(key);
        const int64_t step = kCheckpointWindow / static_cast<int64_t>(sizeof(float));
        for (int64_t at = lo; at < hi; at += step) {
          const int64_t k = std::min(step, hi - at);
          const std::span<const uint8_t> src = bytes.subspan(
              static_cast<std::size_t>(at - pb) * sizeof(float),
              static_cast<std::size_t>(k) * sizeof(float));
          if (want.data) {
            std::memcpy(want.data + (at - want.begin), src.data(), src.size());
          } else {
            MOETRAIN_CHECK(want.put, "reading '{}' [{}, {}): neither memory nor a sink",
                           want.name, want.begin, want.end);
            window.resize(static_cast<std::size_t>(k));
            std::memcpy(window.data(), src.data(), src.size());
            check_finite_tensor(window.data(), k, dir, want.name, at);
            want.put(at - want.begin, k, window.data());
          }
          reader->hand_back(src);
        }
        covered += hi - lo;
      }
      // The manifest's pieces do not overlap (read_manifest checked), so this is full coverage.
      MOETRAIN_CHECK(covered == want.end - want.begin,
                     "{}: tensor '{}' [{}, {}): only {} elements saved", dir.string(), want.name,
                     want.begin, want.end, covered);
      if (want.data)
        check_finite_tensor(want.data, want.end - want.begin, dir, want.name, want.begin);
    }
  }
}

fs::path write_checkpoint(const fs::path& run_dir, int64_t step, const CheckpointContents& c,
                          int64_t keep) {
  CheckpointShare share;
  for (const NamedTensor& t : c.model) share.model.push_back(whole_tensor(t.name, t.shape, t.data));
  for (const NamedTensor& t : c.optimizer)
    share.optimizer.push_back(whole_tensor(t.name, t.shape, t.data));
  for (const NamedTensor& t : c.state) share.state.push_back(whole_tensor(t.name, t.shape, t.data));
  auto local = make_local_comm("checkpoint");
  return write_checkpoint(*local, run_dir, step, share, {c.config, c.trainer, c.files}, keep);
}

void read_checkpoint(const fs::path& dir, CheckpointContents& into) {
  verify_checkpoint(dir);
  into.config = read_checkpoint_json(dir, "config.json");
  into.trainer = read_checkpoint_json(dir, "trainer_state.json");
  CheckpointShare share;
  for (const NamedTensor& t : into.model)
    share.model.push_back(whole_tensor(t.name, t.shape, t.data));
  for (const NamedTensor& t : into.optimizer)
    share.optimizer.push_back(whole_tensor(t.name, t.shape, t.data));
  for (const NamedTensor& t : into.state)
    share.state.push_back(whole_tensor(t.name, t.shape, t.data));
  read_checkpoint_pieces(dir, share);
}

}  // namespace moetrain
