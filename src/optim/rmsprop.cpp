#include "optim/rmsprop.h"

#include <cmath>

#include "core/check.h"

namespace moetrain {

namespace {

struct RmsPropScalars {
  float lr, wd, alpha, one_minus_alpha, eps, mu;
};

// p, g, sq, buf, ga (hi - lo, offset by lo); must run inside a parallel region (or serially).
template <bool kDecay, bool kCentered, bool kMomentum>
void rmsprop_segment(float* p, const float* g, float* sq, float* buf, float* ga, int64_t lo,
                     int64_t hi, const RmsPropScalars& s) {
#pragma omp for simd schedule(static) nowait
  for (int64_t i = lo; i < hi; ++i) {
    float grad = g[i];
    if constexpr (kDecay) grad = grad + s.wd * p[i];
    const float sqi = s.alpha * sq[i] + s.one_minus_alpha * (grad * grad);
    sq[i] = sqi;
    float var = sqi;
    if constexpr (kCentered) {
      const float gai = s.alpha * ga[i] + s.one_minus_alpha * grad;
      ga[i] = gai;
      var = sqi - gai * gai;
      var = var < 0.0f ? 0.0f : var;
    }
    const float denom = std::sqrt(var) + s.eps;
    if constexpr (kMomentum) {
      const float b = s.mu * buf[i] + grad / denom;
      buf[i] = b;
      p[i] = p[i] - s.lr * b;
    } else {
      p[i] = p[i] - s.lr * (grad / denom);
    }
  }
}

}  // namespace

namespace {
std::vector<StateSpec> rmsprop_state(const OptimizerConfig& c) {
  std::vector<StateSpec> out{{"square_avg", 0.0f}};
  if (c.momentum != 0.0) out.push_back({"momentum", 0.0f});
  if (c.centered) out.push_back({"grad_avg", 0.0f});
  return out;
}
}  // namespace

RmsProp::RmsProp(const OptimizerConfig& config, std::span<const ParamRange> groups, int64_t begin,
                 int64_t end, StateStorage storage)
    : Optimizer(config, groups, begin, end, rmsprop_state(config), storage) {
  MOETRAIN_CHECK(config.kind == OptimizerKind::RmsProp, "RmsProp built from a '{}' config",
                 optimizer_kind_name(config.kind));
}

void RmsProp::update(float* params, const float* grads, float* const* state, float lr) {
  const OptimizerConfig& c = config();
  RmsPropScalars s;
  s.lr = lr;
  s.wd = static_cast<float>(c.weight_decay);
  s.alpha = static_cast<float>(c.alpha);
  s.one_minus_alpha = static_cast<float>(1.0 - c.alpha);
  s.eps = static_cast<float>(c.eps);
  s.mu = static_cast<float>(c.momentum);
  // In rmsprop_state() order: square_avg, then momentum and grad_avg when present.
  int next = 0;
  float* sq = state[next++];
  float* buf = c.momentum != 0.0 ? state[next++] : nullptr;
  float* ga = c.centered ? state[next++] : nullptr;
  for_each_segment([&](int64_t lo, int64_t hi, bool decay) {
    with_flag(decay && c.weight_decay != 0.0, [&](auto kDecay) {
      with_flag(c.centered, [&](auto kCentered) {
        with_flag(c.momentum != 0.0, [&](auto kMomentum) {
          rmsprop_segment<kDecay(), kCentered(), kMomentum()>(params, grads, sq, buf, ga, lo, hi,
                                                              s);
        });
      });
    });
  });
}

}  // namespace moetrain
