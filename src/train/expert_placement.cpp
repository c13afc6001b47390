#include "train/expert_placement.h"

#include <algorithm>

#include "core/log.h"

namespace moetrain {

ExpertPlacement::ExpertPlacement(const PlacementConfig& cfg, TrainableModel& model,
                                 const MoeConfig& moe, std::unique_ptr<Comm> ep_group,
                                 int64_t ranks_per_node)
    : group_(std::move(ep_group)),
      blocks_(model.moe_blocks()),
      planner_(cfg, static_cast<int64_t>(blocks_.size()), moe.E, group_->size(), ranks_per_node),
      sync_(*group_, moe) {
  reduced_.assign(blocks_.size(), false);
  for (std::size_t m = 0; m < blocks_.size(); ++m)
    blocks_[m].moe->set_placement(&planner_.placement(static_cast<int64_t>(m)));
}

void ExpertPlacement::reduce_block(int64_t m, float* grads) {
  const MoeWeights g = moe_weights(grads, blocks_[m].offsets);
  sync_.reduce_grads(planner_.placement(m), g);
  reduced_[m] = true;
}

std::function<void(int64_t)> ExpertPlacement::grads_ready(std::function<void(int64_t)> inner,
                                                          float* grads) {
  return [this, inner = std::move(inner), grads](int64_t from) {
    // Backward visits the blocks last to first; `from` is the first offset that is final.
    for (int64_t m = static_cast<int64_t>(blocks_.size()) - 1; m >= 0; --m) {
      if (reduced_[m]) continue;
      if (blocks_[m].offsets.w1 >= from) reduce_block(m, grads);
    }
    if (inner) inner(from);
    if (from == 0) std::fill(reduced_.begin(), reduced_.end(), false);
  };
}

void ExpertPlacement::after_step(int64_t steps, const std::vector<std::vector<int64_t>>& loads,
                                 float* params) {
  for (std::size_t m = 0; m < blocks_.size(); ++m) {
    const int64_t mi = static_cast<int64_t>(m);
    planner_.observe(mi, loads[m].data());
    if (planner_.due(steps)) {
      const std::vector<ExpertMove> moves = planner_.replan(mi);
      if (!moves.empty()) log_info("step {}: placement {}", steps, describe_moves(mi, moves));
      blocks_[m].moe->set_placement(&planner_.placement(mi));
    }
  }
  refresh(params);
}

void ExpertPlacement::refresh(float* params) {
  for (std::size_t m = 0; m < blocks_.size(); ++m)
    sync_.refresh(planner_.placement(static_cast<int64_t>(m)),
                  moe_weights(params, blocks_[m].offsets));
}

std::vector<double> ExpertPlacement::replicas_per_expert() const {
  std::vector<double> out;
  for (std::size_t m = 0; m < blocks_.size(); ++m)
    out.push_back(planner_.replicas_per_expert(static_cast<int64_t>(m)));
  return out;
}

std::vector<double> ExpertPlacement::rank_max_mean_load(
    const std::vector<std::vector<int64_t>>& loads) const {
  std::vector<double> out;
  for (std::size_t m = 0; m < loads.size(); ++m) {
    const std::vector<double> load(loads[m].begin(), loads[m].end());
    const std::vector<double> ranks = planner_.placement(static_cast<int64_t>(m)).rank_loads(load);
    double sum = 0, most = 0;
    for (double r : ranks) sum += r, most = std::max(most, r);
    out.push_back(sum > 0 ? most * static_cast<double>(ranks.size()) / sum : 1.0);
  }
  return out;
}

}  // namespace moetrain
