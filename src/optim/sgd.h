// SGD with momentum, torch.optim.SGD semantics (dampening 0, weight decay added to the gradient):
//   g ← g + wd·p                               (only where the group decays)
//   buf ← g at the first step, then μ·buf + g  (when μ > 0)
//   g ← g + μ·buf if nesterov, else buf
//   p ← p − lr·g
#pragma once
#include <vector>

#include "optim/optimizer.h"

namespace moetrain {

class Sgd final : public Optimizer {
 public:
  Sgd(const OptimizerConfig& config, std::span<const ParamRange> groups, int64_t begin,
      int64_t end, StateStorage storage = StateStorage::Owned);

 protected:
  void update(float* params, const float* grads, float* const* state, float lr) override;
};

}  // namespace moetrain
