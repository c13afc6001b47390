// AdaGrad, torch.optim.Adagrad semantics:
//   g ← g + wd·p                               (only where the group decays)
//   sum ← sum + g²                             (sum starts at initial_accumulator_value)
//   p ← p − lr_t · g / (√sum + eps),   lr_t = lr / (1 + (t − 1)·lr_decay)
#pragma once
#include <vector>

#include "optim/optimizer.h"

namespace moetrain {

class AdaGrad final : public Optimizer {
 public:
  AdaGrad(const OptimizerConfig& config, std::span<const ParamRange> groups, int64_t begin,
          int64_t end, StateStorage storage = StateStorage::Owned);

 protected:
  void update(float* params, const float* grads, float* const* state, float lr) override;
};

}  // namespace moetrain
