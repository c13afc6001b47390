// Test support: the values of one key over the lines of a run's metrics.jsonl, in order, as the
// exact doubles written (lines without the key are skipped).
#pragma once
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moetrain::testing {

inline std::vector<double> metric(const std::filesystem::path& run_dir, const char* key) {
  std::vector<double> out;
  std::ifstream in(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains(key)) out.push_back(j[key].get<double>());
  }
  return out;
}

}  // namespace moetrain::testing
