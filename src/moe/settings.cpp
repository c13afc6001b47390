#include "moe/settings.h"

#include <cmath>

#include "core/check.h"

namespace moetrain {

RouterKind parse_router_setting(const std::string& name) {
  try {
    return parse_router_kind(name);  // the one list of router names
  } catch (const Error& e) {
    MOETRAIN_FAIL("model.router = '{}': {}", name, e.what());
  }
}

CapacityMode parse_capacity_mode(const std::string& name) {
  if (name == "fixed") return CapacityMode::Fixed;
  if (name == "dynamic") return CapacityMode::Dynamic;
  MOETRAIN_FAIL("model.capacity = '{}': allowed are fixed, dynamic", name);
}

Overflow parse_overflow(const std::string& name) {
  if (name == "drop") return Overflow::Drop;
  if (name == "reroute") return Overflow::Reroute;
  MOETRAIN_FAIL("model.overflow = '{}': allowed are drop, reroute", name);
}

BalanceLoss parse_balance_loss(const std::string& name) {
  if (name == "switch") return BalanceLoss::Switch;
  if (name == "variance") return BalanceLoss::Variance;
  MOETRAIN_FAIL("model.balance_loss = '{}': allowed are switch, variance", name);
}

const char* capacity_mode_name(CapacityMode m) {
  return m == CapacityMode::Dynamic ? "dynamic" : "fixed";
}

const char* router_controller_name(RouterControllerKind k) {
  return k == RouterControllerKind::Rl ? "rl" : "none";
}

MoeConfig MoeModelConfig::moe_config(int64_t dim) const {
  MoeConfig m;
  m.C = dim;
  m.F = expert_hidden;
  m.E = n_experts;
  m.K = top_k;
  m.router = router;
  m.renormalize = renormalize;
  m.capacity_factor = static_cast<float>(capacity_factor);
  m.overflow = overflow;
  m.balance_loss = balance_loss;
  m.aux_loss_coef = static_cast<float>(aux_loss_coef);
  m.z_loss_coef = static_cast<float>(z_loss_coef);
  m.bias_update_rate = static_cast<float>(bias_update_rate);
  m.shared_F = shared_expert_hidden;
  m.route_groups = route_groups;
  m.route_group_topk = route_group_topk;
  m.router_skew = static_cast<float>(router_skew);
  return m;
}

void MoeModelConfig::validate_moe() const {
  MOETRAIN_CHECK(expert_hidden > 0, "model.expert_hidden = {}: must be a positive integer",
                 expert_hidden);
  MOETRAIN_CHECK(n_experts > 0, "model.n_experts = {}: must be a positive integer", n_experts);
  MOETRAIN_CHECK(top_k >= 1 && top_k <= n_experts,
                 "model.top_k = {}: must be in [1, model.n_experts = {}]", top_k, n_experts);
  MOETRAIN_CHECK(std::isfinite(capacity_factor),
                 "model.capacity_factor = {}: must be finite (> 0 fixed, 0 = dropless, < 0 "
                 "min(|cf|, the load needed))",
                 capacity_factor);
  MOETRAIN_CHECK(capacity_factor >= 0 || router != RouterKind::ExpertChoice,
                 "model.capacity_factor = {}: must be ≥ 0 with model.router = expert_choice",
                 capacity_factor);
  balance.validate();
  if (capacity == CapacityMode::Dynamic) {
    MOETRAIN_CHECK(capacity_factor != 0,
                   "model.capacity = dynamic needs model.capacity_factor ≠ 0 (the starting "
                   "factor; < 0 for min(|cf|, the load needed)), not the dropless 0");
    MOETRAIN_CHECK(router != RouterKind::ExpertChoice,
                   "model.capacity = dynamic needs a token-choice model.router, not expert_choice");
  }
  if (router_controller == RouterControllerKind::Rl)
    MOETRAIN_CHECK(router == RouterKind::SigmoidBias,
                   "model.router_controller = rl needs model.router = sigmoid_bias (the controller "
                   "moves its selection bias), not {}",
                   router_kind_name(router));
  gating.validate();
  MOETRAIN_CHECK(std::isfinite(aux_loss_coef) && aux_loss_coef >= 0,
                 "model.aux_loss_coef = {}: must be a finite value ≥ 0", aux_loss_coef);
  MOETRAIN_CHECK(std::isfinite(z_loss_coef) && z_loss_coef >= 0,
                 "model.z_loss_coef = {}: must be a finite value ≥ 0", z_loss_coef);
  MOETRAIN_CHECK(std::isfinite(bias_update_rate) && bias_update_rate >= 0,
                 "model.bias_update_rate = {}: must be a finite value ≥ 0", bias_update_rate);
  MOETRAIN_CHECK(std::isfinite(router_skew) && router_skew >= 0,
                 "model.router_skew = {}: must be a finite value >= 0 (0 = off)", router_skew);
  MOETRAIN_CHECK(shared_expert_hidden >= 0,
                 "model.shared_expert_hidden = {}: must be ≥ 0 (0 = none)", shared_expert_hidden);
  MOETRAIN_CHECK(route_groups >= 1,
                 "model.route_groups = {}: must be ≥ 1, the number of expert groups a token's "
                 "experts are limited to (1 = off: every expert in one group)",
                 route_groups);
  const MoeConfig layer = moe_config(1);
  layer.validate_route_groups();          // its messages name the model.route_* keys
  layer.validate_overflow_and_balance();  // and these model.overflow, model.balance_loss
}

}  // namespace moetrain
