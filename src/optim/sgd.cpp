#include "optim/sgd.h"

#include "core/check.h"

namespace moetrain {

namespace {

// p, g, buf (hi - lo, offset by lo); must run inside a parallel region (or serially).
template <bool kDecay, bool kMomentum, bool kFirst, bool kNesterov>
void sgd_segment(float* p, const float* g, float* buf, int64_t lo, int64_t hi, float lr, float wd,
                 float mu) {
#pragma omp for simd schedule(static) nowait
  for (int64_t i = lo; i < hi; ++i) {
    float grad = g[i];
    if constexpr (kDecay) grad = grad + wd * p[i];
    if constexpr (kMomentum) {
      const float b = kFirst ? grad : mu * buf[i] + grad;
      buf[i] = b;
      grad = kNesterov ? grad + mu * b : b;
    }
    p[i] = p[i] - lr * grad;
  }
}

}  // namespace

namespace {
std::vector<StateSpec> sgd_state(const OptimizerConfig& c) {
  if (c.momentum == 0.0) return {};
  return {{"momentum", 0.0f}};
}
}  // namespace

Sgd::Sgd(const OptimizerConfig& config, std::span<const ParamRange> groups, int64_t begin,
         int64_t end, StateStorage storage)
    : Optimizer(config, groups, begin, end, sgd_state(config), storage) {
  MOETRAIN_CHECK(config.kind == OptimizerKind::Sgd, "Sgd built from a '{}' config",
                 optimizer_kind_name(config.kind));
}

void Sgd::update(float* params, const float* grads, float* const* state, float lr) {
  const OptimizerConfig& c = config();
  const float wd = static_cast<float>(c.weight_decay);
  const float mu = static_cast<float>(c.momentum);
  // The buffer is the gradient itself at the first step, as in PyTorch (not μ·0 + g).
  const bool first = step_count() == 1;
  float* buf = c.momentum != 0.0 ? state[0] : nullptr;
  for_each_segment([&](int64_t lo, int64_t hi, bool decay) {
    with_flag(decay && c.weight_decay != 0.0, [&](auto kDecay) {
      with_flag(c.momentum != 0.0, [&](auto kMomentum) {
        with_flag(first, [&](auto kFirst) {
          with_flag(c.nesterov, [&](auto kNesterov) {
            sgd_segment<kDecay(), kMomentum(), kFirst(), kNesterov()>(params, grads, buf, lo, hi,
                                                                      lr, wd, mu);
          });
        });
      });
    });
  });
}

}  // namespace moetrain
