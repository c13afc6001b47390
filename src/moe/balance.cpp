#include "moe/balance.h"

#include <cmath>
#include <vector>

#include "core/check.h"

namespace moetrain {

namespace {
// The loss sums are a few hundred thousand adds: one thread in token order is fast, fixed in
// order, and never waits for a second thread on a busy machine.
constexpr int64_t kParallelExp = 1 << 20;
}  // namespace

double aux_loss_forward(float* f, const float* probs, const int32_t* selected, int64_t N, int64_t E,
                        int64_t S, int64_t K) {
  for (int64_t e = 0; e < E; ++e) f[e] = 0.0f;
  if (N == 0) return 0.0;
  std::vector<int64_t> count(E, 0);
  for (int64_t i = 0; i < N * S; ++i) {
    if (selected[i] >= 0) ++count[selected[i]];
  }
  std::vector<double> P(E, 0.0);
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t e = 0; e < E; ++e) P[e] += probs[t * E + e];
  }
  double loss = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    double fe = static_cast<double>(count[e]) / static_cast<double>(N * K);
    f[e] = static_cast<float>(fe);
    loss += fe * P[e] / static_cast<double>(N);
  }
  return static_cast<double>(E) * loss;
}

void aux_loss_backward(float* dprobs, const float* f, int64_t N, int64_t E, float scale) {
  std::vector<float> g(E);
  for (int64_t e = 0; e < E; ++e)
    g[e] = scale * static_cast<float>(E) * f[e] / static_cast<float>(N);
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t e = 0; e < E; ++e) dprobs[t * E + e] = g[e];
  }
}

double z_loss_forward(const float* lse, int64_t N) {
  double sum = 0.0;
  for (int64_t t = 0; t < N; ++t) sum += static_cast<double>(lse[t]) * lse[t];
  return N > 0 ? sum / static_cast<double>(N) : 0.0;
}

void z_loss_backward(float* dlogits, const float* logits, const float* lse, int64_t N, int64_t E,
                     float scale) {
  const float c = 2.0f * scale / static_cast<float>(N);
#pragma omp parallel for schedule(static) if (N * E > kParallelExp)
  for (int64_t t = 0; t < N; ++t) {
    const float* l = logits + t * E;
    float* d = dlogits + t * E;
    const float s = c * lse[t];
    for (int64_t e = 0; e < E; ++e) d[e] = s * std::exp(l[e] - lse[t]);
  }
}

void bias_update(float* bias, const int64_t* load, int64_t E, float rate) {
  MOETRAIN_CHECK(E == 0 || (bias && load), "bias_update: null bias or load for E={}", E);
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    MOETRAIN_CHECK(load[e] >= 0, "bias_update: load of expert {} is {}, must be >= 0", e, load[e]);
    total += load[e];
  }
  // mean − load_i has the sign of total − E·load_i, which stays exact in integers.
  for (int64_t e = 0; e < E; ++e) {
    int64_t diff = total - E * load[e];
    bias[e] += diff > 0 ? rate : (diff < 0 ? -rate : 0.0f);
  }
}

}  // namespace moetrain
