// Test support: the settings of a small LM run (2 layers of dim 32, 4 experts of hidden 32, top-2,
// batch 4 × 32 tokens, 8 steps, no evaluation, checkpoints or progress bar) over TMP/data into
// TMP/run, as `--set` strings; a test appends what it is about.
#pragma once
#include <string>
#include <vector>

#include "support/temp_dir.h"

namespace moetrain::testing {

inline std::vector<std::string> small_run_keys(const TempDir& tmp) {
  return {"model.dim=32",
          "model.n_layers=2",
          "model.n_heads=4",
          "model.n_kv_heads=2",
          "model.expert_hidden=32",
          "model.n_experts=4",
          "model.top_k=2",
          "model.max_seq_len=32",
          "train.batch_size=4",
          "train.seq_len=32",
          "train.steps=8",
          "train.eval_every=0",
          "train.checkpoint_every=0",
          "train.progress=off",
          "optim.warmup_steps=2",
          "data.dir=" + (tmp / "data").string(),
          "train.run_dir=" + (tmp / "run").string()};
}

}  // namespace moetrain::testing
