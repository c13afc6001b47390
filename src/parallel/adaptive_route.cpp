#include "parallel/adaptive_route.h"

#include <cmath>

#include "core/check.h"

namespace moetrain {

RouteChooser::RouteChooser(const RouteChoiceOptions& opts)
    : opts_(opts), relayed_(opts.start_relayed) {
  MOETRAIN_CHECK(opts_.probe_every >= 2, "route probe every {} steps: must be ≥ 2",
                 opts_.probe_every);
  MOETRAIN_CHECK(opts_.margin >= 0 && opts_.margin < 1, "route margin {}: must be in [0, 1)",
                 opts_.margin);
  MOETRAIN_CHECK(opts_.smoothing > 0 && opts_.smoothing <= 1,
                 "route smoothing {}: must be in (0, 1]", opts_.smoothing);
}

void RouteChooser::observe(int64_t step, double seconds) {
  MOETRAIN_CHECK(std::isfinite(seconds) && seconds >= 0,
                 "route: step {} measured {} seconds per exchange", step, seconds);
  double& e = estimate_[relayed_at(step) ? 1 : 0];
  e = e < 0 ? seconds : (1 - opts_.smoothing) * e + opts_.smoothing * seconds;
  const double here = estimate(relayed_), there = estimate(!relayed_);
  if (there >= 0 && here >= 0 && there < (1 - opts_.margin) * here) {
    relayed_ = !relayed_;
    ++switches_;
  }
}

}  // namespace moetrain
