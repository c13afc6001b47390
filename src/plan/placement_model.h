// Hot-expert replication in the cost model (placement.spare_slots = R, moe/placement.h): the
// placement the trainer's planner makes for the load model's fractions, and the traffic its
// replicas cost. The placement's rank loads replace the static ones (each rank's load spread
// evenly over its E / EP experts for the expert-time formula, which then sees the rows a rank
// computes, not how they split over its El + R slots); every replica off its owner costs, per
// step and MoE layer, its weights sent from the owner after the update and its gradient sent
// back in backward (3·F·C f32 values each way).
#pragma once
#include <cstdint>

#include "plan/cost_model.h"

namespace moetrain::plan {

struct PlacedLoad {
  LoadModel load;                 // the load as the replicated placement spreads it over the ranks
  double replicas_off_owner = 0;  // the most replica slots of other ranks' experts on one rank
};

// The placement planned on each row of load.fractions (a measured load's steps are spread by
// the placement of the mean, as the trainer re-plans from a moving average). ranks_per_node > 0
// keeps replicas on their expert's home node (dist.hierarchical).
PlacedLoad placed_load(const LoadModel& load, int64_t ep, int64_t spare_slots,
                       int64_t ranks_per_node);

}  // namespace moetrain::plan
