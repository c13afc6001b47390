#include "model/config.h"

#include <cmath>

#include <nlohmann/json.hpp>

#include "core/check.h"

namespace moetrain {

int64_t ModelConfig::n_moe_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < n_layers; ++l) n += !is_dense_layer(l);
  return n;
}

MoeConfig MoeModelConfig::moe_config(int64_t dim) const {
  MoeConfig m;
  m.C = dim;
  m.F = expert_hidden;
  m.E = n_experts;
  m.K = top_k;
  m.router = parse_router_kind(router);
  m.renormalize = renormalize;
  m.capacity_factor = static_cast<float>(capacity_factor);
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
  MOETRAIN_CHECK(capacity_factor >= 0 || router != "expert_choice",
                 "model.capacity_factor = {}: must be ≥ 0 with model.router = expert_choice",
                 capacity_factor);
  MOETRAIN_CHECK(capacity == "fixed" || capacity == "dynamic",
                 "model.capacity = '{}': allowed are fixed, dynamic", capacity);
  balance.validate();
  if (capacity == "dynamic") {
    MOETRAIN_CHECK(capacity_factor != 0,
                   "model.capacity = dynamic needs model.capacity_factor ≠ 0 (the starting "
                   "factor; < 0 for min(|cf|, the load needed)), not the dropless 0");
    MOETRAIN_CHECK(router != "expert_choice",
                   "model.capacity = dynamic needs a token-choice model.router, not expert_choice");
  }
  if (parse_router_controller(router_controller) == RouterControllerKind::Rl)
    MOETRAIN_CHECK(router == "sigmoid_bias",
                   "model.router_controller = rl needs model.router = sigmoid_bias (the controller "
                   "moves its selection bias), not {}",
                   router);
  gating.validate();
  MOETRAIN_CHECK(aux_loss_coef >= 0, "model.aux_loss_coef = {}: must be ≥ 0", aux_loss_coef);
  MOETRAIN_CHECK(z_loss_coef >= 0, "model.z_loss_coef = {}: must be ≥ 0", z_loss_coef);
  MOETRAIN_CHECK(bias_update_rate >= 0, "model.bias_update_rate = {}: must be ≥ 0",
                 bias_update_rate);
  MOETRAIN_CHECK(std::isfinite(router_skew) && router_skew >= 0,
                 "model.router_skew = {}: must be a finite value >= 0 (0 = off)", router_skew);
  MOETRAIN_CHECK(shared_expert_hidden >= 0,
                 "model.shared_expert_hidden = {}: must be ≥ 0 (0 = none)", shared_expert_hidden);
  MoeConfig m;
  try {
    m = moe_config(1);  // rejects unknown router names, listing the allowed ones
  } catch (const Error& e) {
    MOETRAIN_FAIL("model.router = '{}': {}", router, e.what());
  }
  m.validate_route_groups();  // its messages name the model.route_* keys
  try {
    m.validate();
  } catch (const Error& e) {
    MOETRAIN_FAIL("model.router = '{}': {}", router, e.what());
  }
}

void ModelConfig::validate() const {
  auto positive = [](const char* key, int64_t v) {
    MOETRAIN_CHECK(v > 0, "model.{} = {}: must be a positive integer", key, v);
  };
  positive("vocab_size", vocab_size);
  positive("dim", dim);
  positive("n_layers", n_layers);
  positive("n_heads", n_heads);
  positive("n_kv_heads", n_kv_heads);
  positive("max_seq_len", max_seq_len);
  MOETRAIN_CHECK(vocab_size <= 65536,
                 "model.vocab_size = {}: token shards store uint16, so at most 65536", vocab_size);
  MOETRAIN_CHECK(dim % n_heads == 0, "model.n_heads = {}: must divide model.dim = {}", n_heads,
                 dim);
  MOETRAIN_CHECK(n_heads % n_kv_heads == 0, "model.n_kv_heads = {}: must divide model.n_heads = {}",
                 n_kv_heads, n_heads);
  MOETRAIN_CHECK(head_dim() % 2 == 0,
                 "model.dim / model.n_heads = {}: the head size must be even for RoPE", head_dim());
  MOETRAIN_CHECK(dense_every >= 0, "model.dense_every = {}: must be ≥ 0 (0 = every layer is MoE)",
                 dense_every);
  MOETRAIN_CHECK(dense_hidden >= 0, "model.dense_hidden = {}: must be ≥ 0", dense_hidden);
  MOETRAIN_CHECK(rope_theta > 0, "model.rope_theta = {}: must be positive", rope_theta);
  MOETRAIN_CHECK(norm_eps > 0, "model.norm_eps = {}: must be positive", norm_eps);
  MOETRAIN_CHECK(init_std > 0, "model.init_std = {}: must be positive", init_std);
  validate_moe();
}

bool ModelConfig::hf_mixtral_compatible(std::string* why) const {
  auto no = [why](const char* reason) {
    if (why) *why = reason;
    return false;
  };
  if (router != "topk_softmax")
    return no("only the topk_softmax router exists in transformers' Mixtral");
  if (!renormalize) return no("Mixtral always renormalises the top-k weights");
  if (shared_expert_hidden > 0) return no("Mixtral has no shared experts");
  if (dense_every > 0) return no("Mixtral has no dense layers");
  if (capacity_factor > 0) return no("Mixtral does not drop tokens (capacity_factor must be 0)");
  if (route_groups > 1) return no("Mixtral has no group-limited routing (route_groups must be 0)");
  if (router_skew != 0) return no("Mixtral has no router skew (router_skew must be 0)");
  return true;
}

}  // namespace moetrain

namespace moetrain {

nlohmann::json ModelConfig::to_hf_json() const {
  return {
      {"architectures", {"MixtralForCausalLM"}},
      {"model_type", "mixtral"},
      {"vocab_size", vocab_size},
      {"hidden_size", dim},
      {"intermediate_size", expert_hidden},
      {"num_hidden_layers", n_layers},
      {"num_attention_heads", n_heads},
      {"num_key_value_heads", n_kv_heads},
      {"head_dim", head_dim()},
      {"hidden_act", "silu"},
      {"max_position_embeddings", max_seq_len},
      {"initializer_range", init_std},
      {"rms_norm_eps", norm_eps},
      {"use_cache", true},
      {"rope_theta", rope_theta},
      {"sliding_window", nullptr},
      {"attention_dropout", 0.0},
      {"num_experts_per_tok", top_k},
      {"num_local_experts", n_experts},
      {"output_router_logits", false},
      {"router_aux_loss_coef", aux_loss_coef},
      {"router_jitter_noise", 0.0},
      {"tie_word_embeddings", false},
      {"torch_dtype", "float32"},
      {"bos_token_id", nullptr},
      {"eos_token_id", nullptr},
  };
}

}  // namespace moetrain
