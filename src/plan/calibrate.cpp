#include "plan/calibrate.h"

#include <unistd.h>

#include <omp.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
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

// Median seconds of one call of f over `reps` timed batches, each long enough (≥ 10 ms) to
// swamp the timer; the median keeps a neighbour's burst on a shared machine out.
template <class F>
double seconds_per_call(F&& f, int reps = 3) {
  f();  // warm-up: builds the oneDNN primitive, faults the pages in
  Timer probe;
  f();
  const double once = std::max(probe.seconds(), 1e-7);
  const int inner = std::max(1, static_cast<int>(0.01 / once));
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    Timer timer;
    for (int i = 0; i < inner; ++i) f();
    t.push_back(timer.seconds() / inner);
  }
  std::nth_element(t.begin(), t.begin() + reps / 2, t.end());
  return t[reps / 2];
}

struct GemmTable {
  std::vector<double> dims, rates;  // smallest side ascending, FLOP/s
};

// GEMMs at the shapes a Linear layer's forward and backward take in the MoE models (tokens ×
// out × in, from thin expert slices to square ones). Not below 32 rows: there the weights stay in
// cache and the curve's form (compute bound, thinning to memory bound) no longer holds.
GemmTable measure_gemm(DType t) {
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
  std::map<int64_t, std::vector<double>> by_dim;
  for (const auto& [M, N, K] : shapes) {
    const double sec = seconds_per_call([&] {
      if (t == DType::F32)
        gemm(Trans::N, Trans::T, M, N, K, a.data(), b.data(), c.data(), false);
      else
        gemm(Trans::N, Trans::T, M, N, K, a16.data(), b16.data(), c.data(), false);
    });
    by_dim[std::min({M, N, K})].push_back(2.0 * M * N * K / sec);
  }
  // Shapes sharing a smallest side: their median rate.
  GemmTable table;
  for (auto& [d, rates] : by_dim) {
    std::sort(rates.begin(), rates.end());
    table.dims.push_back(static_cast<double>(d));
    table.rates.push_back(rates[rates.size() / 2]);
  }
  return table;
}

}  // namespace

namespace {

DeviceModel measure_device(Calibration& cal, bool bf16) {
  DeviceModel dev;
  DeviceModel& d = dev;
  d.name = "cpu";
  d.threads = omp_in_parallel() ? 1 : num_threads();
  // MFU is quoted against the best measured GEMM rate of the precision.
  const GemmTable f32 = measure_gemm(DType::F32);
  d.gemm_f32_dims = f32.dims;
  d.gemm_f32_flops = f32.rates;
  d.peak_flops_f32 = *std::max_element(f32.rates.begin(), f32.rates.end());
  if (bf16 && gemm_is_native(DType::BF16)) {
    const GemmTable b16 = measure_gemm(DType::BF16);
    d.gemm_bf16_dims = b16.dims;
    d.gemm_bf16_flops = b16.rates;
    d.peak_flops_bf16 = *std::max_element(b16.rates.begin(), b16.rates.end());
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
  return dev;
}

}  // namespace

Calibration calibrate(bool bf16) {
  Calibration cal;
  const int threads = num_threads();
  cal.device = measure_device(cal, bf16);
  const double intra = cal.intra_node_bandwidth, copy = cal.copy_bandwidth;
  // One thread per process, every core busy at once (as when the processes of a run share the
  // machine): each thread measures on its own buffers, the kernels inside run single-threaded
  // (nested regions are serial); the first thread's figures are kept.
#pragma omp parallel num_threads(threads)
  {
    Calibration mine;
    DeviceModel single = measure_device(mine, bf16);
#pragma omp master
    cal.single_thread = single;
  }
  cal.single_thread.threads = 1;
  // The link figures of the whole machine (every process copies at once).
  cal.intra_node_bandwidth = intra;
  cal.copy_bandwidth = copy;
  return cal;
}

}  // namespace moetrain::plan
