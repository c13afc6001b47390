#include "optim/loss_scale.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

namespace moetrain {

void LossScaleConfig::validate() const {
  MOETRAIN_CHECK(std::isfinite(init) && init > 0,
                 "train.loss_scale_init = {}: must be a positive finite number", init);
  MOETRAIN_CHECK(growth_interval >= 1, "train.loss_scale_growth_interval = {}: must be ≥ 1",
                 growth_interval);
  MOETRAIN_CHECK(std::isfinite(growth_factor) && growth_factor > 1,
                 "train.loss_scale_growth_factor = {}: must be > 1", growth_factor);
  MOETRAIN_CHECK(backoff_factor > 0 && backoff_factor < 1,
                 "train.loss_scale_backoff_factor = {}: must be in (0, 1)", backoff_factor);
  MOETRAIN_CHECK(min_scale > 0 && min_scale <= max_scale && std::isfinite(max_scale),
                 "loss scale bounds [{}, {}]: need 0 < min ≤ max < ∞", min_scale, max_scale);
}

LossScaler::LossScaler(const LossScaleConfig& cfg) : cfg_(cfg), scale_(cfg.init) {
  cfg_.validate();
}

bool LossScaler::update(bool found_non_finite) {
  if (found_non_finite) {
    scale_ = std::max(cfg_.min_scale, scale_ * cfg_.backoff_factor);
    good_steps_ = 0;
    ++skipped_;
    return false;
  }
  if (++good_steps_ >= cfg_.growth_interval) {
    if (scale_ * cfg_.growth_factor <= cfg_.max_scale) scale_ *= cfg_.growth_factor;
    good_steps_ = 0;
  }
  return true;
}

void LossScaler::restore(double scale, int64_t good_steps, int64_t skipped) {
  MOETRAIN_CHECK(std::isfinite(scale) && scale > 0 && good_steps >= 0 && skipped >= 0,
                 "loss scale state (scale {}, good steps {}, skipped {}) is not valid", scale,
                 good_steps, skipped);
  scale_ = scale;
  good_steps_ = good_steps;
  skipped_ = skipped;
}

}  // namespace moetrain
