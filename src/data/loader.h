// Batches of (input, target) windows from a token shard. The shard must outlive the loaders.
#pragma once
#include <cstdint>

#include "data/shard.h"

namespace moetrain {

// Random training windows. Row b of micro-batch `micro` at `step` on `rank` starts at
//   Rng(seed, rng_stream(Data, step, 0)).below(((micro · world + rank) · B + b), size − T)
// — a pure function of (seed, step, micro, rank, b): a run resumed at step s draws exactly the
// windows it would have drawn, whatever happened before. Because the index only enumerates the
// rows of the step's global batch, any split of those rows gives the same windows: world W with B
// rows each, one rank with W·B rows, and one rank with W micro-batches of B rows all see the same
// W·B windows at a step.
class BatchLoader {
 public:
  BatchLoader(const TokenShard& shard, int64_t B, int64_t T, uint64_t seed, int rank = 0,
              int world = 1);

  uint64_t window_start(int64_t step, int64_t micro, int64_t b) const;
  // inputs: (B, T) tokens [start, start+T); targets: (B, T) tokens [start+1, start+T+1).
  void fill(int64_t step, int64_t micro, int32_t* inputs, int32_t* targets) const;

  int64_t batch() const { return B_; }
  int64_t seq_len() const { return T_; }

 private:
  const TokenShard* shard_;
  int64_t B_, T_;
  uint64_t seed_;
  int rank_, world_;
};

// Sequential, non-overlapping evaluation windows: window w holds tokens [w·T, w·T + T] (inputs and
// the next-token targets), for a validation loss that is the same on every run. Global batch i
// holds windows [i·W·B, (i+1)·W·B) and rank r takes the r-th group of B of them, so the ranks
// together cover every window exactly once. The last batch may be partial (or empty on some
// ranks); every rank sees the same num_batches() so collective code stays in step.
class EvalLoader {
 public:
  // max_batches > 0 caps the global batches (and so the windows) used; 0 uses all.
  EvalLoader(const TokenShard& shard, int64_t B, int64_t T, int64_t max_batches = 0, int rank = 0,
             int world = 1);

  int64_t num_windows() const { return windows_; }  // used, over all ranks
  int64_t num_batches() const { return batches_; }
  // Fills this rank's rows of batch i and returns how many (0..B); rows past that are zeroed.
  // inputs, targets: (B, T)
  int64_t fill(int64_t i, int32_t* inputs, int32_t* targets) const;

 private:
  const TokenShard* shard_;
  int64_t B_, T_;
  int rank_, world_;
  int64_t windows_ = 0;
  int64_t batches_ = 0;
};

}  // namespace moetrain
