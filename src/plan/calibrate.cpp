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
#include "kernels/rope.h"
#include "model/params.h"
#include "moe/experts.h"
#include "optim/clip.h"
#include "optim/optimizer.h"
#include "plan/kernel_table.h"

namespace moetrain::plan {

namespace {

// Median seconds of one call of f over `reps` timed batches, each long enough (≥ 10 ms) to
// swamp the timer; the median keeps a neighbour's burst on a shared machine out.
// In the one-thread-per-core calibration every thread runs the same measurements; a barrier
// before each keeps them side by side, so that each core is timed while the others run the same
// kernel (as a run's processes do), not while they idle or run another.
template <class F>
double seconds_per_call(F&& f, int reps = 3) {
#pragma omp barrier
  f();  // warm-up: builds the oneDNN primitive, faults the pages in
#pragma omp barrier
  Timer probe;
  f();
  const double once = std::max(probe.seconds(), 1e-7);
  if (once > 0.05) {  // a long call times itself: the median of three
    std::vector<double> t = {once};
    for (int r = 0; r < 2; ++r) {
      Timer timer;
      f();
      t.push_back(timer.seconds());
    }
    std::sort(t.begin(), t.end());
    return t[1];
  }
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

// Fills a buffer with N(0, 1) values (every kernel reads finite, representative data).
std::vector<float> normal(int64_t n, uint64_t seed) {
  std::vector<float> v(static_cast<std::size_t>(std::max<int64_t>(n, 1)));
  rng_fill_normal(v.data(), n, Rng(seed, 7), 0, 1);
  return v;
}

// A Linear layer as the model runs it (model/transformer.cpp): out (N, OC) = inp · Wᵀ, then
// dinp = dout · W and dW += doutᵀ · inp; in mixed precision from rounded operands, dout rounded
// in backward.
double time_linear(int64_t N, int64_t IC, int64_t OC, DType t) {
  std::vector<float> inp = normal(N * IC, 11), w = normal(OC * IC, 12), dout = normal(N * OC, 13);
  std::vector<float> out(N * OC), dinp(N * IC), dw(OC * IC);
  if (t == DType::F32)
    return seconds_per_call([&] {
      linear_forward(out.data(), inp.data(), w.data(), N, IC, OC);
      gemm(Trans::N, Trans::N, N, IC, OC, dout.data(), w.data(), dinp.data(), false);
      gemm(Trans::T, Trans::N, OC, IC, N, dout.data(), inp.data(), dw.data(), true);
    });
  const std::size_t es = dtype_size(t);
  std::vector<char> inp_lp(N * IC * es), w_lp(OC * IC * es), dout_lp(N * OC * es);
  f32_to_dtype(t, inp_lp.data(), inp.data(), inp.size());
  f32_to_dtype(t, w_lp.data(), w.data(), w.size());
  return seconds_per_call([&] {
    f32_to_dtype(t, inp_lp.data(), inp.data(), inp.size());
    gemm(t, Trans::N, Trans::T, N, OC, IC, inp_lp.data(), w_lp.data(), out.data(), false);
    f32_to_dtype(t, dout_lp.data(), dout.data(), dout.size());
    gemm(t, Trans::N, Trans::N, N, IC, OC, dout_lp.data(), w_lp.data(), dinp.data(), false);
    gemm(t, Trans::T, Trans::N, OC, IC, N, dout_lp.data(), inp_lp.data(), dw.data(), true);
  });
}

// G experts of (C, F), `rows` rows each per call, forward + backward (moe/experts.h, the grouped
// row-block kernels the MoE layer calls); seconds per expert.
double time_experts(int64_t C, int64_t F, int64_t G, int64_t rows, DType t) {
  const int64_t R = G * rows, block = F * C;
  std::vector<float> w1 = normal(G * block, 21), w3 = normal(G * block, 22),
                     w2 = normal(G * block, 23);
  for (auto* w : {&w1, &w3, &w2})
    for (float& x : *w) x *= 0.05f;
  std::vector<float> g1(G * block), g3(G * block), g2(G * block);
  std::vector<float> xp = normal(R * C, 24), dy = normal(R * C, 25), y(R * C), dxp(R * C);
  std::vector<int64_t> counts(static_cast<std::size_t>(G), rows);
  ExpertRange w, g;
  w.first = g.first = 0;
  w.count = g.count = G;
  w.w1 = w1.data(), w.w3 = w3.data(), w.w2 = w2.data();
  g.w1 = g1.data(), g.w3 = g3.data(), g.w2 = g2.data();
  std::vector<char> lp1, lp3, lp2;
  if (t != DType::F32) {
    const std::size_t bytes = static_cast<std::size_t>(G * block) * dtype_size(t);
    lp1.resize(bytes), lp3.resize(bytes), lp2.resize(bytes);
    f32_to_dtype(t, lp1.data(), w1.data(), w1.size());
    f32_to_dtype(t, lp3.data(), w3.data(), w3.size());
    f32_to_dtype(t, lp2.data(), w2.data(), w2.size());
    w.lp = t, w.w1_lp = lp1.data(), w.w3_lp = lp3.data(), w.w2_lp = lp2.data();
  }
  ExpertActs acts;
  return seconds_per_call([&] {
           experts_forward(y.data(), xp.data(), counts.data(), w, C, F, acts);
           experts_backward(dxp.data(), g, dy.data(), xp.data(), counts.data(), w, C, F, acts);
         }) /
         static_cast<double>(G);
}

double time_attention(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  const int64_t nq = B * T * NH * HS, nk = B * T * NKV * HS;
  std::vector<float> q = normal(nq, 31), k = normal(nk, 32), v = normal(nk, 33), g = normal(nq, 34);
  std::vector<float> o(nq), lse(B * NH * T), dq(nq), dk(nk), dv(nk);
  return seconds_per_call([&] {
    attention_forward(o.data(), lse.data(), q.data(), k.data(), v.data(), B, T, NH, NKV, HS);
    attention_backward(dq.data(), dk.data(), dv.data(), g.data(), q.data(), k.data(), v.data(),
                       o.data(), lse.data(), B, T, NH, NKV, HS);
  });
}

double time_norm(int64_t N, int64_t C) {
  std::vector<float> x = normal(N * C, 41), dy = normal(N * C, 42), y(N * C), dx(N * C),
                     w(C, 1.0f), dw(C), rstd(N);
  return seconds_per_call([&] {
    rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
    rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
  });
}

double time_rope(int64_t N, int64_t H, int64_t HS, int64_t T) {
  std::vector<float> x = normal(N * H * HS, 51);
  std::vector<int32_t> pos(static_cast<std::size_t>(N));
  for (int64_t i = 0; i < N; ++i) pos[i] = static_cast<int32_t>(i % T);
  return seconds_per_call([&] {
    rope_forward(x.data(), x.data(), pos.data(), N, H, HS, 10000.0f);
    rope_backward(x.data(), x.data(), pos.data(), N, H, HS, 10000.0f);
  });
}

// The update as the trainer runs it over n parameters: zero the gradients (the next step's
// backward accumulates), the clip's norm, the optimizer's step. Seconds per parameter.
double time_update(const RunConfig& cfg, int64_t n) {
  std::vector<float> p = normal(n, 61), g = normal(n, 62);
  const ParamRange all{0, n, true};
  auto opt = make_optimizer(cfg.optim.optimizer_config(), std::span<const ParamRange>(&all, 1), 0, n);
  return seconds_per_call([&] {
           clip_grad_norm(g.data(), n, 1.0);
           opt->step(p.data(), g.data(), 1e-6f);
           std::fill(g.begin(), g.end(), 0.0f);
         }) /
         static_cast<double>(n);
}

// The kernels of one micro-batch of `cfg` at its shapes, for each thread count the process
// could run: Linear layers (attention projections, dense and shared FFNs, LM head), the attention
// core, the experts at the uniform rows per expert, a quarter and twice that (a skewed load,
// and the per-source calls of expert parallelism), the RMSNorm and RoPE.
KernelTable measure_config(const RunConfig& cfg) {
  const ModelConfig& m = cfg.model;
  const DType t = cfg.train.precision_dtype();
  const double dt = dtype_code(t);
  const int64_t B = cfg.train.batch_size, T = cfg.train.seq_len, N = B * T, C = m.dim;
  const int64_t HS = m.head_dim(), QD = m.n_heads * HS, KD = m.n_kv_heads * HS;
  KernelTable k;
  std::vector<std::array<int64_t, 2>> linears = {{C, QD}, {C, KD}, {QD, C}, {C, m.vocab_size}};
  if (m.n_layers > m.n_moe_layers())
    linears.insert(linears.end(), {{C, m.dense_ffn_hidden()}, {m.dense_ffn_hidden(), C}});
  if (m.shared_expert_hidden > 0)
    linears.insert(linears.end(), {{C, m.shared_expert_hidden}, {m.shared_expert_hidden, C}});
  for (const auto& [IC, OC] : linears) {
    const std::vector<double> shape = {double(N), double(IC), double(OC), dt};
    if (!k.find("linear", shape)) k.add("linear", shape, time_linear(N, IC, OC, t));
  }
  k.add("attention", {double(B), double(T), double(m.n_heads), double(m.n_kv_heads), double(HS)},
        time_attention(B, T, m.n_heads, m.n_kv_heads, HS));
  if (m.n_moe_layers() > 0) {
    const int64_t r0 = std::max<int64_t>(1, (N * m.top_k + m.n_experts - 1) / m.n_experts);
    for (int64_t rows : {std::max<int64_t>(1, r0 / 4), r0, 2 * r0})
      k.add("experts", {double(C), double(m.expert_hidden), double(rows), dt},
            time_experts(C, m.expert_hidden, m.n_experts, rows, t));
  }
  k.add("norm", {double(N), double(C)}, time_norm(N, C));
  // The update over the model's parameters (at most 8 M, 4 arrays of 32 MB: past the caches the
  // rate holds).
  {
    const int64_t n = std::min<int64_t>(ParamLayout(m).size(), int64_t{8} << 20);
    k.add("optimizer", {double(n), optimizer_code(cfg.optim.name)}, time_update(cfg, n) * n);
  }
  k.add("rope", {double(N), double(m.n_heads), double(HS)}, time_rope(N, m.n_heads, HS, T));
  if (m.n_kv_heads != m.n_heads)
    k.add("rope", {double(N), double(m.n_kv_heads), double(HS)},
          time_rope(N, m.n_kv_heads, HS, T));
  return k;
}

}  // namespace

namespace {

DeviceModel measure_device(Calibration& cal, bool bf16, const RunConfig* cfg) {
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
  if (cfg != nullptr) d.kernels = measure_config(*cfg);
  d.memory_bytes = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) *
                   static_cast<double>(::sysconf(_SC_PAGE_SIZE));
  return dev;
}

}  // namespace

Calibration calibrate(bool bf16, const RunConfig* cfg) {
  Calibration cal;
  const int threads = num_threads();
  cal.device = measure_device(cal, bf16, cfg);
  const double intra = cal.intra_node_bandwidth, copy = cal.copy_bandwidth;
  // One thread per process, every core busy at once (as when the processes of a run share the
  // machine): each thread measures on its own buffers, the kernels inside run single-threaded
  // (nested regions are serial); the first thread's figures are kept.
#pragma omp parallel num_threads(threads)
  {
    Calibration mine;
    DeviceModel single = measure_device(mine, bf16, cfg);
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
