// ZeRO-2 (dist.zero = 2): GradSync's bucketed reduce-scatter into this rank's shard, with no whole
// gradient kept. Once a bucket's reduce-scatter has completed, its range of the flat gradient
// buffer is cleared (core/page_buffer.h: the whole pages inside it go back to the system, the
// partial pages at its edges are set to zero), so only the buckets backward is still filling or
// reducing are resident. The optimizer steps on the shard itself (piece_grads: each optimizer
// piece's gradients where they sit in the shard); the parameters are then all-gathered as under
// ZeRO-1. With A = 1 the sums, their order and so the bits are ZeRO-1's.
//
// Gradient accumulation (A > 1 micro-batches): every micro-batch's buckets are reduce-scattered
// as its backward finishes them, each reduced chunk summed into an f32 accumulator of the shard's
// size, and the bucket cleared, so the next backward writes into zeroed memory and no whole
// gradient stays resident between micro-batches. The last micro-batch's chunks are summed with
// the accumulator into the shard. The reduction traffic is A times that of one reduction.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/page_buffer.h"
#include "optim/sharded_optimizer.h"
#include "parallel/comm_thread.h"
#include "parallel/grad_sync.h"
#include "parallel/reducer.h"

namespace moetrain {

class Zero2Reducer final : public GradReducer {
 public:
  // grads: the flat gradient buffer every call's `grads` points into; outlives this object.
  // overlap: the thread that reduces buckets during backward (null: after each backward).
  // sharded_params (ZeRO-3, parallel/zero3_params.h): the parameters are not gathered after the
  // step; the model's units gather them where they are used.
  Zero2Reducer(std::unique_ptr<GradSync> sync, CommThread* overlap, PageBuffer& grads,
               bool sharded_params = false);

  // The optimizer's pieces (this rank's shard, as runs contiguous in both the flat buffer and
  // the shard), in piece_grads() order.
  const std::vector<OptimPiece>& pieces() const { return pieces_; }

  void begin(float* grads) override;
  // The model's grads-ready hook: gradients at offsets ≥ from are final.
  void ready(int64_t from) { sync_->ready(from); }
  GradientShard& reduce(float* grads) override;
  bool reduces_each_micro_batch() const override { return true; }
  void begin_micro_batch(float* grads, int64_t micro) override;
  void end_micro_batch(float* grads) override;
  std::span<const float* const> piece_grads() const override { return piece_grads_; }
  void finish_step(float* params) override;
  bool gathers_params() const override { return true; }
  double inline_seconds() const override { return inline_s_; }
  int64_t bytes_sent() const override { return sync_->bytes_sent(); }
  // Bytes of gradient pages handed back to the system so far.
  int64_t bytes_released() const { return released_; }

  GradSync& sync() { return *sync_; }
  const GradSync& sync() const { return *sync_; }

 private:
  // What a completed bucket's chunk does with the accumulator.
  enum class Fold { None, Start, Add, Finish };
  void bucket_done(std::size_t i);
  void run(float* grads);  // the reduction of one backward, when not overlapped

  std::unique_ptr<GradSync> sync_;
  CommThread* overlap_;
  PageBuffer& grads_;
  bool sharded_params_;
  std::vector<std::vector<FlatRange>> ranges_;  // (buckets) their flat ranges, joined
  std::vector<OptimPiece> pieces_;
  std::vector<const float*> piece_grads_;
  std::vector<float> acc_;   // (shard) the earlier micro-batches' reduced chunks, summed
  int64_t accumulated_ = 0;  // micro-batches in acc_ this step
  Fold fold_ = Fold::None;
  double inline_s_ = 0;
  int64_t released_ = 0;
};

}  // namespace moetrain
