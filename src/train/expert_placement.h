// Hot-expert replication in a training run (the [placement] keys, moe/placement.h): the planner
// over the MoE layers' measured loads, the replica sync over the EP group, and the two places the
// trainer hands over to them.
//   backward: as soon as a block's backward is done, its replicas' gradients go to their owners
//             (before the block's gradients are handed on, so overlapped reductions see them)
//   after each optimizer step: the step's global loads feed the moving averages; every
//             placement.every steps a re-plan (its moves logged); then every replica is
//             refreshed from its owner's updated weights
// Every EP group plans from the same global loads, so all of them hold the same placements.
// Placements are not checkpointed: a resumed run starts from static placement and re-plans.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/comm.h"
#include "model/trainable.h"
#include "moe/config.h"
#include "moe/placement.h"
#include "parallel/replica_sync.h"

namespace moetrain {

class ExpertPlacement {
 public:
  // ep_group: a communicator of its own over the EP group (one process: a group of one).
  // moe: the model's MoE layer settings.
  ExpertPlacement(const PlacementConfig& cfg, TrainableModel& model, const MoeConfig& moe,
                  std::unique_ptr<Comm> ep_group, int64_t ranks_per_node);

  // The model's grads-ready hook over the gradient buffer `grads`: replica gradients first, then
  // `inner` (may be empty). Collective over the EP group, like the backward.
  std::function<void(int64_t)> grads_ready(std::function<void(int64_t)> inner, float* grads);
  // steps: optimizer steps done; loads (MoE layers, E): the step's global loads. Collective.
  void after_step(int64_t steps, const std::vector<std::vector<int64_t>>& loads, float* params);
  // Every replica takes its owner's weights in `params` (no re-plan). Collective.
  void refresh(float* params);

  // Per MoE layer: mean replicas per expert; the busiest rank's share of `loads` over the mean,
  // each expert's load split evenly over its replicas.
  std::vector<double> replicas_per_expert() const;
  std::vector<double> rank_max_mean_load(const std::vector<std::vector<int64_t>>& loads) const;

 private:
  void reduce_block(int64_t m, float* grads);

  std::unique_ptr<Comm> group_;
  std::vector<MoeBlockRef> blocks_;  // (MoE layers) each MoE layer's block
  PlacementPlanner planner_;
  ReplicaSync sync_;
  std::vector<bool> reduced_;  // (MoE layers) replica gradients sent in this backward
};

}  // namespace moetrain
