#include "optim/adagrad.h"

#include <cmath>

#include "core/check.h"

namespace moetrain {

namespace {

// p, g, sum (hi - lo, offset by lo); must run inside a parallel region (or serially).
template <bool kDecay>
void adagrad_segment(float* p, const float* g, float* sum, int64_t lo, int64_t hi, float clr,
                     float wd, float eps) {
#pragma omp for simd schedule(static) nowait
  for (int64_t i = lo; i < hi; ++i) {
    float grad = g[i];
    if constexpr (kDecay) grad = grad + wd * p[i];
    const float s = sum[i] + grad * grad;
    sum[i] = s;
    p[i] = p[i] - clr * (grad / (std::sqrt(s) + eps));
  }
}

}  // namespace

AdaGrad::AdaGrad(const OptimizerConfig& config, std::span<const ParamRange> groups, int64_t begin,
                 int64_t end, StateStorage storage)
    : Optimizer(config, groups, begin, end,
                {{"sum_sq", static_cast<float>(config.initial_accumulator_value)}}, storage) {
  MOETRAIN_CHECK(config.kind == OptimizerKind::AdaGrad, "AdaGrad built from a '{}' config",
                 optimizer_kind_name(config.kind));
}

void AdaGrad::update(float* params, const float* grads, float* const* state, float lr) {
  const OptimizerConfig& c = config();
  const float clr = static_cast<float>(double(lr) / (1.0 + double(step_count() - 1) * c.lr_decay));
  const float wd = static_cast<float>(c.weight_decay);
  const float eps = static_cast<float>(c.eps);
  float* sum = state[0];
  for_each_segment([&](int64_t lo, int64_t hi, bool decay) {
    with_flag(decay && c.weight_decay != 0.0, [&](auto kDecay) {
      adagrad_segment<kDecay()>(params, grads, sum, lo, hi, clr, wd, eps);
    });
  });
}

}  // namespace moetrain
