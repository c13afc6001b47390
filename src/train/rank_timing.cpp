#include "train/rank_timing.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/check.h"

namespace moetrain {

void add_rank_timing(Comm& comm, const RankTiming& mine, nlohmann::json& line) {
  const int P = comm.size();
  const bool memory = mine.memory.peak >= 0;
  if (memory) {
    line["rss_bytes"] = static_cast<int64_t>(mine.memory.rss);
    line["peak_rss_bytes"] = static_cast<int64_t>(mine.memory.peak);
    line["peak_rss_bytes_max"] = static_cast<int64_t>(mine.memory.peak);
  }
  if (P <= 1) return;
  const double values[3] = {mine.step_s, mine.compute_s, mine.memory.peak};
  const std::vector<double> all = comm.allgather_same(values);
  std::vector<double> step(P), compute(P);
  std::vector<int64_t> peak(P);
  for (int q = 0; q < P; ++q)
    step[q] = all[3 * q], compute[q] = all[3 * q + 1],
    peak[q] = static_cast<int64_t>(all[3 * q + 2]);
  line["rank_step_time_s"] = step;
  if (mine.compute_s >= 0) line["rank_compute_s"] = compute;
  if (memory) {
    line["rank_peak_rss_bytes"] = peak;
    line["peak_rss_bytes_max"] = *std::max_element(peak.begin(), peak.end());
  }
}

namespace {

// A phase's name as a metrics key: lower-case letters and digits, every other run of characters
// one '_' ("experts (fwd, bwd data)" -> "experts_fwd_bwd_data").
std::string phase_key(std::string_view name) {
  std::string key;
  for (char c : name) {
    const bool word = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
    if (word)
      key += c;
    else if (!key.empty() && key.back() != '_')
      key += '_';
  }
  while (!key.empty() && key.back() == '_') key.pop_back();
  return key;
}

}  // namespace

void add_rank_phases(Comm& comm, const PhaseTable& mine, double step_s, nlohmann::json& line) {
  constexpr std::size_t kPhases = static_cast<std::size_t>(Phase::kCount);
  std::vector<double> values(kPhases + 1);
  double in_phases = 0;
  for (std::size_t i = 0; i < kPhases; ++i) {
    values[i] = mine[i].seconds;
    in_phases += mine[i].seconds;
  }
  values[kPhases] = step_s - in_phases;
  const int P = comm.size();
  const std::vector<double> all = comm.allgather_same(values);
  MOETRAIN_CHECK(all.size() == values.size() * static_cast<std::size_t>(P),
                 "phase profile: gathered {} values from {} ranks, expected {} each", all.size(), P,
                 values.size());
  for (std::size_t i = 0; i <= kPhases; ++i) {
    std::vector<double> per_rank(P);
    for (int q = 0; q < P; ++q) per_rank[q] = all[q * values.size() + i];
    const std::string name =
        i < kPhases ? phase_key(phase_name(static_cast<Phase>(i))) : std::string("other");
    line[fmt::format("profile_{}_s", name)] = per_rank;
  }
}

}  // namespace moetrain
