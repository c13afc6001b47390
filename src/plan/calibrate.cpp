#include "plan/calibrate.h"

#include <unistd.h>

#include <omp.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
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
#include "optim/param_groups.h"
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

// A kernel of the config as a training step calls it: its forward and its backward, sharing
// buffers they own (the backward reads what the forward saved).
struct Kernel {
  std::function<void()> forward, backward;
};

template <class State, class F, class B>
Kernel kernel(std::shared_ptr<State> s, F forward, B backward) {
  return {[s, forward] { forward(*s); }, [s, backward] { backward(*s); }};
}

// Median seconds of each kernel's forward plus its backward, timed in the order a step runs
// them: a round calls every forward in turn, then every backward in reverse, and times each call
// alone. A kernel timed back to back in a loop of its own keeps its data, its weights and its
// oneDNN primitive hot, and its backward finds the forward's saved activations in cache; a step's
// kernels, each between the others, do not. Rounds: as many as fit in about a second and a half
// (3 to 41), the count one thread sets for all; every call starts at a barrier (see
// seconds_per_call).
std::vector<double> seconds_in_turn(const std::vector<Kernel>& kernels) {
  const std::size_t n = kernels.size();
  std::vector<const std::function<void()>*> order;
  for (const Kernel& k : kernels) order.push_back(&k.forward);
  for (auto k = kernels.rbegin(); k != kernels.rend(); ++k) order.push_back(&k->backward);
  for (const auto* f : order) {  // warm-up round: primitives built, pages faulted in
#pragma omp barrier
    (*f)();
  }
#pragma omp barrier
  Timer probe;
  for (const auto* f : order) (*f)();
  const double round = std::max(probe.seconds(), 1e-7);
  int rounds = 0;
#pragma omp single copyprivate(rounds)
  rounds = std::clamp(static_cast<int>(1.5 / round), 3, 41);
  std::vector<std::vector<double>> t(order.size());
  for (int r = 0; r < rounds; ++r)
    for (std::size_t i = 0; i < order.size(); ++i) {
#pragma omp barrier
      Timer timer;
      (*order[i])();
      t[i].push_back(timer.seconds());
    }
  auto median = [&](std::size_t i) {
    std::nth_element(t[i].begin(), t[i].begin() + rounds / 2, t[i].end());
    return t[i][rounds / 2];
  };
  std::vector<double> seconds(n);
  for (std::size_t i = 0; i < n; ++i) seconds[i] = median(i) + median(2 * n - 1 - i);
  return seconds;
}

// A Linear layer as the model runs it (model/transformer.cpp): out (N, OC) = inp · Wᵀ, then
// dinp = dout · W and dW += doutᵀ · inp; in mixed precision from rounded operands, dout rounded
// in backward.
Kernel linear_kernel(int64_t N, int64_t IC, int64_t OC, DType t) {
  struct State {
    std::vector<float> inp, w, dout, out, dinp, dw;
    std::vector<char> inp_lp, w_lp, dout_lp;
  };
  auto s = std::make_shared<State>();
  s->inp = normal(N * IC, 11), s->w = normal(OC * IC, 12), s->dout = normal(N * OC, 13);
  s->out.resize(N * OC), s->dinp.resize(N * IC), s->dw.resize(OC * IC);
  if (t == DType::F32)
    return kernel(
        s, [=](State& x) { linear_forward(x.out.data(), x.inp.data(), x.w.data(), N, IC, OC); },
        [=](State& x) {
          gemm(Trans::N, Trans::N, N, IC, OC, x.dout.data(), x.w.data(), x.dinp.data(), false);
          gemm(Trans::T, Trans::N, OC, IC, N, x.dout.data(), x.inp.data(), x.dw.data(), true);
        });
  const std::size_t es = dtype_size(t);
  s->inp_lp.resize(N * IC * es), s->w_lp.resize(OC * IC * es), s->dout_lp.resize(N * OC * es);
  f32_to_dtype(t, s->w_lp.data(), s->w.data(), s->w.size());
  return kernel(
      s,
      [=](State& x) {
        f32_to_dtype(t, x.inp_lp.data(), x.inp.data(), x.inp.size());
        gemm(t, Trans::N, Trans::T, N, OC, IC, x.inp_lp.data(), x.w_lp.data(), x.out.data(),
             false);
      },
      [=](State& x) {
        f32_to_dtype(t, x.dout_lp.data(), x.dout.data(), x.dout.size());
        gemm(t, Trans::N, Trans::N, N, IC, OC, x.dout_lp.data(), x.w_lp.data(), x.dinp.data(),
             false);
        gemm(t, Trans::T, Trans::N, OC, IC, N, x.dout_lp.data(), x.inp_lp.data(), x.dw.data(),
             true);
      });
}

// G experts of (C, F), `rows` rows each per call, forward + backward (moe/experts.h, the grouped
// row-block kernels the MoE layer calls).
Kernel experts_kernel(int64_t C, int64_t F, int64_t G, int64_t rows, DType t) {
  struct State {
    std::vector<float> w1, w3, w2, g1, g3, g2, xp, dy, y, dxp;
    std::vector<int64_t> counts;
    std::vector<char> lp1, lp3, lp2;
    ExpertRange w, g;
    ExpertActs acts;
  };
  auto s = std::make_shared<State>();
  const int64_t R = G * rows, block = F * C;
  s->w1 = normal(G * block, 21), s->w3 = normal(G * block, 22), s->w2 = normal(G * block, 23);
  for (auto* w : {&s->w1, &s->w3, &s->w2})
    for (float& x : *w) x *= 0.05f;
  s->g1.resize(G * block), s->g3.resize(G * block), s->g2.resize(G * block);
  s->xp = normal(R * C, 24), s->dy = normal(R * C, 25), s->y.resize(R * C), s->dxp.resize(R * C);
  s->counts.assign(static_cast<std::size_t>(G), rows);
  ExpertRange &w = s->w, &g = s->g;
  w.first = g.first = 0;
  w.count = g.count = G;
  w.w1 = s->w1.data(), w.w3 = s->w3.data(), w.w2 = s->w2.data();
  g.w1 = s->g1.data(), g.w3 = s->g3.data(), g.w2 = s->g2.data();
  if (t != DType::F32) {
    const std::size_t bytes = static_cast<std::size_t>(G * block) * dtype_size(t);
    s->lp1.resize(bytes), s->lp3.resize(bytes), s->lp2.resize(bytes);
    f32_to_dtype(t, s->lp1.data(), s->w1.data(), s->w1.size());
    f32_to_dtype(t, s->lp3.data(), s->w3.data(), s->w3.size());
    f32_to_dtype(t, s->lp2.data(), s->w2.data(), s->w2.size());
    w.lp = t, w.w1_lp = s->lp1.data(), w.w3_lp = s->lp3.data(), w.w2_lp = s->lp2.data();
  }
  return kernel(
      s,
      [=](State& x) {
        experts_forward(x.y.data(), x.xp.data(), x.counts.data(), x.w, C, F, x.acts);
      },
      [=](State& x) {
        experts_backward(x.dxp.data(), x.g, x.dy.data(), x.xp.data(), x.counts.data(), x.w, C, F,
                         x.acts);
      });
}

Kernel attention_kernel(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  struct State {
    std::vector<float> q, k, v, g, o, lse, dq, dk, dv;
  };
  auto s = std::make_shared<State>();
  const int64_t nq = B * T * NH * HS, nk = B * T * NKV * HS;
  s->q = normal(nq, 31), s->k = normal(nk, 32), s->v = normal(nk, 33), s->g = normal(nq, 34);
  s->o.resize(nq), s->lse.resize(B * NH * T), s->dq.resize(nq), s->dk.resize(nk),
      s->dv.resize(nk);
  return kernel(
      s,
      [=](State& x) {
        attention_forward(x.o.data(), x.lse.data(), x.q.data(), x.k.data(), x.v.data(), B, T, NH,
                          NKV, HS);
      },
      [=](State& x) {
        attention_backward(x.dq.data(), x.dk.data(), x.dv.data(), x.g.data(), x.q.data(),
                           x.k.data(), x.v.data(), x.o.data(), x.lse.data(), B, T, NH, NKV, HS);
      });
}

Kernel norm_kernel(int64_t N, int64_t C) {
  struct State {
    std::vector<float> x, dy, y, dx, w, dw, rstd;
  };
  auto s = std::make_shared<State>();
  s->x = normal(N * C, 41), s->dy = normal(N * C, 42), s->y.resize(N * C), s->dx.resize(N * C),
  s->w.assign(C, 1.0f), s->dw.resize(C), s->rstd.resize(N);
  return kernel(
      s,
      [=](State& a) {
        rmsnorm_forward(a.y.data(), a.rstd.data(), a.x.data(), a.w.data(), N, C, 1e-5f);
      },
      [=](State& a) {
        rmsnorm_backward(a.dx.data(), a.dw.data(), a.dy.data(), a.x.data(), a.w.data(),
                         a.rstd.data(), N, C);
      });
}

Kernel rope_kernel(int64_t N, int64_t H, int64_t HS, int64_t T) {
  struct State {
    std::vector<float> x;
    std::vector<int32_t> pos;
  };
  auto s = std::make_shared<State>();
  s->x = normal(N * H * HS, 51);
  s->pos.resize(static_cast<std::size_t>(N));
  for (int64_t i = 0; i < N; ++i) s->pos[i] = static_cast<int32_t>(i % T);
  return kernel(
      s,
      [=](State& a) { rope_forward(a.x.data(), a.x.data(), a.pos.data(), N, H, HS, 10000.0f); },
      [=](State& a) { rope_backward(a.x.data(), a.x.data(), a.pos.data(), N, H, HS, 10000.0f); });
}

// The update as the trainer runs it over the first n parameters of the model's table, in its
// parameter groups (the optimizer's loops run per decay segment): zero the gradients (the next
// step's backward accumulates), the clip's norm, the optimizer's step.
std::function<void()> update_call(const RunConfig& cfg, const ParamLayout& layout, int64_t n) {
  const std::vector<ParamRange> groups =
      n < layout.size() ? std::vector<ParamRange>{{0, n, true}} : param_groups(layout);
  struct State {
    std::vector<float> p, g;
    std::unique_ptr<Optimizer> opt;
  };
  auto s = std::make_shared<State>();
  s->p = normal(n, 61), s->g = normal(n, 62);
  s->opt = make_optimizer(cfg.optim.optimizer_config(), groups, 0, n);
  return [s, n] {
    clip_grad_norm(s->g.data(), n, 1.0);
    s->opt->step(s->p.data(), s->g.data(), 1e-6f);
    std::fill(s->g.begin(), s->g.end(), 0.0f);
  };
}

// The kernels of one micro-batch of `cfg` at its shapes, timed in a step's order
// (seconds_in_turn), for each thread count the process could run: Linear layers (attention
// projections, dense and shared FFNs, LM head), RoPE, the attention core, RMSNorm, the experts at
// the uniform rows per expert, a quarter and twice that (a skewed load, and the per-source calls
// of expert parallelism); and the update.
KernelTable measure_config(const RunConfig& cfg) {
  const ModelConfig& m = cfg.model;
  const DType t = cfg.train.precision_dtype();
  const double dt = dtype_code(t);
  const int64_t B = cfg.train.batch_size, T = cfg.train.seq_len, N = B * T, C = m.dim;
  const int64_t HS = m.head_dim(), QD = m.n_heads * HS, KD = m.n_kv_heads * HS;
  struct Entry {
    std::string kind;
    std::vector<double> shape;
    double per;  // the table holds seconds per call / per
  };
  std::vector<Entry> entries;
  std::vector<Kernel> kernels;
  auto add = [&](std::string kind, std::vector<double> shape, double per, auto make) {
    for (const Entry& e : entries)
      if (e.kind == kind && e.shape == shape) return;
    entries.push_back({std::move(kind), std::move(shape), per});
    kernels.push_back(make());
  };
  std::vector<std::array<int64_t, 2>> linears = {{C, QD}, {C, KD}, {QD, C}, {C, m.vocab_size}};
  if (m.n_layers > m.n_moe_layers())
    linears.insert(linears.end(), {{C, m.dense_ffn_hidden()}, {m.dense_ffn_hidden(), C}});
  if (m.shared_expert_hidden > 0)
    linears.insert(linears.end(), {{C, m.shared_expert_hidden}, {m.shared_expert_hidden, C}});
  for (const auto& [IC, OC] : linears)
    add("linear", {double(N), double(IC), double(OC), dt}, 1,
        [&] { return linear_kernel(N, IC, OC, t); });
  add("rope", {double(N), double(m.n_heads), double(HS)}, 1,
      [&] { return rope_kernel(N, m.n_heads, HS, T); });
  if (m.n_kv_heads != m.n_heads)
    add("rope", {double(N), double(m.n_kv_heads), double(HS)}, 1,
        [&] { return rope_kernel(N, m.n_kv_heads, HS, T); });
  add("attention", {double(B), double(T), double(m.n_heads), double(m.n_kv_heads), double(HS)}, 1,
      [&] { return attention_kernel(B, T, m.n_heads, m.n_kv_heads, HS); });
  add("norm", {double(N), double(C)}, 1, [&] { return norm_kernel(N, C); });
  if (m.n_moe_layers() > 0) {
    const int64_t r0 = std::max<int64_t>(1, (N * m.top_k + m.n_experts - 1) / m.n_experts);
    for (int64_t rows : {std::max<int64_t>(1, r0 / 4), r0, 2 * r0})
      add("experts", {double(C), double(m.expert_hidden), double(rows), dt},
          static_cast<double>(m.n_experts),
          [&] { return experts_kernel(C, m.expert_hidden, m.n_experts, rows, t); });
  }
  const std::vector<double> seconds = seconds_in_turn(kernels);
  KernelTable k;
  for (std::size_t i = 0; i < entries.size(); ++i)
    k.add(entries[i].kind, entries[i].shape, seconds[i] / entries[i].per);
  // The update once a step, after every backward: timed in a loop of its own (it streams the
  // whole parameter state through the caches each call). At most 8 M parameters, 4 arrays of
  // 32 MB: past the caches the rate holds.
  const ParamLayout layout(m);
  const int64_t n_update = std::min<int64_t>(layout.size(), int64_t{8} << 20);
  k.add("optimizer", {double(n_update), optimizer_code(cfg.optim.name)},
        seconds_per_call(update_call(cfg, layout, n_update)));
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
