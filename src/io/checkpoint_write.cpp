#include "io/checkpoint.h"

#include <fmt/format.h>

#include <map>
#include <memory>

#include "core/build_info.h"
#include "core/check.h"
#include "core/fault.h"
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
  for (const TensorPiece* p : pieces) {
    const Shape shape = is_whole(*p) ? p->shape : Shape{p->end - p->begin};
    if (p->data)
      w.add(piece_key(*p), SafetensorsDType::F32, shape, p->data);
    else
      w.add_streamed(piece_key(*p), SafetensorsDType::F32, shape);  // written below from get
  }
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
  std::vector<float> window;
  for (const TensorPiece* p : pieces) {
    const int64_t n = p->end - p->begin;
    if (p->data) {
      put(p->data, static_cast<std::size_t>(n) * sizeof(float));
      continue;
    }
    MOETRAIN_CHECK(p->get, "checkpoint: tensor '{}' [{}, {}) has neither data nor a source",
                   p->name, p->begin, p->end);
    const int64_t step = kCheckpointWindow / static_cast<int64_t>(sizeof(float));
    window.resize(static_cast<std::size_t>(std::min(n, step)));
    for (int64_t at = 0; at < n; at += step) {
      const int64_t k = std::min(step, n - at);
      p->get(at, k, window.data());
      put(window.data(), static_cast<std::size_t>(k) * sizeof(float));
    }
  }
  out.commit();
  return r;
}

FileRecord write_bytes_file(const fs::path& path, std::string_view bytes) {
  write_file_atomic(path, bytes);
  return {bytes.size(), crc32c(bytes.data(), bytes.size())};
}

FileRecord write_json_file(const fs::path& path, const json& j) {
  return write_bytes_file(path, j.dump(2) + "\n");
}

// `latest` is a symbolic link to the newest checkpoint's directory, so that the path opens as
// that checkpoint in any program (transformers' from_pretrained, moetrain sample); replaced
// atomically by renaming a new link over it.
void point_latest(const fs::path& root, const fs::path& final_dir) {
  const fs::path tmp = root / ".latest.tmp";
  std::error_code ec;
  fs::remove(tmp, ec);
  fs::create_directory_symlink(final_dir.filename(), tmp, ec);
  MOETRAIN_CHECK(!ec, "cannot create the link {}: {}", tmp.string(), ec.message());
  // A directory in its place is a copy of a checkpoint (a tree copied with its links followed):
  // not a checkpoint of this run (no step_ name), and in the way of the link.
  const fs::path latest = root / "latest";
  if (fs::is_directory(fs::symlink_status(latest, ec))) {
    log_warn("{} is a directory, not the link to the newest checkpoint: replaced by the link",
             latest.string());
    fs::remove_all(latest, ec);
  }
  fs::rename(tmp, latest, ec);
  MOETRAIN_CHECK(!ec, "cannot rename {} to {}: {}", tmp.string(), (root / "latest").string(),
                 ec.message());
}

void prune(const fs::path& root, int64_t step, int64_t keep) {
  std::vector<std::pair<int64_t, fs::path>> complete;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root)) {
    if (!e.is_directory()) continue;
    const fs::path& p = e.path();
    if (int64_t s = step_of(p); s >= 0) {
      // A run resumes from the newest checkpoint that verifies, so one past this step is one
      // that could not be verified then (or a newer run's): never removed here, nor counted.
      if (s <= step) complete.push_back({s, p});
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
  for (const auto& [name, bytes] : docs.files)
    files[name] = file_entry(write_bytes_file(tmp / name, bytes), 0);
  // What wrote the checkpoint: the program (version, commit) and the machine (CPU, host).
  json trainer = docs.trainer;
  if (trainer.is_object() || trainer.is_null()) trainer["written_by"] = written_by();
  files["trainer_state.json"] =
      file_entry(write_json_file(tmp / "trainer_state.json", trainer), 0);
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
  point_latest(root, final_dir);
  prune(root, step, keep);
  return final_dir;
}

}  // namespace

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


}  // namespace moetrain
