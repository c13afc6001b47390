#include "train/expert_placement.h"

#include <algorithm>

#include "core/log.h"

namespace moetrain {

ExpertPlacement::ExpertPlacement(const PlacementConfig& cfg, Transformer& model,
                                 std::unique_ptr<Comm> ep_group, int64_t ranks_per_node)
    : model_(model),
      group_(std::move(ep_group)),
      planner_(cfg, static_cast<int64_t>(model.moe_layers().size()), model.config().n_experts,
               group_->size(), ranks_per_node),
      sync_(*group_, model.config().moe_config(model.config().dim)) {
  for (int64_t l = 0; l < model.config().n_layers; ++l)
    if (model.moe_index(l) >= 0) layer_of_.push_back(l);
  reduced_.assign(layer_of_.size(), false);
  std::vector<MoeLayer*> layers = model_.moe_layers();
  for (std::size_t m = 0; m < layers.size(); ++m)
    layers[m]->set_placement(&planner_.placement(static_cast<int64_t>(m)));
}

void ExpertPlacement::reduce_block(int64_t m, float* grads) {
  const MoeWeights g = moe_weights(grads, model_.layout().layers[layer_of_[m]]);
  sync_.reduce_grads(planner_.placement(m), g);
  reduced_[m] = true;
}

std::function<void(int64_t)> ExpertPlacement::grads_ready(std::function<void(int64_t)> inner,
                                                          float* grads) {
  return [this, inner = std::move(inner), grads](int64_t from) {
    // Backward visits the blocks last to first; `from` is the first offset that is final.
    for (int64_t m = static_cast<int64_t>(layer_of_.size()) - 1; m >= 0; --m) {
      if (reduced_[m]) continue;
      if (model_.layout().layers[layer_of_[m]].w1 >= from) reduce_block(m, grads);
    }
    if (inner) inner(from);
    if (from == 0) std::fill(reduced_.begin(), reduced_.end(), false);
  };
}

void ExpertPlacement::after_step(int64_t steps, const std::vector<std::vector<int64_t>>& loads,
                                 float* params) {
  std::vector<MoeLayer*> layers = model_.moe_layers();
  for (std::size_t m = 0; m < layers.size(); ++m) {
    const int64_t mi = static_cast<int64_t>(m);
    planner_.observe(mi, loads[m].data());
    if (planner_.due(steps)) {
      const std::vector<ExpertMove> moves = planner_.replan(mi);
      if (!moves.empty()) log_info("step {}: placement {}", steps, describe_moves(mi, moves));
      layers[m]->set_placement(&planner_.placement(mi));
    }
    sync_.refresh(planner_.placement(mi),
                  moe_weights(params, model_.layout().layers[layer_of_[m]]));
  }
}

std::vector<double> ExpertPlacement::replicas_per_expert() const {
  std::vector<double> out;
  for (std::size_t m = 0; m < layer_of_.size(); ++m)
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
