#include "moe/gating_controller.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/rng.h"

namespace moetrain {

RouterControllerKind parse_router_controller(std::string_view name) {
  if (name == "none") return RouterControllerKind::None;
  if (name == "rl") return RouterControllerKind::Rl;
  MOETRAIN_CHECK(false, "model.router_controller = '{}': allowed are none, rl", name);
  return RouterControllerKind::None;
}

void GatingControlConfig::validate() const {
  MOETRAIN_CHECK(std::isfinite(lr) && lr >= 0, "gating.lr = {}: must be a finite value >= 0", lr);
  MOETRAIN_CHECK(std::isfinite(sigma) && sigma > 0, "gating.sigma = {}: must be a finite value > 0",
                 sigma);
  MOETRAIN_CHECK(std::isfinite(baseline_lr) && baseline_lr >= 0 && baseline_lr <= 1,
                 "gating.baseline_lr = {}: must be in [0, 1]", baseline_lr);
  MOETRAIN_CHECK(std::isfinite(time_decay) && time_decay >= 0 && time_decay < 1,
                 "gating.time_decay = {}: must be in [0, 1)", time_decay);
}

void reinforce_step(GatingTheta& theta, const std::vector<double>& phi,
                    const std::vector<double>& a, const std::vector<double>& mu, double sigma,
                    double advantage, double lr) {
  const std::size_t E = a.size();
  MOETRAIN_CHECK(E > 0 && mu.size() == E && phi.size() == E * kGatingFeatures,
                 "reinforce_step: {} actions, {} means and {} features (want E·{})", E, mu.size(),
                 phi.size(), kGatingFeatures);
  GatingTheta grad{};
  for (std::size_t e = 0; e < E; ++e) {
    const double score = (a[e] - mu[e]) / (sigma * sigma);
    for (std::size_t k = 0; k < kGatingFeatures; ++k)
      grad[k] += score * phi[e * kGatingFeatures + k];
  }
  for (std::size_t k = 0; k < kGatingFeatures; ++k)
    theta[k] += lr * advantage * grad[k] / static_cast<double>(E);
}

GatingController::GatingController(const GatingControlConfig& cfg, int64_t E, uint64_t seed,
                                   uint64_t layer)
    : cfg_(cfg), E_(E), seed_(seed), layer_(layer) {
  cfg_.validate();
  MOETRAIN_CHECK(E > 0, "GatingController: {} experts, need at least one", E);
}

std::vector<double> GatingController::update(const GatingObservation& obs, uint64_t step) {
  MOETRAIN_CHECK(obs.load != nullptr, "GatingController::update: null load");
  const std::size_t E = static_cast<std::size_t>(E_);
  double total = 0, max_load = 0, entropy = 0;
  for (std::size_t e = 0; e < E; ++e) {
    total += static_cast<double>(obs.load[e]);
    max_load = std::max(max_load, static_cast<double>(obs.load[e]));
  }
  std::vector<double> dev(E, 0.0);
  if (total > 0) {
    for (std::size_t e = 0; e < E; ++e) {
      const double s = static_cast<double>(obs.load[e]) / total;
      dev[e] = static_cast<double>(E_) * s - 1.0;
      if (s > 0) entropy -= s * std::log(s);
    }
  }
  const double util = E > 1 ? entropy / std::log(static_cast<double>(E_)) : 1.0;
  const double imbalance = total > 0 ? max_load * static_cast<double>(E_) / total : 1.0;
  const double tau = time_mean_ > 0 && obs.step_s > 0 ? obs.step_s / time_mean_ - 1.0 : 0.0;
  const double tps = obs.step_s > 0 ? obs.tokens / obs.step_s : 0.0;
  const std::array<double, kBaselineFeatures> psi{1.0, util, tau, imbalance - 1.0};

  if (!a_.empty()) {
    const double rel_tps = tps_mean_ > 0 && tps > 0 ? tps / tps_mean_ : 1.0;
    last_reward_ = rel_tps / imbalance;
    double value = 0;
    for (std::size_t k = 0; k < kBaselineFeatures; ++k) value += w_[k] * psi_[k];
    const double advantage = last_reward_ - value;
    reinforce_step(theta_, phi_, a_, mu_, cfg_.sigma, advantage, cfg_.lr);
    for (std::size_t k = 0; k < kBaselineFeatures; ++k)
      w_[k] += cfg_.baseline_lr * advantage * psi_[k];
  }
  const double d = cfg_.time_decay;
  if (obs.step_s > 0)
    time_mean_ = time_mean_ > 0 ? d * time_mean_ + (1 - d) * obs.step_s : obs.step_s;
  if (tps > 0) tps_mean_ = tps_mean_ > 0 ? d * tps_mean_ + (1 - d) * tps : tps;

  phi_.assign(E * kGatingFeatures, 0.0);
  mu_.assign(E, 0.0);
  a_.assign(E, 0.0);
  const Rng rng(seed_, rng_stream(RngPurpose::Gating, step, layer_));
  for (std::size_t e = 0; e < E; ++e) {
    double* f = &phi_[e * kGatingFeatures];
    f[0] = dev[e], f[1] = dev[e] * (1.0 - util), f[2] = dev[e] * tau;
    for (std::size_t k = 0; k < kGatingFeatures; ++k) mu_[e] += theta_[k] * f[k];
    a_[e] = mu_[e] + cfg_.sigma * static_cast<double>(rng.normal(e));
  }
  psi_ = psi;
  return a_;
}

nlohmann::json GatingController::to_json() const {
  return {{"theta", theta_},       {"baseline", w_}, {"time_mean", time_mean_},
          {"tps_mean", tps_mean_}, {"phi", phi_},    {"action", a_},
          {"mean", mu_},           {"psi", psi_},    {"last_reward", last_reward_}};
}

namespace {

template <class Out>
void read_numbers(Out& out, const nlohmann::json& j, const char* key, std::size_t n,
                  const std::string& where) {
  MOETRAIN_CHECK(j.contains(key) && j[key].is_array() && j[key].size() == n,
                 "{}: gating controller '{}' must be an array of {} numbers", where, key, n);
  for (std::size_t i = 0; i < n; ++i) {
    MOETRAIN_CHECK(j[key][i].is_number() && std::isfinite(j[key][i].get<double>()),
                   "{}: gating controller '{}' holds a non-finite or non-number entry", where, key);
    out[i] = j[key][i].get<double>();
  }
}

}  // namespace

void GatingController::restore(const nlohmann::json& j, const std::string& where) {
  MOETRAIN_CHECK(j.is_object(), "{}: gating controller state must be an object", where);
  for (const char* k : {"time_mean", "tps_mean", "last_reward"})
    MOETRAIN_CHECK(j.contains(k) && j[k].is_number() && std::isfinite(j[k].get<double>()),
                   "{}: gating controller state needs a finite number '{}'", where, k);
  MOETRAIN_CHECK(j.contains("action") && j["action"].is_array(),
                 "{}: gating controller state needs an array 'action'", where);
  const std::size_t E = static_cast<std::size_t>(E_);
  const std::size_t n = j["action"].empty() ? 0 : E;  // empty before the first step
  GatingTheta theta{};
  std::array<double, kBaselineFeatures> w{}, psi{};
  std::vector<double> phi(n * kGatingFeatures), a(n), mu(n);
  read_numbers(theta, j, "theta", kGatingFeatures, where);
  read_numbers(w, j, "baseline", kBaselineFeatures, where);
  read_numbers(psi, j, "psi", kBaselineFeatures, where);
  read_numbers(phi, j, "phi", n * kGatingFeatures, where);
  read_numbers(a, j, "action", n, where);
  read_numbers(mu, j, "mean", n, where);
  theta_ = theta, w_ = w, psi_ = psi, phi_ = phi, a_ = a, mu_ = mu;
  time_mean_ = j["time_mean"].get<double>();
  tps_mean_ = j["tps_mean"].get<double>();
  last_reward_ = j["last_reward"].get<double>();
}

}  // namespace moetrain
