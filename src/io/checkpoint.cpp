#include "io/checkpoint.h"

#include <fmt/format.h>

#include <fcntl.h>
#include <unistd.h>
#include <algorithm>
#include <array>
#include <cstring>
#include <exception>
#include <map>
#include <memory>

#include "core/check.h"
#include "core/fault.h"
#include "core/log.h"
#include "io/crc32c.h"
#include "io/safetensors.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace moetrain {

namespace {

constexpr int kVersion = 2;
constexpr const char* kManifest = "manifest.json";
constexpr const char* kModelIndex = "model.safetensors.index.json";
constexpr std::array<const char*, 3> kFamilies = {"model", "optimizer", "state"};

const std::vector<TensorPiece>& family(const CheckpointShare& s, std::size_t f) {
  return f == 0 ? s.model : f == 1 ? s.optimizer : s.state;
}

bool is_whole(const TensorPiece& p) {
  return p.begin == 0 && p.end == shape_numel(p.shape);
}

// The piece's tensor name inside its safetensors file: the global name for a whole tensor (what
// transformers looks for), with the element range appended for a slice.
std::string piece_key(const TensorPiece& p) {
  return is_whole(p) ? p.name : fmt::format("{}[{}:{}]", p.name, p.begin, p.end);
}

void broadcast_string(Comm& comm, std::string& s, int root) {
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

void fsync_dir(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  MOETRAIN_CHECK(fd >= 0, "cannot open directory {} to sync it", dir.string());
  int rc = ::fsync(fd);
  ::close(fd);
  MOETRAIN_CHECK(rc == 0, "cannot fsync directory {}", dir.string());
}

// The step of a directory named `prefix` + 8 digits, else −1.
int64_t step_of(const fs::path& dir, std::string_view prefix = "step_") {
  std::string name = dir.filename().string();
  if (!name.starts_with(prefix) || name.size() != prefix.size() + 8) return -1;
  int64_t step = 0;
  for (char ch : name.substr(prefix.size())) {
    if (ch < '0' || ch > '9') return -1;
    step = step * 10 + (ch - '0');
  }
  return step;
}

struct FileRecord {
  uint64_t bytes = 0;
  uint32_t crc = 0;
};

json file_entry(const FileRecord& r, int rank) {
  return {{"bytes", r.bytes}, {"crc32c", r.crc}, {"rank", rank}};
}

// Writes the pieces as one safetensors file (atomically), checksumming the bytes on their way out
// rather than reading the file back.
FileRecord write_piece_file(const fs::path& path, const std::vector<const TensorPiece*>& pieces) {
  SafetensorsWriter w;
  for (const TensorPiece* p : pieces)
    w.add(piece_key(*p), SafetensorsDType::F32, is_whole(*p) ? p->shape : Shape{p->end - p->begin},
          p->data);
  // transformers' from_pretrained refuses a safetensors file whose metadata does not name the
  // framework whose layout the tensors follow; ours are PyTorch's (row-major, (out, in) weights).
  w.set_metadata("format", "pt");
  const std::string header = w.header();
  const uint64_t header_bytes = header.size();
  AtomicFileWriter out(path);
  FileRecord r;
  auto put = [&](const void* data, std::size_t n) {
    // In blocks that the write has just pulled into the cache, where the checksum finds them.
    constexpr std::size_t kBlock = std::size_t{4} << 20;
    for (const auto* p = static_cast<const uint8_t*>(data); n > 0;) {
      const std::size_t k = std::min(n, kBlock);
      out.write(p, k);
      r.crc = crc32c(p, k, r.crc);
      p += k, n -= k, r.bytes += k;
    }
  };
  put(&header_bytes, 8);
  put(header.data(), header.size());
  for (const TensorPiece* p : pieces)
    put(p->data, static_cast<std::size_t>(p->end - p->begin) * sizeof(float));
  out.commit();
  return r;
}

FileRecord write_json_file(const fs::path& path, const json& j) {
  const std::string text = j.dump(2) + "\n";
  write_file_atomic(path, text);
  return {text.size(), crc32c(text.data(), text.size())};
}

const json& member(const json& j, const char* key, const fs::path& where) {
  MOETRAIN_CHECK(j.is_object() && j.contains(key),
                 "{}: no '{}' (not a moetrain checkpoint manifest)", where.string(), key);
  return j.at(key);
}

// Every tensor's pieces, sorted by begin, must tile [0, numel) exactly and name a listed file.
void check_tensors(json& tensors, const json& files, const fs::path& where) {
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

// manifest.json, parsed and checked for structure (not against the files).
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
  MOETRAIN_CHECK(m.value("format", std::string()) == "moetrain-checkpoint" &&
                     m.value("version", 0) == kVersion,
                 "{}: format '{}' version {}, expected moetrain-checkpoint version {}",
                 path.string(), m.value("format", std::string()), m.value("version", 0), kVersion);
  const json& files = member(m, "files", path);
  MOETRAIN_CHECK(files.is_object(), "{}: 'files' is not an object", path.string());
  member(m, "tensors", path);
  check_tensors(m["tensors"], files, path);
  return m;
}

void prune(const fs::path& root, int64_t step, int64_t keep) {
  std::vector<std::pair<int64_t, fs::path>> complete;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root)) {
    if (!e.is_directory()) continue;
    const fs::path& p = e.path();
    if (int64_t s = step_of(p); s >= 0) {
      // Checkpoints past this one belong to a run this one was resumed from before they were
      // written: another timeline, never to be resumed.
      if (s > step)
        fs::remove_all(p, ec);
      else
        complete.push_back({s, p});
    } else if (step_of(p, ".tmp_step_") >= 0 || step_of(p, ".replaced_step_") >= 0) {
      fs::remove_all(p, ec);  // left by a writer that died
    }
  }
  std::sort(complete.begin(), complete.end(), [](auto& a, auto& b) { return a.first > b.first; });
  for (std::size_t i = static_cast<std::size_t>(std::max<int64_t>(keep, 1)); i < complete.size();
       ++i)
    fs::remove_all(complete[i].second, ec);
}

// Rank 0: the manifest from every rank's record, the JSON documents, the commit.
fs::path commit(const fs::path& run_dir, int64_t step, int world, const std::string& records,
                const std::vector<int64_t>& lengths, const CheckpointDocs& docs, int64_t keep) {
  const fs::path root = run_dir / "checkpoints";
  const fs::path tmp = root / fmt::format(".tmp_step_{:08}", step);
  const fs::path final_dir = checkpoint_dir(run_dir, step);
  json manifest = {{"format", "moetrain-checkpoint"},
                   {"version", kVersion},
                   {"step", step},
                   {"world_size", world},
                   {"checksum", "crc32c"},
                   {"files", json::object()},
                   {"tensors", json::object()}};
  json& files = manifest["files"];
  json& tensors = manifest["tensors"];
  for (const char* fam : kFamilies) tensors[fam] = json::object();
  json weight_map = json::object();
  int64_t model_bytes = 0;
  std::size_t at = 0;
  for (int64_t len : lengths) {
    json r = json::parse(records.substr(at, static_cast<std::size_t>(len)));
    at += static_cast<std::size_t>(len);
    for (auto& [name, entry] : r["files"].items()) files[name] = entry;
    for (const json& p : r["pieces"]) {
      const std::string fam = p["family"], name = p["name"];
      json& t = tensors[fam][name];
      if (t.is_null()) t = {{"shape", p["shape"]}, {"pieces", json::array()}};
      MOETRAIN_CHECK(t["shape"] == p["shape"],
                     "checkpoint step {}: ranks disagree on the shape of '{}' ({} vs {})", step,
                     name, t["shape"].dump(), p["shape"].dump());
      t["pieces"].push_back(
          {{"file", p["file"]}, {"key", p["key"]}, {"begin", p["begin"]}, {"end", p["end"]}});
      if (fam == "model") {
        weight_map[name] = p["file"];
        model_bytes += (p["end"].get<int64_t>() - p["begin"].get<int64_t>()) * 4;
      }
    }
  }
  // A gap or an overlap here is a bug in who was told to write what: refuse to commit it.
  check_tensors(tensors, files, tmp / kManifest);

  files["config.json"] = file_entry(write_json_file(tmp / "config.json", docs.config), 0);
  files["trainer_state.json"] =
      file_entry(write_json_file(tmp / "trainer_state.json", docs.trainer), 0);
  if (!files.contains("model.safetensors") && !weight_map.empty()) {
    // Several model shards: transformers finds them through this index.
    json index = {{"metadata", {{"total_size", model_bytes}}}, {"weight_map", weight_map}};
    files[kModelIndex] = file_entry(write_json_file(tmp / kModelIndex, index), 0);
  }
  write_json_file(tmp / kManifest, manifest);
  fsync_dir(tmp);

  // The commit point: the rename of the complete directory. A checkpoint of the same step (a
  // rerun) is replaced only once the new one is complete.
  const fs::path replaced = root / fmt::format(".replaced_step_{:08}", step);
  std::error_code ec;
  fs::remove_all(replaced, ec);
  if (fs::exists(final_dir)) fs::rename(final_dir, replaced);
  fs::rename(tmp, final_dir, ec);
  MOETRAIN_CHECK(!ec, "cannot rename {} to {}: {}", tmp.string(), final_dir.string(), ec.message());
  fsync_dir(root);
  write_file_atomic(root / "latest", final_dir.filename().string() + "\n");
  prune(root, step, keep);
  return final_dir;
}

std::vector<fs::path> candidates(const fs::path& run_dir) {
  const fs::path root = run_dir / "checkpoints";
  std::vector<fs::path> out;
  if (!fs::is_directory(root)) return out;
  if (fs::is_regular_file(root / "latest")) {
    MappedFile m(root / "latest");
    std::string name(reinterpret_cast<const char*>(m.data()), m.size());
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    if (step_of(name) >= 0 && fs::is_directory(root / name)) out.push_back(root / name);
  }
  std::vector<std::pair<int64_t, fs::path>> dirs;
  for (const auto& e : fs::directory_iterator(root))
    if (e.is_directory() && step_of(e.path()) >= 0) dirs.push_back({step_of(e.path()), e.path()});
  std::sort(dirs.begin(), dirs.end(), [](auto& a, auto& b) { return a.first > b.first; });
  for (const auto& [s, d] : dirs)
    if (out.empty() || d != out.front()) out.push_back(d);
  return out;
}

}  // namespace

TensorPiece whole_tensor(std::string name, Shape shape, float* data) {
  const int64_t n = shape_numel(shape);
  return {std::move(name), std::move(shape), 0, n, data};
}

fs::path checkpoint_dir(const fs::path& run_dir, int64_t step) {
  return run_dir / "checkpoints" / fmt::format("step_{:08}", step);
}

fs::path write_checkpoint(Comm& comm, const fs::path& run_dir, int64_t step,
                          const CheckpointShare& mine, const CheckpointDocs& docs, int64_t keep) {
  const fs::path root = run_dir / "checkpoints";
  const fs::path tmp = root / fmt::format(".tmp_step_{:08}", step);
  const int rank = comm.rank();
  on_every_rank(&comm, [&] {
    for (std::size_t f = 0; f < kFamilies.size(); ++f)
      for (const TensorPiece& p : family(mine, f)) {
        MOETRAIN_CHECK(0 <= p.begin && p.begin <= p.end && p.end <= shape_numel(p.shape),
                       "checkpoint piece '{}' [{}, {}) lies outside its {} elements", p.name,
                       p.begin, p.end, shape_numel(p.shape));
        MOETRAIN_CHECK(f != 0 || is_whole(p) || p.begin == p.end,
                       "model tensor '{}' is written in part ([{}, {})): parameters are written "
                       "whole, as transformers reads them",
                       p.name, p.begin, p.end);
      }
    if (rank != 0) return;
    std::error_code ec;
    fs::create_directories(root, ec);
    MOETRAIN_CHECK(!ec, "cannot create checkpoint directory {}: {}", root.string(), ec.message());
    fs::remove_all(tmp, ec);
    MOETRAIN_CHECK(!ec, "cannot remove {}: {}", tmp.string(), ec.message());
    fs::create_directory(tmp, ec);
    MOETRAIN_CHECK(!ec, "cannot create {}: {}", tmp.string(), ec.message());
  });

  // The i-th of the n ranks with pieces of a family writes its shard i of n.
  std::array<std::vector<const TensorPiece*>, kFamilies.size()> pieces;
  std::array<std::vector<int64_t>, kFamilies.size()> writers;
  for (std::size_t f = 0; f < kFamilies.size(); ++f) {
    for (const TensorPiece& p : family(mine, f))
      if (p.end > p.begin) pieces[f].push_back(&p);
    writers[f] = comm.allgather_one(pieces[f].empty() ? 0 : 1);
  }
  json record = {{"files", json::object()}, {"pieces", json::array()}};
  on_every_rank(&comm, [&] {
    for (std::size_t f = 0; f < kFamilies.size(); ++f) {
      if (pieces[f].empty()) continue;
      int64_t n = 0, i = 0;
      for (int q = 0; q < comm.size(); ++q) n += writers[f][q], i += q < rank ? writers[f][q] : 0;
      const std::string file =
          n == 1 ? fmt::format("{}.safetensors", kFamilies[f])
                 : fmt::format("{}-{:05}-of-{:05}.safetensors", kFamilies[f], i + 1, n);
      record["files"][file] = file_entry(write_piece_file(tmp / file, pieces[f]), rank);
      for (const TensorPiece* p : pieces[f])
        record["pieces"].push_back({{"family", kFamilies[f]},
                                    {"name", p->name},
                                    {"shape", p->shape},
                                    {"begin", p->begin},
                                    {"end", p->end},
                                    {"file", file},
                                    {"key", piece_key(*p)}});
    }
  });

  // Every rank's pieces are on disk and fsynced; nothing is committed until rank 0 has written
  // the manifest and renamed the directory below. A process that dies here leaves a .tmp_
  // directory that no reader accepts.
  fault_point("checkpoint_write", step);
  const std::string mine_text = record.dump();
  std::vector<int64_t> lengths = comm.allgather_one(static_cast<int64_t>(mine_text.size()));
  std::vector<int64_t> displs(lengths.size(), 0);
  for (std::size_t q = 1; q < lengths.size(); ++q) displs[q] = displs[q - 1] + lengths[q - 1];
  std::string records(static_cast<std::size_t>(displs.back() + lengths.back()), '\0');
  comm.allgatherv(records.data(), lengths, displs, mine_text.data());

  fs::path final_dir = checkpoint_dir(run_dir, step);
  on_every_rank(&comm, [&] {
    if (rank == 0) commit(run_dir, step, comm.size(), records, lengths, docs, keep);
  });
  return final_dir;
}

void verify_checkpoint(const fs::path& dir, Comm* comm) {
  const int rank = comm ? comm->rank() : 0, world = comm ? comm->size() : 1;
  on_every_rank(comm, [&] {
    json m = read_manifest(dir);
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
      MappedFile f(dir / name);
      const uint32_t crc = crc32c(f.data(), f.size());
      const uint32_t want = m["files"][name].value("crc32c", uint32_t{0});
      MOETRAIN_CHECK(crc == want,
                     "{}: CRC-32C {:08x}, the manifest says {:08x} (the file is corrupt)",
                     (dir / name).string(), crc, want);
    }
  });
}

std::optional<fs::path> find_latest_checkpoint(const fs::path& run_dir, Comm* comm) {
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
      return dir;
    } catch (const std::exception& e) {
      log_warn("refusing checkpoint {}: {}", dir.string(), e.what());
    }
  }
  return std::nullopt;
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
        std::span<const uint8_t> bytes = reader->bytes(key);
        std::memcpy(want.data + (lo - want.begin),
                    bytes.data() + static_cast<std::size_t>(lo - pb) * sizeof(float),
                    static_cast<std::size_t>(hi - lo) * sizeof(float));
        covered += hi - lo;
      }
      // The manifest's pieces do not overlap (read_manifest checked), so this is full coverage.
      MOETRAIN_CHECK(covered == want.end - want.begin,
                     "{}: tensor '{}' [{}, {}): only {} elements saved", dir.string(), want.name,
                     want.begin, want.end, covered);
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
  return write_checkpoint(*local, run_dir, step, share, {c.config, c.trainer}, keep);
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
