// RMSProp, torch.optim.RMSprop semantics:
//   g ← g + wd·p                               (only where the group decays)
//   sq ← α·sq + (1 − α)·g²
//   centered: ga ← α·ga + (1 − α)·g,  d ← √(sq − ga²) + eps;  otherwise d ← √sq + eps
//   momentum μ > 0: buf ← μ·buf + g / d,  p ← p − lr·buf;  otherwise p ← p − lr·g / d
// Centered: sq − ga² ≥ 0 in exact arithmetic; a rounding-negative value is taken as 0 rather than
// giving NaN (NaN inputs still propagate).
#pragma once
#include <vector>

#include "optim/optimizer.h"

namespace moetrain {

class RmsProp final : public Optimizer {
 public:
  RmsProp(const OptimizerConfig& config, std::span<const ParamRange> groups, int64_t begin,
          int64_t end, StateStorage storage = StateStorage::Owned);

 protected:
  void update(float* params, const float* grads, float* const* state, float lr) override;
};

}  // namespace moetrain
