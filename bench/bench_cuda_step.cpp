// The CUDA engine's train step as the trainer runs it (resident: zero the gradients, forward,
// backward, the global norm and clip, AdamW, all on the device) against references measured in the
// same run: cuBLAS's own f32 GEMM rate on a large square product and on the experts' shape, and
// the same step on this machine's CPU (forward, backward, norm, clip, AdamW on the host).
//
//   bench_cuda_step [--iters N] [--cpu-iters N] [--preset tiny|large|xl]...
//
// Prints per preset: the step's median time, tokens/s, model TFLOP/s (6·active parameters +
// attention per token, Transformer::flops_per_token) and their ratio to the raw cuBLAS rates, and
// the CPU step's median for the GPU/CPU speed-up. Without a usable GPU it says so and exits 0.
#include <cublas_v2.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/rng.h"
#include "core/threads.h"
#include "core/timer.h"
#include "cuda/device.h"
#include "model/device_engine.h"
#include "optim/device_state.h"
#include "model/params.h"
#include "model/transformer.h"
#include "presets.h"
#include "optim/optimizer.h"
#include "optim/param_groups.h"
#include "optim/update.h"

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

// cuBLAS SGEMM (row-major C (M, N) = A (M, K) · Bᵀ), true f32 or with TF32 tensor-core operands,
// TFLOP/s: the median of 5 timings of 10 products each, after a warm-up.
double raw_sgemm_tflops(int64_t M, int64_t N, int64_t K, bool tf32) {
  cuda::Context ctx;
  MOETRAIN_CUBLAS_CHECK(
      cublasSetMathMode(ctx.blas(), tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
  cuda::DeviceBuffer<float> A(M * K), B(N * K), C(M * N);
  MOETRAIN_CUDA_CHECK(cudaMemset(A.data(), 0, sizeof(float) * M * K));
  MOETRAIN_CUDA_CHECK(cudaMemset(B.data(), 0, sizeof(float) * N * K));
  const float one = 1.0f, zero = 0.0f;
  auto run = [&] {
    MOETRAIN_CUBLAS_CHECK(cublasSgemm(ctx.blas(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N),
                                      static_cast<int>(M), static_cast<int>(K), &one, B.data(),
                                      static_cast<int>(K), A.data(), static_cast<int>(K), &zero,
                                      C.data(), static_cast<int>(N)));
  };
  run();
  ctx.sync();
  std::vector<double> t;
  for (int rep = 0; rep < 5; ++rep) {
    Timer timer;
    for (int i = 0; i < 10; ++i) run();
    ctx.sync();
    t.push_back(timer.seconds() / 10);
  }
  return 2.0 * M * N * K / median(t) * 1e-12;
}

// Median seconds of one train step of a fixed batch on `device` (tf32: the GPU's GEMMs on TF32
// operands).
double step_seconds(const Preset& p, const std::string& device, int iters, bool tf32 = false) {
  const ModelConfig cfg = validated_model(p);
  Transformer model(cfg);
  const int64_t n = model.layout().size();
  std::vector<float> params(static_cast<std::size_t>(n));
  std::vector<float> grads(params.size(), 0.0f), zeros(params.size(), 0.0f);
  init_params(params.data(), model.layout(), cfg, 1234);
  const std::vector<ParamRange> groups = param_groups(model.layout());
  OptimizerConfig oc;
  oc.kind = OptimizerKind::AdamW;
  oc.weight_decay = 0.1;
  std::unique_ptr<Optimizer> cpu_opt;
  DeviceTrainingState* engine = nullptr;
  if (device != "cpu") {
    model.set_device(device);
    model.device_engine()->set_tf32(tf32);
    engine = &model.device_engine()->training_state();
    engine->set_resident(true);
    engine->upload_state(params.data(), zeros.data(), zeros.data(), 0, n);
  } else {
    cpu_opt = make_optimizer(oc, groups, 0, n);
  }
  auto comm = make_local_comm();
  UpdateOptions uo;
  uo.grad_clip = 1.0;
  int64_t steps = 0;
  const int64_t N = p.B * p.T;
  std::vector<int32_t> inputs(static_cast<std::size_t>(N)), targets(inputs.size());
  Rng rng(7, 0);
  for (int64_t i = 0; i < N; ++i) {
    inputs[i] = static_cast<int32_t>(rng.below(2 * i, 256));
    targets[i] = static_cast<int32_t>(rng.below(2 * i + 1, 256));
  }
  MoeStep step;
  step.training = true;
  auto one = [&] {
    ++steps;
    if (engine) {
      engine->zero_grads();
      model.forward(params.data(), inputs.data(), targets.data(), p.B, p.T, step);
      model.backward(params.data(), grads.data(), 1.0f);
      apply_update(engine->gradient(), *comm, uo,
                   [&] { engine->adamw_step(oc, groups, 1e-4f, steps); });
      model.device_engine()->synchronize();
    } else {
      std::fill(grads.begin(), grads.end(), 0.0f);
      model.forward(params.data(), inputs.data(), targets.data(), p.B, p.T, step);
      model.backward(params.data(), grads.data(), 1.0f);
      FlatGradient g(grads.data(), n);
      apply_update(g, *comm, uo, [&] { cpu_opt->step(params.data(), grads.data(), 1e-4f); });
      model.weights_changed();
    }
  };
  one();  // warm-up: allocations, cuBLAS heuristics
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    Timer timer;
    one();
    t.push_back(timer.seconds());
  }
  return median(t);
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 10, cpu_iters = 3;
  std::vector<std::string> presets;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) {
      iters = std::stoi(argv[++i]);
    } else if (a == "--cpu-iters" && i + 1 < argc) {
      cpu_iters = std::stoi(argv[++i]);
    } else if (a == "--preset" && i + 1 < argc) {
      presets.emplace_back(argv[++i]);
    } else {
      fmt::print(stderr, "bench_cuda_step: unknown argument '{}' (known: --iters N, --cpu-iters "
                 "N, --preset tiny|large|xl)\n", a);
      return 2;
    }
  }
  if (presets.empty()) presets = {"tiny", "large", "xl"};
  std::string why;
  if (!cuda::device_available(&why)) {
    fmt::print("bench_cuda_step: {}; nothing to measure\n", why);
    return 0;
  }
  init_threads(0, 1);
  fmt::print("device: {}\n", cuda::device_description());
  const double raw_f32 = raw_sgemm_tflops(8192, 8192, 8192, false);
  const double raw_tf32 = raw_sgemm_tflops(8192, 8192, 8192, true);
  fmt::print("raw cuBLAS SGEMM 8192^3: {:.1f} TFLOP/s f32, {:.1f} TFLOP/s tf32\n", raw_f32,
             raw_tf32);
  fmt::print("{:<6} {:>8} {:>9} {:>8} {:>8} {:>9} {:>9} {:>11} {:>9} {:>8} {:>8}\n", "preset",
             "f32 ms", "/raw f32", "/expert", "tf32 ms", "/raw tf32", "/expert", "tokens/s",
             "cpu ms", "cpu/f32", "cpu/tf32");
  for (const std::string& name : presets) {
    const Preset* p = nullptr;
    for (const Preset& q : kPresets)
      if (name == q.name) p = &q;
    MOETRAIN_CHECK(p != nullptr, "bench_cuda_step: no preset '{}' (tiny, large, xl)", name);
    const ModelConfig cfg = validated_model(*p);
    const double tokens = static_cast<double>(p->B * p->T);
    const double flops = Transformer(cfg).flops_per_token(p->T) * tokens;
    const double f32 = step_seconds(*p, "cuda", iters, false);
    const double tf32 = step_seconds(*p, "cuda", iters, true);
    // The experts' first GEMM at the rows one expert gets under uniform routing.
    const int64_t rows = p->B * p->T * p->K / p->E;
    const double expert_f32 = raw_sgemm_tflops(rows, p->F, p->C, false);
    const double expert_tf32 = raw_sgemm_tflops(rows, p->F, p->C, true);
    const double cpu = cpu_iters > 0 ? step_seconds(*p, "cpu", cpu_iters) : 0.0;
    // Model TFLOP/s over the raw GEMM rate: the step's utilisation of what cuBLAS reaches.
    auto util = [&](double s, double raw) { return flops / s * 1e-12 / raw; };
    fmt::print("{:<6} {:>8.2f} {:>9.3f} {:>8.3f} {:>8.2f} {:>9.3f} {:>9.3f} {:>11.0f} {:>9.1f} "
               "{:>8.1f} {:>8.1f}\n",
               p->name, f32 * 1e3, util(f32, raw_f32), util(f32, expert_f32), tf32 * 1e3,
               util(tf32, raw_tf32), util(tf32, expert_tf32), tokens / tf32, cpu * 1e3,
               cpu > 0 ? cpu / f32 : 0.0, cpu > 0 ? cpu / tf32 : 0.0);
  }
  return 0;
}
