// The dynamic capacity factor: a controller that moves cf between bounds, once per optimizer
// step, from the step's measured capacity utilisation and load imbalance.
//
//   utilisation u = assignments the experts computed / capacity slots (E · capacity, summed over
//                   the step's micro-batches and processes)
//   imbalance   i = busiest expert's load · E / Σ load (1 = balanced)
//   rules, first match wins:
//     u < util_low  and i > imbalance_high   → cf · 0.9   (slots sit empty behind a hot expert)
//     u > util_high and i < imbalance_low    → cf · 1.1   (balanced and full: room to drop less)
//     least-squares slope of u over the last `window` steps < −slope_tol → cf · 0.95
//     otherwise keep
//   then cf is clamped to [cf_min, cf_max].
// Pure: the state is cf and the utilisation window, so ranks that feed it the same reduced
// figures hold the same cf, and a checkpoint of the state resumes it bit-exactly.
#pragma once
#include <cstdint>
#include <deque>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace moetrain {

struct CapacityControlConfig {
  double cf_min = 0.5, cf_max = 2.0;
  int64_t window = 100;
  double util_low = 0.5, util_high = 0.9;
  double imbalance_low = 1.2, imbalance_high = 2.0;
  double slope_tol = 1e-3;  // utilisation per step

  // Throws naming the `balance.*` key that is out of range.
  void validate() const;
};

enum class CapacityRule { Keep, Shrink, Grow, Trend };
const char* capacity_rule_name(CapacityRule rule);

// Least-squares slope of y (n ≥ 2) against 0, 1, ..., n−1; 0 for fewer points.
double least_squares_slope(const std::deque<double>& y);

class CapacityController {
 public:
  CapacityController() = default;
  // cf0 is clamped to the bounds.
  CapacityController(const CapacityControlConfig& cfg, double cf0);

  // One step's figures; returns the rule that fired. cf() is the factor for the next step.
  CapacityRule update(double utilisation, double imbalance);
  double cf() const { return cf_; }
  const std::deque<double>& history() const { return history_; }

  nlohmann::json to_json() const;
  // Restores what to_json wrote; `where` names the file in errors.
  void restore(const nlohmann::json& j, const std::string& where);

 private:
  CapacityControlConfig cfg_;
  double cf_ = 1.0;
  std::deque<double> history_;  // the last `window` utilisations, oldest first
};

}  // namespace moetrain
