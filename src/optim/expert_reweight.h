// Expert gradient reweighting ([grad] expert_reweight): each expert's reduced gradient is
// multiplied by a factor before the global norm and the clip (optim/update.h), the factors of an
// MoE layer normalised to mean 1 over its experts:
//   importance   moving average (grad.reweight_decay) of the mean |g| over the expert's
//                parameters; the first step takes the step's value
//   utilisation  ×2 below grad.util_low × the layer's mean load, ×0.5 above grad.util_high × it,
//                ×1 between (the step's tokens per expert, over every process)
//   grad_norm    1 / ‖g‖ of the expert's gradient
// An expert whose raw factor is 0 or undefined (no gradient, no history) keeps ×1 and is left out
// of the normalisation; a layer where no expert has one keeps ×1 throughout.
// Every figure comes from the reduced gradient or the reduced loads, summed over the processes,
// so every process computes the same factors and applies them to the part it holds.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/comm.h"
#include "model/params.h"
#include "optim/update.h"

namespace moetrain {

enum class ExpertReweightMode { None, Importance, Utilisation, GradNorm };

// "none" | "importance" | "utilisation" | "grad_norm"; throws naming grad.expert_reweight.
ExpertReweightMode parse_expert_reweight(const std::string& s);

struct ExpertReweightConfig {
  ExpertReweightMode mode = ExpertReweightMode::None;
  double decay = 0.9;      // importance: avg = decay·avg + (1 − decay)·mean|g|
  double util_low = 0.5;   // utilisation: load < util_low × mean load → ×2
  double util_high = 2.0;  // utilisation: load > util_high × mean load → ×0.5
};

// raw / mean(raw), the mean over the entries > 0 (finite); the others become 1. All ones when
// no entry is > 0.
std::vector<double> normalise_mean_one(const std::vector<double>& raw);
// (E) the utilisation factors of one layer's loads, normalised.
std::vector<double> utilisation_factors(const std::vector<int64_t>& load, double low, double high);
// (E) 1 / norm, normalised.
std::vector<double> grad_norm_factors(const std::vector<double>& norm);
// avg (E) ← decay·avg + (1 − decay)·mean_abs, or mean_abs when first; returns avg normalised.
std::vector<double> importance_factors(std::vector<double>& avg,
                                       const std::vector<double>& mean_abs, double decay,
                                       bool first);

class ExpertReweighter {
 public:
  // The experts of `table`: every tensor with ParamInfo::expert ≥ 0, grouped into MoE layers by
  // the name before ".experts." in table order.
  ExpertReweighter(const ExpertReweightConfig& cfg, const ParamTable& table);

  int64_t layers() const { return L_; }
  int64_t experts() const { return E_; }
  // utilisation: this step's loads, (layers, E) summed over every process.
  void set_loads(std::vector<std::vector<int64_t>> loads) { loads_ = std::move(loads); }
  // Collective over comm: the factors from this step's reduced gradient (and loads), applied:
  // partial_sums of this process's part, summed over comm, then apply_sums.
  void apply(GradientShard& grads, Comm& comm);
  // (2 · layers · E) Σ|g| then Σg² of each expert over this process's part (zeros for
  // utilisation, which reads the loads). Summed over every part of the gradient, they are what
  // apply_sums takes; a parameter server adds its servers' parts in server order.
  std::vector<double> partial_sums(const GradientShard& grads) const;
  // The factors from the summed figures (and the loads), applied to this process's part.
  void apply_sums(GradientShard& grads, const std::vector<double>& sums);
  // (layers, E) the factors the last apply used (ones before the first).
  const std::vector<std::vector<double>>& factors() const { return factors_; }
  // (layers) the smallest and largest factor of each layer.
  std::vector<double> layer_min() const;
  std::vector<double> layer_max() const;

  // The moving averages (importance) and the steps taken, for the checkpoint.
  nlohmann::json to_json() const;
  // Restores what to_json wrote; `where` names the file in errors.
  void restore(const nlohmann::json& j, const std::string& where);

 private:
  ExpertReweightConfig cfg_;
  int64_t L_ = 0, E_ = 0;
  std::vector<std::vector<WeightedRange>> ranges_;  // (layers · E) flat ranges of each expert
  std::vector<int64_t> numel_;                      // (layers · E)
  std::vector<WeightedRange> sorted_;               // every expert range, by offset
  std::vector<int64_t> owner_;                      // (sorted_) its layers · E index
  std::vector<std::vector<int64_t>> loads_;
  std::vector<std::vector<double>> avg_;  // (layers, E) importance moving average
  std::vector<std::vector<double>> factors_;
  int64_t steps_ = 0;
};

}  // namespace moetrain
