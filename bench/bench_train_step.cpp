// One optimizer step of the LM (forward, backward, AdamW) in tokens/s, and model FLOP utilisation:
// achieved model FLOP/s over the f32 rate of a raw oneDNN GEMM measured in the same run at the
// model's expert shape (M = B·T·k/E rows, N = F, K = C). precision 1 runs the model with bf16
// GEMM operands (Transformer::set_precision) and also measures the raw bf16 GEMM rate at that
// shape through kernels/gemm.h (oneDNN bf16 where the CPU has it; bf16_native says whether it
// did, else the operands were widened to f32 and no bf16 speed-up is possible).
// --profile prints, instead, where one step's time goes phase by phase (core/profile.h), and the
// optimizer's memory rate against a streaming kernel measured in the same run; --batch B profiles
// the presets at B sequences a step, --seq T at T tokens a sequence; --preset NAME profiles one
// preset, --precision f32|bf16 one precision, --steps N over N steps (default 5).
// --paired times the two precisions step against step, for the ratio on a machine whose speed
// moves: both models are built and warmed, then each round runs one f32 and one bf16 step (the
// order alternating between rounds), and the ratio is taken within each round; it prints the
// median of the rounds' ratios, their spread and each precision's median step, and the f32
// utilisation against the raw GEMM rate measured right after. --steps N rounds (default 9).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <dnnl.hpp>
#include <memory>
#include <string>
#include <vector>

#include "core/profile.h"
#include "core/rng.h"
#include "core/threads.h"
#include "core/timer.h"
#include "kernels/gemm.h"
#include "model/params.h"
#include "model/transformer.h"
#include "presets.h"
#include "profile_table.h"
#include "optim/optimizer.h"
#include "optim/param_groups.h"
#include "train/trainer.h"

using namespace moetrain;

namespace {

using bench::kPresets;
using bench::model_of;
using bench::Preset;

double raw_bf16_gemm_gflops(int64_t M, int64_t N, int64_t K) {
  std::vector<bf16> A(M * K, bf16(0.5f)), B(N * K, bf16(0.25f));
  std::vector<float> C(M * N);
  auto run = [&] { gemm(Trans::N, Trans::T, M, N, K, A.data(), B.data(), C.data(), false); };
  run();
  Timer t;
  int iters = 0;
  while (t.seconds() < 0.3 || iters < 3) run(), ++iters;
  return 2.0 * M * N * K * iters / t.seconds() * 1e-9;
}

double raw_gemm_gflops(int64_t M, int64_t N, int64_t K) {
  using dt = dnnl::memory::data_type;
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream s(eng);
  dnnl::memory::desc a({M, K}, dt::f32, {K, 1}), b({K, N}, dt::f32, {1, K}),
      c({M, N}, dt::f32, {N, 1});
  dnnl::matmul prim(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), eng));
  std::vector<float> A(M * K, 0.5f), B(N * K, 0.25f), C(M * N);
  dnnl::memory am(a, eng, A.data()), bm(b, eng, B.data()), cm(c, eng, C.data());
  auto run = [&] {
    prim.execute(s, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
    s.wait();
  };
  run();
  Timer t;
  int iters = 0;
  while (t.seconds() < 0.3 || iters < 3) run(), ++iters;
  return 2.0 * M * N * K * iters / t.seconds() * 1e-9;
}

// One preset's model, parameters, optimizer and a fixed batch: what one step touches.
struct StepRig {
  const Preset& p;
  ModelConfig cfg;
  Transformer model;
  std::vector<float> params, grads;
  std::vector<ParamRange> groups;  // the optimizer keeps a view of them
  std::unique_ptr<Optimizer> opt;
  std::vector<int32_t> in, tg;
  MoeStep ms;

  StepRig(const Preset& preset, bool bf)
      : p(preset), cfg(model_of(preset)), model(cfg), in(p.B * p.T), tg(p.B * p.T) {
    if (bf) model.set_precision(DType::BF16);
    const ParamLayout& layout = model.layout();
    params.resize(layout.size());
    grads.resize(layout.size());
    init_params(params.data(), layout, cfg, 1);
    groups = param_groups(layout);
    opt = make_optimizer(default_optimizer_config(OptimizerKind::AdamW), groups, 0, layout.size());
    Rng rng(5, 5);
    for (size_t i = 0; i < in.size(); ++i)
      in[i] = rng.below(2 * i, 256), tg[i] = rng.below(2 * i + 1, 256);
  }

  // Two untimed steps before any timing. The first creates the GEMM primitives and touches every
  // activation and optimizer buffer for the first time; a step of the large preset outlasts the
  // benchmark's minimum time, so without these the benchmark would time that first step alone.
  void warm_up() {
    step();
    step();
  }

  void step() {
    {
      PhaseScope zero(Phase::GradZero);
      std::fill(grads.begin(), grads.end(), 0.0f);
    }
    model.forward(params.data(), in.data(), tg.data(), p.B, p.T, ms);
    model.backward(params.data(), grads.data(), 1.0f);
    // bf16: the optimizer writes the weight copy as it updates, as the trainer's step does.
    opt->step(params.data(), grads.data(), 1e-4f, {}, model.lp_copy_of(params.data()));
    model.weights_changed_copy_kept();
    ++ms.step;
  }
};

void BM_train_step(benchmark::State& state) {
  const Preset& p = kPresets[state.range(0)];
  const bool bf = state.range(1) == 1;
  StepRig rig(p, bf);
  rig.warm_up();
  Transformer& model = rig.model;
  double moe_experts = 0, moe_total = 0;
  for (auto _ : state) {
    rig.step();
    for (MoeLayer* m : model.moe_layers())
      moe_experts += m->timings().experts, moe_total += m->timings().total();
  }
  const double tokens = static_cast<double>(p.B * p.T);
  const double gemm = raw_gemm_gflops(p.B * p.T * p.K / p.E, p.F, p.C);
  state.counters["tokens_per_s"] =
      benchmark::Counter(tokens * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["model_GFLOPs"] = benchmark::Counter(
      model.flops_per_token(p.T) * tokens * state.iterations() * 1e-9, benchmark::Counter::kIsRate);
  state.counters["raw_gemm_GFLOPs"] = gemm;
  if (bf) {
    state.counters["raw_bf16_gemm_GFLOPs"] = raw_bf16_gemm_gflops(p.B * p.T * p.K / p.E, p.F, p.C);
    state.counters["bf16_native"] = gemm_is_native(DType::BF16) ? 1 : 0;
  }
  state.counters["moe_expert_share"] = moe_total > 0 ? moe_experts / moe_total : 0;
  state.SetLabel(std::string(p.name) + (bf ? "_bf16" : "_f32"));
}

// a (n) = b + s·c, cloned for the instruction sets the optimizer's loop is (optim/adamw.cpp): a
// baseline SSE2 loop is bound by its 16-byte loads and stores well below the memory's rate.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void triad(float* a, const float* b, const float* c, float s, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

// A streaming a[i] = b[i] + s·c[i] over arrays far larger than the caches: the memory bandwidth
// the optimizer (which reads parameters, gradients and two moments and writes three) can reach.
double stream_gbps() {
  const int64_t n = int64_t{1} << 24;
  std::vector<float> a(n, 0.0f), b(n, 1.0f), c(n, 2.0f);
  auto run = [&] { triad(a.data(), b.data(), c.data(), 0.5f, n); };
  run();
  Timer t;
  int iters = 0;
  while (t.seconds() < 0.3 || iters < 3) run(), ++iters;
  benchmark::DoNotOptimize(a.data());
  return 3.0 * 4.0 * static_cast<double>(n) * iters / t.seconds() * 1e-9;
}

// bench_train_step --profile: where one step's time goes, phase by phase (core/profile.h).
void print_profile(Preset p, bool bf, int steps, double stream) {
  StepRig rig(p, bf);
  rig.warm_up();
  Timer t;
  profile::start();
  for (int i = 0; i < steps; ++i) rig.step();
  const PhaseTable table = profile::stop();
  const double step_s = t.seconds() / steps;
  std::printf("\n%s %s: %.1f ms per step (%d steps), %.0f tokens/s\n", p.name,
              bf ? "bf16" : "f32", step_s * 1e3, steps, static_cast<double>(p.B * p.T) / step_s);
  bench::print_phase_table(table, steps, step_s);
  const PhaseTotals& o = table[static_cast<int>(Phase::Optimizer)];
  const double opt_bytes = 7.0 * 4.0 * static_cast<double>(rig.params.size());
  if (o.seconds > 0)
    std::printf("  optimizer: %.1f M parameters, %.2f GB/s (7 x 4 bytes per parameter) against "
                "%.2f GB/s streaming: %.0f%%\n",
                static_cast<double>(rig.params.size()) / 1e6, opt_bytes * steps / o.seconds * 1e-9,
                stream, 100.0 * opt_bytes * steps / o.seconds * 1e-9 / stream);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// bench_train_step --paired: f32 and bf16 steps of one preset, alternated.
void print_paired(const Preset& p, int rounds) {
  StepRig f32(p, false), bf(p, true);
  f32.warm_up();
  bf.warm_up();
  std::vector<double> t32, t16, ratio;
  for (int r = 0; r < rounds; ++r) {
    double s[2];
    for (int k = 0; k < 2; ++k) {
      const bool is_bf = (r + k) % 2 == 1;  // f32 first in even rounds, bf16 first in odd
      Timer t;
      (is_bf ? bf : f32).step();
      s[is_bf ? 1 : 0] = t.seconds();
    }
    t32.push_back(s[0]), t16.push_back(s[1]), ratio.push_back(s[0] / s[1]);
  }
  const double tokens = static_cast<double>(p.B * p.T);
  const double gemm = raw_gemm_gflops(p.B * p.T * p.K / p.E, p.F, p.C);
  const double util = f32.model.flops_per_token(p.T) * tokens / median(t32) * 1e-9 / gemm;
  std::printf("\n%s: %d rounds of one f32 and one bf16 step\n  bf16 / f32 tokens/s per round:",
              p.name, rounds);
  for (double x : ratio) std::printf(" %.2f", x);
  std::printf("\n  median %.3fx (rounds %.2f-%.2f)\n", median(ratio),
              *std::min_element(ratio.begin(), ratio.end()),
              *std::max_element(ratio.begin(), ratio.end()));
  std::printf("  median step: f32 %.1f ms (%.0f tokens/s), bf16 %.1f ms (%.0f tokens/s)\n",
              median(t32) * 1e3, tokens / median(t32), median(t16) * 1e3, tokens / median(t16));
  std::printf("  f32 utilisation: %.1f%% (model FLOP/s over the raw f32 GEMM's %.1f GFLOP/s)\n",
              100.0 * util, gemm);
}

}  // namespace

BENCHMARK(BM_train_step)
    ->Args({0, 0})
    ->Args({0, 1})
    ->Args({1, 0})
    ->Args({1, 1})
    ->ArgNames({"preset", "bf16"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(2.0);

int main(int argc, char** argv) {
  init_threads();
  pin_threads();  // as the trainer runs one process
  bool profile_mode = false, paired = false;
  int64_t batch = 0, seq = 0;
  int steps = 0;  // the mode's default
  std::string only_preset, only_precision;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--profile") {
      profile_mode = true;
    } else if (std::string(argv[i]) == "--paired") {
      paired = true;
    } else if (std::string(argv[i]) == "--batch" && i + 1 < argc) {
      batch = std::stoll(argv[++i]);
    } else if (std::string(argv[i]) == "--seq" && i + 1 < argc) {
      seq = std::stoll(argv[++i]);
    } else if (std::string(argv[i]) == "--steps" && i + 1 < argc) {
      steps = std::stoi(argv[++i]);
    } else if (std::string(argv[i]) == "--preset" && i + 1 < argc) {
      only_preset = argv[++i];
    } else if (std::string(argv[i]) == "--precision" && i + 1 < argc) {
      only_precision = argv[++i];
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  // The presets a mode runs: --preset's, else tiny and large (xl is a GPU's model), at --batch
  // and --seq where given.
  std::vector<Preset> presets;
  for (const Preset& preset : kPresets) {
    if (only_preset.empty() ? std::string(preset.name) == "xl" : only_preset != preset.name)
      continue;
    presets.push_back(preset);
    if (batch > 0) presets.back().B = batch;
    if (seq > 0) presets.back().T = seq;
  }
  if (paired) {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    std::printf("threads %d; %s\n", num_threads(), gemm_backend_info());
    for (const Preset& p : presets) print_paired(p, steps > 0 ? steps : 9);
    return 0;
  }
  if (profile_mode) {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    const double stream = stream_gbps();
    std::printf("threads %d; %s; memory bandwidth (streaming) %.2f GB/s\n", num_threads(),
                gemm_backend_info(), stream);
    for (const Preset& p : presets) {
      for (bool bf : {false, true}) {
        if (!only_precision.empty() && only_precision != (bf ? "bf16" : "f32")) continue;
        print_profile(p, bf, steps > 0 ? steps : 5, stream);
      }
    }
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("threads", std::to_string(num_threads()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
