// The check before every optimizer step, taken after the gradients are complete (and reduced,
// when several processes hold them):
//
//   non-finite check → (fp16) loss-scaler decision → unscale → expert reweighting → global norm
//   → clip
//
// then, unless the step is skipped, the caller steps its optimizer: the update reads top to
// bottom (train/step_engine.cpp: reduce → check_and_clip → step → finish).
//
// The gradient is seen through GradientShard: the elements this process is responsible for
// (all of them on one process; its shard of the reduced gradient under data parallelism). The
// check and the norm are this process's part summed over `comm` — every element of the global
// gradient lies in exactly one process's part — so every process takes the same decision and
// clips by the same factor. With a local communicator the sums are the process's own values.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/comm.h"
#include "optim/loss_scale.h"

namespace moetrain {

// Elements [offset, offset + size) of the flat gradient, and a factor for them.
struct WeightedRange {
  int64_t offset = 0, size = 0;
  float factor = 1;
};

// abs_sum += Σ|g|, sq_sum += Σg² over g (n), in double, in order.
void add_range_sums(const float* g, int64_t n, double& abs_sum, double& sq_sum);

class ExpertReweighter;

class GradientShard {
 public:
  virtual ~GradientShard() = default;
  // Whether this process's part holds a NaN or an Inf.
  virtual bool has_non_finite() const = 0;
  // Σ g² over this process's part, with the fixed blocking of optim/clip.h.
  virtual double sum_squares() const = 0;
  // This process's part (and every copy of it the optimizer reads) *= factor.
  virtual void scale(float factor) = 0;
  // For each range r (flat offsets, disjoint, sorted by offset): abs_sum[r] += Σ|g| and
  // sq_sum[r] += Σg² over the elements of this process's part within it, in a fixed order.
  virtual void range_sums(const std::vector<WeightedRange>& ranges, double* abs_sum,
                          double* sq_sum) const = 0;
  // Elements of each range (disjoint, sorted by offset) *= its factor, in this process's part
  // and every copy of it the optimizer reads.
  virtual void scale_ranges(const std::vector<WeightedRange>& ranges) = 0;
};

// Elements [first, first + n) of the flat gradient in one buffer at g, all of them this
// process's: the whole gradient (first = 0), or a parameter server's key range. Range figures
// and factors apply to the part of each range the buffer holds.
class FlatGradient final : public GradientShard {
 public:
  FlatGradient(float* g, int64_t n, int64_t first = 0) : g_(g), n_(n), first_(first) {}
  bool has_non_finite() const override;
  double sum_squares() const override;
  void scale(float factor) override;
  void range_sums(const std::vector<WeightedRange>& ranges, double* abs_sum,
                  double* sq_sum) const override;
  void scale_ranges(const std::vector<WeightedRange>& ranges) override;

 private:
  // The part of r this buffer holds, as [lo, hi) flat offsets (empty: lo ≥ hi).
  std::pair<int64_t, int64_t> held(const WeightedRange& r) const {
    return {std::max(r.offset, first_), std::min(r.offset + r.size, first_ + n_)};
  }
  float* g_;
  int64_t n_, first_;
};

struct UpdateOptions {
  double grad_clip = 0;           // clip to this global L2 norm; ≤ 0: no clipping
  // Multiplies each expert's unscaled gradient by its factor before the norm and the clip.
  ExpertReweighter* reweight = nullptr;
  LossScaler* scaler = nullptr;   // fp16: the gradients are scaled by scaler->scale()
  // Names the step in errors: "step 12", "clock 7 on server 1".
  std::string where;
  // Appended to the non-finite error: what the user can do, where the good state is.
  std::string advice;
};

struct UpdateOutcome {
  bool skipped = false;    // fp16 overflow: no step was taken, the scale backed off
  double grad_norm = 0;    // global norm after unscaling and reweighting, before clipping
  double loss_scale = 1;   // the scale the gradients carried
  double clip_coef = 1;    // the factor clipping applied
};

// Collective over `comm`. Runs the sequence above; the caller then takes the optimizer step on
// the unscaled, clipped gradients unless the outcome says it is skipped. Without a scaler a
// non-finite gradient is an Error naming opts.where and the number of processes that saw one.
UpdateOutcome check_and_clip(GradientShard& grads, Comm& comm, const UpdateOptions& opts);

}  // namespace moetrain
