// Test support for the tensor-parallel tests (tests/parallel/tensor_parallel*_test.cpp): the small
// MoE LM they train with dist.tp = 2 and against the run without it.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "train/run_config.h"

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

}  // namespace moetrain::testing
