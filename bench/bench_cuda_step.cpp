// The train step on the CUDA operations as the trainer runs it (resident: zero the gradients,
// forward, backward, the global norm and clip, AdamW, all on the device) in each GEMM operand mode
// (f32, TF32, bf16) against references measured in the same run: cuBLAS's own GEMM rate in that
// mode on a large square product and on the experts' shape, and the same step on this machine's
// CPU (forward, backward, norm, clip, AdamW on the host).
//
//   bench_cuda_step [--iters N] [--cpu-iters N] [--preset tiny|large|xl]... [--profile]
//
// Prints per preset and mode: the step's median time, tokens/s, model TFLOP/s (6·active
// parameters + attention per token, Transformer::flops_per_token), their ratio to the raw cuBLAS
// rates, MFU against the device's datasheet peak where the device is known, and the CPU/GPU
// speed-up. --profile prints instead where a step's time goes, phase by phase (core/profile.h; the
// stream is drained at every phase boundary, which costs a little), and the experts' GEMM rate
// against raw cuBLAS on the same shapes. Without a usable GPU it says so and exits 0.
#include <cublas_v2.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/profile.h"
#include "core/rng.h"
#include "core/threads.h"
#include "core/timer.h"
#include "cuda/device.h"
#include "cuda/gemm.h"
#include "cuda/kernels.h"
#include "model/device_ops.h"
#include "model/params.h"
#include "model/transformer.h"
#include "optim/device_state.h"
#include "optim/optimizer.h"
#include "optim/param_groups.h"
#include "optim/update.h"
#include "presets.h"
#include "profile_table.h"

using namespace moetrain;

namespace {

using bench::kPresets;
using bench::Preset;

ModelConfig validated_model(const Preset& p) {
  ModelConfig c = bench::model_of(p);
  c.validate();
  return c;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

constexpr DeviceGemm kModes[] = {DeviceGemm::F32, DeviceGemm::TF32, DeviceGemm::BF16};

const char* mode_name(DeviceGemm g) {
  return g == DeviceGemm::F32 ? "f32" : g == DeviceGemm::TF32 ? "tf32" : "bf16";
}

// Dense datasheet peak of the device in `mode`, TFLOP/s (0 where the device is not known here):
// H100/H200 SXM 67 f32, 495 TF32, 989 bf16; A100 19.5, 156, 312.
double datasheet_peak(const std::string& device, DeviceGemm mode) {
  const int i = static_cast<int>(mode);
  if (device.find("H100") != std::string::npos || device.find("H200") != std::string::npos)
    return std::array<double, 3>{67, 495, 989}[i];
  if (device.find("A100") != std::string::npos) return std::array<double, 3>{19.5, 156, 312}[i];
  return 0;
}

// cuBLAS's row-major C (M, N) = A (M, K) · Bᵀ in `mode` (f32, TF32 on f32 operands, bf16
// operands), f32 accumulation and output, TFLOP/s: the median of 5 timings of 10 products each,
// after a warm-up.
double raw_gemm_tflops(int64_t M, int64_t N, int64_t K, DeviceGemm mode) {
  cuda::Context ctx;
  const bool bf = mode == DeviceGemm::BF16;
  const std::size_t es = bf ? 2 : 4;
  void *A = nullptr, *B = nullptr;
  MOETRAIN_CUDA_CHECK(cudaMalloc(&A, es * M * K));
  MOETRAIN_CUDA_CHECK(cudaMalloc(&B, es * N * K));
  cuda::DeviceBuffer<float> C(M * N);
  MOETRAIN_CUDA_CHECK(cudaMemset(A, 0, es * M * K));
  MOETRAIN_CUDA_CHECK(cudaMemset(B, 0, es * N * K));
  const float one = 1.0f, zero = 0.0f;
  const cudaDataType t = bf ? CUDA_R_16BF : CUDA_R_32F;
  const cublasComputeType_t ct =
      mode == DeviceGemm::TF32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  auto run = [&] {
    MOETRAIN_CUBLAS_CHECK(cublasGemmEx(
        ctx.blas(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M),
        static_cast<int>(K), &one, B, t, static_cast<int>(K), A, t, static_cast<int>(K), &zero,
        C.data(), CUDA_R_32F, static_cast<int>(N), ct, CUBLAS_GEMM_DEFAULT));
  };
  run();
  ctx.sync();
  std::vector<double> times;
  for (int rep = 0; rep < 5; ++rep) {
    Timer timer;
    for (int i = 0; i < 10; ++i) run();
    ctx.sync();
    times.push_back(timer.seconds() / 10);
  }
  MOETRAIN_CUDA_CHECK(cudaFree(A));
  MOETRAIN_CUDA_CHECK(cudaFree(B));
  return 2.0 * M * N * K / median(times) * 1e-12;
}

// The engine's own GEMM call (cuda/gemm.h: f32 operands, rounded to bf16 first in that mode) on
// the experts' product, as the step makes it: the rows change from call to call (64 row counts
// around `M`, as routing changes them), against the same rows every call. Also cuBLAS's
// cublasGemmEx on operands already in the mode's type with the same changing rows, and the
// rounding of both operands alone.
struct EngineGemm {
  double fixed_tflops, varying_tflops, gemmex_varying_tflops, rounding_ms, copies_varying_tflops;
};
EngineGemm engine_gemm(int64_t M, int64_t N, int64_t K, DeviceGemm mode) {
  cuda::Context ctx;
  ctx.set_gemm_mode(mode);
  const int64_t Mmax = M + 32;
  cuda::DeviceBuffer<float> A(Mmax * K), B(N * K), C(Mmax * N);
  MOETRAIN_CUDA_CHECK(cudaMemset(A.data(), 0, sizeof(float) * Mmax * K));
  MOETRAIN_CUDA_CHECK(cudaMemset(B.data(), 0, sizeof(float) * N * K));
  cuda::DeviceBuffer<uint16_t> Ab(Mmax * K), Bb(N * K);
  MOETRAIN_CUDA_CHECK(cudaMemset(Ab.data(), 0, 2 * Mmax * K));
  MOETRAIN_CUDA_CHECK(cudaMemset(Bb.data(), 0, 2 * N * K));
  int call = 0;
  auto rows = [&](bool vary) { return vary ? M - 32 + (call++ * 37) % 64 : M; };
  double flops = 0;
  // Seconds per call: the median of 5 timings of 64 calls, after one warm-up round.
  auto timed = [&](auto&& f) {
    for (int i = 0; i < 64; ++i) f();
    ctx.sync();
    std::vector<double> times;
    flops = 0;
    for (int rep = 0; rep < 5; ++rep) {
      Timer timer;
      for (int i = 0; i < 64; ++i) f();
      ctx.sync();
      times.push_back(timer.seconds() / 64);
    }
    return median(times);
  };
  auto engine = [&](bool vary) {
    return [&, vary] {
      const int64_t m = rows(vary);
      flops += 2.0 * m * N * K;
      cuda::linear_forward(ctx, C.data(), A.data(), B.data(), m, K, N);
    };
  };
  EngineGemm r{};
  double s = timed(engine(false));
  r.fixed_tflops = flops / (5 * 64) / s * 1e-12;
  s = timed(engine(true));
  r.varying_tflops = flops / (5 * 64) / s * 1e-12;
  const bool bf = mode == DeviceGemm::BF16;
  const float one = 1.0f, zero = 0.0f;
  s = timed([&] {
    const int64_t m = rows(true);
    flops += 2.0 * m * N * K;
    MOETRAIN_CUBLAS_CHECK(
        cublasGemmEx(ctx.blas(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(m),
                     static_cast<int>(K), &one, bf ? static_cast<void*>(Bb.data()) : B.data(),
                     bf ? CUDA_R_16BF : CUDA_R_32F, static_cast<int>(K),
                     bf ? static_cast<void*>(Ab.data()) : A.data(), bf ? CUDA_R_16BF : CUDA_R_32F,
                     static_cast<int>(K), &zero, C.data(), CUDA_R_32F, static_cast<int>(N),
                     mode == DeviceGemm::TF32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT));
  });
  r.gemmex_varying_tflops = flops / (5 * 64) / s * 1e-12;
  if (bf) {
    // The same calls with both operands read from bf16 copies, as in a step (the weights' copy;
    // the activation in a Bf16Operand): cuBLASLt's algorithm for the class alone.
    ctx.set_weight_copy(B.data(), N * K, Bb.data());
    const cuda::Bf16Operand a16(ctx, A.data(), Mmax * K);
    s = timed(engine(true));
    r.copies_varying_tflops = flops / (5 * 64) / s * 1e-12;
    ctx.set_weight_copy(nullptr, 0, nullptr);
  }
  r.rounding_ms = timed([&] {
                    cuda::to_bf16(Ab.data(), A.data(), M * K, ctx.stream());
                    cuda::to_bf16(Bb.data(), B.data(), N * K, ctx.stream());
                  }) *
                  1e3;
  return r;
}

// A train step of a fixed batch on `device` ("cpu" or "cuda", the latter in `mode`).
class StepRig {
 public:
  StepRig(const Preset& p, const std::string& device, DeviceGemm mode)
      : p_(p), cfg_(validated_model(p)), model_(cfg_) {
    const int64_t n = model_.layout().size();
    params_.resize(static_cast<std::size_t>(n));
    grads_.assign(params_.size(), 0.0f);
    const std::vector<float> zeros(params_.size(), 0.0f);
    init_params(params_.data(), model_.layout(), cfg_, 1234);
    groups_ = param_groups(model_.layout());
    oc_.kind = OptimizerKind::AdamW;
    oc_.weight_decay = 0.1;
    if (device != "cpu") {
      model_.set_device(device);
      model_.device_ops()->set_gemm(mode);
      engine_ = &model_.device_ops()->training_state();
      engine_->set_resident(true);
      engine_->upload_state(params_.data(), zeros.data(), zeros.data(), 0, n);
    } else {
      cpu_opt_ = make_optimizer(oc_, groups_, 0, n);
    }
    uo_.grad_clip = 1.0;
    const int64_t N = p.B * p.T;
    inputs_.resize(static_cast<std::size_t>(N)), targets_.resize(inputs_.size());
    Rng rng(7, 0);
    for (int64_t i = 0; i < N; ++i) {
      inputs_[i] = static_cast<int32_t>(rng.below(2 * i, 256));
      targets_[i] = static_cast<int32_t>(rng.below(2 * i + 1, 256));
    }
    step_.training = true;
  }

  void step() {
    ++steps_;
    if (engine_) {
      engine_->zero_grads();
      model_.forward(params_.data(), inputs_.data(), targets_.data(), p_.B, p_.T, step_);
      model_.backward(params_.data(), grads_.data(), 1.0f);
      if (!check_and_clip(engine_->gradient(), *comm_, uo_).skipped)
        engine_->adamw_step(oc_, groups_, 1e-4f, steps_);
      model_.device_ops()->synchronize();
    } else {
      std::fill(grads_.begin(), grads_.end(), 0.0f);
      model_.forward(params_.data(), inputs_.data(), targets_.data(), p_.B, p_.T, step_);
      model_.backward(params_.data(), grads_.data(), 1.0f);
      FlatGradient g(grads_.data(), static_cast<int64_t>(grads_.size()));
      if (!check_and_clip(g, *comm_, uo_).skipped)
        cpu_opt_->step(params_.data(), grads_.data(), 1e-4f);
      model_.weights_changed();
    }
  }

  // Median seconds of `iters` steps after one warm-up step (allocations, cuBLAS heuristics).
  double median_seconds(int iters) {
    step();
    std::vector<double> t;
    for (int i = 0; i < iters; ++i) {
      Timer timer;
      step();
      t.push_back(timer.seconds());
    }
    return median(t);
  }

 private:
  const Preset& p_;
  ModelConfig cfg_;
  Transformer model_;
  std::vector<float> params_, grads_;
  std::vector<ParamRange> groups_;
  OptimizerConfig oc_;
  std::unique_ptr<Optimizer> cpu_opt_;
  DeviceTrainingState* engine_ = nullptr;
  std::unique_ptr<Comm> comm_ = make_local_comm();
  UpdateOptions uo_;
  std::vector<int32_t> inputs_, targets_;
  MoeStep step_;
  int64_t steps_ = 0;
};

const Preset& preset_named(const std::string& name) {
  for (const Preset& q : kPresets)
    if (name == q.name) return q;
  MOETRAIN_FAIL("bench_cuda_step: no preset '{}' (tiny, large, xl)", name);
}

// --profile: where one step's time goes in each mode, and the experts' GEMMs against raw cuBLAS on
// their shapes (uniform routing: B·T·k/E rows an expert; the Experts phase also holds SwiGLU).
void print_profiles(const Preset& p, int steps) {
  const ModelConfig cfg = validated_model(p);
  const double tokens = static_cast<double>(p.B * p.T);
  const int64_t rows = p.B * p.T * p.K / p.E;
  // Per step: 3 matrices × (forward + 2 backward GEMMs) × 2·rows·C·F for each expert and layer.
  const double expert_flops = 3.0 * 3.0 * 2.0 * rows * p.C * p.F * p.E * cfg.n_moe_layers();
  for (DeviceGemm mode : kModes) {
    StepRig rig(p, "cuda", mode);
    rig.step();
    rig.step();
    const cuda::GemmPlanStats plans = cuda::gemm_plan_stats();
    Timer t;
    profile::start();
    for (int i = 0; i < steps; ++i) rig.step();
    const PhaseTable table = profile::stop();
    const double step_s = t.seconds() / steps;
    std::printf("\n%s %s: %.2f ms per step (%d steps, profiled), %.0f tokens/s\n", p.name,
                mode_name(mode), step_s * 1e3, steps, tokens / step_s);
    bench::print_phase_table(table, steps, step_s);
    if (mode == DeviceGemm::BF16) {
      const cuda::GemmPlanStats st = cuda::gemm_plan_stats();
      std::printf("  bf16 cuBLASLt algorithms over the profiled steps: %lld chosen, %lld reused\n",
                  static_cast<long long>(st.chosen - plans.chosen),
                  static_cast<long long>(st.reused - plans.reused));
    }
    const double ex = table[static_cast<int>(Phase::Experts)].seconds / steps;
    const double raw = raw_gemm_tflops(rows, p.F, p.C, mode);
    const EngineGemm g = engine_gemm(rows, p.F, p.C, mode);
    std::printf(
        "  one expert GEMM through cuda::gemm: %.1f TFLOP/s with the same rows, %.1f with "
        "changing rows (cublasGemmEx: %.1f); rounding its operands alone %.3f ms\n",
        g.fixed_tflops, g.varying_tflops, g.gemmex_varying_tflops, g.rounding_ms);
    if (mode == DeviceGemm::BF16)
      std::printf("  the same, operands from bf16 copies as in a step: %.1f TFLOP/s\n",
                  g.copies_varying_tflops);
    if (ex > 0)
      std::printf(
          "  experts: %.1f TFLOP/s in their phase, raw cuBLAS %.1f TFLOP/s on (%lld, %lld, "
          "%lld): %.2f\n",
          expert_flops / ex * 1e-12, raw, static_cast<long long>(rows), static_cast<long long>(p.F),
          static_cast<long long>(p.C), expert_flops / ex * 1e-12 / raw);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 10, cpu_iters = 3;
  bool profile_mode = false;
  std::vector<std::string> presets;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) {
      iters = std::stoi(argv[++i]);
    } else if (a == "--cpu-iters" && i + 1 < argc) {
      cpu_iters = std::stoi(argv[++i]);
    } else if (a == "--preset" && i + 1 < argc) {
      presets.emplace_back(argv[++i]);
    } else if (a == "--profile") {
      profile_mode = true;
    } else {
      fmt::print(stderr,
                 "bench_cuda_step: unknown argument '{}' (known: --iters N, --cpu-iters "
                 "N, --preset tiny|large|xl, --profile)\n",
                 a);
      return 2;
    }
  }
  if (presets.empty()) presets = {"tiny", "large", "xl"};
  std::string why;
  if (!cuda::device_available(&why)) {
    fmt::print("bench_cuda_step: {}; nothing to measure\n", why);
    return 0;
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  init_threads(0, 1);
  const std::string device = cuda::device_description();
  fmt::print("device: {}\n", device);
  if (profile_mode) {
    for (const std::string& name : presets) print_profiles(preset_named(name), 5);
    return 0;
  }
  double raw[3];
  for (DeviceGemm mode : kModes) {
    raw[static_cast<int>(mode)] = raw_gemm_tflops(8192, 8192, 8192, mode);
    fmt::print("raw cuBLAS GEMM 8192^3 {}: {:.1f} TFLOP/s (datasheet {:.0f})\n", mode_name(mode),
               raw[static_cast<int>(mode)], datasheet_peak(device, mode));
  }
  fmt::print("{:<6} {:<5} {:>9} {:>11} {:>8} {:>9} {:>9} {:>7} {:>9}\n", "preset", "mode",
             "step ms", "tokens/s", "TFLOP/s", "/raw", "/expert", "MFU", "cpu/gpu");
  for (const std::string& name : presets) {
    const Preset& p = preset_named(name);
    const ModelConfig cfg = validated_model(p);
    const double tokens = static_cast<double>(p.B * p.T);
    const double flops = Transformer(cfg).flops_per_token(p.T) * tokens;
    const double cpu =
        cpu_iters > 0 ? StepRig(p, "cpu", DeviceGemm::F32).median_seconds(cpu_iters) : 0.0;
    // The experts' first GEMM at the rows one expert gets under uniform routing.
    const int64_t rows = p.B * p.T * p.K / p.E;
    for (DeviceGemm mode : kModes) {
      const double s = StepRig(p, "cuda", mode).median_seconds(iters);
      const double rate = flops / s * 1e-12;
      const double expert = raw_gemm_tflops(rows, p.F, p.C, mode);
      const double peak = datasheet_peak(device, mode);
      fmt::print("{:<6} {:<5} {:>9.2f} {:>11.0f} {:>8.1f} {:>9.3f} {:>9.3f} {:>7} {:>9}\n", p.name,
                 mode_name(mode), s * 1e3, tokens / s, rate, rate / raw[static_cast<int>(mode)],
                 rate / expert, peak > 0 ? fmt::format("{:.3f}", rate / peak) : "-",
                 cpu > 0 ? fmt::format("{:.1f}", cpu / s) : "-");
    }
    if (cpu > 0) fmt::print("{:<6} cpu   {:>9.2f} {:>11.0f}\n", p.name, cpu * 1e3, tokens / cpu);
  }
  return 0;
}
