#include "moe/slot_routing.h"

#include "core/check.h"

namespace moetrain {

void route_to_slots(Routing& out, const Routing& r, const Placement& p) {
  MOETRAIN_CHECK(r.E == p.E, "route_to_slots: routing over {} experts, placement over {}", r.E,
                 p.E);
  const int64_t n_assign = r.N * r.S;
  std::vector<int64_t> n(static_cast<std::size_t>(r.E), 0), seen(n.size(), 0);
  for (int64_t i = 0; i < n_assign; ++i)
    if (r.expert[i] >= 0) ++n[r.expert[i]];
  std::vector<std::vector<int64_t>> slots(n.size());
  for (int64_t e = 0; e < r.E; ++e) {
    slots[e] = p.slots_of(e);
    MOETRAIN_CHECK(!slots[e].empty(), "route_to_slots: expert {} has no slot", e);
  }
  out.N = r.N, out.E = p.slots(), out.S = r.S;
  out.weight = r.weight;
  out.expert.resize(static_cast<std::size_t>(n_assign));
  out.selected.resize(static_cast<std::size_t>(n_assign));
  for (int64_t i = 0; i < n_assign; ++i) {
    const int32_t e = r.expert[i];
    const int32_t sel = r.selected[i];
    out.selected[i] = sel >= 0 ? static_cast<int32_t>(slots[sel][0]) : -1;
    if (e < 0) {
      out.expert[i] = -1;
      continue;
    }
    // Replica i takes [n·i/k, n·(i+1)/k): the smallest i with n·(i+1)/k > j.
    const int64_t k = static_cast<int64_t>(slots[e].size()), j = seen[e]++;
    int64_t rep = 0;
    while (n[e] * (rep + 1) / k <= j) ++rep;
    out.expert[i] = static_cast<int32_t>(slots[e][rep]);
    out.selected[i] = out.expert[i];
  }
}

void slot_counts_to_experts(int64_t* per_expert, const int64_t* per_slot, const Placement& p) {
  for (int64_t e = 0; e < p.E; ++e) per_expert[e] = 0;
  for (int64_t s = 0; s < p.slots(); ++s)
    if (p.slot_expert[s] >= 0) per_expert[p.slot_expert[s]] += per_slot[s];
}

}  // namespace moetrain
