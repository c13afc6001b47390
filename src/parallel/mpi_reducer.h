// The MPI GradReducer: GradSync's bucketed reduce-scatter, plain data parallelism (the reduced
// gradients gathered back into the flat buffer, the whole optimizer step) or ZeRO-1 (the step on
// this rank's shard only, then the parameters all-gathered).
#pragma once
#include <memory>

#include "parallel/reducer.h"
#include "parallel/comm_thread.h"
#include "parallel/grad_sync.h"

namespace moetrain {

class MpiGradReducer final : public GradReducer {
 public:
  // overlap: the thread that reduces buckets during backward (null: reduce after backward).
  // zero1: ZeRO-1 (the optimizer holds state for this rank's shard only).
  MpiGradReducer(std::unique_ptr<GradSync> sync, CommThread* overlap, bool zero1);

  void begin(float* grads) override;
  // The model's grads-ready hook: gradients at offsets ≥ from are final.
  void ready(int64_t from) { sync_->ready(from); }
  GradientShard& reduce(float* grads) override;
  void prepare_step(float* grads) override;
  void finish_step(float* params) override;
  bool gathers_params() const override { return zero1_; }
  double inline_seconds() const override { return inline_s_; }
  std::vector<float>* carried() override {
    return sync_->residual().empty() ? nullptr : &sync_->residual();
  }
  const char* carried_kind() const override {
    return sync_->sparse().enabled() ? "sparse_ratio" : "";
  }
  void set_active_experts(std::span<const uint8_t> active) override {
    sync_->set_active_experts(active);
  }
  int64_t bytes_skipped() const override { return sync_->bytes_skipped(); }
  SparseReduceFigures sparse_figures() const override {
    const SparseBuckets& s = sync_->sparse();
    return {s.bytes(), s.values(), s.entries_sent(), s.contributions()};
  }
  int64_t bytes_sent() const override { return sync_->bytes_sent(); }

  const GradSync& sync() const { return *sync_; }

 private:
  std::unique_ptr<GradSync> sync_;
  CommThread* overlap_;
  bool zero1_;
  double inline_s_ = 0;
};

}  // namespace moetrain
