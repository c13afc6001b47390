#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "moe/placement.h"

using namespace moetrain;

namespace {

double max_of(const std::vector<double>& v) {
  return *std::max_element(v.begin(), v.end());
}

// Every rank within its El + R slots, at most R·P extra replicas, every expert placed, no rank
// with two replicas of one expert.
void expect_valid(const Placement& p, int64_t E, int64_t P, int64_t R) {
  ASSERT_EQ(p.slots(), P * (E / P + R));
  int64_t used = 0;
  for (int64_t r = 0; r < P; ++r) {
    std::vector<int32_t> here;
    for (int64_t j = 0; j < p.slots_per_rank; ++j) {
      const int32_t e = p.slot_expert[r * p.slots_per_rank + j];
      if (e < 0) continue;
      EXPECT_EQ(std::count(here.begin(), here.end(), e), 0) << "expert " << e << " twice on " << r;
      here.push_back(e);
      ++used;
    }
  }
  EXPECT_LE(used - E, R * P);
  for (int64_t n : p.replicas()) EXPECT_GE(n, 1);
}

// The smallest largest rank load over every placement: each expert on a non-empty set of ranks,
// its load split evenly over them, at most El + R experts per rank and R·P extra replicas.
double brute_force(const std::vector<double>& load, int64_t P, int64_t R) {
  const int64_t E = static_cast<int64_t>(load.size()), cap = E / P + R;
  double best = std::numeric_limits<double>::infinity();
  std::vector<double> rank(static_cast<std::size_t>(P), 0.0);
  std::vector<int64_t> used(static_cast<std::size_t>(P), 0);
  auto go = [&](auto&& self, int64_t e, int64_t extra) -> void {
    if (e == E) {
      best = std::min(best, max_of(rank));
      return;
    }
    for (int mask = 1; mask < (1 << P); ++mask) {
      const int k = __builtin_popcount(static_cast<unsigned>(mask));
      if (extra + k - 1 > R * P) continue;
      bool fits = true;
      for (int r = 0; r < P; ++r) fits &= !(mask >> r & 1) || used[r] < cap;
      if (!fits) continue;
      for (int r = 0; r < P; ++r)
        if (mask >> r & 1) ++used[r], rank[r] += load[e] / k;
      self(self, e + 1, extra + k - 1);
      for (int r = 0; r < P; ++r)
        if (mask >> r & 1) --used[r], rank[r] -= load[e] / k;
    }
  };
  go(go, 0, 0);
  return best;
}

std::vector<double> zipf_loads(int64_t E, double s, std::mt19937& rng) {
  std::vector<double> l(static_cast<std::size_t>(E));
  for (int64_t e = 0; e < E; ++e) l[e] = 1000.0 / std::pow(static_cast<double>(e + 1), s);
  std::shuffle(l.begin(), l.end(), rng);
  return l;
}

}  // namespace

TEST(Placement, ConfigRejectsBadKeysByName) {
  auto message = [](PlacementConfig c) {
    try {
      c.validate(8, 4);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message({.spare_slots = 3}).find("placement.spare_slots = 3"), std::string::npos);
  EXPECT_NE(message({.spare_slots = -1}).find("placement.spare_slots"), std::string::npos);
  EXPECT_NE(message({.spare_slots = 1, .every = 0}).find("placement.every = 0"), std::string::npos);
  EXPECT_NE(message({.spare_slots = 1, .decay = 1.0}).find("placement.decay"), std::string::npos);
  EXPECT_EQ(message({.spare_slots = 2, .every = 5}), "");
}

TEST(Placement, StaticIsContiguousWithEmptySpares) {
  const Placement p = static_placement(4, 2, 1);
  EXPECT_EQ(p.slot_expert, (std::vector<int32_t>{0, 1, -1, 2, 3, -1}));
  EXPECT_EQ(p.replicas(), (std::vector<int64_t>{1, 1, 1, 1}));
}

TEST(Placement, ReplicasGoToTheHeaviestPerReplica) {
  // Mean slot load 24 / 8 = 3: 16 → 8 → 5.3 per replica, 6 → 3 for expert 1, then expert 0
  // (5.3 → 4); the last extra would leave a replica of 3, no heavier than the mean slot.
  EXPECT_EQ(plan_replicas({16, 6, 1, 1}, 4, 1), (std::vector<int64_t>{4, 2, 1, 1}));
  // An expert on every rank gets no more; the next heaviest does (6 > 24 / 6).
  EXPECT_EQ(plan_replicas({16, 6, 1, 1}, 2, 1), (std::vector<int64_t>{2, 2, 1, 1}));
  // At most `max_replicas` each (the node size in the hierarchical policy); light experts none.
  EXPECT_EQ(plan_replicas({100, 1, 1, 1}, 4, 1, 2), (std::vector<int64_t>{2, 1, 1, 1}));
  EXPECT_EQ(plan_replicas({100, 90, 1, 1}, 4, 1, 2), (std::vector<int64_t>{2, 2, 1, 1}));
  // No load, no replicas.
  EXPECT_EQ(plan_replicas({0, 0, 0, 0}, 2, 1), (std::vector<int64_t>{1, 1, 1, 1}));
}

TEST(Placement, WithinOneExpertOfTheBruteForceOptimum) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> uni(0.0, 100.0);
  const int64_t shapes[][2] = {{4, 2}, {6, 2}, {6, 3}};
  int checked = 0;
  for (const auto& shape : shapes) {
    const int64_t E = shape[0], P = shape[1], R = 1;
    for (int trial = 0; trial < 40; ++trial) {
      std::vector<double> load(static_cast<std::size_t>(E));
      if (trial % 2 == 0)
        for (double& l : load) l = uni(rng);
      else
        load = zipf_loads(E, 1.2, rng);
      const Placement p = plan_placement(load, P, R, 0, nullptr);
      expect_valid(p, E, P, R);
      const double got = max_of(p.rank_loads(load)), opt = brute_force(load, P, R);
      EXPECT_GE(got, opt - 1e-9);
      EXPECT_LE(got, opt + max_of(load) + 1e-9) << "E=" << E << " P=" << P << " trial " << trial;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 120);
}

TEST(Placement, NeverExceedsTheSlotBudget) {
  std::mt19937 rng(3);
  for (int64_t P : {2, 4, 8})
    for (int64_t El : {1, 2, 4})
      for (int64_t R = 0; R <= El; ++R) {
        const int64_t E = El * P;
        const std::vector<double> load = zipf_loads(E, 1.2, rng);
        const Placement p = plan_placement(load, P, R, P >= 4 ? 2 : 0, nullptr);
        expect_valid(p, E, P, R);
        // Spare slots never make the largest rank load worse than static placement.
        EXPECT_LE(max_of(p.rank_loads(load)),
                  max_of(static_placement(E, P, R).rank_loads(load)) + 1e-9);
      }
}

TEST(Placement, SameLoadsReplanMovesNothing) {
  std::mt19937 rng(11);
  const std::vector<double> load = zipf_loads(8, 1.2, rng);
  const Placement first = plan_placement(load, 4, 1, 0, nullptr);
  const Placement again = plan_placement(load, 4, 1, 0, &first);
  EXPECT_EQ(first, again);
  EXPECT_TRUE(placement_moves(first, again).empty());
  EXPECT_FALSE(placement_moves(static_placement(8, 4, 1), first).empty());
}

TEST(Placement, KeepsSlotsOfExpertsThatStay) {
  // Expert 0 hot: it gains a replica; the others keep their static slots.
  const Placement s = static_placement(4, 2, 1);
  const Placement p = plan_placement({10, 1, 1, 1}, 2, 1, 0, &s);
  expect_valid(p, 4, 2, 1);
  EXPECT_EQ(p.replicas()[0], 2);
  const std::vector<ExpertMove> moves = placement_moves(s, p);
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].expert, 0);
  EXPECT_EQ(moves[0].from_rank, 0);
  EXPECT_EQ(moves[0].to_rank, 1);
  EXPECT_EQ(describe_moves(2, moves), "layer 2: expert 0 rank 0 -> rank 1");
}

TEST(Placement, HierarchicalKeepsReplicasOnTheHomeNode) {
  // 4 ranks, 2 per node; expert 0 (rank 0, node 0) hot: its replica goes to rank 1, not to the
  // lighter ranks of node 1.
  std::vector<double> load(8, 1.0);
  load[0] = 40.0;
  const Placement p = plan_placement(load, 4, 1, 2, nullptr);
  expect_valid(p, 8, 4, 1);
  EXPECT_EQ(p.replicas()[0], 2);
  for (int64_t s : p.slots_of(0)) EXPECT_LT(p.rank_of(s), 2);
  const Placement flat = plan_placement(load, 4, 1, 0, nullptr);
  EXPECT_EQ(flat.replicas()[0], 4);
}

TEST(Placement, PlannerAveragesAndReplansEveryN) {
  PlacementConfig cfg{.spare_slots = 1, .every = 2, .decay = 0.5};
  PlacementPlanner planner(cfg, 1, 4, 2, 0);
  const int64_t a[] = {8, 0, 0, 0}, b[] = {0, 0, 0, 8};
  planner.observe(0, a);
  planner.observe(0, b);
  EXPECT_EQ(planner.average(0), (std::vector<double>{4, 0, 0, 4}));
  EXPECT_FALSE(planner.due(1));
  EXPECT_TRUE(planner.due(2));
  EXPECT_DOUBLE_EQ(planner.replicas_per_expert(0), 1.0);
  EXPECT_FALSE(planner.replan(0).empty());
  EXPECT_EQ(planner.placement(0).replicas(), (std::vector<int64_t>{2, 1, 1, 2}));
  EXPECT_DOUBLE_EQ(planner.replicas_per_expert(0), 1.5);
  EXPECT_TRUE(planner.replan(0).empty());
}
