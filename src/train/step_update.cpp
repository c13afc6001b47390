#include "train/step_update.h"

#include "core/check.h"
#include "core/timer.h"

namespace moetrain {

StepUpdate reduce_and_update(GradReducer& reducer, ShardedOptimizer& optimizer, Comm& control,
                             float* params, float* grads, float lr, const UpdateOptions& opts) {
  StepUpdate out;
  const double sync_before = reducer.seconds();
  double exposed = 0;
  GradientShard* shard = nullptr;
  {
    ScopedTimer timer(exposed);
    shard = &reducer.reduce(grads);
  }
  out.outcome = apply_update(*shard, control, opts, [&] {
    Timer outside;
    double update_s = 0;
    reducer.update(params, grads, [&] {
      ScopedTimer timer(update_s);
      optimizer.step(params, grads, lr);
    });
    exposed += outside.seconds() - update_s;  // the ZeRO-1 parameter all-gather
  });
  out.sync_s = reducer.seconds() - sync_before;
  out.sync_exposed_s = exposed;
  return out;
}

nlohmann::json finish_step(const std::vector<MoeLayer*>& moe, const MoeConfig& moe_cfg,
                           Comm& control, Accumulated& acc, StepFigures figures,
                           std::vector<CapacityController>* capacity) {
  if (moe_cfg.router == RouterKind::SigmoidBias) update_router_biases(moe, moe_cfg.E, control);
  reduce_step_figures(control, acc);
  figures.acc = &acc;
  nlohmann::json line = step_metrics_line(figures);
  if (capacity) {
    MOETRAIN_CHECK(capacity->size() == moe.size(),
                   "finish_step: {} capacity controllers for {} MoE layers", capacity->size(),
                   moe.size());
    for (std::size_t m = 0; m < moe.size(); ++m)
      (*capacity)[m].update(capacity_utilisation(acc, m), imbalance(acc.tokens_per_expert[m]));
    apply_capacity_factors(*capacity, moe);
  }
  return line;
}

void apply_capacity_factors(const std::vector<CapacityController>& capacity,
                            const std::vector<MoeLayer*>& moe) {
  for (std::size_t m = 0; m < moe.size(); ++m) {
    const float cf = static_cast<float>(capacity[m].cf());
    moe[m]->set_capacity_factor(moe[m]->config().capacity_factor < 0 ? -cf : cf);
  }
}

}  // namespace moetrain
