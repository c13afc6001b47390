// Test support for the tensor-parallel tests (tests/parallel/tensor_parallel*_test.cpp): the small
// MoE LM they train with dist.tp = 2 and against the run without it, and the comparison of the
// two runs' figures.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/comm.h"
#include "support/held_values.h"
#include "support/run_metrics.h"
#include "support/temp_dir.h"
#include "train/lm_checkpoint.h"
#include "train/run_config.h"
#include "train/trainer.h"

namespace moetrain::testing {

// Rows a copy takes a step, steps a run, tensor-parallel ranks a copy.
inline constexpr int64_t kTpRows = 2, kTpSteps = 20, kTp = 2;

// 3 blocks (the last a dense SwiGLU FFN: dense_every 3), 4 heads over 2 key-value heads, 4
// experts top-2 with a shared expert, a vocabulary of 256; validation and checkpoints every 10
// steps, f32, clipped at 0.5, small gradient buckets (several a step).
inline RunConfig tp_config(const std::filesystem::path& data, const std::filesystem::path& run,
                           int64_t rows, int64_t tp, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> keys = {"model.dim=32",
                                   "model.n_layers=3",
                                   "model.n_heads=4",
                                   "model.n_kv_heads=2",
                                   "model.expert_hidden=24",
                                   "model.n_experts=4",
                                   "model.top_k=2",
                                   "model.shared_expert_hidden=16",
                                   "model.dense_every=3",
                                   "model.max_seq_len=16",
                                   "train.batch_size=" + std::to_string(rows),
                                   "train.seq_len=16",
                                   "train.steps=" + std::to_string(kTpSteps),
                                   "train.eval_every=10",
                                   "train.eval_batches=2",
                                   "train.checkpoint_every=10",
                                   "train.keep_checkpoints=3",
                                   "train.progress=off",
                                   "train.precision=f32",
                                   "optim.warmup_steps=3",
                                   "optim.grad_clip=0.5",
                                   "dist.bucket_first_mb=0.01",
                                   "dist.bucket_mb=0.05",
                                   "data.dir=" + data.string(),
                                   "train.run_dir=" + run.string(),
                                   "dist.tp=" + std::to_string(tp)};
  keys.insert(keys.end(), extra.begin(), extra.end());
  return load_run_config("", keys);
}

// A finished run's figures: every rank's parameters and which of them it holds (held_values);
// rank 0's per-step losses, validation losses and gradient norms from the run's metrics.
struct TpFigures {
  std::vector<float> params;
  std::vector<char> held;
  std::vector<double> losses, val_losses, grad_norms;  // rank 0 only
};
inline TpFigures tp_figures(Trainer& t, const std::filesystem::path& run) {
  TpFigures f{t.params(), held_values(t), {}, {}, {}};
  if (t.rank() == 0) {
    f.losses = metric(run, "loss"), f.val_losses = metric(run, "val_loss");
    f.grad_norms = metric(run, "grad_norm");
  }
  return f;
}

// Relative bounds on the losses (and validation losses), the gradient norms and the held
// parameters (of the largest): the reordered sums of the shares (tensor_parallel_test.cpp)
// unless a test argues others.
struct TpBounds {
  double loss = 1e-5, norm = 1e-4, param = 1e-4;
};

// `got` against `ref` within `b`, printing how far each is: on rank 0 every step's loss, gradient
// norm and validation loss (the run learns: its last loss below its first), on every rank the
// values it holds.
inline void expect_tp_follows(const std::string& name, int rank, const TpFigures& got,
                              const TpFigures& ref, const TpBounds& b = {}) {
  SCOPED_TRACE(name);
  if (rank == 0) {
    EXPECT_EQ(got.losses.size(), static_cast<std::size_t>(kTpSteps));
    EXPECT_EQ(ref.losses.size(), got.losses.size());
    EXPECT_EQ(ref.grad_norms.size(), got.grad_norms.size());
    EXPECT_EQ(ref.val_losses.size(), got.val_losses.size());
    EXPECT_LE(max_rel(got.losses, ref.losses), b.loss);
    EXPECT_LE(max_rel(got.grad_norms, ref.grad_norms), b.norm);
    EXPECT_LE(max_rel(got.val_losses, ref.val_losses), b.loss);
    if (!got.losses.empty()) {
      EXPECT_LT(got.losses.back(), got.losses.front());
    }
    std::printf("%s: losses %.3g, norms %.3g, validation losses %.3g off the reference\n",
                name.c_str(), max_rel(got.losses, ref.losses),
                max_rel(got.grad_norms, ref.grad_norms), max_rel(got.val_losses, ref.val_losses));
  }
  ASSERT_EQ(got.params.size(), ref.params.size());
  const double d = max_rel_diff_held(got.params, ref.params, got.held);
  EXPECT_LE(d, b.param);
  if (rank == 0) std::printf("%s: parameters %.3g of the largest off\n", name.c_str(), d);
}

// The checkpoint in `run` holds the whole model at the last step (the same safetensors as any
// layout's): every rank finds the values it holds there, bit for bit.
inline void expect_checkpoint_holds(const std::filesystem::path& run, const TpFigures& got) {
  LoadedModel m = load_model(run);
  EXPECT_EQ(m.step, kTpSteps);
  EXPECT_EQ(m.params.size(), got.params.size());
  int64_t differ = 0;
  for (std::size_t i = 0; i < std::min(m.params.size(), got.params.size()); ++i)
    differ += got.held[i] && m.params[i] != got.params[i];
  EXPECT_EQ(differ, 0) << "checkpointed parameters differ from their holder's";
}

// The step-10 checkpoint of the run in `whole` resumed by one process, the same global batch as
// `micro_batches` micro-batches of kTpRows: it starts from the checkpoint's parameters, bit for
// bit, and trains on to the last step.
inline void expect_one_process_resumes_step10(const std::filesystem::path& data,
                                              const std::filesystem::path& whole,
                                              int64_t micro_batches) {
  namespace fs = std::filesystem;
  TempDir back("tp_back");
  fs::create_directories(back.path() / "checkpoints");
  fs::copy(whole / "checkpoints/step_00000010", back.path() / "checkpoints/step_00000010");
  std::ofstream(back.path() / "checkpoints/latest") << "step_00000010";
  fs::copy_file(whole / "metrics.jsonl", back.path() / "metrics.jsonl");
  Trainer one(tp_config(data, back.path(), kTpRows, 1,
                        {"train.grad_accum=" + std::to_string(micro_batches)}),
              true, make_local_comm());
  EXPECT_EQ(one.step(), 10);
  LoadedModel at10 = load_model(whole / "checkpoints/step_00000010");
  ASSERT_EQ(at10.params.size(), one.params().size());
  EXPECT_EQ(0, std::memcmp(one.params().data(), at10.params.data(),
                           at10.params.size() * sizeof(float)));
  one.run();
  EXPECT_EQ(one.step(), kTpSteps);
}

}  // namespace moetrain::testing
