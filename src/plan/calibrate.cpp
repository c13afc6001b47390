#include "plan/calibrate.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "core/threads.h"
#include "core/timer.h"
#include "kernels/attention.h"
#include "kernels/gemm.h"
#include "kernels/norm.h"

namespace moetrain::plan {

namespace {

// Median seconds of one call of f over `reps` timed batches, each long enough (≥ 20 ms) to
// swamp the timer; the median keeps a neighbour's burst on a shared machine out.
template <class F>
double seconds_per_call(F&& f, int reps = 5) {
  f();  // warm-up: builds the oneDNN primitive, faults the pages in
  Timer probe;
  f();
  const double once = std::max(probe.seconds(), 1e-7);
  const int inner = std::max(1, static_cast<int>(0.02 / once));
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    Timer timer;
    for (int i = 0; i < inner; ++i) f();
    t.push_back(timer.seconds() / inner);
  }
  std::nth_element(t.begin(), t.begin() + reps / 2, t.end());
  return t[reps / 2];
}

struct GemmFit {
  double peak = 0, small_dim = 0, call_s = 0, worst = 0;
};

// Least squares of t = a·flops + b·flops/d + c over the measured shapes (the form of the cost
// model's GEMM time), weighted by 1/t so that small shapes count as much as large ones:
// peak = 1/a, small_dim = b/a, call = c. Coefficients are kept ≥ 0.
GemmFit fit_gemm(const std::vector<std::array<double, 4>>& obs) {  // flops, d, t, unused
  double m[3][4] = {};
  for (const auto& o : obs) {
    const double x[3] = {o[0] / o[2], o[0] / o[1] / o[2], 1 / o[2]};  // divided by t: weight
    for (int i = 0; i < 3; ++i) {
      for (int j = 0; j < 3; ++j) m[i][j] += x[i] * x[j];
      m[i][3] += x[i];  // target t / t = 1
    }
  }
  for (int i = 0; i < 3; ++i) {  // Gauss-Jordan, 3 × 3
    int piv = i;
    for (int r = i + 1; r < 3; ++r)
      if (std::fabs(m[r][i]) > std::fabs(m[piv][i])) piv = r;
    std::swap(m[i], m[piv]);
    for (int r = 0; r < 3; ++r) {
      if (r == i || m[i][i] == 0) continue;
      const double f = m[r][i] / m[i][i];
      for (int c = 0; c < 4; ++c) m[r][c] -= f * m[i][c];
    }
  }
  double a = m[0][3] / m[0][0], b = m[1][3] / m[1][1], c = m[2][3] / m[2][2];
  MOETRAIN_CHECK(a > 0 && std::isfinite(a), "calibration: the GEMM fit gave no positive rate");
  b = std::max(0.0, b);
  c = std::max(0.0, c);
  GemmFit fit{1 / a, b / a, c, 0};
  for (const auto& o : obs)
    fit.worst = std::max(fit.worst, std::fabs(a * o[0] + b * o[0] / o[1] + c - o[2]) / o[2]);
  return fit;
}

// GEMMs at the shapes a Linear layer's forward and backward take in the MoE models (tokens ×
// out × in, from thin expert slices to square ones). Not below 32 rows: there the weights stay in
// cache and the curve's form (compute bound, thinning to memory bound) no longer holds.
GemmFit measure_gemm(DType t) {
  const std::vector<std::array<int64_t, 3>> shapes = {
      {4096, 512, 256}, {1024, 1024, 1024}, {2048, 256, 128}, {256, 2048, 512},
      {128, 512, 512},  {512, 128, 1024},   {32, 512, 512},   {64, 1024, 256}};
  int64_t most = 0;
  for (const auto& s : shapes) most = std::max({most, s[0] * s[2], s[1] * s[2], s[0] * s[1]});
  std::vector<float> a(most), b(most), c(most);
  rng_fill_normal(a.data(), most, Rng(1, 1), 0, 1);
  rng_fill_normal(b.data(), most, Rng(2, 1), 0, 1);
  std::vector<bf16> a16(most), b16(most);
  f32_to_bf16(a16.data(), a.data(), a.size());
  f32_to_bf16(b16.data(), b.data(), b.size());
  std::vector<std::array<double, 4>> obs;
  for (const auto& [M, N, K] : shapes) {
    const double sec = seconds_per_call([&] {
      if (t == DType::F32)
        gemm(Trans::N, Trans::T, M, N, K, a.data(), b.data(), c.data(), false);
      else
        gemm(Trans::N, Trans::T, M, N, K, a16.data(), b16.data(), c.data(), false);
    });
    obs.push_back({2.0 * M * N * K, static_cast<double>(std::min({M, N, K})), sec, 0});
  }
  return fit_gemm(obs);
}

}  // namespace

Calibration calibrate() {
  Calibration cal;
  DeviceModel& d = cal.device;
  d.name = "cpu";
  d.threads = num_threads();
  const GemmFit f32 = measure_gemm(DType::F32);
  d.peak_flops_f32 = f32.peak;
  d.gemm_small_dim = f32.small_dim;
  d.gemm_call_s = f32.call_s;
  cal.fit_error = f32.worst;
  if (gemm_is_native(DType::BF16)) {
    const GemmFit b16 = measure_gemm(DType::BF16);
    d.peak_flops_bf16 = b16.peak;
    cal.fit_error = std::max(cal.fit_error, b16.worst);
  }
  // Element-wise rate: RMSNorm forward + backward at a training shape, in the bytes the cost
  // model charges for it (forward reads and writes N·C, backward about twice that).
  {
    const int64_t N = 8192, C = 256;
    std::vector<float> x(N * C), y(N * C), dy(N * C), dx(N * C), w(C, 1.0f), dw(C), rstd(N);
    rng_fill_normal(x.data(), N * C, Rng(3, 1), 0, 1);
    rng_fill_normal(dy.data(), N * C, Rng(4, 1), 0, 1);
    const double sec = seconds_per_call([&] {
      rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
      rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
    });
    d.norm_bandwidth = 3 * 2 * 4.0 * N * C / sec;
  }
  // A parallel stream copy: the raw memory rate, and what a shared-memory MPI transport moves
  // (it copies each message twice, in and out of the shared segment: half the copy rate).
  {
    const int64_t n = 16 << 20;
    std::vector<float> src(n, 1.0f), dst(n);
    const double sec = seconds_per_call(
        [&] {
#pragma omp parallel for schedule(static)
          for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
        },
        3);
    cal.copy_bandwidth = 2 * 4.0 * n / sec;
    d.memory_bandwidth = cal.copy_bandwidth;
    cal.intra_node_bandwidth = cal.copy_bandwidth / 2;
    // Open MPI's shared-memory latency is a few µs on any x86 machine; not measured here (no MPI
    // in the calibration), stated.
    cal.intra_node_latency = 3e-6;
  }
  // Attention forward + backward at a shape unlike the demo's, rated at the cost model's FLOPs.
  {
    const int64_t B = 2, T = 256, NH = 4, NKV = 2, HS = 64;
    const int64_t nq = B * T * NH * HS, nk = B * T * NKV * HS;
    std::vector<float> q(nq), k(nk), v(nk), o(nq), lse(B * NH * T), dq(nq), dk(nk), dv(nk), g(nq);
    rng_fill_normal(q.data(), nq, Rng(5, 1), 0, 1);
    rng_fill_normal(k.data(), nk, Rng(6, 1), 0, 1);
    rng_fill_normal(v.data(), nk, Rng(7, 1), 0, 1);
    rng_fill_normal(g.data(), nq, Rng(8, 1), 0, 1);
    const double sec = seconds_per_call([&] {
      attention_forward(o.data(), lse.data(), q.data(), k.data(), v.data(), B, T, NH, NKV, HS);
      attention_backward(dq.data(), dk.data(), dv.data(), g.data(), q.data(), k.data(), v.data(),
                         o.data(), lse.data(), B, T, NH, NKV, HS);
    });
    d.attention_flops = 3.5 * 2 * B * NH * (T * (T + 1) / 2.0) * HS / sec;
  }
  d.memory_bytes = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) *
                   static_cast<double>(::sysconf(_SC_PAGE_SIZE));
  return cal;
}

}  // namespace moetrain::plan
