#include "moe/config.h"

#include <cmath>

#include "core/check.h"

namespace moetrain {

namespace {
constexpr std::string_view kRouterNames[] = {"topk_softmax", "noisy_topk", "expert_choice",
                                             "sigmoid_bias"};
}  // namespace

RouterKind parse_router_kind(std::string_view name) {
  for (int i = 0; i < 4; ++i) {
    if (name == kRouterNames[i]) return static_cast<RouterKind>(i);
  }
  MOETRAIN_FAIL(
      "unknown router '{}': allowed are topk_softmax, noisy_topk, expert_choice, sigmoid_bias",
      name);
}

std::string_view router_kind_name(RouterKind kind) {
  int i = static_cast<int>(kind);
  MOETRAIN_CHECK(i >= 0 && i < 4, "router kind {} is not one of the 4 known routers", i);
  return kRouterNames[i];
}

const char* overflow_name(Overflow o) {
  return o == Overflow::Reroute ? "reroute" : "drop";
}

const char* balance_loss_name(BalanceLoss b) {
  return b == BalanceLoss::Variance ? "variance" : "switch";
}

void MoeConfig::validate() const {
  MOETRAIN_CHECK(C > 0, "moe config: C (model dim) is {}, must be > 0", C);
  MOETRAIN_CHECK(F > 0, "moe config: F (expert hidden size) is {}, must be > 0", F);
  MOETRAIN_CHECK(E > 0, "moe config: E (experts) is {}, must be > 0", E);
  MOETRAIN_CHECK(K >= 1 && K <= E, "moe config: K (top-k) is {}, must be in [1, E] = [1, {}]", K,
                 E);
  int r = static_cast<int>(router);
  MOETRAIN_CHECK(r >= 0 && r < 4,
                 "moe config: router is {}, must be one of topk_softmax, noisy_topk, "
                 "expert_choice, sigmoid_bias",
                 r);
  MOETRAIN_CHECK(std::isfinite(capacity_factor),
                 "moe config: capacity_factor is {}, must be finite (0 = dropless)",
                 capacity_factor);
  MOETRAIN_CHECK(capacity_factor >= 0.0f || is_token_choice(router),
                 "moe config: capacity_factor is {}, must be >= 0 with expert_choice (a negative "
                 "factor caps a token-choice router's capacity at the load it needs)",
                 capacity_factor);
  MOETRAIN_CHECK(std::isfinite(aux_loss_coef) && aux_loss_coef >= 0.0f,
                 "moe config: aux_loss_coef is {}, must be a finite value >= 0", aux_loss_coef);
  MOETRAIN_CHECK(std::isfinite(z_loss_coef) && z_loss_coef >= 0.0f,
                 "moe config: z_loss_coef is {}, must be a finite value >= 0", z_loss_coef);
  MOETRAIN_CHECK(std::isfinite(bias_update_rate) && bias_update_rate >= 0.0f,
                 "moe config: bias_update_rate is {}, must be a finite value >= 0",
                 bias_update_rate);
  MOETRAIN_CHECK(shared_F >= 0,
                 "moe config: shared_F (shared expert hidden size) is {}, must be >= 0 (0 = none)",
                 shared_F);
  MOETRAIN_CHECK(std::isfinite(router_skew) && router_skew >= 0.0f,
                 "model.router_skew = {}: must be a finite value >= 0 (0 = off)", router_skew);
  validate_route_groups();
  validate_overflow_and_balance();
}

void MoeConfig::validate_overflow_and_balance() const {
  if (overflow == Overflow::Reroute) {
    MOETRAIN_CHECK(is_token_choice(router),
                   "model.overflow = reroute: rerouting moves token-choice assignments over an "
                   "expert's capacity; model.router = expert_choice lets every expert pick its "
                   "tokens and never overflows (set model.overflow = drop)");
    MOETRAIN_CHECK(capacity_factor != 0.0f,
                   "model.overflow = reroute needs a capacity (model.capacity_factor > 0 fixed or "
                   "< 0 agreed); model.capacity_factor = 0 is dropless and nothing overflows (set "
                   "model.overflow = drop)");
  }
  if (balance_loss == BalanceLoss::Variance)
    MOETRAIN_CHECK(has_balance_loss(router),
                   "model.balance_loss = variance: only model.router = topk_softmax or noisy_topk "
                   "has a balancing loss; {} is balanced {} (set model.balance_loss = switch)",
                   router_kind_name(router),
                   router == RouterKind::ExpertChoice ? "by construction" : "by its bias");
}

void MoeConfig::validate_route_groups() const {
  MOETRAIN_CHECK(route_groups >= 0, "model.route_groups = {}: must be >= 0 (0 or 1 = off)",
                 route_groups);
  if (!group_limited()) return;
  MOETRAIN_CHECK(is_token_choice(router),
                 "model.route_groups = {}: group-limited routing needs a token-choice router; "
                 "model.router = expert_choice lets experts pick tokens (set route_groups = 0)",
                 route_groups);
  MOETRAIN_CHECK(E % route_groups == 0,
                 "model.route_groups = {}: must divide model.n_experts = {} (the groups are equal "
                 "and contiguous)",
                 route_groups, E);
  MOETRAIN_CHECK(route_group_topk >= 1 && route_group_topk <= route_groups,
                 "model.route_group_topk = {}: must be in [1, model.route_groups = {}]",
                 route_group_topk, route_groups);
  MOETRAIN_CHECK(route_group_topk * (E / route_groups) >= K,
                 "model.route_group_topk = {}: the kept groups hold {} · {} = {} experts, fewer "
                 "than model.top_k = {}",
                 route_group_topk, route_group_topk, E / route_groups,
                 route_group_topk * (E / route_groups), K);
}

MoeParamSizes moe_param_sizes(const MoeConfig& cfg) {
  cfg.validate();
  MoeParamSizes s;
  s.gate = cfg.E * cfg.C;
  s.noise = cfg.router == RouterKind::NoisyTopK ? cfg.E * cfg.C : 0;
  s.w1 = s.w3 = s.w2 = cfg.E * cfg.F * cfg.C;
  s.shared_w1 = s.shared_w3 = s.shared_w2 = cfg.shared_F * cfg.C;
  return s;
}

MoeWeights moe_weights_from_buffer(const MoeConfig& cfg, float* base) {
  MoeParamSizes s = moe_param_sizes(cfg);
  MOETRAIN_CHECK(base != nullptr || s.total() == 0,
                 "moe_weights_from_buffer: null buffer for {} floats", s.total());
  MoeWeights w;
  float* p = base;
  auto take = [&p](int64_t n) {
    float* q = n > 0 ? p : nullptr;
    p += n;
    return q;
  };
  w.gate = take(s.gate);
  w.noise = take(s.noise);
  w.w1 = take(s.w1);
  w.w3 = take(s.w3);
  w.w2 = take(s.w2);
  w.shared_w1 = take(s.shared_w1);
  w.shared_w3 = take(s.shared_w3);
  w.shared_w2 = take(s.shared_w2);
  return w;
}

int64_t expert_capacity(int64_t N, int64_t K, int64_t E, float capacity_factor) {
  MOETRAIN_CHECK(N >= 0 && K >= 1 && E >= 1,
                 "expert_capacity: N={} K={} E={} (need N >= 0, K >= 1, E >= 1)", N, K, E);
  MOETRAIN_CHECK(std::isfinite(capacity_factor) && capacity_factor >= 0.0f,
                 "expert_capacity: capacity_factor {} must be finite and >= 0", capacity_factor);
  // For N·K < 2^29, N·K·cf is exact in double (a 24-bit mantissa times an int), so the one rounding
  // in the division keeps an integral quotient integral and ceil never overshoots.
  double c = std::ceil(static_cast<double>(N * K) * static_cast<double>(capacity_factor) /
                       static_cast<double>(E));
  if (c > static_cast<double>(N)) return N;
  return static_cast<int64_t>(c);
}

}  // namespace moetrain
