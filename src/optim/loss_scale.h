// Dynamic loss scaling for fp16 training. fp16 gradients underflow below 2^-24 and overflow above
// 65504: the loss (hence every gradient) is multiplied by a scale S before backward, and the f32
// gradients are divided by S before the optimizer sees them. A step whose gradients hold an Inf
// or NaN is skipped and S shrinks (backoff factor); after `growth_interval` good steps in a row S
// grows (growth factor), so it settles just under the overflow threshold.
#pragma once
#include <cstdint>

namespace moetrain {

struct LossScaleConfig {
  double init = 65536.0;  // 2^16
  int64_t growth_interval = 2000;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  double min_scale = 1.0;         // never backs off below this
  double max_scale = 16777216.0;  // 2^24: never grows above this

  // Throws naming the field ("train.loss_scale_growth_factor = 1: must be > 1").
  void validate() const;
};

class LossScaler {
 public:
  explicit LossScaler(const LossScaleConfig& cfg);

  float scale() const { return static_cast<float>(scale_); }
  // After a step's gradients are known: found_non_finite says whether any (on any process) is
  // Inf or NaN. Returns whether the step may be applied; updates the scale.
  bool update(bool found_non_finite);

  int64_t good_steps() const { return good_steps_; }  // good steps since the last change
  int64_t skipped_steps() const { return skipped_; }  // steps skipped over the whole run
  // For checkpoints: the state that update() evolves.
  void restore(double scale, int64_t good_steps, int64_t skipped);
  double raw_scale() const { return scale_; }

 private:
  LossScaleConfig cfg_;
  double scale_;
  int64_t good_steps_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace moetrain
