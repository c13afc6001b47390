// Hot-expert replication and placement (EPLB-style). Under expert parallelism over P ranks each
// rank computes El = E/P experts; with R spare slots per rank it runs El + R slots instead, and a
// planner decides which logical expert every slot computes: a hot expert gets several replicas on
// different ranks, and its tokens are split among them, so that no rank becomes the straggler.
//
// The planner is pure: loads in, slot table out.
//   1. replicas: every expert starts with one; R·P times, the expert with the largest load per
//      replica gets another (ties to the lower index), as long as that load is above the mean
//      load per slot (a lighter replica cannot relieve the busiest rank); an expert already on
//      every rank (on every rank of its node, with ranks_per_node > 0) gets none.
//   2. packing: replicas by load per replica, heaviest first (ties to the lower expert index),
//      each into the least loaded rank with a free slot that does not hold that expert yet (ties
//      to a rank that held it in the previous placement, then to the lower rank); with
//      ranks_per_node > 0, the expert's home node (the node of the rank that owns it statically) is
//      tried first, so node-limited routing stays on its node.
//   3. slots: an expert keeps its slot on a rank that held it in the previous placement, so a
//      re-plan that changes nothing moves nothing.
// Slot s of the table lives on rank s / (El + R); the exchange sees the P·(El + R) slots as its
// experts.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moetrain {

// The [placement] keys.
struct PlacementConfig {
  int64_t spare_slots = 0;  // R per rank; 0 = off
  int64_t every = 100;      // re-plan every N optimizer steps
  double decay = 0.9;       // moving average of the loads: avg = decay·avg + (1 − decay)·load

  bool enabled() const { return spare_slots > 0; }
  // Throws naming the placement.* key out of range (R > E/P or < 0, every < 1, decay ∉ [0, 1)).
  void validate(int64_t E, int64_t P) const;
};

struct Placement {
  int64_t E = 0, P = 1, slots_per_rank = 0;  // logical experts, ranks, El + R
  std::vector<int32_t> slot_expert;          // (P · slots_per_rank) logical expert, -1 = empty

  int64_t slots() const { return static_cast<int64_t>(slot_expert.size()); }
  int64_t rank_of(int64_t slot) const { return slot / slots_per_rank; }
  // (E) replicas of each expert.
  std::vector<int64_t> replicas() const;
  // The slots of expert e, ascending.
  std::vector<int64_t> slots_of(int64_t e) const;
  // (P) Σ over each rank's slots of load[e] / replicas[e].
  std::vector<double> rank_loads(const std::vector<double>& load) const;
  bool operator==(const Placement&) const = default;
};

// Expert e on slot (e / El)·(El + R) + e % El: static contiguous ownership, spare slots empty.
Placement static_placement(int64_t E, int64_t P, int64_t R);

// (E) replicas per expert: step 1 above with R·P extra replicas, at most max_replicas each
// (0 = P).
std::vector<int64_t> plan_replicas(const std::vector<double>& load, int64_t P, int64_t R,
                                   int64_t max_replicas = 0);

// The placement for `load` (E, ≥ 0). previous: the placement in force (same E, P, R) or null.
Placement plan_placement(const std::vector<double>& load, int64_t P, int64_t R,
                         int64_t ranks_per_node, const Placement* previous);

// A replica that lands on a rank that did not hold its expert.
struct ExpertMove {
  int64_t expert = 0, from_rank = 0, to_rank = 0;  // from: a rank that held it before
};
std::vector<ExpertMove> placement_moves(const Placement& before, const Placement& after);

// Per MoE layer: the moving average of each logical expert's load and the placement in force.
class PlacementPlanner {
 public:
  PlacementPlanner() = default;
  PlacementPlanner(const PlacementConfig& cfg, int64_t layers, int64_t E, int64_t P,
                   int64_t ranks_per_node);

  // One optimizer step's global loads (E) of `layer` (the first call sets the average).
  void observe(int64_t layer, const int64_t* load);
  // Whether the step that has just finished (1-based) re-plans.
  bool due(int64_t step) const { return cfg_.enabled() && step % cfg_.every == 0; }
  // Re-plans `layer` from its average; returns the moves (empty: nothing changed).
  std::vector<ExpertMove> replan(int64_t layer);

  const Placement& placement(int64_t layer) const { return placements_[layer]; }
  const std::vector<double>& average(int64_t layer) const { return avg_[layer]; }
  // Mean replicas per expert of `layer` (1 when off).
  double replicas_per_expert(int64_t layer) const;

 private:
  PlacementConfig cfg_;
  int64_t E_ = 0, P_ = 1, ranks_per_node_ = 0;
  std::vector<std::vector<double>> avg_;  // (layers, E)
  std::vector<bool> seen_;                // (layers)
  std::vector<Placement> placements_;     // (layers)
};

// "layer 1: expert 3 rank 0 -> rank 2; ..." for the log.
std::string describe_moves(int64_t layer, const std::vector<ExpertMove>& moves);

}  // namespace moetrain
