#include "moe/capacity_controller.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "core/check.h"

namespace moetrain {

void CapacityControlConfig::validate() const {
  MOETRAIN_CHECK(std::isfinite(cf_min) && cf_min > 0,
                 "balance.cf_min = {}: must be a finite value > 0", cf_min);
  MOETRAIN_CHECK(std::isfinite(cf_max) && cf_max >= cf_min,
                 "balance.cf_max = {}: must be finite and >= balance.cf_min = {}", cf_max, cf_min);
  MOETRAIN_CHECK(window >= 2, "balance.window = {}: must be >= 2 (a slope needs two points)",
                 window);
  MOETRAIN_CHECK(std::isfinite(util_low) && util_low >= 0 && util_low <= 1,
                 "balance.util_low = {}: must be in [0, 1]", util_low);
  MOETRAIN_CHECK(std::isfinite(util_high) && util_high >= util_low && util_high <= 1,
                 "balance.util_high = {}: must be in [balance.util_low = {}, 1]", util_high,
                 util_low);
  MOETRAIN_CHECK(std::isfinite(imbalance_low) && imbalance_low >= 1,
                 "balance.imbalance_low = {}: must be >= 1 (1 = balanced)", imbalance_low);
  MOETRAIN_CHECK(std::isfinite(imbalance_high) && imbalance_high >= imbalance_low,
                 "balance.imbalance_high = {}: must be finite and >= balance.imbalance_low = {}",
                 imbalance_high, imbalance_low);
  MOETRAIN_CHECK(std::isfinite(slope_tol) && slope_tol >= 0,
                 "balance.slope_tol = {}: must be a finite value >= 0", slope_tol);
}

const char* capacity_rule_name(CapacityRule rule) {
  switch (rule) {
    case CapacityRule::Shrink:
      return "shrink";
    case CapacityRule::Grow:
      return "grow";
    case CapacityRule::Trend:
      return "trend";
    case CapacityRule::Keep:
      break;
  }
  return "keep";
}

double least_squares_slope(const std::deque<double>& y) {
  const std::size_t n = y.size();
  if (n < 2) return 0.0;
  const double xm = static_cast<double>(n - 1) / 2.0;
  double ym = 0;
  for (double v : y) ym += v;
  ym /= static_cast<double>(n);
  double sxy = 0, sxx = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double dx = static_cast<double>(i) - xm;
    sxy += dx * (y[i] - ym);
    sxx += dx * dx;
  }
  return sxy / sxx;
}

CapacityController::CapacityController(const CapacityControlConfig& cfg, double cf0)
    : cfg_(cfg), cf_(std::clamp(cf0, cfg.cf_min, cfg.cf_max)) {
  cfg_.validate();
}

CapacityRule CapacityController::update(double utilisation, double imbalance) {
  history_.push_back(utilisation);
  while (static_cast<int64_t>(history_.size()) > cfg_.window) history_.pop_front();
  CapacityRule rule = CapacityRule::Keep;
  double factor = 1.0;
  if (utilisation < cfg_.util_low && imbalance > cfg_.imbalance_high) {
    rule = CapacityRule::Shrink, factor = 0.9;
  } else if (utilisation > cfg_.util_high && imbalance < cfg_.imbalance_low) {
    rule = CapacityRule::Grow, factor = 1.1;
  } else if (static_cast<int64_t>(history_.size()) == cfg_.window &&
             least_squares_slope(history_) < -cfg_.slope_tol) {
    // Only a full window: a slope over the first few steps is mostly noise.
    rule = CapacityRule::Trend, factor = 0.95;
  }
  cf_ = std::clamp(cf_ * factor, cfg_.cf_min, cfg_.cf_max);
  return rule;
}

nlohmann::json CapacityController::to_json() const {
  return {{"cf", cf_}, {"history", std::vector<double>(history_.begin(), history_.end())}};
}

void CapacityController::restore(const nlohmann::json& j, const std::string& where) {
  MOETRAIN_CHECK(j.is_object() && j.contains("cf") && j["cf"].is_number() &&
                     j.contains("history") && j["history"].is_array(),
                 "{}: capacity controller state needs a number 'cf' and an array 'history'", where);
  const double cf = j["cf"].get<double>();
  MOETRAIN_CHECK(std::isfinite(cf) && cf >= cfg_.cf_min && cf <= cfg_.cf_max,
                 "{}: capacity controller cf {} is outside [balance.cf_min, balance.cf_max] = "
                 "[{}, {}]",
                 where, cf, cfg_.cf_min, cfg_.cf_max);
  history_.clear();
  for (const auto& v : j["history"]) {
    MOETRAIN_CHECK(v.is_number(), "{}: capacity controller history holds a non-number", where);
    history_.push_back(v.get<double>());
  }
  while (static_cast<int64_t>(history_.size()) > cfg_.window) history_.pop_front();
  cf_ = cf;
}

}  // namespace moetrain
