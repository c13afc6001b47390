// A load-aware gating controller (model.router_controller = "rl"): REINFORCE with a learned
// baseline that moves the sigmoid_bias router's per-expert bias, in place of the sign rule.
//
//   state   per step, from the step's load reduced over every process: the load shares s_e,
//           d_e = E·s_e − 1 (deviation from an even share), u = normalised load entropy
//           (1 = even, 0 = one expert takes everything), τ = step time / its running mean − 1
//   policy  Gaussian, linear in the state: a_e ~ N(μ_e, σ²), μ_e = θ·φ_e with
//           φ_e = (d_e, d_e·(1 − u), d_e·τ): the gain on an expert's overload depends on the
//           utilisation and the step time (a term shared by every expert would shift all biases
//           alike and change no routing decision, so every feature is scaled by d_e)
//   action  b_e += γ·a_e (γ = model.bias_update_rate); the bias enters the selection only, as
//           for sigmoid_bias
//   reward  r = (tokens/s ÷ its running mean) × (mean load ÷ max load), measured one step after
//           the action that caused it (the bias acts on the next step's routing)
//   learn   A = r − V(ψ), V(ψ) = w·ψ over ψ = (1, u, τ, max/mean − 1);
//           θ += lr · A · Σ_e (a_e − μ_e)/σ² · φ_e / E;  w += baseline_lr · A · ψ
// θ starts at (−1, 0, 0): a proportional version of the sign rule, which learning then adjusts.
// Pure: every process feeds it the same reduced figures (the step time is the slowest rank's)
// and draws the same ε from (seed, step, layer), so ranks hold the same policy and bias, and a
// checkpoint of the state resumes it exactly.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace moetrain {

enum class RouterControllerKind { None, Rl };
// "none" | "rl"; anything else is an Error naming model.router_controller.
RouterControllerKind parse_router_controller(std::string_view name);

struct GatingControlConfig {
  double lr = 0.05;          // policy step size
  double sigma = 0.5;        // policy standard deviation, in units of γ
  double baseline_lr = 0.1;  // value-baseline step size
  double time_decay = 0.9;   // running means of the step time and tokens/s

  // Throws naming the `gating.*` key that is out of range.
  void validate() const;
};

constexpr std::size_t kGatingFeatures = 3;    // φ_e
constexpr std::size_t kBaselineFeatures = 4;  // ψ
using GatingTheta = std::array<double, kGatingFeatures>;

// One REINFORCE step of the Gaussian policy: theta += lr · advantage · Σ_e (a_e − μ_e)/σ² · φ_e
// / E, for E = a.size() experts; phi (E · kGatingFeatures), mu (E) the means the actions a (E)
// were drawn around.
void reinforce_step(GatingTheta& theta, const std::vector<double>& phi,
                    const std::vector<double>& a, const std::vector<double>& mu, double sigma,
                    double advantage, double lr);

// What one optimizer step measured, reduced over the processes.
struct GatingObservation {
  const int64_t* load = nullptr;  // (E) assignments per expert chosen by the step's forwards
  double step_s = 0;              // the slowest process's step time
  double tokens = 0;              // tokens the step trained on (every process)
};

class GatingController {
 public:
  GatingController() = default;
  GatingController(const GatingControlConfig& cfg, int64_t E, uint64_t seed, uint64_t layer);

  // Learns from the reward of the previous action (if any), then draws the next action;
  // returns the bias change (E) in units of γ. step numbers the draw.
  std::vector<double> update(const GatingObservation& obs, uint64_t step);

  const GatingTheta& theta() const { return theta_; }
  double last_reward() const { return last_reward_; }

  nlohmann::json to_json() const;
  // Restores what to_json wrote; `where` names the file in errors.
  void restore(const nlohmann::json& j, const std::string& where);

 private:
  GatingControlConfig cfg_;
  int64_t E_ = 0;
  uint64_t seed_ = 0, layer_ = 0;
  GatingTheta theta_{-1.0, 0.0, 0.0};
  std::array<double, kBaselineFeatures> w_{};
  double time_mean_ = 0, tps_mean_ = 0;  // 0 = nothing measured yet
  double last_reward_ = 0;
  // The last action, for its reward a step later; empty before the first.
  std::vector<double> phi_, a_, mu_;
  std::array<double, kBaselineFeatures> psi_{};
};

}  // namespace moetrain
