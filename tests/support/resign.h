// Test support: rewrite one file of a checkpoint and sign it again in its manifest, so that the
// checksums pass and only what reads the contents can find the fault.
#pragma once
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "io/checkpoint.h"
#include "io/crc32c.h"

namespace moetrain::testing {

inline void resign_checkpoint_file(const std::filesystem::path& dir, const std::string& file,
                                   const std::string& text) {
  std::ofstream(dir / file, std::ios::binary | std::ios::trunc) << text;
  nlohmann::json manifest = read_checkpoint_json(dir, "manifest.json");
  manifest["files"][file]["bytes"] = text.size();
  manifest["files"][file]["crc32c"] = crc32c(text.data(), text.size());
  std::ofstream(dir / "manifest.json", std::ios::binary | std::ios::trunc) << manifest.dump(2);
}

}  // namespace moetrain::testing
