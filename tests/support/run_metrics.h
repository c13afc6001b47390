// Test support for runs' files: the values of one key over the lines of a run's metrics.jsonl, in
// order, as the exact doubles written (lines without the key are skipped); the largest relative
// difference of two series; one run's checkpoint set up for another run directory to resume from.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
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

// max over i of |a[i] − b[i]| / |b[i]| (over the shorter length).
inline double max_rel(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::max(1e-12, std::abs(b[i])));
  return worst;
}

// dir/<to> resumes from dir/<from>'s checkpoint of step `step` (and its metrics up to it, so that
// the resumed run's series is whole).
inline void copy_checkpoint(const std::filesystem::path& dir, const std::string& from,
                            const std::string& to, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  std::filesystem::create_directories(dir / to / "checkpoints");
  std::filesystem::copy(dir / from / "checkpoints" / name, dir / to / "checkpoints" / name);
  std::ofstream(dir / to / "checkpoints" / "latest") << name;
  std::ifstream in(dir / from / "metrics.jsonl");
  std::ofstream out(dir / to / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("step") || j["step"].get<int64_t>() <= step) out << line << "\n";
  }
}

}  // namespace moetrain::testing
