#include "kernels/softmax.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/check.h"
#include "core/profile.h"

namespace moetrain {

namespace {
constexpr int64_t kParallelMin = 1 << 14;

float row_max(const float* x, int64_t V) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < V; ++v) m = std::max(m, x[v]);
  return m;
}

// log Σ_v exp(x_v). Terms are float (each within an ulp) but summed in double, so a row of 10^5
// terms does not lose the small ones.
double row_logsumexp(const float* x, int64_t V) {
  const float m = row_max(x, V);
  double sum = 0.0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(x[v] - m);
  return double(m) + std::log(sum);
}

void check_targets(const char* fn, const int32_t* targets, int64_t N, int64_t V) {
  for (int64_t n = 0; n < N; ++n) {
    MOETRAIN_CHECK(targets[n] >= -1 && targets[n] < V,
                   "{}: target of row {} is {}, expected -1 (ignore) or a class in [0, {})", fn, n,
                   targets[n], V);
  }
}
}  // namespace

void softmax_forward(float* out, const float* inp, int64_t N, int64_t V) {
  MOETRAIN_CHECK(N >= 0 && V > 0, "softmax_forward: need N >= 0 and V > 0, got N={} V={}", N, V);
#pragma omp parallel for schedule(static) if (N * V > kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * V;
    float* y = out + n * V;
    const float m = row_max(x, V);
    double sum = 0.0;
    for (int64_t v = 0; v < V; ++v) {
      const float e = std::exp(x[v] - m);
      y[v] = e;
      sum += e;
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t v = 0; v < V; ++v) y[v] *= inv;
  }
}

void softmax_backward(float* dinp, const float* dout, const float* out, int64_t N, int64_t V) {
  MOETRAIN_CHECK(N >= 0 && V > 0, "softmax_backward: need N >= 0 and V > 0, got N={} V={}", N, V);
#pragma omp parallel for schedule(static) if (N * V > kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* dy = dout + n * V;
    const float* y = out + n * V;
    float* dx = dinp + n * V;
    double dot = 0.0;
    for (int64_t v = 0; v < V; ++v) dot += double(dy[v]) * y[v];
    const float s = static_cast<float>(dot);
    for (int64_t v = 0; v < V; ++v) dx[v] = y[v] * (dy[v] - s);
  }
}

void softmax_xent_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                          int64_t N, int64_t V) {
  PhaseScope phase_scope(Phase::Loss);
  MOETRAIN_CHECK(N >= 0 && V > 0, "softmax_xent_forward: need N >= 0 and V > 0, got N={} V={}", N,
                 V);
  check_targets("softmax_xent_forward", targets, N, V);
#pragma omp parallel for schedule(static) if (N * V > kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = logits + n * V;
    const double l = row_logsumexp(x, V);
    lse[n] = static_cast<float>(l);
    // The loss comes from the double lse: with logits near 1e4 a float lse would cost 1e-3 of it.
    losses[n] = targets[n] < 0 ? 0.0f : static_cast<float>(l - double(x[targets[n]]));
  }
}

void softmax_xent_backward(float* dlogits, const float* dlosses, const float* logits,
                           const float* lse, const int32_t* targets, int64_t N, int64_t V) {
  PhaseScope phase_scope(Phase::Loss);
  MOETRAIN_CHECK(N >= 0 && V > 0, "softmax_xent_backward: need N >= 0 and V > 0, got N={} V={}", N,
                 V);
  check_targets("softmax_xent_backward", targets, N, V);
#pragma omp parallel for schedule(static) if (N * V > kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = logits + n * V;
    float* dx = dlogits + n * V;
    const int32_t t = targets[n];
    if (t < 0) {
      for (int64_t v = 0; v < V; ++v) dx[v] = 0.0f;
      continue;
    }
    const float g = dlosses[n];
    const float l = lse[n];
    // Element v is read before it is written, and nothing else of the row is read afterwards, so
    // dlogits may be logits.
    for (int64_t v = 0; v < V; ++v) dx[v] = g * std::exp(x[v] - l);
    dx[t] -= g;
  }
}

}  // namespace moetrain
