// Mixed-precision training end to end on real text: bf16 and fp16 runs track the f32 run, resume
// bit-exactly (fp16 with its loss scale), and an fp16 overflow skips the step and backs off;
// precision = "auto" resolves by instruction set, is recorded, and is kept on resume.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "support/corpus.h"
#include "support/expect_error.h"
#include "support/temp_dir.h"
#include "train/precision.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

RunConfig run_config(const TempDir& tmp, const std::string& precision,
                     std::vector<std::string> extra = {}) {
  write_corpus(tmp / "data", 60000);
  std::vector<std::string> o = {
      "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
      "model.expert_hidden=32", "model.n_experts=4", "model.top_k=2", "model.max_seq_len=32",
      "train.batch_size=4", "train.seq_len=32", "train.steps=8", "train.grad_accum=2",
      "train.eval_every=0", "train.eval_batches=4", "train.progress=off",
      // One thread: these runs check numbers, not speed, and a
      // single thread keeps them fast on a busy machine.
      "train.threads=1", "train.precision=" + precision, "optim.warmup_steps=2",
      "data.dir=" + (tmp / "data").string(), "train.run_dir=" + (tmp / "run").string()};
  o.insert(o.end(), extra.begin(), extra.end());
  return load_run_config("", o);
}

std::vector<nlohmann::json> step_lines(const fs::path& run_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(j);
  }
  return out;
}

void expect_bitwise_resume(const std::string& precision, std::vector<std::string> extra = {}) {
  TempDir straight_dir("straight"), resumed_dir("resumed");
  RunConfig a = run_config(straight_dir, precision, extra);
  std::vector<float> straight;
  double straight_scale = 0;
  {
    Trainer t(a, false);
    t.run();
    straight = t.params();
    if (t.loss_scaler()) straight_scale = t.loss_scaler()->raw_scale();
  }
  RunConfig b = run_config(resumed_dir, precision, extra);
  {
    Trainer t(b, false);
    t.run(4);
  }
  std::vector<float> resumed;
  {
    Trainer t(b, true);
    EXPECT_EQ(t.step(), 4);
    t.run();
    resumed = t.params();
    if (t.loss_scaler()) {
      EXPECT_EQ(t.loss_scaler()->raw_scale(), straight_scale);
    }
  }
  auto la = step_lines(a.train.run_dir), lb = step_lines(b.train.run_dir);
  ASSERT_EQ(la.size(), 8u);
  ASSERT_EQ(lb.size(), 8u);
  for (size_t i = 0; i < la.size(); ++i) {
    EXPECT_EQ(la[i]["loss"].get<double>(), lb[i]["loss"].get<double>()) << "step " << i + 1;
    if (la[i].contains("loss_scale")) {
      EXPECT_EQ(la[i]["loss_scale"].get<double>(), lb[i]["loss_scale"].get<double>());
    }
  }
  EXPECT_EQ(0, std::memcmp(straight.data(), resumed.data(), straight.size() * sizeof(float)))
      << precision << ": parameters differ after resume";
}

}  // namespace

TEST(PrecisionTrainer, Bf16ResumeIsBitExact) {
  expect_bitwise_resume("bf16");
}

TEST(PrecisionTrainer, Fp16ResumeIsBitExactAndRestoresTheLossScale) {
  // The scale grows every 3 good steps, so it differs at the step-4 checkpoint from its start.
  expect_bitwise_resume("fp16",
                        {"train.loss_scale_init=256", "train.loss_scale_growth_interval=3"});
}

TEST(PrecisionTrainer, Fp16OverflowSkipsTheStepAndHalvesTheScale) {
  TempDir tmp("overflow");
  // 2^28 times the loss gradient overflows fp16 (max 65504) in the first backward GEMMs: real
  // overflow, no injection hook. Each skipped step halves the scale until it fits (about 2^21
  // for this model).
  RunConfig cfg = run_config(tmp, "fp16", {"train.loss_scale_init=268435456", "train.steps=16"});
  Trainer t(cfg, false);
  const std::vector<float> before = t.params();
  t.run(1);
  EXPECT_EQ(0, std::memcmp(before.data(), t.params().data(), before.size() * sizeof(float)))
      << "a skipped step changed the parameters";
  EXPECT_EQ(t.loss_scaler()->raw_scale(), std::ldexp(1.0, 27));
  EXPECT_EQ(t.loss_scaler()->skipped_steps(), 1);
  t.run();
  const auto lines = step_lines(cfg.train.run_dir);
  ASSERT_EQ(lines.size(), 16u);
  int skipped = 0;
  double scale = std::ldexp(1.0, 28);
  for (const auto& l : lines) {
    EXPECT_EQ(l["loss_scale"].get<double>(), scale);
    if (l["skipped"].get<bool>()) {
      ++skipped;
      scale /= 2;
    }
  }
  EXPECT_GE(skipped, 2);
  EXPECT_LT(skipped, 16) << "the scale never came down to a usable value";
  std::printf("%d steps skipped; final scale %g\n", skipped, scale);
  EXPECT_FALSE(lines.back()["skipped"].get<bool>());
  EXPECT_NE(0, std::memcmp(before.data(), t.params().data(), before.size() * sizeof(float)));
}

TEST(PrecisionTrainer, LowPrecisionTrainingTracksF32) {
  // 120 steps of the small model: the validation loss of bf16 and fp16 runs within 2% of f32's.
  std::vector<std::string> longer = {"train.steps=120", "optim.warmup_steps=10"};
  double val[3];
  const char* names[3] = {"f32", "bf16", "fp16"};
  for (int i = 0; i < 3; ++i) {
    TempDir tmp(names[i]);
    Trainer t(run_config(tmp, names[i], longer), false);
    val[i] = t.run().val_loss;
  }
  std::printf("validation loss f32 %.4f bf16 %.4f fp16 %.4f\n", val[0], val[1], val[2]);
  EXPECT_LT(val[0], 3.0);  // it learned something (the byte unigram baseline is about 3)
  EXPECT_NEAR(val[1], val[0], 0.02 * val[0]) << "bf16";
  EXPECT_NEAR(val[2], val[0], 0.02 * val[0]) << "fp16";
  EXPECT_NE(val[1], val[0]);
}

TEST(PrecisionTrainer, BadPrecisionSettingsNameTheKey) {
  TempDir tmp("bad");
  expect_error([&] { run_config(tmp, "fp8"); },
               "train.precision = 'fp8': allowed are auto, f32, bf16, fp16");
  expect_error([&] { run_config(tmp, "fp16", {"train.loss_scale_backoff_factor=2"}); },
               "train.loss_scale_backoff_factor = 2");
  expect_error([&] { run_config(tmp, "f32", {"dist.grad_reduce_dtype=fp16"}); },
               "dist.grad_reduce_dtype = 'fp16': allowed are f32, bf16");
  expect_error([&] { run_config(tmp, "f32", {"dist.a2a_dtype=int8"}); }, "dist.a2a_dtype = 'int8'");
  // Settings that do not change the computation leave the hash alone.
  RunConfig a = run_config(tmp, "f32"), b = run_config(tmp, "f32", {"train.loss_scale_init=8"});
  EXPECT_EQ(a.config_hash(), b.config_hash());
  EXPECT_NE(a.config_hash(), run_config(tmp, "bf16").config_hash());
}

TEST(PrecisionTrainer, AutoResolvesByTheInstructionSet) {
  // oneDNN's names (dnnl::cpu_isa): a native bf16 matmul from AVX512_BF16 on.
  for (const char* isa : {"avx512_core_bf16", "avx512_core_amx"}) {
    EXPECT_TRUE(has_native_bf16(isa)) << isa;
    EXPECT_EQ(resolve_auto("cpu", isa), Precision::BF16) << isa;
  }
  for (const char* isa : {"sse41", "avx", "avx2", "avx512_core", "avx512_core_vnni", "unknown"}) {
    EXPECT_FALSE(has_native_bf16(isa)) << isa;
    EXPECT_EQ(resolve_auto("cpu", isa), Precision::F32) << isa;
  }
  // A GPU's tensor cores multiply bf16 whatever the host CPU.
  EXPECT_EQ(resolve_auto("cuda", "avx2"), Precision::BF16);
  // Explicit settings are never overridden, and the typed value gives the GEMM types.
  TempDir tmp("explicit");
  for (const char* p : {"f32", "bf16", "fp16"}) {
    const RunConfig c = run_config(tmp, p);
    EXPECT_STREQ(precision_name(c.train.precision), p);
    EXPECT_FALSE(c.train.precision_was_auto);
    EXPECT_EQ(dtype_name(c.train.precision_dtype()), p);
  }
  EXPECT_EQ(device_gemm(Precision::TF32), DeviceGemm::TF32);
  EXPECT_EQ(device_gemm(Precision::BF16), DeviceGemm::BF16);
  EXPECT_EQ(device_gemm(Precision::F32), DeviceGemm::F32);
  EXPECT_EQ(gemm_dtype(Precision::TF32), DType::F32);
}

TEST(PrecisionTrainer, AutoTrainsAndRecordsWhatItResolvedTo) {
  TempDir tmp("auto");
  RunConfig cfg = run_config(tmp, "auto");
  // Resolved when the configuration loaded, once, and known to have been auto.
  EXPECT_TRUE(cfg.train.precision_was_auto);
  const std::string resolved = precision_name(resolve_auto("cpu", onednn_cpu_isa()));
  EXPECT_EQ(precision_name(cfg.train.precision), resolved);
  std::printf("oneDNN ISA %s: auto is %s\n", onednn_cpu_isa().c_str(), resolved.c_str());
  {
    Trainer t(cfg, false);
    EXPECT_EQ(t.model().precision(), cfg.train.precision_dtype());
    EXPECT_TRUE(std::isfinite(t.run().val_loss));
  }
  std::ifstream in(fs::path(cfg.train.run_dir) / "run_config.json");
  const nlohmann::json run = nlohmann::json::parse(in);
  EXPECT_EQ(run["train"]["precision"], resolved);
  const auto ckpt = find_latest_checkpoint(cfg.train.run_dir);
  ASSERT_TRUE(ckpt);
  EXPECT_EQ(read_checkpoint_json(*ckpt, "config.json")["moetrain"]["train"]["precision"], resolved);
  EXPECT_EQ(read_checkpoint_json(*ckpt, "trainer_state.json")["precision"], resolved);
}

TEST(PrecisionTrainer, AutoResumeKeepsThePrecisionTheRunUsed) {
  // Whatever this machine would pick, a run resumed with "auto" goes on in the precision its
  // checkpoint records: as on a machine whose instruction set resolves differently.
  for (const char* used : {"f32", "bf16"}) {
    TempDir tmp(used);
    {
      Trainer t(run_config(tmp, used), false);
      t.run(4);
    }
    Trainer t(run_config(tmp, "auto"), true);
    EXPECT_EQ(t.step(), 4);
    EXPECT_EQ(dtype_name(t.model().precision()), used);
    t.run();
    std::ifstream in(tmp / "run" / "run_config.json");
    EXPECT_EQ(nlohmann::json::parse(in)["train"]["precision"], used);
  }
}
