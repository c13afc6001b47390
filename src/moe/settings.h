// The MoE settings of a model's configuration (the model.* MoE keys, [balance], [gating]): each
// parsed into its type when the configuration loads, validated once, here, with messages that
// name the key.
#pragma once
#include <cstdint>
#include <string>

#include "moe/capacity_controller.h"
#include "moe/config.h"
#include "moe/gating_controller.h"

namespace moetrain {

enum class CapacityMode { Fixed, Dynamic };

// The model.* keys' parsers for the configuration schema (model.router_controller's is
// parse_router_controller, moe/gating_controller.h): an Error names the key, the value and the
// allowed names. And each value's name, as configs and JSON write it.
RouterKind parse_router_setting(const std::string& name);
CapacityMode parse_capacity_mode(const std::string& name);
Overflow parse_overflow(const std::string& name);
BalanceLoss parse_balance_loss(const std::string& name);
const char* capacity_mode_name(CapacityMode m);
const char* router_controller_name(RouterControllerKind k);

// The MoE keys every model's config has (model.n_experts, model.router, ...), typed and validated
// here, once: the language model's and the classifier's configs derive from it, the step engine
// takes it whole, and each MoE layer runs with the MoeConfig it gives (moe_config).
struct MoeModelConfig {
  int64_t expert_hidden = 256;  // F: each expert's SwiGLU hidden size (HF intermediate_size)
  int64_t n_experts = 8;        // E
  int64_t top_k = 2;            // K
  RouterKind router = RouterKind::TopKSoftmax;
  bool renormalize = true;
  double capacity_factor = 0.0;  // > 0 fixed, 0 = dropless, < 0 min(|cf|, needed)
  // fixed: capacity_factor as set; dynamic: the controller of [balance] moves its magnitude each
  // step (capacity_factor must then be non-zero: its sign keeps the mode).
  CapacityMode capacity = CapacityMode::Fixed;
  CapacityControlConfig balance;  // [balance]: the dynamic capacity controller
  // drop or reroute the assignments over a token-choice capacity (needs capacity_factor ≠ 0)
  Overflow overflow = Overflow::Drop;
  // switch or variance, weighted by aux_loss_coef (topk_softmax and noisy_topk)
  BalanceLoss balance_loss = BalanceLoss::Switch;
  double aux_loss_coef = 1e-2;
  double z_loss_coef = 1e-3;
  double bias_update_rate = 1e-3;
  // none: sigmoid_bias moves its bias by the sign rule; rl: the gating controller of [gating]
  // moves it (needs model.router = sigmoid_bias).
  RouterControllerKind router_controller = RouterControllerKind::None;
  GatingControlConfig gating;        // [gating]
  int64_t shared_expert_hidden = 0;  // 0 = no shared expert
  int64_t route_groups = 1;          // G expert groups for group-limited routing, ≥ 1 (1 = off)
  int64_t route_group_topk = 0;      // M groups each token may route to
  double router_skew = 0.0;          // Zipf skew of the routing (MoeConfig::router_skew), 0 = off

  // The layer configuration of an MoE block over model dimension `dim`.
  MoeConfig moe_config(int64_t dim) const;
  // Throws naming the key ("model.top_k = 9: must be in [1, model.n_experts = 8]").
  void validate_moe() const;
};

}  // namespace moetrain
