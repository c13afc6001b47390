#include "kernels/softmax.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/check.h"
#include "core/cpu.h"
#include "core/profile.h"
#include "kernels/vec_math.h"

namespace moetrain {

namespace {
constexpr int64_t kParallelMin = 1 << 14;

// The AVX2 clone is picked at load time where the CPU has it; both do the same float operations
// (no FMA contraction: cmake/warnings.cmake), so they agree bitwise (as kernels/attention.cpp).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOETRAIN_SOFTMAX_HOT __attribute__((target_clones("avx2", "default")))
#define MOETRAIN_SOFTMAX_WIDE 1
#else
#define MOETRAIN_SOFTMAX_HOT
#endif

// A row's maximum (kernels/vec_math.h), compiled for AVX2 where the CPU has it.
MOETRAIN_SOFTMAX_HOT float max_of_row(const float* x, int64_t V) {
  return row_max(x, V);
}

// e[0, n) = exp(x[0, n) − m) · g through exp_v (within an ulp of exp), VF's lanes at a time, then
// eight; the last partial vector on a padded copy. e may be x. Returns Σ e in double when sum is
// set: four double lanes (add_quarters), then the lanes in order, the same bits at either width.
template <class VF>
[[gnu::always_inline]] inline double exp_row_impl(float* e, const float* x, int64_t n, float m,
                                                  float g, bool sum) {
  constexpr int64_t kW = sizeof(VF) / sizeof(float);
  VD4 acc = VD4{};
  const auto step = [&](auto& y) {
    y -= m;
    exp_v(y, y);
    y *= g;
    if (sum) add_quarters(acc, y);
  };
  int64_t v = 0;
  for (; v + kW <= n; v += kW) {
    VF y;
    load_v(y, x + v);
    step(y);
    store_v(e + v, y);
  }
  VF8 y;
  for (; v + 8 <= n; v += 8) {
    load_vf8(y, x + v);
    step(y);
    store_vf8(e + v, y);
  }
  if (v < n) {
    const std::size_t tail = static_cast<std::size_t>(n - v) * sizeof(float);
    // Padding lanes hold -inf: their exp is 0 and adds nothing to the sum.
    float buf[8];
    std::fill(buf, buf + 8, -std::numeric_limits<float>::infinity());
    std::memcpy(buf, x + v, tail);
    load_vf8(y, buf);
    step(y);
    store_vf8(buf, y);
    std::memcpy(e + v, buf, tail);
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

MOETRAIN_SOFTMAX_HOT double exp_row_narrow(float* e, const float* x, int64_t n, float m, float g,
                                           bool sum) {
  return exp_row_impl<VF8>(e, x, n, m, g, sum);
}
#ifdef MOETRAIN_SOFTMAX_WIDE
// 16 lanes where the CPU has AVX-512: each lane through the same operations, so the same bits.
__attribute__((target("avx512f"))) double exp_row_wide(float* e, const float* x, int64_t n,
                                                       float m, float g, bool sum) {
  return exp_row_impl<VF16>(e, x, n, m, g, sum);
}
#endif

double exp_row(float* e, const float* x, int64_t n, float m, float g, bool sum) {
  return softmax_exp_row(true, e, x, n, m, g, sum);
}

// log Σ_v exp(x_v). Terms are float (each within an ulp) but summed in double, so a row of 10^5
// terms does not lose the small ones. scratch (V) takes the terms.
double row_logsumexp(const float* x, int64_t V, float* scratch) {
  const float m = max_of_row(x, V);
  return double(m) + std::log(exp_row(scratch, x, V, m, 1.0f, true));
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
    const float m = max_of_row(x, V);
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
#pragma omp parallel if (N * V > kParallelMin)
  {
    std::vector<float> scratch(static_cast<std::size_t>(V));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* x = logits + n * V;
      const double l = row_logsumexp(x, V, scratch.data());
      lse[n] = static_cast<float>(l);
      // The loss comes from the double lse: with logits near 1e4 a float lse would cost 1e-3 of
      // it.
      losses[n] = targets[n] < 0 ? 0.0f : static_cast<float>(l - double(x[targets[n]]));
    }
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
    exp_row(dx, x, V, l, g, false);
    dx[t] -= g;
  }
}

void xent_shard_max(float* out, const float* logits, int64_t N, int64_t V) {
  PhaseScope phase_scope(Phase::Loss);
  MOETRAIN_CHECK(N >= 0 && V > 0, "xent_shard_max: need N >= 0 and V > 0, got N={} V={}", N, V);
#pragma omp parallel for schedule(static) if (N * V > kParallelMin)
  for (int64_t n = 0; n < N; ++n) out[n] = max_of_row(logits + n * V, V);
}

void xent_shard_sums(double* sums, const float* logits, const float* rmax, const int32_t* targets,
                     int64_t v0, int64_t N, int64_t V, int64_t V_total) {
  PhaseScope phase_scope(Phase::Loss);
  MOETRAIN_CHECK(N >= 0 && V > 0 && v0 >= 0 && v0 + V <= V_total,
                 "xent_shard_sums: columns [{}, {}) of a vocabulary of {} (N={})", v0, v0 + V,
                 V_total, N);
  check_targets("xent_shard_sums", targets, N, V_total);
#pragma omp parallel if (N * V > kParallelMin)
  {
    std::vector<float> scratch(static_cast<std::size_t>(V));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* x = logits + n * V;
      sums[2 * n] = exp_row(scratch.data(), x, V, rmax[n], 1.0f, true);
      const int64_t t = targets[n] - v0;
      sums[2 * n + 1] = targets[n] >= 0 && t >= 0 && t < V ? double(x[t]) : 0.0;
    }
  }
}

void xent_shard_finish(float* losses, float* lse, const float* rmax, const double* sums,
                       const int32_t* targets, int64_t N) {
  for (int64_t n = 0; n < N; ++n) {
    const double l = double(rmax[n]) + std::log(sums[2 * n]);
    lse[n] = static_cast<float>(l);
    losses[n] = targets[n] < 0 ? 0.0f : static_cast<float>(l - sums[2 * n + 1]);
  }
}

void softmax_xent_shard_backward(float* dlogits, const float* dlosses, const float* logits,
                                 const float* lse, const int32_t* targets, int64_t v0, int64_t N,
                                 int64_t V, int64_t V_total) {
  PhaseScope phase_scope(Phase::Loss);
  MOETRAIN_CHECK(N >= 0 && V > 0 && v0 >= 0 && v0 + V <= V_total,
                 "softmax_xent_shard_backward: columns [{}, {}) of a vocabulary of {} (N={})", v0,
                 v0 + V, V_total, N);
  check_targets("softmax_xent_shard_backward", targets, N, V_total);
#pragma omp parallel for schedule(static) if (N * V > kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    float* dx = dlogits + n * V;
    if (targets[n] < 0) {
      for (int64_t v = 0; v < V; ++v) dx[v] = 0.0f;
      continue;
    }
    const float g = dlosses[n];
    exp_row(dx, logits + n * V, V, lse[n], g, false);
    const int64_t t = targets[n] - v0;
    if (t >= 0 && t < V) dx[t] -= g;
  }
}

double softmax_exp_row([[maybe_unused]] bool wide, float* e, const float* x, int64_t n, float m,
                       float g, bool sum) {
#ifdef MOETRAIN_SOFTMAX_WIDE
  if (wide && cpu_has_avx512f()) return exp_row_wide(e, x, n, m, g, sum);
#endif
  return exp_row_narrow(e, x, n, m, g, sum);
}

}  // namespace moetrain
