#include "moe/balance.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.h"
#include "core/comm.h"

namespace moetrain {

namespace {
// The loss sums are a few hundred thousand adds: one thread in token order is fast, fixed in
// order, and never waits for a second thread on a busy machine.
constexpr int64_t kParallelExp = 1 << 20;
constexpr int64_t kTokenBlock = 256;  // fixed blocks for token sums: thread-count independent
}  // namespace

namespace {
// psum (E) += Σ_t probs[t, :] in fixed blocks of kTokenBlock tokens.
void sum_probs(double* psum, const float* probs, int64_t N, int64_t E) {
  std::vector<double> partial(E);
  for (int64_t b = 0; b < N; b += kTokenBlock) {
    std::fill(partial.begin(), partial.end(), 0.0);
    for (int64_t t = b; t < std::min(N, b + kTokenBlock); ++t)
      for (int64_t e = 0; e < E; ++e) partial[e] += probs[t * E + e];
    for (int64_t e = 0; e < E; ++e) psum[e] += partial[e];
  }
}
}  // namespace

double aux_loss_forward(float* f, const float* probs, const int32_t* selected, int64_t N, int64_t E,
                        int64_t S, int64_t K, Comm* stats) {
  for (int64_t e = 0; e < E; ++e) f[e] = 0.0f;
  // sums: (E) selections before dropping, N, (E) Σ_t p[t, e]; the counts stay exact in double.
  std::vector<double> sums(2 * E + 1, 0.0);
  for (int64_t i = 0; i < N * S; ++i)
    if (selected[i] >= 0) sums[selected[i]] += 1.0;
  sums[E] = static_cast<double>(N);
  double* psum = sums.data() + E + 1;
  sum_probs(psum, probs, N, E);
  if (stats) stats->allreduce(sums.data(), 2 * E + 1);
  const double Ng = sums[E];
  if (Ng == 0) return 0.0;
  double loss = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    const double fe = sums[e] / (Ng * static_cast<double>(K));
    f[e] = static_cast<float>(fe);
    loss += fe * (psum[e] / Ng);
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

double variance_loss_forward(float* dLdP, const float* probs, int64_t N, int64_t E, Comm* stats) {
  for (int64_t e = 0; e < E; ++e) dLdP[e] = 0.0f;
  std::vector<double> sums(E + 1, 0.0);  // (E) Σ_t p[t, e], N
  sum_probs(sums.data(), probs, N, E);
  sums[E] = static_cast<double>(N);
  if (stats) stats->allreduce(sums.data(), E + 1);
  const double Ng = sums[E];
  if (Ng == 0) return 0.0;
  const double Ed = static_cast<double>(E);
  double mean = 0.0;
  for (int64_t e = 0; e < E; ++e) mean += sums[e] / Ng;
  mean /= Ed;
  double var = 0.0;  // Var_i(P_i)
  for (int64_t e = 0; e < E; ++e) {
    const double d = sums[e] / Ng - mean;
    var += d * d;
    dLdP[e] = static_cast<float>(4.0 * Ed * d);
  }
  var /= Ed;
  // Var(E·P) for the importance term plus Var(E·P) for the load term.
  return 2.0 * Ed * Ed * var;
}

void variance_loss_backward(float* dprobs, const float* dLdP, int64_t N, int64_t E, float scale) {
  std::vector<float> g(E);
  for (int64_t e = 0; e < E; ++e) g[e] = scale * dLdP[e] / static_cast<float>(N);
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t e = 0; e < E; ++e) dprobs[t * E + e] = g[e];
  }
}

double z_loss_forward(const float* lse, int64_t N, Comm* stats) {
  double sums[2] = {0.0, static_cast<double>(N)};  // Σ lse², N
  for (int64_t b = 0; b < N; b += kTokenBlock) {
    double partial = 0.0;
    for (int64_t t = b; t < std::min(N, b + kTokenBlock); ++t)
      partial += static_cast<double>(lse[t]) * lse[t];
    sums[0] += partial;
  }
  if (stats) stats->allreduce(sums, 2);
  return sums[1] > 0 ? sums[0] / sums[1] : 0.0;
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
