#include "optim/expert_reweight.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include <nlohmann/json.hpp>

#include "core/check.h"

namespace moetrain {

ExpertReweightMode parse_expert_reweight(const std::string& s) {
  if (s == "none") return ExpertReweightMode::None;
  if (s == "importance") return ExpertReweightMode::Importance;
  if (s == "utilisation") return ExpertReweightMode::Utilisation;
  if (s == "grad_norm") return ExpertReweightMode::GradNorm;
  MOETRAIN_FAIL("grad.expert_reweight = '{}': allowed are none, importance, utilisation, grad_norm",
                s);
}

std::vector<double> normalise_mean_one(const std::vector<double>& raw) {
  double sum = 0;
  int64_t n = 0;
  for (double r : raw) {
    if (std::isfinite(r) && r > 0) sum += r, ++n;
  }
  std::vector<double> out(raw.size(), 1.0);
  if (n == 0) return out;
  const double mean = sum / static_cast<double>(n);
  for (std::size_t e = 0; e < raw.size(); ++e)
    if (std::isfinite(raw[e]) && raw[e] > 0) out[e] = raw[e] / mean;
  return out;
}

std::vector<double> utilisation_factors(const std::vector<int64_t>& load, double low, double high) {
  if (load.empty()) return {};
  const double mean = static_cast<double>(std::accumulate(load.begin(), load.end(), int64_t{0})) /
                      static_cast<double>(load.size());
  std::vector<double> raw(load.size(), 1.0);
  for (std::size_t e = 0; e < load.size(); ++e) {
    const double l = static_cast<double>(load[e]);
    if (l < low * mean) raw[e] = 2.0;
    if (l > high * mean) raw[e] = 0.5;
  }
  return normalise_mean_one(raw);
}

std::vector<double> grad_norm_factors(const std::vector<double>& norm) {
  std::vector<double> raw(norm.size(), 0.0);
  for (std::size_t e = 0; e < norm.size(); ++e)
    if (norm[e] > 0) raw[e] = 1.0 / norm[e];
  return normalise_mean_one(raw);
}

std::vector<double> importance_factors(std::vector<double>& avg,
                                       const std::vector<double>& mean_abs, double decay,
                                       bool first) {
  MOETRAIN_CHECK(avg.size() == mean_abs.size(), "importance_factors: {} averages for {} experts",
                 avg.size(), mean_abs.size());
  for (std::size_t e = 0; e < avg.size(); ++e)
    avg[e] = first ? mean_abs[e] : decay * avg[e] + (1.0 - decay) * mean_abs[e];
  return normalise_mean_one(avg);
}

ExpertReweighter::ExpertReweighter(const ExpertReweightConfig& cfg, const ParamTable& table)
    : cfg_(cfg) {
  MOETRAIN_CHECK(cfg.mode != ExpertReweightMode::None,
                 "ExpertReweighter: grad.expert_reweight = none needs no reweighter");
  std::map<std::string, int64_t> layer_of;
  std::vector<std::string> order;
  for (const ParamInfo& p : table.params()) {
    if (p.expert < 0) continue;
    const std::size_t at = p.name.find(".experts.");
    MOETRAIN_CHECK(at != std::string::npos, "expert tensor '{}' has no '.experts.' in its name",
                   p.name);
    const std::string prefix = p.name.substr(0, at);
    if (layer_of.emplace(prefix, static_cast<int64_t>(order.size())).second)
      order.push_back(prefix);
    E_ = std::max(E_, p.expert + 1);
  }
  L_ = static_cast<int64_t>(order.size());
  MOETRAIN_CHECK(L_ > 0, "grad.expert_reweight = '{}' needs a model with MoE layers",
                 cfg.mode == ExpertReweightMode::Importance    ? "importance"
                 : cfg.mode == ExpertReweightMode::Utilisation ? "utilisation"
                                                               : "grad_norm");
  ranges_.assign(static_cast<std::size_t>(L_ * E_), {});
  numel_.assign(static_cast<std::size_t>(L_ * E_), 0);
  for (const ParamInfo& p : table.params()) {
    if (p.expert < 0) continue;
    const int64_t k = layer_of.at(p.name.substr(0, p.name.find(".experts."))) * E_ + p.expert;
    ranges_[k].push_back({p.offset, p.numel, 1.0f});
    numel_[k] += p.numel;
  }
  std::vector<std::pair<WeightedRange, int64_t>> all;
  for (int64_t k = 0; k < L_ * E_; ++k)
    for (const WeightedRange& r : ranges_[k]) all.push_back({r, k});
  std::sort(all.begin(), all.end(),
            [](const auto& a, const auto& b) { return a.first.offset < b.first.offset; });
  for (const auto& [r, k] : all) sorted_.push_back(r), owner_.push_back(k);
  avg_.assign(static_cast<std::size_t>(L_), std::vector<double>(static_cast<std::size_t>(E_), 0));
  factors_.assign(static_cast<std::size_t>(L_),
                  std::vector<double>(static_cast<std::size_t>(E_), 1.0));
}

void ExpertReweighter::apply(GradientShard& grads, Comm& comm) {
  std::vector<double> sums = partial_sums(grads);
  if (cfg_.mode != ExpertReweightMode::Utilisation)
    comm.allreduce(sums.data(), static_cast<int64_t>(sums.size()));
  apply_sums(grads, sums);
}

std::vector<double> ExpertReweighter::partial_sums(const GradientShard& grads) const {
  const std::size_t LE = static_cast<std::size_t>(L_ * E_);
  std::vector<double> sums(2 * LE, 0.0);  // Σ|g| then Σg², per (layer, expert)
  if (cfg_.mode == ExpertReweightMode::Utilisation) return sums;
  std::vector<double> abs_sum(sorted_.size(), 0.0), sq_sum(sorted_.size(), 0.0);
  grads.range_sums(sorted_, abs_sum.data(), sq_sum.data());
  for (std::size_t i = 0; i < sorted_.size(); ++i) {
    sums[static_cast<std::size_t>(owner_[i])] += abs_sum[i];
    sums[LE + static_cast<std::size_t>(owner_[i])] += sq_sum[i];
  }
  return sums;
}

void ExpertReweighter::apply_sums(GradientShard& grads, const std::vector<double>& sums) {
  const std::size_t LE = static_cast<std::size_t>(L_ * E_);
  MOETRAIN_CHECK(sums.size() == 2 * LE, "expert reweighting: {} summed figures for {} experts",
                 sums.size(), LE);
  if (cfg_.mode == ExpertReweightMode::Utilisation)
    MOETRAIN_CHECK(static_cast<int64_t>(loads_.size()) == L_,
                   "grad.expert_reweight = utilisation: {} layers of loads for {} MoE layers",
                   loads_.size(), L_);
  for (int64_t l = 0; l < L_; ++l) {
    std::vector<double> per(static_cast<std::size_t>(E_));
    for (int64_t e = 0; e < E_; ++e) {
      const std::size_t k = static_cast<std::size_t>(l * E_ + e);
      per[e] = cfg_.mode == ExpertReweightMode::Importance
                   ? sums[k] / static_cast<double>(std::max<int64_t>(1, numel_[k]))
                   : std::sqrt(sums[LE + k]);
    }
    switch (cfg_.mode) {
      case ExpertReweightMode::Importance:
        factors_[l] = importance_factors(avg_[l], per, cfg_.decay, steps_ == 0);
        break;
      case ExpertReweightMode::Utilisation:
        factors_[l] = utilisation_factors(loads_[l], cfg_.util_low, cfg_.util_high);
        break;
      case ExpertReweightMode::GradNorm:
        factors_[l] = grad_norm_factors(per);
        break;
      case ExpertReweightMode::None:
        break;
    }
  }
  std::vector<WeightedRange> weighted = sorted_;
  for (std::size_t i = 0; i < weighted.size(); ++i) {
    const int64_t k = owner_[i];
    weighted[i].factor = static_cast<float>(factors_[k / E_][k % E_]);
  }
  grads.scale_ranges(weighted);
  ++steps_;
}

std::vector<double> ExpertReweighter::layer_min() const {
  std::vector<double> out;
  for (const auto& f : factors_) out.push_back(*std::min_element(f.begin(), f.end()));
  return out;
}

std::vector<double> ExpertReweighter::layer_max() const {
  std::vector<double> out;
  for (const auto& f : factors_) out.push_back(*std::max_element(f.begin(), f.end()));
  return out;
}

nlohmann::json ExpertReweighter::to_json() const {
  return {{"steps", steps_}, {"importance_avg", avg_}};
}

void ExpertReweighter::restore(const nlohmann::json& j, const std::string& where) {
  MOETRAIN_CHECK(j.is_object() && j.contains("steps") && j["steps"].is_number_integer() &&
                     j.contains("importance_avg") && j["importance_avg"].is_array(),
                 "{}: 'expert_reweight' must hold 'steps' and 'importance_avg'", where);
  std::vector<std::vector<double>> avg;
  try {
    avg = j["importance_avg"].get<std::vector<std::vector<double>>>();
  } catch (const nlohmann::json::exception& e) {
    MOETRAIN_FAIL("{}: 'expert_reweight.importance_avg' is not a list of number lists: {}", where,
                  e.what());
  }
  bool shaped = static_cast<int64_t>(avg.size()) == L_;
  for (const auto& a : avg) shaped = shaped && static_cast<int64_t>(a.size()) == E_;
  MOETRAIN_CHECK(shaped, "{}: 'expert_reweight.importance_avg' must be {} layers of {} experts",
                 where, L_, E_);
  steps_ = j["steps"].get<int64_t>();
  avg_ = std::move(avg);
}

}  // namespace moetrain
