#include "train/step_update.h"

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
                           Comm& control, Accumulated& acc, StepFigures figures) {
  if (moe_cfg.router == RouterKind::SigmoidBias) update_router_biases(moe, moe_cfg.E, control);
  reduce_step_figures(control, acc);
  figures.acc = &acc;
  return step_metrics_line(figures);
}

}  // namespace moetrain
