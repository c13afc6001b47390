#include "plan/placement_model.h"

#include <algorithm>

#include "moe/placement.h"

namespace moetrain::plan {

PlacedLoad placed_load(const LoadModel& load, int64_t ep, int64_t spare_slots,
                       int64_t ranks_per_node) {
  PlacedLoad out{load, 0};
  out.load.kind = load.kind + " replicated";
  for (std::size_t r = 0; r < load.fractions.size(); ++r) {
    const std::vector<double>& mean = load.fractions[r];
    const int64_t E = static_cast<int64_t>(mean.size()), el = E / ep;
    const Placement pl = plan_placement(mean, ep, spare_slots, ranks_per_node, nullptr);
    for (int64_t rk = 0; rk < ep; ++rk) {
      double off = 0;
      for (int64_t s = rk * pl.slots_per_rank; s < (rk + 1) * pl.slots_per_rank; ++s)
        off += pl.slot_expert[s] >= 0 && pl.slot_expert[s] / el != rk ? 1 : 0;
      out.replicas_off_owner = std::max(out.replicas_off_owner, off);
    }
    // Rank rk's placed load, spread evenly over the experts the expert-time formula gives it.
    auto spread = [&](const std::vector<double>& row) {
      const std::vector<double> ranks = pl.rank_loads(row);
      std::vector<double> placed(row.size());
      for (int64_t e = 0; e < E; ++e) placed[e] = ranks[e / el] / static_cast<double>(el);
      return placed;
    };
    out.load.fractions[r] = spread(mean);
    for (auto& step : out.load.steps)
      if (r < step.size()) step[r] = spread(step[r]);
  }
  return out;
}

}  // namespace moetrain::plan
