#include "moe/placement.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/check.h"

namespace moetrain {

void PlacementConfig::validate(int64_t E, int64_t P) const {
  // Experts that the ranks do not divide are refused where dist.ep is checked.
  const int64_t El = P >= 1 ? E / P : E;
  MOETRAIN_CHECK(spare_slots >= 0 && spare_slots <= El,
                 "placement.spare_slots = {}: must be in [0, {}] (experts per rank, {} experts "
                 "over {} ranks)",
                 spare_slots, El, E, P);
  MOETRAIN_CHECK(every >= 1, "placement.every = {}: must be at least 1 (optimizer steps)", every);
  MOETRAIN_CHECK(std::isfinite(decay) && decay >= 0.0 && decay < 1.0,
                 "placement.decay = {}: must be in [0, 1)", decay);
}

std::vector<int64_t> Placement::replicas() const {
  std::vector<int64_t> n(static_cast<std::size_t>(E), 0);
  for (int32_t e : slot_expert)
    if (e >= 0) ++n[e];
  return n;
}

std::vector<int64_t> Placement::slots_of(int64_t e) const {
  std::vector<int64_t> s;
  for (int64_t i = 0; i < slots(); ++i)
    if (slot_expert[i] == e) s.push_back(i);
  return s;
}

std::vector<double> Placement::rank_loads(const std::vector<double>& load) const {
  const std::vector<int64_t> n = replicas();
  std::vector<double> r(static_cast<std::size_t>(P), 0.0);
  for (int64_t s = 0; s < slots(); ++s) {
    const int32_t e = slot_expert[s];
    if (e >= 0) r[rank_of(s)] += load[e] / static_cast<double>(n[e]);
  }
  return r;
}

Placement static_placement(int64_t E, int64_t P, int64_t R) {
  MOETRAIN_CHECK(P >= 1 && E % P == 0 && R >= 0, "static placement: {} experts, {} ranks, {} spare",
                 E, P, R);
  const int64_t El = E / P;
  Placement p{E, P, El + R, std::vector<int32_t>(static_cast<std::size_t>(P * (El + R)), -1)};
  for (int64_t e = 0; e < E; ++e)
    p.slot_expert[(e / El) * (El + R) + e % El] = static_cast<int32_t>(e);
  return p;
}

std::vector<int64_t> plan_replicas(const std::vector<double>& load, int64_t P, int64_t R,
                                   int64_t max_replicas) {
  const int64_t E = static_cast<int64_t>(load.size());
  std::vector<int64_t> n(static_cast<std::size_t>(E), 1);
  if (E == 0) return n;
  if (max_replicas <= 0 || max_replicas > P) max_replicas = P;
  // A replica lighter than the mean slot cannot relieve the busiest rank.
  double total = 0;
  for (double l : load) total += l;
  const double mean_slot = total / static_cast<double>(E + R * P);
  for (int64_t extra = 0; extra < R * P; ++extra) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e)
      if (n[e] < max_replicas && (best < 0 || load[e] * static_cast<double>(n[best]) >
                                                  load[best] * static_cast<double>(n[e])))
        best = e;
    if (best < 0 || load[best] / static_cast<double>(n[best]) <= mean_slot) break;  // no gain
    ++n[best];
  }
  return n;
}

Placement plan_placement(const std::vector<double>& load, int64_t P, int64_t R,
                         int64_t ranks_per_node, const Placement* previous) {
  const int64_t E = static_cast<int64_t>(load.size());
  Placement out = static_placement(E, P, R);
  MOETRAIN_CHECK(R >= 0 && R <= E / P, "placement: {} spare slots for {} experts per rank", R,
                 E / P);
  for (double l : load)
    MOETRAIN_CHECK(std::isfinite(l) && l >= 0.0, "placement: expert load {} is not >= 0", l);
  MOETRAIN_CHECK(!previous || (previous->E == E && previous->P == P &&
                               previous->slots_per_rank == out.slots_per_rank),
                 "placement: the previous placement has another shape");
  const int64_t El = E / P, cap = El + R;
  const int64_t rpn = ranks_per_node > 0 && P % ranks_per_node == 0 ? ranks_per_node : 0;
  const std::vector<int64_t> n = plan_replicas(load, P, R, rpn);

  // Heaviest replica first; an expert's replicas are consecutive.
  std::vector<int64_t> order(static_cast<std::size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  auto per_replica = [&](int64_t e) { return load[e] / static_cast<double>(n[e]); };
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return per_replica(a) > per_replica(b); });
  std::vector<double> rank_load(static_cast<std::size_t>(P), 0.0);
  std::vector<int64_t> used(static_cast<std::size_t>(P), 0);
  std::vector<std::vector<int32_t>> held(static_cast<std::size_t>(P));  // experts per rank
  auto holds = [&](int64_t r, int64_t e) {
    return std::find(held[r].begin(), held[r].end(), e) != held[r].end();
  };
  auto held_before = [&](int64_t r, int64_t e) {
    for (int64_t j = 0; previous && j < cap; ++j)
      if (previous->slot_expert[r * cap + j] == e) return true;
    return false;
  };
  for (int64_t e : order) {
    const int64_t home = rpn > 0 ? (e / El) / rpn : -1;
    for (int64_t k = 0; k < n[e]; ++k) {
      int64_t best = -1;
      for (int pass = rpn > 0 ? 0 : 1; pass < 2 && best < 0; ++pass) {
        for (int64_t r = 0; r < P; ++r) {
          if (used[r] >= cap || holds(r, e) || (pass == 0 && r / rpn != home)) continue;
          // Ties go to a rank that held e before (nothing moves), then to the lower rank.
          if (best < 0 || rank_load[r] < rank_load[best] ||
              (rank_load[r] == rank_load[best] && held_before(r, e) && !held_before(best, e)))
            best = r;
        }
      }
      // Only the free slots of ranks that hold e are left: e keeps fewer replicas.
      if (best < 0) break;
      held[best].push_back(static_cast<int32_t>(e));
      ++used[best];
      rank_load[best] += per_replica(e);
    }
  }

  // Slots: what a rank held before stays in its slot; the rest fill its free slots in order.
  std::fill(out.slot_expert.begin(), out.slot_expert.end(), -1);
  for (int64_t r = 0; r < P; ++r) {
    std::vector<int32_t> rest;
    std::sort(held[r].begin(), held[r].end());
    for (int32_t e : held[r]) {
      int64_t kept = -1;
      for (int64_t j = 0; previous && j < cap && kept < 0; ++j)
        if (previous->slot_expert[r * cap + j] == e) kept = j;
      if (kept >= 0)
        out.slot_expert[r * cap + kept] = e;
      else
        rest.push_back(e);
    }
    int64_t j = 0;
    for (int32_t e : rest) {
      while (out.slot_expert[r * cap + j] >= 0) ++j;
      out.slot_expert[r * cap + j] = e;
    }
  }
  return out;
}

std::vector<ExpertMove> placement_moves(const Placement& before, const Placement& after) {
  std::vector<ExpertMove> moves;
  for (int64_t s = 0; s < after.slots(); ++s) {
    const int32_t e = after.slot_expert[s];
    if (e < 0) continue;
    const int64_t to = after.rank_of(s);
    int64_t from = -1;
    bool here = false;
    for (int64_t b : before.slots_of(e)) {
      if (before.rank_of(b) == to) here = true;
      if (from < 0) from = before.rank_of(b);
    }
    if (!here) moves.push_back({e, from, to});
  }
  return moves;
}

PlacementPlanner::PlacementPlanner(const PlacementConfig& cfg, int64_t layers, int64_t E, int64_t P,
                                   int64_t ranks_per_node)
    : cfg_(cfg), E_(E), P_(P), ranks_per_node_(ranks_per_node) {
  cfg_.validate(E, P);
  avg_.assign(static_cast<std::size_t>(layers), std::vector<double>(static_cast<std::size_t>(E)));
  seen_.assign(static_cast<std::size_t>(layers), false);
  placements_.assign(static_cast<std::size_t>(layers), static_placement(E, P, cfg_.spare_slots));
}

void PlacementPlanner::observe(int64_t layer, const int64_t* load) {
  std::vector<double>& a = avg_[layer];
  for (int64_t e = 0; e < E_; ++e) {
    const double l = static_cast<double>(load[e]);
    a[e] = seen_[layer] ? cfg_.decay * a[e] + (1.0 - cfg_.decay) * l : l;
  }
  seen_[layer] = true;
}

std::vector<ExpertMove> PlacementPlanner::replan(int64_t layer) {
  Placement next =
      plan_placement(avg_[layer], P_, cfg_.spare_slots, ranks_per_node_, &placements_[layer]);
  std::vector<ExpertMove> moves = placement_moves(placements_[layer], next);
  placements_[layer] = std::move(next);
  return moves;
}

double PlacementPlanner::replicas_per_expert(int64_t layer) const {
  const Placement& p = placements_[layer];
  int64_t used = 0;
  for (int32_t e : p.slot_expert) used += e >= 0;
  return E_ > 0 ? static_cast<double>(used) / static_cast<double>(E_) : 1.0;
}

std::string describe_moves(int64_t layer, const std::vector<ExpertMove>& moves) {
  std::string s = fmt::format("layer {}:", layer);
  for (std::size_t i = 0; i < moves.size(); ++i)
    s += fmt::format("{} expert {} rank {} -> rank {}", i ? ";" : "", moves[i].expert,
                     moves[i].from_rank, moves[i].to_rank);
  return s;
}

}  // namespace moetrain
