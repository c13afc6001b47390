// Test support: every tensor of a checkpoint, whole, whatever layout wrote it.
#pragma once
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "io/checkpoint.h"

namespace moetrain::testing {

// "model/<name>", "optimizer/<name>", "state/<name>" → the tensor's values (flattened).
inline std::map<std::string, std::vector<float>> read_all_tensors(
    const std::filesystem::path& dir) {
  const nlohmann::json manifest = read_checkpoint_json(dir, "manifest.json");
  std::map<std::string, std::vector<float>> out;
  CheckpointShare share;
  for (const char* family : {"model", "optimizer", "state"}) {
    for (auto& [name, t] : manifest["tensors"][family].items()) {
      Shape shape = t["shape"].get<Shape>();
      std::vector<float>& v = out[std::string(family) + "/" + name];
      v.assign(static_cast<std::size_t>(shape_numel(shape)), 0.0f);
      TensorPiece p = whole_tensor(name, shape, v.data());
      (family[0] == 'm'   ? share.model
       : family[0] == 'o' ? share.optimizer
                          : share.state)
          .push_back(p);
    }
  }
  read_checkpoint_pieces(dir, share);
  return out;
}

}  // namespace moetrain::testing
