#include "optim/update.h"

#include <cmath>

#include "core/check.h"
#include "optim/clip.h"
#include "optim/expert_reweight.h"

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

void add_range_sums(const float* g, int64_t n, double& abs_sum, double& sq_sum) {
  double a = 0, q = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = g[i];
    a += std::fabs(x);
    q += x * x;
  }
  abs_sum += a;
  sq_sum += q;
}

void FlatGradient::range_sums(const std::vector<WeightedRange>& ranges, double* abs_sum,
                              double* sq_sum) const {
  for (std::size_t r = 0; r < ranges.size(); ++r) {
    const auto [lo, hi] = held(ranges[r]);
    if (lo < hi) add_range_sums(g_ + (lo - first_), hi - lo, abs_sum[r], sq_sum[r]);
  }
}

void FlatGradient::scale_ranges(const std::vector<WeightedRange>& ranges) {
  for (const WeightedRange& r : ranges) {
    const auto [lo, hi] = held(r);
    if (lo < hi) scale_gradients(g_ + (lo - first_), hi - lo, r.factor);
  }
}

UpdateOutcome check_and_clip(GradientShard& grads, Comm& comm, const UpdateOptions& opts) {
  UpdateOutcome out;
  out.loss_scale = opts.scaler ? static_cast<double>(opts.scaler->scale()) : 1.0;
  // Without a loss scale or reweighting, which change the gradients between the check and the
  // norm, the sum of squares comes first: a finite sum has no non-finite term, so only a
  // non-finite sum (or one that overflowed) needs the elements looked at.
  const bool sum_first = !opts.scaler && !opts.reweight;
  double sq = sum_first ? grads.sum_squares() : 0.0;
  int64_t bad = sum_first && std::isfinite(sq) ? 0 : grads.has_non_finite() ? 1 : 0;
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
  if (opts.reweight) opts.reweight->apply(grads, comm);
  if (!sum_first) sq = grads.sum_squares();
  comm.allreduce(&sq, 1);
  out.grad_norm = std::sqrt(sq);
  if (opts.grad_clip > 0) {
    out.clip_coef = clip_coefficient(out.grad_norm, opts.grad_clip);
    if (out.clip_coef != 1.0) grads.scale(static_cast<float>(out.clip_coef));
  }
  return out;
}

}  // namespace moetrain
