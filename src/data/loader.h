// Batches of (input, target) windows from a token shard: training windows shuffled per epoch,
// evaluation windows in order. The shard must outlive the loaders.
#pragma once
#include <cstdint>

#include "data/epoch_sampler.h"
#include "data/shard.h"

namespace moetrain {

// The training windows of a shard, in epoch order. Window w holds tokens [w·T, w·T + T] (inputs
// and the next-token targets), w in [0, N), N = (tokens − 1) / T: every token after the first is
// the target of exactly one window (the evaluation windows' rule, below). Epoch e visits the N
// windows in a permutation drawn from (seed, e) alone; the epochs are laid end to end into one
// stream (data/epoch_sampler.h), whose position p is window perm_{p / N}[p mod N].
class WindowStream {
 public:
  WindowStream(const TokenShard& shard, int64_t T, uint64_t seed);
  // N for a shard and T (≥ 1 when the shard holds T+1 tokens).
  static int64_t windows_in(const TokenShard& shard, int64_t T);

  int64_t windows_per_epoch() const { return sampler_.size(); }
  int64_t epoch_of(int64_t position) const { return position / sampler_.size(); }
  int64_t window(int64_t position) { return sampler_.at(position); }
  uint64_t window_start(int64_t position) {
    return static_cast<uint64_t>(window(position)) * static_cast<uint64_t>(T_);
  }
  // inputs: T tokens [start, start+T); targets: T tokens [start+1, start+T+1).
  void read(int64_t position, int32_t* inputs, int32_t* targets);
  int64_t seq_len() const { return T_; }

 private:
  const TokenShard* shard_;
  int64_t T_;
  EpochSampler sampler_;
};

// The stream position of row `row` (0 ≤ row < rows) of micro-batch `micro` (0 ≤ micro <
// micro_batches) of step `step`, for a global batch of `micro_batches` micro-batches of `rows`
// rows: (step · micro_batches + micro) · rows + row. Step s takes positions [s·G, (s+1)·G),
// G = rows · micro_batches, so the position after step s is (s+1)·G: the step counter and the
// global batch a checkpoint records say where the data stands.
int64_t stream_position(int64_t step, int64_t micro, int64_t row, int64_t rows,
                        int64_t micro_batches);

// One rank's training batches. `world` ranks of B rows each make a micro-batch of world·B rows,
// and `micro_batches` of those a step: the global batch is G = micro_batches · world · B windows.
// Row b of micro-batch `micro` on `rank` is the window at stream_position(step, micro,
// rank·B + b, world·B, micro_batches) — a function of (seed, shard size, T, G, and the row's
// index in the global batch) alone. So every split of the same global batch sees the same windows
// at a step: world W with B rows each, one rank with W·B rows, and one rank with W micro-batches
// of B rows; and the ranks of a step take disjoint windows, an epoch's N windows exactly once
// between them, in steps of G (a step at an epoch's end takes the epoch's last windows and the
// next epoch's first). A run resumed at step s reads exactly the windows it would have read.
class BatchLoader {
 public:
  BatchLoader(const TokenShard& shard, int64_t B, int64_t T, uint64_t seed, int rank = 0,
              int world = 1, int64_t micro_batches = 1);

  int64_t position(int64_t step, int64_t micro, int64_t b) const;
  uint64_t window_start(int64_t step, int64_t micro, int64_t b) {
    return stream_.window_start(position(step, micro, b));
  }
  // inputs: (B, T) tokens [start, start+T); targets: (B, T) tokens [start+1, start+T+1).
  void fill(int64_t step, int64_t micro, int32_t* inputs, int32_t* targets);

  int64_t batch() const { return B_; }
  int64_t seq_len() const { return stream_.seq_len(); }
  int64_t micro_batches() const { return micro_batches_; }
  int64_t global_batch() const { return micro_batches_ * world_ * B_; }
  WindowStream& stream() { return stream_; }

 private:
  WindowStream stream_;
  int64_t B_;
  int rank_, world_;
  int64_t micro_batches_;
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
