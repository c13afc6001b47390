#include "kernels/activation.h"

#include "core/profile.h"

#include <cmath>

namespace moetrain {

namespace {
constexpr int64_t kParallelMin = 1 << 14;
inline float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}
// d/dx [x·σ(x)] = σ(x)·(1 + x·(1 − σ(x)))
inline float silu_grad(float x) {
  float s = sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}
}  // namespace

void silu_forward(float* out, const float* inp, int64_t n) {
  PhaseScope phase_scope(Phase::Activation);
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = inp[i] * sigmoid(inp[i]);
}

void silu_backward(float* dinp, const float* dout, const float* inp, int64_t n) {
  PhaseScope phase_scope(Phase::Activation);
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) dinp[i] = dout[i] * silu_grad(inp[i]);
}

void swiglu_forward(float* out, const float* a, const float* b, int64_t n) {
  PhaseScope phase_scope(Phase::Activation);
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] * sigmoid(a[i]) * b[i];
}

void swiglu_backward(float* da, float* db, const float* dout, const float* a, const float* b,
                     int64_t n) {
  PhaseScope phase_scope(Phase::Activation);
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    float s = sigmoid(a[i]);
    float silu = a[i] * s;
    da[i] = dout[i] * b[i] * s * (1.0f + a[i] * (1.0f - s));
    db[i] = dout[i] * silu;
  }
}

}  // namespace moetrain
