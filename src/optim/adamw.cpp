#include "optim/adamw.h"

#include <cmath>
#include <cstdint>

#include "core/check.h"
#include "optim/adamw_scalars.h"

namespace moetrain {

namespace {

// The loop is vectorised (CMake builds this file with -fno-math-errno: std::sqrt's errno branch
// kept it scalar, compute-bound at under half the memory bandwidth), and cloned for AVX-512 and
// AVX2, picked at load time. Every version does the same IEEE operations in the same order
// (division and square root are correctly rounded at any width; nothing is contracted, the
// project compiles with -ffp-contract=off), so they agree bitwise — with each other and with the
// GPU's kernel (cuda/adamw.cu).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOETRAIN_ADAMW_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MOETRAIN_ADAMW_CLONES
#endif

// p, g, m, v, lp (hi - lo, offset by lo); must run inside a parallel region (or serially).
// kCopy: each new parameter is also written rounded to bf16 into lp (the model's weight copy) in
// the same pass, as bits: the rounding is a select and a store of integers, so the loop stays
// vectorised.
template <bool kDecay, bool kCopy>
MOETRAIN_ADAMW_CLONES void adamw_segment(float* p, const float* g, float* m, float* v,
                                         uint16_t* lp, int64_t lo, int64_t hi,
                                         const AdamWScalars& s) {
#pragma omp for simd schedule(static) nowait
  for (int64_t i = lo; i < hi; ++i) {
    float param = p[i];
    if constexpr (kDecay) param *= s.decay;
    const float grad = g[i];
    const float mi = s.beta1 * m[i] + s.one_minus_beta1 * grad;
    const float vi = s.beta2 * v[i] + s.one_minus_beta2 * (grad * grad);
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) / s.bias2_sqrt + s.eps;
    const float updated = param - s.step_size * (mi / denom);
    p[i] = updated;
    if constexpr (kCopy) lp[i] = bf16::round_bits(updated);
  }
}

}  // namespace

AdamW::AdamW(const OptimizerConfig& config, std::span<const ParamRange> groups, int64_t begin,
             int64_t end, StateStorage storage)
    : Optimizer(config, groups, begin, end, {{"exp_avg", 0.0f}, {"exp_avg_sq", 0.0f}}, storage) {
  MOETRAIN_CHECK(config.kind == OptimizerKind::AdamW, "AdamW built from a '{}' config",
                 optimizer_kind_name(config.kind));
}

void AdamW::update(float* params, const float* grads, float* const* state, float lr) {
  const OptimizerConfig& c = config();
  const AdamWScalars s =
      adamw_scalars(c.beta1, c.beta2, c.eps, c.weight_decay, lr, step_count());
  float* m = state[0];
  float* v = state[1];
  const LowPrecisionCopy& lp = lp_copy();
  uint16_t* bits = lp.data && writes_lp_copy(lp.type) ? static_cast<uint16_t*>(lp.data) : nullptr;
  with_flag(bits != nullptr, [&](auto copy) {
    for_each_segment([&](int64_t lo, int64_t hi, bool decay) {
      if (decay && c.weight_decay != 0.0) {
        adamw_segment<true, copy()>(params, grads, m, v, bits, lo, hi, s);
      } else {
        adamw_segment<false, copy()>(params, grads, m, v, bits, lo, hi, s);
      }
    });
  });
}

}  // namespace moetrain
