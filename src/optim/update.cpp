#include "optim/update.h"

#include <cmath>

#include "core/check.h"
#include "optim/clip.h"

namespace moetrain {

bool FlatGradient::has_non_finite() const {
  return moetrain::has_non_finite(g_, n_);
}

double FlatGradient::sum_squares() const {
  return grad_sum_squares(g_, n_);
}

void FlatGradient::scale(float factor) {
  scale_gradients(g_, n_, factor);
}

UpdateOutcome apply_update(GradientShard& grads, Comm& comm, const UpdateOptions& opts,
                           const std::function<void()>& step) {
  UpdateOutcome out;
  out.loss_scale = opts.scaler ? static_cast<double>(opts.scaler->scale()) : 1.0;
  int64_t bad = grads.has_non_finite() ? 1 : 0;
  comm.allreduce(&bad, 1);
  if (opts.scaler) {
    // The summed flag: every process takes the same decision and keeps the same scale.
    out.skipped = !opts.scaler->update(bad > 0);
    if (out.skipped) return out;
    grads.scale(static_cast<float>(1.0 / out.loss_scale));
  }
  MOETRAIN_CHECK(bad == 0, "{}: non-finite gradient{}; stopping.{}{}", opts.where,
                 comm.size() > 1 ? fmt::format(" on {} process(es)", bad) : std::string(),
                 opts.advice.empty() ? "" : " ", opts.advice);
  double sq = grads.sum_squares();
  comm.allreduce(&sq, 1);
  out.grad_norm = std::sqrt(sq);
  if (opts.grad_clip > 0) {
    out.clip_coef = clip_coefficient(out.grad_norm, opts.grad_clip);
    if (out.clip_coef != 1.0) grads.scale(static_cast<float>(out.clip_coef));
  }
  step();
  return out;
}

}  // namespace moetrain
