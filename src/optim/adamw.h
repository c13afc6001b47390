// AdamW with torch.optim.AdamW semantics (decoupled weight decay, bias-corrected moments):
//   p ← p·(1 − lr·wd)                          (only where the group decays)
//   m ← β1·m + (1 − β1)·g
//   v ← β2·v + (1 − β2)·g²
//   p ← p − (lr / (1 − β1^t)) · m / (√v / √(1 − β2^t) + eps)
// Per-step scalars are computed in double and rounded once; the elementwise work is float.
#pragma once
#include <vector>

#include "optim/optimizer.h"

namespace moetrain {

class AdamW final : public Optimizer {
 public:
  AdamW(const OptimizerConfig& config, std::span<const ParamRange> groups, int64_t begin,
        int64_t end, StateStorage storage = StateStorage::Owned);

 protected:
  void update(float* params, const float* grads, float* const* state, float lr) override;
  // bf16 copies in the update's own pass; fp16 ones after it.
  bool writes_lp_copy(DType t) const override { return t == DType::BF16; }

};

}  // namespace moetrain
