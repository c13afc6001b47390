// The CUDA operations end to end: the trainer on the GPU against the same run on the CPU, bit-exact
// resume on the GPU, and the refusals. Skipped, saying why, where no GPU is usable — except the
// refusals, which are what such a machine shows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/rng.h"
#include "cuda/device.h"
#include "model/device_ops.h"
#include "model/params.h"
#include "model/transformer.h"
#include "support/corpus.h"
#include "support/expect_error.h"
#include "support/run_metrics.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

// The demo model (configs/tiny.toml) for 20 steps, or a small one with every block kind the
// engine has: a dense FFN layer, a shared expert, capacity dropping.
RunConfig run_config(const TempDir& tmp, const std::string& name, const std::string& device,
                     bool tiny, int64_t steps) {
  std::vector<std::string> keys = {"train.steps=" + std::to_string(steps),
                                   "train.eval_every=0",
                                   "train.eval_batches=2",
                                   "train.checkpoint_every=0",
                                   "train.progress=off",
                                   "train.tensorboard=false",
                                   "train.device=" + device,
                                   "data.dir=" + (tmp / "data").string(),
                                   "train.run_dir=" + (tmp / name).string()};
  if (!tiny) {
    for (const char* k :
         {"model.dim=64", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2",
          "model.expert_hidden=48", "model.n_experts=6", "model.top_k=2", "model.max_seq_len=64",
          "model.dense_every=3", "model.shared_expert_hidden=32", "model.capacity_factor=1.0",
          "train.batch_size=4", "train.seq_len=48", "train.grad_accum=2", "optim.warmup_steps=2"})
      keys.emplace_back(k);
  }
  return load_run_config(tiny ? std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml" : "", keys);
}

// GPU and CPU sum in different orders, and routing near a tie may differ by an ulp; over 20
// AdamW steps the losses stay within 1e-3 relative (the bar), measured well inside it.
void expect_gpu_matches_cpu(bool tiny) {
  std::string why;
  if (!cuda::device_available(&why)) GTEST_SKIP() << why;
  TempDir tmp("cuda_train");
  write_corpus(tmp / "data", 400000);
  const int64_t steps = tiny ? 20 : 10;
  {
    Trainer cpu(run_config(tmp, "cpu", "cpu", tiny, steps), false);
    cpu.run();
  }
  {
    Trainer gpu(run_config(tmp, "gpu", "cuda", tiny, steps), false);
    gpu.run();
  }
  const std::vector<double> lc = metric(tmp / "cpu", "loss"), lg = metric(tmp / "gpu", "loss");
  ASSERT_EQ(lc.size(), static_cast<std::size_t>(steps));
  ASSERT_EQ(lg.size(), lc.size());
  double worst = 0;
  for (std::size_t i = 0; i < lc.size(); ++i) {
    const double rel = std::abs(lg[i] - lc[i]) / std::abs(lc[i]);
    worst = std::max(worst, rel);
    EXPECT_LT(rel, 1e-3) << "step " << i + 1 << ": cpu " << lc[i] << ", gpu " << lg[i];
  }
  const std::vector<double> vc = metric(tmp / "cpu", "val_loss"),
                            vg = metric(tmp / "gpu", "val_loss");
  ASSERT_EQ(vc.size(), 1u);
  ASSERT_EQ(vg.size(), 1u);
  EXPECT_LT(std::abs(vg[0] - vc[0]) / vc[0], 1e-3);
  EXPECT_LT(lg.back(), lg.front());  // it trains
  std::cout << (tiny ? "tiny" : "small") << ": largest relative loss difference over " << steps
            << " steps " << worst << "; final cpu " << lc.back() << " gpu " << lg.back()
            << "; validation cpu " << vc[0] << " gpu " << vg[0] << "\n";
}

// One forward and backward of a model with every block kind, on the CPU then on the GPU, from the
// same parameters and tokens, with GEMM operands in f32 or, with bf16, rounded to bf16 on both
// (the CPU's Transformer::set_precision, the engine's set_gemm): the loss parts and each parameter
// tensor's gradient, each within `tol` of the tensor's largest element.
void expect_one_step_matches(std::initializer_list<const char*> routers, bool bf16, double tol) {
  std::string why;
  if (!cuda::device_available(&why)) GTEST_SKIP() << why;
  for (const char* router : routers) {
    ModelConfig cfg;
    cfg.dim = 64, cfg.n_layers = 3, cfg.n_heads = 4, cfg.n_kv_heads = 2, cfg.expert_hidden = 48;
    cfg.n_experts = 6, cfg.top_k = 2, cfg.max_seq_len = 64, cfg.vocab_size = 256;
    cfg.dense_every = 3, cfg.shared_expert_hidden = 32, cfg.capacity_factor = 1.0f;
    cfg.router = parse_router_setting(router);
    if (cfg.router == RouterKind::ExpertChoice) cfg.capacity_factor = 0.0f;
    cfg.validate();
    Transformer model(cfg);
    const int64_t B = 3, T = 40, N = B * T, n = model.layout().size();
    std::vector<float> params(static_cast<std::size_t>(n));
    init_params(params.data(), model.layout(), cfg, 99);
    std::vector<int32_t> inputs(static_cast<std::size_t>(N)), targets(inputs.size());
    Rng rng(5, 0);
    for (int64_t i = 0; i < N; ++i) {
      inputs[i] = static_cast<int32_t>(rng.below(2 * i, 256));
      targets[i] = i % 7 == 3 ? -1 : static_cast<int32_t>(rng.below(2 * i + 1, 256));
    }
    MoeStep step;
    step.training = true;
    step.seed = 3;
    std::vector<float> gc(params.size(), 0.0f), gg(params.size(), 0.5f);
    if (bf16) model.set_precision(DType::BF16);
    const LossParts pc = model.forward(params.data(), inputs.data(), targets.data(), B, T, step);
    model.backward(params.data(), gc.data(), 0.7f);
    model.set_device("cuda");
    if (bf16) {
      model.device_ops()->set_gemm(DeviceGemm::BF16);
      // The CPU's bf16 precision keeps attention f32; the GPU's would round its operands too, and
      // a hidden state moved by that flips near-tied top-k choices (whole rows of expert
      // gradients). Attention's tensor-core path is held to its own bounds in attention_test.
      model.device_ops()->keep_attention_f32(true);
    }
    const LossParts pg = model.forward(params.data(), inputs.data(), targets.data(), B, T, step);
    model.backward(params.data(), gg.data(), 0.7f);
    for (float& g : gg) g -= 0.5f;  // the engine adds into what the buffer held
    EXPECT_NEAR(pg.ce, pc.ce, (bf16 ? tol : 1e-5) * pc.ce) << router;
    EXPECT_NEAR(pg.aux, pc.aux, 1e-4 * std::max(1.0, pc.aux)) << router;
    EXPECT_NEAR(pg.z, pc.z, 1e-4 * std::max(1.0, pc.z)) << router;
    EXPECT_EQ(pg.targets, pc.targets) << router;
    int bad = 0;
    double worst = 0;
    for (const ParamInfo& p : model.layout().params()) {
      double mx = 0, err = 0;
      for (int64_t i = p.offset; i < p.offset + p.numel; ++i) {
        mx = std::max(mx, std::abs(double(gc[i])));
        err = std::max(err, std::abs(double(gg[i]) - double(gc[i])));
      }
      const bool ok = err <= tol * mx + 1e-7;
      if (mx > 0) worst = std::max(worst, err / mx);
      if (!ok && ++bad <= 12)
        ADD_FAILURE() << router << " " << p.name << ": largest difference " << err
                      << " against largest gradient " << mx;
    }
    std::cout << router << (bf16 ? " bf16" : "") << ": ce cpu " << pc.ce << " gpu " << pg.ce
              << "; aux " << pc.aux << " / " << pg.aux << "; largest difference / largest gradient "
              << worst << "; tensors off: " << bad << "\n";
  }
}

}  // namespace

// Tolerance: a gradient element sums up to N·C-term products through a few layers; 1e-3 of the
// tensor's largest element bounds f32 reordering with a wide margin, while a wrong index or a
// dropped term moves whole tensors by O(1) of it.
TEST(CudaTrain, OneStepLossAndGradientsMatchTheCpu) {
  expect_one_step_matches({"topk_softmax", "sigmoid_bias", "expert_choice", "noisy_topk"}, false,
                          1e-3);
}

// bf16 on both sides rounds the same operands the same way; what differs is the f32 summation
// order, which now and then moves an intermediate across a bf16 rounding boundary: that operand
// then differs by one bf16 step (2^-8 relative) in one term of the sums that read it. A tensor
// stays within 2^-8 of its largest element unless most of its terms flipped, which reordering
// cannot do; a wrong operand (an unrounded or stale weight copy) moves whole tensors.
TEST(CudaTrain, Bf16OneStepMatchesTheCpuBf16) {
  expect_one_step_matches({"topk_softmax", "expert_choice"}, true, 1.0 / 256);
}

TEST(CudaTrain, TinyModelMatchesTheCpuRun) {
  expect_gpu_matches_cpu(true);
}

TEST(CudaTrain, DenseSharedAndCapacityBlocksMatchTheCpuRun) {
  expect_gpu_matches_cpu(false);
}

// TF32 rounds every GEMM operand to a 10-bit significand (2^-11 relative), bf16 to an 8-bit one
// (2^-8). Two trainings whose GEMMs round differently drift apart step by step, so single steps'
// losses are no measure (on an H100, with the fixed corpus a machine without fortunes gets, TF32
// and f32 differed by up to 38% late in 80 steps, where the loss is near 0.2). What is held to
// the f32 run is what a user keeps: the validation loss after training through the warm-up,
// within 1% or 0.01 nats/byte (the resolution the demo's figure is read at), whichever is larger
// (measured there for TF32: 0.0049).
TEST(CudaTrain, Tf32AndBf16ValidationLossStayWithinOnePercentOfF32) {
  std::string why;
  if (!cuda::device_available(&why)) GTEST_SKIP() << why;
  TempDir tmp("cuda_lowp");
  write_corpus(tmp / "data", 400000);
  const int64_t steps = 80;
  {
    Trainer f32(run_config(tmp, "f32", "cuda", true, steps), false);
    f32.run();
  }
  const std::vector<double> a = metric(tmp / "f32", "loss"), va = metric(tmp / "f32", "val_loss");
  ASSERT_EQ(a.size(), static_cast<std::size_t>(steps));
  ASSERT_EQ(va.size(), 1u);
  for (const char* precision : {"tf32", "bf16"}) {
    RunConfig c = run_config(tmp, precision, "cuda", true, steps);
    c.train.precision = parse_precision(precision);
    {
      Trainer t(c, false);
      t.run();
    }
    const std::vector<double> b = metric(tmp / precision, "loss");
    ASSERT_EQ(b.size(), a.size());
    double worst = 0, mean = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      const double rel = std::abs(b[i] - a[i]) / a[i];
      worst = std::max(worst, rel);
      mean += rel / static_cast<double>(a.size());
    }
    const std::vector<double> vb = metric(tmp / precision, "val_loss");
    ASSERT_EQ(vb.size(), 1u);
    const double val_rel = std::abs(vb[0] - va[0]) / va[0];
    EXPECT_LE(std::abs(vb[0] - va[0]), std::max(0.01 * va[0], 0.01))
        << "validation f32 " << va[0] << ", " << precision << " " << vb[0];
    EXPECT_GT(worst, 0.0) << precision << ": the rounding of the operands shows";
    std::cout << precision << " against f32 on the GPU over " << steps
              << " steps: mean relative loss difference " << mean << ", largest " << worst
              << "; validation f32 " << va[0] << ", " << precision << " " << vb[0] << " ("
              << val_rel << ")\n";
  }
}

TEST(CudaTrain, ResumeOnTheGpuIsBitExact) {
  std::string why;
  if (!cuda::device_available(&why)) GTEST_SKIP() << why;
  TempDir tmp("cuda_resume");
  write_corpus(tmp / "data", 200000);
  std::vector<float> straight, resumed;
  {
    Trainer t(run_config(tmp, "straight", "cuda", false, 8), false);
    t.run();
    straight = t.params();
  }
  const RunConfig b = run_config(tmp, "resumed", "cuda", false, 8);
  {
    Trainer t(b, false);
    t.run(4);  // stop half way, as if interrupted
  }
  {
    Trainer t(b, true);
    EXPECT_EQ(t.step(), 4);
    t.run();
    resumed = t.params();
  }
  const std::vector<double> la = metric(tmp / "straight", "loss"),
                            lb = metric(tmp / "resumed", "loss");
  ASSERT_EQ(la.size(), 8u);
  ASSERT_EQ(lb.size(), 8u);
  for (std::size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i], lb[i]) << "step " << i + 1;
  ASSERT_EQ(straight.size(), resumed.size());
  EXPECT_EQ(0, std::memcmp(straight.data(), resumed.data(), straight.size() * sizeof(float)))
      << "parameters differ after resume on the GPU";
}

TEST(CudaTrain, WithoutAUsableGpuTheRunSaysSo) {
  std::string why;
  if (cuda::device_available(&why)) GTEST_SKIP() << "a GPU is usable here";
  TempDir tmp("cuda_none");
  write_corpus(tmp / "data", 60000);
  expect_error([&] { Trainer t(run_config(tmp, "run", "cuda", false, 2), false); },
               "train.device = \"cuda\": no");
}

TEST(CudaTrain, WhatTheEngineDoesNotRunIsRefusedByName) {
  auto check = [&](std::vector<std::string> keys) {
    return [keys] { load_run_config("", keys).validate(); };
  };
  expect_error(check({"train.device=cuda", "train.precision=fp16"}), "train.precision = fp16");
  expect_error(check({"train.device=cuda", "dist.ep=2", "model.n_experts=8"}), "one process");
  expect_error(check({"train.device=tpu"}), "allowed are cpu, cuda");
  expect_error(check({"train.precision=tf32"}), "needs train.device = cuda");
}
