#include "io/hf_checkpoint.h"

#include <fmt/format.h>

#include <map>
#include <memory>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/dtype.h"
#include "io/safetensors.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace moetrain {

namespace {

constexpr const char* kSingle = "model.safetensors";
constexpr const char* kIndex = "model.safetensors.index.json";

std::string shape_text(const Shape& s) {
  return fmt::format("[{}]", fmt::join(s, ", "));
}

// The index's shard names must be files of the directory itself: an index naming
// "../elsewhere" or an absolute path would read weights from outside what the user pointed at.
fs::path shard_path(const fs::path& dir, const std::string& file, const fs::path& index) {
  const fs::path f(file);
  MOETRAIN_CHECK(!file.empty() && f.filename() == f && file != "." && file != "..",
                 "{}: weight_map names '{}', which is not a file name in that directory",
                 index.string(), file);
  const fs::path p = dir / f;
  MOETRAIN_CHECK(fs::is_regular_file(p), "{}: weight_map names {}, which does not exist",
                 index.string(), p.string());
  return p;
}

}  // namespace

bool is_hf_model_dir(const fs::path& dir) {
  return fs::is_directory(dir) && !fs::exists(dir / "manifest.json") &&
         fs::is_regular_file(dir / "config.json") &&
         (fs::is_regular_file(dir / kSingle) || fs::is_regular_file(dir / kIndex));
}

void read_hf_tensors(const fs::path& dir, const std::vector<NamedTensor>& into) {
  // Every tensor name of the directory → the reader of the file that holds it.
  std::vector<std::unique_ptr<SafetensorsReader>> files;
  std::map<std::string, const SafetensorsReader*> where;
  // Where the names come from: the index when there is one (a shard it does not list is not
  // part of the model, as in transformers), else the one file.
  const bool sharded = fs::is_regular_file(dir / kIndex);
  const fs::path listing = dir / (sharded ? kIndex : kSingle);
  if (sharded) {
    const fs::path index = dir / kIndex;
    const json doc = read_checkpoint_json(dir, kIndex);
    MOETRAIN_CHECK(doc.is_object() && doc.contains("weight_map") && doc["weight_map"].is_object(),
                   "{}: no 'weight_map' object", index.string());
    std::map<std::string, const SafetensorsReader*> by_file;
    for (const auto& [name, file] : doc["weight_map"].items()) {
      MOETRAIN_CHECK(file.is_string(), "{}: weight_map['{}'] is not a file name", index.string(),
                     name);
      const std::string f = file.get<std::string>();
      if (!by_file.count(f)) {
        files.push_back(std::make_unique<SafetensorsReader>(shard_path(dir, f, index)));
        by_file[f] = files.back().get();
      }
      const SafetensorsReader* r = by_file[f];
      MOETRAIN_CHECK(r->contains(name), "{}: weight_map puts '{}' in {}, which does not hold it",
                     index.string(), name, r->path().string());
      where[name] = r;
    }
    // A tensor in a shard but not in the index: transformers would not load it either way, so
    // the directory is not the model the index describes.
    for (const auto& r : files)
      for (const std::string& name : r->names())
        MOETRAIN_CHECK(where.count(name) && where[name] == r.get(),
                       "{}: holds tensor '{}', which {} does not map to it", r->path().string(),
                       name, index.string());
  } else {
    files.push_back(std::make_unique<SafetensorsReader>(dir / kSingle));
    for (const std::string& name : files.back()->names()) where[name] = files.back().get();
  }

  std::set<std::string> wanted;
  for (const NamedTensor& t : into) {
    wanted.insert(t.name);
    auto it = where.find(t.name);
    MOETRAIN_CHECK(it != where.end(), "{}: no tensor '{}' (shape {})", listing.string(), t.name,
                   shape_text(t.shape));
    const SafetensorsReader& r = *it->second;
    const SafetensorsEntry& e = r.entry(t.name);
    MOETRAIN_CHECK(e.shape == t.shape, "{}: tensor '{}' has shape {}, the model expects {}",
                   r.path().string(), t.name, shape_text(e.shape), shape_text(t.shape));
    DType from;
    switch (e.dtype) {
      case SafetensorsDType::F32:
        from = DType::F32;
        break;
      case SafetensorsDType::BF16:
        from = DType::BF16;
        break;
      case SafetensorsDType::F16:
        from = DType::F16;
        break;
      default:
        MOETRAIN_FAIL("{}: tensor '{}' is {}; weights must be F32, BF16 or F16", r.path().string(),
                      t.name, safetensors_dtype_name(e.dtype));
    }
    // Copied to a buffer first: the map's bytes carry no alignment guarantee.
    const std::size_t n = static_cast<std::size_t>(e.numel());
    std::vector<uint8_t> raw(n * dtype_size(from));
    r.copy_bytes(t.name, raw.data(), raw.size());
    dtype_to_f32(from, t.data, raw.data(), n);
    check_finite_tensor(t.data, static_cast<int64_t>(n), r.path(), t.name);
  }
  for (const auto& [name, r] : where)
    MOETRAIN_CHECK(wanted.count(name), "{}: tensor '{}' is not a parameter of this model",
                   r->path().string(), name);
}

}  // namespace moetrain
