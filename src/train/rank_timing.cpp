#include "train/rank_timing.h"

#include <vector>

namespace moetrain {

void add_rank_timing(Comm& comm, const RankTiming& mine, nlohmann::json& line) {
  const int P = comm.size();
  if (P <= 1) return;
  const double values[2] = {mine.step_s, mine.compute_s};
  const std::vector<double> all = comm.allgather_same(values);
  std::vector<double> step(P), compute(P);
  for (int q = 0; q < P; ++q) step[q] = all[2 * q], compute[q] = all[2 * q + 1];
  line["rank_step_time_s"] = step;
  if (mine.compute_s >= 0) line["rank_compute_s"] = compute;
}

}  // namespace moetrain
